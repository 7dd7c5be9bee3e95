"""kvstore.misses: miss counts, the lost-token histogram, the recent list and its threshold."""

from __future__ import annotations

import json

from kvstore import misses
from kvstore.misses import Miss, Misses


def test_misses_counts_histogram_recent_and_threshold() -> None:
    m = Misses(threshold=256, recent=3)
    small = Miss(misses.DIVERGED, prompt=400, served=300, at=300, stored=380, after=(1, 2, 3))
    big = Miss(misses.OTHER_IDENTITY, prompt=2000, served=0, at=2000, stored=2000, detail="chat_template differs")
    assert m.record(small) is False and m.record(big) is True
    for _ in range(3):
        m.record(small)
    s = m.stats()
    assert s["miss_diverged"] == 4 and s["miss_other_identity"] == 1 and s["miss_cut_refused"] == 0
    assert set(f"miss_{r}" for r in misses.REASONS) <= set(s)
    assert s["miss_lost_tokens"] == 4 * 80 + 2000 and s["miss_log_threshold"] == 256
    h = s["miss_lost_tokens_histogram"]
    assert h["count"] == 5 and h["counts"][h["le"].index(256)] == 4 and h["sum"] == 2320
    [listed] = s["recent_misses"]  # only the misses worth a log line
    assert listed["reason"] == "other_identity" and listed["lost_tokens"] == 2000 and listed["diverged_at"] == 2000
    for i in range(5):
        m.record(Miss(misses.DIVERGED, prompt=4000, served=100 + i, at=100 + i, stored=4000))
    recent = m.stats()["recent_misses"]
    assert [r["served_tokens"] for r in recent] == [102, 103, 104]  # the last 3, oldest first
    assert not any("after" in r or "tokens" == k for r in recent for k in r)  # no token ids
    json.dumps(s)  # what /v1/cache/stats sends
    near = misses.Near(4000)  # a prompt sharing only a role header with a stored one is new, not changed:
    near.saw("disk", 6, 4000)   # the store makes no Miss of it (so nothing is counted)
    assert misses.explain(near, 6) is None
    near.saw("disk", misses.MIN_DISK_GAIN, 4000)
    assert misses.explain(near, misses.MIN_DISK_GAIN).reason == misses.DIVERGED


def test_a_small_miss_is_named_later_and_every_read_counts_its_part() -> None:
    """``record(name=)``: naming a miss's part renders the request again, so a miss not
    worth a log line is named later (``name_pending``: a store runs it when its counts are read), once;
    a read of the counts names what is still pending first, so it always holds every part."""
    from kvstore.parts import Part

    m = Misses(threshold=256)
    calls: list[int] = []

    def name(miss: Miss) -> Part:
        calls.append(miss.served)
        return Part("messages", index=1)

    small = Miss(misses.DIVERGED, prompt=400, served=390, at=390, stored=400)
    m.record(small, name=name)
    m.record(Miss(misses.DIVERGED, prompt=400, served=391, at=391, stored=400), name=name)
    assert calls == []  # not named by record
    s = m.stats()
    assert calls == [390, 391] and s["miss_part_messages"] == 2 and s["miss_diverged"] == 2
    m.name_pending()
    assert calls == [390, 391] and m.stats()["miss_part_messages"] == 2  # each named once

    def broken(miss: Miss) -> Part:
        raise RuntimeError("the request's template cannot be rendered again")

    m.record(small, name=broken)
    s = m.stats()
    assert s["miss_diverged"] == 3 and s["miss_part_messages"] == 2  # counted, without a part


def test_the_nearest_is_ranked_one_way_and_a_chunk_counts_its_entry() -> None:
    """``rank``: most shared tokens, then most of the query's length held, then the shorter
    (``kvstore why`` and every tier's search pick by it). A chunk others go on from counts
    at its end until ``resolved`` names its entry; never at the query's length (issue 52.12)."""
    n_q = 7695
    assert misses.rank(1861, 7200, n_q) > misses.rank(1861, 2048, n_q) > misses.rank(1800, 9000, n_q)
    assert misses.rank(1861, 7695, n_q) > misses.rank(1861, 9000, n_q)  # both hold the query's length: the shorter
    assert misses.held_past(7200, n_q, 1861) == 5339 and misses.held_past(9000, n_q, 1861) == n_q - 1861
    assert misses.held_past(1000, n_q, 1861) == 0
    near = misses.Near(n_q)
    near.saw("disk", 1861, 2048, b"", below=b"k" * 16)  # a chunk: its entries are filed under its key
    near.saw("disk", 1861, 2048, b"", below=b"j" * 16)  # another, as near: kept too (its entries may hold more)
    assert near.below == (b"k" * 16, b"j" * 16) and near.bounded
    unresolved = misses.explain(near, 1861)
    assert unresolved is not None and (unresolved.stored, unresolved.lost) == (2048, 2048 - 1861)
    near.resolved(7200, (5, 6, 7))
    miss = misses.explain(near, 1861)
    assert miss is not None and near.below == () and not near.bounded
    assert (miss.reason, miss.stored, miss.lost, miss.after) == (misses.DIVERGED, 7200, 5339, (5, 6, 7))
    assert "recomputed 5,339 tokens a stored prefix held; served 1,861 of 7,695, the prompt parts from the " \
           "stored 7,200-token prefix" in misses.log_line(miss, [], None)
    near.saw("memory", 1861, 7000)  # shares as much, holds less of the query: not nearer
    assert near.stored == 7200 and near.tier == "disk"
    near.saw("disk", 1861, 2048, b"", below=b"i" * 16)  # a chunk's end ranks below the entry kept: not kept
    assert near.below == ()
    entry = misses.Near(n_q)
    entry.saw("memory", 1861, 2048)  # an entry as long as a chunk's end, and such a chunk: both kept
    entry.saw("disk", 1861, 2048, b"", below=b"k" * 16)
    assert entry.below == (b"k" * 16,) and not entry.bounded
    entry.resolved(2000, ())  # an entry below that ranks no nearer leaves the one kept
    assert entry.stored == 2048 and entry.tier == "memory"
