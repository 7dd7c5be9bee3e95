"""``verify`` (fsck) and its repairs, and ``rebuild_index`` for an index LMDB cannot read.

Modelled on python-diskcache's ``check(fix=True)``: ``verify`` returns typed ``Problem``
records and repairs them when asked, through the index's public ``WriteTxn`` only. Every
repair re-checks its condition inside the write transaction that applies it, so a record
a server commits between the scan and the repair is never dropped by mistake; a pack file
no record names is removed only inside a write transaction that finds no record for it,
which is the same lock a writer holds when it checks that its new pack is still there.
Files that are not kvstore's (``files.own_packs``) are reported and never touched.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb

from .. import files, segments
from ..index import DBS, Index, IndexRecords, WriteTxn, scan
from ..index.core import aside_name
from ..index.pages import walk_all
from ..index.trie import chunk_edges, entry_edges
from ..keys import KEY_BYTES, TOKEN_BYTES, boundaries, chunk_key, entry_key, root_key
from ..records import ChunkRecord, EntryRecord, Kind, PackRecord, RecordError, Segment

if TYPE_CHECKING:  # maintenance needs no MLX itself; DiskTier is only a type here
    from ..disk import DiskTier

ORPHAN_BLOB_SECONDS = 60  # a pack file older than this that no record names is an orphan

# Problem kinds, in the order verify reports them.
KINDS = (
    "corrupt_index",   # the LMDB index itself cannot be read
    "bad_record",      # a record kvstore did not write, or that disagrees with its token ids
    "missing_chunk",   # an entry names a chunk record that does not exist
    "missing_pack",    # a segment names a pack no pack record describes
    "missing_blob",    # a pack file does not exist (or is not a regular file of kvstore's)
    "truncated",       # a pack file has another size than its record says
    "bad_checksum",    # a segment's bytes do not hash to its checksum
    "orphan_chunk",    # a chunk no entry references, or whose refcount drifted
    "orphan_pack",     # a pack record whose segment count or live bytes drifted, or unused
    "dangling_bound",  # a trie edge pointing at no record (or at the wrong parent)
    "missing_bound",   # a record without its trie edge: lookups cannot reach it (re-added)
    "orphan_tokens",   # token ids stored for a key that is neither entry nor chunk
    "bytes_drift",     # the index's byte counter disagrees with its pack records
    "orphan_blob",     # a pack file no record names (older than the grace period)
    "foreign_file",    # a file under blobs/ kvstore did not write: reported, never touched
)
BLOB_KINDS = ("missing_pack", "missing_blob", "truncated", "bad_checksum")
NOT_OURS = ("foreign_file",)  # reported only: never repaired, never a failure of verify


@dataclass
class Problem:
    """One thing wrong with a cache directory.

    ``key``: entry / chunk / pack key (hex) the problem is about, if any; ``path``: the
    file (relative to the cache directory) if any; ``record``: "entry", "chunk", "pack",
    "whole" (an entry's whole copy: only the copy is repaired away), "bound", "tokens",
    "meta" or "file"; ``bytes``: bytes the repair frees (files)."""

    kind: str
    key: str | None = None
    path: str | None = None
    detail: str = ""
    record: str = "file"
    bytes: int = 0
    fixed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- verify


def verify(disk: DiskTier, *, fix: bool = False, checksums: bool = True,
           blob_age: float = ORPHAN_BLOB_SECONDS, now: float | None = None) -> list[Problem]:
    """Check every record against its token ids and pack files, and every file against the
    index. With ``fix``, repair each problem (``Problem.fixed`` says which were): broken
    entries are removed, broken chunks dropped with the entries built on them, reference
    and segment counts recounted, dangling trie edges and orphan token ids deleted, orphan
    pack files removed. ``checksums=False`` checks sizes only (``gc`` uses it).

    Never raises for a damaged directory: an index LMDB cannot read (or whose B-tree no
    longer finds its own keys) is one ``corrupt_index`` problem; ``fix`` rebuilds it from
    its readable records (``rebuild_index``) and then verifies the result."""
    now = time.time() if now is None else now
    try:
        return _verify(disk, fix, checksums, blob_age, now)
    except lmdb.Error as e:
        bad = Problem("corrupt_index", None, str(Path("index") / "data.mdb"),
                      f"the index is damaged ({type(e).__name__}: {e})", "meta")
    if not fix:
        bad.detail += ("; `kvstore verify --fix` rebuilds it from its readable records (restart the "
                       "servers using this directory afterwards)")
        return [bad]
    try:
        how = rebuild_index(disk)
    except (lmdb.Error, OSError) as e:
        bad.detail += f"; rebuilding it failed ({e}): stop the servers and move {disk.index.path} aside"
        return [bad]
    bad.fixed = True
    bad.detail += f"; rebuilt from its readable records ({how}): restart the servers using this directory"
    try:
        return [bad] + _verify(disk, True, checksums, blob_age, now)
    except lmdb.Error as e:
        return [bad, Problem("corrupt_index", None, bad.path, f"still unreadable after the rebuild: {e}", "meta")]


def _verify(disk: DiskTier, fix: bool, checksums: bool, blob_age: float, now: float) -> list[Problem]:
    marked = disk.index.marked_damaged()  # damage a process met that no page walk may see any more
    if marked is not None:
        raise lmdb.CorruptedError(f"a process using it met damage: {marked}")
    own, foreign = files.own_packs(disk.blob_root)  # before the index: a pack committed in
    snap = scan(disk.index, check=True)              # between is seen as named, not orphan
    seg_check = SegmentCheck(disk, snap.packs, checksums)
    with seg_check:
        problems = _entry_problems(snap, seg_check, disk.chunk) + _chunk_problems(snap, seg_check)
    bad = {bytes.fromhex(p.key) for p in problems if p.kind == "bad_record" and p.key}  # their edges go with them
    problems += (_pack_problems(snap) + _edge_problems(snap, bad) + _count_problems(snap)
                 + _file_problems(disk, snap, own, foreign, blob_age, now))
    problems.sort(key=lambda p: KINDS.index(p.kind))
    if fix:
        _fix(disk, problems, snap, blob_age)
    return problems


def _rel(disk: DiskTier, path: Path) -> str:
    return str(path.relative_to(disk.root))


class SegmentCheck:
    """Segments against their pack files (``packs``: pack id -> its record, None if
    unreadable): kvstore's own files only (``files.open_own``), at most ``OPEN`` of them
    open at a time (a directory of 100,000 packs must not run the process out of file
    descriptors: an open that fails for a reason other than the file, e.g. EMFILE, is
    raised, never reported as a missing file and never "fixed")."""

    OPEN = 64

    def __init__(self, disk: DiskTier, packs: dict[bytes, PackRecord | None], checksums: bool = True) -> None:
        self.disk, self.packs, self.checksums = disk, packs, checksums
        self.fds: dict[bytes, int | files.BlobError] = {}  # insertion order = age

    def problem(self, seg: Segment) -> tuple[str, str, str | None] | None:
        """(kind, detail, file) when ``seg`` cannot be read back as written, else None."""
        path = files.pack_path(self.disk.blob_root, seg.pack)
        rel = _rel(self.disk, path)
        prec = self.packs.get(seg.pack)
        if prec is None:
            return "missing_pack", f"pack {seg.pack.hex()[:12]} has no (readable) record", rel
        fd = self._fd(seg.pack, path)
        if isinstance(fd, files.BlobError):
            return "missing_blob", str(fd), rel
        size = os.fstat(fd).st_size
        if size != prec.size or seg.end > size:
            return "truncated", f"pack file is {size} bytes, its record says {prec.size}", rel
        if self.checksums and segments.hash_segment(fd, seg) != seg.checksum:
            return "bad_checksum", f"segment at {seg.offset} does not match its xxh3-128", rel
        return None

    def _fd(self, pack: bytes, path: Path) -> int | files.BlobError:
        if pack not in self.fds:
            if len(self.fds) >= self.OPEN:
                old = self.fds.pop(next(iter(self.fds)))
                if isinstance(old, int):
                    os.close(old)
            try:
                self.fds[pack] = files.open_own(path)
            except files.BlobError as e:
                self.fds[pack] = e
        return self.fds[pack]

    def close(self) -> None:
        for fd in self.fds.values():
            if isinstance(fd, int):
                os.close(fd)

    def __enter__(self) -> "SegmentCheck":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def entry_mismatch(key: bytes, rec: EntryRecord, toks: bytes | None, chunk: int) -> str | None:
    """Why an entry record disagrees with its own token ids (every key is a hash of them),
    or None. A record that fails this can never be hit, or would restore the wrong thing."""
    if toks is None:
        return "no token ids stored"
    if len(toks) != TOKEN_BYTES * rec.n:
        return f"token ids hold {len(toks) // TOKEN_BYTES} tokens, record says {rec.n}"
    if rec.chunk != chunk:
        return f"chunk size {rec.chunk}, the directory's is {chunk}"
    b = boundaries(root_key(rec.identity), toks, rec.chunk)
    if entry_key(b[-1], toks[(len(b) - 1) * rec.chunk * TOKEN_BYTES :]) != key:
        return "token ids do not hash to the entry key"
    if b[-1] != rec.boundary:
        return "boundary does not match the token ids"
    if rec.chunks != (tuple(b[1:]) if rec.chunked else ()):
        return "chunk list does not match the token ids"
    return None


def chunk_mismatch(key: bytes, rec: ChunkRecord, toks: bytes | None) -> str | None:
    if toks is None:
        return "no token ids stored"
    if len(toks) != TOKEN_BYTES * rec.n:
        return f"token ids hold {len(toks) // TOKEN_BYTES} tokens, record says {rec.n}"
    if chunk_key(rec.parent, toks) != key:
        return "token ids do not hash to the chunk key"
    return None


def _entry_problems(snap: IndexRecords, segs: SegmentCheck, chunk: int) -> list[Problem]:
    out = []
    edges = {edge: v for _, _, v, edge in snap.bounds}
    for key, rec in snap.entries.items():
        hx = key.hex()
        if rec is None:
            out.append(Problem("bad_record", hx, None, "entry record is not one kvstore writes", "entry"))
            continue
        why = entry_mismatch(key, rec, snap.tokens.get(key), chunk)
        if why:
            out.append(Problem("bad_record", hx, None, why, "entry"))
            continue
        if _missing_edge(entry_edges(key, rec, snap.tokens.get(key)), edges, Kind.ENTRY):
            out.append(Problem("missing_bound", hx, None, f"entry {hx[:12]} lacks a trie edge: lookups cannot reach it", "bound"))
        missing = [ck for ck in rec.chunks if ck not in snap.chunks]
        if missing:
            out.append(Problem("missing_chunk", hx, None, f"{len(missing)} of {len(rec.chunks)} chunk records "
                               f"missing (first {missing[0].hex()[:12]})", "entry"))
            continue
        for seg in rec.segments:
            bad = segs.problem(seg)
            if bad and seg == rec.whole:  # only the copy is lost: the entry stays (``disk.whole``)
                out.append(Problem(bad[0], hx, bad[2], f"whole copy: {bad[1]}", "whole"))
            elif bad:
                out.append(Problem(bad[0], hx, bad[2], bad[1], "entry"))
    return out


def _chunk_problems(snap: IndexRecords, segs: SegmentCheck) -> list[Problem]:
    out = []
    edges = {edge: v for _, _, v, edge in snap.bounds}
    refs = _refcounts(snap.entries.values())
    for key, rec in snap.chunks.items():
        hx = key.hex()
        if rec is None:
            out.append(Problem("bad_record", hx, None, "chunk record is not one kvstore writes", "chunk"))
            continue
        why = chunk_mismatch(key, rec, snap.tokens.get(key))
        if why:
            out.append(Problem("bad_record", hx, None, why, "chunk"))
            continue
        bad = segs.problem(rec.segment)
        if bad:
            out.append(Problem(bad[0], hx, bad[2], bad[1], "chunk"))
            continue
        if _missing_edge(chunk_edges(key, rec, snap.tokens.get(key)), edges, Kind.CHUNK):
            out.append(Problem("missing_bound", hx, None,
                               f"chunk {hx[:12]} lacks a trie edge: entries built on it cannot be reached", "bound"))
        want = refs.get(key, 0)
        if want == 0:
            out.append(Problem("orphan_chunk", hx, None, f"refs={rec.refs} but no entry references it", "chunk"))
        elif rec.refs != want:
            out.append(Problem("orphan_chunk", hx, None, f"refcount drift: refs={rec.refs}, {want} entries use it", "chunk"))
    return out


def _pack_problems(snap: IndexRecords) -> list[Problem]:
    out = []
    use = snap.pack_use()
    for pack, rec in snap.packs.items():
        hx = pack.hex()
        if rec is None:
            out.append(Problem("bad_record", hx, None, "pack record is not one kvstore writes", "pack"))
            continue
        n, live = use.get(pack, (0, 0))
        if (rec.segments, rec.live) != (n, live):
            out.append(Problem("orphan_pack", hx, None, f"record counts {rec.segments} segments ({rec.live} B), "
                               f"{n} used ({live} B)", "pack", rec.size if n == 0 else 0))
    return out


def _edge_problems(snap: IndexRecords, bad: set[bytes]) -> list[Problem]:
    """Edges leading nowhere or not where their record says; a bad record's own edges
    are part of it (reported with it, removed with it)."""
    out = []
    for b, c, v, edge in snap.bounds:
        target = snap.entries.get(c, False) if v == Kind.ENTRY.value else (
            snap.chunks.get(c, False) if v == Kind.CHUNK.value else False)
        why = None
        if v not in (Kind.ENTRY.value, Kind.CHUNK.value):
            why = f"unknown edge kind {v!r}"
        elif target is False:
            why = f"points at {'entry' if v == Kind.ENTRY.value else 'chunk'} {c.hex()[:12]}, which does not exist"
        elif target is not None and c not in bad and edge not in (_edges_of(c, target, snap.tokens.get(c)) or [edge]):
            why = f"edge from {b.hex()[:12]} to {c.hex()[:12]} is not one its record and token ids make"
        if why:
            out.append(Problem("dangling_bound", edge.hex(), None, why, "bound"))
    return out


def _count_problems(snap: IndexRecords) -> list[Problem]:
    out = [Problem("orphan_tokens", k.hex(), None, "token ids of no entry or chunk", "tokens")
           for k in snap.tokens if k not in snap.entries and k not in snap.chunks]
    counted = sum(r.size for r in snap.packs.values() if r)
    if counted != snap.meta_bytes:
        out.append(Problem("bytes_drift", None, None, f"index counts {snap.meta_bytes} bytes, its pack records "
                           f"{counted}", "meta"))
    return out


def _file_problems(disk: DiskTier, snap: IndexRecords, own: list[files.OwnFile], foreign: list[Path],
                   blob_age: float, now: float) -> list[Problem]:
    out = []
    for f in own:
        age = now - min(f.st.st_mtime, now)  # a future mtime (another host's clock) is now
        if f.pack not in snap.packs and age >= blob_age:
            out.append(Problem("orphan_blob", f.pack.hex(), _rel(disk, f.path),
                               f"no record names this pack file ({age:.0f}s old)", "file", f.st.st_size))
    for p in foreign:
        out.append(Problem("foreign_file", None, _rel(disk, p) if p != disk.blob_root else "blobs",
                           "not a file kvstore writes (or not a regular file / directory): left alone", "file"))
    return out


def _edges_of(key: bytes, rec: Any, tokens: bytes | None) -> list[bytes] | None:
    """The trie edges a record should have (None: unknown, its token ids are damaged)."""
    return entry_edges(key, rec, tokens) if isinstance(rec, EntryRecord) else chunk_edges(key, rec, tokens)


def _missing_edge(want: list[bytes] | None, have: dict[bytes, bytes], kind: Kind) -> bool:
    return want is None or any(have.get(e) != kind.value for e in want)


def _refcounts(entries: Any) -> dict[bytes, int]:
    refs: dict[bytes, int] = {}
    for rec in entries:
        for ck in (rec.chunks if rec else ()):
            refs[ck] = refs.get(ck, 0) + 1
    return refs


# ----------------------------------------------------------------------------- repairs


def _fix(disk: DiskTier, problems: list[Problem], snap: IndexRecords, blob_age: float) -> None:
    broken = {(p.record, p.key) for p in problems if p.record in ("entry", "chunk", "pack")
              and p.kind in BLOB_KINDS + ("bad_record", "missing_chunk")}
    if broken:
        gone = disk.index.transact(lambda t: _drop_broken(t, snap, broken))
        for p in problems:
            if (p.record, p.key) in broken:
                p.fixed = (p.record, p.key) in gone
    for p in problems:
        if p.record == "whole" and p.key:  # the copy goes, its entry stays
            key = bytes.fromhex(p.key)
            was = snap.entries.get(key)
            p.fixed = bool(was and was.whole and disk.forget_whole(key, was.whole))
    for p in (p for p in problems if p.kind == "orphan_blob"):
        p.fixed = remove_orphan(disk, bytes.fromhex(p.key), blob_age)  # type: ignore[arg-type]
    if any(p.record not in ("file",) for p in problems):
        disk.index.transact(_sweep)
        for p in problems:
            if p.kind in ("orphan_chunk", "orphan_pack", "dangling_bound", "missing_bound", "orphan_tokens",
                          "bytes_drift"):
                p.fixed = True


def _drop_broken(t: WriteTxn, snap: IndexRecords, broken: set[tuple[str, str | None]]) -> set[tuple[str, str]]:
    """Remove the broken records that are still as scanned, and every entry built on a
    broken chunk. Returns the (record, key hex) removed, here or by another process since
    the scan (a reader that met the same damage drops what it read)."""
    gone: set[tuple[str, str]] = set()
    db = {"entry": "entries", "chunk": "chunks", "pack": "packs"}
    bad_chunks: set[bytes] = set()
    for kind, hx in sorted(broken, key=lambda x: ("chunk", "pack", "entry").index(x[0])):
        key = bytes.fromhex(hx or "")
        was = getattr(snap, db[kind])[key] if key in getattr(snap, db[kind]) else None
        try:
            now = t.entry(key) if kind == "entry" else t.chunk(key) if kind == "chunk" else t.pack(key)
        except RecordError:
            now = None
        if was is not None and t.raw(db[kind], key) is None:
            gone.add((kind, hx or ""))  # removed meanwhile (a reader that met the damage, a gc): nothing to fix
            if kind == "chunk":
                bad_chunks.add(key)     # entries still built on it go below
            continue
        if not _same_record(now, was):
            continue  # rewritten meanwhile: not the record judged
        if now is None:
            t.drop_raw(db[kind], key)
            if kind == "pack":
                t.unlink_after_commit(files.pack_path(t.blob_root, key))
            elif kind == "chunk":
                bad_chunks.add(key)
        elif isinstance(now, ChunkRecord):
            t.remove_chunk(key, now)
            bad_chunks.add(key)
        elif isinstance(now, EntryRecord):
            t.remove_entry(key)
        else:
            t.drop_pack(key, now.size)
        gone.add((kind, hx or ""))
    bad_packs = {bytes.fromhex(hx) for kind, hx in gone if kind == "pack"}
    for ck, crec in _readable(t, "chunks").items():  # chunks whose pack went too
        if crec.segment.pack in bad_packs:
            t.remove_chunk(ck, crec)
            bad_chunks.add(ck)
    for ek, rec in _readable(t, "entries").items():
        if bad_chunks.intersection(rec.chunks) or (rec.tail is not None and rec.tail.pack in bad_packs):
            t.remove_entry(ek)
        elif rec.whole is not None and rec.whole.pack in bad_packs:  # only its copy went
            t.set_entry(ek, rec.with_whole(None))
    return gone


def _same_record(a: Any, b: Any) -> bool:
    """The same record, read twice: equal but for timestamps, which a record from a
    skewed clock (a future time) reads as a different "now" each time."""
    if isinstance(a, EntryRecord) and isinstance(b, EntryRecord):
        return replace(a, created=0.0, last_used=0.0) == replace(b, created=0.0, last_used=0.0)
    if isinstance(a, PackRecord) and isinstance(b, PackRecord):
        return replace(a, created=0.0) == replace(b, created=0.0)
    return a == b


def remove_orphan(disk: DiskTier, pack: bytes, blob_age: float = ORPHAN_BLOB_SECONDS) -> bool:
    """Unlink pack file ``pack`` if no record names it and it is older than ``blob_age``,
    deciding inside a write transaction: a writer checks, under the same lock, that its new
    pack is still there before naming it, so a slow writer never loses its entry. True if
    the file is gone."""
    path = files.pack_path(disk.blob_root, pack)

    def run(t: WriteTxn) -> bool:
        if t.raw("packs", pack) is not None:
            return False  # a writer committed it after all
        try:
            fd = files.open_own(path)  # kvstore's own file only: never through a symlink
        except files.BlobError:
            return not os.path.lexists(path)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        now = time.time()
        if now - min(st.st_mtime, now) < blob_age:  # a future mtime counts as now
            return False
        return files.unlink_own(path)

    try:
        return disk.index.transact(run)
    except OSError:
        return False


def _sweep(t: WriteTxn) -> None:
    """In one write transaction, re-reading everything in it: recount chunk references
    (dropping unused chunks) and pack segments (dropping unused packs, files unlinked after
    commit), delete trie edges and token ids that lead nowhere, re-add missing edges, and
    recompute the byte counter. A concurrent writer's commit is either fully seen or not."""
    entries = _readable(t, "entries")
    refs = _refcounts(entries.values())
    for ck, crec in _readable(t, "chunks").items():
        want = refs.get(ck, 0)
        if want == 0:
            t.remove_chunk(ck, crec)
        elif crec.refs != want:
            t.set_chunk(ck, crec.with_refs(want))
    chunks = _readable(t, "chunks")
    use: dict[bytes, list[int]] = {}
    for s in [s for r in entries.values() for s in r.segments] + [r.segment for r in chunks.values()]:
        u = use.setdefault(s.pack, [0, 0])
        u[0], u[1] = u[0] + 1, u[1] + s.length
    total = 0
    for pack in t.keys("packs"):
        try:
            prec = t.pack(pack)
        except RecordError:
            prec = None
        n, live = use.get(pack, (0, 0))
        if prec is None or n == 0:
            t.drop_raw("packs", pack)
            t.unlink_after_commit(files.pack_path(t.blob_root, pack))
        else:
            if (prec.segments, prec.live) != (n, live):
                t.put_raw("packs", pack, PackRecord(prec.size, n, min(live, prec.size), prec.created).to_bytes())
            total += prec.size
    _sweep_edges(t, entries, chunks)
    for k in t.keys("tokens"):
        if k not in entries and k not in chunks and t.raw("entries", k) is None and t.raw("chunks", k) is None:
            t.delete_raw("tokens", k)
    t.set_meta(b"bytes", str(total).encode())


def _sweep_edges(t: WriteTxn, entries: dict[bytes, EntryRecord], chunks: dict[bytes, ChunkRecord]) -> None:
    for k in t.keys("bounds"):
        v, c = t.raw("bounds", k), k[-KEY_BYTES:]
        rec = entries.get(c) if v == Kind.ENTRY.value else chunks.get(c) if v == Kind.CHUNK.value else None
        if rec is None or k not in (_edges_of(c, rec, t.tokens(c)) or ()):
            t.delete_raw("bounds", k)
    for key, rec in list(entries.items()) + list(chunks.items()):  # every record reachable again
        kind = Kind.ENTRY if isinstance(rec, EntryRecord) else Kind.CHUNK
        for edge in _edges_of(key, rec, t.tokens(key)) or ():
            if t.raw("bounds", edge) != kind.value:
                t.put_raw("bounds", edge, kind.value)


def _readable(t: WriteTxn, db: str) -> dict[bytes, Any]:
    out = {}
    for k in t.keys(db):
        try:
            rec = t.entry(k) if db == "entries" else t.chunk(k)
        except RecordError:
            continue
        if rec is not None:
            out[k] = rec
    return out


# ----------------------------------------------------------------------------- rebuild


def rebuild_index(disk: DiskTier) -> str:
    """Copy every record LMDB can still read into a fresh index, swap it in place of the
    damaged one (kept as ``index.corrupt-<time>``) and point ``disk`` at it.

    The copy re-inserts keys, so a B-tree whose keys were out of order comes back ordered;
    records on unreadable pages are lost (their pack files become orphans ``verify --fix``
    removes). Processes that still have the old index open keep reading it safely, but what
    they write from then on is not seen by the new one: restart them."""
    old = disk.index
    path = old.path
    psize = old.env.stat()["psize"]
    for _ in range(20):  # read the pages ourselves: LMDB would abort on a damaged one
        try:
            with old.env.begin() as txn:  # pins the snapshot while its pages are read
                lost, salvaged = walk_all(path / "data.mdb", psize, txn.id(), collect=True)
            break
        except LookupError:
            continue
    else:
        lost, salvaged = walk_all(path / "data.mdb", psize, None, collect=True)
    tmp = aside_name(path, "rebuild")  # unpredictable: nothing can be planted there
    files.make_dir(tmp, old.modes)  # the directory's sharing mode: a group keeps access after a repair
    new = Index(disk.root, path=tmp, modes=old.modes)

    def copy(t: WriteTxn) -> int:
        n = 0
        for name in DBS:
            for k, v in salvaged.get(name, []):
                if name == "meta" and k == b"format":
                    continue  # the fresh index wrote its own
                try:
                    t.put_raw(name, k, v)
                    n += 1
                except lmdb.Error:  # a key LMDB cannot hold (damaged length)
                    pass
        return n

    kept = new.transact(copy)
    new.close()
    aside = aside_name(path, "corrupt")
    os.replace(path, aside)
    os.replace(tmp, path)
    # The old environment is left open, not closed: another thread or Index of this process
    # (a KVStore's writer) may be inside a transaction on it. It only leaves the per-process
    # registry, so that opening the path again maps the new files.
    old.forget()
    disk.index = Index(disk.root, modes=old.modes)
    skipped = f"; skipped {len(lost)} damaged part(s), first: {lost[0]}" if lost else ""
    return f"{kept} records kept{skipped}; old index in {aside.name}"
