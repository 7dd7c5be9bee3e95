"""Bytes written to a cache directory, per UTC day and in total (SSD wear, issue 23).

Kept in the index's ``meta`` table and counted inside each persist's own commit
(``disk.persist.commit``), so the figures survive restarts, are shared by every process using
the directory, never disagree with what was committed, and cost no extra sync. A damaged
figure counts from zero again. Imports nothing of kvstore: the disk tier counts, the write
policy and ``stats`` read.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

DAY_KEY = b"written_day"  # b"YYYY-MM-DD <bytes>": bytes written on that UTC day
TOTAL_KEY = b"written_total"  # bytes written since the directory was created (this version on)


def utc_day(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))


def _stored_day(raw: bytes | None, day: str) -> tuple[str, int]:
    """The day the stored count belongs to and the count, seen from ``day`` (today by
    this process's clock). A count dated the day after ``day`` is still today's: the
    clock stepped back over midnight (an NTP correction, a VM resumed), and restarting
    the count there would grant the budget twice in one real day. A count dated earlier,
    further ahead (a clock that was wrong), or damaged starts from zero today."""
    try:
        d, n = (raw or b"").decode().split()
        if d == day or d == _next_day(day):
            return d, int(n)
    except ValueError:  # damaged (or absent): counted from zero again
        pass
    return day, 0


def _next_day(day: str) -> str:
    return (datetime.date.fromisoformat(day) + datetime.timedelta(days=1)).isoformat()


def _day_count(raw: bytes | None, day: str) -> int:
    return _stored_day(raw, day)[1]


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
    day, today = _stored_day(t.meta(DAY_KEY), utc_day(now))
    today, total = today + n, _int(t.meta(TOTAL_KEY)) + n
    t.set_meta(DAY_KEY, f"{day} {today}".encode())
    t.set_meta(TOTAL_KEY, str(total).encode())
