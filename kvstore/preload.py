"""Preload: restore a model's stored entries into the memory tier, ahead of traffic.

``Preloader.run`` is ``KVStore.preload`` (its docstring says what is guaranteed): it tries a
model's entries in ``preload_order`` and puts each into the memory tier only if it fits the
room left and drops no stored prefix, so nothing already in memory is evicted or replaced.
It reads the disk through the store (``read``: a miss, never an error, as ``fetch`` reads)
and files each entry by the memory tier's own check (``MemoryTier.add_cold``: it goes in only
where it evicts nothing); ``Preloaded`` is its report.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .disk import DiskTier, Restored
from .disk_errors import DiskErrors
from .index import IndexFailure
from .identity import Identity
from .keys import TOKEN_BYTES, decode_tokens
from .memory import MemoryTier, Room, Snapshot


@dataclass
class Preloaded:
    """What ``KVStore.preload`` put in the memory tier: ``entries`` holding ``tokens`` and
    ``nbytes``, out of ``candidates`` tried in order; ``skipped`` were held already, would
    have dropped a held prefix, or could not be read; ``stopped``: "done", "budget" (the
    next one did not fit), "stopped", "nothing stored"."""

    entries: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    candidates: int = 0
    skipped: int = 0
    stopped: str = ""
    running: bool = False

    def add(self, tokens: int, nbytes: int | None) -> None:
        """Count one candidate: preloaded (``nbytes`` given) or skipped (None)."""
        if nbytes is None:
            self.skipped += 1
            return
        self.entries += 1
        self.tokens += tokens
        self.nbytes += nbytes

    def as_stats(self) -> dict[str, Any]:
        return {"preloaded_entries": self.entries, "preloaded_tokens": self.tokens,
                "preloaded_bytes": self.nbytes, "preload_seconds": round(self.seconds, 3),
                "preload_skipped": self.skipped, "preload_running": self.running}


def preload_order(entries: dict[bytes, Any], identity: bytes, how: int | str) -> list[tuple[bytes, Any]]:
    """``(key, EntryRecord)`` of ``identity`` in the order ``KVStore.preload`` tries them:
    pinned first, then by ``(1 + hits) x n``, then most recently used. ``how`` "pinned"
    keeps the pinned ones, "auto" all, an int N the first N. Unreadable records (None) are
    left out."""
    if not (how in ("pinned", "auto") or (isinstance(how, int) and how >= 0)):
        raise ValueError(f"preload must be 'pinned', 'auto' or a number of entries >= 0, got {how!r}")
    mine = [(k, r) for k, r in entries.items() if r is not None and r.identity == identity]
    mine.sort(key=lambda kr: (not kr[1].pinned, -(1 + kr[1].hits) * kr[1].n, -kr[1].last_used, kr[0]))
    if how == "pinned":
        return [(k, r) for k, r in mine if r.pinned]
    return mine[:how] if isinstance(how, int) else mine  # validated above: "auto" or an int


@dataclass
class Preloader:
    """What a preload needs from its store: its memory tier, its
    disk tier and error policy (None, or a damaged index: nothing to preload), and two of
    the store's answers, each a miss rather than an error: ``identity`` of a model key and
    ``read`` (one whole stored prefix, restored as ``fetch`` restores)."""

    memory: MemoryTier
    disk: DiskTier | None
    errors: DiskErrors
    identity: Callable[[Any], Identity | None]
    read: Callable[[Identity, bytes], Restored | None]

    def disk_on(self, ident: Identity | None) -> bool:
        return ident is not None and self.disk is not None and not self.errors.off

    def entries(self) -> dict[bytes, Any] | None:
        """Every entry record on disk (None for unreadable ones), or None if they cannot
        be listed (logged once; a damaged index switches the disk tier off)."""
        from .index import scan

        try:
            return scan(self.disk.index, full=False).entries  # type: ignore[union-attr]
        except IndexFailure as e:
            if not self.errors.index_damaged(e, self.disk):
                self.errors.warn_once("preload", "kvstore: cannot list entries to preload (%s)", e)
            return None

    def tokens(self, key: bytes) -> bytes | None:
        return self.disk.index.view(lambda r: r.tokens(key))  # type: ignore[union-attr]

    def run(self, report: Preloaded, model: Any, how: int | str, max_bytes: int | None,
            progress: Callable[[int, int], None] | None, stop: threading.Event | None) -> Preloaded:
        """Fill ``report`` while preloading ``model``'s entries (``KVStore.preload``).

        Order: pinned entries first, then by value, ``(1 + hits) x tokens`` (an entry's write
        counts as its first use), the most recently used first on ties. ``how``: "pinned"
        (pinned entries only), "auto" (all of them), or an int N (the first N).
        Guarantees: nothing already in memory is evicted or replaced. An entry goes in only
        if it fits the room left (``max_entries``, the memory tier's ``max_bytes``, and
        ``max_bytes`` here) and its insertion drops no stored prefix (mlx-lm's rule for a
        trimmable entry); the first entry that does not fit ends the preload (its bytes
        are known once read, so that one entry may be read for nothing). A preloaded
        entry is an ordinary memory entry (same LRU lists, limits, byte accounting) filed
        least recently used, so live inserts outrank it. No hit is credited on disk; a
        damaged entry is dropped and counted as ``fetch`` does; nothing is raised.
        ``stop`` ends it between two entries; ``progress(done, total)`` is called once the
        candidates are known, then after each."""
        t0 = time.perf_counter()
        try:
            ident = self.identity(model)
            order = self._order(ident, how)
            report.candidates = len(order)
            if not self.disk_on(ident):
                report.stopped = "no disk tier for this model"
            if progress is not None and order:
                progress(0, len(order))
            for done, (key, rec) in enumerate(order, 1):
                if stop is not None and stop.is_set():
                    report.stopped = "stopped"
                    break
                got = self._one(ident, key, rec, max_bytes)  # type: ignore[arg-type]
                if got is Room.FULL:
                    report.stopped = "budget"
                    break
                report.add(rec.n, got.nbytes if isinstance(got, Snapshot) else None)
                if progress is not None:
                    progress(done, len(order))
            else:
                report.stopped = report.stopped or ("done" if order else "nothing stored")
        finally:
            report.seconds = time.perf_counter() - t0
            report.running = False
        return report

    def _order(self, ident: Identity | None, how: int | str) -> list[tuple[bytes, Any]]:
        """The entries the preload tries, in order (none without a disk tier)."""
        if not self.disk_on(ident):
            return []
        entries = self.entries()
        return [] if entries is None else preload_order(entries, ident.digest, how)  # type: ignore[union-attr]

    def _one(self, ident: Identity, key: bytes, rec: Any, max_bytes: int | None) -> Snapshot | Room | None:
        """Put one entry into memory: its Snapshot, else why not: ``Room.SKIP`` / None (it is
        held, would drop a held prefix / is gone or unreadable: skipped) or ``Room.FULL``
        (it does not fit the room left: the preload ends)."""
        enc = self.tokens(key)
        if enc is None or len(enc) != rec.n * TOKEN_BYTES:
            return None
        tokens = decode_tokens(enc)
        why = self.memory.room(ident.digest, tokens, rec.trimmable, 0, max_bytes)
        if why is not None:
            return why
        got = self.read(ident, enc)
        if got is None:
            return None
        snap = Snapshot.kept(got.tensors, got.layout, rec.cache_type, key)
        why = self.memory.add_cold(ident.digest, tokens, snap, max_bytes)
        return snap if why is None else why
