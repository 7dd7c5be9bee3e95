"""kvstore.cachedir: opening a private cache directory costs the same whatever it holds."""

from __future__ import annotations

import os
from pathlib import Path


def _stats_during_open(root: Path) -> int:
    """How many stat-like calls (lstat, stat, access) opening ``root`` writable makes."""
    import kvstore.cachedir as cachedir

    calls = 0
    real = {n: getattr(os, n) for n in ("lstat", "stat", "access")}

    def counting(name):
        def call(*a, **k):
            nonlocal calls
            calls += 1
            return real[name](*a, **k)
        return call

    try:
        for n in real:
            setattr(os, n, counting(n))
        disk = cachedir.open_disk(root)
    finally:
        for n, f in real.items():
            setattr(os, n, f)
    disk.close()
    return calls


def test_private_open_cost_does_not_grow_with_fanout_dirs(tmp_path: Path) -> None:
    """Opening a private cache directory looks at a fixed set of files whatever ``blobs/``
    holds: 1 or 256 fan-out directories, the same number of stat calls (a cold start paid
    one inode read per fan-out directory, tens of ms after a page-cache drop). Before:
    every fan-out directory was checked at every open."""
    from kvstore.cachedir import open_disk

    counts = {}
    for n in (1, 256):
        root = tmp_path / f"c{n}"
        open_disk(root).close()
        for i in range(n):
            (root / "blobs" / f"{i:02x}").mkdir(mode=0o700)
        counts[n] = _stats_during_open(root)
    assert counts[1] == counts[256], counts
