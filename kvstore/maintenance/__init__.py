"""Offline care of a cache directory: ``fsck`` (verify, repairs, index rebuild) and ``gc``.

Everything here works while servers use the directory, through the index's public API:
records are dropped in one write transaction and their files unlinked only after it
commits, so a concurrent reader sees an entry either whole or not at all (a reader already
holding a record finds a missing file, which is a miss, never an error).
"""

from .fsck import (BLOB_KINDS, KINDS, NOT_OURS, ORPHAN_BLOB_SECONDS, Problem, SegmentCheck, chunk_mismatch,
                   entry_mismatch, rebuild_index, remove_orphan, verify)
from .gc import GcResult, gc

__all__ = ["BLOB_KINDS", "KINDS", "NOT_OURS", "ORPHAN_BLOB_SECONDS", "GcResult", "Problem", "SegmentCheck", "chunk_mismatch",
           "entry_mismatch", "gc", "rebuild_index", "remove_orphan", "verify"]
