"""Maintenance of a shared tier: what it holds per identity, and removing entries.

``listing`` scans the prefix's names (``SCAN``, never ``KEYS``) and reads each entry's
frame and record with bounded ``GETRANGE`` reads (never a whole value) and each chunk's
size, in pipelines of ``BATCH`` names. ``collect_garbage`` removes every name of some
identities, or entries published longer ago than an age: their boundary-hash fields
first (so no reader is sent to them), then the values, then chunks no remaining entry
uses and published before the same age (a chunk written just now for an entry not yet
published is younger than that, so a running publisher is never undercut). Last, it
removes the fields of every boundary hash whose value is gone (removed here, evicted by
the server, or expired): a field found by ``HKEYS`` is removed only if its value does not
``EXISTS`` after that, and a publisher writes a value before its field, so a field being
published is never taken.

The server's own eviction (``maxmemory`` + ``allkeys-lru``, or a TTL) is the budget; this
is for removing a model's entries, or old ones, on purpose.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from ..records import EntryRecord, RecordError
from . import values
from .client import SharedClient

BATCH = 500
Bytes = bytes  # the type, for classes with a field named ``bytes``


@dataclass
class EntryInfo:
    key: bytes
    identity: bytes
    tokens: int
    bytes: int  # the value's size (this name shadows the type below: hence Bytes)
    chunks: tuple[Bytes, ...]
    boundary: Bytes
    cache_type: str
    created: float
    published: float


@dataclass
class Listing:
    """What a scan found: entries (readable ones), chunks (name -> (size, published)),
    hashes, and names that are not kvstore's format (counted, never touched)."""

    entries: list[EntryInfo] = field(default_factory=list)
    chunks: dict[str, tuple[bytes, int, float]] = field(default_factory=dict)  # name -> (identity, size, published)
    hashes: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    complete: bool = True  # False: the server failed during the scan

    def by_identity(self) -> list[dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}

        def row(ident: bytes) -> dict[str, Any]:
            return rows.setdefault(ident.hex(), {"identity": ident.hex(), "entries": 0, "chunks": 0,
                                                 "tokens": 0, "bytes": 0, "newest": 0.0})
        for e in self.entries:
            r = row(e.identity)
            r["entries"] += 1
            r["tokens"] += e.tokens
            r["bytes"] += e.bytes
            r["newest"] = max(r["newest"], e.published)
        for ident, size, _ in self.chunks.values():
            r = row(ident)
            r["chunks"] += 1
            r["bytes"] += size
        return sorted(rows.values(), key=lambda r: r["identity"])


def listing(client: SharedClient, identity: str | None = None) -> Listing:
    """Every kvstore name under the client's prefix (of identities whose hex starts with
    ``identity``), entries with their records, chunks with size and publish time."""
    prefix = client.config.prefix
    out = Listing()
    names: dict[str, values.Name] = {}
    for text in client.scan_iter(values.pattern(prefix, None, identity)):
        parsed = values.parse_name(prefix, text)
        if parsed is None:
            out.unreadable.append(text)
        else:
            names[text] = parsed
    for batch in _batches([n for n, p in names.items() if p.kind != "bounds"]):
        heads = client.pipeline_read([("GETRANGE", n, 0, values.FRAME.size - 1) for n in batch])
        sizes = client.pipeline_read([("STRLEN", n) for n in batch])
        if heads is None or sizes is None:
            out.complete = False
            break
        frames: dict[str, values.Frame] = {}
        for n, head, size in zip(batch, heads, sizes):
            try:
                f = values.parse_frame(head or b"")
                if f.size != size or f.kind != names[n].kind:
                    raise values.ValueFormatError("frame does not match the value")
                frames[n] = f
            except values.ValueFormatError:
                out.unreadable.append(n)
        entries = [n for n in frames if frames[n].kind == "entry"]
        for n in frames:
            if frames[n].kind == "chunk":
                out.chunks[n] = (names[n].identity, frames[n].size, frames[n].published)
        recs = client.pipeline_read([("GETRANGE", n, 0, values.FRAME.size + frames[n].record - 1) for n in entries])
        if recs is None:
            out.complete = False
            break
        for n, data in zip(entries, recs):
            try:
                f, rec = values.parse_record(data or b"")
            except RecordError:
                out.unreadable.append(n)
                continue
            if not isinstance(rec, EntryRecord) or rec.identity != names[n].identity:
                out.unreadable.append(n)
                continue
            out.entries.append(EntryInfo(names[n].key, rec.identity, rec.n, f.size, rec.chunks, rec.boundary,
                                         rec.cache_type, rec.created, f.published))
    out.hashes = [n for n, p in names.items() if p.kind == "bounds"]
    return out


@dataclass
class GcResult:
    entries: list[EntryInfo]
    chunks: int
    hashes: int
    bytes: int
    dry_run: bool
    complete: bool
    fields: int = 0  # boundary-hash fields whose value was gone (a dry run counts them from the listing)


def collect_garbage(client: SharedClient, *, identities: Sequence[str] = (), max_age: float | None = None,
                    dry_run: bool = False, now: float | None = None) -> GcResult:
    """Remove every value of ``identities`` (full hex digests), and entries published more
    than ``max_age`` seconds ago with the chunks nothing else uses (see the module
    docstring). ``dry_run``: report only."""
    now = time.time() if now is None else now
    found = listing(client)
    prefix = client.config.prefix
    doomed_ids = {bytes.fromhex(h) for h in identities}
    old = now - max_age if max_age is not None else None
    gone = [e for e in found.entries if e.identity in doomed_ids or (old is not None and e.published < old)]
    gone_keys = {e.key for e in gone}
    used = {ck for e in found.entries if e.key not in gone_keys for ck in e.chunks}
    chunks = [n for n, (ident, _, published) in found.chunks.items()
              if ident in doomed_ids or (old is not None and published < old
                                         and values.parse_name(prefix, n).key not in used)]  # type: ignore[union-attr]
    hashes = [n for n in found.hashes
              if values.parse_name(prefix, n).identity in doomed_ids]  # type: ignore[union-attr]
    freed = sum(e.bytes for e in gone) + sum(found.chunks[n][1] for n in chunks)
    if not dry_run:
        fields: dict[str, list[str]] = {}
        for e in gone:
            if e.identity not in doomed_ids:
                fields.setdefault(values.name(prefix, "bounds", e.boundary, e.identity), []).append(e.key.hex())
        for hname, keys in fields.items():  # readers are no longer sent to them
            client.run(_hdel(hname, keys))
        for batch in _batches(hashes + [values.name(prefix, "entry", e.key, e.identity) for e in gone] + chunks):
            client.delete_many(batch)
    doomed_hashes = set(hashes)
    kept = [n for n in found.hashes if n not in doomed_hashes]
    left = {values.name(prefix, "entry", e.key, e.identity) for e in found.entries if e.key not in gone_keys}
    left |= set(found.chunks) - set(chunks)
    dangling = _dangling_fields(client, kept, None if dry_run else set(), left)
    if not dry_run:
        for hname, names in dangling.items():
            client.run(_hdel(hname, names))
    return GcResult(gone, len(chunks), len(hashes), freed, dry_run, found.complete,
                    sum(len(f) for f in dangling.values()))


def _hdel(name: str, fields: list[str]) -> Callable[[Any], Any]:
    """An HDEL of ``fields`` from hash ``name``, for ``SharedClient.run``."""
    return lambda r: r.hdel(name, *fields)


def _dangling_fields(client: SharedClient, hashes: list[str], exists: set[str] | None,
                     left: set[str]) -> dict[str, list[str]]:
    """Fields of ``hashes`` whose value (an entry, or a chunk for a chunk field) is gone:
    absent from ``left`` (the listing after this gc) when ``exists`` is None (a dry run),
    else not ``EXISTS`` now, asked after ``HKEYS``."""
    prefix = client.config.prefix
    out: dict[str, list[str]] = {}
    for batch in _batches(hashes):
        keys = client.pipeline_read([("HKEYS", h) for h in batch])
        if keys is None:
            break
        targets: list[tuple[str, str, str]] = []  # (hash, field, value name)
        for h, fields in zip(batch, keys):
            ident = values.parse_name(prefix, h).identity  # type: ignore[union-attr]
            for f in fields or []:
                text = f.decode() if isinstance(f, bytes) else str(f)
                chunk = text.startswith(values.CHUNK_FIELD)
                try:
                    key = bytes.fromhex(text[len(values.CHUNK_FIELD):] if chunk else text)
                    targets.append((h, text, values.name(prefix, "chunk" if chunk else "entry", key, ident)))
                except ValueError:
                    continue  # not a field kvstore writes: never touched
        if exists is None:
            gone = [t for t in targets if t[2] not in left]
        else:
            there = client.pipeline_read([("EXISTS", t[2]) for t in targets]) if targets else []
            if there is None:
                break
            gone = [t for t, e in zip(targets, there) if e == 0]
        for h, f, _ in gone:
            out.setdefault(h, []).append(f)
    return out


def server_memory(client: SharedClient) -> dict[str, Any] | None:
    """used_memory, maxmemory and maxmemory_policy of the server (summed over cluster
    primaries), or None if it does not answer."""
    def read(r: Any) -> dict[str, Any]:
        info = r.info("memory")
        nodes = list(info.values()) if info and all(isinstance(v, dict) for v in info.values()) else [info]
        return {"used_memory": sum(int(n.get("used_memory", 0)) for n in nodes),
                "maxmemory": sum(int(n.get("maxmemory", 0)) for n in nodes),
                "maxmemory_policy": sorted({str(n.get("maxmemory_policy")) for n in nodes})}
    return client.run(read)


def _batches(items: list[str]) -> Iterator[list[str]]:
    for i in range(0, len(items), BATCH):
        yield items[i : i + BATCH]
