"""What the writer thread puts on the SSD: a write policy and a daily write budget.

A Mac's SSD is soldered in, and a disk KV cache that writes every new prefix can write
tens of GB in a session. ``WritePolicy.admit`` is asked once per persist job, on the
writer thread (spills of memory evictions and write-behind alike), before anything is
written:

- ``persist="all"`` writes every job (kvstore's behaviour without a policy);
- ``"system"`` writes system segments (``cache_type="system"``: what mlx_lm.server keeps
  for a system prompt and ``kvstore warm`` stores) and re-writes of pinned entries only;
- ``"reused"`` writes a job when a prefix of it was seen before: its exact tokens, or at
  least one full chunk of them, came in an earlier job of this process or are already on
  disk. A one-shot prompt is never written; the second turn of a conversation (which
  extends the first) and a system prompt's second use are.

``max_write_bytes_per_day``: once the bytes written today (UTC) reach the budget, jobs are
skipped until the next day; the write that crosses it completes. The count is kept in
the index's ``meta`` table (``written_day``, ``written_total``), updated in a write
transaction after each write, so it survives restarts and is shared by every process
using the directory. A skipped job stays in memory; it is counted by the caller.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from .keys import boundaries, root_key
from .records import RecordError

POLICIES = ("all", "system", "reused")
DAY_KEY = b"written_day"  # b"YYYY-MM-DD <bytes>": bytes written on that UTC day
TOTAL_KEY = b"written_total"  # bytes written since the directory was created (this version on)
SEEN_KEYS = 1 << 16  # prefixes "reused" remembers (16-byte keys: about 3 MB at most)


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


def add_written(index: Any, n: int, now: float | None = None) -> tuple[int, int]:
    """Count ``n`` more bytes written (one write transaction); returns ``written``."""
    day = utc_day(now)

    def run(t: Any) -> tuple[int, int]:
        today, total = _day_count(t.meta(DAY_KEY), day) + n, _int(t.meta(TOTAL_KEY)) + n
        t.set_meta(DAY_KEY, f"{day} {today}".encode())
        t.set_meta(TOTAL_KEY, str(total).encode())
        return today, total

    return index.transact(run)


def _entry(disk: Any, key: bytes) -> Any:
    """The entry record under ``key``; None when absent or unreadable (a damaged record
    is verify's business, not a reason to write or not)."""
    try:
        return disk.index.entry(key)
    except RecordError:
        return None


class WritePolicy:
    """``admit(disk, job)`` says whether a persist job is written now; see the module doc."""

    def __init__(self, persist: str = "all", max_write_bytes_per_day: int | None = None) -> None:
        if persist not in POLICIES:
            raise ValueError(f"persist must be one of {list(POLICIES)}, got {persist!r}")
        if max_write_bytes_per_day is not None and max_write_bytes_per_day < 0:
            raise ValueError(f"max_write_bytes_per_day must be >= 0, got {max_write_bytes_per_day}")
        self.persist = persist
        self.max_write_bytes_per_day = max_write_bytes_per_day
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, disk: Any, job: Any) -> str | None:
        """None: write ``job``; "policy" or "budget": skip it (and say why)."""
        if not self._wanted(disk, job):
            return "policy"
        if self.max_write_bytes_per_day is not None and written(disk.index)[0] >= self.max_write_bytes_per_day:
            return "budget"
        return None

    def _wanted(self, disk: Any, job: Any) -> bool:
        if self.persist == "all":
            return True
        if self.persist == "system":
            if job.cache_type == "system":
                return True
            rec = _entry(disk, job.key)
            return rec is not None and rec.pinned
        bounds = boundaries(root_key(job.identity.digest), job.tokens, disk.chunk)
        keys = [job.key, *bounds[1:]]  # bounds[0] is the root: no token in common
        with self._lock:
            seen = any(k in self._seen for k in keys)
            for k in keys:
                self._seen[k] = None
                self._seen.move_to_end(k)
            while len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
        return seen or bool(disk.held_chunks(bounds, job.tokens)) or _entry(disk, job.key) is not None

    def wrote(self, disk: Any, nbytes: int) -> None:
        """Count a write in the directory's daily and total figures."""
        if nbytes > 0:
            add_written(disk.index, nbytes)

    def stats(self) -> dict[str, Any]:
        return {"persist_policy": self.persist, "max_write_bytes_per_day": self.max_write_bytes_per_day}
