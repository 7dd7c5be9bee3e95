"""The SSD write policy and daily write budget (``kvstore.write_policy``), on real stores.

Every test writes through a real ``KVStore`` (writer thread, LMDB index, pack files) and
reads what reached the disk back from a fresh store or the ``kvstore`` command line.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvstore import KVStore
from kvstore.bytes_written import count, written
from tests.support.caches import ident, rand_tokens, synth
from tests.system.test_cli import cli

pytest_plugins = ("tests.support.redis_servers",)

C = 4  # chunk tokens: a prefix of one chunk is 4 tokens
ID = ident("write-policy")


def on_disk(d: Path) -> set[tuple[int, ...]]:
    """Token lists of the entries stored in ``d``."""
    from kvstore.keys import decode_tokens

    with KVStore(d, chunk_tokens=C) as s:
        keys = s.disk.index.view(lambda r: list(r.keys_from("entries", b"")))
        return {tuple(decode_tokens(bytes(s.disk.index.tokens(k)))) for k in keys}


def put(store: KVStore, tokens: list[int], cache_type: str = "assistant") -> None:
    store.insert(ID, tokens, synth(tokens), cache_type=cache_type)
    store.flush()


def test_system_writes_system_segments_only(tmp_path: Path) -> None:
    system, chat = rand_tokens(10, 1), rand_tokens(10, 1) + rand_tokens(7, 2)
    with KVStore(tmp_path, chunk_tokens=C, persist="system") as s:
        put(s, system, "system")
        put(s, chat)
        st = s.stats()
    assert st["writes"] == 1 and st["writes_skipped_policy"] == 1 and st["persist_policy"] == "system", st
    assert on_disk(tmp_path) == {tuple(system)}
    with KVStore(tmp_path, chunk_tokens=C) as s:  # a restart keeps the system prompt
        got = s.fetch(ID, chat)
    assert (got.source, got.n) == ("disk", len(system))


def test_system_admits_a_pinned_entry(tmp_path: Path) -> None:
    from kvstore.segments import host_views
    from kvstore.codec import encode_cache
    from kvstore.disk import PersistJob
    from kvstore.keys import encode_tokens, key_of, root_key
    from kvstore.query import Query
    from kvstore.write_policy import WritePolicy

    toks = rand_tokens(9, 3)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        put(s, toks)
        disk = s.disk
        key = key_of(root_key(ID.digest), encode_tokens(toks), C)
        tensors, layout = encode_cache(synth(toks))
        job = PersistJob(ID, Query(encode_tokens(toks), ID.digest, C), host_views(tensors), layout)
        assert job.query.key == key
        policy = WritePolicy("system", None)
        assert policy.admit(disk, job) == "policy"
        disk.index.transact(lambda t: t.set_entry(key, t.entry(key).pinned_as(True)))
        assert policy.admit(disk, job) is job


def test_reused_writes_a_prefix_seen_a_second_time(tmp_path: Path) -> None:
    one_shot, turn1 = rand_tokens(9, 4), rand_tokens(9, 5)
    turn2 = turn1 + rand_tokens(6, 6)
    with KVStore(tmp_path, chunk_tokens=C, persist="reused") as s:
        put(s, one_shot)
        put(s, turn1)
        assert s.stats()["writes"] == 0
        put(s, turn2)  # extends turn 1: its two whole chunks come a second time, and only they
        put(s, one_shot)  # the same prompt again: all of it
        st = s.stats()
    assert st["writes"] == 2 and st["writes_skipped_policy"] == 2, st
    assert on_disk(tmp_path) == {tuple(one_shot), tuple(turn1[:8])}
    with KVStore(tmp_path, chunk_tokens=C, persist="reused") as s:  # a restart: the reused prefix is there
        got = s.fetch(ID, turn2)
        assert (got.source, got.n) == ("disk", 8)
        turn3 = turn2 + rand_tokens(5, 7)
        put(s, turn3)  # its first chunks are on disk: that prefix is written (it is already: nothing new)
        put(s, turn3 + rand_tokens(3, 8))  # turn 3's five chunks come back: all of turn 3
        put(s, rand_tokens(9, 9))
        st = s.stats()
    assert st["writes_skipped_policy"] == 1 and st["bytes_written"] > 0, st
    assert on_disk(tmp_path) == {tuple(one_shot), tuple(turn1[:8]), tuple(turn3)}


def test_reused_writes_a_cache_it_cannot_cut_whole(tmp_path: Path) -> None:
    turn1 = rand_tokens(9, 20)
    turn2 = turn1 + rand_tokens(6, 21)
    with KVStore(tmp_path, chunk_tokens=C, persist="reused") as s:
        for toks in (turn1, turn2):
            s.insert(ID, toks, synth(toks, snapshot=True))  # a recurrent layer: valid at its length only
            s.flush()
    assert on_disk(tmp_path) == {tuple(turn2)}


def test_daily_budget_stops_writes_across_restarts_and_resumes_next_day(tmp_path: Path) -> None:
    a, b, c = rand_tokens(9, 10), rand_tokens(9, 11), rand_tokens(9, 12)
    with KVStore(tmp_path, chunk_tokens=C, max_write_bytes_per_day=1) as s:
        put(s, a)  # under the budget when it starts: completes
        put(s, b)
        st = s.stats()
    assert st["writes"] == 1 and st["writes_skipped_budget"] == 1, st
    assert st["written_today_bytes"] == st["written_total_bytes"] == st["bytes_written"] > 0, st
    with KVStore(tmp_path, chunk_tokens=C, max_write_bytes_per_day=1) as s:  # a restart: still spent
        put(s, b)
        assert s.stats()["writes_skipped_budget"] == 1
    assert on_disk(tmp_path) == {tuple(a)}
    p = cli("stats", "--json", cache_dir=tmp_path)
    assert p.returncode == 0, p.stderr
    w = json.loads(p.stdout)["written"]
    assert w["today_bytes"] == w["total_bytes"] == st["bytes_written"], w
    assert "today" in cli("stats", cache_dir=tmp_path).stdout
    # the same count, dated yesterday: today's budget is untouched and writes resume
    with KVStore(tmp_path, chunk_tokens=C) as s:
        from kvstore.bytes_written import DAY_KEY

        s.disk.index.transact(lambda t: t.set_meta(DAY_KEY, b"2000-01-01 999999"))
        assert written(s.disk.index)[0] == 0
    with KVStore(tmp_path, chunk_tokens=C, max_write_bytes_per_day=1) as s:
        put(s, c)
        assert s.stats()["writes"] == 1
    assert on_disk(tmp_path) == {tuple(a), tuple(c)}


def test_written_counts_by_utc_day(tmp_path: Path) -> None:
    with KVStore(tmp_path, chunk_tokens=C) as s:
        now = time.time()
        s.disk.index.transact(lambda t: count(t, 100, now=now - 86400))
        assert written(s.disk.index, now=now - 86400) == (100, 100)
        s.disk.index.transact(lambda t: count(t, 5, now=now))
        assert written(s.disk.index, now=now) == (5, 105)


@pytest.mark.parametrize("bad", [{"persist": "some"}, {"max_write_bytes_per_day": -1}])
def test_bad_options_are_refused(tmp_path: Path, bad: dict) -> None:
    with pytest.raises(ValueError, match="persist|max_write_bytes_per_day"):
        KVStore(tmp_path, **bad)
    assert not tmp_path.joinpath("index").exists()  # refused before anything was created


# --------------------------------------------------------------------------- one door to the disk


@pytest.mark.parametrize("limits", [{"persist": "system"}, {"max_write_bytes_per_day": 0},
                                    {"max_disk_bytes": 1}])
def test_shared_hits_are_written_to_disk_only_as_the_limits_allow(tmp_path: Path, redis_server, limits) -> None:
    """A hit from the shared tier is filed on the local disk through the same door as any
    persist: the write policy, the daily budget and the disk budget all apply to it (they
    were skipped: 3 entries and 466 KB written past `--persist system`, a zero budget and
    `--max-disk-bytes 1`). The hit itself is still served, from the bytes received."""
    from kvstore.shared import SharedConfig

    shared = SharedConfig.from_url(redis_server.url)
    prompts = [rand_tokens(13, 40 + i) for i in range(3)]
    with KVStore(tmp_path / "a", chunk_tokens=C, shared=shared) as a:  # machine A publishes
        for toks in prompts:
            a.insert(ID, toks, synth(toks))
        assert a.flush(30)
        assert a.stats()["shared_published"] == 3, a.stats()
    with KVStore(tmp_path / "b", chunk_tokens=C, shared=shared, **limits) as b:
        for toks in prompts:
            got = b.fetch(ID, toks)
            assert got.n == len(toks) and got.source == "shared", got
        assert b.flush(30)
        st = b.stats()
    if "max_disk_bytes" in limits:
        assert st["evictions_disk"] >= 3, st  # filed, then evicted down to the budget
    else:
        assert st["writes_skipped_" + ("policy" if "persist" in limits else "budget")] == 3, st
    assert on_disk(tmp_path / "b") == set()
    if "max_disk_bytes" not in limits:
        with KVStore(tmp_path / "b", chunk_tokens=C) as b:
            assert written(b.disk.index) == (0, 0)


def test_the_daily_budget_survives_the_clock_stepping_back_over_midnight(tmp_path: Path) -> None:
    """A count dated tomorrow by a clock that then steps back (NTP, a resumed VM) is still
    today's: the budget is not granted twice in one real day. A count dated further ahead
    (a clock that was wrong) starts from zero."""
    with KVStore(tmp_path, chunk_tokens=C) as s:
        now = time.time()
        s.disk.index.transact(lambda t: count(t, 100, now=now + 86400))  # written just after midnight
        assert written(s.disk.index, now=now)[0] == 100  # the clock stepped back: still spent
        s.disk.index.transact(lambda t: count(t, 5, now=now))
        assert written(s.disk.index, now=now + 86400)[0] == 105  # one day's count, not two
        s.disk.index.transact(lambda t: count(t, 7, now=now + 3 * 86400))
        assert written(s.disk.index, now=now)[0] == 0  # dated far ahead: a wrong clock, counted afresh
        assert written(s.disk.index, now=now)[1] == 112
