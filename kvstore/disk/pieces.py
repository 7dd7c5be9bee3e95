"""The segments a restore or an import reads (``Piece``: whose, what its header must say,
where it lands) and the checks every one passes before anything is allocated: its header
names its record, identity and token range, all share one layout, and the layout fits the
identity's model. A failure of a record's bytes is a ``BlobError`` naming the record
(``blame``); anything else passes as it is.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from .. import files, segments
from ..layout import Layout
from ..identity import Identity
from ..index import Reader
from ..fit import ArraySpec, layout_problem
from ..records import ChunkRecord, EntryRecord, Kind, RecordError, Segment
from ..segments import SegmentMeta, SegmentMismatch
from ..floors import CutRefused
from .plan import Plan


@dataclass(frozen=True)
class Piece:
    """One segment to read: whose it is, what its header must say, where it lands."""

    record: tuple[str, bytes]     # ("entry" | "chunk", key): blamed on failure
    kind: str                      # the segment's kvstore.kind
    segment: Segment
    lo: int                        # token range in the restored arrays
    hi: int


def plan_pieces(r: Reader, plan: Plan) -> list[Piece]:
    """The plan's segments in order, from its records (one read transaction)."""
    out: list[Piece] = []
    lo = 0
    for ck in plan.chunks:
        crec = _need(r, Kind.CHUNK, ck)
        out.append(Piece(("chunk", ck), "chunk", crec.segment, lo, lo + crec.n))
        lo += crec.n
    kind, key = plan.last  # type: ignore[misc]
    rec = _need(r, kind, key)
    if kind is Kind.CHUNK:
        out.append(Piece(("chunk", key), "chunk", rec.segment, lo, lo + rec.n))
    elif rec.tail is not None:
        out.append(Piece(("entry", key), "tail" if rec.chunked else "snapshot", rec.tail, lo, rec.n))
    if not out or out[-1].hi != plan.stored_n:
        raise blamed(("entry" if kind is Kind.ENTRY else "chunk", key),
                      f"its pieces hold {out[-1].hi if out else 0} tokens, not {plan.stored_n}")
    return out


def _need(r: Reader, kind: Kind, key: bytes) -> Any:
    name = "entry" if kind is Kind.ENTRY else "chunk"
    try:
        rec = r.entry(key) if kind is Kind.ENTRY else r.chunk(key)
    except RecordError as e:
        raise blamed((name, key), f"unreadable record: {e}") from None
    if rec is None:
        raise blamed((name, key), "vanished from the index")
    return rec


def _check_pieces(pieces: list[Piece], heads: list[segments.Header], ident: Identity, plan: Plan) -> Layout:
    """The stored layout, once every piece's header says it is the record's own segment
    (key, kind, identity, token range) and all pieces share one layout. Headers are not
    verified yet: this only decides what to allocate (bounded by the segments' sizes);
    the checksums decide what is handed out."""
    layout = None
    for p, h in zip(pieces, heads):
        with blame(*p.record):
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


def checked(pieces: list[Piece], heads: list[segments.Header], ident: Identity,
             plan: Plan) -> tuple[Layout, segments.Specs]:
    """The stored layout and the restored arrays' specs, once ``_check_pieces`` and the
    identity's layout check (``fit.layout_problem``, on the specs) accept the pieces; CutRefused
    if the plan cuts a snapshot where its layout does not allow (nothing allocated yet)."""
    layout = _check_pieces(pieces, heads, ident, plan)
    with blame(*pieces[0].record):
        specs = _final_specs(heads[0], plan) if plan.chunked else heads[0].specs
    with blame(*pieces[-1].record):
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


@dataclass(frozen=True)
class Framed:
    """An entry framed elsewhere, taken apart: the plan of its ``n`` tokens, its pieces in
    token order with their bytes (``data``) and parsed (not yet checked) headers."""

    plan: Plan
    pieces: list[Piece]
    data: list[Any]
    heads: list[segments.Header]


def framed(C: int, ident: Identity, key: bytes, rec: EntryRecord, chunks: list[tuple[bytes, ChunkRecord, bytes, Any]],
           tail: Any, n: int | None = None) -> Framed:
    """The one preamble of a restore from bytes in memory and of an import: entry ``key``
    (``rec``) of ``ident`` framed elsewhere, its given chunks then its tail or snapshot,
    each header parsed (reading only the header's bytes). ``n``: a restore of ``n``
    tokens, which needs every chunk of ``rec`` given; None: an import of all of it, given
    the chunks not indexed here. BlobError naming the record otherwise."""
    whole = n is not None
    if rec.chunk != C or rec.identity != ident.digest or (whole and {ck for ck, *_ in chunks} != set(rec.chunks)):
        raise blamed(("entry", key), f"not {'a whole entry' if whole else 'an entry'} of this directory's "
                                     "identity and chunk size")
    at = {ck: k for k, ck in enumerate(rec.chunks)}
    pieces, data = [], []
    for ck, crec, _toks, seg in chunks:
        if ck not in at or crec.n != C:
            raise blamed(("chunk", ck), "not a chunk of the entry")
        pieces.append(Piece(("chunk", ck), "chunk", crec.segment, at[ck] * C, (at[ck] + 1) * C))
        data.append(seg)
    if rec.tail is not None:
        lo = len(rec.chunks) * C if rec.chunked else 0
        pieces.append(Piece(("entry", key), "tail" if rec.chunked else "snapshot", rec.tail, lo, rec.n))
        data.append(tail)
    heads = []
    for p, d in zip(pieces, data):
        with blame(*p.record):
            hlen = int.from_bytes(bytes(d[:8]), "little") if len(d) >= 8 else 0
            heads.append(segments.parse_header(bytes(d[: 8 + min(hlen, len(d))]), len(d)))
    return Framed(Plan(rec.n if n is None else n, rec.chunks, None, rec.n, rec.chunked), pieces, data, heads)


@contextmanager
def blame(kind: str, key: bytes) -> Iterator[None]:
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
        raise blamed((kind, key), f"{type(e).__name__}: {e}") from None


def blamed(record: tuple[str, bytes], why: str) -> files.BlobError:
    err = files.BlobError(f"{record[0]} {record[1].hex()[:12]}: {why}")
    err.record = record
    return err
