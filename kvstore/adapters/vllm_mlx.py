"""kvstore as vllm-mlx's prefix trie cache (``SimpleEngine(prefix_trie_cache=True)``).

vllm-mlx (0.6) builds that cache lazily, in ``SimpleEngine._ensure_prefix_trie_cache``, as
``mlx_lm.models.cache.LRUPromptCache(max_size=..., max_bytes=...)``, and keys it with the
loaded model object (``self._model.model``). ``install`` makes engines build kvstore's
cache there instead, keyed by the engine's model directory, so entries persist on disk and
a restarted engine (or another process) starts warm.

Keying by model directory is also what makes the cache work at all: the model object is an
``mlx.nn.Module``, a ``dict``, hence unhashable, and mlx-lm's trie raises ``TypeError`` on
every lookup and insert with it (vllm-mlx 0.6 logs that at DEBUG and counts a "skip").

Usage::

    from vllm_mlx.engine.simple import SimpleEngine
    from kvstore.adapters import vllm_mlx as kv_vllm

    kv_vllm.install(cache_dir="~/.cache/kvstore")       # every SimpleEngine, from now on
    engine = SimpleEngine("/path/to/model", prefix_trie_cache=True)

    kv_vllm.install(engine, cache_dir="/fast/disk")     # or just this engine (before or
                                                        # after it started)
    kv_vllm.uninstall()                                 # back to vllm-mlx's own cache

The store's settings are a ``StoreOptions`` (``options=``, default ``options.DROP_IN``) and
its keywords (``cache_dir``, ``max_disk_bytes``, ``chunk_tokens``, ...; ``disk=False``: memory
only), as ``LRUPromptCache`` takes them; ``max_size`` / ``max_bytes`` come from the engine's
``prefix_trie_cache_size`` / ``prefix_trie_cache_memory_mb``. ``engine.stop()``
closes the cache (flushing pending writes). Importing this module does not import vllm-mlx;
``install`` without vllm-mlx raises a ModuleNotFoundError that says how to install it.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from ..options import DROP_IN, StoreOptions, store_changes
from ..salt import salt_of
from .mlx_lm import LRUPromptCache

_OPTIONS_ATTR = "_kvstore_options"   # on the SimpleEngine class (all) or one engine
_ORIGINALS_ATTR = "_kvstore_originals"


class EnginePromptCache(LRUPromptCache):
    """kvstore's ``LRUPromptCache`` for one engine: whatever model object vllm-mlx passes,
    entries are keyed by ``model_key`` (mlx-lm's ``(model path, adapter, draft)`` key)."""

    def __init__(self, max_size: int | None = None, max_bytes: int | None = None, *,
                 model_key: Any, **settings: Any) -> None:  # ``LRUPromptCache``'s: options=, keywords
        super().__init__(max_size, max_bytes, **settings)
        self.model_key = model_key

    def fetch_nearest_cache(self, model: Any, tokens: list[int], *,
                            salt: Any = None) -> tuple[list[Any] | None, list[int]]:
        return super().fetch_nearest_cache(self.model_key, tokens, salt=salt)

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant", salt: Any = None) -> None:
        super().insert_cache(self.model_key, tokens, prompt_cache, cache_type=cache_type, salt=salt)

    def __bool__(self) -> bool:
        # vllm-mlx skips the lookup when ``bool(cache)`` is false; the disk may still hit
        return self.store.disk is not None or len(self) > 0

    def peek(self, tokens: list[int], *, salt: Any = None) -> int:
        """Tokens a fetch would restore (memory or disk), capped at ``len(tokens) - 1`` as
        vllm-mlx keeps one token to run; reads no KV data."""
        n = self.store.peek(self.model_key, tokens, salt=salt if salt is not None else salt_of(tokens))
        return min(n, max(len(tokens) - 1, 0))

    @property
    def _trie(self) -> "_Peek":
        # vllm-mlx reads mlx-lm's private ``_trie`` to size a hit before fetching it (when a
        # system-prompt snapshot competes); without it the trie would never be consulted then.
        return _Peek(self)


class _Peek:
    """The part of mlx-lm's ``PromptTrie`` vllm-mlx's ``_peek_prefix_trie_tokens_saved``
    reads: ``search`` reporting kvstore's reusable prefix as a "shorter" match."""

    def __init__(self, cache: EnginePromptCache) -> None:
        self.cache = cache

    def search(self, model: Any, tokens: list[int]) -> Any:
        from mlx_lm.models.cache import PromptTrieResult

        n = self.cache.peek(tokens)
        return PromptTrieResult(model, None, list(tokens[:n]) if n else None, None, 0)


def install(engine: Any = None, *, options: StoreOptions | None = None, **store_keywords: Any) -> None:
    """Make vllm-mlx ``SimpleEngine``s use kvstore as their prefix trie cache.

    With ``engine=None`` every engine (existing ones included) builds kvstore's cache the
    next time it needs one; with an engine, only that engine does, and a cache it already
    built is replaced. Engines need ``prefix_trie_cache=True``. Calling again updates the
    options for caches built afterwards. ``options`` / ``store_keywords``: the store's
    settings, as ``LRUPromptCache`` takes them (a keyword that is none: TypeError, here).
    """
    options = (options or DROP_IN).but(**store_changes(**store_keywords))
    cls = _simple_engine()
    _patch(cls)
    if engine is None:
        setattr(cls, _OPTIONS_ATTR, options)
        return
    setattr(engine, _OPTIONS_ATTR, options)
    with engine._prefix_trie_cache_lock:
        old = engine._prefix_trie_cache
        if old is not None and not isinstance(old, EnginePromptCache):
            engine._prefix_trie_cache = None   # rebuilt as kvstore's on next use


def install_all(**store_keywords: Any) -> None:
    """kvstore in every vllm-mlx engine from now on (what ``kvstore vllm-mlx serve`` does):
    SimpleEngine's prefix trie cache (``install``), its system-prompt KV slots
    (``vllm_mlx_system``) and the batched engine's prefix cache (``vllm_mlx_batched``).
    ``store_keywords``: the store options the user set (``cache_dir``, ``max_disk_bytes``,
    ``persist``, ``max_write_bytes_per_day``, ...), each engine's over its own defaults
    (``options.DROP_IN``, ``options.VLLM_BATCHED``). A ModuleNotFoundError says how to
    install vllm-mlx when it cannot be imported."""
    from . import vllm_mlx_batched

    install(**store_keywords)
    vllm_mlx_batched.install(**store_keywords)
    try:
        from . import vllm_mlx_system
    except ImportError:
        return
    vllm_mlx_system.install(**store_keywords)


def uninstall() -> None:
    """Undo ``install``: engines build mlx-lm's ``LRUPromptCache`` again (caches already
    built stay until their engine stops)."""
    cls = _simple_engine()
    originals = cls.__dict__.get(_ORIGINALS_ATTR)
    if originals is None:
        return
    for name, fn in originals.items():
        setattr(cls, name, fn)
    delattr(cls, _ORIGINALS_ATTR)
    if _OPTIONS_ATTR in cls.__dict__:
        delattr(cls, _OPTIONS_ATTR)


def engine_cache(engine: Any) -> EnginePromptCache | None:
    """The kvstore cache an engine currently uses (for ``.stats()``), if any."""
    cache = getattr(engine, "_prefix_trie_cache", None)
    return cache if isinstance(cache, EnginePromptCache) else None


def make_cache(engine: Any, options: StoreOptions = DROP_IN) -> EnginePromptCache:
    """kvstore's cache for ``engine``: ``options`` with the limits the engine was configured
    with (no ``prefix_trie_cache_memory_mb``: the options' ``max_bytes``)."""
    mb = engine._prefix_trie_cache_memory_mb
    return EnginePromptCache(
        max_size=engine._prefix_trie_cache_size,
        max_bytes=mb * 1024 * 1024 if mb is not None else None,
        model_key=(str(engine._model_path), None, None),
        options=options,
    )


# -- internals ---------------------------------------------------------------------------


INSTALL_HINT = (
    "install it beside kvstore as tested, in its own venv (vllm-mlx 0.6 pins mlx-lm<0.32; its "
    "other declared dependencies, torch and CUDA wheels among them, are not needed for its "
    "engines and server): pip install 'mlx-lm==0.31.3' 'jsonschema>=4.0.0' 'requests>=2.28.0' "
    "fastapi 'starlette>=1.0.1' uvicorn python-multipart && "
    "pip install --no-deps 'vllm-mlx==0.6.0'  (or tools/gates/compat_env.sh VENV; see docs/adapters.md, vllm-mlx)")


def _simple_engine() -> type:
    """vllm-mlx's SimpleEngine; a ModuleNotFoundError that says how to install vllm-mlx
    (or the module it lacks) when it cannot be imported."""
    try:
        from vllm_mlx.engine.simple import SimpleEngine
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "vllm_mlx":
            raise ModuleNotFoundError(f"kvstore.adapters.vllm_mlx needs vllm-mlx, which is not installed: "
                                      f"{INSTALL_HINT}", name=e.name) from None
        raise ModuleNotFoundError(f"vllm-mlx is installed but cannot be imported: the module {e.name!r} "
                                  f"it imports is missing. The tested setup: {INSTALL_HINT}", name=e.name) from e
    return SimpleEngine


def _patch(cls: Any) -> None:  # vllm-mlx's SimpleEngine: untyped here, its methods are replaced
    if _ORIGINALS_ATTR in cls.__dict__:
        return
    ensure, stop = cls._ensure_prefix_trie_cache, cls.stop

    @functools.wraps(ensure)
    def _ensure_prefix_trie_cache(self: Any) -> Any:
        options = getattr(self, _OPTIONS_ATTR, None)
        if options is not None and self._prefix_trie_cache_enabled and not self._is_mllm:
            with self._prefix_trie_cache_lock:
                if not isinstance(self._prefix_trie_cache, EnginePromptCache):
                    self._prefix_trie_cache = make_cache(self, options)
        return ensure(self)

    @functools.wraps(stop)
    async def _stop(self: Any) -> None:
        cache = engine_cache(self)
        await stop(self)
        if cache is not None:  # flush pending writes; release the index for a restart
            await asyncio.to_thread(cache.close)

    setattr(cls, _ORIGINALS_ATTR, {"_ensure_prefix_trie_cache": ensure, "stop": stop})
    cls._ensure_prefix_trie_cache = _ensure_prefix_trie_cache
    cls.stop = _stop
