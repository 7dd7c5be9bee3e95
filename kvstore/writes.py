"""The write path: an insert's snapshot, and what leaves memory onto the disk.

``take`` (the caller's thread) checks an insert and snapshots the cache (views, their
evaluation scheduled on the caller's stream: ``Snapshot.ready`` waits for it); the caller makes it pending in the memory tier, and ``follow``
queues, on the writer thread, the memory tier's settle and then the snapshot's write. A
snapshot that can be stored is written to disk behind (``queue``), through one door
(``admit``, ``admit_framed``: the write policy and the daily budget), then the disk budget
is kept. Whatever leaves memory (the memory tier hands it to ``write_evicted``: eviction by
the limits, memory pressure, a discard) is written first if it never was; what is lost
instead (a skip, a full queue, a cache that cannot be stored) is remembered
(``misses.Ghosts``) so a later miss can say why. Disk failures cost at most a miss
(``disk_errors.DiskErrors``). Hits are credited to their disk entries in batches, here too.
The write path never touches the memory tier: its lock guards its own state only.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np

from . import files, segments, side_records
from .budget import evict_to
from .counters import Counters
from .disk import DiskTier, PersistJob, Plan, Restored
from .disk.whole import wanted as whole_wanted
from .disk_errors import DiskErrors
from .identity import Identity
from .index import IndexFailure
from .keys import TOKEN_BYTES, TokenError
from .layout import Layout
from .fit import layout_problem
from .memory import Evicted, Snapshot, check, take
from .misses import EVICTED_DISK, EVICTED_UNWRITTEN, Ghosts
from .query import Query
from .write_policy import WritePolicy
from .writer import Writer
from .bytes_written import written
from .escape import logger

log = logger("kvstore")


class WritePath:
    """One store's writes. Its state is handed in: counters, the error policy, the disk
    tier and writer (None: memory only), the write policy, the disk budget."""

    def __init__(self, counters: Counters, errors: DiskErrors, disk: DiskTier | None, writer: Writer | None,
                 policy: WritePolicy, *, max_disk_bytes: int | None,
                 whole_copy_min_bytes: int | None = None) -> None:
        self.counters, self.errors = counters, errors
        self.disk, self.writer, self.policy = disk, writer, policy
        self.max_disk_bytes = max_disk_bytes
        self.whole_copy_min_bytes = whole_copy_min_bytes  # ``copy_whole``: None writes no copies
        self.ghosts = Ghosts()
        self.on_written: Callable[[PersistJob], None] | None = None  # the shared tier's publish
        self._lock = threading.Lock()  # the state below, and each snapshot's write claimed once
        self._host: dict[int, dict[str, Any]] = {}  # id(pending snapshot) -> its host views
        self._described: set[bytes] = set()  # salted identities filed in the index
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._touch_scheduled = False

    @property
    def disk_on(self) -> bool:
        return self.disk is not None and not self.errors.off

    # -- insert ------------------------------------------------------------------------

    @staticmethod
    def take(ident: Identity | None, enc: bytes, cache: list[Any], cache_type: str,
             vocab: int | None) -> tuple[Snapshot, int, str | None]:
        """Check ``cache`` (holding the tokens ``enc``) and snapshot it (``memory.take``: on
        the caller's thread, its evaluation scheduled); returns the snapshot, the positions it covers and
        why it cannot be persisted (None: it can). Raises ValueError for bad input."""
        check(cache, cache_type)
        if ident is not None and enc and vocab is not None:
            top = int(np.frombuffer(enc, dtype="<i8").max())
            if top >= vocab:
                raise TokenError(f"token id {top} is out of the vocabulary of {ident.name} (vocab_size {vocab})")
        return take(cache, len(enc) // TOKEN_BYTES, cache_type)

    def follow(self, snap: Snapshot, ident: Identity | None, enc: bytes, covered: int,
               settle: Callable[[], object]) -> None:
        """After ``snap`` is pending in the memory tier: prepare its write (host views: MLX
        work scheduled on the caller's thread) and queue ``settle`` (the memory tier's) and then its
        write on the writer thread (here when there is none or its queue is full)."""
        if snap.tensors is not None and ident is not None and self.disk_on and covered > 0:
            host = self._host_views(snap, here=True)
            if host is not None:
                with self._lock:
                    snap.persist = (ident, enc[: covered * TOKEN_BYTES])
                    self._host[id(snap)] = host

        def job() -> None:
            settle()
            self.queue(snap)

        if self.writer is None or not self.writer.submit(job):
            job()  # no writer, or its queue is full: here, as before

    def behind(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on the writer thread, where evicted entries are written; False when
        there is none or its queue is full (the caller runs it)."""
        return self.writer is not None and self.writer.submit(job)

    # -- to disk -----------------------------------------------------------------------

    def queue(self, snap: Snapshot) -> None:
        """Write ``snap`` to disk (queued; inline on the writer thread) unless it is there
        or queued already, or has nothing to write. A new snapshot's layout is checked
        against its identity first: a cache that does not fit is never stored under it."""
        with self._lock:  # claimed once: the writer's settle and a close may meet here
            host = self._host.pop(id(snap), None)
            if snap.persisted or snap.persist is None or self.writer is None:
                return
            snap.persisted = True
        if host is not None and snap.tensors is not None and snap.layout is not None:  # new: not checked yet
            wrong = layout_problem(snap.persist[0], snap.tensors, snap.layout)
            if wrong is not None:  # memory is the caller's own; the disk is not
                snap.persist, snap.persisted = None, False
                self.counters.add("unpersistable")
                self.errors.warn_once("layout", "kvstore: %s; kept in memory only", wrong)
                return
        snap.persisted = self._submit(snap, host)

    def _submit(self, snap: Snapshot, host: dict[str, Any] | None = None) -> bool:
        assert self.writer is not None and self.disk is not None and snap.tensors is not None and snap.persist
        ident, enc = snap.persist
        host = host if host is not None else self._host_views(snap)
        if host is None:
            return False
        job = PersistJob(ident, Query(enc, ident.digest, self.disk.chunk), host, snap.layout or Layout(),
                         snap.cache_type)
        snap.disk_key = job.query.key

        def write() -> None:
            snap.ready()  # its arrays (and host views) computed: waited for once, then read here
            self.persist(job)

        if self.writer.on_thread():  # settling on the writer thread: write now, keep the queue's room
            write()
            return True
        return self.writer.submit(write)

    def persist(self, job: PersistJob) -> None:
        """The writer thread's half of an insert: write, commit, keep the budget."""
        disk = self.disk
        if disk is None or self.errors.off:
            return
        t0 = time.perf_counter()
        try:
            admitted = self.admit(job)
            if admitted is None:  # the job's snapshot stays in memory
                return
            job = admitted
            self.describe(job.identity)
            written = disk.persist(job)
            self.keep_disk_budget()
        except (OSError, IndexFailure, files.BlobError) as e:  # a write or commit failed (full disk, I/O)
            self.counters.add("write_errors")
            if not self.errors.index_damaged(e, self.disk):
                self.errors.warn_once(f"write:{getattr(e, 'errno', None) or type(e).__name__}",
                                      "kvstore: write failed (%s); entry stays in memory only", e)
            return
        took = time.perf_counter() - t0
        self.counters.add("writes", write_seconds=took, bytes_written=written)
        self.counters.observe("persist_seconds", took)
        if self.on_written is not None:
            self.on_written(job)

    def copy_whole(self, ident: Identity, plan: Plan, got: Restored) -> None:
        """After a restore from segments: keep the entry also as one whole file
        (``disk.whole``) when it is worth it, on the writer thread, never on the request
        path (a full queue skips it). Only as the write policy and the daily budget allow
        (``WritePolicy.admit_copy``) and within the room the disk budget leaves (a copy
        never evicts an entry); the writer checks the entry was served before. Not after
        a copy just failed its checks (``Restored.copy_dropped``): the next restore writes
        it again. A skipped copy is not counted (the entry is stored; nothing is lost); a
        failed write is counted and said once, as a persist's is."""
        if (self.disk is None or self.errors.off or got.whole or got.copy_dropped or plan.entry is None
                or self.whole_copy_min_bytes is None
                or not whole_wanted(plan, got.nbytes, got.segments, self.whole_copy_min_bytes)):
            return
        try:
            host = segments.host_views(got.tensors, copy=segments.own_copies())
        except TypeError:
            return
        disk, key = self.disk, plan.entry

        def job() -> None:
            if self.errors.off or self.policy.admit_copy(disk, key, plan.cache_type) is not None:
                return
            room = None
            if self.max_disk_bytes is not None:
                room = side_records.budget_for(disk.root, self.max_disk_bytes) - disk.index.total_bytes()
            try:
                n = disk.write_whole(ident, key, plan.n, host, got.layout, room=room)
            except Exception as e:  # counted and said here, never left to the writer thread uncounted
                self.counters.add("write_errors")
                if not (isinstance(e, (OSError, IndexFailure, files.BlobError)) and self.errors.index_damaged(e, disk)):
                    self.errors.warn_once(f"whole:{getattr(e, 'errno', None) or type(e).__name__}",
                                          "kvstore: writing a whole copy failed (%s); the entry stays as it was", e)
                return
            if n:
                self.counters.add("whole_copies_written", bytes_written=n)

        self.behind(job)

    def admit(self, job: PersistJob) -> PersistJob | None:
        """The one door to the disk tier: every write asks the write policy and the daily
        budget first (a shared hit filed here: ``admit_framed``). The job to write (for
        "reused" perhaps its prefix), or None, the skip counted and remembered."""
        assert self.disk is not None
        admitted = self.policy.admit(self.disk, job)
        if isinstance(admitted, str):
            self._skipped(admitted, job.identity, job.query.enc)
            return None
        return admitted

    def admit_framed(self, ident: Identity, enc: bytes, key: bytes, cache_type: str) -> bool:
        """``admit`` for an entry framed elsewhere (a shared hit filed here whole, under
        entry ``key``, holding the tokens ``enc``): True if it is written."""
        assert self.disk is not None
        why = self.policy.admit_framed(self.disk, key, len(enc) // TOKEN_BYTES, cache_type)
        if why is not None:
            self._skipped(why, ident, enc)
        return why is None

    def _skipped(self, why: str, ident: Identity, enc: bytes) -> None:
        """A write the policy or the budget skipped: counted, and remembered for a miss."""
        self.counters.add(f"writes_skipped_{why}")
        detail = "the daily write budget" if why == "budget" else f"the write policy ({self.policy.persist})"
        self.ghosts.add(ident.digest, EVICTED_UNWRITTEN, detail, len(enc) // TOKEN_BYTES, enc=enc)

    def describe(self, ident: Identity) -> None:
        """File a salted identity's description (``salt.salted``: the model's, marked
        salted; never the salt) before its first entry, once per process, so maintenance
        (ls, gc of missing models) sees whose entries they are."""
        if ident.info.get("salted") and ident.digest not in self._described and self.disk is not None:
            self.disk.index.put_identity(ident.digest, ident.info)
            self._described.add(ident.digest)

    def keep_disk_budget(self) -> None:
        """After every write: evict least recently used entries until they and the side
        records (``side_records``: ``--stable-prefix``'s) fit ``max_disk_bytes``."""
        if self.max_disk_bytes is not None and self.disk is not None:
            went = evict_to(self.disk, side_records.budget_for(self.disk.root, self.max_disk_bytes))  # records count
            gone = [r for r in went if not r.copy]  # a whole copy's entry is still here: no eviction
            self.counters.add("gc_runs", int(bool(went)), evictions_disk=len(gone),
                              gc_freed_bytes=sum(r.freed for r in went))
            C = self.disk.chunk
            for r in gone:
                self.ghosts.add(r.record.identity, EVICTED_DISK, "the disk budget", r.record.n,
                                boundary=r.record.boundary, k=r.record.n // C)

    def write_evicted(self, evicted: Evicted) -> None:
        """What left the memory tier: written first if it never was; if it cannot be
        (memory only, not storable, a full queue), remembered as lost."""
        self.counters.add("evictions_memory", len(evicted))
        for mem_key, tokens, snap in evicted:
            self.queue(snap)
            if not snap.persisted:
                why = "not storable" if snap.persist is None else "the write queue was full"
                self.ghosts.add(mem_key, EVICTED_UNWRITTEN, why if self.disk_on else "memory only",
                                len(tokens), enc=np.asarray(tokens, dtype="<i8").tobytes())

    def write_unwritten(self, held: list[Snapshot], timeout: float | None) -> None:
        """Queue the snapshots still in memory (``held``) whose write was dropped (queue
        full): at close there is no generation left to hold up, so wait for room if needed."""
        assert self.writer is not None
        pending = [s for s in held if not s.persisted and s.persist is not None]
        for snap in pending:
            self.queue(snap)
            if not snap.persisted and snap.persist is not None:
                self.writer.flush(timeout)
                self.queue(snap)

    def _host_views(self, snap: Snapshot, here: bool = False) -> dict[str, Any] | None:
        """``segments.host_views`` of a snapshot, None if its dtype cannot be stored (said
        once). ``here``: on the thread that took it (the insert), where the views' evaluation
        is scheduled with the snapshot's (``Snapshot.schedule``); elsewhere (an eviction) the
        snapshot is waited for first and the views are evaluated on this thread. On a GPU
        with memory of its own they are copies the writer alone reads (``segments.own_copies``:
        its first numpy view moves the buffer it reads, which hits and the host's cache share
        otherwise)."""
        try:
            if here:
                host = segments.host_views(snap.tensors, evaluate=False,  # type: ignore[arg-type]
                                           copy=segments.own_copies())
                snap.schedule([a for _, a in host.values()])
                return host
            snap.ready()
            return segments.host_views(snap.tensors, copy=segments.own_copies())  # type: ignore[arg-type]
        except TypeError as e:
            self.errors.warn_once("dtype", "kvstore: %s; kept in memory only", e)
            return None

    # -- hits --------------------------------------------------------------------------

    def credit(self, key: bytes | None) -> None:
        """Credit a hit to disk entry ``key`` (last used, hits), batched on the writer thread."""
        if key is None or self.writer is None:
            return
        with self._lock:
            _when, hits = self._touches.get(key, (0.0, 0))
            self._touches[key] = (time.time(), hits + 1)
            schedule = not self._touch_scheduled
            self._touch_scheduled = True
        if schedule and not self.writer.submit(self.flush_credits):
            self._touch_scheduled = False

    def flush_credits(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
            self._touch_scheduled = False
        if touches and self.disk_on:
            try:
                self.disk.touch(touches)  # type: ignore[union-attr]
            except IndexFailure as e:  # bookkeeping only: a failed touch costs nothing else
                if not self.errors.index_damaged(e, self.disk):
                    self.errors.warn_once("touch", "kvstore: could not record hits: %s", e)

    @property
    def credits_pending(self) -> bool:
        return bool(self._touches)

    def stats(self) -> dict[str, Any]:
        """The write side's figures: the policy, the queue, what the disk holds and was
        written today (a damaged index switches the disk tier off: ``disk_off`` says why)."""
        s: dict[str, Any] = dict(self.policy.stats())
        if self.writer is not None:
            s.update(queue_depth=self.writer.depth, pending_writes=self.writer.pending,
                     dropped_writes=self.writer.dropped)
        if self.disk is not None:
            try:
                if not self.errors.off:
                    s["disk_bytes"] = self.disk.index.total_bytes()
                    s.update({f"disk_{k}": v for k, v in self.disk.index.counts().items()})
                    s["written_today_bytes"], s["written_total_bytes"] = written(self.disk.index)
            except IndexFailure as e:
                self.errors.index_damaged(e, self.disk)
            if self.errors.off:
                s["disk_off"] = self.errors.off
        return s
