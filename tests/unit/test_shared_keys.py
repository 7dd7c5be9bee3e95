"""kvstore.shared.keys: every key carries one hash tag."""

from __future__ import annotations

import pytest

from kvstore.shared import key_slot, make_key


def test_keys_carry_one_hash_tag() -> None:
    assert make_key("kvstore", "blob", 7, tag="ab12") == "kvstore:{ab12}:blob:7"
    assert make_key("kvstore", "meta") == "kvstore:meta"
    # the slot depends on the tag alone
    assert key_slot("kvstore:{ab12}:blob:7") == key_slot("other:{ab12}:rec") == key_slot("ab12")
    for bad in ({"tag": "a{b"}, {"tag": ""}, {"tag": "a b"}):
        with pytest.raises(ValueError):
            make_key("kvstore", "x", **bad)
    with pytest.raises(ValueError):
        make_key("kvstore", "x}y")
    with pytest.raises(ValueError):
        make_key("kvstore")
