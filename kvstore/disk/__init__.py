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

The package has a room per job: ``tier`` (the directory's state: open, close, remove,
touch), ``plan`` (the lookup), ``pieces`` (what a restore or an import reads, and the checks
before anything is allocated), ``restore``, ``persist`` and ``transfer`` (segments that
cross machines). ``DiskTier`` is the one door: each method hands its job to its room.
``_plan`` and ``_commit`` are looked up here when called (tests count plans and fail
commits through them).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..identity import Identity
from ..misses import Near
from ..query import Query
from ..keys import encode_tokens
from ..records import ChunkRecord, EntryRecord, Segment
from . import restore as _restore, transfer as _transfer
from .persist import Commit, PersistJob, commit as _commit, persist as _persist
from .plan import Plan, entry_below as _entry_below, find as _plan, held as _held
from .restore import READ_THREADS, Restored
from .tier import Tier

__all__ = ["Commit", "DiskTier", "PersistJob", "Plan", "READ_THREADS", "Restored"]


class DiskTier(Tier):
    """Pack files + index of one cache directory (``Tier``: its state), and the jobs that
    read or write its segments, each handed to its room."""

    # -- lookup ------------------------------------------------------------------------

    def lookup(self, q: Query, skip: frozenset[bytes] = frozenset(), near: Near | None = None) -> Plan | None:
        """The longest reusable stored prefix of the query ``q`` (its identity and chain
        under this directory's chunk size), or None.

        One read transaction. First the chain of stored full chunks matching the query is
        followed as far as it goes; then the boundaries from the deepest down to the end of
        that chain are searched for entries (and, at the chain's end, a chunk to trim),
        stopping as soon as nothing shallower can be longer. Each boundary costs a few
        seeks however many children it has (``trie.edges``). Records kvstore did not write
        are passed over, and so are the entries in ``skip`` (a cut a restore refused). The
        query's chain is the one every tier reads (hashed once); the plan returns the part
        of it found stored and verified (``Plan.chain``: no second walk). ``near`` is told
        the stored entries the walk compared (``misses.Near``: why a query was not served
        further). Raises ValueError for a query chained under another chunk size."""
        if q.chunk != self.chunk:
            raise ValueError(f"a query chained every {q.chunk} tokens, this directory every {self.chunk}")
        return self.index.view(lambda r: _plan(r, q, skip, near))

    def nearest(self, q: Query, near: Near) -> bool:
        """Name the stored entry ``near``'s nearest prefix is, when the walk left it at a
        chunk others go on from (``plan.entry_below``: a miss's cost is the entry's own
        length, not the query's). One read transaction; True when one was found."""
        return self.index.view(lambda r: _entry_below(r, q, near))

    def plan(self, ident: Identity, tokens: Sequence[int] | bytes, skip: frozenset[bytes] = frozenset(),
             near: Near | None = None) -> Plan | None:
        """``lookup`` of ``tokens`` (token ids, or their encoding) for ``ident``: for callers
        that hold tokens rather than a query (tools, tests, the CLI)."""
        enc = tokens if isinstance(tokens, bytes) else encode_tokens(tokens)
        return self.lookup(Query(enc, ident.digest, self.chunk), skip, near)

    # -- restore -----------------------------------------------------------------------

    def restore(self, plan: Plan, ident: Identity) -> Restored:
        """Read a plan's segments (verified) and build live caches holding ``plan.n`` tokens.

        The stored layout must fit ``ident``'s model (``fit.layout_problem``), checked
        on the segments' headers before anything is allocated. Raises BlobError (naming the record in ``err.record``) when a record's
        bytes are bad, anything else (OSError, MemoryError, RuntimeError) as it is; then
        nothing is returned and the arrays being filled are dropped.
        Raises ``CutRefused`` (before allocating) when the plan cuts a snapshot at a point
        its layout refuses (``Layout.can_cut``): the entry is valid, the query a miss."""
        return _restore.restore(self, plan, ident)

    def restore_framed(self, ident: Identity, key: bytes, rec: EntryRecord, n: int,
                       chunks: list[tuple[bytes, ChunkRecord, bytes, Any]], tail: Any) -> Restored:
        """``n`` tokens of the entry ``import_entry`` would file (every chunk of ``rec``
        given: nothing is read from here), restored straight from the segment bytes in
        memory (a shared hit, before it is written here): each segment checked as
        ``restore`` checks it before anything is allocated, then copied into the final
        arrays. The checksums are the caller's (the shared tier verified them as the
        bytes arrived; ``import_entry`` verifies them again as it writes)."""
        return _restore.restore_framed(self, ident, key, rec, n, chunks, tail)

    # -- persist -----------------------------------------------------------------------

    def persist(self, job: PersistJob) -> int:
        """Write a job's new segments into one pack file and commit its entry in one
        transaction; returns the pack bytes written (0 if the entry already existed).
        Chunks already indexed are reused, not written. Raises OSError on a failed write
        (nothing is indexed then, and the pack file is removed)."""
        return _persist(self, job, _commit)

    # -- segments from elsewhere (a shared tier) ------------------------------------------

    def held_chunks(self, bounds: list[bytes], tokens: bytes) -> set[bytes]:
        """The chunk keys of ``bounds[1:]`` (a query's chain) indexed here with exactly
        the query's token ids (one read transaction; unreadable records are not held)."""
        return self.index.view(lambda r: _held(r, bounds, tokens, self.chunk))

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
        checksums verified as it is written, synced, and one transaction (``persist.commit``:
        chunks indexed meanwhile are shared, the pack re-checked). Returns ``Commit``: OK,
        EXISTS or RETRY (a gc removed what it needed; nothing is indexed). Raises
        BlobError naming the failing record; OSError on a failed write."""
        return _transfer.import_entry(self, ident, key, rec, tokens, chunks, tail)

    def export_entry(self, key: bytes) -> tuple[EntryRecord, bytes, list[tuple[bytes, ChunkRecord, bytes]]] | None:
        """Entry ``key``'s record and token ids, and (key, record, token ids) of each of
        its chunks, from one read transaction; None if any is missing or unreadable."""
        return _transfer.export_entry(self, key)

    def segment_bytes(self, seg: Segment) -> bytes:
        """A segment's bytes as its pack file holds them, verified against its checksum
        (kvstore's own files only); BlobError otherwise."""
        return _transfer.segment_bytes(self, seg)
