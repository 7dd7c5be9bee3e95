"""SimpleEngine's system-prompt KV slots (``VLLM_MLX_SYSTEM_KV_SLOTS``) kept on disk too.

vllm-mlx's SimpleEngine keeps an LRU of system-prompt KV snapshots in RAM
(``engine._system_kv_cache``: ``OrderedDict[hash of the system prefix text, (snapshot,
token count)]``, used on its streaming chat path), lost at every restart. ``install``
makes every SimpleEngine built afterwards use ``SystemSlots`` instead, an OrderedDict that

- writes each snapshot the engine files through to kvstore (``cache_type="system"``, so
  ``persist="system"`` keeps exactly these), keyed by the system prefix's tokens;
- on a lookup that misses in RAM, restores the snapshot from disk when kvstore holds all
  of the prefix's tokens, and files it as a slot (the engine's capacity applies).

Tokens: the engine keys slots by a hash of the prefix text. kvstore records the text of each
hash as vllm-mlx's ``build_system_prompt_cache_prefix`` returns it, and tokenises it both
ways the engine may (with and without special tokens); a snapshot is written only when
exactly one of those has its token count, and restored only when exactly one is on disk
whole, so a slot never comes back for other tokens than the engine's (the engine also
checks the token count before using it). The text route of multimodal models
(``_text_model``, which finds the prefix by ChatML markers itself) is not covered.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from typing import Any
from ..escape import logger
from ..options import DROP_IN, StoreOptions, store_changes

log = logger("kvstore")
_TEXTS: "OrderedDict[str, tuple[str, Any]]" = OrderedDict()  # hash -> (prefix text, tokenizer)
_TEXTS_MAX = 256
_TEXTS_LOCK = threading.Lock()
_OPTIONS: dict[str, StoreOptions] = {}  # install()'s: "store", the slots' store settings
_ORIGINALS: dict[str, Any] = {}


def slot_hash(text: str) -> str:
    """The key SimpleEngine files a system prefix under (vllm-mlx 0.6)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _remember_text(text: str, tokenizer: Any) -> None:
    with _TEXTS_LOCK:
        h = slot_hash(text)
        _TEXTS[h] = (text, tokenizer)
        _TEXTS.move_to_end(h)
        while len(_TEXTS) > _TEXTS_MAX:
            _TEXTS.popitem(last=False)


def _candidates(h: str) -> list[list[int]]:
    """The token lists the engine may have for slot ``h``: both tokenisations of its text
    (one if they agree); [] when the text is unknown."""
    with _TEXTS_LOCK:
        got = _TEXTS.get(h)
    if got is None:
        return []
    text, tok = got
    out: list[list[int]] = []
    for special in (True, False):
        ids = [int(t) for t in tok.encode(text, add_special_tokens=special)]
        if ids and ids not in out:
            out.append(ids)
    return out


class SystemSlots(OrderedDict):
    """``engine._system_kv_cache`` with kvstore's disk tier underneath (see module doc)."""

    def __init__(self, engine: Any, options: StoreOptions) -> None:
        super().__init__()
        self._engine = engine
        self._options = options
        self._store: Any = None
        self._opened = False
        self._lock = threading.RLock()

    # OrderedDict's own pickling/copy would call __init__ without arguments
    def __reduce__(self) -> Any:
        return (OrderedDict, (list(self.items()),))

    def _kv(self) -> Any:
        if not self._opened:
            self._opened = True
            try:
                from .mlx_lm import LRUPromptCache

                self._store = LRUPromptCache(max_size=0, options=self._options).store
            except Exception as e:
                log.warning("kvstore: system-prompt slots stay in memory only: %s", str(e))
        return self._store

    def _model_key(self) -> tuple[str, None, None]:
        return (str(self._engine._model_path), None, None)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if getattr(self, "_engine", None) is not None:  # not while OrderedDict builds itself
            self._write(key, value)

    def _write(self, key: str, value: Any) -> None:
        """The engine's new snapshot to disk (queued); never raises."""
        try:
            snapshot, n = value
            tokens = [c for c in _candidates(key) if len(c) == n]
            if len(tokens) != 1:
                return
            store = self._kv()
            if store is None:
                return
            store.insert(self._model_key(), tokens[0], self._as_cache(snapshot), cache_type="system")
        except Exception as e:
            log.debug("kvstore: system slot not written: %s", str(e))

    def get(self, key: str, default: Any = None) -> Any:
        got = super().get(key)
        if got is not None:
            return got
        try:
            got = self._restore(key)
        except Exception as e:
            log.debug("kvstore: system slot not restored: %s", str(e))
            got = None
        return got if got is not None else default

    def _restore(self, key: str) -> Any:
        store = self._kv() if _candidates(key) else None
        if store is None:
            return None
        whole = [c for c in _candidates(key) if store.peek(self._model_key(), c) >= len(c)]
        if len(whole) != 1:
            return None
        tokens = whole[0]
        got = store.fetch(self._model_key(), tokens)
        if got.cache is None or got.n != len(tokens):
            return None
        import mlx.core as mx

        snapshot = [c.state for c in got.cache]
        mx.eval([a for s in snapshot for a in (s if isinstance(s, (list, tuple)) else [s]) if a is not None])
        value = (snapshot, len(tokens))
        with self._lock:
            capacity = int(getattr(self._engine, "_system_kv_capacity", 4))
            while len(self) >= capacity:
                self.popitem(last=False)
            OrderedDict.__setitem__(self, key, value)
        log.info("kvstore: system prompt slot restored from disk (%d tokens)", len(tokens))
        return value

    def _as_cache(self, snapshot: list[Any]) -> list[Any]:
        """The engine's snapshot (a list of layer states) as mlx-lm cache layers sharing its
        arrays, what kvstore stores."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self._engine._model.model)
        for layer, state in zip(cache, snapshot):
            layer.state = state
        return cache


def install(*, options: StoreOptions | None = None, **store_keywords: Any) -> None:
    """Every SimpleEngine built from now on keeps its system-prompt slots on disk too.
    ``options`` / ``store_keywords``: the store's settings, as ``LRUPromptCache`` takes them
    (default ``options.DROP_IN``; TypeError naming a keyword that is none)."""
    store = (options or DROP_IN).but(**store_changes(**store_keywords))
    import vllm_mlx.engine.simple as simple

    _OPTIONS.clear()
    _OPTIONS["store"] = store
    if _ORIGINALS:
        return
    cls = simple.SimpleEngine
    init, build = cls.__init__, simple.build_system_prompt_cache_prefix
    _ORIGINALS.update(init=init, build=build)

    @functools.wraps(init)
    def __init__(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        if _OPTIONS:
            self._system_kv_cache = SystemSlots(self, _OPTIONS["store"])

    @functools.wraps(build)
    def build_system_prompt_cache_prefix(tokenizer: Any, *a: Any, **k: Any) -> Any:
        text = build(tokenizer, *a, **k)
        if isinstance(text, str) and text:
            _remember_text(text, tokenizer)
        return text

    cls.__init__ = __init__
    simple.build_system_prompt_cache_prefix = build_system_prompt_cache_prefix


def uninstall() -> None:
    """Undo ``install`` (engines already built keep their slots)."""
    import vllm_mlx.engine.simple as simple

    if _ORIGINALS:
        simple.SimpleEngine.__init__ = _ORIGINALS["init"]
        simple.build_system_prompt_cache_prefix = _ORIGINALS["build"]
    _ORIGINALS.clear()
    _OPTIONS.clear()
