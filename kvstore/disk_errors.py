"""The store's disk-error policy: a disk problem of any kind costs at most a miss.

``DiskErrors`` decides what a failure of the disk tier does, so that every place in
``KVStore`` that reads or writes the disk handles one the same way: it is counted
(``Counters``), logged once per kind (``warn_once``; later ones only counted), and never
raised to the caller. A restore that fails on a record's own bytes (an error naming the
record: ``names_record``) drops the record (``Failure.DAMAGED``), unless a concurrent gc
removed it (a counted race); any other failure (an I/O error, memory or threads running
out, a defect) keeps it (``Failure.UNREADABLE``). A damaged index
(``index.DAMAGE``) switches the disk tier off for the process (``off`` says why): LMDB has
no checksums, and walking a damaged tree further can abort the process.
"""

from __future__ import annotations

import threading
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import files
from .counters import Counters
from .index import DAMAGE, IndexFailure
from .records import Kind
from .escape import logger

if TYPE_CHECKING:
    from .disk import DiskTier, Plan

log = logger("kvstore")


class Failure(Enum):
    """Why a restore gave nothing."""

    DAMAGED = "damaged"        # the record was dropped, or a gc raced it: a new plan may still hit
    UNREADABLE = "unreadable"  # not the record's bytes (I/O, memory, threads, a defect): the entry is kept
    REFUSED = "refused"        # the plan cuts a snapshot where its layout does not allow: kept


class DiskErrors:
    """One store's handling of disk failures (thread-safe)."""

    def __init__(self, counters: Counters, cache_dir: Path) -> None:
        self.counters = counters
        self.cache_dir = cache_dir
        self.warned: set[str] = set()  # the kinds already logged: a fixed, small set
        self.off: str | None = None    # why the disk tier was switched off (a damaged index)
        self._lock = threading.Lock()

    def warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg`` the first time a problem of ``kind`` happens in this store; later
        ones are only counted (``warnings_suppressed``). Kinds are a fixed, small set,
        never built from data (a file name, a record), so the set is bounded."""
        with self._lock:
            first = kind not in self.warned
            self.warned.add(kind)
        if not first:
            self.counters.add("warnings_suppressed")
            return
        log.warning(msg, *args)

    def index_damaged(self, e: BaseException, disk: DiskTier | None) -> bool:
        """Switch the disk tier off for this process when LMDB reports a damaged file;
        True if ``e`` is such a report. Memory keeps serving."""
        if not isinstance(e, DAMAGE):
            return False
        with self._lock:
            first, self.off = self.off is None, self.off or f"{type(e).__name__}: {e}"
        if first:
            if disk is not None:  # no clean stamp; verify reports it, the next open salvages
                disk.index.mark_damaged(f"{type(e).__name__}: {e}")
            log.error("kvstore: the index in %s is damaged (%s); the disk tier is off for this process, "
                      "memory keeps serving (`kvstore verify` reports the damage)", self.cache_dir, e)
        return True

    def restore_failed(self, disk: DiskTier, plan: Plan, e: Exception) -> Failure:
        """What a failed ``DiskTier.restore`` of ``plan`` costs (see the module's docstring).

        A deny-list: only an error that names the record whose own bytes failed
        (``names_record``) drops a record, and a damaged index switches the disk tier
        off. Anything else (an OSError, MemoryError, a thread that cannot start, an MLX
        allocation refused, an unexpected error) says nothing about the bytes: the entry
        is kept, the miss counted in ``io_errors``."""
        if names_record(e) is not None:
            self._damaged(disk, plan, e)
            return Failure.DAMAGED
        if self.index_damaged(e, disk):
            return Failure.DAMAGED
        self.counters.add("io_errors")
        if isinstance(e, (OSError, MemoryError, RuntimeError)):
            self.warn_once("io", "kvstore: could not read an entry (%s: %s); served as a miss, entry kept",
                           type(e).__name__, e)
        elif "bug" not in self.warned:  # a defect, not damage: still a miss, never a crash, nothing lost
            self.warned.add("bug")
            log.error("kvstore: unexpected error restoring an entry (a kvstore bug: please report); "
                      "served as a miss, entry kept", exc_info=e)
        return Failure.UNREADABLE

    def _damaged(self, disk: DiskTier, plan: Plan, err: Exception) -> None:
        """A restore failed: a record whose file vanished because a gc removed the record
        meanwhile is a race (counted, retried); anything else is damage, dropped."""
        bad = getattr(err, "record", None)
        if bad is not None and _gone(disk, bad):
            self.counters.add("races")
            return
        self.counters.add("corrupt")
        self.warn_once("damaged", "kvstore: dropping damaged entry: %s", err)
        self.drop(disk, plan, err)

    def drop(self, disk: DiskTier, plan: Plan, err: Exception | None = None) -> None:
        """Remove the record whose file failed (``err.record``), else the plan's last one;
        a segment another record owns (``err.foreign``) is not released."""
        bad = getattr(err, "record", None)  # the record whose file failed, when known
        if bad is None and plan.last is not None:
            bad = ("entry" if plan.last[0] is Kind.ENTRY else "chunk", plan.last[1])
        try:
            if bad is None:
                return
            own = not getattr(err, "foreign", False)  # a segment another record owns stays
            if bad[0] == "entry":
                disk.remove([bad[1]], release=own)
            else:
                disk.drop_chunk_and_users(bad[1], release=own)
        except Exception as e:
            if not self.index_damaged(e, disk):
                self.warn_once("drop", "kvstore: could not drop damaged record: %s", e)


def names_record(e: BaseException) -> tuple[str, bytes] | None:
    """The record (``("entry" | "chunk", key)``) whose own bytes ``e`` proves bad: a
    ``BlobError`` the disk tier raised naming it. None for anything else, which says
    nothing about any record's bytes (the process or the system ran short, a defect)."""
    return e.record if isinstance(e, files.BlobError) else None


def _gone(disk: DiskTier, record: tuple[str, bytes]) -> bool:
    kind, key = record
    try:
        return disk.index.view(lambda r: r.raw("entries" if kind == "entry" else "chunks", key) is None)
    except IndexFailure:
        return False
