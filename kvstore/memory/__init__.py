"""The memory tier: hot prefix snapshots (``entries``: mlx-lm's matching and eviction), its
lock, the inserts not filed yet, and the byte budget memory pressure sets.

An insert is made pending on the caller's thread (``put``: cheap, so a response is not held
up by the trie and the limits, O(prompt) of Python) and filed by ``settle``, which the
writer thread runs behind it and every read of this tier runs first: whatever a caller
reads here (a lookup, a count, the bytes held) already holds every earlier insert, and an
insert another thread has begun (``inserting``) is waited for. What leaves the tier (its
limits, memory pressure, ``trim_to``, ``remove``) is handed to ``on_evict``, the write path's,
outside the lock; this tier knows nothing of disks. With a ``pressure.Gauge`` the byte
budget follows the machine's available memory (the user's ``max_bytes`` stays a hard cap):
set at every filing, and by the memory watch (``tick``), whose relief runs ``behind``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import mlx.core as mx

from ..counters import Counters
from ..misses import Near
from ..pressure import Gauge
from .entries import Entries, Evicted, Room, Trie
from .snapshot import ORDERING, Snapshot, check, take
from ..escape import logger

__all__ = ["MemoryTier", "Snapshot", "ORDERING", "Evicted", "Room", "Trie", "check", "take"]
log = logger("kvstore")
INSERT_WAIT_S = 30.0  # the longest a read waits for an insert begun on another thread


class MemoryTier(Entries):
    """Thread-safe: every public method settles pending inserts first and runs under the
    tier's own lock. ``on_evict`` receives what leaves (called outside the lock);
    ``behind(job)`` runs a job where evicted entries are written (False: it could not be
    queued, the job is run here); ``counters`` counts pressure evictions."""

    def __init__(self, max_entries: int = 10, max_bytes: int = 1 << 63, *, touch_on_hit: bool = False,
                 gauge: Gauge | None = None, counters: Counters | None = None,
                 on_evict: Callable[[Evicted], None] | None = None,
                 behind: Callable[[Callable[[], None]], bool] | None = None) -> None:
        super().__init__(max_entries, max_bytes, touch_on_hit=touch_on_hit)
        self.cap = max_bytes  # the user's hard cap; the gauge may hold the tier below it
        self.gauge = gauge
        self._counters = counters if counters is not None else Counters()
        self._on_evict = on_evict if on_evict is not None else (lambda evicted: None)
        self._behind = behind if behind is not None else (lambda job: False)
        self._lock = threading.RLock()
        self._pending: list[tuple[Hashable, list[int], Snapshot]] = []  # inserts not filed yet
        self._inserting: dict[int, int] = {}  # thread id -> inserts under way that are not pending yet
        self._inserted = threading.Condition(self._lock)
        self._relief_queued = False

    # -- inserts -----------------------------------------------------------------------

    @contextlib.contextmanager
    def inserting(self) -> Iterator[None]:
        """An insert under way on this thread: a read on another thread (``settle``) waits
        for it until it is pending. Counted without taking the lock, so that nothing
        between the caller's call and the count can give another thread the chance to look
        up first: mlx_lm.server ends a response (``rqueue.put(None)``) just before it
        inserts that response's cache, and a client's next lookup should find it (only the
        counting thread changes its own count; the GIL keeps each change whole). A lookup
        that runs before the host calls the insert at all cannot see it."""
        me = threading.get_ident()
        self._inserting[me] = self._inserting.get(me, 0) + 1
        try:
            yield
        finally:
            if self._inserting[me] > 1:
                self._inserting[me] -= 1
            else:
                del self._inserting[me]
            with self._lock:  # after the change: a waiting settle rechecks under the lock
                self._inserted.notify_all()

    def put(self, model: Hashable, tokens: list[int], snap: Snapshot) -> None:
        """Make ``snap`` (a snapshot of ``tokens``, its evaluation scheduled) pending: from here on every
        read finds it; ``settle`` files it."""
        with self._lock:
            self._pending.append((model, tokens, snap))

    def settle(self) -> list[Snapshot]:
        """File the inserts still pending, in order, and hand what that evicted to
        ``on_evict``; returns the snapshots filed."""
        with self._lock:
            me = threading.get_ident()  # an insert another thread has begun is waited for
            if not self._inserted.wait_for(lambda: not [t for t in list(self._inserting) if t != me],
                                           timeout=INSERT_WAIT_S):
                log.warning("kvstore: an insert on another thread took over %.0f s; this lookup does not "
                            "wait for it", INSERT_WAIT_S)
            if not self._pending:
                return []
            pending, self._pending = self._pending, []
            evicted: Evicted = []
            squeezed = self._follow() < self.cap  # memory, not the user's cap, sets the budget
            for model, tokens, snap in pending:
                evicted += Entries.insert(self, model, tokens, snap)
            if squeezed and evicted:
                self._counters.add("evictions_pressure", len(evicted))
        self._on_evict(evicted)
        return [snap for _, _, snap in pending]

    # -- reads: settled first, under the lock --------------------------------------------

    @contextlib.contextmanager
    def _settled(self) -> Iterator[None]:
        """Every public read and change runs here: pending inserts filed, then the lock held."""
        self.settle()
        with self._lock:
            yield

    def lookup(self, model: Hashable, tokens: list[int], near: Near | None = None,
               floor: int = 0) -> tuple[list[Any] | None, int, Snapshot | None]:
        with self._settled():
            return super().lookup(model, tokens, near, floor)

    def peek(self, model: Hashable, tokens: list[int], floor: int = 0) -> int:
        with self._settled():
            return super().peek(model, tokens, floor)

    def get(self, model: Hashable, tokens: list[int]) -> Snapshot | None:
        with self._settled():
            return super().get(model, tokens)

    def holds_prefix(self, model: Hashable, tokens: list[int]) -> bool:
        with self._settled():
            return super().holds_prefix(model, tokens)

    def snapshots(self) -> list[Snapshot]:
        with self._settled():
            return super().snapshots()

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        with self._settled():
            return super().stats_by_type()

    def __len__(self) -> int:
        with self._settled():
            return self._count()

    @property
    def nbytes(self) -> int:
        with self._settled():
            return self._held()

    def room(self, model: Hashable, tokens: list[int], trimmable: bool, nbytes: int,
             max_bytes: int | None = None) -> Room | None:
        with self._settled():
            return super().room(model, tokens, trimmable, nbytes, max_bytes)

    # -- changes: what leaves goes to on_evict ---------------------------------------------

    def insert(self, model: Hashable, tokens: list[int], snap: Snapshot, *, recent: bool = True) -> Evicted:
        """File ``snap`` now (a restored snapshot kept hot); what it evicts goes to ``on_evict``."""
        with self._settled():
            evicted = super().insert(model, tokens, snap, recent=recent)
        self._on_evict(evicted)
        return evicted

    def add_cold(self, model: Hashable, tokens: list[int], snap: Snapshot, max_bytes: int | None = None) -> Room | None:
        """File ``snap`` least recently used (a snapshot nobody asked for yet) only if it
        fits without evicting or dropping anything (``room``); None, or why it was not."""
        with self._settled():
            why = super().room(model, tokens, snap.trimmable, snap.nbytes, max_bytes)
            if why is None:
                super().insert(model, tokens, snap, recent=False)  # fits: evicts nothing
        return why

    def remove(self, model: Hashable, tokens: list[int]) -> Snapshot | None:
        """Take out the snapshot stored under exactly ``tokens`` (handed to ``on_evict``);
        None if there is none."""
        with self._settled():
            snap = super().remove(model, tokens)
        if snap is not None:
            self._on_evict([(model, tokens, snap)])
        return snap

    def trim_to(self, n_sequences: int | None = None, n_bytes: int | None = None) -> Evicted:
        """Shrink to at most ``n_sequences`` entries / ``n_bytes`` (mlx-lm's order); what
        goes is handed to ``on_evict``."""
        with self._settled():
            evicted = super().trim_to(n_sequences, n_bytes)
        self._on_evict(evicted)
        return evicted

    def clear(self) -> Evicted:
        """Empty the tier at once, handing nothing on (a cold start for a test or a
        benchmark: what never reached disk is dropped); returns what was held."""
        with self._settled():
            return super().clear()

    # -- memory pressure ---------------------------------------------------------------

    def _follow(self) -> int:
        """Set the byte budget from the machine's available memory (``cap`` stays a hard
        cap); returns it. Called under the lock."""
        if self.gauge is None:
            return self.max_bytes
        self.max_bytes = self.gauge.budget(self._held(), self.cap)
        return self.max_bytes

    def tick(self) -> None:
        """The memory watch's look (every ``pressure.WATCH_SECONDS``): when the tier holds
        more than the budget allows, relief is queued ``behind`` (once at a time), where
        each evicted entry is written before it goes."""
        with self._lock:
            over = self._held() > self._follow() and self._count() > 0
            if not over or self._relief_queued:
                return
            self._relief_queued = True

        def relief() -> None:
            try:
                self.relieve()
            finally:
                self._relief_queued = False

        if not self._behind(relief):
            relief()  # memory only (nothing to write first), or a full queue: relieve now

    def relieve(self) -> int:
        """Give memory back when available memory fell under the floor: entries leave
        least valuable first (mlx-lm's eviction order), each handed to ``on_evict`` (run
        behind, on the writer thread, its writes are inline), then MLX's buffer cache is
        emptied so the bytes go back to the system. Returns the entries evicted."""
        with self._lock:
            budget = self._follow()
            evicted = super().trim_to(n_bytes=budget) if self._held() > budget else []
        if not evicted:
            return 0
        self._counters.add("evictions_pressure", len(evicted))
        self._on_evict(evicted)
        del evicted
        mx.clear_cache()  # the allocator's free buffers, not a limit or a setting of the host
        return 1
