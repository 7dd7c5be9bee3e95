"""The shared tier: prefix lookups in two round trips, and a publisher, over SharedClient.

Guaranteed: ``SharedTier.lookup`` costs at most two round trips per node whatever the
prompt's length, is bounded in wall time (a late lookup is a counted miss, never a wait)
and returns only what it verified (identity, keys re-derived from token ids, token ids,
parents; signatures with a fleet secret): a verified chain of whole chunks or None, never a
partial cache. ``SharedTier.submit`` never blocks (a full queue drops and counts); a publish
writes chunks, then the entry, then the hash fields, so a reader never sees a field whose
values were not written. A server failure never raises: it is counted and local serving
goes on. Needs no DiskTier or KVStore (the store glues them).

How and why, step by step (round trips, verification, publishing, timeouts, deadlines,
cost, size bounds): docs/shared.md.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..floors import serves
from ..query import Query
from ..keys import TOKEN_BYTES, boundaries, chunk_key, common_tokens, entry_key, key_of, residual
from ..records import ChunkRecord, EntryRecord, Segment
from ..writer import Writer
from . import signing
from . import values
from .bulk import Bulk, Tally
from .client import SharedClient
from .cost import Link, PrefillRates
from .config import SharedConfig
from ..escape import logger

log = logger("kvstore.shared")

MAX_FIELDS = 4096            # fields of one boundary hash considered per lookup
PUBLISH_BATCH_BYTES = 32 << 20  # chunk bytes per SET NX pipeline
BULK_TIMEOUT = 1.0           # seconds per socket operation when moving values
DEADLINE_FLOOR = 0.25        # seconds a lookup always gets (two small round trips on a LAN)
COUNTERS = ("lookups", "lookup_hits", "trim_hits", "rejected", "missing", "bad_fields", "too_large",
            "deleted", "published", "publish_skipped", "publish_failed", "chunks_published",
            "deadline_misses", "skipped_cost", "publish_abandoned", "bad_signature")

ChunkPiece = tuple[bytes, ChunkRecord, bytes, bytes | memoryview]  # key, record, token ids, segment bytes


@dataclass(frozen=True)
class Found:
    """A verified shared hit, ready for ``DiskTier.import_entry``: entry ``key`` holding
    ``tokens`` (``record``; an entry of whole chunks made from a chain has no tail),
    ``chunks`` of it not held locally, ``tail`` its tail or snapshot bytes (b"" for none),
    and ``n``, the query tokens it serves."""

    key: bytes
    record: EntryRecord
    tokens: bytes
    chunks: list[ChunkPiece]
    tail: bytes | memoryview
    n: int


@dataclass(frozen=True)
class PublishItem:
    """A locally committed entry to publish: its record and token ids, its chunks as
    (key, record, token ids), and ``read(segment) -> bytes`` (verified local bytes)."""

    identity: bytes
    key: bytes
    record: EntryRecord
    tokens: bytes
    chunks: list[tuple[bytes, ChunkRecord, bytes]]
    read: Callable[[Segment], bytes]


@dataclass(frozen=True)
class _Candidate:
    n: int                  # query tokens it would serve
    k: int                  # boundary it is filed under (chain: chunks it needs)
    key: bytes | None       # entry key (trim: the chunk's); None: the chain of chunks alone
    chunked: bool = True    # what the entry's field says (its value must agree)
    trim: bool = False      # key is a chunk after boundary k, to be trimmed to the query


def _better(a: _Candidate, b: _Candidate | None) -> bool:
    """More query tokens; at equal length an entry over a chunk to trim over the chain."""
    def rank(c: _Candidate) -> int:
        return 0 if c.key is None else 1 if c.trim else 2
    return b is None or a.n > b.n or (a.n == b.n and rank(a) > rank(b))


def _whole(identity: bytes, chunks: list[bytes], tokens: bytes, C: int, pieces: list[ChunkPiece],
           n: int) -> Found:
    """A hit made of whole chunks (``chunks``, the chain's keys in order, holding
    ``tokens``), filed as an entry with no tail at the last one; serves ``n`` tokens."""
    now = time.time()
    rec = EntryRecord(identity, len(chunks) * C, C, True, True, chunks[-1], tuple(chunks), None,
                      "assistant", now, now)
    return Found(entry_key(chunks[-1], b""), rec, tokens, pieces, b"", n)


class SharedTier:
    """Lookup and publish against one shared store (see the module docstring).

    ``max_value_bytes`` bounds every value read; ``queue_size`` the publisher's queue."""

    def __init__(self, config: SharedConfig | str, *, queue_size: int,
                 max_value_bytes: int | None = None, max_fields: int = MAX_FIELDS) -> None:
        self.client = SharedClient(config)
        cfg = self.config = self.client.config  # values (round trip 2, publishing) may be many
        # MB: a longer per-operation timeout than the quick round trip 1 and its breaker
        bulk = cfg.with_options(command_timeout=max(BULK_TIMEOUT, 10 * cfg.command_timeout))
        self.bulk = SharedClient(bulk)
        self.pub = SharedClient(bulk)
        self.prefix = cfg.prefix
        self.secret = cfg.secret  # values signed and verified (``signing``) when set
        self.max_value_bytes = int(cfg.max_value_bytes if max_value_bytes is None else max_value_bytes)
        self.max_fields = int(max_fields)
        self.link = Link()
        self.prefill = PrefillRates()
        self.publisher = Writer(queue_size, name="kvstore-publisher")
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._server_limit: int | None = None  # proto-max-bulk-len, asked once by the publisher
        self._stop_at: float | None = None     # set by close: publishes after it are dropped

    def name(self, kind: str, key: bytes, identity: bytes) -> str:
        return values.name(self.prefix, kind, key, identity)

    # -- lookup ------------------------------------------------------------------------

    def lookup(self, q: Query, held: set[bytes], better_than: int) -> Found | None:
        """The longest verified prefix of the query ``q`` longer than ``better_than`` tokens,
        or None; at most two round trips (see the module docstring). ``q`` brings its
        identity's digest and its chain (``keys.boundaries`` from the identity's root,
        ``q.chunk`` tokens per chunk, hashed once for every tier); ``held``: its chunk keys
        indexed locally (read from there); ``q.near`` is told of a candidate skipped for its
        cost (``misses.Near``)."""
        identity, bounds, C = q.digest, q.bounds, q.chunk
        n_q, K = q.n, len(bounds) - 1
        levels = [k for k in range(K + 1) if min((k + 1) * C - 1, n_q) > better_than]
        if not levels or n_q == 0:
            return None
        self._count("lookups")
        need = [k for k in range(1, K + 1) if bounds[k] not in held]
        cmds = [("HGETALL", self.name("bounds", bounds[k], identity)) for k in levels]
        cmds += [("STRLEN", self.name("chunk", bounds[k], identity)) for k in need]
        t0 = time.monotonic()
        until = t0 + self.config.fetch_deadline
        got = self.client.pipeline_read(cmds, until)
        if got is None:
            self._late(until)
            return None
        self.link.round_trip(time.monotonic() - t0)
        sizes = dict(zip(need, got[len(levels):]))
        for k, size in sizes.items():
            if isinstance(size, int) and size > self.max_value_bytes:
                self._count("too_large")
        chain = 0
        while chain < K and (chain + 1 not in sizes or _fits(sizes[chain + 1], self.max_value_bytes)):
            chain += 1
        best = self._choose(q, levels, got[: len(levels)], chain, better_than)
        if best is None:
            return None
        moving = self._moving(identity, best, sizes, C)
        budget = self._budget(identity, moving, best.n - better_than)
        if budget is None:
            self._count("skipped_cost")
            if q.near is not None:
                q.near.skipped("its transfer would cost more than the prefill it saves", best.n)
            return None
        until = time.monotonic() + budget  # round trip 1 had fetch_deadline; round trip 2 what the hit is worth
        found = self._fetch(q, held, best, better_than, until, moving)
        if found is not None:
            self._count("lookup_hits")
        return found

    def _moving(self, identity: bytes, best: _Candidate, sizes: dict[int, Any], C: int) -> float | None:
        """Bytes round trip 2 would move for ``best``: its chunks' sizes (round trip 1 read
        them) and its own value's, estimated per token (from those chunks, else from this
        model's earlier transfers); None when nothing tells."""
        chunks = [sizes[k] for k in range(1, best.k + 1) if k in sizes and isinstance(sizes[k], int)] \
            if best.chunked else []
        per_token = sum(chunks) / (len(chunks) * C) if chunks else self.link.bytes_per_token(identity)
        own = _value_tokens(best, C)
        if own and per_token is None:
            return None
        return sum(chunks) + (per_token or 0.0) * own

    def _budget(self, identity: bytes, moving: float | None, saved: int) -> float | None:
        """Seconds round trip 2 may take to move ``moving`` bytes that save prefilling
        ``saved`` tokens, or None when it does not pay (see ``cost``): with the prefill
        time P and the transfer time T both estimated, T >= P is skipped, else the
        deadline is max(DEADLINE_FLOOR, min(P, 2 T)); with P alone, min(P / 2,
        fetch_deadline); with neither, ``fetch_deadline``."""
        transfer = None if moving is None else self.link.seconds(moving)
        prefill = self.prefill.seconds(identity, saved)
        if prefill is None:
            return self.config.fetch_deadline
        if transfer is None:
            return max(DEADLINE_FLOOR, min(prefill / 2, self.config.fetch_deadline))
        if transfer >= prefill:
            return None
        return max(DEADLINE_FLOOR, min(prefill, 2 * transfer))

    def _late(self, until: float, started: float | None = None, moving: float | None = None,
              received: int | None = None) -> None:
        """A call that failed: a deadline miss (counted) if its time ran out; then the
        link moved ``received`` of ``moving`` bytes since ``started`` (its estimate lowered)."""
        if time.monotonic() >= until - 0.005:
            self._count("deadline_misses")
            self.link.late(moving, time.monotonic() - started if started is not None else None, received)
        return None

    def _choose(self, q: Query, levels: list[int], hashes: list[Any],
                chain: int, better_than: int) -> _Candidate | None:
        """The best candidate from round trip 1: most query tokens; at equal length an
        entry, then a chunk to trim, then the chain of chunks alone."""
        tokens, C = q.enc, q.chunk
        n_q = len(tokens) // TOKEN_BYTES
        best: _Candidate | None = None
        if chain:
            n = chain * C - (chain * C == n_q)
            if n > better_than:
                best = _Candidate(n, chain, None)
        for k, fields in zip(levels, hashes):
            if not isinstance(fields, dict):
                continue
            for i, (fname, fvalue) in enumerate(fields.items()):
                if i >= self.max_fields:
                    break
                got = self._field(q, k, chain, fname, fvalue)
                if got is not None and got.n > better_than and _better(got, best):
                    best = got
        return best

    def _field(self, q: Query, k: int, chain: int, fname: bytes, fvalue: bytes) -> _Candidate | None:
        """What one field of boundary ``k``'s hash offers the query, or None; a field that
        is not kvstore's is counted. A chunk field counts only where the chain ends (below,
        the chain itself is longer; beyond, its parent is out of reach) and only for a chunk
        that leaves the query inside it: 0 < m < C shared tokens, trimmed to k*C + m."""
        tokens, bounds, C = q.enc, q.bounds, q.chunk
        n_q, after = len(tokens) // TOKEN_BYTES, tokens[k * C * TOKEN_BYTES :]
        try:
            if values.is_chunk_field(fname):
                if k != chain:
                    return None
                cf = values.parse_chunk_field(fname, fvalue, C)
                if chunk_key(bounds[k], cf.tokens) != cf.key:
                    raise values.ValueFormatError("chunk field's key does not follow from its token ids")
                m = common_tokens(cf.tokens, after)
                return _Candidate(serves((k + 1) * C, k * C + m, n_q) or 0, k, cf.key, trim=True) if 0 < m < C else None
            f = values.parse_field(fname, fvalue, C)
        except values.ValueFormatError:
            self._count("bad_fields")
            return None
        m, r = common_tokens(f.residual, after), len(f.residual) // TOKEN_BYTES
        if k * C + r == 0 or (f.chunked and k > chain):
            return None
        n = serves(k * C + r, k * C + m, n_q, f.trimmable) or 0
        return _Candidate(n, k, f.key, f.chunked)

    def _fetch(self, q: Query, held: set[bytes],
               best: _Candidate, better_than: int, until: float, moving: float | None = None) -> Found | None:
        """Round trip 2: the candidate's values, verified; a rejected or missing entry or
        chunk to trim falls back to the verified chain of chunks, a rejected chunk cuts
        the chain."""
        identity, tokens, bounds, C = q.digest, q.enc, q.bounds, q.chunk
        wanted = [j for j in range(1, best.k + 1) if bounds[j] not in held] if best.chunked else []
        names = [self.name("chunk", bounds[j], identity) for j in wanted]
        if best.key is not None:
            names.append(self.name("chunk" if best.trim else "entry", best.key, identity))
        t0, tally = time.monotonic(), Tally()
        got = self.bulk.read_values(names, self.max_value_bytes, until, values.segment_offset, tally)
        if got is None:
            self._late(until, t0, moving, tally.n)
            return None
        nbytes = sum(len(v.data) for v in got if v is not None)
        self.link.transfer(identity, nbytes, len(wanted) * C + _value_tokens(best, C), time.monotonic() - t0)
        if self.secret is not None:  # every tag at once, in parallel; each value is judged where it is parsed
            got = signing.unseal_all(self.secret, names, got)
        pieces, chain = self._chain(q, best.k, dict(zip(wanted, got)), held)
        if best.key is not None and (chain == best.k or not best.chunked):
            if best.trim:
                found = self._trimmed(q, best, got[-1], pieces, better_than)
            else:
                found = self._entry(q, best, got[-1], pieces, better_than)
            if found is not None:
                return found
            if got[-1] is not None and len(got[-1].data) == 0:  # its field outlived it: lookups would keep choosing it
                self._forget(identity, bounds[best.k], best)
        n = chain * C - (chain * C == len(tokens) // TOKEN_BYTES)
        if chain == 0 or n <= better_than or not pieces:
            return None
        return _whole(identity, bounds[1 : chain + 1], tokens[: chain * C * TOKEN_BYTES], C, pieces, n)

    def _chain(self, q: Query, k: int, fetched: dict[int, Any], held: set[bytes]) -> tuple[list[ChunkPiece], int]:
        """The verified chain up to boundary ``k``: its chunks not held locally, read in
        round trip 2, and the boundary where it ends (before the first missing or rejected
        chunk)."""
        identity, tokens, bounds, C = q.digest, q.enc, q.bounds, q.chunk
        pieces: list[ChunkPiece] = []
        for j in range(1, k + 1):
            if bounds[j] in held:
                continue
            want = tokens[(j - 1) * C * TOKEN_BYTES : j * C * TOKEN_BYTES]
            piece = self._chunk(identity, C, bounds[j - 1], bounds[j], want, fetched[j]) if j in fetched else None
            if piece is None:
                return pieces, j - 1
            pieces.append(piece)
        return pieces, k

    def _chunk(self, identity: bytes, C: int, parent: bytes, key: bytes, want: bytes | None,
               data: Any) -> ChunkPiece | None:
        """Chunk ``key`` after boundary ``parent`` from its value, or None (missing or
        rejected, counted): this identity's, C tokens whose chained key is ``key``, and
        (``want``) exactly the query's token ids, or any (a chunk to trim: the publisher's)."""
        name = self.name("chunk", key, identity)
        if not self._present(data):
            return None
        try:
            v = values.parse_chunk(*self._unseal(name, data))
            rec = v.record
            if not isinstance(rec, ChunkRecord) or rec.identity != identity or rec.parent != parent \
                    or rec.n != C or (want is not None and v.tokens != want) or chunk_key(parent, v.tokens) != key:
                raise values.ValueFormatError("chunk is not the one asked for (identity, parent or token ids)")
        except values.ValueFormatError as e:
            self._reject(name, data, e)
            return None
        return key, rec, v.tokens, v.segment

    def _trimmed(self, q: Query, best: _Candidate,
                 data: Any, pieces: list[ChunkPiece], better_than: int) -> Found | None:
        """The verified chain up to boundary ``best.k`` and the chunk to trim after it, as
        one entry of whole chunks holding the publisher's token ids (the local plan trims
        it to the common prefix); None if the chunk is missing, rejected or shares too
        little with the query. Its length is re-derived from the value's token ids."""
        identity, tokens, bounds, C = q.digest, q.enc, q.bounds, q.chunk
        assert best.key is not None
        k = best.k
        piece = self._chunk(identity, C, bounds[k], best.key, None, data)
        if piece is None:
            return None
        m = common_tokens(piece[2], tokens[k * C * TOKEN_BYTES :])
        n = serves((k + 1) * C, k * C + m, len(tokens) // TOKEN_BYTES, whole=False) or 0
        if m == 0 or n <= better_than:
            return None
        self._count("trim_hits")
        return _whole(identity, [*bounds[1 : k + 1], best.key], tokens[: k * C * TOKEN_BYTES] + piece[2], C,
                      [*pieces, piece], n)

    def _entry(self, q: Query, best: _Candidate, data: Any, pieces: list[ChunkPiece], better_than: int) -> Found | None:
        """The chosen entry from its value, or None (missing or rejected)."""
        identity, tokens, bounds, C = q.digest, q.enc, q.bounds, q.chunk
        assert best.key is not None
        name = self.name("entry", best.key, identity)
        if not self._present(data):
            return None
        try:
            v = values.parse_entry(*self._unseal(name, data))
            rec = v.record
            if not isinstance(rec, EntryRecord) or rec.identity != identity or rec.chunk != C \
                    or rec.chunked != best.chunked:
                raise values.ValueFormatError("entry of another identity or chunk size, or not as filed")
            eb = boundaries(bounds[0], v.tokens, C)
            if key_of(bounds[0], v.tokens, C) != best.key or rec.boundary != eb[-1] \
                    or len(eb) - 1 != best.k or eb[-1] != bounds[best.k] \
                    or rec.chunks != (tuple(eb[1:]) if rec.chunked else ()):
                raise values.ValueFormatError("entry keys do not follow from its token ids")
            if v.tokens[: best.k * C * TOKEN_BYTES] != tokens[: best.k * C * TOKEN_BYTES]:
                raise values.ValueFormatError("entry token ids differ from the query's before its boundary")
        except values.ValueFormatError as e:
            self._reject(name, data, e)
            return None
        n_q, m = len(tokens) // TOKEN_BYTES, common_tokens(v.tokens, tokens)
        n = serves(rec.n, m, n_q, rec.trimmable) or 0
        if n <= better_than:
            return None
        return Found(best.key, rec, v.tokens, pieces if rec.chunked else [], v.segment, n)

    def _unseal(self, name: str, data: Bulk) -> tuple[Any, None, tuple[int, bytes] | None]:
        """(value, now, digest) to parse: with a fleet secret the value without its tag
        once the tag is verified (``signing.BadSignature`` otherwise); the digest taken as
        it arrived covers the tag too then, so the segment is hashed again."""
        if self.secret is None:
            return data.data, None, _digest(data)
        if isinstance(data, signing.Checked):
            if data.error is not None:
                raise data.error
            return data.data, None, None
        return signing.unseal(self.secret, name, data.data), None, None

    def _present(self, data: Bulk | None) -> bool:
        """A value asked for in round trip 2 is there; one gone since it was named (evicted
        or deleted) is counted as missing."""
        if data is None:
            return False
        if len(data.data) == 0:
            self._count("missing")
            return False
        return True

    def _forget(self, identity: bytes, boundary: bytes, best: _Candidate) -> None:
        """Remove the field of a candidate whose value is gone, off the caller's thread (a
        later publish of the value writes the field again)."""
        assert best.key is not None
        hname = self.name("bounds", boundary, identity)
        field = values.chunk_field_name(best.key) if best.trim else best.key.hex()

        def drop() -> None:
            self.pub.run(lambda r: r.hdel(hname, field))

        self.publisher.submit(drop)

    def _reject(self, name: str, data: Bulk, err: Exception) -> None:
        """A value that failed verification: counted, and deleted by the publisher thread
        unless it may just be cut short by our own read bound."""
        if len(data.data) >= self.max_value_bytes:  # cut short by our read bound: too large, not bad
            self._count("too_large")
            return
        self._count("rejected")
        if isinstance(err, signing.BadSignature):
            self._count("bad_signature")
        log.debug("shared value %s rejected: %s", name, err)
        self.publisher.submit(lambda: self._count("deleted", self.pub.delete_many([name]) or 0))

    def drop(self, kind: str, key: bytes, identity: bytes) -> None:
        """Delete one value the caller found unusable after ``lookup`` (e.g. a segment
        whose header does not fit the model), off the caller's thread."""
        name = self.name(kind, key, identity)
        self._count("rejected")
        self.publisher.submit(lambda: self._count("deleted", self.pub.delete_many([name]) or 0))

    # -- publish -----------------------------------------------------------------------

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue a publish job on the publisher thread; False (counted) if the queue is full."""
        return self.publisher.submit(job)

    def publish(self, item: PublishItem) -> bool:
        """Publish one entry (see the module docstring for the order). True if the store
        holds it afterwards; False if a step failed (counted; nothing is retried)."""
        rec, ident = item.record, item.identity
        until = time.monotonic() + self.config.publish_deadline
        if self._stop_at is not None:  # closing: what is still queued is dropped
            self._count("publish_abandoned")
            return False
        if self._too_large(item):
            self._count("too_large")
            return self._published(False)
        ename = self.name("entry", item.key, ident)
        cnames = [self.name("chunk", ck, ident) for ck, _, _ in item.chunks]
        fields = _fields(self.prefix, item)
        got = self.pub.pipeline_read([("EXISTS", ename)] + [("EXISTS", c) for c in cnames]
                                     + [("HEXISTS", h, f) for h, f, _ in fields], until)
        if got is None:
            return self._published(False)
        chunks_there, fields_there = got[1 : 1 + len(cnames)], got[1 + len(cnames) :]
        if got[0] and all(chunks_there) and all(fields_there):
            self._count("publish_skipped")
            return True
        now = time.time()
        try:
            missing = [(c, piece) for c, piece, there in zip(cnames, item.chunks, chunks_there) if not there]
            if not self._put_chunks(missing, item.read, now, until):
                return self._published(False)
            if not got[0]:
                tail = item.read(rec.tail) if rec.tail is not None else b""
                clean = EntryRecord(rec.identity, rec.n, rec.chunk, rec.chunked, rec.trimmable, rec.boundary,
                                    rec.chunks, rec.tail, rec.cache_type, rec.created, rec.created)
                parts = signing.seal(self.secret, ename, values.entry_parts(clean, item.tokens, tail, now))
                wrote = self.pub.write_values([(ename, parts)], until=until)
                if not wrote or not wrote[0]:
                    return self._published(False)
        except Exception as e:  # a local segment that cannot be read (gc'd, damaged)
            log.debug("shared publish of %s skipped: %s", item.key.hex()[:12], e)
            return self._published(False)
        hashes: dict[str, dict[str, bytes]] = {}  # chunks' fields where absent, the entry's always
        for (h, f, value), there in zip(fields, [*fields_there[:-1], False]):
            if not there:
                hashes.setdefault(h, {})[f] = value
        return self._published(self.pub.hset_many(hashes, until=until))

    def _too_large(self, item: PublishItem) -> bool:
        """Whether a value of ``item`` would exceed the limit, from the records alone
        (nothing read, nothing built)."""
        limit = self.max_value_bytes
        if self._server_limit is None:  # once: the server's own bulk limit, if it says
            got = self.pub.run(lambda r: r.config_get("proto-max-bulk-len"), round_trips=0)  # once, like a handshake
            self._server_limit = _bulk_limit(got) or 0
        if self._server_limit:
            limit = min(limit, self._server_limit)
        rec = item.record
        sizes = [values.FRAME.size + len(c.to_bytes()) + len(t) + c.segment.length for _, c, t in item.chunks]
        sizes.append(values.FRAME.size + len(rec.to_bytes()) + len(item.tokens) + (rec.tail.length if rec.tail else 0))
        return max(sizes) + (signing.TAG_BYTES if self.secret else 0) > limit

    def _put_chunks(self, missing: list[tuple[str, tuple[bytes, ChunkRecord, bytes]]],
                    read: Callable[[Segment], bytes], now: float, until: float) -> bool:
        """SET NX the chunks, in pipelines of about PUBLISH_BATCH_BYTES; True if sent."""
        batch: list[tuple[str, list[bytes]]] = []
        size = 0
        for i, (cname, (_ck, crec, toks)) in enumerate(missing):
            value = signing.seal(self.secret, cname, values.chunk_parts(crec.with_refs(1), toks, read(crec.segment), now))
            batch.append((cname, value))
            size += sum(len(p) for p in value)
            if size >= PUBLISH_BATCH_BYTES or i == len(missing) - 1:
                wrote = self.pub.write_values(batch, nx=True, until=until)
                if wrote is None:
                    return False
                self._count("chunks_published", sum(wrote))
                batch, size = [], 0
        return True

    def _published(self, ok: bool) -> bool:
        self._count("published" if ok else "publish_failed")
        return ok

    # -- state -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``shared_*`` counters: this tier's, the client's (round trips, bytes, errors,
        breaker), and the publisher's queue (dropped publishes). No credentials."""
        with self._lock:
            s: dict[str, Any] = {f"shared_{k}": v for k, v in self._counts.items()}
        c, b, p = self.client.stats(), self.bulk.stats(), self.pub.stats()
        for k in ("round_trips", "calls", "skipped_calls", "bytes_in", "bytes_out", "errors", "breaker_opens"):
            s[f"shared_{k}"] = c[k] + b[k] + p[k]
        states = {c["breaker_state"], b["breaker_state"], p["breaker_state"]}
        s["shared_breaker_state"] = next((x for x in ("open", "half-open") if x in states), "closed")
        s["shared_server"] = c["server"]
        s["shared_publish_dropped"] = self.publisher.dropped
        s["shared_publish_queue"] = self.publisher.depth
        s["shared_link_bandwidth"] = self.link.bandwidth
        return s

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued publish has run, at most ``timeout`` seconds (None: the
        config's ``flush_deadline``)."""
        return self.publisher.flush(self.config.flush_deadline if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> None:
        """Run the queued publishes for at most ``flush_deadline`` (or ``timeout`` if
        shorter), then drop the rest (counted), abandon the one in flight, stop the
        publisher and drop the connections."""
        budget = self.config.flush_deadline if timeout is None else min(timeout, self.config.flush_deadline)
        self.publisher.flush(budget)
        self._stop_at = time.monotonic()
        self.pub.close()  # a publish still sending fails at once
        self.publisher.close(budget)
        self.client.close()
        self.bulk.close()
        self.pub.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n


def _fields(prefix: str, item: PublishItem) -> list[tuple[str, str, bytes]]:
    """(hash name, field, value) of every field an entry publishes: each of its chunks
    under its parent boundary (token ids), then the entry under its boundary."""
    ident, rec = item.identity, item.record
    out = [(values.name(prefix, "bounds", crec.parent, ident), values.chunk_field_name(ck), toks)
           for ck, crec, toks in item.chunks]
    out.append((values.name(prefix, "bounds", rec.boundary, ident), item.key.hex(),
                values.field_value(rec, residual(item.tokens, rec.chunk))))
    return out


def _digest(data: Bulk) -> tuple[int, bytes] | None:
    return None if data.offset is None or data.digest is None else (data.offset, data.digest)


def _bulk_limit(reply: Any) -> int | None:
    """``proto-max-bulk-len`` from a CONFIG GET reply (one server's dict, or a cluster's
    per-node dicts: the smallest), None when it could not be read."""
    if not isinstance(reply, dict):
        return None
    found = [reply] if "proto-max-bulk-len" in reply or b"proto-max-bulk-len" in reply else list(reply.values())
    limits = []
    for d in found:
        if isinstance(d, dict):
            v = d.get("proto-max-bulk-len", d.get(b"proto-max-bulk-len"))
            if isinstance(v, (bytes, str)) and v.isdigit():
                limits.append(int(v))
    return min(limits) if limits else None


def _value_tokens(best: _Candidate, C: int) -> int:
    """Tokens of KV in the candidate's own value (a chunk to trim, a tail, a snapshot)."""
    if best.key is None:
        return 0
    return C if best.trim else best.n - best.k * C if best.chunked else best.n


def _fits(size: Any, limit: int) -> bool:
    return isinstance(size, int) and 0 < size <= limit

