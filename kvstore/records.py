"""The index's record format: one frozen type per record kind, one writer, one validator.

Every record the index holds is written by a ``to_bytes`` here and read back through a
``from_bytes`` here, which checks every field by type and range and the invariants that tie
them together, and raises ``RecordError`` naming the field otherwise. Nothing else in
kvstore parses or builds a record, so a maintainer who changes the format changes this file.

Records are fixed binary layouts (struct, little-endian) behind a one-byte kind tag and a
one-byte format version (``keys.FORMAT_VERSION``, the one version constant): no JSON, so a
crafted record cannot nest, cannot hold a string that some caller later joins to a path,
and cannot carry a field of the wrong type. Blob files are named by 16 random bytes
(``Segment.pack``), never by a string from a record. Timestamps from the future (another
host's clock) are clamped to now when read.

Identity records hold the identity's JSON description (model name, path, components):
bounded in size and nesting, and only their top-level fields kvstore uses are typed.
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar

from .keys import FORMAT_VERSION, KEY_BYTES

CACHE_TYPES = ("assistant", "user", "system")
MAX_TOKENS = 1 << 28          # tokens in one entry
MAX_CHUNK = 1 << 20           # tokens per chunk
MAX_SEGMENT = 1 << 40         # bytes of one segment
MAX_IDENTITY_JSON = 1 << 20   # bytes of one identity description
MAX_JSON_DEPTH = 16


class RecordError(ValueError):
    """A stored record that kvstore did not write (damaged, foreign or crafted)."""


class Kind(Enum):
    """What a trie edge leads to (the value stored under an edge key)."""

    ENTRY = b"e"
    CHUNK = b"c"


def _tag(kind: bytes) -> bytes:
    """A record's two-byte tag: its kind, then the format version (``keys.FORMAT_VERSION``)."""
    return kind + bytes([FORMAT_VERSION])


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise RecordError(what)


def _clamp(ts: float, now: float | None) -> float:
    """A timestamp, never later than now (a record written under a skewed clock must not
    stay first in LRU order forever)."""
    return min(ts, time.time() if now is None else now)


def _unpack(fmt: struct.Struct, data: bytes, where: str) -> tuple:
    try:
        return fmt.unpack_from(data)
    except struct.error:
        raise RecordError(f"{where} is {len(data)} bytes, too short") from None


def _keys(data: bytes, count: int, where: str) -> tuple[bytes, ...]:
    _need(len(data) == count * KEY_BYTES, f"{where}: {len(data)} bytes for {count} keys")
    return tuple(data[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(count))


# ----------------------------------------------------------------------------- segment


@dataclass(frozen=True)
class Segment:
    """Where a record's KV lives: ``length`` bytes at ``offset`` of pack file ``pack``
    (a complete safetensors buffer), whose xxh3-128 is ``checksum``."""

    pack: bytes
    offset: int
    length: int
    checksum: bytes

    FMT: ClassVar[struct.Struct] = struct.Struct(f"<{KEY_BYTES}sQQ{KEY_BYTES}s")

    def to_bytes(self) -> bytes:
        return self.FMT.pack(self.pack, self.offset, self.length, self.checksum)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Segment":
        pack, offset, length, checksum = _unpack(cls.FMT, data, "segment")
        _need(8 <= length <= MAX_SEGMENT, f"segment length {length} out of range")
        _need(offset <= MAX_SEGMENT, f"segment offset {offset} out of range")
        return cls(pack, offset, length, checksum)

    @property
    def end(self) -> int:
        return self.offset + self.length


_NO_SEGMENT = b"\0" * Segment.FMT.size


# ----------------------------------------------------------------------------- entry


@dataclass(frozen=True)
class EntryRecord:
    """One stored prefix of ``n`` tokens of ``identity``.

    ``chunked``: trimmable KV stored as ``n // chunk`` shared chunks (keys ``chunks``, each
    the chained key of the prefix it ends) plus, when ``n`` is not a multiple of the chunk
    size, a ``tail`` segment; otherwise one snapshot segment (``tail``) at exactly ``n``.
    ``boundary``: the last chunk boundary at or before ``n`` (the trie node it is filed
    under). ``trimmable``: a restore may cut it to a shorter prefix. ``whole``: a copy of
    all ``n`` tokens as one safetensors file of its own (a pack holding only it, at offset
    0), which MLX's loader reads in one pass (``disk.whole``); redundant, dropped first
    under a disk budget and whenever it fails a check."""

    identity: bytes
    n: int
    chunk: int
    chunked: bool
    trimmable: bool
    boundary: bytes
    chunks: tuple[bytes, ...]
    tail: Segment | None
    cache_type: str = "assistant"
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0
    pinned: bool = False
    whole: Segment | None = None

    TAG: ClassVar[bytes] = _tag(b"E")
    FMT: ClassVar[struct.Struct] = struct.Struct(f"<2sBB{KEY_BYTES}sIIddQ{KEY_BYTES}sI")

    def __post_init__(self) -> None:
        _need(len(self.identity) == KEY_BYTES and len(self.boundary) == KEY_BYTES,
              f"identity / boundary must be {KEY_BYTES} bytes")
        _need(0 < self.n <= MAX_TOKENS, f"n={self.n} out of range")
        _need(0 < self.chunk <= MAX_CHUNK, f"chunk={self.chunk} out of range")
        _need(self.cache_type in CACHE_TYPES, f"cache_type {self.cache_type!r}")
        _need(all(len(k) == KEY_BYTES for k in self.chunks), f"chunk keys must be {KEY_BYTES} bytes")
        for name in ("created", "last_used"):
            v = getattr(self, name)
            _need(isinstance(v, float) and math.isfinite(v) and v >= 0, f"{name}={v!r}")
        _need(0 <= self.hits < 1 << 63, f"hits={self.hits}")
        if self.chunked:
            _need(len(self.chunks) == self.n // self.chunk,
                  f"{len(self.chunks)} chunks for {self.n} tokens of {self.chunk}")
            _need((self.tail is not None) == bool(self.n % self.chunk), "a chunked entry has a tail iff n % chunk")
        else:
            _need(not self.chunks and self.tail is not None, "a snapshot entry has one segment and no chunks")
        _need(self.whole is None or (self.whole.offset == 0 and (self.tail is None or self.whole.pack != self.tail.pack)),
              "a whole copy starts a pack of its own")

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The entry's own segment(s): its tail or snapshot, and its whole copy (chunks are
        separate records)."""
        return tuple(s for s in (self.tail, self.whole) if s is not None)

    def to_bytes(self) -> bytes:
        flags = (self.chunked | self.trimmable << 1 | self.pinned << 2 | (self.tail is not None) << 3
                 | (self.whole is not None) << 4)
        head = self.FMT.pack(self.TAG, flags, CACHE_TYPES.index(self.cache_type), self.identity, self.n,
                             self.chunk, self.created, self.last_used, self.hits, self.boundary,
                             len(self.chunks))
        tail = self.tail.to_bytes() if self.tail is not None else _NO_SEGMENT
        return head + tail + b"".join(self.chunks) + (self.whole.to_bytes() if self.whole is not None else b"")

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, now: float | None = None) -> "EntryRecord":
        data = bytes(data)
        tag, flags, ctype, ident, n, chunk, created, used, hits, boundary, count = _unpack(cls.FMT, data, "entry")
        _need(tag == cls.TAG, f"not an entry record of this format (tag {tag!r})")
        _need(flags < 32 and ctype < len(CACHE_TYPES), f"flags {flags} / cache type {ctype}")
        _need(count <= MAX_TOKENS // max(chunk, 1), f"{count} chunks")
        rest = data[cls.FMT.size :]
        whole = rest[len(rest) - Segment.FMT.size :] if flags & 16 else b""
        rest = rest[: len(rest) - len(whole)]
        seg, keys = rest[: Segment.FMT.size], rest[Segment.FMT.size :]
        _need(len(seg) == Segment.FMT.size and len(whole) == (Segment.FMT.size if flags & 16 else 0),
              "entry record truncated")
        try:
            return cls(ident, n, chunk, bool(flags & 1), bool(flags & 2), boundary, _keys(keys, count, "chunks"),
                       Segment.from_bytes(seg) if flags & 8 else None, CACHE_TYPES[ctype],
                       _clamp(created, now), _clamp(used, now), hits, bool(flags & 4),
                       Segment.from_bytes(whole) if whole else None)
        except (TypeError, ValueError) as e:
            raise RecordError(f"entry record: {e}") from None

    def touched(self, when: float, hits: int = 1) -> "EntryRecord":
        return replace(self, last_used=max(self.last_used, when), hits=self.hits + hits)

    def pinned_as(self, pinned: bool) -> "EntryRecord":
        return replace(self, pinned=pinned)

    def with_whole(self, whole: Segment | None) -> "EntryRecord":
        return replace(self, whole=whole)


# ----------------------------------------------------------------------------- chunk


@dataclass(frozen=True)
class ChunkRecord:
    """One shared chunk: the KV of the ``n`` tokens after boundary ``parent`` (its key is
    the chained key of ``parent`` + those tokens), referenced by ``refs`` entries."""

    identity: bytes
    parent: bytes
    n: int
    refs: int
    segment: Segment

    TAG: ClassVar[bytes] = _tag(b"C")
    FMT: ClassVar[struct.Struct] = struct.Struct(f"<2s{KEY_BYTES}s{KEY_BYTES}sII")

    def __post_init__(self) -> None:
        _need(len(self.identity) == KEY_BYTES and len(self.parent) == KEY_BYTES,
              f"identity / parent must be {KEY_BYTES} bytes")
        _need(0 < self.n <= MAX_CHUNK, f"n={self.n} out of range")
        _need(0 <= self.refs < 1 << 32, f"refs={self.refs}")

    def to_bytes(self) -> bytes:
        return self.FMT.pack(self.TAG, self.identity, self.parent, self.n, self.refs) + self.segment.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, now: float | None = None) -> "ChunkRecord":
        data = bytes(data)
        tag, ident, parent, n, refs = _unpack(cls.FMT, data, "chunk")
        _need(tag == cls.TAG, f"not a chunk record of this format (tag {tag!r})")
        seg = data[cls.FMT.size :]
        _need(len(seg) == Segment.FMT.size, "chunk record has the wrong length")
        try:
            return cls(ident, parent, n, refs, Segment.from_bytes(seg))
        except (TypeError, ValueError) as e:
            raise RecordError(f"chunk record: {e}") from None

    def with_refs(self, refs: int) -> "ChunkRecord":
        return replace(self, refs=refs)


# ----------------------------------------------------------------------------- pack


@dataclass(frozen=True)
class PackRecord:
    """One pack file: ``size`` bytes on disk, ``segments`` of them still used by records
    (``live`` bytes). The file goes when the last segment does."""

    size: int
    segments: int
    live: int
    created: float = 0.0

    TAG: ClassVar[bytes] = _tag(b"P")
    FMT: ClassVar[struct.Struct] = struct.Struct("<2sQIQd")

    def __post_init__(self) -> None:
        _need(0 < self.size <= MAX_SEGMENT * 64, f"pack size {self.size}")
        _need(0 <= self.segments < 1 << 32 and 0 <= self.live <= self.size, f"{self.segments} / {self.live}")
        _need(math.isfinite(self.created) and self.created >= 0, f"created={self.created!r}")

    def to_bytes(self) -> bytes:
        return self.FMT.pack(self.TAG, self.size, self.segments, self.live, self.created)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, now: float | None = None) -> "PackRecord":
        data = bytes(data)
        _need(len(data) == cls.FMT.size, "pack record has the wrong length")
        tag, size, segments, live, created = cls.FMT.unpack(data)
        _need(tag == cls.TAG, f"not a pack record of this format (tag {tag!r})")
        try:
            return cls(size, segments, live, _clamp(created, now))
        except (TypeError, ValueError) as e:
            raise RecordError(f"pack record: {e}") from None

    def released(self, length: int) -> "PackRecord":
        """One segment of ``length`` bytes no longer used."""
        return replace(self, segments=max(0, self.segments - 1), live=max(0, self.live - length))


# ----------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class IdentityRecord:
    """What an identity digest stands for, as ``identity.Identity.info`` describes it:
    the fields kvstore reads are typed, the rest is kept as bounded JSON."""

    info: dict[str, Any] = field(default_factory=dict)

    TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "name": (str,), "path": (str, type(None)), "model_type": (str, type(None)),
        "kv_bits": (int, type(None)), "versions": (dict,), "components": (dict,)}

    def __post_init__(self) -> None:
        _need(isinstance(self.info, dict), "identity description is not an object")
        for k, types in self.TYPES.items():
            if k in self.info:
                v = self.info[k]
                _need(isinstance(v, types) and not isinstance(v, bool), f"identity field {k!r} is {type(v).__name__}")
        _need(_depth(self.info) <= MAX_JSON_DEPTH, "identity description nests too deep")

    def get(self, key: str, default: Any = None) -> Any:
        return self.info.get(key, default)

    @property
    def name(self) -> str | None:
        return self.info.get("name")

    @property
    def path(self) -> str | None:
        return self.info.get("path")

    def to_bytes(self) -> bytes:
        data = json.dumps(self.info, separators=(",", ":"), sort_keys=True, default=str).encode()
        _need(len(data) <= MAX_IDENTITY_JSON, "identity description too large")
        return data

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, now: float | None = None) -> "IdentityRecord":
        data = bytes(data)
        _need(len(data) <= MAX_IDENTITY_JSON, f"identity description of {len(data)} bytes")
        try:
            info = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise RecordError(f"identity description is not JSON: {type(e).__name__}") from None
        return cls(info)


def _depth(obj: Any, level: int = 0) -> int:
    if level > MAX_JSON_DEPTH:
        return level
    if isinstance(obj, dict):
        return max((_depth(v, level + 1) for v in obj.values()), default=level + 1)
    if isinstance(obj, list):
        return max((_depth(v, level + 1) for v in obj), default=level + 1)
    return level


Record = EntryRecord | ChunkRecord | PackRecord | IdentityRecord  # any stored record
RECORD_TYPES: dict[str, type[Record]] = {"entries": EntryRecord, "chunks": ChunkRecord, "packs": PackRecord, "identities": IdentityRecord}


def parse(db: str, data: bytes | memoryview | None, now: float | None = None) -> Any:
    """The record stored in database ``db`` (None for None); RecordError if unreadable."""
    if data is None:
        return None
    return RECORD_TYPES[db].from_bytes(data, now)
