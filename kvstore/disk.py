"""The disk tier: safetensors blobs under ``blobs/``, named by the LMDB index under ``index/``.

Trimmable KV (every layer KVCache / QuantizedKVCache) is cut into fixed token chunks keyed
by the chained hash, so a shared prefix is stored once and a conversation that grows by a
turn writes only its new chunks, plus an exact tail for the last partial chunk. Everything
else (RotatingKVCache, ArraysCache, mixed layouts) is one snapshot taken at exactly the
prefix boundary.

Lookup walks the query's chunk boundaries through the index's ``bounds`` trie and returns a
``Plan``: the longest reusable prefix, from an entry (exact or shorter), or from a chunk
chain trimmed back to the common prefix. Every token of a plan is compared with the stored
token ids; no hash is trusted alone. Restore reads each blob once, checks its size and
checksum, and rebuilds caches. Any failure is a ``BlobError``; the store turns it into a
miss and drops the damaged record.
"""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import mlx.core as mx
import numpy as np

from . import blobs

if TYPE_CHECKING:
    from . import codec
from .identity import Identity
from .index import Index, Reader
from .keys import boundaries, chunk_key, encode_tokens, entry_key, root_key

log = logging.getLogger("kvstore")

# Blobs of one chunked restore read (and hashed) at a time, on reader threads: readinto
# and xxhash release the GIL, so reads overlap each other and the hashing. Warm reads are
# CPU-bound (copy + hash): more readers than cores only contend.
RESTORE_THREADS = max(2, min(4, os.cpu_count() or 2))


@dataclass
class Plan:
    """What to read to restore ``n`` tokens of a query."""

    n: int                      # tokens the restored cache will hold
    chunks: list[bytes]         # full chunks to read, in order
    last: tuple[str, bytes] | None  # ("entry", key) or ("chunk", key): the final piece
    layout: codec.Layout        # layout of the final piece (offsets fixed at restore)
    stored_n: int               # tokens the final piece's source holds (before trimming)
    chunked: bool
    entry: bytes | None = None  # entry credited with the hit (for last_used / hits)
    cache_type: str = "assistant"  # the entry's cache type (kept when promoted to memory)


@dataclass
class PersistJob:
    """One cache snapshot to persist, prepared on the caller's thread."""

    identity: Identity
    tokens: bytes               # encoded token ids the cache covers
    tensors: dict[str, tuple[str, Any]]  # blobs.host_views(...)
    layout: codec.Layout
    cache_type: str = "assistant"
    created: float = field(default_factory=time.time)

    @property
    def n(self) -> int:
        return len(self.tokens) // 4


def _common(a: bytes, b: bytes) -> int:
    """Common prefix length, in tokens, of two encoded token strings."""
    n = min(len(a), len(b)) // 4
    if a[: n * 4] == b[: n * 4]:
        return n
    lo, hi = 0, n  # binary search on equal prefixes (bytes compare is fast)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * 4] == b[: mid * 4]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DiskTier:
    """Blobs + index of one cache directory."""

    def __init__(self, root: Path, *, chunk_tokens: int = 256, readonly: bool = False) -> None:
        self.root = Path(root)
        self.blob_root = self.root / "blobs"
        if not readonly:
            self.blob_root.mkdir(parents=True, exist_ok=True)
        self.index = Index(self.root / "index", readonly=readonly)
        # The chunk size is part of the directory's format (it places every key boundary):
        # the first opener fixes it, later openers use it whatever they ask for.
        stored = self.index.meta_setdefault(b"chunk_tokens", str(int(chunk_tokens)).encode())
        self.chunk = int(stored) if stored else int(chunk_tokens)
        if self.chunk != chunk_tokens:
            log.info("kvstore: %s uses chunk_tokens=%d (asked for %d)", self.root, self.chunk, chunk_tokens)

    def close(self) -> None:
        self.index.close()

    # -- lookup ------------------------------------------------------------------------

    def plan(self, ident: Identity, tokens: list[int] | bytes) -> Plan | None:
        """The longest reusable stored prefix of ``tokens`` for ``ident``, or None.

        One read transaction. First the chain of stored full chunks matching the query is
        followed as far as it goes; then the boundaries from the deepest down to the end of
        that chain are searched for entries (and, at the chain's end, a chunk to trim),
        stopping as soon as nothing shallower can be longer. Each boundary costs a few
        seeks however many children it has (``Reader.edges``)."""
        enc = tokens if isinstance(tokens, bytes) else encode_tokens(tokens)
        bounds = boundaries(root_key(ident.digest), enc, self.chunk)
        return self.index.view(lambda r: _plan(r, ident, enc, bounds, self.chunk))

    # -- restore -----------------------------------------------------------------------

    def _open(self, rec: dict | None, kind: str, key: bytes) -> blobs.Blob:
        """A record's blob, opened: size checked, header parsed, nothing verified yet."""
        with _blame(kind, key):
            if rec is None:
                raise blobs.BlobError(f"{kind} {key.hex()} vanished from the index")
            return blobs.Blob(self.blob_root / rec["blob"], rec["size"], rec["checksum"])

    def _read(self, rec: dict | None, kind: str, key: bytes, layout: codec.Layout | None = None,
              exact: bool = False, *, blob: blobs.Blob | None = None,
              into: dict[str, tuple[str, np.ndarray]] | None = None) -> dict[str, mx.array] | None:
        """One record's verified blob; a BlobError names the record (``err.record``).

        Returns fresh arrays; with ``into`` (see ``Blob.read_into``: numpy only, any thread)
        the tensors are read straight into those destinations and nothing is returned.
        ``blob``: the record's blob if ``_open`` already opened it.

        The blob's own (checksummed) metadata must agree with the index record that led to
        it: its key, its kind and, when ``layout`` is given, the layout the restore will use
        (``exact``: offsets too). LMDB has no checksums, so a flipped record must not be
        able to reinterpret a good blob."""
        from . import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up
        blob = blob or self._open(rec, kind, key)
        with _blame(kind, key):
            try:
                tensors = blob.read() if into is None else blob.read_into(into)
            finally:
                blob.close()
            meta = blob.meta
            want_kind = "chunk" if kind == "chunk" else rec.get("kind")  # type: ignore[union-attr]
            if meta.get("kvstore.key", key.hex()) != key.hex() or meta.get("kvstore.kind", want_kind) != want_kind:
                raise blobs.BlobError(f"{kind} {key.hex()}: the blob is {meta.get('kvstore.kind')} "
                                      f"{meta.get('kvstore.key')}, not what the index record says")
            if layout is not None and "kvstore.layout" in meta:
                stored = json.loads(meta["kvstore.layout"])
                same = (stored == layout) if exact else (
                    codec.layout_signature(stored) == codec.layout_signature(layout))
                if not same:
                    raise blobs.BlobError(f"{kind} {key.hex()}: the index record's layout differs from the blob's")
        return tensors

    def _read_tokens(self, pieces: list[tuple[dict | None, str, bytes, codec.Layout | None]],
                     n_chunks: int, total: int) -> dict[str, mx.array]:
        """A chunked cache's pieces (``n_chunks`` full chunks, then maybe a tail) read
        straight into arrays allocated once for ``total`` tokens: each blob lands in its
        token slice, a few blobs at a time on reader threads, each verified as it is read.
        Returns only when every piece verified; on a BlobError the arrays are dropped (no
        reader is still running then)."""
        spans, a = [], 0
        for i in range(len(pieces)):
            b = a + self.chunk if i < n_chunks else total
            if b <= a or b > total:
                raise blobs.BlobError(f"a chunked record of {total} tokens has {n_chunks} chunks and a tail")
            spans.append((a, b))
            a = b
        if a != total:
            raise blobs.BlobError(f"the pieces of a chunked record hold {a} tokens, not {total}")
        first = self._open(*pieces[0][:3])
        try:
            with _blame(*pieces[0][1:3]):  # shapes come from the first header (checked as it is read)
                t0 = spans[0][1] - spans[0][0]
                if any(len(shape) < 2 or shape[-2] != t0 for _, shape in first.specs.values()):
                    raise blobs.BlobError(f"{first.path.name}: tensors do not hold {t0} tokens")
                specs = {name: (st, (*shape[:-2], total, shape[-1])) for name, (st, shape) in first.specs.items()}
                arrays, hosts = blobs.empty(specs)

            def read(i: int) -> None:
                rec, kind, key, layout = pieces[i]
                lo, hi = spans[i]
                self._read(rec, kind, key, layout, blob=first if i == 0 else None,
                           into={name: (specs[name][0], h[..., lo:hi, :]) for name, h in hosts.items()})

            if len(pieces) == 1:
                read(0)
            else:
                with ThreadPoolExecutor(min(RESTORE_THREADS, len(pieces)), "kvstore-restore") as pool:
                    futures = [pool.submit(read, i) for i in range(len(pieces))]
                    try:
                        for f in futures:
                            f.result()
                    except BaseException:
                        for f in futures:
                            f.cancel()
                        raise  # after the pool's exit has waited for the running readers
        finally:
            first.close()
        return {name: blobs.finish(specs[name][0], x) for name, x in arrays.items()}

    def restore(self, plan: Plan) -> tuple[list[Any], int]:
        """Read a plan's blobs (verified) and build live cache objects holding ``plan.n``
        tokens. Raises BlobError / codec.Unsupported on anything unexpected."""
        from . import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up
        pieces: list[tuple[dict | None, str, bytes, codec.Layout | None]] = [
            (self.index.chunk(ck), "chunk", ck, None) for ck in plan.chunks]
        kind, key = plan.last  # type: ignore[misc]
        rec = self.index.entry(key) if kind == "entry" else self.index.chunk(key)
        if rec is None or rec.get("blob") is not None:
            pieces.append((rec, kind, key, plan.layout))
        elif not (plan.chunked and pieces and plan.stored_n == len(pieces) * self.chunk):
            # only a chunked entry of whole chunks has no tail
            raise blobs.BlobError(f"{kind} {key.hex()} names no blob")
        if plan.chunked:
            tensors = self._read_tokens(pieces, len(plan.chunks), plan.stored_n)
            tensors = codec.slice_tokens(tensors, 0, plan.n)
            cache = codec.decode_cache(tensors, codec.with_offset(plan.layout, plan.n))
        else:
            cache = codec.decode_cache(self._read(rec, kind, key, plan.layout, exact=True), plan.layout)
            if plan.n < plan.stored_n:
                if not codec.trimmable(cache):
                    raise blobs.BlobError("stored snapshot cannot be trimmed")
                for c in cache:
                    c.trim(plan.stored_n - plan.n)
        _check_restored(cache, plan.n)
        mx.eval([v for layer in cache for v in _arrays(layer)])
        return cache, plan.n

    # -- persist -----------------------------------------------------------------------

    def _write(self, key: bytes, tensors: dict, meta: dict[str, str]) -> dict:
        path = blobs.blob_path(self.blob_root, key.hex())
        path.parent.mkdir(exist_ok=True)
        size, checksum = blobs.write_blob(path, tensors, meta)
        return {"blob": str(path.relative_to(self.blob_root)), "size": size, "checksum": checksum}

    def persist(self, job: PersistJob) -> int:
        """Write a job's blobs and commit its entry; returns bytes written (0 if the entry
        already existed). Raises OSError on a failed write (nothing is indexed then)."""
        from . import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up
        ident, enc, C = job.identity, job.tokens, self.chunk
        n = job.n
        root = root_key(ident.digest)
        bounds = boundaries(root, enc, C)
        chunked = codec.is_chunkable(job.layout, n)
        K = len(bounds) - 1 if chunked else 0
        boundary = bounds[-1]
        key = entry_key(boundary, enc[(len(bounds) - 1) * C * 4 :])
        if self.index.entry(key) is not None:
            return 0
        meta = {"kvstore.format": "1", "kvstore.identity": ident.hex}
        # numpy views of the caller's evaluated arrays: no MLX op runs on this thread
        host = {nm: (st, np.asarray(a)) for nm, (st, a) in job.tensors.items()}
        chunk_layout = json.dumps(codec.with_offset(job.layout, C)) if chunked else ""
        written = 0
        for attempt in range(3):
            new_chunks: dict[bytes, tuple[dict, bytes, bytes]] = {}
            reused: list[bytes] = []
            new_files: list[str] = []
            try:
                for k in range(K):
                    ck = bounds[k + 1]
                    if self.index.chunk(ck) is not None and attempt == 0:
                        reused.append(ck)
                        continue
                    t = {nm: (st, a[..., k * C : (k + 1) * C, :]) for nm, (st, a) in host.items()}
                    rec = self._write(ck, t, dict(meta, **{"kvstore.kind": "chunk", "kvstore.key": ck.hex(),
                                                          "kvstore.tokens": f"{k * C}-{(k + 1) * C}",
                                                          "kvstore.layout": chunk_layout}))
                    new_files.append(rec["blob"])
                    written += rec["size"]
                    rec.update(identity=ident.hex, parent=bounds[k].hex(), n=C,
                               layout=codec.with_offset(job.layout, C))
                    new_chunks[ck] = (rec, enc[k * C * 4 : (k + 1) * C * 4], bounds[k])
                record: dict[str, Any] = {
                    "identity": ident.hex, "n": n, "kind": "chunked" if chunked else "snapshot",
                    "chunk": C, "chunks": [bounds[k + 1].hex() for k in range(K)],
                    "root": root.hex(), "boundary": boundary.hex(),
                    "trimmable": chunked or _layout_trimmable(job.layout, n),
                    "layout": job.layout, "cache_type": job.cache_type,
                    "created": job.created, "last_used": job.created, "hits": 0, "pinned": False,
                    "blob": None, "size": 0, "checksum": None,
                }
                if not chunked or n > K * C:
                    tail = host if not chunked else {
                        nm: (st, a[..., K * C : n, :]) for nm, (st, a) in host.items()}
                    layout = job.layout if not chunked else codec.with_offset(job.layout, n - K * C)
                    rec = self._write(key, tail, dict(meta, **{"kvstore.kind": record["kind"],
                                                              "kvstore.key": key.hex(),
                                                              "kvstore.tokens": f"{K * C}-{n}",
                                                              "kvstore.layout": json.dumps(layout)}))
                    new_files.append(rec["blob"])
                    written += rec["size"]
                    record.update(rec)
                    if chunked:
                        record["tail_layout"] = layout
                status = self.index.commit_entry(key, record, enc, boundary, new_chunks, reused)
            except BaseException:
                self._unlink(new_files)
                raise
            if status == "ok":
                self._unlink(record.get("_dup_blobs", []))
                return written
            self._unlink(new_files)
            if status == "exists":
                return 0
            # "retry": a reused chunk vanished under a concurrent gc; write them all now
        raise OSError("could not commit entry: chunks kept vanishing under a concurrent gc")

    def _unlink(self, rel_paths: list[str]) -> None:
        for rel in rel_paths:
            try:
                os.unlink(self.blob_root / rel)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("kvstore: could not remove blob %s: %s", rel, e)

    def remove(self, keys: list[bytes], *, only_if: Callable[[bytes, dict], bool] | None = None,
               removed: list[bytes] | None = None) -> int:
        """Drop entries and their unreferenced chunks in one transaction (see
        ``Index.remove_entries``); blobs go after the commit. Returns blobs unlinked."""
        rels = self.index.remove_entries(keys, only_if=only_if, removed=removed)
        self._unlink(rels)
        return len(rels)

    def drop_chunk(self, key: bytes) -> None:
        self._unlink(self.index.drop_chunk_orphans([key]))

    def drop_chunk_and_users(self, key: bytes) -> None:
        """Drop a damaged chunk and every entry built on it (none of them can be restored):
        no entry record is left naming a chunk that is gone, so rewriting one of those
        entries stores it whole again."""
        k = key.hex()
        users = [ek for ek, rec in self.index.entries() if k in rec.get("chunks", ())]
        rels = self.index.remove_entries(users) if users else []
        self._unlink(rels + self.index.drop_chunk_orphans([key]))


def _plan(r: Reader, ident: Identity, enc: bytes, bounds: list[bytes], C: int) -> Plan | None:
    n_q = len(enc) // 4
    # Full chunks whose stored token ids equal the query's. Their keys chain from the
    # identity's root, so a chunk found under the query's own boundary is this identity's.
    chain: list[bytes] = []
    for k in range(1, len(bounds)):
        if r.chunk(bounds[k]) is None or r.tokens(bounds[k]) != enc[(k - 1) * C * 4 : k * C * 4]:
            break
        chain.append(bounds[k])
    best: Plan | None = None
    last = r.chunk(chain[-1]) if chain else None
    if last is not None and isinstance(last.get("layout"), list):
        # the chain alone is reusable (keeping one token to feed when it is all)
        n = len(chain) * C
        best = Plan(n - 1 if n == n_q else n, chain[:-1], ("chunk", chain[-1]), last["layout"], n, True)
    for k in range(len(bounds) - 1, len(chain) - 1, -1):
        if best is not None and best.n >= (k + 1) * C:
            break  # everything filed at boundary k or above holds fewer tokens
        after = enc[k * C * 4 : (k + 1) * C * 4]
        for child, kind, shared, exact in r.edges(bounds[k], after):
            top = k * C + shared if exact else min(k * C + shared, n_q - 1)
            if best is not None and top <= best.n:
                break  # what follows shares no more (Reader.edges), so it cannot do better
            got = _candidate(r, ident, enc, bounds[k], k, child, kind, chain, C, best.n if best else 0)
            if got is not None and (best is None or got.n > best.n):
                best = got
    return best


def _candidate(r: Reader, ident: Identity, enc: bytes, boundary: bytes, k: int, child: bytes, kind: str,
               chain: list[bytes], C: int, beat: int) -> Plan | None:
    """What one child of boundary ``k`` can restore for the query if it is more than
    ``beat`` tokens, else None. Chunked pieces need the verified chain up to ``k``; the
    stored token ids decide every length (compared first: the cheap test)."""
    n_q = len(enc) // 4
    stored = r.tokens(child)
    if stored is None or len(stored) % 4:
        return None
    if kind == "e":
        n_e = len(stored) // 4
        common = _common(stored, enc)
        if (n_e if common == n_e else min(common, n_q - 1)) <= beat:
            return None
        if not _keyed(boundary, k, child, kind, stored, C):
            return None
        rec = r.entry(child)
        if rec is None or rec.get("identity") != ident.hex or not isinstance(rec.get("layout"), list):
            return None
        chunked = rec.get("kind") == "chunked"
        if chunked and k > len(chain):
            return None
        usable = n_e if common == n_e else (min(common, n_q - 1) if rec.get("trimmable") else 0)
        if usable <= 0:
            return None
        return Plan(usable, chain[:k] if chunked else [], ("entry", child), rec["layout"], n_e, chunked,
                    entry=child, cache_type=rec.get("cache_type") or "assistant")
    if kind != "c" or k != len(chain):
        return None
    m = _common(stored, enc[k * C * 4 :])
    if min(k * C + m, n_q - 1) <= beat or not _keyed(boundary, k, child, kind, stored, C):
        return None
    crec = r.chunk(child)
    if m <= 0 or crec is None or crec.get("identity") != ident.hex or not isinstance(crec.get("layout"), list):
        return None
    return Plan(min(k * C + m, n_q - 1), chain[:k], ("chunk", child), crec["layout"], (k + 1) * C, True)


def _keyed(boundary: bytes, k: int, child: bytes, kind: str, stored: bytes, C: int) -> bool:
    """The stored token ids hash to the key they are filed under. Token ids are what every
    hit is checked against, so a damaged (or foreign) token record must not be trusted: a
    flip in an entry's last partial chunk would otherwise serve its KV to another prompt."""
    if len(stored) % 4:
        return False
    if kind == "e":
        return len(stored) // 4 // C == k and entry_key(boundary, stored[k * C * 4 :]) == child
    return len(stored) == C * 4 and chunk_key(boundary, stored) == child


@contextmanager
def _blame(kind: str, key: bytes) -> Iterator[None]:
    """Any failure in the block becomes a BlobError naming the record (``err.record``)."""
    try:
        yield
    except blobs.BlobError as e:
        e.record = (kind, key)
        raise
    except (KeyError, TypeError, ValueError) as e:  # an unusable record
        err = blobs.BlobError(f"{kind} {key.hex()}: damaged index record ({e!r})")
        err.record = (kind, key)
        raise err from None


def _check_restored(cache: list[Any], n: int) -> None:
    """A restored cache holds exactly ``n`` positions: every layer that counts its
    positions says ``n``, and KV arrays hold them (a damaged layout must not pass)."""
    for i, layer in enumerate(_flat(cache)):
        off = getattr(layer, "offset", None)
        if isinstance(off, int) and off != n:
            raise blobs.BlobError(f"restored layer {i} holds {off} positions, not {n}")
        keys = getattr(layer, "keys", None)
        if type(layer).__name__ in ("KVCache", "QuantizedKVCache") and keys is not None:
            k = keys[0] if isinstance(keys, (tuple, list)) else keys
            if k.shape[-2] < n:
                raise blobs.BlobError(f"restored layer {i} has arrays for {k.shape[-2]} positions, not {n}")


def _flat(cache: list[Any]) -> list[Any]:
    out: list[Any] = []
    for c in cache:
        subs = getattr(c, "caches", None)
        out.extend(_flat(list(subs)) if isinstance(subs, (list, tuple)) else [c])
    return out


def _layout_trimmable(layout: codec.Layout, n: int) -> bool:
    """Whether a snapshot can be trimmed to a shorter prefix after restore (mlx-lm's
    ``is_trimmable`` for the classes involved, decided from the stored layout)."""
    from . import codec  # lazy: keeps mlx_lm (3 s) out of CLI start-up
    flat = codec._walk(layout)
    for m in flat:
        cls = m["class"]
        if cls in ("KVCache", "QuantizedKVCache", "ChunkedKVCache"):
            continue
        if cls == "RotatingKVCache" and m["offset"] < m["max_size"]:
            continue
        return False
    return True


def _arrays(layer: Any) -> list[mx.array]:
    out: list[mx.array] = []
    for v in (getattr(layer, "keys", None), getattr(layer, "values", None)):
        if isinstance(v, mx.array):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out.extend(x for x in v if isinstance(x, mx.array))
    for x in getattr(layer, "cache", None) or []:
        if isinstance(x, mx.array):
            out.append(x)
    for sub in getattr(layer, "caches", None) or []:
        out.extend(_arrays(sub))
    return out
