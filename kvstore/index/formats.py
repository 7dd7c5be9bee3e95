"""A store of another format: found before anything is written into it, set aside whole,
reclaimed by one command.

Every key, identity and segment of a format derives from its number (``keys.FORMAT_VERSION``
is in the key root and in every identity digest), so a store of format 2 or 3 holds no
entry today's kvstore could ever serve: converting it would rewrite every record to reach
entries nobody asks for. So a writable open of one moves it aside whole, its index and its
pack files together (``format-<N>-<time>-<random>/index`` and ``/blobs``: a cache
directory that the kvstore which wrote it can still use as its ``--cache-dir``), says so
with its size, and a new store starts in its place: persistence goes on. ``kvstore gc
--old-formats`` removes what was set aside. A read-only open refuses it, changing nothing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import struct
import time
from pathlib import Path

from .. import files
from .meta import Damaged

ASIDE = "format-"  # format-<N>-<time>-<random hex>/ under the cache directory


def stored_format(data: Path) -> int | None:
    """The format number the index data file ``data`` records (its ``meta`` database's
    ``format``), read page by page without LMDB (nothing is opened for writing, not even
    LMDB's lock file); None if there is none, or it cannot be read (LMDB's open says why)."""
    from .pages import lookup

    try:
        if data.stat().st_size == 0:
            return None
        got = lookup(data, "meta", b"format")
        return int(got) if got is not None else None
    except (OSError, Damaged, struct.error, ValueError):
        return None


def set_aside(root: Path, found: int, reads: int, modes: files.Modes) -> tuple[Path, int] | None:
    """Move the store of format ``found`` under cache directory ``root`` (``index/`` and
    ``blobs/``) to a new ``format-<found>-...`` directory beside them, one opener at a time
    (a lock on ``root``); returns (where, its bytes), or None if another opener moved it
    first. Nothing inside the store is opened for writing or changed. The new store's
    directories (``modes``) are made at once, under the lock."""
    fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no locks here (some network file systems): a racing opener may fail its start, never mix stores
        if stored_format(root / "index" / "data.mdb") != found or found == reads:
            return None  # moved (or replaced) by another opener meanwhile
        aside = root / f"{ASIDE}{found}-{int(time.time())}-{os.urandom(4).hex()}"
        os.mkdir(aside, 0o700)
        if os.path.lexists(root / "blobs"):
            os.rename(root / "blobs", aside / "blobs")  # the pack files first: the index names them
        os.rename(root / "index", aside / "index")
        for d in (root / "index", root / "blobs"):
            files.make_dir(d, modes)
        return aside, tree_bytes(aside)
    finally:
        os.close(fd)


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (never following a symlink)."""
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


def set_aside_stores(root: Path) -> list[tuple[Path, int]]:
    """Every store set aside under cache directory ``root`` (a real directory named
    ``format-<N>-...``), with its bytes, oldest first."""
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith(ASIDE))
    except OSError:
        return []
    out = []
    for n in names:
        p = root / n
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode):
                out.append((p, tree_bytes(p)))
        except OSError:
            continue
    return out


def reclaim(root: Path, *, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove every store set aside under ``root`` (``set_aside_stores``); returns what was
    (or, ``dry_run``, would be) removed. ``shutil.rmtree`` removes a symlink inside, never
    what it points to."""
    gone = set_aside_stores(root)
    if not dry_run:
        for p, _ in gone:
            shutil.rmtree(p)
    return gone


__all__ = ["ASIDE", "reclaim", "set_aside", "set_aside_stores", "stored_format", "tree_bytes"]
