"""kvstore.serve.response_store: stored responses are bounded, per tenant, evicted by the
store's own sequence (never by the clock), refused writes say why, and foreign or malformed
files are counted misses."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def stored(cache: Path) -> list[Path]:
    d = cache / "responses"
    return sorted(d.iterdir()) if d.is_dir() else []


def response(response_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "output": [], **extra}


def test_response_store_bounds_tenants_and_foreign_files(tmp_path: Path) -> None:
    from kvstore.serve.response_store import NotStored, ResponseStore, record_name

    store = ResponseStore(tmp_path, max_count=3, max_bytes=4000)
    for i in range(5):
        store.put(None, f"resp_{i}", response(f"resp_{i}", n=i), CONVERSATION)
    assert [store.get(None, f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
    with pytest.raises(NotStored, match="more than the 4,000"):  # larger than max_bytes alone
        store.put(None, "resp_big", response("resp_big", text="x" * 5000), CONVERSATION)
    store.put(None, "resp_mid", response("resp_mid", text="y" * 2500), CONVERSATION)  # the count bound removes resp_2
    assert store.get(None, "resp_mid") is not None and store.get(None, "resp_2") is None
    store.put(None, "resp_mid2", response("resp_mid2", text="z" * 2500), CONVERSATION)  # bytes: all older ones go
    assert [p.name for p in stored(tmp_path)] == [record_name(None, "resp_mid2")]
    assert store.stats()["not_stored"] == 1 and store.stats()["evicted"] == 6

    store.put("alice", "resp_a", response("resp_a"), CONVERSATION)
    assert store.get("bob", "resp_a") is None and store.get(None, "resp_a") is None
    assert not store.delete("bob", "resp_a")
    got = store.get("alice", "resp_a")
    assert got is not None and got.response == response("resp_a") and got.conversation == CONVERSATION

    # a record under another id's name, a torn file, a symlink: counted misses, never followed or removed
    d = tmp_path / "responses"
    (d / record_name(None, "resp_x")).write_bytes((d / record_name("alice", "resp_a")).read_bytes())
    (d / record_name(None, "resp_torn")).write_bytes(b'{"id": "resp_torn", "resp')
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"id": "resp_link", "response": {"id": "resp_link"}, "conversation": []}))
    (d / record_name(None, "resp_link")).symlink_to(outside)
    assert store.get(None, "resp_x") is None and store.get(None, "resp_torn") is None
    assert store.get(None, "resp_link") is None and not store.delete(None, "resp_link")
    assert outside.exists()
    assert store.stats()["invalid_by_reason"] == {"other_id": 1, "not_json": 1, "not_regular": 2}
    assert store.get(None, "resp_never") is None and store.stats()["invalid_records"] == 4  # a plain miss: not counted

    memory = ResponseStore(None, max_count=2)
    for i in range(3):
        memory.put(None, f"resp_{i}", response(f"resp_{i}"), CONVERSATION)
    assert memory.get(None, "resp_0") is None
    assert memory.get(None, "resp_2") is not None and memory.get(None, "resp_2").seq == 2  # type: ignore[union-attr]


def test_eviction_follows_the_sequence_across_restarts_and_clock_steps(tmp_path: Path) -> None:
    """Records whose mtimes are an hour ahead (a clock stepped back) or behind, a restart
    between the writes, records of the previous version (no ``seq``): the newest stay, the
    lowest in the sequence go first, and the record just written is never the one removed."""
    from kvstore.serve.response_store import ResponseStore, record_name

    d = tmp_path / "responses"
    first = ResponseStore(tmp_path, max_count=5)
    for i in range(5):
        first.put(None, f"old_{i}", response(f"old_{i}"), CONVERSATION)
    # two records as the previous version wrote them: no seq
    for i in (0, 1):
        (d / record_name(None, f"legacy_{i}")).write_text(json.dumps(
            {"id": f"legacy_{i}", "response": response(f"legacy_{i}"), "conversation": CONVERSATION}))
    ahead = time.time() + 3600
    for p in stored(tmp_path):
        os.utime(p, (ahead, ahead))
    os.utime(d / record_name(None, "legacy_1"), (ahead + 1, ahead + 1))
    # the count bound is already passed (7 > 5): nothing is removed until a write
    again = ResponseStore(tmp_path, max_count=5)  # a restart: the sequence recovered from the records
    legacy = again.get(None, "legacy_0")
    assert legacy is not None and legacy.seq is None and legacy.conversation == CONVERSATION
    for i in range(3):
        again.put(None, f"new_{i}", response(f"new_{i}"), CONVERSATION)
        behind = time.time() - 3600 * (i + 1)  # and the clock stepped the other way for each new one
        os.utime(d / record_name(None, f"new_{i}"), (behind, behind))
    alive = {rid for rid in [*(f"old_{i}" for i in range(5)), "legacy_0", "legacy_1", *(f"new_{i}" for i in range(3))]
             if again.get(None, rid) is not None}
    assert alive == {"old_3", "old_4", "new_0", "new_1", "new_2"}, alive
    assert [again.get(None, f"new_{i}").seq for i in range(3)] == [5, 6, 7]  # type: ignore[union-attr]

    one = ResponseStore(tmp_path, max_count=1)
    one.put(None, "only", response("only"), CONVERSATION)  # everything else goes, never the record just stored
    assert [p.name for p in stored(tmp_path)] == [record_name(None, "only")]


def test_a_store_that_cannot_write_says_why(tmp_path: Path) -> None:
    from kvstore.serve.response_store import NotStored, ResponseStore

    (tmp_path / "responses").write_text("not a directory")
    store = ResponseStore(tmp_path)
    with pytest.raises(NotStored, match="could not be written"):
        store.put(None, "resp_1", response("resp_1"), CONVERSATION)
    with pytest.raises(NotStored, match="max-count is 0"):
        ResponseStore(tmp_path / "x", max_count=0).put(None, "resp_1", response("resp_1"), CONVERSATION)
    deep: Any = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(NotStored, match="could not be read back"):  # never stored only to be a later miss
        ResponseStore(None).put(None, "resp_1", response("resp_1", metadata={"x": deep}), CONVERSATION)
    assert store.stats()["not_stored"] == 1 and store.get(None, "resp_1") is None


MALFORMED: dict[str, bytes] = {
    "no_response": json.dumps({"id": "r", "conversation": []}).encode(),
    "no_conversation": json.dumps({"id": "r", "response": {"id": "r"}}).encode(),
    "conversation_a_string": json.dumps({"id": "r", "response": {"id": "r"}, "conversation": "hi"}).encode(),
    "message_without_role": json.dumps({"id": "r", "response": {"id": "r"}, "conversation": [{"content": "x"}]}).encode(),
    "tool_call_not_an_object": json.dumps({"id": "r", "response": {"id": "r"}, "conversation": [
        {"role": "assistant", "content": "", "tool_calls": ["x"]}]}).encode(),
    "seq_a_string": json.dumps({"seq": "1", "id": "r", "response": {"id": "r"}, "conversation": []}).encode(),
    "a_list": b"[1, 2]",
    "not_utf8": b"\xff\xfe{}",
    "deep": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_records_are_counted_misses(tmp_path: Path, name: str) -> None:
    from kvstore.serve.response_store import ResponseStore, record_name

    store = ResponseStore(tmp_path)
    store.put(None, "good", response("good"), CONVERSATION)
    (tmp_path / "responses" / record_name(None, "r")).write_bytes(MALFORMED[name])
    assert store.get(None, "r") is None and not store.delete(None, "r")
    assert store.stats()["invalid_records"] == 2, store.stats()
    store.put(None, "next", response("next"), CONVERSATION)  # the malformed file ranks lowest
    assert store.get(None, "good") is not None and store.get(None, "next") is not None


def test_concurrent_writers_get_distinct_numbers_and_the_bound_holds(tmp_path: Path) -> None:
    """8 threads writing 10 records each (some replaying an id) through one store: every
    number handed out once, ``max_count`` left, the last one written among them."""
    import threading

    from kvstore.serve.response_store import ResponseStore

    store = ResponseStore(tmp_path, max_count=20)

    def write(t: int) -> None:
        for i in range(10):
            rid = f"t{t}_{i % 7}"  # ids 0-2 written twice: a replay replaces the record
            store.put(None, rid, response(rid), CONVERSATION)

    threads = [threading.Thread(target=write, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    records = [store.get(None, f"t{t}_{i}") for t in range(8) for i in range(7)]
    kept = [r for r in records if r is not None]
    assert len(stored(tmp_path)) == len(kept) == 20
    assert sorted(r.seq for r in kept) == sorted({r.seq for r in kept}) and max(r.seq for r in kept) == 79  # type: ignore[type-var]


def test_in_memory_records_are_bounded_by_bytes_oldest_first() -> None:
    """Issue 52.14: the in-memory store (no cache directory) ignoring ``max_bytes`` passed
    every test. Records of ~1 kB under a 3,500-byte bound and a count bound it never reaches:
    after every put the records still readable fit the bound, the newest are the ones kept,
    and one larger than the bound alone is refused without dropping anything."""
    from kvstore.serve.response_record import Record
    from kvstore.serve.response_store import NotStored, ResponseStore

    def size(rid: str) -> int:  # what the store holds of a record: its bytes as written
        return len(Record(rid, records[rid], CONVERSATION, 0).to_bytes())

    def newest_that_fit(ids: list[str]) -> list[str]:
        kept: list[str] = []
        for r in reversed(ids):
            if sum(map(size, [r, *kept])) > 3500:
                break
            kept.insert(0, r)
        return kept

    memory = ResponseStore(None, max_count=1000, max_bytes=3500)
    records = {f"resp_{i}": response(f"resp_{i}", text=str(i % 10) * 1000) for i in range(12)}
    assert len(newest_that_fit(list(records))) >= 2  # the bound holds more than one record, fewer than all
    for n, (rid, record) in enumerate(records.items()):
        memory.put(None, rid, record, CONVERSATION)
        held = [r for r in records if memory.get(None, r) is not None]
        assert sum(size(r) for r in held) <= 3500, (rid, held)
        assert held == newest_that_fit(list(records)[: n + 1]), (rid, held)  # the oldest went first
    with pytest.raises(NotStored, match="more than the 3,500"):
        memory.put(None, "resp_huge", response("resp_huge", text="h" * 4000), CONVERSATION)
    assert memory.get(None, "resp_huge") is None
    assert [r for r in records if memory.get(None, r) is not None] == newest_that_fit(list(records))


def test_any_response_id_names_one_record_file_and_an_unknown_one_is_a_miss(tmp_path: Path) -> None:
    """Property test (hypothesis; tests/conftest.py's profile): a response id is outside
    text (a URL path, a body's ``previous_response_id``, lone surrogates included): each
    (tenant, id) names one well-formed file, distinct ids never share one, and looking up
    one never stored is a miss, never an exception."""
    import re

    from hypothesis import given, strategies as st

    from kvstore.serve.response_store import ResponseStore, record_name

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


# -- mutation gate (tools.gates.mutation): behaviour the tests above left open -----------


def sizes_of(*ids: str, seq: int = 0) -> list[int]:
    """The bytes a record of each id takes (on disk and in memory) at a one-digit ``seq``."""
    from kvstore.serve.response_record import Record

    return [len(Record(rid, response(rid), CONVERSATION, seq).to_bytes()) for rid in ids]


def test_record_names_are_stable_across_versions() -> None:
    """A record written by an earlier kvstore is found after an upgrade only if the name of
    (tenant, id) never changes: pinned values, a lone surrogate included."""
    from kvstore.serve.response_store import record_name

    assert record_name(None, "resp_1") == "4ec3ba9cef11952155de7e1817f9f6cc.json"
    assert record_name(b"k", "resp_1") == "7441512eec3418361207d41036d91ac4.json"
    assert record_name(None, "\ud800") == "c9c95e23579ae2bde8a33b6a8a184ce2.json"
    assert record_name(None, "\ud800") != record_name(None, "\ud801")


@pytest.mark.parametrize("on_disk", [True, False])
def test_delete_removes_only_that_tenants_record(tmp_path: Path, on_disk: bool) -> None:
    from kvstore.serve.response_store import ResponseStore, record_name

    store = ResponseStore(tmp_path if on_disk else None)
    store.put("alice", "resp_a", response("resp_a"), CONVERSATION)
    store.put("alice", "resp_b", response("resp_b"), CONVERSATION)
    store.put(None, "resp_a", response("resp_a"), CONVERSATION)
    assert not store.delete("bob", "resp_a")
    assert store.delete("alice", "resp_b") and store.get("alice", "resp_b") is None  # no unsalted resp_b
    store.put("alice", "resp_b", response("resp_b"), CONVERSATION)
    assert store.delete("alice", "resp_a")
    assert store.get("alice", "resp_a") is None and not store.delete("alice", "resp_a")
    assert store.get("alice", "resp_b") is not None and store.get(None, "resp_a") is not None
    if on_disk:
        assert [p.name for p in stored(tmp_path)] == sorted([record_name("alice", "resp_b"), record_name(None, "resp_a")])
        restarted = ResponseStore(tmp_path)  # a store that has not written yet deletes too
        assert restarted.delete(None, "resp_a") and restarted.get(None, "resp_a") is None
        assert [p.name for p in stored(tmp_path)] == [record_name("alice", "resp_b")]
    assert store.stats()["invalid_records"] == 0


def test_unlink_never_removes_what_is_not_a_regular_record(tmp_path: Path) -> None:
    from kvstore.serve.response_store import ResponseStore, record_name

    store = ResponseStore(tmp_path)
    store.put(None, "resp_1", response("resp_1"), CONVERSATION)
    d = tmp_path / "responses"
    link = d / record_name(None, "link")
    link.symlink_to(d / record_name(None, "resp_1"))
    assert not store._unlink(link.name) and link.is_symlink()
    assert not store._unlink(record_name(None, "missing"))


def test_the_bytes_bound_is_inclusive_and_evicts_as_few_as_it_must(tmp_path: Path) -> None:
    """A record of exactly ``max_bytes`` is stored and read; records summing to exactly the
    bound all stay; a write past it removes the oldest until it holds, no more."""
    from kvstore.serve.response_store import ResponseStore, record_name

    ids = [f"resp_{i}" for i in range(4)]
    sizes = sizes_of(*ids)
    assert len(set(sizes)) == 1
    (tmp_path / "exact").mkdir()
    exact = ResponseStore(tmp_path / "exact", max_bytes=sizes[0])
    exact.put(None, "resp_0", response("resp_0"), CONVERSATION)
    assert exact.get(None, "resp_0") is not None and exact.stats()["invalid_records"] == 0

    (tmp_path / "bound").mkdir()
    store = ResponseStore(tmp_path / "bound", max_bytes=3 * sizes[0])
    for rid in ids:
        store.put(None, rid, response(rid), CONVERSATION)
    assert [p.name for p in stored(tmp_path / "bound")] == sorted(record_name(None, r) for r in ids[1:])
    assert store.stats()["evicted"] == 1

    memory = ResponseStore(None, max_bytes=3 * sizes[0])
    for rid in ids:
        memory.put(None, rid, response(rid), CONVERSATION)
    assert [memory.get(None, r) is not None for r in ids] == [False, True, True, True]
    assert memory.stats()["evicted"] == 1


def test_a_large_record_evicts_several_small_ones_in_memory() -> None:
    from kvstore.serve.response_store import ResponseStore

    small = sizes_of("s_0")[0]
    memory = ResponseStore(None, max_bytes=4 * small + 100)
    for i in range(4):
        memory.put(None, f"s_{i}", response(f"s_{i}"), CONVERSATION)
    big = response("big", text="b" * (2 * small))  # about 3 small ones: three must go
    memory.put(None, "big", big, CONVERSATION)
    held = [r for r in ["s_0", "s_1", "s_2", "s_3", "big"] if memory.get(None, r) is not None]
    assert held == ["s_3", "big"] and memory.stats()["evicted"] == 3


def test_memory_count_bound_keeps_exactly_max_count_and_a_replay_is_the_newest() -> None:
    from kvstore.serve.response_store import ResponseStore

    memory = ResponseStore(None, max_count=2)
    for rid in ("a", "b"):
        memory.put(None, rid, response(rid), CONVERSATION)
    assert memory.get(None, "a") is not None and memory.get(None, "b") is not None
    memory.put(None, "a", response("a", n=2), CONVERSATION)  # a replay: now the newest
    memory.put(None, "c", response("c"), CONVERSATION)
    assert [memory.get(None, r) is not None for r in "abc"] == [True, False, True]
    assert memory.get(None, "a").response["n"] == 2  # type: ignore[union-attr]
    assert memory.stats()["evicted"] == 1

    one = ResponseStore(None, max_count=1)
    for rid in "xyz":
        one.put(None, rid, response(rid), CONVERSATION)
    assert [one.get(None, r) is not None for r in "xyz"] == [False, False, True]
    assert one.stats()["evicted"] == 2


def test_files_not_named_as_records_are_skipped_not_the_end_of_the_listing(tmp_path: Path) -> None:
    """Foreign files among the records (many, made last, so a listing meets them early):
    the sequence still recovers past every record and eviction still sees them all."""
    from kvstore.serve.response_store import ResponseStore, record_name

    first = ResponseStore(tmp_path)
    for i in range(5):
        first.put(None, f"r_{i}", response(f"r_{i}"), CONVERSATION)
    d = tmp_path / "responses"
    for i in range(40):
        (d / f"notes_{i}.txt").write_text("not a record")
    again = ResponseStore(tmp_path, max_count=3)
    again.put(None, "r_5", response("r_5"), CONVERSATION)
    assert again.get(None, "r_5").seq == 5  # type: ignore[union-attr]
    assert {p.name for p in stored(tmp_path) if p.suffix == ".json"} == {record_name(None, f"r_{i}") for i in (3, 4, 5)}
    assert len(stored(tmp_path)) == 43  # the foreign files are never removed


def test_an_empty_directory_starts_the_sequence_at_zero(tmp_path: Path) -> None:
    from kvstore.serve.response_store import ResponseStore

    (tmp_path / "responses").mkdir()
    store = ResponseStore(tmp_path)
    store.put(None, "r", response("r"), CONVERSATION)
    assert store.get(None, "r").seq == 0  # type: ignore[union-attr]


def test_a_record_is_ranked_again_when_it_changes_and_only_then(tmp_path: Path) -> None:
    """The eviction rank is read once per change of the file's (inode, size, mtime): a
    record rewritten (another size) is ranked by what it now says; one whose stat did not
    change is not read again."""
    from kvstore.serve.response_store import ResponseStore, record_name

    d = tmp_path / "responses"
    store = ResponseStore(tmp_path, max_count=3)
    for i in range(3):
        store.put(None, f"r_{i}", response(f"r_{i}"), CONVERSATION)
    store.put(None, "r_3", response("r_3"), CONVERSATION)  # ranks every file: r_0 goes
    assert not (d / record_name(None, "r_0")).exists()
    # r_2 rewritten in place to garbage of the same size, its mtime put back: same stat
    p2 = d / record_name(None, "r_2")
    st = p2.stat()
    with open(p2, "r+b") as f:
        f.write(b"x" * st.st_size)
    os.utime(p2, ns=(st.st_atime_ns, st.st_mtime_ns))
    # r_3 rewritten with another size: a legacy record (no seq) now, ranked below every seq
    p3 = d / record_name(None, "r_3")
    p3.write_text(json.dumps({"id": "r_3", "response": response("r_3"), "conversation": CONVERSATION}))
    store.put(None, "r_4", response("r_4"), CONVERSATION)
    names = {p.name for p in stored(tmp_path)}
    assert names == {record_name(None, r) for r in ("r_1", "r_2", "r_4")}, names


def test_a_record_of_another_writer_never_evicts_the_one_just_written(tmp_path: Path) -> None:
    """Two stores on one directory (two processes): the one that read the directory first
    hands out a low number; its write is still never the one removed."""
    from kvstore.serve.response_store import ResponseStore, record_name

    slow = ResponseStore(tmp_path, max_count=1)
    slow.put(None, "slow_0", response("slow_0"), CONVERSATION)  # seq 0; slow's next is 1
    fast = ResponseStore(tmp_path, max_count=100)
    for i in range(5):
        fast.put(None, f"fast_{i}", response(f"fast_{i}"), CONVERSATION)  # seq 1..5
    slow.put(None, "slow_1", response("slow_1"), CONVERSATION)  # seq 1 again: the lowest but one
    assert [p.name for p in stored(tmp_path)] == [record_name(None, "slow_1")]


def test_file_and_directory_modes_are_the_stores(tmp_path: Path) -> None:
    from kvstore import files
    from kvstore.serve.response_store import ResponseStore

    old = os.umask(0o022)
    try:
        store = ResponseStore(tmp_path, files.Modes(file=0o640, dir=0o750))
        store.put(None, "r", response("r"), CONVERSATION)
    finally:
        os.umask(old)
    assert (tmp_path / "responses").stat().st_mode & 0o7777 == 0o750
    assert [p.stat().st_mode & 0o7777 for p in stored(tmp_path)] == [0o640]


def test_records_larger_than_max_bytes_on_disk_are_too_large_misses(tmp_path: Path, caplog) -> None:
    from kvstore.serve.response_store import ResponseStore, record_name

    size = sizes_of("r")[0]
    store = ResponseStore(tmp_path, max_bytes=size)
    store.put(None, "r", response("r"), CONVERSATION)
    p = tmp_path / "responses" / record_name(None, "r")
    p.write_bytes(p.read_bytes() + b" ")  # still a valid record, one byte over the bound
    assert store.get(None, "r") is None
    assert store.stats()["invalid_by_reason"] == {"too_large": 1}
    assert f"kvstore: stored response r unusable (a miss): more than the {size:,} bytes the store keeps" in [
        r.getMessage() for r in caplog.records]


def test_misses_and_refusals_are_logged_saying_which_and_why(tmp_path: Path, caplog) -> None:
    from kvstore.serve.response_store import NotStored, ResponseStore, record_name

    store = ResponseStore(tmp_path, max_bytes=2000)
    store.put(None, "resp_a", response("resp_a"), CONVERSATION)
    d = tmp_path / "responses"
    (d / record_name(None, "resp_x")).write_bytes((d / record_name(None, "resp_a")).read_bytes())
    (d / record_name(None, "resp_l")).symlink_to(d / record_name(None, "resp_a"))
    assert store.get(None, "resp_x") is None and store.get(None, "resp_l") is None
    with pytest.raises(NotStored) as big:
        store.put(None, "resp_big", response("resp_big", text="x" * 3000), CONVERSATION)
    with pytest.raises(NotStored) as unmade:
        store.put(None, "resp_set", response("resp_set", tags={1, 2}), CONVERSATION)
    with pytest.raises(NotStored) as none:
        ResponseStore(None, max_count=0).put(None, "r", response("r"), CONVERSATION)
    n = sizes_of("resp_big")[0] + 3000 + len(',"text":""')
    assert str(big.value) == (f"the record is {n:,} bytes, more than the 2,000 the store keeps "
                              "(--responses-max-bytes)")
    assert str(unmade.value).startswith("the record could not be made: ") and "set" in str(unmade.value)
    assert str(none.value) == "--responses-max-count is 0: no response is kept"
    assert store.stats()["not_stored"] == 2
    messages = [r.getMessage() for r in caplog.records]
    assert "kvstore: stored response resp_x unusable (a miss): the record under this name is another id's" in messages
    link = [m for m in messages if m.startswith("kvstore: stored response resp_l unusable (a miss): ")]
    assert len(link) == 1 and record_name(None, "resp_l") in link[0] and "not kvstore's file" in link[0]
    assert f"kvstore: response resp_big not stored: {big.value}" in messages
    assert f"kvstore: response resp_set not stored: {unmade.value}" in messages


def test_running_out_of_descriptors_is_a_counted_miss_and_a_refusal_then_recovers(tmp_path: Path, caplog) -> None:
    """EMFILE (the process's limit, not the file): a read is an ``unreadable`` miss and a
    first write is refused saying the records could not be listed; once descriptors are
    free again both work, and the sequence continues past what is on disk."""
    import errno
    import resource

    from kvstore.serve.response_store import NotStored, ResponseStore

    ResponseStore(tmp_path).put(None, "r_0", response("r_0"), CONVERSATION)
    store = ResponseStore(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
    try:
        while True:
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        got = store.get(None, "r_0")
        with pytest.raises(NotStored) as listing:
            store.put(None, "r_1", response("r_1"), CONVERSATION)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got is None and store.stats()["invalid_by_reason"] == {"unreadable": 1}
    assert str(listing.value).startswith("the stored responses could not be listed: ")
    assert any(m.startswith("kvstore: stored response r_0 unusable (a miss): ") and "Too many open files" in m
               for m in (r.getMessage() for r in caplog.records))
    store.put(None, "r_1", response("r_1"), CONVERSATION)
    assert store.get(None, "r_0") is not None and store.get(None, "r_1").seq == 1  # type: ignore[union-attr]


def test_a_symlink_named_as_a_record_is_not_counted_against_the_bound(tmp_path: Path) -> None:
    """A symlink planted under a record's name (to a real record elsewhere) is never
    followed: not counted, not removed, and it makes no real record go."""
    from kvstore.serve.response_store import ResponseStore, record_name

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ResponseStore(elsewhere).put(None, "x", response("x"), CONVERSATION)
    store = ResponseStore(tmp_path, max_count=3)
    for i in range(3):
        store.put(None, f"r_{i}", response(f"r_{i}"), CONVERSATION)
    link = tmp_path / "responses" / record_name(None, "x")
    link.symlink_to(elsewhere / "responses" / record_name(None, "x"))
    store.put(None, "r_3", response("r_3"), CONVERSATION)
    assert [store.get(None, f"r_{i}") is not None for i in range(4)] == [False, True, True, True]
    assert link.is_symlink() and store.stats()["evicted"] == 1
