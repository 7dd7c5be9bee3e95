"""Bytes written to a cache directory, per UTC day and in total (SSD wear, issue 23).

Kept in the index's ``meta`` table and counted inside each persist's own commit
(``disk._commit``), so the figures survive restarts, are shared by every process using
the directory, never disagree with what was committed, and cost no extra sync. A damaged
figure counts from zero again. Imports nothing of kvstore: the disk tier counts, the write
policy and ``stats`` read.
"""

from __future__ import annotations

import time
from typing import Any

DAY_KEY = b"written_day"  # b"YYYY-MM-DD <bytes>": bytes written on that UTC day
TOTAL_KEY = b"written_total"  # bytes written since the directory was created (this version on)


def utc_day(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))


def _day_count(raw: bytes | None, day: str) -> int:
    if not raw:
        return 0
    try:
        d, n = raw.decode().split()
        return int(n) if d == day else 0
    except ValueError:  # damaged: counted from zero again
        return 0


def _int(raw: bytes | None) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def written(index: Any, now: float | None = None) -> tuple[int, int]:
    """(bytes written today (UTC), bytes written in total) in this cache directory."""
    return index.view(lambda r: (_day_count(r.meta(DAY_KEY), utc_day(now)), _int(r.meta(TOTAL_KEY))))


def count(t: Any, n: int, now: float | None = None) -> None:
    """Count ``n`` more bytes written, inside the write transaction ``t`` that commits them."""
    day = utc_day(now)
    today, total = _day_count(t.meta(DAY_KEY), day) + n, _int(t.meta(TOTAL_KEY)) + n
    t.set_meta(DAY_KEY, f"{day} {today}".encode())
    t.set_meta(TOTAL_KEY, str(total).encode())
