"""kvstore.callers: per-salt tallies are bounded, least recently used dropped first."""

from __future__ import annotations


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
