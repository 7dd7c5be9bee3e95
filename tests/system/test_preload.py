"""``KVStore.preload``: a restarted store's memory tier filled from disk before traffic.

Real stores on real LMDB directories and pack files; synthetic caches whose every position
is known (``tests.support.caches.synth``), so a preloaded entry's content is checked exactly. Pins,
hits and last use are set on the records as ``kvstore pin`` and the writer's touches do.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import tests.support.stores as U
from tests.support.caches import assert_synth, ident, rand_tokens, synth

from kvstore import KVStore
from kvstore.keys import encode_tokens, key_of, root_key
from kvstore.preload import preload_order
from kvstore.store import MIN_DISK_GAIN

C = U.CHUNK
WHO = ident("preload")


def entry_key(store: KVStore, tokens: list[int]) -> bytes:
    return key_of(root_key(WHO.digest), encode_tokens(tokens), store.disk.chunk)


def set_record(store: KVStore, tokens: list[int], **fields) -> None:
    """Change an entry's record in place (pinned=, hits=, last_used=), as `kvstore pin` and
    the writer's touches do."""
    key = entry_key(store, tokens)
    store.disk.index.transact(lambda t: t.set_entry(key, replace(t.entry(key), **fields)))


def make_store(path: Path, entries: dict[str, tuple[list[int], dict]], **types: str) -> None:
    """A cache directory holding ``entries`` (name -> (tokens, record fields)), written and
    closed (the next store opened on it starts with an empty memory tier)."""
    with KVStore(path, chunk_tokens=C, queue_size=64) as s:
        for name, (tokens, _) in entries.items():
            s.insert(WHO, tokens, synth(tokens), cache_type=types.get(name, "assistant"))
        assert s.flush(60)
        for tokens, fields in entries.values():
            if fields:
                set_record(s, tokens, **fields)


def held(store: KVStore) -> list[int]:
    """Lengths of the entries in memory, least recently used first, by LRU list."""
    store.settle()  # the memory tier as a lookup sees it (inserts filed)
    return [len(t) for lru in store.memory._lrus.values() for _, t in lru]


# four unrelated prompts: A pinned, B most valuable by hits x tokens, C newest, D oldest
A, B, Cc, D = (rand_tokens(n, seed=s) for n, s in ((100, 1), (150, 2), (200, 3), (120, 4)))
ENTRIES = {"A": (A, {"pinned": True}), "B": (B, {"hits": 3, "last_used": 2e9}),
           "C": (Cc, {"last_used": 3e9}), "D": (D, {"last_used": 1e9})}
ORDER = [A, B, Cc, D]  # pinned; (1+3) x 150 = 600; 200 (newest of the 1 x n); 120


def test_order_is_pinned_then_value_then_recency(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    with KVStore(tmp_path) as s:
        from kvstore.index import scan
        entries = scan(s.disk.index, full=False).entries
        keys = [entry_key(s, t) for t in ORDER]
        assert [k for k, _ in preload_order(entries, WHO.digest, "auto")] == keys
        assert [k for k, _ in preload_order(entries, WHO.digest, "pinned")] == keys[:1]
        assert [k for k, _ in preload_order(entries, WHO.digest, 2)] == keys[:2]
        assert preload_order(entries, ident("other").digest, "auto") == []
        with pytest.raises(ValueError, match="preload must be"):
            preload_order(entries, WHO.digest, "all")


def test_auto_fills_memory_up_to_max_entries(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    with KVStore(tmp_path, max_entries=3) as s:
        seen = []
        r = s.preload(WHO, "auto", progress=lambda done, total: seen.append((done, total)))
        assert (r.entries, r.candidates, r.stopped, r.skipped) == (3, 4, "budget", 0)
        assert r.tokens == 100 + 150 + 200 and r.nbytes == s.memory.nbytes > 0
        assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]
        # the most valuable is the last to go: filed least recently used in reverse order
        assert held(s) == [200, 150, 100]
        st = s.stats()
        assert (st["preloaded_entries"], st["preloaded_tokens"], st["memory_entries"]) == (3, 450, 3)
        assert st["hits_disk"] == st["restores"] == 0
        for t in (A, B, Cc):  # each is a memory hit with exactly its stored content
            got = s.fetch(WHO, t + [7])
            assert (got.source, got.n) == ("memory", len(t))
            assert_synth(got.cache, t)
        assert s.fetch(WHO, D).source == "disk"


def test_byte_budget_stops_at_the_first_entry_that_does_not_fit(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    with KVStore(tmp_path) as s:
        r = s.preload(WHO, "auto")
        per_token = r.nbytes // r.tokens  # synthetic caches: the same bytes per token
    with KVStore(tmp_path, max_bytes=(100 + 150) * per_token + 10) as s:
        r = s.preload(WHO, "auto")
        assert (r.entries, r.stopped) == (2, "budget") and held(s) == [150, 100]
    with KVStore(tmp_path) as s:  # --prompt-cache-bytes: a budget given to preload itself
        r = s.preload(WHO, "auto", max_bytes=100 * per_token)
        assert (r.entries, r.stopped) == (1, "budget") and held(s) == [100]


def test_pinned_and_n(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    with KVStore(tmp_path) as s:
        r = s.preload(WHO, "pinned")
        assert (r.entries, r.candidates, r.stopped) == (1, 1, "done") and held(s) == [100]
    with KVStore(tmp_path) as s:
        assert s.preload(WHO, 2).entries == 2 and held(s) == [150, 100]
    with KVStore(tmp_path) as s:
        r = s.preload(ident("unknown model"), "auto")
        assert (r.entries, r.stopped) == (0, "nothing stored") and len(s.memory) == 0


def test_preload_never_evicts_a_live_entry(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    live = rand_tokens(90, seed=50)
    with KVStore(tmp_path, max_entries=2) as s:
        s.insert(WHO, live, synth(live))
        r = s.preload(WHO, "auto")
        assert (r.entries, r.stopped) == (1, "budget")
        assert s.memory.get(WHO.digest, live) is not None and held(s) == [100, 90]
        # a live insert wins: the preloaded entry is the first to go
        new = rand_tokens(70, seed=51)
        s.insert(WHO, new, synth(new))
        assert held(s) == [90, 70]
    with KVStore(tmp_path, max_entries=1) as s:
        s.insert(WHO, live, synth(live))
        assert s.preload(WHO, "auto").entries == 0 and held(s) == [90]


def test_an_entry_that_would_drop_a_held_prefix_is_skipped(tmp_path: Path) -> None:
    """A trimmable insert drops the stored prefixes it covers (mlx-lm's rule): preloading
    a conversation must not drop the system prompt live traffic (or a pin) put there."""
    system = rand_tokens(130, seed=60)
    chat = system + rand_tokens(40, seed=61)
    make_store(tmp_path, {"system": (system, {"pinned": True}), "chat": (chat, {"hits": 9})}, system="system")
    with KVStore(tmp_path) as s:
        r = s.preload(WHO, "auto")
        assert (r.entries, r.skipped, r.stopped) == (1, 1, "done") and held(s) == [130]
        assert s.memory.get(WHO.digest, system).cache_type == "system"
        assert s.preload(WHO, "auto").skipped == 2  # both held or covered now: nothing changes
        assert held(s) == [130]


def test_a_preloaded_hit_credits_the_entry_and_preload_itself_does_not(tmp_path: Path) -> None:
    make_store(tmp_path, {"A": (A, {"pinned": True})})
    with KVStore(tmp_path) as s:
        key = entry_key(s, A)
        before = s.disk.index.entry(key)
        s.preload(WHO, "pinned")
        assert s.flush(60)
        assert s.disk.index.entry(key) == before
        assert s.fetch(WHO, A + [1, 2]).source == "memory"
        assert s.flush(60)
        assert s.disk.index.entry(key).hits == before.hits + 1
        assert s.stats()["hits_memory"] == 1


def test_a_damaged_entry_is_skipped_and_dropped(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    with KVStore(tmp_path) as s:
        seg = U.entry_segments(s, B, WHO)[-1]
    U.damage_segment(seg, "flip")
    with KVStore(tmp_path) as s:
        r = s.preload(WHO, "auto")
        assert (r.entries, r.skipped) == (3, 1) and sorted(held(s)) == [100, 120, 200]
        assert s.stats()["corrupt"] == 1 and s.disk.index.entry(entry_key(s, B)) is None


def test_whole_chunk_entry_is_preloaded_whole(tmp_path: Path) -> None:
    tokens = rand_tokens(2 * C, seed=70)
    make_store(tmp_path, {"t": (tokens, {})})
    with KVStore(tmp_path) as s:
        assert s.preload(WHO, "auto").tokens == 2 * C
        assert_synth(s.fetch(WHO, tokens + [5]).cache, tokens)


def test_stop_ends_a_preload_between_entries(tmp_path: Path) -> None:
    make_store(tmp_path, ENTRIES)
    stop = threading.Event()
    with KVStore(tmp_path) as s:
        r = s.preload(WHO, "auto", stop=stop, progress=lambda done, total: done == 2 and stop.set())
        assert (r.entries, r.stopped) == (2, "stopped") and not r.running


def test_a_few_more_tokens_on_disk_do_not_beat_a_memory_hit(tmp_path: Path) -> None:
    """After a preload the memory holds the system prompt, while the disk holds the last
    conversations, which extend it by a user header's few tokens: restoring the whole
    prefix for those costs more than it saves. More than MIN_DISK_GAIN more tokens, or
    the whole query, still come from disk."""
    system = rand_tokens(150, seed=80)
    header = rand_tokens(MIN_DISK_GAIN, seed=81)
    longer = system + header + rand_tokens(60, seed=82)
    make_store(tmp_path, {"chat": (system + header + rand_tokens(30, seed=83), {}), "long": (longer, {})})
    with KVStore(tmp_path) as s:
        s.insert(WHO, system, synth(system))
        query = system + header + rand_tokens(20, seed=84)
        assert s.peek(WHO, query) == len(system)
        got = s.fetch(WHO, query)
        assert (got.source, got.n) == ("memory", len(system))
        query = longer[: len(system) + MIN_DISK_GAIN + 1] + [3]
        assert s.peek(WHO, query) == len(system) + MIN_DISK_GAIN + 1
        got = s.fetch(WHO, query)
        assert (got.source, got.n) == ("disk", len(system) + MIN_DISK_GAIN + 1)
        assert_synth(got.cache, query[:-1])


def _fetch_work(store: KVStore, tokens: list[int]) -> tuple[object, int, int]:
    """A fetch of ``tokens`` on this thread, and the work it did: Python calls (every
    thread), and segment reads from pack files (``segments._preadv``)."""
    import sys

    from kvstore import segments

    calls, reads, real = [0], [0], segments._preadv

    def preadv(*a):
        reads[0] += 1
        return real(*a)

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1

    segments._preadv = preadv
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        got = store.fetch(WHO, tokens)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        segments._preadv = real
    return got, calls[0], reads[0]


def test_the_first_hit_after_a_pinned_preload_costs_what_a_memory_hit_costs(tmp_path: Path) -> None:
    """Issue 56 (warm start): a restarted server's first request under its pinned system
    prompt must cost what a memory hit costs. A preloaded entry is kept as a restore built
    it (evaluated arrays, marked as on disk): its first hit reads no pack file and does no
    more Python than a hit on the same prefix inserted live (no conversion, copy or check
    left for first use). Counted, not timed."""
    make_store(tmp_path, ENTRIES)
    question = rand_tokens(40, seed=9)
    with KVStore(tmp_path) as s:
        s.fetch(WHO, rand_tokens(10, seed=10))  # the identity resolved, the index opened: as in a server
        assert s.preload(WHO, "pinned").entries == 1
        got, calls, reads = _fetch_work(s, A + question)
        assert (got.source, got.n, reads) == ("memory", len(A), 0)
        assert_synth(got.cache, A)
        assert s.stats()["hits_memory"] == 1
    with KVStore(tmp_path) as s:
        s.fetch(WHO, rand_tokens(10, seed=10))
        s.insert(WHO, A, synth(A), cache_type="system")
        s.settle()
        live, live_calls, _ = _fetch_work(s, A + question)
        assert (live.source, live.n) == ("memory", len(A))
    assert calls <= 1.1 * live_calls, f"a preloaded hit made {calls} Python calls, a live one {live_calls}"
