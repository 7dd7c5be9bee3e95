"""LMDB's meta pages, read with pread: what every open of the index needs of the data file
before LMDB maps it (its newest transaction id; whether its trees' roots are inside it).

Kept apart from ``pages`` (the page walker, for a damaged or crash-stopped file) so an
open, and ``kvstore ls``, imports only this. On-disk format: LMDB 0.9 (``mdb.c``), 64-bit.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import NamedTuple

P_INVALID = (1 << 64) - 1  # LMDB's "no page": an empty tree's root


class Damaged(Exception):
    """A page (or meta page) is not what LMDB writes."""


class Meta(NamedTuple):
    """The newest (or asked-for) meta page of a data file, and the file's size when read."""

    txnid: int
    last_pg: int
    free: tuple  # the free-page list's MDB_db (flags, depth at [2], ..., root at [7])
    main: tuple  # the main tree's MDB_db
    size: int


def read_meta(fd: int, psize: int, txnid: int | None) -> Meta:
    """The meta page of transaction ``txnid`` (the newest if None) of the data file open
    on ``fd``; Damaged if neither meta page is valid, LookupError if ``txnid``'s was
    overwritten meanwhile. The meta page is read before the size, so a commit in between
    only makes the file longer than the meta page needs."""
    metas = []
    for m in (0, 1):
        b = os.pread(fd, 160, m * psize)
        if len(b) < 152 or int.from_bytes(b[16:20], "little") != 0xBEEFC0DE:
            continue
        metas.append((int.from_bytes(b[144:152], "little"), b))
    if not metas:
        raise Damaged("no valid meta page")
    pick = [mb for mb in metas if mb[0] == txnid] if txnid is not None else sorted(metas)[-1:]
    if not pick:
        raise LookupError("the read transaction's meta page was overwritten meanwhile")
    txn, b = pick[0]
    return Meta(txn, int.from_bytes(b[136:144], "little"), struct.unpack_from("<IHHQQQQQ", b, 40),
                struct.unpack_from("<IHHQQQQQ", b, 40 + 48), os.fstat(fd).st_size)


def _newest(data: Path) -> tuple[Meta, int]:
    """(newest meta page, page size) of ``data``; OSError, Damaged or struct.error."""
    psize = page_size(data)
    fd = os.open(data, os.O_RDONLY)
    try:
        return read_meta(fd, psize, None), psize
    finally:
        os.close(fd)


def page_size(data: Path) -> int:
    """The page size the file records in its first meta page (FREE_DBI's md_pad), so a
    file made on a 16 KiB-page Mac reads right anywhere; the system's if implausible."""
    with open(data, "rb") as f:
        head = f.read(48)
    psize = int.from_bytes(head[40:44], "little") if len(head) >= 44 else 0
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        psize = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    return psize


def unwritten_roots(data: Path) -> str | None:
    """Why the newest meta page of ``data`` names a tree root past the end of the file
    (a truncated file: reading that page through a map is a SIGBUS), or None.

    Only what LMDB keeps is checked: a commit writes every page its trees reach before
    the meta page naming them, so each root lies inside the file. ``last_pgno`` is no
    bound: pages allocated and freed inside one transaction (a gc removing most entries)
    count in it but are never written, and a healthy file ends before it."""
    try:
        meta, psize = _newest(data)
    except (OSError, Damaged, struct.error):
        return None  # no meta page to go by: LMDB's own open says what is wrong
    for name, db in (("free-page list", meta.free), ("main", meta.main)):
        root = db[7]
        if root != P_INVALID and (root + 1) * psize > meta.size:
            return (f"{data} is truncated: {meta.size} bytes, the root page {root} of its {name} "
                    f"needs {(root + 1) * psize}")
    return None


def last_txnid(data: Path) -> int | None:
    """The newest transaction id the data file's meta pages record (two preads), or None."""
    try:
        return _newest(data)[0].txnid
    except (OSError, Damaged, struct.error):
        return None
