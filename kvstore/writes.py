"""The write path: an insert into memory, and what leaves memory onto the disk.

``take`` (the caller's thread) checks an insert and snapshots the cache (views, evaluated
on the caller's stream); the snapshot is pending until ``settle`` files it in the memory
tier, which the writer thread does, and every reader of the memory tier first. A snapshot
that can be stored is written to disk behind (``queue``), through one door (``admit``: the
write policy and the daily budget), then the disk budget is kept. Whatever leaves memory
(eviction by the limits, memory pressure, a discard) is written first if it never was; what
is lost instead (a skip, a full queue, a cache that cannot be stored) is remembered
(``misses.Ghosts``) so a later miss can say why. Disk failures cost at most a miss
(``disk_errors.DiskErrors``). Hits are credited to their disk entries in batches, here too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Hashable, Iterator

import mlx.core as mx
import numpy as np

from . import codec, files, segments
from .budget import evict_to
from .counters import Counters
from .disk import DiskTier, PersistJob
from .disk_errors import DiskErrors
from .identity import Identity
from .index import IndexFailure
from .keys import TOKEN_BYTES, TokenError
from .layout import Layout
from .fit import layout_problem
from .memory import ORDERING, MemoryTier, Snapshot
from .misses import EVICTED_DISK, EVICTED_UNWRITTEN, Ghosts
from .pressure import Gauge
from .query import Query
from .write_policy import WritePolicy
from .writer import Writer
from .bytes_written import written

log = logging.getLogger("kvstore")
INSERT_WAIT_S = 30.0  # the longest a lookup waits for an insert begun on another thread
Evicted = list[tuple[Hashable, list[int], Snapshot]]


class WritePath:
    """One store's inserts and writes. Its state is handed in: the memory tier and the
    lock guarding it, the disk tier and writer (None: memory only), counters, the error
    policy, the write policy, the disk budget, the memory gauge (None: a fixed budget)."""

    def __init__(self, memory: MemoryTier, lock: threading.RLock, counters: Counters, errors: DiskErrors,
                 disk: DiskTier | None, writer: Writer | None, policy: WritePolicy, *,
                 max_bytes: int, max_disk_bytes: int | None, gauge: Gauge | None) -> None:
        self.memory, self.lock, self.counters, self.errors = memory, lock, counters, errors
        self.disk, self.writer, self.policy = disk, writer, policy
        self.max_bytes, self.max_disk_bytes, self.gauge = max_bytes, max_disk_bytes, gauge
        self.ghosts = Ghosts()
        self.on_written: Callable[[PersistJob], None] | None = None  # the shared tier's publish
        self._pending: list[tuple[Hashable, list[int], Snapshot]] = []  # inserts not in the tier yet
        self._inserting: dict[int, int] = {}  # thread id -> inserts under way that are not pending yet
        self._inserted = threading.Condition(lock)
        self._host: dict[int, dict[str, Any]] = {}  # id(pending snapshot) -> its host views
        self._described: set[bytes] = set()  # salted identities filed in the index
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._touch_scheduled = False
        self._relief_queued = False

    @property
    def disk_on(self) -> bool:
        return self.disk is not None and not self.errors.off

    # -- insert ------------------------------------------------------------------------

    def insert(self, mem_key: Hashable, ident: Identity | None, tokens: list[int], enc: bytes, cache: list[Any],
               cache_type: str, vocab: int | None) -> tuple[Snapshot, str | None]:
        """Check and snapshot ``cache`` (holding ``tokens``), make it pending (any lookup
        from now on finds it), and queue its filing and write; returns the snapshot and
        why it cannot be persisted (None: it can). Raises ValueError for bad input,
        storing nothing."""
        with self.inserting():  # the store's insert has begun it already: a count per thread
            snap, covered, why = self._take(mem_key, ident, tokens, enc, cache, cache_type, vocab)
        if snap.tensors is not None and ident is not None and self.disk_on and covered > 0:
            host = self._host_views(snap)
            if host is not None:
                with self.lock:
                    snap.persist = (ident, enc[: covered * TOKEN_BYTES])
                    self._host[id(snap)] = host
        job = lambda: self._file(snap)  # noqa: E731
        if self.writer is None or not self.writer.submit(job):
            job()  # no writer, or its queue is full: here, as before
        return snap, why

    @contextlib.contextmanager
    def inserting(self) -> Iterator[None]:
        """An insert under way on this thread: a lookup on another thread (``settle``) waits
        for it until it is pending. Counted without taking the lock, so that nothing
        between the caller's call and the count can give another thread the chance to look
        up first: mlx_lm.server ends a response (``rqueue.put(None)``) just before it
        inserts that response's cache, and a client's next lookup must find it (only the
        counting thread changes its own count; the GIL keeps each change whole)."""
        me = threading.get_ident()
        self._inserting[me] = self._inserting.get(me, 0) + 1
        try:
            yield
        finally:
            if self._inserting[me] > 1:
                self._inserting[me] -= 1
            else:
                del self._inserting[me]
            with self.lock:  # after the change: a waiting settle rechecks under the lock
                self._inserted.notify_all()

    def _take(self, mem_key: Hashable, ident: Identity | None, tokens: list[int], enc: bytes, cache: list[Any],
              cache_type: str, vocab: int | None) -> tuple[Snapshot, int, str | None]:
        if cache_type not in ORDERING:
            raise ValueError(f"cache_type must be one of {list(ORDERING)}, got {cache_type!r}")
        check_cache(cache)
        if ident is not None and tokens and vocab is not None:
            top = int(np.frombuffer(enc, dtype="<i8").max())
            if top >= vocab:
                raise TokenError(f"token id {top} is out of the vocabulary of {ident.name} (vocab_size {vocab})")
        snap, covered, why = snapshot(cache, len(tokens), cache_type)
        # Evaluated before any lookup can find it: its views are made on this thread's
        # stream, and MLX streams are per thread (Metal, MLX >= 0.31.2), so no other thread
        # could evaluate them. (Views: free once the caller's cache is computed.)
        mx.eval([a for c in snap.opaque for a in codec.layer_arrays(c)] if snap.opaque is not None
                else list((snap.tensors or {}).values()))
        with self.lock:  # from here on a lookup finds it
            self._pending.append((mem_key, tokens, snap))
        return snap, covered, why

    def settle(self) -> list[Snapshot]:
        """File the inserts still pending into the memory tier, in order, and queue what
        that evicted for disk; returns the snapshots filed. ``insert`` leaves this to the
        writer thread (the trie and the limits cost O(prompt) of Python), and every reader
        of the memory tier does it first, so a lookup always sees every earlier insert."""
        with self.lock:
            me = threading.get_ident()  # an insert another thread has begun is waited for
            if not self._inserted.wait_for(lambda: not [t for t in list(self._inserting) if t != me],
                                           timeout=INSERT_WAIT_S):
                log.warning("kvstore: an insert on another thread took over %.0f s; this lookup does not "
                            "wait for it", INSERT_WAIT_S)
            if not self._pending:
                return []
            pending, self._pending = self._pending, []
            evicted: Evicted = []
            squeezed = self.follow_memory() < self.max_bytes  # memory, not the user's cap, sets the budget
            for mem_key, tokens, snap in pending:
                evicted += self.memory.insert(mem_key, tokens, snap)
            if squeezed and evicted:
                self.counters.add("evictions_pressure", len(evicted))
        self.write_evicted(evicted)
        return [snap for _, _, snap in pending]

    def _file(self, snap: Snapshot) -> None:
        """The writer thread's half of ``insert``: the pending inserts into the memory
        tier, then ``snap`` to disk."""
        self.settle()
        self.queue(snap)

    # -- to disk -----------------------------------------------------------------------

    def queue(self, snap: Snapshot) -> None:
        """Write ``snap`` to disk (queued; inline on the writer thread) unless it is there
        or queued already, or has nothing to write. A new snapshot's layout is checked
        against its identity first: a cache that does not fit is never stored under it."""
        with self.lock:  # claimed once: the writer's settle and a close may meet here
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
        query = Query(enc, ident.digest, self.disk.chunk)
        job = PersistJob(ident, enc, query.key, host, snap.layout or Layout(), snap.cache_type, query=query)
        snap.disk_key = job.key
        if self.writer.on_thread():  # settling on the writer thread: write now, keep the queue's room
            self.persist(job)
            return True
        return self.writer.submit(lambda: self.persist(job))

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

    def admit(self, job: PersistJob, *, framed: bool = False) -> PersistJob | None:
        """The one door to the disk tier: every write (a persist, a shared hit filed here)
        asks the write policy and the daily budget first. The job to write (for "reused"
        perhaps its prefix), or None, the skip counted and remembered."""
        assert self.disk is not None
        admitted = self.policy.admit(self.disk, job, framed=framed)
        if isinstance(admitted, str):
            self.counters.add(f"writes_skipped_{admitted}")
            detail = "the daily write budget" if admitted == "budget" else f"the write policy ({self.policy.persist})"
            self.ghosts.add(job.identity.digest, EVICTED_UNWRITTEN, detail, job.n, enc=job.tokens)
            return None
        return admitted

    def describe(self, ident: Identity) -> None:
        """File a salted identity's description (``salt.salted``: the model's, marked
        salted; never the salt) before its first entry, once per process, so maintenance
        (ls, gc of missing models) sees whose entries they are."""
        if ident.info.get("salted") and ident.digest not in self._described and self.disk is not None:
            self.disk.index.put_identity(ident.digest, ident.info)
            self._described.add(ident.digest)

    def keep_disk_budget(self) -> None:
        """After every write: evict least recently used entries down to ``max_disk_bytes``."""
        if self.max_disk_bytes is not None and self.disk is not None:
            gone = evict_to(self.disk, self.max_disk_bytes)
            self.counters.add("gc_runs", int(bool(gone)), evictions_disk=len(gone),
                              gc_freed_bytes=sum(r.freed for r in gone))
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

    def write_unwritten(self, timeout: float | None) -> None:
        """Queue the snapshots still in memory whose write was dropped (queue full): at
        close there is no generation left to hold up, so wait for room if needed."""
        assert self.writer is not None
        with self.lock:
            pending = [s for s in self.memory.snapshots() if not s.persisted and s.persist is not None]
        for snap in pending:
            self.queue(snap)
            if not snap.persisted and snap.persist is not None:
                self.writer.flush(timeout)
                self.queue(snap)

    def _host_views(self, snap: Snapshot) -> dict[str, Any] | None:
        """``segments.host_views`` of a snapshot (MLX work: the caller's thread), None if its
        dtype cannot be stored (said once)."""
        try:
            return segments.host_views(snap.tensors)  # type: ignore[arg-type]
        except TypeError as e:
            self.errors.warn_once("dtype", "kvstore: %s; kept in memory only", e)
            return None

    # -- hits --------------------------------------------------------------------------

    def credit(self, key: bytes | None) -> None:
        """Credit a hit to disk entry ``key`` (last used, hits), batched on the writer thread."""
        if key is None or self.writer is None:
            return
        with self.lock:
            _when, hits = self._touches.get(key, (0.0, 0))
            self._touches[key] = (time.time(), hits + 1)
            schedule = not self._touch_scheduled
            self._touch_scheduled = True
        if schedule and not self.writer.submit(self.flush_credits):
            self._touch_scheduled = False

    def flush_credits(self) -> None:
        with self.lock:
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

    # -- memory pressure ---------------------------------------------------------------

    def follow_memory(self) -> int:
        """Set the memory tier's byte budget from the machine's available memory (the
        user's ``max_bytes`` stays a hard cap); returns it. Called under the lock."""
        if self.gauge is None:
            return self.memory.max_bytes
        self.memory.max_bytes = self.gauge.budget(self.memory.nbytes, self.max_bytes)
        return self.memory.max_bytes

    def memory_tick(self) -> None:
        """The memory watch's look (every ``pressure.WATCH_SECONDS``): when the tier holds
        more than the budget allows, relief is queued on the writer thread (once at a
        time), where each evicted entry is written before it goes."""
        with self.lock:
            over = self.memory.nbytes > self.follow_memory() and len(self.memory) > 0
            if not over or self._relief_queued:
                return
            self._relief_queued = True

        def relief() -> None:
            try:
                self.relieve_memory()
            finally:
                self._relief_queued = False

        if self.writer is None or not self.writer.submit(relief):
            relief()  # memory only (nothing to write first), or a full queue: relieve now

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

    def relieve_memory(self) -> int:
        """Give memory back when available memory fell under the floor: entries leave the
        memory tier least valuable first (mlx-lm's eviction order), each written to disk
        first when it is not there yet (run on the writer thread, the writes are inline),
        then MLX's buffer cache is emptied so the bytes go back to the system. Returns the
        entries evicted."""
        with self.lock:
            budget = self.follow_memory()
            evicted = self.memory.trim_to(n_bytes=budget) if self.memory.nbytes > budget else []
        if not evicted:
            return 0
        self.counters.add("evictions_pressure", len(evicted))
        self.write_evicted(evicted)
        del evicted
        mx.clear_cache()  # the allocator's free buffers, not a limit or a setting of the host
        return 1


def snapshot(cache: list[Any], n_tokens: int, cache_type: str) -> tuple[Snapshot, int, str | None]:
    """(the snapshot of ``cache``, positions it covers, why it cannot be persisted or None)."""
    try:
        tensors, layout = codec.encode_cache(cache)
    except codec.Unsupported as e:
        nbytes = sum(getattr(c, "nbytes", 0) for c in cache) if isinstance(cache, (list, tuple)) else 0
        trim = bool(cache) and all(getattr(c, "is_trimmable", lambda: False)() for c in cache)
        return Snapshot(None, None, cache, nbytes, trim, cache_type), 0, str(e)
    offsets = [m["offset"] for m in layout.flat if "offset" in m]
    covered = min(offsets) if offsets else n_tokens
    if covered > n_tokens:
        raise ValueError(f"cache holds {covered} positions but only {n_tokens} tokens were given")
    if len(set(offsets)) > 1:
        raise ValueError(f"cache layers disagree on their length: {sorted(set(offsets))}")
    if not offsets:  # recurrent state only: it must be taken at the prefix boundary
        covered = n_tokens
    try:  # what the snapshot keeps alive: its views pin the whole allocated buffers,
        # which is also what mlx-lm's LRUPromptCache counts against max_bytes
        nbytes = int(sum(c.nbytes for c in cache))
    except Exception:
        nbytes = codec.cache_nbytes(tensors)
    return Snapshot(tensors, layout, None, nbytes, layout.covers_prefixes, cache_type), covered, None


def check_cache(cache: Any) -> None:
    """A prompt cache is a non-empty list of cache objects whose arrays hold what they claim."""
    if not isinstance(cache, (list, tuple)) or not cache:
        raise ValueError(f"cache must be a non-empty list of cache objects (one per layer), "
                         f"got {type(cache).__name__}{' (empty)' if isinstance(cache, (list, tuple)) else ''}")
    for i, c in enumerate(codec.flat_layers(cache)):
        if not (hasattr(type(c), "state") or hasattr(c, "nbytes")) or isinstance(c, (int, float, str, bytes)):
            raise ValueError(f"cache layer {i} is a {type(c).__name__}, not a cache object")
    why = codec.check_holds(cache)
    if why:
        raise ValueError(f"cache {why}")
