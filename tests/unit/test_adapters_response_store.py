"""kvstore.adapters.response_store: stored responses are bounded, per tenant, and foreign
files are misses."""

from __future__ import annotations

import json
import os
from pathlib import Path


def stored(cache: Path) -> list[Path]:
    d = cache / "responses"
    return sorted(d.iterdir()) if d.is_dir() else []


def test_response_store_bounds_tenants_and_foreign_files(tmp_path: Path) -> None:
    from kvstore.adapters.response_store import ResponseStore, record_name

    store = ResponseStore(tmp_path, max_count=3, max_bytes=4000)
    for i in range(5):
        assert store.put(None, f"resp_{i}", {"response": {"n": i}})
        os.utime(tmp_path / "responses" / record_name(None, f"resp_{i}"), ns=(i * 10**9, i * 10**9))
    assert [store.get(None, f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert not store.put(None, "resp_big", {"response": "x" * 5000})  # larger than max_bytes alone
    assert store.put(None, "resp_mid", {"response": "y" * 2500})  # the count bound removes resp_2
    os.utime(tmp_path / "responses" / record_name(None, "resp_mid"), ns=(10 * 10**9, 10 * 10**9))
    assert store.get(None, "resp_mid") is not None and store.get(None, "resp_2") is None
    assert store.put(None, "resp_mid2", {"response": "z" * 2500})  # the bytes bound: all older ones go
    assert [p.name for p in stored(tmp_path)] == [record_name(None, "resp_mid2")]

    assert store.put("alice", "resp_a", {"response": 1})
    assert store.get("bob", "resp_a") is None and store.get(None, "resp_a") is None
    assert not store.delete("bob", "resp_a") and store.get("alice", "resp_a") == {"id": "resp_a", "response": 1}

    # a record under another id's name, a torn file, a symlink: misses, never followed or removed
    d = tmp_path / "responses"
    (d / record_name(None, "resp_x")).write_bytes((d / record_name("alice", "resp_a")).read_bytes())
    (d / record_name(None, "resp_torn")).write_bytes(b'{"id": "resp_torn", "resp')
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"id": "resp_link", "response": 2}))
    (d / record_name(None, "resp_link")).symlink_to(outside)
    assert store.get(None, "resp_x") is None and store.get(None, "resp_torn") is None
    assert store.get(None, "resp_link") is None and not store.delete(None, "resp_link")
    assert outside.exists()

    memory = ResponseStore(None, max_count=2)
    for i in range(3):
        memory.put(None, f"resp_{i}", {"response": i})
    assert memory.get(None, "resp_0") is None and memory.get(None, "resp_2") == {"id": "resp_2", "response": 2}


def test_any_response_id_names_one_record_file_and_an_unknown_one_is_a_miss(tmp_path: Path) -> None:
    """Property test (hypothesis; tests/conftest.py's profile): a response id is outside
    text (a URL path, a body's ``previous_response_id``, lone surrogates included): each
    (tenant, id) names one well-formed file, distinct ids never share one, and looking up
    one never stored is a miss, never an exception."""
    import re

    from hypothesis import given, strategies as st

    from kvstore.adapters.response_store import ResponseStore, record_name

    ids = st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"]) | st.sampled_from("/.\\\0"),
                  max_size=80)
    salts = st.none() | st.text(min_size=1, max_size=8) | st.binary(min_size=1, max_size=8)
    stores = (ResponseStore(None), ResponseStore(tmp_path))

    @given(ids, ids, salts)
    def check(a: str, b: str, salt) -> None:
        name = record_name(salt, a)
        assert re.fullmatch(r"[0-9a-f]{32}\.json", name) and name == record_name(salt, a)
        assert (name == record_name(salt, b)) == (a == b)
        assert salt is None or name != record_name(None, a)
        for store in stores:
            assert store.get(salt, a) is None and store.delete(salt, a) is False

    check()
