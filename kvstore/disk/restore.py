"""Restoring: a plan's segments read straight into the final arrays and built into live
caches once. Each segment's header is checked against its record and the identity's layout
before anything is allocated (``pieces.checked``), the reads run on reader threads as the
arrays are allocated, and every checksum is verified before a cache is handed out. A
failure of a record's bytes is a ``BlobError`` naming the record (the store drops it: a
miss); any other failure (I/O, memory or threads running out) passes as it is.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .. import alloc, files, segments
from ..escape import logger
from ..layout import Layout
from ..identity import Identity
from ..records import ChunkRecord, EntryRecord
from .pieces import Piece, blame, blamed, checked, framed, plan_pieces
from .plan import Plan
from .tier import Tier
from . import whole as _whole

if TYPE_CHECKING:
    import numpy as np

# Reads of one restore in flight at once, on reader threads (each a span of a segment, see
# ``segments.SegmentRead``): preadv and xxhash release the GIL, so reads overlap each other
# and the hashing. Cold, the device is kept busy (it was also told to read everything
# ahead, while MLX allocates); warm, the copies and hashes spread over every core.
READ_THREADS = 8

log = logger("kvstore")


@dataclass
class Restored:
    """A restore's result: live ``cache`` objects holding ``n`` tokens, and the encoded
    ``tensors`` / ``layout`` they were built from (what the memory tier keeps)."""

    cache: list[Any]
    tensors: dict[str, Any]
    layout: Layout
    n: int
    nbytes: int
    whole: bool = False     # read from the entry's whole copy (``disk.whole``), not its segments
    one_pass: bool = False  # read by MLX's loader in one pass (a whole copy, a snapshot alone in its pack)
    segments: int = 0    # the segments read
    copy_dropped: bool = False  # the entry's whole copy failed a check and was dropped



def restore(tier: Tier, plan: Plan, ident: Identity) -> Restored:
    """Read a plan's segments (verified) and build live caches holding ``plan.n`` tokens
    (``DiskTier.restore``).

    The stored layout must fit ``ident``'s model (``fit.layout_problem``), checked on the
    segments' headers before anything is allocated. Raises BlobError (naming the record in
    ``err.record``) when a record's bytes are bad, anything else (OSError, MemoryError,
    RuntimeError) as it is; then nothing is returned and the arrays being filled are
    dropped. Raises ``CutRefused`` (before allocating) when the plan cuts a snapshot at a
    point its layout refuses (``Layout.can_cut``): the entry is valid, the query a miss.
    A plan of exactly an entry that has a whole copy reads the copy (``disk.whole``); a
    copy that fails a check is dropped, and the entry's segments are read instead. A
    snapshot alone in its pack is read the same way, by MLX's loader in one pass."""
    copy = tier.index.view(lambda r: _whole.of_plan(r, plan))
    dropped = False
    if copy is not None:
        piece = _whole.copy_piece(plan, copy[1])
        try:
            return _loaded(_whole.as_snapshot(plan), piece, _whole.load(tier, ident, _whole.as_snapshot(plan), piece))
        except files.BlobError as e:
            tier.forget_whole(piece.record[1], copy[1], release=not getattr(e, "foreign", False))
            dropped = True
            log.warning("kvstore: %s; dropped the whole copy, restoring the entry from its segments", e)
    pieces = tier.index.view(lambda r: plan_pieces(r, plan))
    if not plan.chunked and len(pieces) == 1 and pieces[0].segment.offset == 0:  # a snapshot that may be alone in its pack
        one = _whole.load(tier, ident, plan, pieces[0])
        if one is not None:
            return _loaded(plan, pieces[0], one)
    with _Packs(tier.blob_root) as packs, ThreadPoolExecutor(READ_THREADS, "kvstore-restore") as pool:
        heads = [_header(packs, p) for p in pieces]
        layout, specs = checked(pieces, heads, ident, plan)
        for p in pieces:  # the device reads ahead while MLX allocates the arrays
            pool.submit(packs.prefetch, p)
        reading = _Reading(pool, packs, pieces, heads, plan.chunked)
        arrays: dict[str, Any] = {}
        try:
            for group in alloc.groups(specs, segments=len(pieces)):  # reads start as soon as their arrays exist
                got, hosts = alloc.alloc(group)
                arrays.update(got)
                reading.add(hosts)
            reading.finish()
        except BaseException:
            reading.cancel()  # no reader may still write into arrays being dropped
            raise
    done = _built(plan, pieces, specs, arrays, layout)
    done.segments, done.copy_dropped = len(pieces), dropped
    return done


def restore_framed(tier: Tier, ident: Identity, key: bytes, rec: EntryRecord, n: int,
                   chunks: list[tuple[bytes, ChunkRecord, bytes, Any]], tail: Any) -> Restored:
    """``n`` tokens of the entry ``import_entry`` would file (every chunk of ``rec`` given:
    nothing is read from here), restored straight from the segment bytes in memory (a
    shared hit, before it is written here; ``DiskTier.restore_framed``): each segment
    checked as ``restore`` checks it before anything is allocated, then copied into the
    final arrays. The checksums are the caller's (the shared tier verified them as the
    bytes arrived; ``import_entry`` verifies them again as it writes)."""
    got = framed(tier.chunk, ident, key, rec, chunks, tail, n)
    layout, specs = checked(got.pieces, got.heads, ident, got.plan)
    arrays, hosts = alloc.alloc(specs)
    for p, d, h in zip(got.pieces, got.data, got.heads):
        with blame(*p.record):
            _copy_into(d, h, {nm: x[..., p.lo : p.hi, :] for nm, x in hosts.items()} if got.plan.chunked else hosts)
    return _built(got.plan, got.pieces, specs, arrays, layout)


class _Packs:
    """The pack files of one restore (kvstore's own files only, see ``files``), opened as
    its reads need them: one descriptor per pack while reads of it are in flight, and at
    most ``OPEN`` idle ones kept for the next read (the least recently used is closed).

    Why bounded: an agent conversation of T turns spans about T packs, and a restore
    that kept every one open ran out of descriptors (EMFILE) at ~150-200 turns under
    macOS's default soft limit of 256: a miss on every request. kvstore does not raise
    the host's limit (it never changes host state); it holds at most ``OPEN`` plus one
    per reader thread instead, whatever the number of packs. ``OPEN`` is half the soft
    limit less 64 (for everything else the process has open), at least 64: 64 under
    macOS's 256, 448 under Linux's 1024, where a 300-pack restore opens each pack once."""

    def __init__(self, blob_root: Path) -> None:
        self.blob_root = blob_root
        self.OPEN = _open_cap()
        self._lock = threading.Lock()
        self._idle: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._busy: dict[bytes, list[int]] = {}              # pack -> [descriptor, users]

    @contextmanager
    def use(self, piece: Piece) -> Iterator[int]:
        """A descriptor of ``piece``'s pack file for the block (opened now if no reader
        holds one): BlobError naming the piece's record if it is missing or not
        kvstore's; an OSError about the process (EMFILE) as it is."""
        pack = piece.segment.pack
        with self._lock:
            got = self._busy.get(pack)
            if got is not None:
                got[1] += 1
            else:
                fd = self._idle.pop(pack, None)
                if fd is None:
                    with blame(*piece.record):
                        fd = files.open_own(files.pack_path(self.blob_root, pack))
                got = self._busy[pack] = [fd, 1]
        try:
            yield got[0]
        finally:
            with self._lock:
                got[1] -= 1
                if got[1] == 0:
                    del self._busy[pack]
                    self._idle[pack] = got[0]
                    while len(self._idle) > self.OPEN:
                        os.close(self._idle.popitem(last=False)[1])

    def prefetch(self, piece: Piece) -> None:
        """Have the OS read ``piece``'s segment ahead (``files.prefetch``; advice only,
        nothing raised: the read that follows reports any failure)."""
        try:
            with self.use(piece) as fd:
                files.prefetch(fd, piece.segment.offset, piece.segment.length)
        except (OSError, files.BlobError):
            pass

    def __enter__(self) -> "_Packs":
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            fds = list(self._idle.values()) + [got[0] for got in self._busy.values()]
            self._idle.clear()
            self._busy.clear()
        for fd in fds:
            os.close(fd)


def _open_cap() -> int:
    """Idle pack files a restore may keep open (see ``_Packs``), from the soft limit on
    open files (read, never changed)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 64
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(64, min(1024, soft // 2 - 64))


def _header(packs: _Packs, p: Piece) -> segments.Header:
    with packs.use(p) as fd, blame(*p.record):
        if os.fstat(fd).st_size < p.segment.end:
            raise files.BlobError(f"pack {p.segment.pack.hex()[:12]} is shorter than its segment")
        return segments.read_header(fd, p.segment, f"{p.record[0]} {p.record[1].hex()[:12]}")


class _Reading:
    """A restore's reads: every piece read into its token slice of the arrays (chunked) or
    into the arrays whole (a snapshot), span by span on ``pool`` as the arrays are
    ``add``-ed (in file order), each piece hashed as its spans land (``segments.SegmentRead``).
    ``finish`` returns when every piece verified and raises the first failure."""

    def __init__(self, pool: ThreadPoolExecutor, packs: _Packs, pieces: list[Piece],
                 heads: list[segments.Header], chunked: bool) -> None:
        self.pool, self.packs, self.pieces, self.chunked = pool, packs, pieces, chunked
        self.reads = []
        for p, h in zip(pieces, heads):
            with blame(*p.record):  # each span borrows its pack's descriptor as it is read
                self.reads.append(segments.SegmentRead(-1, p.segment, h, f"{p.record[0]} {p.record[1].hex()[:12]}"))
        self.futures: list[Future] = []

    def add(self, hosts: dict[str, np.ndarray]) -> None:
        """Start reading every piece's part of the tensors ``hosts`` (the next in file order)."""
        runs = {n: segments.TokenRuns(a) for n, a in hosts.items()} if self.chunked else {}
        for k, (p, r) in enumerate(zip(self.pieces, self.reads)):
            with blame(*p.record):
                spans = r.add_tokens(runs, p.lo, p.hi) if self.chunked else r.add(hosts)
            self.futures.extend(self.pool.submit(self._read, k, i) for i in spans)

    def _read(self, k: int, i: int) -> None:
        with self.packs.use(self.pieces[k]) as fd, blame(*self.pieces[k].record):
            self.reads[k].read(i, fd)

    def finish(self) -> None:
        for f in self.futures:
            f.result()
        for p, r in zip(self.pieces, self.reads):
            with blame(*p.record):
                r.verify()

    def cancel(self) -> None:
        """Cancel the reads not started and wait for the running ones."""
        for f in self.futures:
            f.cancel()
        wait(self.futures)


def _loaded(plan: Plan, piece: Piece, got: tuple[segments.Specs, dict[str, Any], Layout] | None) -> Restored:
    """The restore of ``plan`` from ``piece`` loaded by MLX in one pass (``whole.load``)."""
    assert got is not None  # a whole copy is never passed over
    specs, arrays, layout = got
    done = _built(plan, [piece], specs, arrays, layout)
    done.one_pass, done.whole, done.segments = True, piece.kind == "whole", 1
    return done


def _built(plan: Plan, pieces: list[Piece], specs: segments.Specs, arrays: dict[str, Any], layout: Layout) -> Restored:
    """The live caches holding ``plan.n`` tokens from filled arrays (see ``restore``)."""
    from .. import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up

    tensors = {name: alloc.finish(specs[name][0], a) for name, a in arrays.items()}
    nbytes = sum(p.segment.length for p in pieces)
    with blame(*pieces[-1].record):  # verified bytes whose layout does not decode: the record's
        if plan.chunked:
            tensors = codec.slice_tokens(tensors, 0, plan.n)
            layout = layout.with_offset(plan.n)
        cache = codec.decode_cache(tensors, layout)
        if not plan.chunked and plan.n < plan.stored_n:
            for c in cache:
                c.trim(plan.stored_n - plan.n)
            tensors, layout = codec.encode_cache(cache)
    why = codec.check_holds(cache, plan.n)
    if why:
        raise blamed(pieces[-1].record, f"restored cache: {why}")
    # Evaluated here: MLX streams are per thread, and a lazy slice or view made on this
    # thread cannot be evaluated on another (the caller's generation thread, or another
    # request thread hitting the memory copy of this restore).
    import mlx.core as mx

    mx.eval(list(tensors.values()) + [a for c in cache for a in codec.layer_arrays(c)])
    return Restored(cache, tensors, layout, plan.n, nbytes)


def _copy_into(data: Any, header: segments.Header, dests: dict[str, np.ndarray]) -> None:
    """A segment's tensors (bytes in memory, checksum already verified) copied into
    ``dests`` as ``segments.read_into`` reads them from a file."""
    import numpy as np
    if set(dests) != set(header.specs):
        raise files.BlobError(f"tensors {sorted(header.specs)}, expected {sorted(dests)}")
    pos = header.start
    for tname, (st, shape) in header.specs.items():
        d, dt = dests[tname], segments.host_dtype(st)
        if d.shape != shape or d.dtype != dt:
            raise files.BlobError(f"tensor {tname!r} is {st} {list(shape)}, expected {list(d.shape)} {d.dtype}")
        count = int(np.prod(shape))
        np.copyto(d, np.frombuffer(data, dt, count, pos).reshape(shape))
        pos += count * dt.itemsize
    if pos != len(data):
        raise files.BlobError(f"tensors end at {pos}, the segment at {len(data)}")

