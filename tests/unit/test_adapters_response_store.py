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


def test_in_memory_records_are_bounded_by_bytes_oldest_first() -> None:
    """Issue 52.14: the in-memory store (no cache directory) ignoring ``max_bytes`` passed
    every test. Records of ~1 kB under a 3,500-byte bound and a count bound it never reaches:
    after every put the records still readable fit the bound, the newest are the ones kept,
    and one larger than the bound alone is refused without dropping anything."""
    from kvstore.adapters.response_store import ResponseStore

    def size(response_id: str, record: dict) -> int:  # what the store holds of a record: its JSON
        return len(json.dumps({"id": response_id, **record}, separators=(",", ":")).encode())

    memory = ResponseStore(None, max_count=1000, max_bytes=3500)
    records = {f"resp_{i}": {"response": str(i % 10) * 1000} for i in range(12)}
    for n, (rid, record) in enumerate(records.items()):
        assert memory.put(None, rid, record)
        held = [r for r in records if memory.get(None, r) is not None]
        assert sum(size(r, records[r]) for r in held) <= 3500, (rid, held)
        assert held == list(records)[max(0, n + 1 - 3): n + 1], (rid, held)  # 3 fit; the oldest went
    assert not memory.put(None, "resp_huge", {"response": "h" * 4000})
    assert memory.get(None, "resp_huge") is None
    assert [r for r in records if memory.get(None, r) is not None] == ["resp_9", "resp_10", "resp_11"]
