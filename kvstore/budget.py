"""The disk budget: whole copies first (redundant), then least recently used entries that
free space, pinned ones last.

Used by the writer thread after each persist (``KVStore(max_disk_bytes=...)``) and by
``kvstore gc --max-bytes``. Bytes are pack-file bytes on disk: removing an entry frees a
pack file only when no record uses any of its segments any more (a shared chunk, or a
chunk another entry still needs, keeps its pack), so eviction works in batches and
re-reads the index's byte counter between them rather than trusting a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from .index import IndexRecords, scan
from .records import EntryRecord

if TYPE_CHECKING:  # the budget needs no MLX; DiskTier is only a type here
    from .disk import DiskTier

BATCH = 256  # entries removed per transaction (one sync each)


@dataclass(frozen=True)
class Removed:
    """An entry a budget removed (or, in a dry run, would remove) and the bytes that freed."""

    key: bytes
    record: EntryRecord
    freed: int
    copy: bool = False  # only the entry's whole copy went (``drop_copies``); the entry stays


def lru_order(records: Iterable[tuple[bytes, EntryRecord]]) -> list[tuple[bytes, EntryRecord]]:
    """Eviction order: unpinned before pinned, least recently used first (``last_used`` is
    clamped to now when read, so a future timestamp cannot keep an entry first forever)."""
    return sorted(records, key=lambda kr: (kr[1].pinned, kr[1].last_used))


class Sim:
    """What removing entries frees, chunk references and pack segments counted from the
    records themselves (not from counters a damaged record may have let drift), without
    removing anything (dry runs, and the size of each real batch)."""

    def __init__(self, snap: IndexRecords) -> None:
        self.total = max(snap.meta_bytes, 0)
        self.refs: dict[bytes, int] = {}
        for r in snap.entries.values():
            for ck in (r.chunks if r else ()):
                self.refs[ck] = self.refs.get(ck, 0) + 1
        self.chunk_seg = {k: r.segment for k, r in snap.chunks.items() if r}
        use = snap.pack_use()
        self.packs = {k: [use.get(k, (0, 0))[0], r.size] for k, r in snap.packs.items() if r}
        self.gone: set[bytes] = set()

    def _release(self, pack: bytes) -> int:
        p = self.packs.get(pack)
        if p is None or p[0] <= 0:
            return 0
        p[0] -= 1
        return p[1] if p[0] == 0 else 0

    def _drops(self, rec: EntryRecord) -> dict[bytes, int]:
        """Pack id -> how many of its used segments removing ``rec`` now releases: its own
        segments, and those of the chunks it holds the last reference to."""
        drop: dict[bytes, int] = {}
        for s in rec.segments:
            drop[s.pack] = drop.get(s.pack, 0) + 1
        for ck in rec.chunks:
            if self.refs.get(ck) == 1 and ck in self.chunk_seg:
                pack = self.chunk_seg[ck].pack
                drop[pack] = drop.get(pack, 0) + 1
        return drop

    def would_free(self, key: bytes, rec: EntryRecord) -> int:
        """The bytes removing ``rec`` now would free, counting nothing as removed."""
        if key in self.gone:
            return 0
        return sum(self.packs[p][1] for p, n in self._drops(rec).items()
                   if p in self.packs and 0 < self.packs[p][0] <= n)

    def drop_copy(self, rec: EntryRecord) -> int:
        """Count ``rec``'s whole copy (``disk.whole``) as dropped; returns the bytes that frees."""
        if rec.whole is None:
            return 0
        freed = self._release(rec.whole.pack)
        self.total -= freed
        return freed

    def remove(self, key: bytes, rec: EntryRecord) -> int:
        """Count ``rec`` as removed; returns the bytes that frees."""
        if key in self.gone:
            return 0
        drops = self._drops(rec)
        self.gone.add(key)
        for ck in rec.chunks:
            if ck in self.refs:
                self.refs[ck] -= 1
        freed = sum(self._release(p) for p, n in drops.items() for _ in range(n))
        self.total -= freed
        return freed


def remove_unchanged(disk: DiskTier, batch: list[tuple[bytes, EntryRecord]],
                     guard: Callable[[EntryRecord], bool] | None = None) -> set[bytes]:
    """Remove entries in one transaction, each unless it was pinned or unpinned since its
    record was read, or ``guard`` rejects its current record (checked in the transaction).
    A use since then does not save it from a size budget (a busy server touches everything
    all the time), only from an age rule (whose guard re-checks the age). Returns the keys
    removed."""
    pinned = {k: r.pinned for k, r in batch}
    return set(disk.remove([k for k, _ in batch],
                           only_if=lambda k, cur: cur.pinned == pinned[k] and (guard is None or guard(cur))))


def victims(sim: Sim, order: list[tuple[bytes, EntryRecord]], excess: int) -> list[Removed]:
    """Entries whose removal frees ``excess`` bytes, counted in ``sim``. A pack file is freed
    only with the last segment anyone uses, so an old prefix that newer entries extend
    frees nothing while they live: first, least recently used first, the unpinned entries
    whose removal frees bytes now (repeated while that frees more: removing a conversation's
    last turn makes the turn before it freeable), then plain LRU order, pinned last, for
    whatever is still missing. Without the first step a budget of 90% could empty the
    directory, removing entries that free nothing."""
    out: list[Removed] = []
    freed = 0
    pending = [kr for kr in order if not kr[1].pinned]
    progress = True
    while progress and freed < excess:
        progress, rest = False, []
        for key, rec in pending:
            if freed < excess and sim.would_free(key, rec) > 0:
                out.append(Removed(key, rec, sim.remove(key, rec)))
                freed += out[-1].freed
                progress = True
            else:
                rest.append((key, rec))
        pending = rest
    for key, rec in order:
        if freed >= excess:
            break
        if key not in sim.gone:
            out.append(Removed(key, rec, sim.remove(key, rec)))
            freed += out[-1].freed
    return out


def drop_copies(disk: DiskTier, sim: Sim, order: list[tuple[bytes, EntryRecord]], excess: int,
                dry_run: bool = False) -> list[Removed]:
    """Drop entries' whole copies (``disk.whole``), in ``order``, until ``excess`` bytes are
    freed: a copy is redundant (its entry's segments stay), so a budget takes copies before
    any entry. Returns the copies dropped (``Removed.copy``), their bytes counted in ``sim``."""
    out: list[Removed] = []
    freed = 0
    for key, rec in order:
        if freed >= excess:
            break
        if rec.whole is not None and (dry_run or disk.forget_whole(key, rec.whole)):
            out.append(Removed(key, rec, sim.drop_copy(rec), copy=True))
            freed += out[-1].freed
    return out


def evict_to(disk: DiskTier, max_bytes: int, *, dry_run: bool = False,
             snap: IndexRecords | None = None, sim: Sim | None = None, pinned: bool = True) -> list[Removed]:
    """Drop entries' whole copies (``drop_copies``), then entries (see ``victims`` for
    the order), until the pack files fit ``max_bytes``, a batch per transaction; ``dry_run`` only counts. Without ``pinned``
    no pinned entry goes, even when the budget is then not met. Returns what went (the
    copies first, marked ``Removed.copy``)."""
    if not dry_run and snap is None and disk.index.total_bytes() <= max_bytes:
        return []
    snap = snap or scan(disk.index, full=False)
    sim = sim or Sim(snap)
    order = [kr for kr in lru_order((k, r) for k, r in snap.entries.items() if r) if kr[0] not in sim.gone]
    copies = drop_copies(disk, sim, order, (sim.total if dry_run else disk.index.total_bytes()) - max_bytes, dry_run)
    total = sim.total if dry_run else disk.index.total_bytes()
    if total <= max_bytes:
        return copies
    planned = victims(sim, order if pinned else [kr for kr in order if not kr[1].pinned], total - max_bytes)
    if dry_run:
        return copies + planned
    gone: list[Removed] = copies
    for i in range(0, len(planned), BATCH):
        if disk.index.total_bytes() <= max_bytes:
            break
        batch = planned[i : i + BATCH]
        done = remove_unchanged(disk, [(r.key, r.record) for r in batch])
        gone += [r for r in batch if r.key in done]
    return gone
