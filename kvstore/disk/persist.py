"""Persisting: a cache snapshot's new segments written into one pack file and its entry
committed in one transaction. Trimmable KV is cut into fixed token chunks keyed by the
chained hash (a common prefix is stored once, a conversation that grows by a turn writes
only its new chunks), plus an exact tail for the last partial chunk; everything else is one
snapshot taken at exactly the prefix boundary. Chunks already indexed are reused, not
written (unless their pack file is gone: then written again).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from .. import bytes_written, files, segments
from ..layout import Layout
from ..identity import Identity
from ..index import Reader, WriteTxn
from ..keys import TOKEN_BYTES
from ..query import Query
from ..records import ChunkRecord, EntryRecord, PackRecord, RecordError, Segment
from ..segments import SegmentMeta
from .tier import Tier


class Commit(str, Enum):
    """How a persist's (or an import's) one write transaction ended (``commit``)."""

    OK = "ok"          # the entry is indexed
    EXISTS = "exists"  # it was indexed already
    RETRY = "retry"    # a chunk it shares, or its own pack file, was removed by a gc meanwhile



@dataclass
class PersistJob:
    """One cache snapshot to persist, prepared on the caller's thread: ``query`` its
    tokens under its identity, chained as the tier it is written to chains (their
    encoding, the entry key and the chain, each computed once however many steps of a
    persist read them: policy, prefix, write, commit), ``tensors`` ``segments.host_views``
    of the cache."""

    identity: Identity
    query: Query
    tensors: dict[str, tuple[str, Any]]
    layout: Layout
    cache_type: str = "assistant"
    created: float = field(default_factory=time.time)


def persist(tier: Tier, job: PersistJob) -> int:
    """Write a job's new segments into one pack file and commit its entry in one
    transaction (``commit``; ``DiskTier.persist``); returns the pack bytes written (0 if
    the entry already existed). Chunks already indexed are reused, not written. Raises
    OSError on a failed write (nothing is indexed then, and the pack file is removed);
    ValueError for a job chained under another chunk size."""
    q, C = job.query, tier.chunk
    if q.chunk != C:
        raise ValueError(f"a job chained every {q.chunk} tokens, this directory every {C}")
    bounds = q.bounds
    chunked = job.layout.chunkable(q.n)
    K = len(bounds) - 1 if chunked else 0
    held = tier.index.view(lambda r: None if r.raw("entries", q.key) else
                           {bounds[k + 1]: _readable_chunk(r, bounds[k + 1]) for k in range(K)
                            if r.raw("chunks", bounds[k + 1])})
    if held is None:
        return 0
    # a chunk indexed here whose pack file is gone or cut short (damage nobody has read
    # yet) is written again, not shared: sharing it would commit an entry lost on its
    # first read. One stat per pack; damage inside a file is a read's to find.
    gone = _missing_files(tier.blob_root, held)
    have: set[bytes] = set(held) - set(gone)
    for _attempt in range(3):
        writer = segments.PackWriter(tier.blob_root, modes=tier.modes)
        try:
            new, tail = _write_segments(writer, job, bounds, K, chunked, have, C)
            if writer.size:
                writer.seal()
            rec = _entry_record(job, bounds, K, chunked, tail, C)
            status = tier.index.transact(lambda t: commit(t, q.key, q.enc, rec, writer, new, have, gone))
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


def _meta(job: PersistJob, kind: str, key: bytes, lo: int, hi: int, layout: list) -> dict[str, str]:
    return SegmentMeta(job.identity.hex, kind, key, lo, hi, layout).to_meta()


def _write_segments(w: segments.PackWriter, job: PersistJob, bounds: list[bytes], K: int, chunked: bool,
                    have: set[bytes], C: int) -> tuple[dict[bytes, tuple[ChunkRecord, bytes]], Segment | None]:
    """Append the job's chunks not in ``have``, then its tail or snapshot, to one pack.
    Returns the new chunks' records (and token ids) and the tail / snapshot segment."""
    import numpy as np

    q = job.query
    n, enc = q.n, q.enc
    host = {nm: (st, np.asarray(a)) for nm, (st, a) in job.tensors.items()}  # no MLX op on this thread
    if not chunked:
        return {}, w.add(host, _meta(job, "snapshot", q.key, 0, n, job.layout.to_json()))
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
    return new, w.add(part, _meta(job, "tail", q.key, K * C, n, tail_layout))


def _entry_record(job: PersistJob, bounds: list[bytes], K: int, chunked: bool, tail: Segment | None,
                  C: int) -> EntryRecord:
    return EntryRecord(job.identity.digest, job.query.n, C, chunked, chunked or job.layout.trimmable, bounds[-1],
                       tuple(bounds[1 : K + 1]), tail, job.cache_type, float(job.created),
                       float(job.created), 0, False)


def _readable_chunk(r: Reader, key: bytes) -> ChunkRecord | None:
    try:
        return r.chunk(key)
    except RecordError:
        return None  # unreadable: written again (``commit`` overwrites the record)


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


def commit(t: WriteTxn, key: bytes, tokens: bytes, rec: EntryRecord, w: segments.PackWriter,
           new: dict[bytes, tuple[ChunkRecord, bytes]], have: set[bytes],
           gone: dict[bytes, Segment] | None = None) -> Commit:
    """The persist's one write transaction: OK, EXISTS (the entry is already indexed) or
    RETRY (a chunk it shares, or its own pack file, was removed by a gc meanwhile: checked
    here, under the write lock gc also takes to remove files). ``key``, ``tokens`` and
    ``rec``: the entry to index (``rec.created`` dates its pack too). ``gone``: chunks indexed
    here whose file was found missing or short; this persist wrote them again, and their
    records move to the new segment (every entry built on them is whole again)."""
    gone = gone or {}
    if t.raw("entries", key) is not None:
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
    written, live = 0, 0
    for ck, (crec, toks) in new.items():
        try:
            old = t.chunk(ck)
        except RecordError:
            old = None  # overwritten by a good record of the same content
        if old is not None and ck in gone and old.segment == gone[ck]:  # its file was lost: ours replaces it
            t.release(old.segment)
            t.set_chunk(ck, replace(crec, refs=old.refs + 1))
            written, live = written + 1, live + crec.segment.length
        elif old is not None:  # written meanwhile by another writer: share it, ours is dead
            t.set_chunk(ck, old.with_refs(old.refs + 1))
        else:
            t.put_chunk(ck, crec, toks)
            written, live = written + 1, live + crec.segment.length
    for ck, old in reused.items():
        t.set_chunk(ck, old.with_refs(old.refs + 1))
    if rec.tail is not None:
        written, live = written + 1, live + rec.tail.length
    if written:
        t.put_pack(w.pack, PackRecord(w.size, written, live, rec.created))
    elif w.size:
        t.unlink_after_commit(w.path)
    t.put_entry(key, rec, tokens)
    if w.size:
        bytes_written.count(t, w.size)
    return Commit.OK
