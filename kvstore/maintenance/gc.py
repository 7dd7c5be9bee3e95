"""``gc``: age, size and model rules, then orphans, on a live cache directory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .. import side_records
from ..budget import BATCH, Removed, Sim, evict_to, lru_order, remove_unchanged, victims
from ..index import scan
from ..records import EntryRecord
from .fsck import NOT_OURS, ORPHAN_BLOB_SECONDS, Problem, verify
from ..superseded import superseded, usage

if TYPE_CHECKING:  # maintenance needs no MLX itself; DiskTier is only a type here
    from ..disk import DiskTier


@dataclass
class GcResult:
    """What ``gc`` removed (or, in a dry run, would remove), and what it would leave."""

    removed: list[dict[str, Any]] = field(default_factory=list)  # key, reason, bytes, tokens, ...
    records_removed: list[dict[str, Any]] = field(default_factory=list)  # side records: directory, name, bytes
    record_bytes_left: int = 0  # side records' bytes left (``side_records``: counted in ``max_bytes``)
    problems: list[Problem] = field(default_factory=list)        # orphans / broken records found
    dry_run: bool = False
    bytes_left: int = 0      # pack bytes left (would be left) after this gc
    entries_left: int = 0

    @property
    def exact(self) -> bool:
        """Whether ``bytes_left`` is exact: a dry run that found broken records can only
        bound what their repair frees (then ``bytes_left`` is at most that)."""
        return not (self.dry_run and any(p.record != "file" for p in self.problems))

    @property
    def freed(self) -> int:
        return sum(r["bytes"] for r in self.removed) + sum(r["bytes"] for r in self.records_removed) + sum(
            p.bytes for p in self.problems if (p.fixed or self.dry_run) and p.kind not in NOT_OURS)

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "freed_bytes": self.freed, "bytes_left": self.bytes_left,
                "entries_left": self.entries_left, "exact": self.exact, "removed": self.removed,
                "records_removed": self.records_removed, "record_bytes_left": self.record_bytes_left,
                "problems": [p.to_dict() for p in self.problems]}


def gc(disk: DiskTier, *, max_bytes: int | None = None, max_age: float | None = None,
       identities: Iterable[str] = (), missing_models: bool = False, orphans: bool = True,
       dry_run: bool = False, blob_age: float = ORPHAN_BLOB_SECONDS, now: float | None = None,
       pinned: bool = False) -> GcResult:
    """Collect garbage, in this order:

    1. entries of the named identities (hex prefixes) and, with ``missing_models``, of
       identities whose model directory no longer exists (pinned ones too: the pin guards
       against budgets, not against dropping a model);
    2. unpinned entries not used for ``max_age`` seconds (pinned entries never age out;
       a last use in the future counts as now);
    3. the side records (``side_records``: ``--stable-prefix``'s), oldest first, down to
       their share of ``max_bytes``; then until the pack files fit what is left: first the unpinned entries of superseded
       identities (``superseded``: another identity of the same model directory started
       storing after their last use, e.g. an mlx-lm upgrade), then least recently used
       entries; pinned ones only with ``pinned`` (the user asked for them: ``kvstore gc
       --include-pinned``), and then only when nothing else is left;
    4. with ``orphans``: orphan pack files, unused chunks and records whose files are gone
       or the wrong size (``verify`` with sizes only, repaired).

    ``dry_run`` changes nothing (open the index read-only for it) and reports what would go
    and what would be left."""
    now = time.time() if now is None else now
    snap = scan(disk.index, full=False)
    sim = Sim(snap)
    res = GcResult(dry_run=dry_run)
    records = lru_order((k, r) for k, r in snap.entries.items() if r)

    def note(removed: Iterable[Removed], reason: str) -> None:
        for r in removed:
            info = snap.identities.get(r.record.identity.hex())
            res.removed.append({"key": r.key.hex(), "reason": "whole_copy" if r.copy else reason, "bytes": r.freed,
                                "tokens": r.record.n,
                                "identity": r.record.identity.hex(), "model": info.name if info else None,
                                "pinned": r.record.pinned, "last_used": r.record.last_used})

    def take(items: list[tuple[bytes, EntryRecord]], reason: str,
             guard: Callable[[EntryRecord], bool] | None = None) -> None:
        items = [(k, r) for k, r in items if k not in sim.gone]
        for j in range(0, len(items), BATCH):
            batch = items[j : j + BATCH]
            done = {k for k, _ in batch} if dry_run else remove_unchanged(disk, batch, guard)
            note((Removed(k, r, sim.remove(k, r)) for k, r in batch if k in done), reason)

    prefixes = [s.lower() for s in identities]
    take([(k, r) for k, r in records if any(r.identity.hex().startswith(p) for p in prefixes)], "identity")
    if missing_models:
        gone = {hx for hx, info in snap.identities.items() if isinstance(info.path, str) and not Path(info.path).exists()}
        take([(k, r) for k, r in records if r.identity.hex() in gone], "missing_model")
    if max_age is not None:
        cutoff = now - max_age
        take([(k, r) for k, r in records if not r.pinned and r.last_used < cutoff], "max_age",
             guard=lambda cur: cur.last_used < cutoff)
    res.record_bytes_left = side_records.total_bytes(disk.root)
    if max_bytes is not None:  # the side records first to their share, then the packs to what is left
        res.records_removed = [{"directory": d, "name": n, "bytes": b} for d, n, b in
                               side_records.trim(disk.root, side_records.bound(max_bytes, max_bytes), dry_run=dry_run)]
        res.record_bytes_left -= sum(r["bytes"] for r in res.records_removed)
        max_bytes = max(0, max_bytes - res.record_bytes_left)
        old = superseded(snap.identities, usage(records))
        stale = [(k, r) for k, r in records if not r.pinned and r.identity.hex() in old and k not in sim.gone]
        planned = victims(sim, stale, sim.total - max_bytes) if stale and sim.total > max_bytes else []
        for j in range(0, len(planned), BATCH):
            batch = planned[j : j + BATCH]
            done = {v.key for v in batch} if dry_run else remove_unchanged(disk, [(v.key, v.record) for v in batch])
            note((v for v in batch if v.key in done), "superseded")
        note(evict_to(disk, max_bytes, dry_run=dry_run, snap=snap, sim=sim, pinned=pinned), "max_bytes")
    if orphans:
        res.problems = verify(disk, fix=not dry_run, checksums=False, blob_age=blob_age, now=now)
        if dry_run:  # records that steps 1-3 would already have removed are no news
            res.problems = [p for p in res.problems
                            if not (p.record == "entry" and p.key and bytes.fromhex(p.key) in sim.gone)]
    if dry_run:
        res.bytes_left = max(0, sim.total - sum(p.bytes for p in res.problems if p.kind == "orphan_pack"))
        res.entries_left = sum(1 for k, _ in records if k not in sim.gone)
    else:
        res.bytes_left, res.entries_left = disk.index.total_bytes(), disk.index.counts()["entries"]
    return res
