"""The disk tier: pack files under ``blobs/``, named by the LMDB index under ``index/``.

Trimmable KV (every layer KVCache / QuantizedKVCache) is cut into fixed token chunks keyed
by the chained hash, so a shared prefix is stored once and a conversation that grows by a
turn writes only its new chunks, plus an exact tail for the last partial chunk. Everything
else (RotatingKVCache, ArraysCache, mixed layouts) is one snapshot taken at exactly the
prefix boundary. One persist writes one pack file holding all its new segments.

``plan`` walks the query's chunk boundaries through the index's trie and returns the
longest reusable prefix: an entry (exact or shorter) or a chunk chain trimmed back to the
common prefix. Every token of a plan is compared with the stored token ids; no hash is
trusted alone. ``restore`` checks each segment's header against its record and the
identity's layout before allocating anything, reads the segments straight into the final
arrays, verifies every checksum, and builds the caches once. Any failure is a
``BlobError`` naming the record; the store turns it into a miss and drops the record.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import xxhash

from . import blobs
from .identity import ArraySpec, Identity
from .index import Index, IndexOpenError, Reader, WriteTxn
from .keys import TOKEN_BYTES, boundaries, chunk_key, encode_tokens, entry_key, root_key
from .keys import common_tokens as _common
from .records import MAX_CHUNK, ChunkRecord, EntryRecord, Kind, PackRecord, RecordError, Segment

log = logging.getLogger("kvstore")

# Segments of one restore read (and hashed) at a time, on reader threads: preadv and
# xxhash release the GIL, so reads overlap each other and the hashing. Warm reads are
# CPU-bound (copy + hash): more readers than cores only contend.
RESTORE_THREADS = max(2, min(4, os.cpu_count() or 2))
FORMAT_TAG = "3"


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
    layout: list
    n: int
    nbytes: int


@dataclass
class PersistJob:
    """One cache snapshot to persist, prepared on the caller's thread: ``key`` is the entry
    key of ``tokens`` (computed once), ``tensors`` ``blobs.host_views`` of the cache."""

    identity: Identity
    tokens: bytes
    key: bytes
    tensors: dict[str, tuple[str, Any]]
    layout: list
    cache_type: str = "assistant"
    created: float = field(default_factory=time.time)

    @property
    def n(self) -> int:
        return len(self.tokens) // TOKEN_BYTES


LayoutCheck = Callable[[dict[str, ArraySpec], list], "str | None"]


class DiskTier:
    """Pack files + index of one cache directory. ``shared_dir``: a group shares the
    directory on purpose (files 0660, directories 2770) instead of private (0600, 0700)."""

    def __init__(self, root: Path, *, chunk_tokens: int = 256, readonly: bool = False,
                 shared_dir: bool = False) -> None:
        self.root = Path(root)
        self.blob_root = self.root / "blobs"
        self.file_mode, self.dir_mode = (0o660, 0o2770) if shared_dir else (0o600, 0o700)
        if not readonly:
            for d in (self.root / "index", self.blob_root):
                blobs.make_dir(d, self.dir_mode)
        self.index = Index(self.root, readonly=readonly, mode=self.file_mode)
        # The chunk size is part of the directory's format (it places every key boundary):
        # the first opener fixes it, later openers use it whatever they ask for.
        stored = self.index.meta_setdefault(b"chunk_tokens", str(int(chunk_tokens)).encode())
        try:
            self.chunk = _chunk_size(stored, chunk_tokens, self.index.path)
        except IndexOpenError:
            self.index.close()
            raise
        if self.chunk != chunk_tokens:
            log.info("kvstore: %s uses chunk_tokens=%d (asked for %d)", self.root, self.chunk, chunk_tokens)

    def close(self) -> None:
        """Release the index (see ``Index.close``)."""
        self.index.close()

    # -- lookup ------------------------------------------------------------------------

    def plan(self, ident: Identity, tokens: list[int] | bytes) -> Plan | None:
        """The longest reusable stored prefix of ``tokens`` for ``ident``, or None.

        One read transaction. First the chain of stored full chunks matching the query is
        followed as far as it goes; then the boundaries from the deepest down to the end of
        that chain are searched for entries (and, at the chain's end, a chunk to trim),
        stopping as soon as nothing shallower can be longer. Each boundary costs a few
        seeks however many children it has (``trie.edges``). Records kvstore did not write
        are passed over."""
        enc = tokens if isinstance(tokens, bytes) else encode_tokens(tokens)
        bounds = boundaries(root_key(ident.digest), enc, self.chunk)
        return self.index.view(lambda r: _plan(r, ident, enc, bounds, self.chunk))

    # -- restore -----------------------------------------------------------------------

    def restore(self, plan: Plan, ident: Identity, check: LayoutCheck | None = None) -> Restored:
        """Read a plan's segments (verified) and build live caches holding ``plan.n`` tokens.

        ``check(specs, layout)`` names why the stored layout does not fit the model (see
        ``identity.layout_problem``); it runs on the segments' headers, before anything is
        allocated. Raises BlobError (naming the record in ``err.record``) on anything
        unexpected; then nothing is returned and the arrays being filled are dropped."""
        from . import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up

        pieces = self.index.view(lambda r: _pieces(r, plan))
        with _Packs(self.blob_root) as packs:
            heads = [_header(packs, p) for p in pieces]
            layout, specs = _checked(pieces, heads, ident, plan, self.chunk, check)
            arrays, hosts = blobs.alloc(specs)
            _read_all(packs, pieces, heads, hosts, self.chunk if plan.chunked else None)
        tensors = {name: blobs.finish(specs[name][0], a) for name, a in arrays.items()}
        nbytes = sum(p.segment.length for p in pieces)
        if plan.chunked:
            tensors = codec.slice_tokens(tensors, 0, plan.n)
            layout = codec.with_offset(layout, plan.n)
        cache = codec.decode_cache(tensors, layout)
        if not plan.chunked and plan.n < plan.stored_n:
            if not codec.trimmable(cache):
                raise _blamed(pieces[-1].record, "stored snapshot cannot be trimmed")
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

    # -- persist -----------------------------------------------------------------------

    def persist(self, job: PersistJob) -> int:
        """Write a job's new segments into one pack file and commit its entry in one
        transaction; returns the pack bytes written (0 if the entry already existed).
        Chunks already indexed are shared, not written. Raises OSError on a failed write
        (nothing is indexed then, and the pack file is removed)."""
        from . import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up

        C = self.chunk
        bounds = boundaries(root_key(job.identity.digest), job.tokens, C)
        chunked = codec.is_chunkable(job.layout, job.n)
        K = len(bounds) - 1 if chunked else 0
        have = self.index.view(lambda r: None if r.raw("entries", job.key) else
                               {bounds[k + 1] for k in range(K) if r.raw("chunks", bounds[k + 1])})
        if have is None:
            return 0
        for _attempt in range(3):
            writer = blobs.PackWriter(self.blob_root, mode=self.file_mode, dir_mode=self.dir_mode)
            try:
                new, tail = _write_segments(writer, job, bounds, K, chunked, have, C)
                if writer.size:
                    writer.seal()
                rec = _entry_record(job, bounds, K, chunked, tail, C)
                status = self.index.transact(lambda t: _commit(t, job, rec, writer, new, have))
            except BaseException:
                writer.discard()
                raise
            writer.close()
            if status == "ok":
                return writer.size
            if status == "exists":
                writer.discard()
                return 0
            writer.discard()
            have = set()  # "retry": a reused chunk or this pack vanished under a gc: write all
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
                     chunks: list[tuple[bytes, ChunkRecord, bytes, bytes]], tail: bytes,
                     check: LayoutCheck | None = None) -> str:
        """File segments framed elsewhere (another machine's, from a shared tier) as entry
        ``key`` of ``tokens``: ``rec`` its record (its tail segment's place is ignored),
        ``chunks`` the (key, record, token ids, segment bytes) of its chunks not indexed
        here, ``tail`` its tail or snapshot bytes (b"" for none). Every chunk of ``rec``
        not given must be indexed here.

        Before anything is written, every segment is checked as ``restore`` checks it: its
        header's metadata names this record, identity and token range, all share one
        layout, and ``check`` accepts it. Then, as ``persist`` does: one new pack,
        checksums verified as it is written, synced, and one transaction (``_commit``:
        chunks indexed meanwhile are shared, the pack re-checked). Returns "ok",
        "exists" or "retry" (a gc removed what it needed; nothing is indexed). Raises
        BlobError naming the failing record; OSError on a failed write."""
        C = self.chunk
        if rec.chunk != C or rec.identity != ident.digest:
            raise _blamed(("entry", key), "not an entry of this directory's identity and chunk size")
        plan = Plan(rec.n, rec.chunks, None, rec.n, rec.chunked)
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
        heads = []
        for p, d in zip(pieces, data):
            with _blame(*p.record):
                heads.append(blobs.parse_header(d, len(d)))
        if pieces:
            _checked(pieces, heads, ident, plan, C, check)
        have = set(rec.chunks) - {ck for ck, *_ in chunks}
        now = time.time()
        job = PersistJob(ident, tokens, key, {}, [], rec.cache_type, now)
        writer = blobs.PackWriter(self.blob_root, mode=self.file_mode, dir_mode=self.dir_mode)
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
        if status != "ok":
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
        fd = blobs.open_own(blobs.pack_path(self.blob_root, seg.pack))
        try:
            data = os.pread(fd, seg.length, seg.offset)
        finally:
            os.close(fd)
        if len(data) != seg.length or xxhash.xxh3_128_digest(data) != seg.checksum:
            raise blobs.BlobError(f"pack {seg.pack.hex()[:12]}: segment is short or does not match its checksum")
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


def _chunk_size(stored: bytes | None, asked: int, where: Path) -> int:
    """The directory's chunk size: the stored one (``asked`` if none is stored yet);
    IndexOpenError if it is not one kvstore writes (a damaged or crafted record)."""
    if stored is None:
        return int(asked)
    try:
        n = int(stored)
    except ValueError:
        n = 0
    if not 0 < n <= MAX_CHUNK:
        raise IndexOpenError(f"index {where} records chunk_tokens={stored[:24]!r}, which kvstore never writes "
                             "(a damaged or foreign index): use another cache directory, or remove this one "
                             "(its cache is rebuilt as requests come)")
    return n


# ----------------------------------------------------------------------------- planning


def _record(r: Reader, kind: Kind, key: bytes) -> Any:
    try:
        return r.entry(key) if kind is Kind.ENTRY else r.chunk(key)
    except RecordError:
        return None  # not kvstore's: passed over (verify --fix drops it)


def _plan(r: Reader, ident: Identity, enc: bytes, bounds: list[bytes], C: int) -> Plan | None:
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
        best = Plan(n - 1 if n == n_q else n, tuple(chain[:-1]), (Kind.CHUNK, chain[-1]), n, True)
    for k in range(len(bounds) - 1, len(chain) - 1, -1):
        if best is not None and best.n >= (k + 1) * C:
            break  # everything filed at boundary k or above holds fewer tokens
        after = enc[k * C * TOKEN_BYTES : (k + 1) * C * TOKEN_BYTES]
        for child, kind, shared, exact in r.edges(bounds[k], after):
            top = k * C + shared if exact else min(k * C + shared, n_q - 1)
            if best is not None and top <= best.n:
                break  # what follows shares no more (trie.edges), so it cannot do better
            got = _candidate(r, ident, enc, bounds[k], k, child, kind, chain, C, best.n if best else 0)
            if got is not None and (best is None or got.n > best.n):
                best = got
    return best


def _candidate(r: Reader, ident: Identity, enc: bytes, boundary: bytes, k: int, child: bytes,
               kind: Kind | None, chain: list[bytes], C: int, beat: int) -> Plan | None:
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
        if (n_e if common == n_e else min(common, n_q - 1)) <= beat or not _keyed(boundary, k, child, kind, stored, C):
            return None
        rec = _record(r, kind, child)
        if rec is None or rec.identity != ident.digest or rec.n != n_e or (rec.chunked and k > len(chain)):
            return None
        usable = n_e if common == n_e else (min(common, n_q - 1) if rec.trimmable else 0)
        if usable <= 0:
            return None
        return Plan(usable, tuple(chain[:k]) if rec.chunked else (), (kind, child), n_e, rec.chunked,
                    entry=child, cache_type=rec.cache_type)
    if k != len(chain):
        return None
    m = _common(stored, enc[k * C * TOKEN_BYTES :])
    if m <= 0 or min(k * C + m, n_q - 1) <= beat or not _keyed(boundary, k, child, kind, stored, C):
        return None
    if _record(r, kind, child) is None:
        return None
    return Plan(min(k * C + m, n_q - 1), tuple(chain[:k]), (kind, child), (k + 1) * C, True)


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
    """Pack files opened once per restore (kvstore's own files only, see ``blobs``)."""

    def __init__(self, blob_root: Path) -> None:
        self.blob_root = blob_root
        self.fds: dict[bytes, int] = {}

    def fd(self, piece: _Piece) -> int:
        seg = piece.segment
        with _blame(*piece.record):
            if seg.pack not in self.fds:
                self.fds[seg.pack] = blobs.open_own(blobs.pack_path(self.blob_root, seg.pack))
            if os.fstat(self.fds[seg.pack]).st_size < seg.end:
                raise blobs.BlobError(f"pack {seg.pack.hex()[:12]} is shorter than its segment")
        return self.fds[seg.pack]

    def __enter__(self) -> "_Packs":
        return self

    def __exit__(self, *exc: Any) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _header(packs: _Packs, p: _Piece) -> blobs.Header:
    fd = packs.fd(p)
    with _blame(*p.record):
        return blobs.read_header(fd, p.segment, f"{p.record[0]} {p.record[1].hex()[:12]}")


def _check_pieces(pieces: list[_Piece], heads: list[blobs.Header], ident: Identity, plan: Plan, C: int) -> list:
    """The stored layout, once every piece's header says it is the record's own segment
    (key, kind, identity, token range) and all pieces share one layout. Headers are not
    verified yet: this only decides what to allocate (bounded by the segments' sizes);
    the checksums decide what is handed out."""
    from . import codec

    layout = None
    for p, h in zip(pieces, heads):
        with _blame(*p.record):
            m = h.meta
            want = {"kvstore.key": p.record[1].hex(), "kvstore.kind": p.kind, "kvstore.identity": ident.hex,
                    "kvstore.tokens": f"{p.lo}-{p.hi}"}
            bad = [k for k, v in want.items() if m.get(k) != v]
            if bad or m.get("kvstore.format") != FORMAT_TAG:
                err = blobs.BlobError(f"the segment is not what its record says ({', '.join(bad) or 'format'})")
                err.foreign = "kvstore.key" in bad and isinstance(m.get("kvstore.key"), str)
                raise err
            try:
                got = codec.check_layout(json.loads(m.get("kvstore.layout", "")))
            except (ValueError, RecursionError) as e:
                raise blobs.BlobError(f"the segment's layout is unusable: {e}") from None
            if layout is None:
                layout = got
            elif codec.layout_signature(got) != codec.layout_signature(layout):
                raise blobs.BlobError("the segments of one entry disagree on its layout")
            if plan.chunked and not codec.is_chunkable(got, p.hi - p.lo):
                raise blobs.BlobError("a chunked piece holds a layout that cannot be chunked")
    return layout  # type: ignore[return-value]


def _checked(pieces: list[_Piece], heads: list[blobs.Header], ident: Identity, plan: Plan, C: int,
             check: LayoutCheck | None) -> tuple[list, blobs.Specs]:
    """The stored layout and the restored arrays' specs, once ``_check_pieces`` and
    ``check`` (the identity's layout check, on the specs) accept the pieces."""
    layout = _check_pieces(pieces, heads, ident, plan, C)
    specs = _final_specs(heads[0], plan) if plan.chunked else heads[0].specs
    if check is not None:
        with _blame(*pieces[-1].record):
            why = check({n: ArraySpec(s, _mx_dtype(st)) for n, (st, s) in specs.items()}, layout)
            if why:
                raise blobs.BlobError(f"stored cache does not fit the model: {why}")
    return layout, specs


def _final_specs(first: blobs.Header, plan: Plan) -> blobs.Specs:
    """The restored arrays' specs: the first piece's, at ``stored_n`` tokens."""
    specs = {}
    for name, (st, shape) in first.specs.items():
        if len(shape) < 2:
            raise blobs.BlobError(f"tensor {name!r} has no token axis")
        specs[name] = (st, (*shape[:-2], plan.stored_n, shape[-1]))
    return specs


def _read_all(packs: _Packs, pieces: list[_Piece], heads: list[blobs.Header],
              hosts: dict[str, np.ndarray], chunk: int | None) -> None:
    """Every piece read into its token slice of ``hosts`` (chunked) or into ``hosts``
    whole (a snapshot), a few at a time on reader threads, each verified as it is read.
    Returns when every piece verified; raises the first failure (no reader still runs)."""
    fds = [packs.fd(p) for p in pieces]

    def read(i: int) -> None:
        p = pieces[i]
        dests = {n: h[..., p.lo : p.hi, :] for n, h in hosts.items()} if chunk is not None else hosts
        with _blame(*p.record):
            blobs.read_into(fds[i], p.segment, heads[i], dests, f"{p.record[0]} {p.record[1].hex()[:12]}")

    if len(pieces) == 1:
        read(0)
        return
    with ThreadPoolExecutor(min(RESTORE_THREADS, len(pieces)), "kvstore-restore") as pool:
        futures = [pool.submit(read, i) for i in range(len(pieces))]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise  # after the pool's exit has waited for the running readers


def _mx_dtype(st: str) -> str:
    return {"BF16": "bfloat16"}.get(st) or blobs.host_dtype(st).name


@contextmanager
def _blame(kind: str, key: bytes) -> Iterator[None]:
    """A failure in the block that is the record's or its file's becomes a BlobError naming
    the record (``err.record``). An OSError passes as it is: what ``blobs`` leaves raised
    (EMFILE, EIO, ENOMEM...) is about the process or the system, not this record."""
    try:
        yield
    except blobs.BlobError as e:
        e.record = (kind, key)
        raise
    except (KeyError, TypeError, ValueError) as e:  # an unusable record or file
        raise _blamed((kind, key), f"{type(e).__name__}: {e}") from None


def _blamed(record: tuple[str, bytes], why: str) -> blobs.BlobError:
    err = blobs.BlobError(f"{record[0]} {record[1].hex()[:12]}: {why}")
    err.record = record
    return err


# ----------------------------------------------------------------------------- persisting


def _meta(job: PersistJob, kind: str, key: bytes, lo: int, hi: int, layout: list) -> dict[str, str]:
    return {"kvstore.format": FORMAT_TAG, "kvstore.identity": job.identity.hex, "kvstore.kind": kind,
            "kvstore.key": key.hex(), "kvstore.tokens": f"{lo}-{hi}", "kvstore.layout": json.dumps(layout)}


def _write_segments(w: blobs.PackWriter, job: PersistJob, bounds: list[bytes], K: int, chunked: bool,
                    have: set[bytes], C: int) -> tuple[dict[bytes, tuple[ChunkRecord, bytes]], Segment | None]:
    """Append the job's chunks not in ``have``, then its tail or snapshot, to one pack.
    Returns the new chunks' records (and token ids) and the tail / snapshot segment."""
    from . import codec

    n, enc = job.n, job.tokens
    host = {nm: (st, np.asarray(a)) for nm, (st, a) in job.tensors.items()}  # no MLX op on this thread
    if not chunked:
        return {}, w.add(host, _meta(job, "snapshot", job.key, 0, n, job.layout))
    new: dict[bytes, tuple[ChunkRecord, bytes]] = {}
    chunk_layout = codec.with_offset(job.layout, C)
    for k in range(K):
        ck = bounds[k + 1]
        if ck not in have:
            part = {nm: (st, a[..., k * C : (k + 1) * C, :]) for nm, (st, a) in host.items()}
            seg = w.add(part, _meta(job, "chunk", ck, k * C, (k + 1) * C, chunk_layout))
            new[ck] = (ChunkRecord(job.identity.digest, bounds[k], C, 1, seg), enc[k * C * TOKEN_BYTES : (k + 1) * C * TOKEN_BYTES])
    if n == K * C:
        return new, None
    part = {nm: (st, a[..., K * C : n, :]) for nm, (st, a) in host.items()}
    return new, w.add(part, _meta(job, "tail", job.key, K * C, n, codec.with_offset(job.layout, n - K * C)))


def _entry_record(job: PersistJob, bounds: list[bytes], K: int, chunked: bool, tail: Segment | None,
                  C: int) -> EntryRecord:
    from . import codec

    return EntryRecord(job.identity.digest, job.n, C, chunked,
                       chunked or codec.layout_trimmable(job.layout), bounds[-1],
                       tuple(bounds[1 : K + 1]), tail, job.cache_type, float(job.created),
                       float(job.created), 0, False)


def _commit(t: WriteTxn, job: PersistJob, rec: EntryRecord, w: blobs.PackWriter,
            new: dict[bytes, tuple[ChunkRecord, bytes]], have: set[bytes]) -> str:
    """The persist's one write transaction: ``"ok"``, ``"exists"`` (the entry is already
    indexed) or ``"retry"`` (a chunk it shares, or its own pack file, was removed by a gc
    meanwhile: checked here, under the write lock gc also takes to remove files)."""
    if t.raw("entries", job.key) is not None:
        return "exists"
    if w.size and not w.still_there():
        return "retry"
    shared = {}
    for ck in have:
        try:
            shared[ck] = t.chunk(ck)
        except RecordError:
            shared[ck] = None  # unreadable now: write it ourselves (the record is overwritten)
        if shared[ck] is None:
            return "retry"
    segments, live = 0, 0
    for ck, (crec, toks) in new.items():
        try:
            old = t.chunk(ck)
        except RecordError:
            old = None  # overwritten by a good record of the same content
        if old is not None:  # written meanwhile by another writer: share it, ours is dead
            t.set_chunk(ck, old.with_refs(old.refs + 1))
        else:
            t.put_chunk(ck, crec, toks)
            segments, live = segments + 1, live + crec.segment.length
    for ck, old in shared.items():
        t.set_chunk(ck, old.with_refs(old.refs + 1))
    if rec.tail is not None:
        segments, live = segments + 1, live + rec.tail.length
    if segments:
        t.put_pack(w.pack, PackRecord(w.size, segments, live, float(job.created)))
    elif w.size:
        t.unlink_after_commit(w.path)
    t.put_entry(job.key, rec, job.tokens)
    return "ok"
