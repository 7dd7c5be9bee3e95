"""Reading and writing the index inside one LMDB transaction, in records.

``Reader`` is a consistent view for one lookup or one scan. ``WriteTxn`` is the one way to
change the index: typed record operations that keep the trie edges, chunk reference
counts, pack segment counts and the byte counter right together, and a list of files to
remove once the transaction has committed (``unlink_after_commit``): a file is unlinked
only after the commit that stopped naming it, so a reader sees an entry whole or not at all.

Databases (keys are 16-byte digests from ``keys``, values ``records`` types):
``entries`` entry key -> EntryRecord; ``chunks`` chunk key -> ChunkRecord; ``packs`` pack
id -> PackRecord; ``tokens`` entry or chunk key -> its exact token ids (int64 LE);
``bounds`` trie edge -> Kind; ``identities`` digest -> IdentityRecord; ``meta`` format,
chunk_tokens and ``bytes`` (the pack files' total size).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .. import files
from ..keys import KEY_BYTES, TOKEN_BYTES, boundaries, entry_key, root_key
from ..records import (ChunkRecord, EntryRecord, IdentityRecord, Kind, PackRecord, RecordError, Segment,
                       parse)

if TYPE_CHECKING:  # the trie's edges: a lookup or a write reads them (imported there), a scan never
    from . import trie

DBS = ("entries", "chunks", "packs", "tokens", "bounds", "identities", "meta")


def count(v: bytes | memoryview | None) -> int:
    """The byte counter; a damaged value counts as 0 (``verify`` reports the drift and
    ``--fix`` recomputes it) rather than failing every write that updates it."""
    try:
        return max(0, int(bytes(v))) if v else 0
    except ValueError:
        return 0


def own_chunks(key: bytes, rec: EntryRecord, tokens: bytes | None) -> tuple[bytes, ...]:
    """The chunks entry ``key`` is built on: those its token ids make, when they also make
    its key; none otherwise. A chunk list damaged or crafted to name other entries'
    chunks must not release them (their entries would lose them); the references of one
    whose token ids do not make its key are left to ``verify --fix``, which recounts."""
    if not rec.chunked or tokens is None or len(tokens) != TOKEN_BYTES * rec.n:
        return ()
    b = boundaries(root_key(rec.identity), bytes(tokens), rec.chunk)
    if entry_key(b[-1], bytes(tokens)[(len(b) - 1) * rec.chunk * TOKEN_BYTES :]) != key:
        return ()
    return tuple(b[1:])


class Reader:
    """Record reads inside one transaction. ``entry`` / ``chunk`` / ``pack`` return None
    for a missing record and raise ``RecordError`` for one kvstore did not write."""

    def __init__(self, txn: Any, dbs: dict[str, Any], blob_root: Path) -> None:
        self.txn, self.db, self.blob_root = txn, dbs, blob_root

    def raw(self, db: str, key: bytes) -> bytes | None:
        """The bytes stored under ``key`` in database ``db`` (None if absent), unparsed."""
        v = self.txn.get(key, db=self.db[db])
        return None if v is None else bytes(v)

    def entry(self, key: bytes) -> EntryRecord | None:
        """Entry ``key``; None if absent; RecordError if not a record kvstore writes."""
        return parse("entries", self.txn.get(key, db=self.db["entries"]))

    def chunk(self, key: bytes) -> ChunkRecord | None:
        """Chunk ``key``; None if absent; RecordError if not a record kvstore writes."""
        return parse("chunks", self.txn.get(key, db=self.db["chunks"]))

    def pack(self, pack: bytes) -> PackRecord | None:
        """Pack ``pack``'s record; None if absent; RecordError if not one kvstore writes."""
        return parse("packs", self.txn.get(pack, db=self.db["packs"]))

    def identity(self, digest: bytes) -> IdentityRecord | None:
        """Identity ``digest``'s description; None if absent; RecordError if unreadable."""
        return parse("identities", self.txn.get(digest, db=self.db["identities"]))

    def tokens(self, key: bytes) -> bytes | None:
        """The exact token ids (int64 LE) of entry or chunk ``key``, unchecked (callers
        compare them with what they expect, and with the key they hash to)."""
        return self.raw("tokens", key)

    def meta(self, key: bytes) -> bytes | None:
        """A ``meta`` value (format, chunk_tokens, bytes), unparsed."""
        return self.raw("meta", key)

    def total_bytes(self) -> int:
        """The pack files' total size as the index counts it (0 if the counter is damaged)."""
        return count(self.txn.get(b"bytes", db=self.db["meta"]))

    def edges(self, boundary: bytes, after: bytes) -> Iterator[trie.Edge]:
        """See ``trie.edges``."""
        from . import trie

        return trie.edges(self.txn, self.db["bounds"], boundary, after)

    def keys(self, db: str) -> list[bytes]:
        """Every key of ``db``, in order (a full scan: maintenance and repairs)."""
        return [bytes(k) for k in self.txn.cursor(db=self.db[db]).iternext(keys=True, values=False)]

    def keys_from(self, db: str, start: bytes) -> Iterator[bytes]:
        """Keys of ``db`` from the first one >= ``start``, in order."""
        cur = self.txn.cursor(db=self.db[db])
        if cur.set_range(start):
            yield from (bytes(k) for k in cur.iternext(keys=True, values=False))

    def pack_path(self, pack: bytes) -> Path:
        """The one path pack ``pack`` may have (``files.pack_path``)."""
        return files.pack_path(self.blob_root, pack)


class WriteTxn(Reader):
    """The index's write transaction (see the module docstring). Created by
    ``Index.transact``, which commits it and then unlinks ``unlink``."""

    def __init__(self, txn: Any, dbs: dict[str, Any], blob_root: Path) -> None:
        super().__init__(txn, dbs, blob_root)
        self.unlink: list[Path] = []

    def _put(self, db: str, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self.db[db])

    def _delete(self, db: str, key: bytes) -> bool:
        return bool(self.txn.delete(key, db=self.db[db]))

    def put_raw(self, db: str, key: bytes, value: bytes) -> None:
        """Store bytes as they are (rebuilding an index from salvaged records only)."""
        self._put(db, key, value)

    def delete_raw(self, db: str, key: bytes) -> bool:
        """Delete one key of one database (repairs only: trie edges, token ids)."""
        return self._delete(db, key)

    def unlink_after_commit(self, path: Path) -> None:
        """Remove ``path`` once this transaction committed (never if it aborts)."""
        self.unlink.append(path)

    def add_bytes(self, n: int) -> None:
        """Move the pack-bytes counter by ``n`` (never below 0)."""
        self._put("meta", b"bytes", str(max(0, self.total_bytes() + n)).encode())

    def set_meta(self, key: bytes, value: bytes) -> None:
        """Store a ``meta`` value."""
        self._put("meta", key, value)

    # -- records -----------------------------------------------------------------------

    def put_identity(self, digest: bytes, rec: IdentityRecord) -> None:
        """Describe identity ``digest`` unless it is described already."""
        if self.txn.get(digest, db=self.db["identities"]) is None:
            self._put("identities", digest, rec.to_bytes())

    def put_pack(self, pack: bytes, rec: PackRecord) -> None:
        """A new pack file (its bytes join the counter)."""
        self._put("packs", pack, rec.to_bytes())
        self.add_bytes(rec.size)

    def put_entry(self, key: bytes, rec: EntryRecord, tokens: bytes) -> None:
        """A new entry: record, token ids and trie edges."""
        from . import trie

        self._put("entries", key, rec.to_bytes())
        self._put("tokens", key, tokens)
        for e in trie.entry_edges(key, rec, tokens) or ():
            self._put("bounds", e, Kind.ENTRY.value)

    def set_entry(self, key: bytes, rec: EntryRecord) -> None:
        """Replace an entry's record (hits, last use, pin); edges and tokens unchanged."""
        self._put("entries", key, rec.to_bytes())

    def put_chunk(self, key: bytes, rec: ChunkRecord, tokens: bytes) -> None:
        """A new chunk: record, token ids and its trie edges under its parent boundary."""
        from . import trie

        self._put("chunks", key, rec.to_bytes())
        self._put("tokens", key, tokens)
        for e in trie.chunk_edges(key, rec, tokens) or ():
            self._put("bounds", e, Kind.CHUNK.value)

    def set_chunk(self, key: bytes, rec: ChunkRecord) -> None:
        """Replace a chunk's record (its reference count); edges and tokens unchanged."""
        self._put("chunks", key, rec.to_bytes())

    # -- removal -----------------------------------------------------------------------

    def release(self, seg: Segment) -> None:
        """One record no longer uses ``seg``: the pack loses a segment, and the pack file
        goes (after commit) with its last one."""
        try:
            prec = self.pack(seg.pack)
        except RecordError:
            prec = None  # a damaged pack record: verify --fix recounts it
        if prec is None:
            return
        prec = prec.released(seg.length)
        if prec.segments == 0:
            self.drop_pack(seg.pack, prec.size)
        else:
            self._put("packs", seg.pack, prec.to_bytes())

    def drop_pack(self, pack: bytes, size: int) -> None:
        """Forget a pack file and remove it after commit."""
        if self._delete("packs", pack):
            self.add_bytes(-size)
        self.unlink_after_commit(self.pack_path(pack))

    def remove_entry(self, key: bytes, *, release: bool = True) -> EntryRecord | None:
        """Drop an entry with its edges and token ids, release its segment (unless
        ``release`` is False: a segment proven to be another record's), and drop every
        chunk it was the last user of: the chunks its token ids make (``own_chunks``),
        not whatever its chunk list says. Returns the removed record (None if absent).
        RecordError if the record is unreadable (``drop_raw`` removes such a record)."""
        from . import trie

        rec = self.entry(key)
        if rec is None:
            return None
        tokens = self.tokens(key)
        self._drop_edges(rec.boundary, key, trie.entry_edges(key, rec, tokens))
        self._delete("entries", key)
        self._delete("tokens", key)
        for seg in rec.segments if release else ():
            self.release(seg)
        for ck in own_chunks(key, rec, tokens):
            self.unref_chunk(ck)
        return rec

    def unref_chunk(self, key: bytes) -> None:
        """One entry less uses chunk ``key``; the last one takes it away."""
        try:
            crec = self.chunk(key)
        except RecordError:
            return  # unreadable: verify --fix drops it and its users
        if crec is None:
            return
        if crec.refs <= 1:
            self.remove_chunk(key, crec)
        else:
            self.set_chunk(key, crec.with_refs(crec.refs - 1))

    def remove_chunk(self, key: bytes, crec: ChunkRecord | None = None, *, release: bool = True) -> None:
        """Drop a chunk record with its edges and token ids and release its segment
        (unless ``release`` is False, as for ``remove_entry``; entries built on it are the
        caller's business)."""
        from . import trie

        crec = crec or self.chunk(key)
        if crec is None:
            return
        self._drop_edges(crec.parent, key, trie.chunk_edges(key, crec, self.tokens(key)))
        self._delete("chunks", key)
        self._delete("tokens", key)
        if release:
            self.release(crec.segment)

    def drop_raw(self, db: str, key: bytes) -> None:
        """Delete an unreadable record with its token ids and every edge to it (a scan of
        the trie: repairs only)."""
        self._delete(db, key)
        self._delete("tokens", key)
        dead = [bytes(k) for k in self.txn.cursor(db=self.db["bounds"]).iternext(keys=True, values=False)
                if bytes(k[-KEY_BYTES:]) == key]
        for k in dead:
            self._delete("bounds", k)

    def _drop_edges(self, boundary: bytes, child: bytes, edge_keys: list[bytes] | None) -> None:
        from . import trie

        if edge_keys is not None and all([self._delete("bounds", e) for e in edge_keys]):
            return
        for e in trie.child_edges(self.txn, self.db["bounds"], boundary, child):
            self._delete("bounds", e)
