"""A read-only walker over LMDB's on-disk B-trees, for an index LMDB itself would crash on.

LMDB checks little of what it reads: a damaged page that a cursor steps onto is an
assertion failure, i.e. abort() of the whole process, not an error Python can catch.
``verify`` walks every record, so before it lets LMDB do that it walks the B-trees itself,
page by page, from the meta page of its own read transaction (pages a live reader's
snapshot uses are never rewritten while it is open), and reports any page that is not
what its parent says as ``corrupt_index``. ``rebuild_index`` uses the same walk to salvage
records from the pages that are intact. On-disk format: LMDB 0.9 (``mdb.c``), 64-bit.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable

import lmdb

from .meta import P_INVALID as _P_INVALID, Damaged as _Damaged, page_size, read_meta

_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_HDR, _NODE = 16, 8


class _Pages:
    """The pages of one snapshot of an LMDB data file, read with pread (no mmap)."""

    def __init__(self, path: Path, psize: int, txnid: int | None) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        try:
            m = read_meta(self.fd, psize, txnid)
        except BaseException:
            os.close(self.fd)
            raise
        self.psize, self.size, self.txnid, self.last_pg, self.free, self.main = (
            psize, m.size, m.txnid, m.last_pg, m.free, m.main)

    def close(self) -> None:
        os.close(self.fd)

    def page(self, pgno: int, n: int = 1) -> bytes:
        if pgno < 2 or pgno + n - 1 > self.last_pg or (pgno + n) * self.psize > self.size:
            raise _Damaged(f"page {pgno} is outside the file")
        b = os.pread(self.fd, n * self.psize, pgno * self.psize)
        if int.from_bytes(b[:8], "little") != pgno:
            raise _Damaged(f"page {pgno} says it is page {int.from_bytes(b[:8], 'little')}")
        return b

    def walk(self, db: tuple, sink: Callable[[bytes, bytes, int], None] | None, errors: list[str],
             name: str, *, intkeys: bool = False) -> None:
        """Every leaf record of the tree ``db`` (an MDB_db tuple), in key order, checking
        page numbers, flags, bounds, depth and key order; ``sink(key, value, node_flags)``.
        A damaged subtree is recorded in ``errors`` and skipped. ``intkeys``: keys are
        native integers (the free-page list), ordered as numbers."""
        order: Callable[[bytes], Any] = (lambda k: int.from_bytes(k, "little")) if intkeys else (lambda k: k)
        depth, root = db[2], db[7]
        if root != _P_INVALID:
            _Walk(self, depth, sink, errors, name, order).visit(root, 1, None, None)

    def node_count(self, pgno: int, b: bytes, want: int) -> tuple[int, int]:
        """(number of nodes, ``upper``) of page ``pgno`` (bytes ``b``), which must be a leaf
        or a branch (``want``); _Damaged if its header is not one (nothing on it is usable)."""
        flags, lower, upper = struct.unpack_from("<HHH", b, 10)
        if flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW) != want:
            raise _Damaged(f"page {pgno} has flags {flags:#x}, its parent expects "
                           f"a {'leaf' if want == _P_LEAF else 'branch'}")
        if not (_HDR <= lower <= upper <= self.psize) or (lower - _HDR) % 2:
            raise _Damaged(f"page {pgno} has bad bounds {lower}/{upper}")
        n = (lower - _HDR) // 2
        if n == 0 and want == _P_BRANCH:
            raise _Damaged(f"branch page {pgno} holds no nodes")
        return n, upper

    def node(self, pgno: int, b: bytes, i: int, upper: int) -> tuple[int, int, int, bytes, int]:
        """Node ``i`` of page ``pgno``: (offset, data size or child low bits, flags, key,
        key end); _Damaged if it does not fit in the page (that node only)."""
        off = int.from_bytes(b[_HDR + 2 * i : _HDR + 2 * i + 2], "little")
        if not upper <= off <= self.psize - _NODE:
            raise _Damaged(f"page {pgno} node {i} is out of bounds")
        mlo, mhi, mflags, ksize = struct.unpack_from("<HHHH", b, off)
        kend = off + _NODE + ksize
        if kend > self.psize:
            raise _Damaged(f"page {pgno} node {i} key runs past the page")
        return off, mlo | (mhi << 16), mflags, bytes(b[off + _NODE : kend]), kend

    def value(self, pgno: int, b: bytes, i: int, dsize: int, mflags: int, kend: int) -> bytes:
        """The value of leaf node ``i`` of page ``pgno``: inline or on overflow pages."""
        if mflags & _F_DUPDATA:
            raise _Damaged(f"page {pgno} has a duplicate-sorted node (kvstore has none)")
        if not mflags & _F_BIGDATA:
            if kend + dsize > self.psize:
                raise _Damaged(f"page {pgno} node {i} value runs past the page")
            return bytes(b[kend : kend + dsize])
        if kend + 8 > self.psize:
            raise _Damaged(f"page {pgno} node {i} overflow pointer runs past the page")
        ov = int.from_bytes(b[kend : kend + 8], "little")
        head = self.page(ov)
        oflags, count = struct.unpack_from("<H", head, 10)[0], int.from_bytes(head[12:16], "little")
        if not oflags & _P_OVERFLOW or count < 1 or dsize > count * self.psize - _HDR:
            raise _Damaged(f"overflow page {ov} does not hold {dsize} bytes")
        return self.page(ov, count)[_HDR : _HDR + dsize]


class _Walk:
    """One walk of one tree: pages seen, the last key, where damage goes."""

    def __init__(self, pages: _Pages, depth: int, sink: Callable[[bytes, bytes, int], None] | None,
                 errors: list[str], name: str, order: Callable[[bytes], Any]) -> None:
        self.pages, self.depth, self.sink, self.errors, self.name = pages, depth, sink, errors, name
        self.order = order  # keys compare as bytes, or as native integers (free-page list)
        self.seen: set[int] = set()
        self.last: Any = None

    def visit(self, pgno: int, level: int, lo: Any, hi: Any) -> None:
        try:
            if pgno in self.seen:
                raise _Damaged(f"page {pgno} is reachable twice")
            self.seen.add(pgno)
            b = self.pages.page(pgno)
            if level < self.depth:
                self.branch(pgno, b, level, lo, hi)
            else:
                self.leaf(pgno, b, lo, hi)
        except _Damaged as e:
            self.errors.append(f"{self.name}: {e}")

    def branch(self, pgno: int, b: bytes, level: int, lo: Any, hi: Any) -> None:
        """Visit every child whose node is readable. Each node is its own unit: a damaged
        node (or separator out of order) is recorded and the other children are still
        visited, so a salvage keeps every record under them."""
        n, upper = self.pages.node_count(pgno, b, _P_BRANCH)
        nodes: list[tuple[int, int, int, bytes, int] | None] = []
        for i in range(n):
            try:
                nodes.append(self.pages.node(pgno, b, i, upper))
            except _Damaged as e:
                self.errors.append(f"{self.name}: {e}")
                nodes.append(None)
        # separator i (node 0's key is implicit) bounds child i: [key_i, key_i+1)
        keys = [self.order(nd[3]) if nd is not None else None for nd in nodes]
        for i in range(1, len(nodes)):
            k = keys[i]
            if k is None:
                continue
            prev = keys[i - 1] if i > 1 else None
            if (prev is not None and k <= prev) or (lo is not None and k < lo) or (hi is not None and k >= hi):
                self.errors.append(f"{self.name}: page {pgno} branch keys are out of order")
                keys[i] = None  # bounds nothing: its child is still walked
        for i, nd in enumerate(nodes):
            if nd is None:
                continue
            _, lohi, mflags, _key, _ = nd
            self.visit(lohi | (mflags << 32), level + 1, lo if i == 0 else keys[i], _next_key(keys, i + 1, hi))

    def leaf(self, pgno: int, b: bytes, lo: Any, hi: Any) -> None:
        """Every readable record of the page to ``sink``. Each node is its own unit: one
        that does not decode (out of the page, a bad overflow value) or is out of order is
        recorded as damage, and the others are still read (a salvage keeps each record
        still readable; an out-of-order key is kept too: what is kept is checked again)."""
        n, upper = self.pages.node_count(pgno, b, _P_LEAF)
        for i in range(n):
            try:
                _off, dsize, mflags, key, kend = self.pages.node(pgno, b, i, upper)
                k = self.order(key)
                if (lo is not None and k < lo) or (hi is not None and k >= hi) or (
                        self.last is not None and k <= self.last):
                    self.errors.append(f"{self.name}: page {pgno} leaf keys are out of order")
                self.last = k
                value = self.pages.value(pgno, b, i, dsize, mflags, kend)
            except _Damaged as e:
                self.errors.append(f"{self.name}: {e}")
                continue
            if self.sink is not None:
                self.sink(key, value, mflags)


def _next_key(keys: list[Any], i: int, hi: Any) -> Any:
    """The upper bound of child ``i - 1``: the next usable separator, else ``hi``."""
    for k in keys[i:]:
        if k is not None:
            return k
    return hi


def walk_all(path: Path, psize: int, txnid: int | None, *, collect: bool
              ) -> tuple[list[str], dict[str, list[tuple[bytes, bytes]]]]:
    """Walk LMDB's free-page list, the main tree and every named database in it. Returns
    (damage found, records by database name when ``collect``). The free-page list holds
    no record, but the next write reads it: a damaged page there fails every write."""
    pages = _Pages(path, psize, txnid)
    errors: list[str] = []
    out: dict[str, list[tuple[bytes, bytes]]] = {}
    try:
        subs: list[tuple[str, tuple]] = []

        def main_sink(key: bytes, value: bytes, flags: int) -> None:
            if flags & _F_SUBDATA and len(value) == 48:
                subs.append((key.decode(errors="replace"), struct.unpack("<IHHQQQQQ", value)))

        pages.walk(pages.free, None, errors, "free-page list", intkeys=True)
        pages.walk(pages.main, main_sink, errors, "main")
        for name, db in subs:
            got: list[tuple[bytes, bytes]] = []
            pages.walk(db, _appender(got) if collect else None, errors, name)
            out[name] = got
    finally:
        pages.close()
    return errors, out


def _appender(got: list[tuple[bytes, bytes]]) -> Callable[[bytes, bytes, int], None]:
    """A walk sink appending each ``(key, value)`` to ``got``."""
    return lambda k, v, flags: got.append((k, v))


def db_roots(data: Path) -> dict[str, int]:
    """Each named database's root page number (tests damage a database on purpose)."""
    pages = _Pages(data, page_size(data), None)
    subs: dict[str, int] = {}
    try:
        def sink(key: bytes, value: bytes, flags: int) -> None:
            if flags & _F_SUBDATA and len(value) == 48:
                subs[key.decode(errors="replace")] = struct.unpack("<IHHQQQQQ", value)[7]
        pages.walk(pages.main, sink, [], "main")
    finally:
        pages.close()
    return subs


def lookup(data: Path, db: str, key: bytes) -> bytes | None:
    """The value of ``key`` in named database ``db`` of ``data``'s newest snapshot, read
    page by page (no map, no lock file); None if absent. OSError, Damaged or struct.error
    if the pages on the way cannot be read."""
    pages = _Pages(data, page_size(data), None)
    try:
        sub: list[tuple] = []
        got: list[bytes] = []
        pages.walk(pages.main, lambda k, v, f: sub.append(struct.unpack("<IHHQQQQQ", v))
                   if k == db.encode() and f & _F_SUBDATA and len(v) == 48 else None, [], "main")
        if sub:
            pages.walk(sub[0], lambda k, v, f: got.append(v) if k == key else None, [], db)
    finally:
        pages.close()
    return got[0] if got else None


def crash_check(data: Path) -> str | None:
    """Why the newest snapshot of ``data`` could fault a process that maps it, or None;
    read with pread only, at a cost that does not grow with the records it holds.

    For a file a kvstore writer opened from a checked state and was then stopped without
    a clean close (killed, out of memory, power lost): every page it reached after that
    was written by LMDB's commit, which writes (and syncs) a transaction's pages before
    the meta page naming them. What such a stop can leave is a file shorter than its
    meta page says (a lost extension, a copy cut short): a page past the end read through
    a map is a SIGBUS. So: the meta page is valid; the free-page list, the main tree and
    each named database's root are pages of the right kind inside the file; and every
    page from the file's end to ``last_pgno`` is on the free-page list (pages allocated
    and freed inside one transaction are never written); a page past ``last_pgno`` is
    named only by a damaged page, which a crash does not make (``verify`` walks them all).
    The cost is the free-page list and one page per database."""
    try:
        psize = page_size(data)
        pages = _Pages(data, psize, None)
    except (OSError, _Damaged, struct.error) as e:
        return f"no readable meta page ({e})"
    try:
        errors: list[str] = []
        subs: list[tuple[str, tuple]] = []

        def main_sink(key: bytes, value: bytes, flags: int) -> None:
            if flags & _F_SUBDATA and len(value) == 48:
                subs.append((key.decode(errors="replace"), struct.unpack("<IHHQQQQQ", value)))

        pages.walk(pages.main, main_sink, errors, "main")
        for name, db in subs:
            _check_root(pages, db, errors, name)
        written = -(-pages.size // psize)  # pages the file holds (a partial last page counts)
        tail = set(range(written, pages.last_pg + 1))
        if tail:
            pages.walk(pages.free, _free_pages(tail), errors, "free-page list", intkeys=True)
            if tail:
                errors.append(f"{data} is truncated: {pages.size} bytes, page {min(tail)} is in use "
                              f"(the meta page names pages up to {pages.last_pg})")
        else:
            _check_root(pages, pages.free, errors, "free-page list")
        return "; ".join(errors[:3]) if errors else None
    except (OSError, struct.error) as e:
        return str(e)
    finally:
        pages.close()


def _check_root(pages: _Pages, db: tuple, errors: list[str], name: str) -> None:
    """The root page of tree ``db`` is inside the file and of the kind its depth says."""
    depth, root = db[2], db[7]
    if root == _P_INVALID:
        return
    try:
        pages.node_count(root, pages.page(root), _P_BRANCH if depth > 1 else _P_LEAF)
    except _Damaged as e:
        errors.append(f"{name}: {e}")


def _free_pages(tail: set[int]) -> Callable[[bytes, bytes, int], None]:
    """A walk sink over LMDB's free-page list (each value a count, then that many page
    numbers, native 64-bit) taking every listed page out of ``tail``."""
    def sink(key: bytes, value: bytes, flags: int) -> None:
        n = len(value) // 8
        if n:
            ids = struct.unpack(f"<{n}Q", value[: n * 8])
            tail.difference_update(ids[1: 1 + ids[0]])
    return sink


def salvage(data: Path) -> tuple[list[str], dict[str, list[tuple[bytes, bytes]]]]:
    """Every record still readable in a (damaged) LMDB data file, by database name, and
    the damage met."""
    try:
        return walk_all(data, page_size(data), None, collect=True)
    except (OSError, _Damaged, struct.error) as e:
        return [str(e)], {}


def check_pages(data: Path, psize: int, txn: Any) -> None:
    """Raise lmdb.CorruptedError if any page of ``txn``'s snapshot of the data file
    ``data`` is damaged, before a cursor steps on it (see above). LookupError if the
    snapshot's meta page was reused meanwhile."""
    errors, _ = walk_all(data, psize, txn.id(), collect=False)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise lmdb.CorruptedError(f"damaged pages: {errors[0]}{more}")
