"""Whole copies: a long entry that is served again is also kept as one safetensors file of
all its tokens, which MLX's own loader reads into the final arrays in one pass.

Why: a restore from segments allocates its arrays, then reads into them (MLX has no
uninitialised allocation, see ``alloc``): one pass over the memory more than ``mx.load``
makes, 0.58-0.80x of ``load_prompt_cache`` warm on this machine (docs/design.md, "The
restore path"). ``mx.load`` of a file lays the bytes into freshly allocated arrays as it
reads them: the pass ``load_prompt_cache`` makes, and all a restore needs.

Guarantees:
- A copy is written off the request path (the writer thread), from the arrays a restore
  from segments just verified, only for an entry restored whole (``wanted``: every token
  of it, ``StoreOptions.whole_copy_min_bytes`` or more, from ``MIN_SEGMENTS`` or more segments) that was served
  before (``hits``), and only while the daily write budget and the disk budget have room
  for it: a copy never makes an entry be evicted, and budgets drop copies first
  (``budget.evict_to``).
- It is a segment like any other (a header naming the entry, its identity, its tokens and
  the kind "whole"; an xxh3-128 checksum), alone in a pack of its own at offset 0, named
  by the entry's record (``EntryRecord.whole``): removing the entry removes it, and
  ``verify``, ``gc``, ``ls`` and the byte counter count it.
- A restore reads it only for a plan of exactly the entry. Its header is checked as
  every segment's is before anything is allocated; MLX's own parse of the file must give
  the same tensors (names, dtypes, shapes) before MLX allocates; the loaded bytes must
  hash to the checksum before anything is handed out. A copy that fails a check is
  dropped and the entry restored from its segments (``Tier.forget_whole``); one whose header names
  another record is forgotten without releasing that record's pack.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .. import bytes_written, files, segments
from ..identity import Identity
from ..index import Reader, WriteTxn
from ..layout import Layout
from ..records import EntryRecord, Kind, PackRecord, RecordError, Segment
from ..segments import SegmentMeta
from .pieces import Piece, blame, checked
from .plan import Plan
from .tier import Tier

MIN_SEGMENTS = 2       # an entry of one segment is read in one pass already
LOADABLE = ("BF16", "F16", "F32", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "BOOL")  # mx.load's


def wanted(plan: Plan, nbytes: int, segments_read: int, min_bytes: int) -> bool:
    """Whether a restore of ``plan`` (``nbytes`` from ``segments_read`` segments) is worth a
    whole copy: all of one entry, ``min_bytes`` or more (``StoreOptions.whole_copy_min_bytes``:
    64 MB by default, below which a restore takes a fraction of a second either way), from
    several segments. Whether it was served
    before, and its dtypes, are the writer's checks (``write``), on the record and arrays."""
    return (plan.entry is not None and plan.last == (Kind.ENTRY, plan.entry) and plan.n == plan.stored_n
            and nbytes >= min_bytes and segments_read >= MIN_SEGMENTS)


def of_plan(r: Reader, plan: Plan) -> tuple[EntryRecord, Segment] | None:
    """The entry's record and whole copy when ``plan`` restores exactly that entry and it
    has one (in read transaction ``r``), else None."""
    if plan.entry is None or plan.last != (Kind.ENTRY, plan.entry) or plan.n != plan.stored_n:
        return None
    try:
        rec = r.entry(plan.entry)
    except RecordError:
        return None
    if rec is None or rec.whole is None or rec.n != plan.n:
        return None
    return rec, rec.whole


def load(tier: Tier, ident: Identity, plan: Plan, piece: Piece) -> tuple[segments.Specs, dict[str, Any], Layout] | None:
    """``piece``, a segment at offset 0 of its pack holding all of ``plan`` (a whole copy,
    kind "whole", with the plan ``as_snapshot``; or a snapshot entry's own segment),
    loaded by ``mx.load`` and verified: the specs, the evaluated arrays and the stored
    layout, for ``restore``'s builder. None, with nothing read but the header, when a
    snapshot's pack holds more than it or its dtypes are not ones MLX's loader reads (a
    restore from segments reads it then). BlobError naming the record (``err.foreign``
    when the header names another record) if a check fails; OSError when MLX cannot open
    the descriptor's file (the process's limits, not the file)."""
    import mlx.core as mx
    import xxhash

    seg, copy = piece.segment, piece.kind == "whole"
    what = "the whole copy" if copy else "the snapshot"
    with blame(*piece.record):
        fd = files.open_own(files.pack_path(tier.blob_root, seg.pack))
        try:
            size = os.fstat(fd).st_size
            if seg.offset != 0 or size < seg.end:
                raise files.BlobError(f"pack {seg.pack.hex()[:12]} is shorter than {what}")
            head = segments.read_header(fd, seg, f"{piece.record[0]} {piece.record[1].hex()[:12]} ({what})")
            layout, specs = checked([piece], [head], ident, plan)  # foreign: another record's pack
            if size != seg.length or any(st not in LOADABLE for st, _ in specs.values()):
                if copy:
                    raise files.BlobError(f"{what} is not alone in its pack, or in a dtype MLX's loader does not read")
                return None
            try:  # the descriptor checked above, not the path: nothing swapped in meanwhile is read
                arrays: dict[str, Any] = mx.load(files.fd_path(fd), format="safetensors")  # type: ignore[assignment]
            except (RuntimeError, ValueError, OSError) as e:
                if "Failed to open" in str(e):
                    raise OSError(f"MLX could not open {what}'s file: {e}") from None
                raise files.BlobError(f"MLX cannot load {what}: {e}") from None
            got = {n: (str(a.dtype).split(".")[-1], tuple(a.shape)) for n, a in arrays.items()}
            want = {n: (segments.mlx_dtype_name(st), shape) for n, (st, shape) in specs.items()}
            if got != want:  # before MLX allocates anything: its parse must be ours
                raise files.BlobError(f"MLX reads {what}'s header otherwise than kvstore")
            mx.async_eval(list(arrays.values()))  # MLX reads them all on its own threads
            h = xxhash.xxh3_128(head.prefix)
            for name in specs:  # file order; each hashed (GIL released) while the next ones load
                mx.eval(arrays[name])
                h.update(memoryview(arrays[name]))
        finally:
            os.close(fd)
        if h.digest() != seg.checksum:
            raise files.BlobError(f"{what}: checksum mismatch")
    return specs, arrays, layout


def copy_piece(plan: Plan, seg: Segment) -> Piece:
    """The piece of entry ``plan.entry``'s whole copy ``seg``."""
    assert plan.entry is not None
    return Piece(("entry", plan.entry), "whole", seg, 0, plan.n)


def as_snapshot(plan: Plan) -> Plan:
    """``plan`` read as one snapshot of all its tokens (what a whole copy holds)."""
    return Plan(plan.n, (), plan.last, plan.n, False, plan.entry, plan.cache_type, plan.chain, plan.holds_prompt)


def write(tier: Tier, ident: Identity, key: bytes, n: int, host: dict[str, tuple[str, Any]], layout: Layout,
          *, room: int | None = None) -> int:
    """Write entry ``key``'s whole copy from ``host`` (``segments.host_views`` of the
    ``n``-token arrays a restore verified, ``layout`` theirs) and name it in the record:
    only if the record still holds ``n`` tokens, has no copy and was served before, the
    dtypes are ones MLX's loader reads, and the copy fits ``room`` bytes (what the disk
    budget leaves; None for no budget).
    Returns the bytes written (0 for none). OSError / IndexFailure as the write or the
    commit raised them; the file is removed then."""
    try:
        rec = tier.index.entry(key)
    except RecordError:
        return 0
    size = sum(a.nbytes for _, a in host.values())
    if (rec is None or rec.whole is not None or rec.n != n or rec.hits < 1 or (room is not None and size > room)
            or any(st not in LOADABLE for st, _ in host.values())):
        return 0
    w = segments.PackWriter(tier.blob_root, modes=tier.modes)
    try:
        seg = w.add(host, SegmentMeta(ident.hex, "whole", key, 0, n, layout.to_json()).to_meta())
        w.seal()

        def run(t: WriteTxn) -> bool:
            try:
                cur = t.entry(key)
            except RecordError:
                return False
            if cur is None or cur.whole is not None or (cur.n, cur.chunks, cur.tail) != (rec.n, rec.chunks, rec.tail):
                return False
            if not w.still_there():
                return False
            t.set_entry(key, cur.with_whole(seg))
            t.put_pack(w.pack, PackRecord(w.size, 1, seg.length, time.time()))
            bytes_written.count(t, w.size)
            return True

        done = tier.index.transact(run)
    except BaseException:
        w.discard()
        raise
    if not done:
        w.discard()
        return 0
    w.close()
    return w.size
