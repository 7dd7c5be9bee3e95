"""KVStore: one lookup over the memory tier and the disk tier.

``fetch`` returns the longest reusable prefix from either tier as fresh cache objects;
``insert`` keeps a snapshot in memory and queues it for the disk (write-behind). A disk
problem of any kind (missing, truncated, corrupt or foreign blob, a failed write, a full
disk) costs at most a miss: it is counted, logged once, and never raised to the caller.
Bad *input* (tokens that are not token ids, a cache longer than its tokens) raises
``ValueError`` naming the problem, and changes nothing.

Thread-safe: one lock guards the memory tier; disk reads run outside it; one writer thread
owns disk writes. Several processes may share a cache directory (LMDB locking, unique blob
names, commit-after-fsync).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable

import lmdb
import mlx.core as mx

from . import blobs, codec
from .disk import DiskTier, PersistJob
from .identity import DigestMemo, Identity, describe_layout, model_identity, watch
from .keys import TokenError, encode_tokens, key_of, root_key
from .memory import MemoryTier, Snapshot
from .writer import Writer

log = logging.getLogger("kvstore")


def default_cache_dir() -> Path:
    """``$KVSTORE_DIR`` if set, else the platform's user cache dir (``.../kvstore/cache``)."""
    env = os.environ.get("KVSTORE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore")) / "cache"


class StoreOpenError(RuntimeError):
    """The cache directory cannot be used; the message says why and what to do."""


@dataclass
class Fetched:
    """Result of a lookup: a fresh cache holding ``n`` tokens (or None), and its tier."""

    cache: list[Any] | None
    n: int
    source: str | None  # "memory", "disk" or None


_STAT_KEYS = ("hits_memory", "hits_disk", "misses", "tokens_saved", "bytes_read",
              "bytes_written", "restore_seconds", "restores", "write_seconds", "writes",
              "corrupt", "races", "write_errors", "unpersistable", "warnings_suppressed")


class KVStore:
    """A two-tier prefix cache for mlx-lm prompt caches.

    ``model`` arguments may be an ``Identity``, a model directory, or mlx-lm's server key
    ``(model path, adapter path, draft model path)``; a key that cannot be resolved to
    files on disk is served from memory only. ``kv_bits`` / ``kv_group_size`` name the KV
    quantisation the engine runs with (it is part of every identity this store resolves).
    """

    def __init__(
        self,
        cache_dir: str | Path | None = None,
        *,
        max_entries: int = 10,
        max_bytes: int = 1 << 63,
        max_disk_bytes: int | None = None,
        chunk_tokens: int = 256,
        queue_size: int = 16,
        touch_on_hit: bool = True,
        memory_only: bool = False,
        on_disk_error: str = "raise",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ) -> None:
        self.memory = MemoryTier(max_entries, max_bytes, touch_on_hit=touch_on_hit)
        self.max_disk_bytes = max_disk_bytes
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._lock = threading.RLock()
        self._stats = {k: 0 for k in _STAT_KEYS}
        self._stats["restore_seconds"] = 0.0
        self._stats["write_seconds"] = 0.0
        self._idents: dict[Hashable, tuple[Identity | None, tuple | None, tuple | None]] = {}
        self._vocab: dict[bytes, int | None] = {}
        self._kv_quant = (kv_bits, kv_group_size if kv_bits else None)
        self._warned: set[str] = set()
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._touch_scheduled = False
        self.disk: DiskTier | None = None
        self._disk_off: str | None = None  # why the disk tier was switched off (a damaged index)
        if not memory_only:
            try:
                self.disk = _open_disk(self.cache_dir, chunk_tokens)
            except StoreOpenError as e:
                if on_disk_error != "memory":
                    raise
                log.warning("kvstore: %s; serving from memory only", e)
        self.memo = DigestMemo(self.cache_dir / "file-digests.json" if self.disk else None)
        self.writer = Writer(queue_size) if self.disk else None
        _open_stores.add(self)

    # -- identity ----------------------------------------------------------------------

    def identity(self, model: Any) -> Identity | None:
        """Map a model key to its identity; None if it names no local files.

        Remembered per key, and re-derived when any file it was derived from changed
        (``identity.watch``: a few stat calls on every use), so weights replaced in place
        (even under their old mtime) or a model directory swapped under a running server
        never restore the old model's KV."""
        if isinstance(model, Identity):
            return model
        try:
            key: Hashable = model if isinstance(model, Hashable) else repr(model)
        except TypeError:
            key = repr(model)
        known = self._idents.get(key)
        if known is not None:
            ident, dirs, stamp = known
            if dirs is None or watch(*dirs) == stamp:
                return ident
        ident, dirs, stamp = None, None, None
        try:
            parts = list(model) if isinstance(model, (tuple, list)) else [model]
            parts += [None] * (3 - len(parts))
            path, adapter, draft = (_local_path(p) if p is not None else None for p in parts[:3])
            if path is not None:
                dirs = (path, adapter, draft)
                stamp = watch(*dirs)
                ident = model_identity(path, adapter_path=adapter, draft_path=draft, memo=self.memo,
                                       kv_bits=self._kv_quant[0], kv_group_size=self._kv_quant[1])
                if self.disk is not None:
                    self.disk.index.put_identity(ident.digest, ident.info)
        except Exception as e:  # unresolvable: memory only, said once
            self._warn_once("identity", "kvstore: no identity for model %r (%s); memory only", model, e)
        if ident is None:
            dirs = None
            self._warn_once("identity", "kvstore: model %r is not a local directory; memory only", model)
        self._idents[key] = (ident, dirs, stamp)
        return ident

    def _vocab_size(self, ident: Identity) -> int | None:
        """The model's vocabulary size from its config.json (None when unknown)."""
        cached = self._vocab.get(ident.digest, False)
        if cached is not False:
            return cached  # type: ignore[return-value]
        vocab = None
        path = ident.info.get("path")
        if path:
            try:
                import json
                cfg = json.loads((Path(path) / "config.json").read_text())
                v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
                vocab = int(v) if v else None
            except (OSError, ValueError, TypeError, AttributeError):
                vocab = None
        self._vocab[ident.digest] = vocab
        return vocab

    def register(self, model: Hashable, identity: Identity) -> None:
        """Use ``identity`` for ``model`` (engines whose key is not a path)."""
        self._idents[model] = (identity, None, None)
        if self.disk is not None:
            self.disk.index.put_identity(identity.digest, identity.info)

    def _mem_key(self, model: Any, ident: Identity | None) -> Hashable:
        return ident.digest if ident is not None else model

    # -- fetch -------------------------------------------------------------------------

    def fetch(self, model: Any, tokens: list[int]) -> Fetched:
        """The longest reusable prefix of ``tokens`` in memory or on disk.

        Raises ValueError (``keys.TokenError``) for token lists that are not token ids.
        """
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        ident = self.identity(model)
        mkey = self._mem_key(model, ident)
        with self._lock:
            cache, n = self.memory.lookup(mkey, tokens)
            snap = self.memory.get(mkey, tokens[:n]) if cache is not None else None
        if cache is not None:
            # A snapshot is keyed by the tokens it was inserted with; a cache that holds fewer
            # positions (mlx-lm's server inserts prompt + generated tokens with a cache that
            # has not seen the last one) serves only the prefix it holds.
            held = _held(cache)
            if held is not None and held < n:
                n = held
                if n <= 0:
                    cache, n = None, 0
        if cache is not None and n == len(tokens):
            self._hit("memory", n, snap)
            return Fetched(cache, n, "memory")
        if ident is not None and self.disk is not None and tokens and not self._disk_off:
            got = self._fetch_disk(ident, enc, better_than=n)
            if got is not None:
                return got
        if cache is not None:
            self._hit("memory", n, snap)
            return Fetched(cache, n, "memory")
        self._stats["misses"] += 1
        return Fetched(None, 0, None)

    def peek(self, model: Any, tokens: list[int]) -> int:
        """How many tokens ``fetch`` would restore now (memory or disk), reading no KV data
        and changing nothing. Engines use it to choose between competing snapshots."""
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        ident = self.identity(model)
        with self._lock:
            result = self.memory._trie.search(self._mem_key(model, ident), tokens)
        n = len(tokens) if result.exact is not None else len(result.shorter or [])
        if result.longer is not None and result.common_prefix > n:
            snap = self.memory.get(self._mem_key(model, ident), result.longer)
            if snap is not None and snap.trimmable:
                n = min(len(tokens) - 1, result.common_prefix)
        if n < len(tokens) and ident is not None and self.disk is not None and tokens and not self._disk_off:
            try:
                plan = self.disk.plan(ident, enc)
                n = max(n, plan.n if plan is not None else 0)
            except Exception:  # a disk problem is a miss, as in fetch
                pass
        return n

    def _fetch_disk(self, ident: Identity, enc: bytes, better_than: int) -> Fetched | None:
        assert self.disk is not None
        for _ in range(4):  # each failure drops a record; the next plan may still hit
            try:
                plan = self.disk.plan(ident, enc)
            except Exception as e:
                if not self._index_damaged(e):
                    self._warn_once("plan", "kvstore: disk lookup failed (%s); treating as a miss", e)
                return None
            if plan is None or plan.n <= better_than:
                return None
            t0 = time.perf_counter()
            try:
                cache, n = self.disk.restore(plan)
            except (blobs.BlobError, codec.Unsupported, KeyError, ValueError, OSError) as e:
                self._stats["corrupt"] += 1
                self._warn_once("damaged", "kvstore: dropping damaged entry: %s", e)
                self._drop(plan, e)
                continue
            except Exception as e:  # a defect, not damage: still a miss, never a crash
                self._stats["corrupt"] += 1
                if self._index_damaged(e):
                    return None
                if "bug" not in self._warned:
                    self._warned.add("bug")
                    log.exception("kvstore: unexpected error restoring an entry (a kvstore bug: please report)")
                self._drop(plan, e)
                continue
            tensors, layout = codec.encode_cache(cache)
            wrong = _layout_problem(ident, tensors, layout)
            if wrong is not None:  # insert refuses such caches: this one was not written by it
                self._stats["corrupt"] += 1
                self._warn_once("misfit", "kvstore: dropping an entry that does not fit its model: %s", wrong)
                self._drop(plan)
                continue
            dt = time.perf_counter() - t0
            self._stats["restore_seconds"] += dt
            self._stats["restores"] += 1
            self._stats["bytes_read"] += sum(int(a.nbytes) for c in cache for a in _layer_arrays(c))
            # promote: keep it hot, marked as already on disk
            ctype = plan.cache_type if plan.cache_type in self.memory.stats_by_type() else "assistant"
            snap = Snapshot(tensors, layout, None, codec.cache_nbytes(tensors),
                            codec.trimmable(cache), ctype, persisted=True)
            tokens = _decode(enc[: n * 4])
            snap.extra["disk_key"] = plan.entry
            with self._lock:
                evicted = self.memory.insert(ident.digest, tokens, snap)
            self._persist_evicted(evicted)
            self._hit("disk", n, snap)
            return Fetched(snap.materialize(), n, "disk")
        return None

    def _drop(self, plan: Any, err: Exception | None = None) -> None:
        assert self.disk is not None
        kind, key = plan.last
        bad = getattr(err, "record", None)  # the record whose blob failed, when known
        try:
            if bad is not None:
                if bad[0] == "entry":
                    self.disk.remove([bad[1]])
                else:
                    self.disk.drop_chunk_and_users(bad[1])
                return
            if kind == "entry":
                self.disk.remove([key])
            else:
                self.disk.drop_chunk(key)
            for ck in plan.chunks:  # a bad chunk in the chain: drop it (entries above go dead)
                rec = self.disk.index.chunk(ck)
                if rec is not None and not (self.disk.blob_root / rec["blob"]).exists():
                    self.disk.drop_chunk(ck)
        except Exception as e:
            self._warn_once("drop", "kvstore: could not drop damaged record: %s", e)

    def _hit(self, tier: str, n: int, snap: Snapshot | None) -> None:
        self._stats[f"hits_{tier}"] += 1
        self._stats["tokens_saved"] += n
        key = snap.extra.get("disk_key") if snap is not None else None
        if key is not None and self.writer is not None:
            with self._lock:
                when, hits = self._touches.get(key, (0.0, 0))
                self._touches[key] = (time.time(), hits + 1)
                schedule = not self._touch_scheduled
                self._touch_scheduled = True
            if schedule and not self.writer.submit(self._flush_touches):
                self._touch_scheduled = False

    def _flush_touches(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
            self._touch_scheduled = False
        if touches and self.disk is not None and not self._disk_off:
            try:
                self.disk.index.touch_many(touches)
            except lmdb.Error as e:  # bookkeeping only: a failed touch costs nothing else
                if not self._index_damaged(e):
                    self._warn_once("touch", "kvstore: could not record hits: %s", e)

    # -- insert ------------------------------------------------------------------------

    def insert(self, model: Any, tokens: list[int], cache: list[Any], *,
               cache_type: str = "assistant") -> None:
        """Keep ``cache`` (which holds ``tokens``) hot and queue it for disk; returns at once.

        Raises ValueError when the tokens are not token ids or the cache holds more
        positions than ``tokens``; nothing is stored then.
        """
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        if cache_type not in self.memory.stats_by_type():
            raise ValueError(f"cache_type must be one of {list(self.memory.stats_by_type())}, got {cache_type!r}")
        _check_cache(cache)
        ident = self.identity(model)
        if ident is not None and tokens:
            vocab = self._vocab_size(ident)
            top = max(tokens)
            if vocab is not None and top >= vocab:
                raise TokenError(f"token id {top} is out of the vocabulary of {ident.name} (vocab_size {vocab})")
        snap, covered = self._snapshot(cache, len(tokens), cache_type)
        wrong = (_layout_problem(ident, snap.tensors, snap.layout)
                 if ident is not None and snap.layout is not None and snap.tensors is not None else None)
        if wrong is not None:  # never stored on disk under this identity (memory is the caller's own)
            self._stats["unpersistable"] += 1
            self._warn_once("layout", "kvstore: %s; kept in memory only", wrong)
        elif (snap.tensors is not None and ident is not None and self.disk is not None and covered > 0
              and not self._disk_off):
            snap.extra["job"] = (ident, enc[: covered * 4])
            snap.persisted = self._submit(snap)
        with self._lock:
            evicted = self.memory.insert(self._mem_key(model, ident), tokens, snap)
        self._persist_evicted(evicted)

    def _snapshot(self, cache: list[Any], n_tokens: int, cache_type: str) -> tuple[Snapshot, int]:
        try:
            tensors, layout = codec.encode_cache(cache)
        except codec.Unsupported as e:
            self._stats["unpersistable"] += 1
            self._warn_once("unsupported", "kvstore: %s; kept in memory only", e)
            nbytes = sum(getattr(c, "nbytes", 0) for c in cache) if isinstance(cache, (list, tuple)) else 0
            trim = bool(cache) and all(getattr(c, "is_trimmable", lambda: False)() for c in cache)
            return Snapshot(None, None, cache, nbytes, trim, cache_type), 0
        offsets = [m["offset"] for m in codec._walk(layout) if "offset" in m]
        covered = min(offsets) if offsets else n_tokens
        if covered > n_tokens:
            raise ValueError(f"cache holds {covered} positions but only {n_tokens} tokens were given")
        if len(set(offsets)) > 1:
            raise ValueError(f"cache layers disagree on their length: {sorted(set(offsets))}")
        if not offsets:  # recurrent state only: it must be taken at the prefix boundary
            covered = n_tokens
        mx.eval(list(tensors.values()))  # views: free, and ready for the writer thread
        try:  # what the snapshot keeps alive: its views pin the whole allocated buffers,
            # which is also what mlx-lm's LRUPromptCache counts against max_bytes
            nbytes = int(sum(c.nbytes for c in cache))
        except Exception:
            nbytes = codec.cache_nbytes(tensors)
        snap = Snapshot(tensors, layout, None, nbytes, codec.trimmable(cache), cache_type)
        return snap, covered

    def _submit(self, snap: Snapshot) -> bool:
        assert self.writer is not None and snap.tensors is not None
        ident, enc = snap.extra["job"]
        try:
            host = blobs.host_views(snap.tensors)
        except TypeError as e:
            self._warn_once("dtype", "kvstore: %s; kept in memory only", e)
            return False
        job = PersistJob(ident, enc, host, snap.layout or [], snap.cache_type)
        snap.extra["disk_key"] = key_of(root_key(ident.digest), enc, self.disk.chunk) if self.disk else None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                written = self.disk.persist(job)  # type: ignore[union-attr]
            except (OSError, lmdb.Error) as e:  # blob write or index commit (full disk, I/O)
                self._stats["write_errors"] += 1
                if self._index_damaged(e):
                    return
                self._warn_once(f"write:{getattr(e, 'errno', type(e).__name__)}",
                                "kvstore: write failed (%s); entry stays in memory only", e)
                return
            self._stats["write_seconds"] += time.perf_counter() - t0
            self._stats["writes"] += 1
            self._stats["bytes_written"] += written
            if self.max_disk_bytes is not None and self.disk is not None:
                from .maintenance import evict_to
                evict_to(self.disk, self.max_disk_bytes)

        return self.writer.submit(run)

    def _persist_evicted(self, evicted: list) -> None:
        for _, _, snap in evicted:
            if not snap.persisted and "job" in snap.extra and self.writer is not None:
                snap.persisted = self._submit(snap)

    # -- limits, stats, lifecycle ------------------------------------------------------

    def trim_to(self, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        with self._lock:
            evicted = self.memory.trim_to(n_sequences, n_bytes)
        self._persist_evicted(evicted)

    def stats(self) -> dict[str, Any]:
        """Counters by tier, plus queue depth, dropped and failed writes, disk totals."""
        s: dict[str, Any] = dict(self._stats)
        s["memory_entries"] = len(self.memory)
        s["memory_bytes"] = self.memory.nbytes
        if self.writer is not None:
            s["queue_depth"] = self.writer.depth
            s["pending_writes"] = self.writer.pending
            s["dropped_writes"] = self.writer.dropped
        if self.disk is not None:
            s["cache_dir"] = str(self.cache_dir)
            try:
                if not self._disk_off:
                    s["disk_bytes"] = self.disk.index.total_bytes()
                    s.update({f"disk_{k}": v for k, v in self.disk.index.counts().items()})
            except lmdb.Error as e:
                self._index_damaged(e)
            if self._disk_off:
                s["disk_off"] = self._disk_off
        return s

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or failed)."""
        if self.writer is None:
            return True
        ok = self.writer.flush(timeout)
        if self._touches:
            self.writer.submit(self._flush_touches)
            ok = self.writer.flush(timeout) and ok
        return ok

    def close(self, timeout: float | None = None) -> None:
        """Flush the write-behind queue and release the index. Idempotent."""
        if self.writer is not None:
            self._persist_unwritten(timeout)
            self.flush(timeout)
            self.writer.close(timeout)
            self.writer = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        _open_stores.discard(self)

    def _persist_unwritten(self, timeout: float | None) -> None:
        """Queue the snapshots still in memory whose write was dropped (queue full): at
        close there is no generation left to hold up, so wait for room if needed."""
        assert self.writer is not None
        with self._lock:
            pending = [s for s in self.memory.snapshots() if not s.persisted and "job" in s.extra]
        for snap in pending:
            snap.persisted = self._submit(snap)
            if not snap.persisted:
                self.writer.flush(timeout)
                snap.persisted = self._submit(snap)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _index_damaged(self, e: BaseException) -> bool:
        """Switch the disk tier off for this process when LMDB reports a damaged file: LMDB
        has no checksums, and walking a damaged tree further can abort the process (an
        assertion in mdb.c) or fault on a wild page. Memory keeps serving."""
        if not isinstance(e, _INDEX_DAMAGE):
            return False
        if not self._disk_off:
            self._disk_off = f"{type(e).__name__}: {e}"
            log.error("kvstore: the index in %s is damaged (%s); the disk tier is off for this process, "
                      "memory keeps serving (`kvstore verify` reports the damage)", self.cache_dir, e)
        return True

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg`` the first time a problem of ``kind`` happens in this store; later
        ones are only counted (``stats()["warnings_suppressed"]``). Kinds are a fixed,
        small set, never built from data (a blob name, a record), so the set is bounded."""
        if kind in self._warned:
            self._stats["warnings_suppressed"] += 1
            return
        self._warned.add(kind)
        log.warning(msg, *args)


def _token_list(tokens: Any) -> list:
    try:
        return list(tokens)
    except TypeError:
        raise TokenError(f"tokens must be a sequence of integers, got {type(tokens).__name__}") from None


def _layers(cache: Any) -> list:
    """Cache layers, CacheList members flattened."""
    out: list = []
    for c in cache:
        subs = getattr(c, "caches", None)
        out.extend(_layers(subs) if isinstance(subs, (list, tuple)) else [c])
    return out


def _held(cache: Any) -> int | None:
    """Positions a live cache holds: the smallest integer ``offset`` of its layers."""
    if not isinstance(cache, (list, tuple)):
        return None
    offs = [c.offset for c in _layers(cache) if isinstance(getattr(c, "offset", None), int)]
    return min(offs) if offs else None


def _check_cache(cache: Any) -> None:
    """A prompt cache is a non-empty list of cache objects whose arrays hold what they claim."""
    if not isinstance(cache, (list, tuple)) or not cache:
        raise ValueError(f"cache must be a non-empty list of cache objects (one per layer), "
                         f"got {type(cache).__name__}{' (empty)' if isinstance(cache, (list, tuple)) else ''}")
    for i, c in enumerate(_layers(cache)):
        if not (hasattr(type(c), "state") or hasattr(c, "nbytes")) or isinstance(c, (int, float, str, bytes)):
            raise ValueError(f"cache layer {i} is a {type(c).__name__}, not a cache object")
        keys = getattr(c, "keys", None)
        off = getattr(c, "offset", None)
        if type(c).__name__ in ("KVCache", "QuantizedKVCache") and keys is not None and isinstance(off, int):
            k = keys[0] if isinstance(keys, (list, tuple)) else keys
            if k.shape[-2] < off:
                raise ValueError(f"cache layer {i} ({type(c).__name__}) claims {off} positions "
                                 f"but its arrays hold {k.shape[-2]}")


_INDEX_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError)

_KV_FAMILY = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache")


def _layout_problem(ident: Identity, tensors: codec.Tensors, layout: codec.Layout) -> str | None:
    """Why a cache does not fit the identity's model, or None: it must have the layers the
    model makes (same count; per layer the same class family: attention KV in any of its
    forms, or the same recurrent class) and, where the identity records it, each attention
    layer's KV geometry (heads and head_dim of keys and values, and dtype). Unknown (None)
    for identities without a layout component, or with a draft model (whose layers the
    engine appends); identities without geometry are checked on classes only."""
    comps = ident.info.get("components") or {}
    want = comps.get("layout")
    if not isinstance(want, list) or comps.get("draft"):
        return None

    def fam(m: dict) -> str:
        return "attention KV" if m.get("class") in _KV_FAMILY else str(m.get("class"))

    def diff(a: list, b: list, where: str) -> str | None:
        if len(a) != len(b):
            return f"cache has {len(a)} layers{where}, {ident.name} makes {len(b)} (a cache from another model?)"
        for i, (x, y) in enumerate(zip(a, b)):
            if fam(x) != fam(y):
                return (f"cache layer {i}{where} is {x.get('class')}, {ident.name} makes {y.get('class')} "
                        "(a cache from another model?)")
            d = _geometry_problem(x, y) if fam(x) == "attention KV" else None
            if d:
                return f"cache layer {i}{where} {d[0]}, {ident.name} makes {d[1]} (a cache from another model?)"
            if x.get("class") == "CacheList":
                d = diff(x.get("sub", []), y.get("sub", []), f" (in layer {i})")
                if d:
                    return d
        return None

    return diff(describe_layout(tensors, layout), want, "")


def _geometry_problem(got: dict, want: dict) -> tuple[str, str] | None:
    """(what the cache layer holds, what the model makes) when their recorded KV geometry
    differs; None when it agrees or either side does not record it (an empty layer, an
    identity without geometry or without dtype)."""
    if not all(isinstance(m.get(n), list) for m in (got, want) for n in ("k", "v")):
        return None
    if (got["k"], got["v"]) != (want["k"], want["v"]):
        return f"has {_shape_text(got, True)}", _shape_text(want, False)
    if got.get("dtype") and want.get("dtype") and got["dtype"] != want["dtype"]:
        return f"holds {got['dtype']} KV", want["dtype"]
    return None


def _shape_text(m: dict, long: bool) -> str:
    (kh, kd), (vh, vd) = m["k"], m["v"]
    if (kh, kd) == (vh, vd):
        return f"{kh} KV heads x head_dim {kd}" if long else f"{kh} x {kd}"
    return f"keys {kh} x {kd} and values {vh} x {vd}"


def _open_disk(path: Path, chunk_tokens: int) -> DiskTier:
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as e:  # ENAMETOOLONG, EACCES on a parent, ELOOP...: pathlib does not swallow these
        raise StoreOpenError(f"cannot use cache directory {path}: {e.strerror}") from None
    if is_file:
        raise StoreOpenError(f"cache path {path} is a file, not a directory: pass another --cache-dir")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreOpenError(f"cannot create cache directory {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreOpenError(f"cache directory {path} is not writable: fix its permissions or pass another --cache-dir")
    try:
        return DiskTier(path, chunk_tokens=chunk_tokens)
    except OSError as e:
        raise StoreOpenError(f"cannot open cache directory {path}: {e}") from None
    except Exception as e:
        raise StoreOpenError(f"cannot open index in {path}: {e}") from None


def _local_path(p: Any) -> Path | None:
    path = Path(str(p)).expanduser()
    if path.is_dir():
        return path
    try:  # a hub repo id already in the local hub cache
        from huggingface_hub import snapshot_download
        got = Path(snapshot_download(str(p), local_files_only=True))
        return got if got.is_dir() else None
    except Exception:
        return None


def _decode(enc: bytes) -> list[int]:
    from .keys import decode_tokens
    return decode_tokens(enc)


def _layer_arrays(layer: Any) -> list:
    from .disk import _arrays
    return _arrays(layer)


_open_stores: "weakref.WeakSet[KVStore]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # interpreter exit flushes the write-behind queue
    for store in list(_open_stores):
        try:
            store.close(timeout=60)
        except Exception:
            pass
