"""Offline care of a cache directory: budgets, gc and verify (fsck).

Every function works while servers use the directory: records are dropped in one LMDB
transaction and their blobs unlinked only after it commits, so a concurrent reader sees an
entry either whole or not at all (a reader already holding a record finds a missing blob,
which is a miss, never an error).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from . import blobs
from .disk import DiskTier

STALE_TMP_SECONDS = 600  # a temp file older than this has no live writer


def lru_order(records: Iterable[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
    """Eviction order: unpinned before pinned, least recently used first."""
    return sorted(records, key=lambda kr: (bool(kr[1].get("pinned")), kr[1].get("last_used", 0)))


def evict_to(disk: DiskTier, max_bytes: int, *, dry_run: bool = False) -> list[tuple[bytes, dict]]:
    """Drop least recently used entries (pinned last) until the blobs fit ``max_bytes``.

    Sizes count shared chunks once; an entry's eviction frees only what no other entry
    still references, so this loops on the index total rather than predicting it.
    """
    if disk.index.total_bytes() <= max_bytes:
        return []
    gone: list[tuple[bytes, dict]] = []
    order = lru_order(disk.index.entries())
    if dry_run:
        return _simulate(disk, order, max_bytes)
    for key, rec in order:
        if disk.index.total_bytes() <= max_bytes:
            break
        disk.remove([key])
        gone.append((key, rec))
    return gone


def _simulate(disk: DiskTier, order: list[tuple[bytes, dict]], max_bytes: int) -> list[tuple[bytes, dict]]:
    total = disk.index.total_bytes()
    refs = {k: r["refs"] for k, r in disk.index.chunks()}
    sizes = {k: r["size"] for k, r in disk.index.chunks()}
    gone = []
    for key, rec in order:
        if total <= max_bytes:
            break
        freed = rec.get("size", 0)
        for ck in rec.get("chunks", []):
            ckb = bytes.fromhex(ck)
            if ckb in refs:
                refs[ckb] -= 1
                if refs[ckb] == 0:
                    freed += sizes[ckb]
        rec = dict(rec, _frees=freed)
        total -= freed
        gone.append((key, rec))
    return gone
