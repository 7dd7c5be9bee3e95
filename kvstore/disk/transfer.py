"""Segments that cross machines (a shared tier, ``kvstore export``/``import``): an entry's
records and verified segment bytes read out of this directory, and an entry framed
elsewhere filed here, checked as a restore checks it before anything is written.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import xxhash

from .. import files, segments
from ..identity import Identity
from ..index import Reader
from ..records import ChunkRecord, EntryRecord, RecordError, Segment
from .persist import Commit, commit
from .pieces import blame, checked, framed
from .tier import Tier


def import_entry(tier: Tier, ident: Identity, key: bytes, rec: EntryRecord, tokens: bytes,
                 chunks: list[tuple[bytes, ChunkRecord, bytes, bytes]], tail: bytes) -> Commit:
    """File segments framed elsewhere (another machine's, from a shared tier) as entry
    ``key`` of ``tokens`` (``DiskTier.import_entry``): ``rec`` its record (its tail
    segment's place is ignored), ``chunks`` the (key, record, token ids, segment bytes) of
    its chunks not indexed here, ``tail`` its tail or snapshot bytes (b"" for none). Every
    chunk of ``rec`` not given must be indexed here.

    Before anything is written, every segment is checked as ``restore`` checks it: its
    header's metadata names this record, identity and token range, all share one
    layout, and it fits ``ident``'s model. Then, as ``persist`` does: one new pack,
    checksums verified as it is written, synced, and one transaction (``persist.commit``:
    chunks indexed meanwhile are shared, the pack re-checked). Returns ``Commit``: OK,
    EXISTS or RETRY (a gc removed what it needed; nothing is indexed). Raises
    BlobError naming the failing record; OSError on a failed write."""
    got = framed(tier.chunk, ident, key, rec, chunks, tail)
    if got.pieces:
        checked(got.pieces, got.heads, ident, got.plan)
    have = set(rec.chunks) - {ck for ck, *_ in chunks}
    now = time.time()
    writer = segments.PackWriter(tier.blob_root, modes=tier.modes)
    try:
        segs = []
        for p, d in zip(got.pieces, got.data):
            with blame(*p.record):
                segs.append(writer.add_framed(d, p.segment.checksum))
        if writer.size:
            writer.seal()
        new = {ck: (replace(crec, refs=1, segment=seg), toks)
               for (ck, crec, toks, _), seg in zip(chunks, segs)}
        local = replace(rec, tail=segs[-1] if rec.tail is not None else None, created=now,
                        last_used=now, hits=0, pinned=False, whole=None)  # a copy names a file of the sender's
        status = tier.index.transact(lambda t: commit(t, key, tokens, local, writer, new, have))
    except BaseException:
        writer.discard()
        raise
    writer.close()
    if status is not Commit.OK:
        writer.discard()
    return status


def export_entry(tier: Tier, key: bytes) -> tuple[EntryRecord, bytes, list[tuple[bytes, ChunkRecord, bytes]]] | None:
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
        return tier.index.view(run)
    except RecordError:
        return None


def segment_bytes(tier: Tier, seg: Segment) -> bytes:
    """A segment's bytes as its pack file holds them, verified against its checksum
    (kvstore's own files only); BlobError otherwise."""
    fd = files.open_own(files.pack_path(tier.blob_root, seg.pack))
    try:
        data = os.pread(fd, seg.length, seg.offset)
    finally:
        os.close(fd)
    if len(data) != seg.length or xxhash.xxh3_128_digest(data) != seg.checksum:
        raise files.BlobError(f"pack {seg.pack.hex()[:12]}: segment is short or does not match its checksum")
    return data
