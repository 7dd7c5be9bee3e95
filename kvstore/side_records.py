"""Small JSON records ``kvstore serve`` keeps beside the index (``--stable-prefix``'s, in
``<cache dir>/stable-prefix/``): bounded by count and bytes, evicted oldest first, and
counted in the disk budget that ``--max-disk-bytes`` and ``kvstore gc --max-bytes`` keep.

Guarantees:
- A record directory holds ``<32 hex>.json`` files made through ``files`` (the cache
  directory's modes, replaced whole); nothing else there is read, counted or removed, and
  nothing is followed through a symlink (``files.open_regular``, ``lstat``).
- Order is a sequence number kvstore writes into each record (``"seq"``: one more than
  the highest it has seen), not the file's mtime: a copy, ``touch`` or backup restore does
  not make an old record new. A record read back in this process counts as used (its
  sequence is raised in memory). Eviction removes the lowest sequence first (a record
  without a readable one first), ties by name, until both bounds hold.
- ``usage`` is what ``kvstore ls`` / ``stats`` show and what the disk budget counts: the
  records' file bytes are taken off what pack files may use (``budget_for``), and the
  records themselves never take more than ``SHARE`` of a disk budget (``bound``).

One idea in one place: a future record kind (stored responses could move here) adds its
directory name to ``DIRECTORIES``.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import files

DIRECTORIES = ("stable-prefix",)  # record directories of a cache directory that these rules cover
SHARE = 4  # records take at most 1/SHARE of a disk budget
_NAME = re.compile(r"[0-9a-f]{32}\.json")


@dataclass(frozen=True)
class Usage:
    """A record directory's files: how many, how many bytes."""

    count: int = 0
    bytes: int = 0


def bound(max_bytes: int, disk_budget: int | None) -> int:
    """The records' byte bound under a disk budget: ``max_bytes``, and at most
    ``disk_budget // SHARE``."""
    return max_bytes if disk_budget is None else min(max_bytes, disk_budget // SHARE)


def _listing(directory: Path) -> list[tuple[str, int]]:
    """(name, size) of the record files in ``directory`` (none if it is not a real directory)."""
    if not files.real_dir(directory):
        return []
    try:
        return [(name, st.st_size) for name, st in files.named_files(directory, _NAME)]
    except OSError:
        return []


def usage(root: Path) -> dict[str, Usage]:
    """Each record directory of cache directory ``root``: its files' count and bytes."""
    out = {}
    for name in DIRECTORIES:
        found = _listing(root / name)
        out[name] = Usage(len(found), sum(size for _, size in found))
    return out


def total_bytes(root: Path) -> int:
    """The bytes of every record directory of ``root``."""
    return sum(u.bytes for u in usage(root).values())


def budget_for(root: Path, disk_budget: int) -> int:
    """What pack files may use of ``disk_budget`` once the records' bytes are counted."""
    return max(0, disk_budget - total_bytes(root))


def _read(path: Path, limit: int) -> dict[str, Any] | None:
    try:
        fd = files.open_regular(path)
    except (files.BlobError, OSError):
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(limit + 1)
        rec = json.loads(data) if len(data) <= limit else None
    except (OSError, ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def _seq(rec: dict[str, Any] | None) -> int:
    v = rec.get("seq") if rec is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 else -1


class RecordDir:
    """One record directory (``path`` None: this process's memory only), bounded by
    ``max_count`` records and ``max_bytes`` bytes; a record over ``max_record`` bytes is
    not written. Not locked: its user serializes calls (``stable_prefix.Memory.lock``)."""

    def __init__(self, path: Path | None, modes: files.Modes = files.PRIVATE, *, max_count: int,
                 max_bytes: int, max_record: int) -> None:
        self.path, self.modes = path, modes
        self.max_count, self.max_bytes, self.max_record = max_count, max_bytes, max_record
        self._seqs: dict[str, int] = {}  # name -> sequence, as read or written by this process
        self._next = 0
        self._learned = False
        self._memory: dict[str, bytes] = {}

    def _bump(self, name: str, seq: int = -1) -> int:
        self._next = max(self._next, seq + 1)
        self._seqs[name] = self._next
        self._next += 1
        return self._seqs[name]

    def read(self, name: str) -> dict[str, Any] | None:
        """The record ``name`` (a ``<32 hex>.json`` name), or None: none, unreadable, too
        large or not an object."""
        if not _NAME.fullmatch(name):
            return None
        if self.path is None:
            data = self._memory.get(name)
            try:
                rec = json.loads(data) if data is not None else None
            except (ValueError, RecursionError):
                rec = None
        else:
            rec = _read(self.path / name, self.max_record)
        if isinstance(rec, dict):
            self._bump(name, _seq(rec))
            return rec
        return None

    def write(self, name: str, rec: dict[str, Any]) -> None:
        """Keep ``rec`` as ``name`` with the next sequence number, then evict the oldest
        until both bounds hold. OSError / BlobError: not written; ValueError: over
        ``max_record``."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a record name: {name!r}")
        if not self._learned and self.path is not None:  # once: number after every record already there
            self._learned = True
            for other, _ in _listing(self.path):
                self._order(other)
        data = json.dumps({**rec, "seq": self._bump(name, self._seqs.get(name, -1))},
                          separators=(",", ":")).encode()  # ASCII: a lone surrogate is escaped, read back
        if len(data) > self.max_record:
            raise ValueError(f"{len(data)} bytes, more than the {self.max_record} one record may take")
        if self.path is None:
            self._memory[name] = data
            self._evict([(n, len(d)) for n, d in self._memory.items()])
            return
        files.make_dir(self.path, self.modes)
        files.replace_file(self.path / name, data, self.modes)
        self._evict(_listing(self.path))

    def _order(self, name: str) -> int:
        if name not in self._seqs and self.path is not None:
            self._seqs[name] = _seq(_read(self.path / name, self.max_record))
            self._next = max(self._next, self._seqs[name] + 1)
        return self._seqs.get(name, -1)

    def _evict(self, found: list[tuple[str, int]]) -> None:
        count, total = len(found), sum(size for _, size in found)
        if count <= self.max_count and total <= self.max_bytes:
            return
        for name, size in sorted(found, key=lambda ns: (self._order(ns[0]), ns[0])):
            if count <= self.max_count and total <= self.max_bytes:
                break
            if self._remove(name):
                count, total = count - 1, total - size

    def _remove(self, name: str) -> bool:
        self._seqs.pop(name, None)
        if self.path is None:
            return self._memory.pop(name, None) is not None
        return remove(self.path / name)


def remove(path: Path) -> bool:
    """Unlink the regular file ``path`` (never a symlink or a directory); True if it went."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def trim(root: Path, max_bytes: int, *, dry_run: bool = False) -> list[tuple[str, str, int]]:
    """Remove records of cache directory ``root``, lowest sequence first across its record
    directories, until their bytes fit ``max_bytes`` (``kvstore gc --max-bytes``); returns
    (directory, name, bytes) of each removed (``dry_run``: would remove)."""
    found = []
    for d in DIRECTORIES:
        for name, size in _listing(root / d):
            found.append((_seq(_read(root / d / name, 1 << 24)), d, name, size))
    total = sum(f[3] for f in found)
    out = []
    for _, d, name, size in sorted(found):
        if total <= max_bytes:
            break
        if dry_run or remove(root / d / name):
            out.append((d, name, size))
            total -= size
    return out
