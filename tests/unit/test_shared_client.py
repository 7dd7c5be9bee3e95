"""kvstore.shared.client: bad arguments are refused before any I/O (the client against real
Redis servers: tests/system/test_shared_client.py)."""

from __future__ import annotations

import pytest

from kvstore.shared import SharedClient


def test_bad_arguments_raise_value_error_without_io() -> None:
    c = SharedClient("redis://127.0.0.1:1/0")  # nothing listens on port 1
    k = c.key("x", tag="t")
    for call in (lambda: c.pipeline_get(k),  # one string, not a list of keys
                 lambda: c.pipeline_get([b"bytes"]),  # type: ignore[list-item]
                 lambda: c.set_many({k: None}),  # type: ignore[arg-type]
                 lambda: c.set_many([(k, b"v", 1)]),  # type: ignore[list-item]
                 lambda: c.set_many({k: b"v"}, ttl=-1),
                 lambda: c.set_many({c.key("a", tag="t1"): b"", c.key("b", tag="t2"): b""},
                                    atomic=True),
                 lambda: c.hset(k, {}),
                 lambda: c.scan_iter("elsewhere:*")):
        with pytest.raises(ValueError):
            call()
    assert c.stats()["calls"] == 0 and c.stats()["errors"] == 0
