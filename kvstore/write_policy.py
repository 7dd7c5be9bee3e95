"""What the writer thread puts on the SSD: a write policy and a daily write budget.

A Mac's SSD is soldered in, and a disk KV cache that writes every new prefix can write
tens of GB in a session. ``WritePolicy.admit`` is asked once per persist job, on the
writer thread (spills of memory evictions and write-behind alike), before anything is
written:

- ``persist="all"`` writes every job (kvstore's behaviour without a policy);
- ``"system"`` writes system segments (``cache_type="system"``: what mlx_lm.server keeps
  for a system prompt and ``kvstore warm`` stores) and re-writes of pinned entries only;
- ``"reused"`` writes the part of a job that was seen before: all of it when its exact
  tokens came in an earlier job of this process or are on disk; else its longest prefix
  of whole chunks that an earlier job held or the disk holds (a cache of plain or
  quantised KV is cut there; one that cannot be cut is written whole). A one-shot prompt
  is never written; a system prompt is written at its second use, a conversation's
  history up to the last chunk boundary the next turn came back to.

``max_write_bytes_per_day``: once the bytes written today (UTC) reach the budget, jobs are
skipped until the next day; the write that crosses it completes. The count is kept in
the index's ``meta`` table (``kvstore.bytes_written``), updated in each persist's own commit, so
it survives restarts, is shared by every process using the directory, and costs no sync
of its own. A skipped job stays in memory; it is counted by the caller.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .disk import PersistJob
from .records import RecordError
from .bytes_written import written

POLICIES = ("all", "system", "reused")
SEEN_KEYS = 1 << 16  # prefixes "reused" remembers (16-byte keys: about 3 MB at most)


def prefix_job(job: PersistJob, n: int) -> PersistJob:
    """The job's first ``n`` tokens (a cuttable cache: KV on axis -2), as its own job.
    No MLX op: the writer thread slices the host views numpy-side, as ``disk`` does."""
    import numpy as np

    query = job.query.prefix(n)  # shares the job's chain: only the new residual is hashed
    tensors = {nm: (st, np.asarray(a)[..., :n, :]) for nm, (st, a) in job.tensors.items()}
    return PersistJob(job.identity, query, tensors, job.layout.with_offset(n), job.cache_type, job.created)


def _entry(disk: Any, key: bytes) -> Any:
    """The entry record under ``key``; None when absent or unreadable (a damaged record
    is verify's business, not a reason to write or not)."""
    try:
        return disk.index.entry(key)
    except RecordError:
        return None


class WritePolicy:
    """``admit(disk, job)`` says whether a persist job is written now; see the module doc."""

    def __init__(self, persist: str, max_write_bytes_per_day: int | None) -> None:  # a store's (StoreOptions)
        if persist not in POLICIES:
            raise ValueError(f"persist must be one of {list(POLICIES)}, got {persist!r}")
        if max_write_bytes_per_day is not None and max_write_bytes_per_day < 0:
            raise ValueError(f"max_write_bytes_per_day must be >= 0, got {max_write_bytes_per_day}")
        self.persist = persist
        self.max_write_bytes_per_day = max_write_bytes_per_day
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def admit(self, disk: Any, job: PersistJob) -> PersistJob | str:
        """The job to write (``job``, or for "reused" its prefix seen before), or why
        nothing is written: "policy" or "budget". Every persist asks here first (an entry
        framed elsewhere: ``admit_framed``)."""
        n = self._wanted(disk, job)
        if n == 0:
            return "policy"
        return self._over_budget(disk) or (job if n == job.query.n else prefix_job(job, n))

    def admit_framed(self, disk: Any, key: bytes, n: int, cache_type: str) -> str | None:
        """Whether an entry framed elsewhere (a shared-tier hit filed here: entry ``key``,
        ``n`` tokens) is written, whole, as ``admit`` would: None, or "policy" or "budget".
        Under "reused" it counts as a second use (another machine stored it, this one
        asked for it)."""
        if n == 0 or (self.persist == "system" and not self._system(disk, key, cache_type)):
            return "policy"
        return self._over_budget(disk)

    def admit_copy(self, disk: Any, key: bytes, cache_type: str) -> str | None:
        """Whether entry ``key``'s whole copy (``disk.whole``: a second copy of an entry
        already stored) is written: None, or "policy" (under "system", only a system
        segment's or a pinned entry's) or "budget" (the daily budget, as ``admit``)."""
        if self.persist == "system" and not self._system(disk, key, cache_type):
            return "policy"
        return self._over_budget(disk)

    def _over_budget(self, disk: Any) -> str | None:
        """"budget" once today's bytes written reached the daily budget, else None."""
        if self.max_write_bytes_per_day is not None and written(disk.index)[0] >= self.max_write_bytes_per_day:
            return "budget"
        return None

    @staticmethod
    def _system(disk: Any, key: bytes, cache_type: str) -> bool:
        """"system" writes a system segment, or a re-write of the pinned entry ``key``."""
        rec = None if cache_type == "system" else _entry(disk, key)
        return cache_type == "system" or (rec is not None and rec.pinned)

    def _wanted(self, disk: Any, job: PersistJob) -> int:
        """How many of the job's tokens the policy writes (0: none)."""
        q = job.query
        if self.persist == "all":
            return q.n
        if self.persist == "system":
            return q.n if self._system(disk, q.key, job.cache_type) else 0
        bounds = q.bounds
        with self._lock:
            seen_whole = q.key in self._seen
            depth = max((k for k in range(1, len(bounds)) if bounds[k] in self._seen), default=0)
            for key in (q.key, *bounds[1:]):  # bounds[0] is the root: no token in common
                self._seen[key] = None
                self._seen.move_to_end(key)
            while len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
        if seen_whole or _entry(disk, q.key) is not None:
            return q.n
        held = disk.held_chunks(bounds, q.enc)
        depth = max([depth] + [k for k in range(1, len(bounds)) if bounds[k] in held])
        return 0 if depth == 0 else depth * disk.chunk if job.layout.chunkable(q.n) else q.n

    def stats(self) -> dict[str, Any]:
        return {"persist_policy": self.persist, "max_write_bytes_per_day": self.max_write_bytes_per_day}
