"""Every record of an index in one read transaction: what maintenance and the CLI read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lmdb

from ..keys import KEY_BYTES
from ..records import ChunkRecord, EntryRecord, IdentityRecord, PackRecord, RecordError, parse
from .core import Index
from .txn import Reader


@dataclass
class IndexRecords:
    """Every record of the index at one moment. ``None`` stands for a record kvstore did
    not write (unreadable); ``meta_bytes`` is -1 when the byte counter is unreadable."""

    entries: dict[bytes, EntryRecord | None]
    chunks: dict[bytes, ChunkRecord | None]
    packs: dict[bytes, PackRecord | None]
    tokens: dict[bytes, bytes]              # key -> its token ids (int64 LE)
    bounds: list[tuple[bytes, bytes, bytes, bytes]]  # (boundary, child, kind value, edge key)
    identities: dict[str, IdentityRecord]
    meta_bytes: int

    def pack_use(self) -> dict[bytes, tuple[int, int]]:
        """pack -> (segments the readable records use, their bytes): what each pack record
        should count, and what keeps each pack file alive."""
        use: dict[bytes, list[int]] = {}
        segs = [s for r in self.entries.values() if r for s in r.segments]
        segs += [r.segment for r in self.chunks.values() if r]
        for s in segs:
            u = use.setdefault(s.pack, [0, 0])
            u[0] += 1
            u[1] += s.length
        return {k: (v[0], v[1]) for k, v in use.items()}


def _parsed(db: str, v: bytes) -> Any:
    try:
        return parse(db, v)
    except RecordError:
        return None


def _items(r: Reader, name: str) -> list[tuple[bytes, bytes]]:
    """A database's records, checking LMDB's order on the way: a B-tree whose keys are out
    of order (damaged pages) hides records from lookups though a scan shows them."""
    out: list[tuple[bytes, bytes]] = []
    for k, v in r.txn.cursor(db=r.db[name]):
        k = bytes(k)
        if out and k <= out[-1][0]:
            raise lmdb.CorruptedError(f"keys out of order in the {name} database")
        out.append((k, bytes(v)))
    look = r.txn.cursor(db=r.db[name])  # a damaged branch page misroutes lookups only
    for k, _ in out:
        if not look.set_key(k):
            raise lmdb.CorruptedError(f"a key of the {name} database is not found by lookup")
    return out


def scan(index: Index, *, full: bool = True, check: bool = False) -> IndexRecords:
    """All records in one read transaction; ``full=False`` skips token ids and trie edges
    (what budgets and listings need). ``check``: walk the pages first
    (``pages.check_pages``), so a damaged index is a CorruptedError rather than an abort
    inside LMDB."""
    psize = index.env.stat()["psize"]

    def run(r: Reader) -> IndexRecords:
        if check:
            from .pages import check_pages  # the page walker: verify only, not every listing

            check_pages(index.path / "data.mdb", psize, r.txn)
        tokens: dict[bytes, bytes] = {}
        bounds: list[tuple[bytes, bytes, bytes, bytes]] = []
        if full:
            tokens = dict(_items(r, "tokens"))
            bounds = [(k[:KEY_BYTES], k[-KEY_BYTES:], v, k) for k, v in _items(r, "bounds")]
        idents: dict[str, IdentityRecord] = {}
        for k, v in r.txn.cursor(db=r.db["identities"]):
            idents[bytes(k).hex()] = _parsed("identities", bytes(v)) or IdentityRecord({})
        mb = r.meta(b"bytes")
        try:
            meta_bytes = int(mb) if mb else 0
        except ValueError:
            meta_bytes = -1
        return IndexRecords({k: _parsed("entries", v) for k, v in _items(r, "entries")},
                        {k: _parsed("chunks", v) for k, v in _items(r, "chunks")},
                        {k: _parsed("packs", v) for k, v in _items(r, "packs")},
                        tokens, bounds, idents, meta_bytes)

    for _ in range(20):
        try:
            return index.view(run)
        except LookupError:  # a commit reused our snapshot's meta page: take a new snapshot
            continue
    check = False  # writers never pause: check nothing rather than loop forever
    return index.view(run)
