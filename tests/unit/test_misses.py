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
