"""kvstore behind vllm-mlx's batched engine (``--continuous-batching``).

vllm-mlx (0.6) builds a ``MemoryAwarePrefixCache`` (vllm_mlx/memory_cache.py) in
``Scheduler.__init__`` (text models) and in ``MLLMBatchGenerator.__init__`` (multimodal),
both by the name they imported. ``install`` makes both build ``KVPrefixCache`` instead: a
subclass of vllm-mlx's own class, so its memory tier, matching, accounting, reservation,
stats and SSD hooks stay vllm-mlx's (its own tests run against it: tools/gates/upstream_vllm_mlx.py),
with kvstore's disk tier underneath:

- every entry vllm-mlx keeps is written through to disk (not only when the RAM LRU evicts
  it), by kvstore's writer thread, subject to ``persist`` and ``max_write_bytes_per_day``;
- the disk is consulted whenever it may hold a longer prefix than memory gave (a memory
  hit shorter than the prompt, or a miss), not only after a complete RAM miss; a disk hit
  is promoted into the memory tier (within its limit) and served as a ``"prefix"`` match;
- a disk hit never covers the whole prompt: a whole-prompt hit is trimmed by one token, so
  the last token is left to run (vllm-mlx drops an ``"exact"`` hit and prefills);
- the arrays go to disk from the snapshot vllm-mlx's ``store`` already evaluated on the
  thread that produced them; the writer thread only copies bytes (vllm-mlx #563: MLX >=
  0.31.2 aborts when a request's arrays are evaluated on another thread).

Identity: kvstore keys entries by the model's files. The model object vllm-mlx passes has
no path, so ``install`` records the path each model is loaded from (vllm-mlx's
``load_model_with_fallback``); ``model_path`` names one for models loaded otherwise. A
model with no known path gets vllm-mlx's behaviour, memory only (said once).

``--use-paged-cache`` (``BlockAwarePrefixCache``) is not covered: with kvstore installed
the scheduler refuses to start with it, naming the flag to drop.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any
from ..escape import logger
from ..options import VLLM_BATCHED, StoreOptions, store_changes

log = logger("kvstore")

_PATHS: dict[int, tuple[Any, str]] = {}    # id(model) -> (weak ref, path it was loaded from)
_OPTIONS: dict[str, Any] = {}              # install()'s: "store" (StoreOptions), "model_path"
_ORIGINALS: dict[tuple[Any, str], Any] = {}
PAGED_REFUSAL = ("kvstore does not cover vllm-mlx's paged cache (--use-paged-cache); drop "
                 "--use-paged-cache to use the memory-aware prefix cache with kvstore's disk tier")


def remember_model(model: Any, path: str | Path) -> None:
    """Record that ``model`` was loaded from ``path`` (its kvstore identity)."""
    key = id(model)
    try:
        ref: Any = weakref.ref(model, lambda _r: _PATHS.pop(key, None))
    except TypeError:  # not weak-referenceable: kept for the process's life
        ref = lambda: model  # noqa: E731
    _PATHS[key] = (ref, str(path))


def model_path_of(model: Any) -> str | None:
    """The path ``model`` (or the model a vllm-mlx wrapper holds) was loaded from."""
    for m in (model, getattr(model, "_model", None), getattr(model, "model", None)):
        if m is None:
            continue
        got = _PATHS.get(id(m))
        if got is not None and got[0]() is m:
            return got[1]
    return _OPTIONS.get("model_path")


if TYPE_CHECKING:  # the mixin's super() is vllm-mlx's class, known only at run time
    _Base = Any
else:
    _Base = object


def _base() -> type:
    from vllm_mlx.memory_cache import MemoryAwarePrefixCache

    return MemoryAwarePrefixCache


class _StoreBackedPrefixCache(_Base):
    """vllm-mlx's ``MemoryAwarePrefixCache`` with kvstore's disk tier underneath: mixed in
    over vllm-mlx's installed class by ``_make_class`` (vllm-mlx is imported only then)."""

    def __init__(self, model: Any, config: Any = None, *, model_path: str | Path | None = None,
                 options: StoreOptions | None = None, **store_keywords: Any) -> None:
        super().__init__(model, config)
        self._kv_promoting = threading.local()
        self._kv_served: set[tuple[int, ...]] = set()  # keys handed out from disk
        self._kv_reads_off = False
        opts = (options or _OPTIONS.get("store", VLLM_BATCHED)).but(**store_changes(**store_keywords))
        path = model_path or _OPTIONS.get("model_path") or model_path_of(model)
        self._kv_model = (str(path), None, None) if path else None
        self._kv_store = None
        if self._kv_model is None:
            log.warning("kvstore: no model path for %s; vllm-mlx's prefix cache stays memory only "
                        "(kvstore.adapters.vllm_mlx_batched.remember_model names one)", type(model).__name__)
            return
        try:
            self._kv_store = _open_store(opts, self._config)
        except Exception as e:  # a cache directory that cannot be used: memory only
            log.warning("kvstore: cannot open the store (%s); memory only", e)

    # -- the two places vllm-mlx's class is extended ---------------------------

    def commit_prepared(self, entry: Any, evict_prefixes: bool = True, **kw: Any) -> bool:
        ok = super().commit_prepared(entry, evict_prefixes, **kw)
        if ok and not getattr(self._kv_promoting, "on", False):
            self._write_through(entry)
        return bool(ok)

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        cache, remaining = super().fetch(tokens)
        if cache is not None:
            # vllm-mlx keys a completion entry by prompt + output while its cache holds
            # one position fewer, and trims it as if it held them all: the tokens to run
            # start where the cache really ends
            pos = held_positions(cache)
            claimed = len(tokens) - len(remaining)
            if pos is not None and 0 < pos < claimed:
                self._stats.tokens_saved -= claimed - pos
                remaining = list(tokens[pos:])
        if (self._kv_store is None or self._kv_reads_off or not tokens
                or len(tokens) < self._config.min_prefix_tokens):
            return cache, remaining
        held = len(tokens) - len(remaining) if cache is not None else 0
        got = self._from_disk(list(tokens), held)
        if got is None:
            return cache, remaining
        if cache is None:  # the miss super() counted is a hit after all
            self._stats.misses = max(0, self._stats.misses - 1)
        disk_cache, n = got
        self._stats.hits += 1 if cache is None else 0
        self._stats.tokens_saved += n - held
        self._last_match_type = "prefix"
        self._last_matched_key = tuple(tokens[:n])
        if len(self._kv_served) < 4096:
            self._kv_served.add(self._last_matched_key)
        return disk_cache, list(tokens[n:])

    # -- helpers ---------------------------------------------------------------

    def _write_through(self, entry: Any) -> None:
        """Queue ``entry`` for disk; never raises (vllm-mlx's store must not). Its
        arrays are the ones vllm-mlx's store just evaluated on this thread; quantised
        layers go as mlx-lm ``QuantizedKVCache`` views of them (no full-precision copy)."""
        store = self._kv_store
        if store is None:
            return
        try:
            store.insert(self._kv_model, list(entry.tokens), to_mlx_lm(entry.cache))
        except Exception as e:  # str(e): a kept log record must not pin the arrays
            log.debug("kvstore: entry of %d tokens not written: %s", len(entry.tokens), str(e))
            _warn_once(store, "write", "kvstore: an entry could not be queued for disk (%s); memory only",
                       str(e))

    def _from_disk(self, tokens: list[int], held: int) -> tuple[list[Any], int] | None:
        """A disk prefix of ``tokens`` longer than the ``held`` tokens memory gave (by
        kvstore's margin), at most ``len(tokens) - 1`` (a whole-prompt hit is trimmed by
        one token, or refused when its cache cannot be trimmed), promoted into memory;
        None otherwise. Never raises."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        from ..store import restore_floor

        store: Any = self._kv_store
        top = len(tokens) - 1
        try:
            if top <= held:
                return None
            if min(store.peek(self._kv_model, tokens), top) <= restore_floor(held, top):
                return None
            got = store.fetch(self._kv_model, tokens)
            if got.cache is None:
                return None
            n = got.n
            if n > top:  # the whole prompt: vllm-mlx needs one token to run
                if not can_trim_prompt_cache(got.cache):
                    return None
                trim_prompt_cache(got.cache, n - top)
                n = top
            if n <= held:
                return None
            cache = from_mlx_lm(got.cache)
        except Exception as e:
            _warn_once(store, "fetch", "kvstore: disk lookup failed (%s); a miss", str(e))
            return None
        self._promote(tokens[:n], cache)
        return cache, n

    def _promote(self, tokens: list[int], cache: list[Any]) -> None:
        """A disk hit into vllm-mlx's memory tier (its own copy, within its limit), not
        written back."""
        self._kv_promoting.on = True
        try:
            super().store(tokens, cache, evict_prefixes=False)
        except Exception as e:
            log.debug("kvstore: disk hit not kept in memory: %s", str(e))
        finally:
            self._kv_promoting.on = False

    def remove(self, tokens: list[int], *, include_ssd: bool = False) -> bool:
        """vllm-mlx's remove. ``include_ssd`` of an entry this cache restored from disk is
        the scheduler refusing it (built under another ``--max-kv-size``): every disk
        entry is then built so, and disk lookups stop for this cache (else each request
        would restore one and prefill anyway)."""
        removed = bool(super().remove(tokens, include_ssd=include_ssd))
        if include_ssd and self._kv_store is not None and tuple(tokens) in self._kv_served:
            self._kv_reads_off = True
            log.warning("kvstore: vllm-mlx refused a cache restored from disk (its KV bound, "
                        "--max-kv-size, differs); disk lookups off for this server")
        return removed

    def save_to_disk(self, cache_dir: str) -> bool:
        """vllm-mlx's snapshot, after kvstore's pending writes reached disk."""
        if self._kv_store is not None:
            try:
                self._kv_store.flush(60)
            except Exception:
                pass
        return bool(super().save_to_disk(cache_dir))

    def get_stats(self) -> dict[str, Any]:
        stats = dict(super().get_stats())
        if self._kv_store is not None:
            try:
                s = self._kv_store.stats()
                stats["kvstore"] = {k: s.get(k, 0) for k in (
                    "hits_disk", "tokens_disk", "writes", "bytes_written", "dropped_writes",
                    "write_errors", "disk_entries", "disk_bytes", "cache_dir") if k in s}
            except Exception:
                pass
        return stats

    def kv_stats(self) -> dict[str, Any]:
        """kvstore's counters for this cache's store ({} when memory only)."""
        return self._kv_store.stats() if self._kv_store is not None else {}

    def close(self) -> None:
        """Flush pending writes and release the index (also done at exit)."""
        store, self._kv_store = self._kv_store, None
        if store is not None:
            store.close()


def _make_class() -> type:
    """``KVPrefixCache``: ``_StoreBackedPrefixCache`` over vllm-mlx's installed ``MemoryAwarePrefixCache``."""
    return type("KVPrefixCache", (_StoreBackedPrefixCache, _base()),
                {"__module__": __name__, "__qualname__": "KVPrefixCache", "__doc__": _StoreBackedPrefixCache.__doc__})


_CLASS: list[type] = []


def prefix_cache_class() -> type:
    """kvstore's ``MemoryAwarePrefixCache`` (built once, on vllm-mlx's installed class)."""
    if not _CLASS:
        _CLASS.append(_make_class())
    return _CLASS[0]


def held_positions(cache: list[Any]) -> int | None:
    """The positions every layer of ``cache`` holds (its smallest ``offset``); None when a
    layer does not say (recurrent state, test doubles)."""
    offsets = []
    for layer in cache:
        off = getattr(layer, "offset", None)
        if not isinstance(off, int) or isinstance(off, bool):
            return None
        offsets.append(off)
    return min(offsets) if offsets else None


def to_mlx_lm(cache: list[Any]) -> list[Any]:
    """vllm-mlx's quantised layers (``_QuantizedCacheWrapper`` of a ``KVCache``) as mlx-lm
    ``QuantizedKVCache``s sharing their arrays; other layers as they are."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache
    from vllm_mlx.memory_cache import _QuantizedCacheWrapper

    out = []
    for layer in cache:
        if isinstance(layer, _QuantizedCacheWrapper):
            if layer.orig_type is not KVCache:
                raise ValueError(f"quantised {layer.orig_type.__name__} layers are not stored")
            q = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
            q.keys, q.values, q.offset = layer.keys, layer.values, layer.offset
            layer = q
        out.append(layer)
    return out


def from_mlx_lm(cache: list[Any]) -> list[Any]:
    """A restored cache as vllm-mlx's fetch hands one out: ``QuantizedKVCache`` layers
    dequantised into ``KVCache``s (as vllm-mlx's ``_dequantize_cache`` does), evaluated here,
    on the thread that restored them."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    out: list[Any] = []
    for layer in cache:
        if isinstance(layer, QuantizedKVCache):
            kv = KVCache()
            n, g, b = layer.offset, layer.group_size, layer.bits
            keys: Any = layer.keys
            values: Any = layer.values
            kv.keys = mx.dequantize(keys[0], keys[1], keys[2], group_size=g, bits=b)[..., :n, :]
            kv.values = mx.dequantize(values[0], values[1], values[2], group_size=g, bits=b)[..., :n, :]
            kv.offset = n
            layer = kv
        elif type(layer) is KVCache and layer.keys is not None and layer.keys.shape[-2] > layer.offset:
            # sliced to its offset, as vllm-mlx's trimmed hits are (its issue #384)
            n = layer.offset
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        out.append(layer)
    mx.eval([c.state for c in out])
    return out


def _open_store(opts: StoreOptions, config: Any) -> Any:
    """The store under one prefix cache: ``opts`` with no memory tier of kvstore's (vllm-mlx's
    cache is the memory tier), quantised as the engine's ``config`` says."""
    from ..store import KVStore

    store = KVStore(options=opts.but(max_entries=VLLM_BATCHED.max_entries))
    if getattr(config, "kv_quantize", False):  # its entries are quantised: another identity
        store.set_kv_quant(int(config.kv_bits), int(config.kv_group_size))
    return store


def _warn_once(store: Any, what: str, msg: str, *args: Any) -> None:
    warn = getattr(store, "_warn_once", None)
    if warn is not None:
        warn(f"vllm-batched-{what}", msg, *args)
    else:
        log.warning(msg, *args)


def install(*, model_path: str | Path | None = None, options: StoreOptions | None = None,
            **store_keywords: Any) -> None:
    """Make vllm-mlx's schedulers (text and multimodal) build ``KVPrefixCache``.

    The store's settings: ``options`` (default ``options.VLLM_BATCHED``) with
    ``store_keywords`` (``cache_dir``, ``max_disk_bytes``, ``persist``, ...; ``disk=False``:
    memory only; TypeError naming one that is none); kvstore's memory tier stays empty
    whatever they say. ``model_path``: the identity of a model whose load kvstore did not
    see. Calling again replaces the options (for caches built afterwards).
    ``--use-paged-cache`` is refused from now on (``PAGED_REFUSAL``).
    """
    store = (options or VLLM_BATCHED).but(**store_changes(**store_keywords))
    import vllm_mlx.scheduler as scheduler
    import vllm_mlx.utils.tokenizer as tok

    _OPTIONS.clear()
    _OPTIONS["store"] = store
    if model_path is not None:
        _OPTIONS["model_path"] = str(model_path)
    cls = prefix_cache_class()
    _replace(scheduler, "MemoryAwarePrefixCache", cls)
    _replace(scheduler, "BlockAwarePrefixCache", _refuse_paged)
    try:
        import vllm_mlx.mllm_batch_generator as mllm
    except Exception:  # its multimodal stack (mlx-vlm) is not installed: nothing to patch
        mllm = None
    if mllm is not None:
        _replace(mllm, "MemoryAwarePrefixCache", cls)
    _replace(tok, "load_model_with_fallback", _recording(_ORIGINALS.get((tok, "load_model_with_fallback"),
                                                                        tok.load_model_with_fallback)))


def uninstall() -> None:
    """Undo ``install`` (caches already built stay until their scheduler goes)."""
    for (mod, name), orig in list(_ORIGINALS.items()):
        setattr(mod, name, orig)
    _ORIGINALS.clear()
    _OPTIONS.clear()


def _replace(mod: Any, name: str, value: Any) -> None:
    _ORIGINALS.setdefault((mod, name), getattr(mod, name))
    setattr(mod, name, value)


def _refuse_paged(*_a: Any, **_k: Any) -> Any:
    raise RuntimeError(PAGED_REFUSAL)


def _recording(load: Any) -> Any:
    def load_model_with_fallback(model_name: str, *args: Any, **kwargs: Any) -> Any:
        model, tokenizer = load(model_name, *args, **kwargs)
        remember_model(model, model_name)
        return model, tokenizer

    load_model_with_fallback.__wrapped__ = load  # type: ignore[attr-defined]
    return load_model_with_fallback
