"""Budgets and garbage collection: LRU eviction to a byte budget, ``gc``'s rules."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .records import ORPHAN_BLOB_SECONDS, STALE_TMP_SECONDS, Problem, Snapshot, snapshot
from .fsck import verify

if TYPE_CHECKING:  # maintenance needs no MLX itself; DiskTier is only a type here
    from ..disk import DiskTier

def lru_order(records: Iterable[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
    """Eviction order: unpinned before pinned, least recently used first."""
    def when(rec: dict) -> float:
        v = rec.get("last_used", 0)
        return float(v) if isinstance(v, (int, float)) else 0.0

    return sorted(records, key=lambda kr: (bool(kr[1].get("pinned")), when(kr[1])))


class _Sim:
    """What removing entries would free, chunk refcounts included (for dry runs and for
    reporting what a real removal freed)."""

    def __init__(self, snap: Snapshot) -> None:
        self.total = snap.meta_bytes
        self.refs = {k: int(r.get("refs", 0)) for k, r in snap.chunks.items() if r}
        self.sizes = {k: int(r.get("size", 0)) for k, r in snap.chunks.items() if r}
        self.gone: set[bytes] = set()

    def preview(self, rec: dict, drops: dict[bytes, int]) -> int:
        """What removing ``rec`` would free after the entries already counted in ``drops``
        (chunk key -> references they drop; updated) went, without removing anything."""
        freed = int(rec.get("size") or 0)
        for ck in rec.get("chunks", []):
            k = bytes.fromhex(ck)
            drops[k] = drops.get(k, 0) + 1
            if k in self.refs and self.refs[k] == drops[k]:
                freed += self.sizes[k]
        return freed

    def remove(self, key: bytes, rec: dict) -> int:
        if key in self.gone:
            return 0
        self.gone.add(key)
        freed = int(rec.get("size") or 0)
        for ck in rec.get("chunks", []):
            k = bytes.fromhex(ck)
            if k in self.refs:
                self.refs[k] -= 1
                if self.refs[k] == 0:
                    freed += self.sizes[k]
        self.total -= freed
        return freed


def evict_to(disk: DiskTier, max_bytes: int, *, dry_run: bool = False) -> list[tuple[bytes, dict]]:
    """Drop least recently used entries (pinned last) until the blobs fit ``max_bytes``.

    Sizes count shared chunks once; an entry's eviction frees only what no other entry
    still references, so this loops on the index total rather than predicting it. Each
    returned record carries ``_frees``: the bytes its removal freed (or would free).
    """
    if disk.index.total_bytes() <= max_bytes:
        return []
    snap = snapshot(disk, full=False)
    return _evict(disk, _Sim(snap), [(k, r) for k, r in snap.entries.items() if r], max_bytes, dry_run)


def _evict(disk: DiskTier, sim: _Sim, records: list[tuple[bytes, dict]], max_bytes: int,
           dry_run: bool) -> list[tuple[bytes, dict]]:
    """Remove in LRU order, a batch per transaction: each batch is what the simulation
    says reaches ``max_bytes`` (at most ``BATCH``); the index total is re-read between
    batches, so concurrent writers and shared chunks only cost another round."""
    gone: list[tuple[bytes, dict]] = []
    order = [kr for kr in lru_order((k, r) for k, r in records) if kr[0] not in sim.gone]
    i = 0
    while i < len(order):
        total = sim.total if dry_run else disk.index.total_bytes()
        if total <= max_bytes:
            break
        batch, frees, drops = [], 0, {}
        while i < len(order) and len(batch) < BATCH and frees < total - max_bytes:
            batch.append(order[i])
            frees += sim.preview(order[i][1], drops)
            i += 1
        done = set(k for k, _ in batch) if dry_run else _remove_many(disk, batch)
        gone += [(k, dict(r, _frees=sim.remove(k, r))) for k, r in batch if k in done]
    return gone


BATCH = 256  # entries removed per transaction (one fsync each)


def _remove_many(disk: DiskTier, batch: list[tuple[bytes, dict]],
                 guard: Callable[[dict], bool] | None = None) -> set[bytes]:
    """Remove entries in one transaction, each unless it was pinned or unpinned since its
    record was read, or ``guard`` rejects its current record (checked in the transaction).
    A use since then does not save it from a size budget (a busy server touches everything
    all the time), only from ``max_age`` (whose guard re-checks the age). Returns the keys
    removed; a malformed record in the way leaves the batch to ``verify --fix``."""
    pinned = {k: bool(r.get("pinned")) for k, r in batch}
    removed: list[bytes] = []

    def only_if(key: bytes, cur: dict) -> bool:
        return bool(cur.get("pinned")) == pinned[key] and (guard is None or guard(cur))

    try:
        disk.remove([k for k, _ in batch], only_if=only_if, removed=removed)
    except (ValueError, KeyError, TypeError):
        if len(batch) == 1:
            return set()
        return set().union(*(_remove_many(disk, [kr], guard) for kr in batch))
    return set(removed)


@dataclass
class GcResult:
    removed: list[dict] = field(default_factory=list)   # {"key", "reason", "bytes", "tokens", ...}
    problems: list[Problem] = field(default_factory=list)  # orphans / broken records found
    dry_run: bool = False

    @property
    def freed(self) -> int:
        return sum(r["bytes"] for r in self.removed) + sum(
            p.bytes for p in self.problems if p.fixed or self.dry_run)

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "freed_bytes": self.freed, "removed": self.removed,
                "problems": [p.to_dict() for p in self.problems]}


def gc(disk: DiskTier, *, max_bytes: int | None = None, max_age: float | None = None,
       identities: Iterable[str] = (), missing_models: bool = False, orphans: bool = True,
       dry_run: bool = False, tmp_age: float = STALE_TMP_SECONDS,
       blob_age: float = ORPHAN_BLOB_SECONDS, now: float | None = None) -> GcResult:
    """Collect garbage, in this order:

    1. entries of the named identities (hex prefixes) and, with ``missing_models``, of
       identities whose model directory no longer exists (pinned ones too: the pin guards
       against budgets, not against dropping a model);
    2. unpinned entries not used for ``max_age`` seconds (pinned entries never age out);
    3. least recently used entries until the blobs fit ``max_bytes`` (pinned ones only
       when nothing else is left);
    4. with ``orphans``: orphan blobs, stale temp files, orphan chunks and records whose
       blobs are gone or the wrong size (``verify`` with sizes only, repaired).

    ``dry_run`` changes nothing (open the index read-only for it) and reports what would go.
    """
    now = time.time() if now is None else now
    snap = snapshot(disk)
    sim = _Sim(snap)
    res = GcResult(dry_run=dry_run)
    records = [(k, r) for k, r in snap.entries.items() if r]
    idents = [s.lower() for s in identities]

    def note(key: bytes, rec: dict, reason: str, freed: int) -> None:
        ident = snap.identities.get(rec.get("identity", ""), {})
        res.removed.append({"key": key.hex(), "reason": reason, "bytes": freed, "tokens": rec.get("n"),
                            "identity": rec.get("identity"), "model": ident.get("name"),
                            "pinned": bool(rec.get("pinned")), "last_used": rec.get("last_used")})

    def take(items: list[tuple[bytes, dict]], reason: str, guard: Callable[[dict], bool] | None = None) -> None:
        items = [(k, r) for k, r in items if k not in sim.gone]
        for j in range(0, len(items), BATCH):
            batch = items[j : j + BATCH]
            done = {k for k, _ in batch} if dry_run else _remove_many(disk, batch, guard)
            for key, rec in batch:
                if key in done:
                    note(key, rec, reason, sim.remove(key, rec))

    gone_models = set()
    if missing_models:
        for hx, info in snap.identities.items():
            p = info.get("path")
            if p and not Path(p).exists():
                gone_models.add(hx)
    named = [(k, r) for k, r in lru_order(records) if any(r.get("identity", "").startswith(p) for p in idents)]
    take(named, "identity")
    take([(k, r) for k, r in lru_order(records) if r.get("identity", "") in gone_models], "missing_model")
    if max_age is not None:
        cutoff = now - max_age
        take([(k, r) for k, r in lru_order(records) if not r.get("pinned") and r.get("last_used", 0) < cutoff],
             "max_age", guard=lambda cur: cur.get("last_used", 0) < cutoff)
    if max_bytes is not None:
        for key, rec in _evict(disk, sim, records, max_bytes, dry_run):
            note(key, rec, "max_bytes", rec["_frees"])
    if orphans:
        res.problems = verify(disk, fix=not dry_run, checksums=False, tmp_age=tmp_age,
                              blob_age=blob_age, now=now)
        if dry_run:  # records that step 1-3 would already have removed are no news
            res.problems = [p for p in res.problems
                            if not (p.record == "entry" and p.key and bytes.fromhex(p.key) in sim.gone)]
    return res
