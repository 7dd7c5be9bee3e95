"""What the shared tier stores under which Redis name: key names, values, hash fields.

Names (``prefix`` from the config; hex digests, lower case)::

    prefix:{<chunk key>}:c1:<identity>     a chunk: the KV of C tokens after its parent
    prefix:{<entry key>}:e1:<identity>     an entry: its record, token ids, tail / snapshot
    prefix:{<boundary>}:h1:<identity>      hash: entry key hex -> ``field_value``, for every
                                           entry filed under that chunk boundary, and
                                           "c:" + chunk key hex -> the chunk's token ids,
                                           for every chunk whose parent is that boundary

Keys are ``keys.py``'s chained xxh3-128 digests, rooted in the identity, so two models
never share a name; the hash tag is the digest itself, so in Redis Cluster chunks and
entries spread over the slots by their own key and a boundary's hash lives in its own
slot (nothing is written atomically across keys: see ``tier.publish`` for the order that
replaces atomicity). The identity in the name is for maintenance (``SCAN`` by identity);
readers never trust it: the value's record names its identity, and every key is
re-derived from token ids. ``1`` in ``c1``/``e1``/``h1`` is the value format version: a
later format uses other names, so readers of either never see the other's values. Chunk
fields were added to ``h1`` without a new version: their names are not entry keys, so a
reader that predates them rejects each by its name (``parse_field``: a bad field, skipped)
and never reads its value as anything.

A chunk or entry value is one Redis string::

    frame    <4s B 3x d I I Q  magic, version, published (unix s), record, token, segment bytes
    record   records.ChunkRecord / EntryRecord .to_bytes() (segment: pack id 0, offset 0)
    tokens   the token ids (int64 LE, ``keys.TOKEN_BYTES`` each): a chunk's C tokens, an entry's whole prompt
    segment  the safetensors buffer exactly as the local pack held it (none for an entry
             of whole chunks)

Guarantees of ``parse_chunk`` / ``parse_entry``: the lengths add up to the value's length
exactly (a claim is only ever compared, never allocated), the record passes its own
``from_bytes`` (every field typed and bounded), the token count is the record's, the
segment's xxh3-128 is the record's checksum (the ``digest`` a reader computed while the
bytes arrived, when it covers exactly the segment: ``segment_offset`` says where the
segment starts from a value's head). Anything else raises ``ValueFormatError``. A
value given as a memoryview is not copied: its ``segment`` is a view of it.
No JSON, nothing that becomes a path. Token and key checks against a query are the
caller's (``tier``): a parsed value is self-consistent, not yet trusted for a prompt.
"""

from __future__ import annotations

import re
import struct
import time
from dataclasses import dataclass

import xxhash

from ..keys import KEY_BYTES, TOKEN_BYTES
from ..records import MAX_CHUNK, ChunkRecord, EntryRecord, RecordError, Segment

VERSION = 1
KINDS = {"chunk": "c1", "entry": "e1", "bounds": "h1"}
FRAME = struct.Struct("<4sB3xdIIQ")
MAGIC = {"chunk": b"KVSc", "entry": b"KVSe"}
NO_PACK = b"\0" * KEY_BYTES
FIELD_TAG = b"F\x01"
CHUNK_FIELD = "c:"  # a chunk field's name: this + the chunk key's hex (an entry field's: the hex alone)
_HEX = re.compile(rb"[0-9a-f]{32}")
_CHUNK_HEX = re.compile(rb"c:[0-9a-f]{32}")
_NAME = re.compile(r"(?P<prefix>[^:]+):\{(?P<key>[0-9a-f]{32})\}:(?P<kind>[a-z]\d):(?P<identity>[0-9a-f]{32})")


class ValueFormatError(RecordError):
    """A shared value kvstore did not write (damaged, truncated, foreign or crafted)."""


# ----------------------------------------------------------------------------- names


def name(prefix: str, kind: str, key: bytes, identity: bytes) -> str:
    """The Redis name of a ``kind`` ("chunk" | "entry" | "bounds") value."""
    from .keys import make_key

    return make_key(prefix, KINDS[kind], identity.hex(), tag=key.hex())


def pattern(prefix: str, kind: str | None = None, identity: str | None = None) -> str:
    """A SCAN pattern for names of one kind and / or identity (hex prefix)."""
    return f"{prefix}:*:{KINDS[kind] if kind else '*'}:{identity or ''}*"


@dataclass(frozen=True)
class Name:
    """A parsed name: ``kind`` ("chunk" | "entry" | "bounds"), ``key`` and ``identity``."""

    kind: str
    key: bytes
    identity: bytes


def parse_name(prefix: str, text: str) -> Name | None:
    """The parts of a name this module makes under ``prefix``; None for any other name."""
    m = _NAME.fullmatch(text)
    if m is None or m["prefix"] != prefix:
        return None
    kind = next((k for k, v in KINDS.items() if v == m["kind"]), None)
    if kind is None:
        return None
    return Name(kind, bytes.fromhex(m["key"]), bytes.fromhex(m["identity"]))


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Value:
    """A parsed chunk or entry value. ``segment`` is b"" for an entry of whole chunks."""

    record: ChunkRecord | EntryRecord
    tokens: bytes
    segment: bytes | memoryview
    published: float


def chunk_parts(rec: ChunkRecord, tokens: bytes, segment: bytes, published: float) -> list[bytes]:
    """A chunk value as its pieces [frame + record + tokens, segment]: the value is their
    concatenation, which a writer sends without making it."""
    return _build("chunk", rec, rec.segment, tokens, segment, published)


def entry_parts(rec: EntryRecord, tokens: bytes, segment: bytes, published: float) -> list[bytes]:
    return _build("entry", rec, rec.tail, tokens, segment, published)


def _build(kind: str, rec: ChunkRecord | EntryRecord, seg: Segment | None, tokens: bytes,
           segment: bytes, published: float) -> list[bytes]:
    if (seg is None) != (not segment) or (seg is not None and seg.length != len(segment)):
        raise ValueError("the segment bytes are not the record's segment")
    if seg is not None:  # the local pack's place means nothing elsewhere
        rec = _with_segment(rec, Segment(NO_PACK, 0, seg.length, seg.checksum))
    body = rec.to_bytes()
    return [FRAME.pack(MAGIC[kind], VERSION, float(published), len(body), len(tokens), len(segment))
            + body + tokens, segment]


def _with_segment(rec: ChunkRecord | EntryRecord, seg: Segment) -> ChunkRecord | EntryRecord:
    from dataclasses import replace

    return replace(rec, segment=seg) if isinstance(rec, ChunkRecord) else replace(rec, tail=seg)


@dataclass(frozen=True)
class Frame:
    """A value's frame: what follows it and when it was published."""

    kind: str
    published: float
    record: int
    tokens: int
    segment: int

    @property
    def size(self) -> int:
        return FRAME.size + self.record + self.tokens + self.segment


def parse_frame(data: bytes | memoryview, now: float | None = None) -> Frame:
    """The frame at the start of ``data`` (which may be just the frame: maintenance reads
    a value's head with GETRANGE). Future publish times are clamped to now."""
    if len(data) < FRAME.size:
        raise ValueFormatError(f"value of {len(data)} bytes has no frame")
    magic, version, published, rlen, tlen, slen = FRAME.unpack_from(data)
    kind = next((k for k, m in MAGIC.items() if m == magic), None)
    if kind is None or version != VERSION:
        raise ValueFormatError(f"not a kvstore shared value of this format ({magic!r} v{version})")
    if not (published == published and 0 <= published < float("inf")):
        raise ValueFormatError(f"publish time {published!r}")
    return Frame(kind, min(published, time.time() if now is None else now), rlen, tlen, slen)


def parse_record(data: bytes | memoryview, now: float | None = None) -> tuple[Frame, ChunkRecord | EntryRecord]:
    """The frame and record of a value whose first ``Frame.record`` bytes after the frame
    are in ``data`` (the rest may be missing): what maintenance needs to list entries."""
    f = parse_frame(data, now)
    body = bytes(data[FRAME.size : FRAME.size + f.record])
    if len(body) != f.record:
        raise ValueFormatError("value truncated inside its record")
    rec = (ChunkRecord if f.kind == "chunk" else EntryRecord).from_bytes(body, now)
    return f, rec


def segment_offset(head: bytes | memoryview) -> int | None:
    """Where a value's segment starts, from its first ``FRAME.size`` bytes (None if they
    are not a frame): what a reader hashes from while the value arrives."""
    if len(head) < FRAME.size:
        return None
    magic, _v, _p, rlen, tlen, _s = FRAME.unpack_from(head)
    return FRAME.size + rlen + tlen if magic in MAGIC.values() else None


def parse_chunk(data: bytes | memoryview, now: float | None = None,
                digest: tuple[int, bytes] | None = None) -> Value:
    """A whole chunk value, checked as the module docstring says (``digest``: (offset,
    xxh3-128 of ``data[offset:]``) computed as it arrived)."""
    return _parse("chunk", data, now, digest)


def parse_entry(data: bytes | memoryview, now: float | None = None,
                digest: tuple[int, bytes] | None = None) -> Value:
    """A whole entry value, checked as the module docstring says."""
    return _parse("entry", data, now, digest)


def _parse(kind: str, data: bytes | memoryview, now: float | None, digest: tuple[int, bytes] | None) -> Value:
    try:
        f, rec = parse_record(data, now)
    except ValueFormatError:
        raise
    except RecordError as e:  # the record's own validation
        raise ValueFormatError(f"{kind} value: {e}") from None
    if f.kind != kind:
        raise ValueFormatError(f"a {f.kind} value where a {kind} was expected")
    if f.size != len(data):
        raise ValueFormatError(f"{kind} value is {len(data)} bytes, its frame says {f.size}")
    seg = rec.segment if isinstance(rec, ChunkRecord) else rec.tail
    if f.tokens != TOKEN_BYTES * rec.n:
        raise ValueFormatError(f"{kind} value holds {f.tokens // TOKEN_BYTES} token ids for {rec.n} tokens")
    if seg is None:
        if f.segment:
            raise ValueFormatError("an entry without a tail carries segment bytes")
    elif (seg.pack, seg.offset, seg.length) != (NO_PACK, 0, f.segment):
        raise ValueFormatError(f"{kind} value: its record does not describe its segment")
    start = FRAME.size + f.record
    tokens = data[start : start + f.tokens]
    segment = data[start + f.tokens :]
    if seg is not None:
        got = digest[1] if digest is not None and digest[0] == start + f.tokens \
            else xxhash.xxh3_128_digest(segment)
        if got != seg.checksum:
            raise ValueFormatError(f"{kind} value: segment checksum mismatch")
    return Value(rec, bytes(tokens), segment, f.published)


# ----------------------------------------------------------------------------- hash fields


@dataclass(frozen=True)
class Field:
    """One boundary-hash field: an entry filed under the boundary, and its residual token
    ids after it (what a lookup compares with the query to choose a candidate)."""

    key: bytes
    chunked: bool
    trimmable: bool
    residual: bytes


def field_value(rec: EntryRecord, residual: bytes) -> bytes:
    return FIELD_TAG + bytes([rec.chunked | rec.trimmable << 1]) + residual


def parse_field(field_name: bytes, value: bytes, chunk: int) -> Field:
    """A hash field (``entry key hex -> field_value``); its residual is shorter than one
    chunk of ``chunk`` tokens, or ValueFormatError."""
    if not _HEX.fullmatch(field_name):
        raise ValueFormatError("hash field name is not an entry key")
    if len(value) < 3 or value[:2] != FIELD_TAG or value[2] > 3:
        raise ValueFormatError("hash field value is not kvstore's")
    residual = value[3:]
    if len(residual) % TOKEN_BYTES or len(residual) >= TOKEN_BYTES * min(chunk, MAX_CHUNK):
        raise ValueFormatError(f"hash field residual of {len(residual)} bytes")
    return Field(bytes.fromhex(field_name.decode()), bool(value[2] & 1), bool(value[2] & 2), residual)


@dataclass(frozen=True)
class ChunkField:
    """One chunk field: a chunk filed under its parent boundary, and its token ids (what a
    lookup compares with the query to choose a chunk to trim)."""

    key: bytes
    tokens: bytes


def chunk_field_name(key: bytes) -> str:
    """The name of chunk ``key``'s field in its parent boundary's hash."""
    return CHUNK_FIELD + key.hex()


def is_chunk_field(field_name: bytes) -> bool:
    """Whether a hash field's name is a chunk field's (its value may still be bad)."""
    return field_name[:2] == CHUNK_FIELD.encode()


def parse_chunk_field(field_name: bytes, value: bytes, chunk: int) -> ChunkField:
    """A chunk field (``"c:" + chunk key hex -> token ids``) holding exactly ``chunk`` token
    ids, or ValueFormatError. Whether the key follows from them is the caller's check."""
    if not _CHUNK_HEX.fullmatch(field_name):
        raise ValueFormatError("hash field name is not a chunk key")
    if len(value) != TOKEN_BYTES * chunk or not 0 < chunk <= MAX_CHUNK:
        raise ValueFormatError(f"chunk field of {len(value)} bytes for chunks of {chunk} tokens")
    return ChunkField(bytes.fromhex(field_name[2:].decode()), bytes(value))
