"""The disk tier: pack files under ``blobs/``, named by the LMDB index under ``index/``.

Trimmable KV (every layer KVCache / QuantizedKVCache) is cut into fixed token chunks keyed
by the chained hash, so a common prefix is stored once and a conversation that grows by a
turn writes only its new chunks, plus an exact tail for the last partial chunk. Everything
else (RotatingKVCache, ArraysCache, mixed layouts) is one snapshot taken at exactly the
prefix boundary. One persist writes one pack file holding all its new segments.

``plan`` walks the query's chunk boundaries through the index's trie and returns the
longest reusable prefix: an entry (exact or shorter) or a chunk chain trimmed back to the
common prefix. Every token of a plan is compared with the stored token ids; no hash is
trusted alone. ``restore`` checks each segment's header against its record and the
identity's layout before allocating anything, reads the segments straight into the final
arrays, verifies every checksum, and builds the caches once. A failure of a record's
bytes is a ``BlobError`` naming the record (the store drops it: a miss); any other
failure (I/O, memory or threads running out) passes as it is, and the entry is kept.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import xxhash

from .. import alloc, bytes_written, files, segments
from ..cachelayout import Layout
from ..served_tokens import CutRefused, bound, serves
from ..identity import Identity
from ..layouts import ArraySpec, layout_problem
from ..index import Index, IndexOpenError, Reader, WriteTxn, chunk_size
from ..keys import TOKEN_BYTES, chunk_key, encode_tokens, entry_key
from ..misses import Near
from ..query import Query
from ..keys import common_tokens as _common
from ..records import ChunkRecord, EntryRecord, Kind, PackRecord, RecordError, Segment
from ..segments import SegmentMeta, SegmentMismatch

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("kvstore")

# Reads of one restore in flight at once, on reader threads (each a span of a segment, see
# ``segments.SegmentRead``): preadv and xxhash release the GIL, so reads overlap each other
# and the hashing. Cold, the device is kept busy (it was also told to read everything
# ahead, while MLX allocates); warm, the copies and hashes spread over every core.
READ_THREADS = 8


class Commit(str, Enum):
    """How a persist's (or an import's) one write transaction ended (``_commit``)."""

    OK = "ok"          # the entry is indexed
    EXISTS = "exists"  # it was indexed already
    RETRY = "retry"    # a chunk it shares, or its own pack file, was removed by a gc meanwhile


@dataclass(frozen=True)
class Plan:
    """What to read to restore ``n`` tokens of a query: the full ``chunks`` in order, then
    ``last`` (an entry's tail or snapshot, or a chunk to trim), ``stored_n`` tokens in all."""

    n: int
    chunks: tuple[bytes, ...]
    last: tuple[Kind, bytes] | None
    stored_n: int
    chunked: bool
    entry: bytes | None = None     # entry credited with the hit (last_used, hits)
    cache_type: str = "assistant"  # kept when the hit is promoted to memory


@dataclass
class Restored:
    """A restore's result: live ``cache`` objects holding ``n`` tokens, and the encoded
    ``tensors`` / ``layout`` they were built from (what the memory tier keeps)."""

    cache: list[Any]
    tensors: dict[str, Any]
    layout: Layout
    n: int
    nbytes: int


@dataclass
class PersistJob:
    """One cache snapshot to persist, prepared on the caller's thread: ``key`` is the entry
    key of ``tokens`` (computed once), ``tensors`` ``segments.host_views`` of the cache."""

    identity: Identity
    tokens: bytes
    key: bytes
    tensors: dict[str, tuple[str, Any]]
    layout: Layout
    cache_type: str = "assistant"
    created: float = field(default_factory=time.time)
    query: Query | None = None  # ``tokens`` as a Query whose chain a caller may have hashed already

    @property
    def n(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    def chained(self, chunk: int) -> Query:
        """The job's tokens as a ``Query``: their chain is hashed once per job, however
        many steps of a persist (policy, prefix, write, commit) read it."""
        if self.query is None or self.query.chunk != chunk:
            self.query = Query(self.tokens, self.identity.digest, chunk)
        return self.query


class DiskTier:
    """Pack files + index of one cache directory. ``shared_dir``: a group shares the
    directory on purpose (files 0660, directories 2770, the directory's group: see
    ``files.Modes``) instead of private (0600, 0700)."""

    def __init__(self, root: Path, *, chunk_tokens: int = 256, readonly: bool = False,
                 shared_dir: bool = False) -> None:
        self.root = Path(root)
        self.blob_root = self.root / "blobs"
        self.modes = files.Modes.of(self.root, shared_dir)
        if not readonly:
            for d in (self.root / "index", self.blob_root):
                files.make_dir(d, self.modes)
        self.index = Index(self.root, readonly=readonly, modes=self.modes)
        # The chunk size is part of the directory's format (it places every key boundary):
        # the first opener fixes it, later openers use it whatever they ask for.
        stored = self.index.meta_setdefault(b"chunk_tokens", str(int(chunk_tokens)).encode())
        try:
            self.chunk = chunk_size(stored, chunk_tokens, self.index.path)
        except IndexOpenError:
            self.index.close()
            raise
        if self.chunk != chunk_tokens:
            log.info("kvstore: %s uses chunk_tokens=%d (asked for %d)", self.root, self.chunk, chunk_tokens)

    def close(self) -> None:
        """Release the index (see ``Index.close``)."""
        self.index.close()

    # -- lookup ------------------------------------------------------------------------

    def plan(self, ident: Identity, tokens: list[int] | bytes | Query, skip: frozenset[bytes] = frozenset(),
             near: Near | None = None) -> Plan | None:
        """The longest reusable stored prefix of ``tokens`` for ``ident``, or None.

        One read transaction. First the chain of stored full chunks matching the query is
        followed as far as it goes; then the boundaries from the deepest down to the end of
        that chain are searched for entries (and, at the chain's end, a chunk to trim),
        stopping as soon as nothing shallower can be longer. Each boundary costs a few
        seeks however many children it has (``trie.edges``). Records kvstore did not write
        are passed over, and so are the entries in ``skip`` (a cut a restore refused).
        A ``Query`` brings its chain (hashed once for every tier); ``near`` is told the
        stored entries the walk compared (``misses.Near``: why a query was not served further)."""
        if not isinstance(tokens, Query):
            enc = tokens if isinstance(tokens, bytes) else encode_tokens(tokens)
            tokens = Query(enc, ident.digest, self.chunk)
        q = tokens
        if (q.chunk, q.digest) != (self.chunk, ident.digest):
            q = Query(q.enc, ident.digest, self.chunk)
        return self.index.view(lambda r: _plan(r, ident, q.enc, q.bounds, self.chunk, skip, near))

    # -- restore -----------------------------------------------------------------------

    def restore(self, plan: Plan, ident: Identity) -> Restored:
        """Read a plan's segments (verified) and build live caches holding ``plan.n`` tokens.

        The stored layout must fit ``ident``'s model (``layouts.layout_problem``), checked
        on the segments' headers before anything is allocated. Raises BlobError (naming the record in ``err.record``) when a record's
        bytes are bad, anything else (OSError, MemoryError, RuntimeError) as it is; then
        nothing is returned and the arrays being filled are dropped.
        Raises ``CutRefused`` (before allocating) when the plan cuts a snapshot at a point
        its layout refuses (``Layout.can_cut``): the entry is valid, the query a miss."""
        pieces = self.index.view(lambda r: _pieces(r, plan))
        with _Packs(self.blob_root) as packs, ThreadPoolExecutor(READ_THREADS, "kvstore-restore") as pool:
            heads = [_header(packs, p) for p in pieces]
            layout, specs = _checked(pieces, heads, ident, plan)
            for p in pieces:  # the device reads ahead while MLX allocates the arrays
                pool.submit(packs.prefetch, p)
            reading = _Reading(pool, packs, pieces, heads, plan.chunked)
            arrays: dict[str, Any] = {}
            try:
                for group in alloc.groups(specs):  # reads start as soon as their arrays exist
                    got, hosts = alloc.alloc(group)
                    arrays.update(got)
                    reading.add(hosts)
                reading.finish()
            except BaseException:
                reading.cancel()  # no reader may still write into arrays being dropped
                raise
        return _built(plan, pieces, specs, arrays, layout)

    def restore_framed(self, ident: Identity, key: bytes, rec: EntryRecord, n: int,
                       chunks: list[tuple[bytes, ChunkRecord, bytes, Any]], tail: Any) -> Restored:
        """``n`` tokens of the entry ``import_entry`` would file (every chunk of ``rec``
        given: nothing is read from here), restored straight from the segment bytes in
        memory (a shared hit, before it is written here): each segment checked as
        ``restore`` checks it before anything is allocated, then copied into the final
        arrays. The checksums are the caller's (the shared tier verified them as the
        bytes arrived; ``import_entry`` verifies them again as it writes)."""
        C = self.chunk
        if rec.chunk != C or rec.identity != ident.digest or {ck for ck, *_ in chunks} != set(rec.chunks):
            raise _blamed(("entry", key), "not a whole entry of this directory's identity and chunk size")
        plan = Plan(n, rec.chunks, None, rec.n, rec.chunked)
        pieces, data = _framed(key, rec, chunks, tail, C)
        heads = []
        for p, d in zip(pieces, data):
            with _blame(*p.record):
                hlen = int.from_bytes(bytes(d[:8]), "little") if len(d) >= 8 else 0
                heads.append(segments.parse_header(bytes(d[: 8 + min(hlen, len(d))]), len(d)))
        layout, specs = _checked(pieces, heads, ident, plan)
        arrays, hosts = alloc.alloc(specs)
        for p, d, h in zip(pieces, data, heads):
            with _blame(*p.record):
                _copy_into(d, h, {nm: x[..., p.lo : p.hi, :] for nm, x in hosts.items()} if plan.chunked else hosts)
        return _built(plan, pieces, specs, arrays, layout)

    # -- persist -----------------------------------------------------------------------

    def persist(self, job: PersistJob) -> int:
        """Write a job's new segments into one pack file and commit its entry in one
        transaction; returns the pack bytes written (0 if the entry already existed).
        Chunks already indexed are reused, not written. Raises OSError on a failed write
        (nothing is indexed then, and the pack file is removed)."""
        C = self.chunk
        bounds = job.chained(C).bounds
        chunked = job.layout.chunkable(job.n)
        K = len(bounds) - 1 if chunked else 0
        held = self.index.view(lambda r: None if r.raw("entries", job.key) else
                               {bounds[k + 1]: _readable_chunk(r, bounds[k + 1]) for k in range(K)
                                if r.raw("chunks", bounds[k + 1])})
        if held is None:
            return 0
        # a chunk indexed here whose pack file is gone or cut short (damage nobody has read
        # yet) is written again, not shared: sharing it would commit an entry lost on its
        # first read. One stat per pack; damage inside a file is a read's to find.
        gone = _missing_files(self.blob_root, held)
        have: set[bytes] = set(held) - set(gone)
        for _attempt in range(3):
            writer = segments.PackWriter(self.blob_root, modes=self.modes)
            try:
                new, tail = _write_segments(writer, job, bounds, K, chunked, have, C)
                if writer.size:
                    writer.seal()
                rec = _entry_record(job, bounds, K, chunked, tail, C)
                status = self.index.transact(lambda t: _commit(t, job, rec, writer, new, have, gone))
            except BaseException:
                writer.discard()
                raise
            writer.close()
            if status is Commit.OK:
                return writer.size
            if status is Commit.EXISTS:
                writer.discard()
                return 0
            writer.discard()
            have = set()  # RETRY: a reused chunk or this pack vanished under a gc: write all
        raise OSError("could not commit entry: its files kept vanishing under a concurrent gc")

    # -- segments from elsewhere (a shared tier) ------------------------------------------

    def held_chunks(self, bounds: list[bytes], tokens: bytes) -> set[bytes]:
        """The chunk keys of ``bounds[1:]`` (a query's chain) indexed here with exactly
        the query's token ids (one read transaction; unreadable records are not held)."""
        C = self.chunk

        def run(r: Reader) -> set[bytes]:
            return {bounds[k] for k in range(1, len(bounds)) if _record(r, Kind.CHUNK, bounds[k]) is not None
                    and r.tokens(bounds[k]) == tokens[(k - 1) * C * TOKEN_BYTES : k * C * TOKEN_BYTES]}

        return self.index.view(run)

    def import_entry(self, ident: Identity, key: bytes, rec: EntryRecord, tokens: bytes,
                     chunks: list[tuple[bytes, ChunkRecord, bytes, bytes]], tail: bytes) -> Commit:
        """File segments framed elsewhere (another machine's, from a shared tier) as entry
        ``key`` of ``tokens``: ``rec`` its record (its tail segment's place is ignored),
        ``chunks`` the (key, record, token ids, segment bytes) of its chunks not indexed
        here, ``tail`` its tail or snapshot bytes (b"" for none). Every chunk of ``rec``
        not given must be indexed here.

        Before anything is written, every segment is checked as ``restore`` checks it: its
        header's metadata names this record, identity and token range, all share one
        layout, and it fits ``ident``'s model. Then, as ``persist`` does: one new pack,
        checksums verified as it is written, synced, and one transaction (``_commit``:
        chunks indexed meanwhile are shared, the pack re-checked). Returns ``Commit``: OK,
        EXISTS or RETRY (a gc removed what it needed; nothing is indexed). Raises
        BlobError naming the failing record; OSError on a failed write."""
        C = self.chunk
        if rec.chunk != C or rec.identity != ident.digest:
            raise _blamed(("entry", key), "not an entry of this directory's identity and chunk size")
        plan = Plan(rec.n, rec.chunks, None, rec.n, rec.chunked)
        pieces, data = _framed(key, rec, chunks, tail, C)
        heads = []
        for p, d in zip(pieces, data):
            with _blame(*p.record):
                heads.append(segments.parse_header(d, len(d)))
        if pieces:
            _checked(pieces, heads, ident, plan)
        have = set(rec.chunks) - {ck for ck, *_ in chunks}
        now = time.time()
        job = PersistJob(ident, tokens, key, {}, Layout(), rec.cache_type, now)
        writer = segments.PackWriter(self.blob_root, modes=self.modes)
        try:
            segs = []
            for p, d in zip(pieces, data):
                with _blame(*p.record):
                    segs.append(writer.add_framed(d, p.segment.checksum))
            if writer.size:
                writer.seal()
            new = {ck: (replace(crec, refs=1, segment=seg), toks)
                   for (ck, crec, toks, _), seg in zip(chunks, segs)}
            local = replace(rec, tail=segs[-1] if rec.tail is not None else None, created=now,
                            last_used=now, hits=0, pinned=False)
            status = self.index.transact(lambda t: _commit(t, job, local, writer, new, have))
        except BaseException:
            writer.discard()
            raise
        writer.close()
        if status is not Commit.OK:
            writer.discard()
        return status

    def export_entry(self, key: bytes) -> tuple[EntryRecord, bytes, list[tuple[bytes, ChunkRecord, bytes]]] | None:
        """Entry ``key``'s record and token ids, and (key, record, token ids) of each of
        its chunks, from one read transaction; None if any is missing or unreadable."""
        def run(r: Reader) -> Any:
            rec, toks = r.entry(key), r.tokens(key)
            if rec is None or toks is None:
                return None
            out = []
            for ck in rec.chunks:
                crec, ctoks = r.chunk(ck), r.tokens(ck)
                if crec is None or ctoks is None:
                    return None
                out.append((ck, crec, ctoks))
            return rec, toks, out

        try:
            return self.index.view(run)
        except RecordError:
            return None

    def segment_bytes(self, seg: Segment) -> bytes:
        """A segment's bytes as its pack file holds them, verified against its checksum
        (kvstore's own files only); BlobError otherwise."""
        fd = files.open_own(files.pack_path(self.blob_root, seg.pack))
        try:
            data = os.pread(fd, seg.length, seg.offset)
        finally:
            os.close(fd)
        if len(data) != seg.length or xxhash.xxh3_128_digest(data) != seg.checksum:
            raise files.BlobError(f"pack {seg.pack.hex()[:12]}: segment is short or does not match its checksum")
        return data

    # -- removal -----------------------------------------------------------------------

    def remove(self, keys: list[bytes], *, only_if: Callable[[bytes, EntryRecord], bool] | None = None,
               release: bool = True) -> list[bytes]:
        """Drop entries (and the chunks and pack files no longer used) in one transaction;
        ``only_if(key, record)`` is asked inside it. Files go after the commit. Returns the
        keys removed; unreadable records are left to ``verify --fix``. ``release=False``:
        their own segments are not theirs (``BlobError.foreign``) and are not released."""
        def run(t: WriteTxn) -> list[bytes]:
            out = []
            for key in keys:
                try:
                    rec = t.entry(key)
                except RecordError:
                    continue
                if rec is not None and (only_if is None or only_if(key, rec)):
                    t.remove_entry(key, release=release)
                    out.append(key)
            return out

        return self.index.transact(run)

    def drop_chunk_and_users(self, key: bytes, *, release: bool = True) -> None:
        """Drop a damaged chunk and every entry built on it (none of them can be restored),
        so rewriting one of those entries stores it whole again. ``release=False``: the
        chunk's segment is not its own (``BlobError.foreign``) and is not released."""
        def run(t: WriteTxn) -> None:
            for ek in t.keys("entries"):
                try:
                    rec = t.entry(ek)
                except RecordError:
                    continue
                if rec is not None and key in rec.chunks:
                    t.remove_entry(ek)
            t.remove_chunk(key, release=release)

        self.index.transact(run)

    def touch(self, hits: dict[bytes, tuple[float, int]]) -> None:
        """Record uses: ``key -> (when, extra hits)``; missing or unreadable keys skipped."""
        def run(t: WriteTxn) -> None:
            for key, (when, n) in hits.items():
                try:
                    rec = t.entry(key)
                except RecordError:
                    continue
                if rec is not None:
                    t.set_entry(key, rec.touched(when, n))

        self.index.transact(run)


# ----------------------------------------------------------------------------- planning


def _record(r: Reader, kind: Kind, key: bytes) -> Any:
    try:
        return r.entry(key) if kind is Kind.ENTRY else r.chunk(key)
    except RecordError:
        return None  # not kvstore's: passed over (verify --fix drops it)


def _plan(r: Reader, ident: Identity, enc: bytes, bounds: list[bytes], C: int,
          skip: frozenset[bytes] = frozenset(), near: Near | None = None) -> Plan | None:
    n_q = len(enc) // TOKEN_BYTES
    # Full chunks whose stored token ids equal the query's. Their keys chain from the
    # identity's root, so a chunk found under the query's own boundary is this identity's.
    chain: list[bytes] = []
    for k in range(1, len(bounds)):
        if _record(r, Kind.CHUNK, bounds[k]) is None or r.tokens(bounds[k]) != enc[(k - 1) * C * TOKEN_BYTES : k * C * TOKEN_BYTES]:
            break
        chain.append(bounds[k])
    best: Plan | None = None
    if chain:  # the chain alone is reusable (keeping one token to feed when it is all)
        n = len(chain) * C
        best = Plan(serves(n, n, n_q, whole=False) or 0, tuple(chain[:-1]), (Kind.CHUNK, chain[-1]), n, True)
    for k in range(len(bounds) - 1, len(chain) - 1, -1):
        if best is not None and best.n >= (k + 1) * C:
            break  # everything filed at boundary k or above holds fewer tokens
        after = enc[k * C * TOKEN_BYTES : (k + 1) * C * TOKEN_BYTES]
        for child, kind, in_common, exact in r.edges(bounds[k], after):
            top = bound(k * C + in_common, n_q, exact)
            if best is not None and top <= best.n:
                break  # what follows shares no more (trie.edges), so it cannot do better
            got = None if child in skip else _candidate(r, ident, enc, bounds[k], k, child, kind, chain, C,
                                                        best.n if best else 0, near)
            if child in skip and near is not None:
                near.refused(k * C + in_common)
            if got is not None and (best is None or got.n > best.n):
                best = got
    return best


def _candidate(r: Reader, ident: Identity, enc: bytes, boundary: bytes, k: int, child: bytes,
               kind: Kind | None, chain: list[bytes], C: int, beat: int, near: Near | None = None) -> Plan | None:
    """What one child of boundary ``k`` can restore for the query if it is more than
    ``beat`` tokens, else None. Chunked pieces need the verified chain up to ``k``; the
    stored token ids decide every length (compared first: the cheap test)."""
    n_q = len(enc) // TOKEN_BYTES
    stored = r.tokens(child)
    if stored is None or len(stored) % TOKEN_BYTES or kind is None:
        return None
    if kind is Kind.ENTRY:
        n_e = len(stored) // TOKEN_BYTES
        common = _common(stored, enc)
        if (serves(n_e, common, n_q) or 0) <= beat or not _keyed(boundary, k, child, kind, stored, C):
            return None
        rec = _record(r, kind, child)
        if rec is None or rec.identity != ident.digest or rec.n != n_e or (rec.chunked and k > len(chain)):
            return None
        usable = serves(n_e, common, n_q, rec.trimmable)  # the stored layout decides the cut point (restore)
        if near is not None:
            near.saw("disk", common, n_e, stored[common * TOKEN_BYTES : (common + 8) * TOKEN_BYTES])
            if usable is None:
                near.refused(min(common, n_q - 1))
        if not usable:
            return None
        return Plan(usable, tuple(chain[:k]) if rec.chunked else (), (kind, child), n_e, rec.chunked,
                    entry=child, cache_type=rec.cache_type)
    if k != len(chain):
        return None
    m = _common(stored, enc[k * C * TOKEN_BYTES :])
    usable = serves((k + 1) * C, k * C + m, n_q, whole=False) or 0
    if near is not None and m > 0:
        near.saw("disk", k * C + m, (k + 1) * C, stored[m * TOKEN_BYTES : (m + 8) * TOKEN_BYTES], continues=True)
    if m <= 0 or usable <= beat or not _keyed(boundary, k, child, kind, stored, C):
        return None
    if _record(r, kind, child) is None:
        return None
    return Plan(usable, tuple(chain[:k]), (kind, child), (k + 1) * C, True)


def _keyed(boundary: bytes, k: int, child: bytes, kind: Kind, stored: bytes, C: int) -> bool:
    """The stored token ids hash to the key they are filed under. Token ids are what every
    hit is checked against, so a damaged (or foreign) token record must not be trusted: a
    flip in an entry's last partial chunk would otherwise serve its KV to another prompt."""
    if kind is Kind.ENTRY:
        return len(stored) // TOKEN_BYTES // C == k and entry_key(boundary, stored[k * C * TOKEN_BYTES :]) == child
    return len(stored) == C * TOKEN_BYTES and chunk_key(boundary, stored) == child


# ----------------------------------------------------------------------------- restoring


@dataclass(frozen=True)
class _Piece:
    """One segment to read: whose it is, what its header must say, where it lands."""

    record: tuple[str, bytes]     # ("entry" | "chunk", key): blamed on failure
    kind: str                      # the segment's kvstore.kind
    segment: Segment
    lo: int                        # token range in the restored arrays
    hi: int


def _pieces(r: Reader, plan: Plan) -> list[_Piece]:
    """The plan's segments in order, from its records (one read transaction)."""
    out: list[_Piece] = []
    lo = 0
    for ck in plan.chunks:
        crec = _need(r, Kind.CHUNK, ck)
        out.append(_Piece(("chunk", ck), "chunk", crec.segment, lo, lo + crec.n))
        lo += crec.n
    kind, key = plan.last  # type: ignore[misc]
    rec = _need(r, kind, key)
    if kind is Kind.CHUNK:
        out.append(_Piece(("chunk", key), "chunk", rec.segment, lo, lo + rec.n))
    elif rec.tail is not None:
        out.append(_Piece(("entry", key), "tail" if rec.chunked else "snapshot", rec.tail, lo, rec.n))
    if not out or out[-1].hi != plan.stored_n:
        raise _blamed(("entry" if kind is Kind.ENTRY else "chunk", key),
                      f"its pieces hold {out[-1].hi if out else 0} tokens, not {plan.stored_n}")
    return out


def _need(r: Reader, kind: Kind, key: bytes) -> Any:
    name = "entry" if kind is Kind.ENTRY else "chunk"
    try:
        rec = r.entry(key) if kind is Kind.ENTRY else r.chunk(key)
    except RecordError as e:
        raise _blamed((name, key), f"unreadable record: {e}") from None
    if rec is None:
        raise _blamed((name, key), "vanished from the index")
    return rec


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
    def use(self, piece: _Piece) -> Iterator[int]:
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
                    with _blame(*piece.record):
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

    def prefetch(self, piece: _Piece) -> None:
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


def _header(packs: _Packs, p: _Piece) -> segments.Header:
    with packs.use(p) as fd, _blame(*p.record):
        if os.fstat(fd).st_size < p.segment.end:
            raise files.BlobError(f"pack {p.segment.pack.hex()[:12]} is shorter than its segment")
        return segments.read_header(fd, p.segment, f"{p.record[0]} {p.record[1].hex()[:12]}")


def _check_pieces(pieces: list[_Piece], heads: list[segments.Header], ident: Identity, plan: Plan) -> Layout:
    """The stored layout, once every piece's header says it is the record's own segment
    (key, kind, identity, token range) and all pieces share one layout. Headers are not
    verified yet: this only decides what to allocate (bounded by the segments' sizes);
    the checksums decide what is handed out."""
    layout = None
    for p, h in zip(pieces, heads):
        with _blame(*p.record):
            try:
                stored = SegmentMeta(ident.hex, p.kind, p.record[1], p.lo, p.hi).expect(h.meta)
            except SegmentMismatch as e:
                err = files.BlobError(str(e))
                err.foreign = e.foreign
                raise err from None
            try:
                got = Layout.from_json(stored)
            except (ValueError, RecursionError) as e:
                raise files.BlobError(f"the segment's layout is unusable: {e}") from None
            if layout is None:
                layout = got
            elif got.signature() != layout.signature():
                raise files.BlobError("the segments of one entry disagree on its layout")
            if plan.chunked and not got.chunkable(p.hi - p.lo):
                raise files.BlobError("a chunked piece holds a layout that cannot be chunked")
    return layout  # type: ignore[return-value]


def _checked(pieces: list[_Piece], heads: list[segments.Header], ident: Identity,
             plan: Plan) -> tuple[Layout, segments.Specs]:
    """The stored layout and the restored arrays' specs, once ``_check_pieces`` and the
    identity's layout check (``layouts.layout_problem``, on the specs) accept the pieces; CutRefused
    if the plan cuts a snapshot where its layout does not allow (nothing allocated yet)."""
    layout = _check_pieces(pieces, heads, ident, plan)
    with _blame(*pieces[0].record):
        specs = _final_specs(heads[0], plan) if plan.chunked else heads[0].specs
    with _blame(*pieces[-1].record):
        why = layout_problem(ident, {n: ArraySpec(s, segments.mlx_dtype_name(st)) for n, (st, s) in specs.items()}, layout)
        if why:
            raise files.BlobError(f"stored cache does not fit the model: {why}")
    if not plan.chunked and plan.n < plan.stored_n and not layout.can_cut(plan.n):
        raise CutRefused(f"a snapshot of {plan.stored_n} tokens cannot be cut to {plan.n}")
    return layout, specs


def _final_specs(first: segments.Header, plan: Plan) -> segments.Specs:
    """The restored arrays' specs: the first piece's, at ``stored_n`` tokens."""
    specs = {}
    for name, (st, shape) in first.specs.items():
        if len(shape) < 2:
            raise files.BlobError(f"tensor {name!r} has no token axis")
        specs[name] = (st, (*shape[:-2], plan.stored_n, shape[-1]))
    return specs


class _Reading:
    """A restore's reads: every piece read into its token slice of the arrays (chunked) or
    into the arrays whole (a snapshot), span by span on ``pool`` as the arrays are
    ``add``-ed (in file order), each piece hashed as its spans land (``segments.SegmentRead``).
    ``finish`` returns when every piece verified and raises the first failure."""

    def __init__(self, pool: ThreadPoolExecutor, packs: _Packs, pieces: list[_Piece],
                 heads: list[segments.Header], chunked: bool) -> None:
        self.pool, self.packs, self.pieces, self.chunked = pool, packs, pieces, chunked
        self.reads = []
        for p, h in zip(pieces, heads):
            with _blame(*p.record):  # each span borrows its pack's descriptor as it is read
                self.reads.append(segments.SegmentRead(-1, p.segment, h, f"{p.record[0]} {p.record[1].hex()[:12]}"))
        self.futures: list[Future] = []

    def add(self, hosts: dict[str, np.ndarray]) -> None:
        """Start reading every piece's part of the tensors ``hosts`` (the next in file order)."""
        for k, (p, r) in enumerate(zip(self.pieces, self.reads)):
            dests = {n: a[..., p.lo : p.hi, :] for n, a in hosts.items()} if self.chunked else hosts
            with _blame(*p.record):
                spans = r.add(dests)
            self.futures.extend(self.pool.submit(self._read, k, i) for i in spans)

    def _read(self, k: int, i: int) -> None:
        with self.packs.use(self.pieces[k]) as fd, _blame(*self.pieces[k].record):
            self.reads[k].read(i, fd)

    def finish(self) -> None:
        for f in self.futures:
            f.result()
        for p, r in zip(self.pieces, self.reads):
            with _blame(*p.record):
                r.verify()

    def cancel(self) -> None:
        """Cancel the reads not started and wait for the running ones."""
        for f in self.futures:
            f.cancel()
        wait(self.futures)


def _built(plan: Plan, pieces: list[_Piece], specs: segments.Specs, arrays: dict[str, Any], layout: Layout) -> Restored:
    """The live caches holding ``plan.n`` tokens from filled arrays (see ``restore``)."""
    from .. import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up

    tensors = {name: alloc.finish(specs[name][0], a) for name, a in arrays.items()}
    nbytes = sum(p.segment.length for p in pieces)
    with _blame(*pieces[-1].record):  # verified bytes whose layout does not decode: the record's
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
        raise _blamed(pieces[-1].record, f"restored cache: {why}")
    # Evaluated here: MLX streams are per thread, and a lazy slice or view made on this
    # thread cannot be evaluated on another (the caller's generation thread, or another
    # request thread hitting the memory copy of this restore).
    import mlx.core as mx

    mx.eval(list(tensors.values()) + [a for c in cache for a in codec.layer_arrays(c)])
    return Restored(cache, tensors, layout, plan.n, nbytes)


def _framed(key: bytes, rec: EntryRecord, chunks: list[tuple[bytes, ChunkRecord, bytes, Any]], tail: Any,
            C: int) -> tuple[list[_Piece], list[Any]]:
    """The pieces (in token order) and their bytes of an entry framed elsewhere: the
    given chunks, then its tail or snapshot (see ``import_entry``)."""
    at = {ck: k for k, ck in enumerate(rec.chunks)}
    pieces, data = [], []
    for ck, crec, _toks, seg in chunks:
        if ck not in at or crec.n != C:
            raise _blamed(("chunk", ck), "not a chunk of the entry")
        pieces.append(_Piece(("chunk", ck), "chunk", crec.segment, at[ck] * C, (at[ck] + 1) * C))
        data.append(seg)
    if rec.tail is not None:
        lo = len(rec.chunks) * C if rec.chunked else 0
        pieces.append(_Piece(("entry", key), "tail" if rec.chunked else "snapshot", rec.tail, lo, rec.n))
        data.append(tail)
    return pieces, data


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


@contextmanager
def _blame(kind: str, key: bytes) -> Iterator[None]:
    """A failure in the block that is the record's or its file's becomes a BlobError naming
    the record (``err.record``): the one way a restore says a record's bytes are bad
    (``disk_errors.names_record``). Anything else passes as it is: an OSError ``files`` leaves
    raised (EMFILE, EIO, ENOMEM...), MemoryError, RuntimeError (a thread that cannot start,
    an MLX allocation refused) is about the process or the system, not this record."""
    try:
        yield
    except files.BlobError as e:
        e.record = (kind, key)
        raise
    except (KeyError, TypeError, ValueError) as e:  # an unusable record or file
        raise _blamed((kind, key), f"{type(e).__name__}: {e}") from None


def _blamed(record: tuple[str, bytes], why: str) -> files.BlobError:
    err = files.BlobError(f"{record[0]} {record[1].hex()[:12]}: {why}")
    err.record = record
    return err


# ----------------------------------------------------------------------------- persisting


def _meta(job: PersistJob, kind: str, key: bytes, lo: int, hi: int, layout: list) -> dict[str, str]:
    return SegmentMeta(job.identity.hex, kind, key, lo, hi, layout).to_meta()


def _write_segments(w: segments.PackWriter, job: PersistJob, bounds: list[bytes], K: int, chunked: bool,
                    have: set[bytes], C: int) -> tuple[dict[bytes, tuple[ChunkRecord, bytes]], Segment | None]:
    """Append the job's chunks not in ``have``, then its tail or snapshot, to one pack.
    Returns the new chunks' records (and token ids) and the tail / snapshot segment."""
    import numpy as np

    n, enc = job.n, job.tokens
    host = {nm: (st, np.asarray(a)) for nm, (st, a) in job.tensors.items()}  # no MLX op on this thread
    if not chunked:
        return {}, w.add(host, _meta(job, "snapshot", job.key, 0, n, job.layout.to_json()))
    # the layouts its chunks and its tail record, as JSON once (each chunk's is the same)
    chunk_layout, tail_layout = (job.layout.with_offset(m).to_json() for m in (C, n - K * C))
    new: dict[bytes, tuple[ChunkRecord, bytes]] = {}
    for k in range(K):
        ck = bounds[k + 1]
        if ck not in have:
            part = {nm: (st, a[..., k * C : (k + 1) * C, :]) for nm, (st, a) in host.items()}
            seg = w.add(part, _meta(job, "chunk", ck, k * C, (k + 1) * C, chunk_layout))
            new[ck] = (ChunkRecord(job.identity.digest, bounds[k], C, 1, seg), enc[k * C * TOKEN_BYTES : (k + 1) * C * TOKEN_BYTES])
    if n == K * C:
        return new, None
    part = {nm: (st, a[..., K * C : n, :]) for nm, (st, a) in host.items()}
    return new, w.add(part, _meta(job, "tail", job.key, K * C, n, tail_layout))


def _entry_record(job: PersistJob, bounds: list[bytes], K: int, chunked: bool, tail: Segment | None,
                  C: int) -> EntryRecord:
    return EntryRecord(job.identity.digest, job.n, C, chunked, chunked or job.layout.trimmable, bounds[-1],
                       tuple(bounds[1 : K + 1]), tail, job.cache_type, float(job.created),
                       float(job.created), 0, False)


def _readable_chunk(r: Reader, key: bytes) -> ChunkRecord | None:
    try:
        return r.chunk(key)
    except RecordError:
        return None  # unreadable: written again (``_commit`` overwrites the record)


def _missing_files(blob_root: Path, held: dict[bytes, ChunkRecord | None]) -> dict[bytes, Segment]:
    """The chunks of ``held`` whose segment's pack file is missing or shorter than the
    segment (each pack stat-ed once, without following a link), with that segment."""
    sizes: dict[bytes, int] = {}
    out = {}
    for ck, crec in held.items():
        if crec is None:
            continue
        seg = crec.segment
        if seg.pack not in sizes:
            try:
                sizes[seg.pack] = os.stat(files.pack_path(blob_root, seg.pack), follow_symlinks=False).st_size
            except (OSError, files.BlobError):
                sizes[seg.pack] = -1
        if sizes[seg.pack] < seg.offset + seg.length:
            out[ck] = seg
    return out


def _commit(t: WriteTxn, job: PersistJob, rec: EntryRecord, w: segments.PackWriter,
            new: dict[bytes, tuple[ChunkRecord, bytes]], have: set[bytes],
            gone: dict[bytes, Segment] | None = None) -> Commit:
    """The persist's one write transaction: OK, EXISTS (the entry is already indexed) or
    RETRY (a chunk it shares, or its own pack file, was removed by a gc meanwhile: checked
    here, under the write lock gc also takes to remove files). ``gone``: chunks indexed
    here whose file was found missing or short; this persist wrote them again, and their
    records move to the new segment (every entry built on them is whole again)."""
    gone = gone or {}
    if t.raw("entries", job.key) is not None:
        return Commit.EXISTS
    if w.size and not w.still_there():
        return Commit.RETRY
    reused: dict[bytes, ChunkRecord] = {}
    for ck in have:
        try:
            got = t.chunk(ck)
        except RecordError:
            got = None  # unreadable now: write it ourselves (the record is overwritten)
        if got is None:
            return Commit.RETRY
        reused[ck] = got
    segments, live = 0, 0
    for ck, (crec, toks) in new.items():
        try:
            old = t.chunk(ck)
        except RecordError:
            old = None  # overwritten by a good record of the same content
        if old is not None and ck in gone and old.segment == gone[ck]:  # its file was lost: ours replaces it
            t.release(old.segment)
            t.set_chunk(ck, replace(crec, refs=old.refs + 1))
            segments, live = segments + 1, live + crec.segment.length
        elif old is not None:  # written meanwhile by another writer: share it, ours is dead
            t.set_chunk(ck, old.with_refs(old.refs + 1))
        else:
            t.put_chunk(ck, crec, toks)
            segments, live = segments + 1, live + crec.segment.length
    for ck, old in reused.items():
        t.set_chunk(ck, old.with_refs(old.refs + 1))
    if rec.tail is not None:
        segments, live = segments + 1, live + rec.tail.length
    if segments:
        t.put_pack(w.pack, PackRecord(w.size, segments, live, float(job.created)))
    elif w.size:
        t.unlink_after_commit(w.path)
    t.put_entry(job.key, rec, job.tokens)
    if w.size:
        bytes_written.count(t, w.size)
    return Commit.OK
