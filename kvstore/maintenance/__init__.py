"""Offline care of a cache directory: budgets, gc and verify (fsck).

Modules: ``records`` (problem kinds, blob checks, index snapshots and the rules a record
must meet), ``pages`` (a walker over LMDB's B-trees for a damaged index), ``fsck``
(verify, its repairs, index rebuild), ``budgets`` (LRU eviction to a byte budget, gc).

Every function works while servers use the directory: records are dropped in one LMDB
transaction and their blobs unlinked only after it commits, so a concurrent reader sees an
entry either whole or not at all (a reader already holding a record finds a missing blob,
which is a miss, never an error).
"""

from .budgets import BATCH, GcResult, evict_to, gc, lru_order
from .records import (BLOB_KINDS, KINDS, ORPHAN_BLOB_SECONDS, STALE_TMP_SECONDS, Problem, Snapshot,
                      blob_header, check_blob, entry_bytes, kv_dtype, snapshot)
from .fsck import rebuild_index, verify

__all__ = ["BATCH", "BLOB_KINDS", "KINDS", "ORPHAN_BLOB_SECONDS", "STALE_TMP_SECONDS", "GcResult",
           "Problem", "Snapshot", "blob_header", "check_blob", "entry_bytes", "evict_to", "gc",
           "kv_dtype", "lru_order", "rebuild_index", "snapshot", "verify"]
