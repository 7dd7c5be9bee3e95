"""kvstore.callers: each salt's lookups counted in a tally of its own, the shared one untouched."""

from __future__ import annotations

import threading

from kvstore import misses
from kvstore.callers import KEEP, LOOKUP_KEYS, Tallies, Tally
from kvstore.counters import Counters
from kvstore.misses import Miss, Misses


def test_a_tally_reports_only_the_lookup_counters_with_its_histogram_and_misses() -> None:
    c = Counters()
    c.add("hits_disk", 2, tokens_disk=300, bytes_written=999, writes=4)
    c.observe("restore_seconds", 0.02)
    m = Misses()
    m.record(Miss(misses.DIVERGED, prompt=400, served=100, at=100, stored=380))
    t = Tally(c, m)
    assert t.counters is c and t.misses is m
    s = t.stats()
    assert list(s)[: len(LOOKUP_KEYS)] == list(LOOKUP_KEYS)
    assert s["hits_disk"] == 2 and s["tokens_disk"] == 300 and s["misses"] == 0
    assert "bytes_written" not in s and "writes" not in s  # the server's counters, not a caller's
    assert s["restore_seconds_histogram"]["count"] == 1 and "persist_seconds_histogram" not in s
    assert s["miss_diverged"] == 1 and s["miss_lost_tokens"] == 280  # stored 380, served 100
    fresh = Tally().stats()
    assert all(fresh[k] == 0 for k in LOOKUP_KEYS) and fresh["miss_diverged"] == 0
    assert Tally().counters is not Tally().counters and Tally().misses is not Tally().misses


def test_each_salt_has_its_own_tally_and_none_is_the_shared_one() -> None:
    shared = Tally()
    tallies = Tallies(shared)
    assert tallies.of(None) is shared and len(tallies) == 0 and tallies.keep == KEEP
    a = tallies.of("tenant-a")
    assert a is not shared and tallies.of("tenant-a") is a and tallies.of(b"tenant-a") is a  # str and bytes alike
    assert tallies.of("tenant-b") is not a and len(tallies) == 2
    a.counters.add("hits_memory", tokens_memory=50)
    assert tallies.read("tenant-a")["tokens_memory"] == 50 and tallies.read("tenant-a")["hits_memory"] == 1
    assert tallies.read("tenant-b")["tokens_memory"] == 0 and shared.stats()["tokens_memory"] == 0
    assert tallies.read("never-seen")["hits_memory"] == 0 and len(tallies) == 2  # reading makes no tally


def test_the_least_recently_used_tallies_beyond_keep_are_dropped() -> None:
    tallies = Tallies(Tally(), keep=2)
    a, b = tallies.of("a"), tallies.of("b")
    assert tallies.of("a") is a  # "a" used last: "b" is the oldest now
    tallies.of("c")
    assert len(tallies) == 2 and tallies.of("a") is a and tallies.of("b") is not b  # b's counts restarted
    assert len(tallies) == 2
    one = Tallies(Tally(), keep=1)
    x = one.of("x")
    assert one.of("x") is x and len(one) == 1


def test_concurrent_first_uses_of_a_salt_share_one_tally() -> None:
    tallies = Tallies(Tally())
    got: list[Tally] = []
    barrier = threading.Barrier(8)

    def use() -> None:
        barrier.wait()
        t = tallies.of("same")
        t.counters.add("misses")
        got.append(t)

    threads = [threading.Thread(target=use) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len({id(t) for t in got}) == 1 and tallies.read("same")["misses"] == 8




def test_tallies_keep_at_most_keep_salts_dropping_the_least_recently_used() -> None:
    """Issue 52.14: with the bound or the LRU order gone, every test still passed. Many salts
    beyond ``keep``: the count never passes it, the oldest go first (their counts read 0
    again), a salt used again is kept over older ones, and the shared tally is never dropped."""
    from kvstore.callers import KEEP, Tallies, Tally

    shared = Tally()
    tallies = Tallies(shared, keep=8)
    kept: list[str] = []  # the expected order, least recently used first
    for i in range(100):
        salt = f"tenant-{i}"
        tallies.of(salt).counters.add("misses", i + 1)
        kept = ([s for s in kept if s != salt] + [salt])[-8:]
        if i % 3 == 0 and len(kept) > 2:  # an older salt used again moves to the end
            again = kept[0]
            assert tallies.of(again).counters["misses"] > 0, again
            kept = kept[1:] + [again]
        assert len(tallies) <= 8, (i, len(tallies))
    assert len(tallies) == 8
    for i in range(100):
        salt = f"tenant-{i}"
        want = i + 1 if salt in kept else 0  # dropped: its counts restart at 0
        assert tallies.read(salt)["misses"] == want, (salt, want)
    assert tallies.of(None) is shared
    # the next new salt drops exactly the least recently used of those kept
    tallies.of("newcomer")
    assert tallies.read(kept[0])["misses"] == 0 and all(tallies.read(s)["misses"] > 0 for s in kept[1:])
    assert len(tallies) == 8
    assert Tallies(Tally()).keep == KEEP > 0  # the store's default is a bound, too
