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
before anything is allocated), ``restore``, ``persist``, ``whole`` (a long entry served
again, also kept as one file MLX's loader reads in one pass) and ``transfer`` (segments that
cross machines). ``DiskTier`` is the one door: its methods are the rooms' functions, each
taking the tier first and documented where it is written.
"""

from __future__ import annotations

from typing import Sequence

from ..identity import Identity
from ..keys import encode_tokens
from ..query import Query
from . import persist as _persist, plan as _plan, restore as _restore, transfer as _transfer, whole as _whole
from .persist import Commit, PersistJob
from .plan import Plan
from .restore import READ_THREADS, Restored
from .tier import Tier

__all__ = ["Commit", "DiskTier", "PersistJob", "Plan", "READ_THREADS", "Restored"]


class DiskTier(Tier):
    """Pack files + index of one cache directory (``Tier``: its state), and the jobs that
    read or write its segments: each method is its room's function (the tier first)."""

    # the lookup (``plan``)
    lookup = _plan.lookup              # the longest reusable stored prefix of a query, or None
    nearest = _plan.nearest            # a miss's nearest entry below a chunk others go on from
    held_chunks = _plan.held_chunks    # a query's chunks indexed here with its token ids
    # reading and writing segments
    restore = _restore.restore                 # a plan's segments, verified, built into live caches
    restore_framed = _restore.restore_framed   # an entry framed elsewhere, restored from memory
    persist = _persist.persist                 # a job's new segments in one pack, one commit
    write_whole = _whole.write                 # an entry just restored, kept also as one file (``whole``)
    # segments from elsewhere (a shared tier, export / import)
    import_entry = _transfer.import_entry
    export_entry = _transfer.export_entry
    segment_bytes = _transfer.segment_bytes

    def plan(self, ident: Identity, tokens: Sequence[int] | bytes, skip: frozenset[bytes] = frozenset()) -> Plan | None:
        """``lookup`` of ``tokens`` (token ids, or their encoding) for ``ident``: for callers
        that hold tokens rather than a query (tools, tests, the CLI)."""
        enc = tokens if isinstance(tokens, bytes) else encode_tokens(tokens)
        return self.lookup(Query(enc, ident.digest, self.chunk), skip)
