"""Cache codecs: mlx-lm cache objects <-> named tensors plus a JSON layout.

One small codec per cache class, all with the same interface (``encode`` / ``decode``), as
mlx-lm's cache classes share one. Codecs read and set the classes' attributes rather than
``state``, whose layout changed between mlx-lm 0.31 (``state`` + ``meta_state``) and 0.32
(``state`` with scalars), so one stored entry reads back on either version.

Guarantees:
- ``encode`` never copies KV data: tensors are views of the live arrays, cut to the filled
  length (mlx-lm's own ``save_prompt_cache`` writes the whole over-allocated buffer), and
  never the host's own array objects: a host that goes on writing its cache in place
  (``state[...] = x`` replaces what that Python object is) changes no snapshot. (A
  full slice is still the host's own MLX array under a new Python object: ``memory.take``
  wraps each tensor, so nothing kvstore waits on is the host's array.)
- ``decode`` hands out fresh array objects (free ``a[:]`` views), so a caller that extends
  the restored cache never changes the arrays it came from.
- A cache kvstore cannot serialise raises ``Unsupported`` naming the class and why.
- A layout is a ``layout.Layout``: what is true of a stored class (its family, where it
  may be cut, whether it is chunkable, which arrays it holds) is ``layout.CLASSES``, data
  read without MLX. A codec only encodes and decodes its live class; what a layer's arrays
  must look like is ``fit``'s, read from the same table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .layout import CLASSES, ITEM_KINDS, STATE, Layout

Tensors = dict[str, mx.array]
Meta = Mapping[str, Any]  # one layer's stored meta (a ``layout.Layer``, or a dict being encoded)


class Unsupported(TypeError):
    """This cache object cannot be persisted (it stays memory-only)."""


def _fresh(x: mx.array) -> mx.array:
    """A new array object over the same data (no copy): writing into one in place
    (``x[...] = y``) leaves the other as it was."""
    return x[:] if x.ndim else x[...]


def _kv_encode(c: Any, n: int) -> Tensors:
    return {"k": c.keys[..., :n, :], "v": c.values[..., :n, :]}


class _Codec:
    """One live cache class's encoder and decoder (every concrete codec has both)."""

    cls: type = object

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        """The layer's tensors (views, no copies) and its meta; every concrete codec has one."""
        raise NotImplementedError(type(self).__name__)

    def decode(self, t: Tensors, meta: Meta) -> Any:
        """A fresh cache object from what ``encode`` gave; every concrete codec has one."""
        raise NotImplementedError(type(self).__name__)


class _KVCodec(_Codec):
    cls: type = mlx_cache.KVCache

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        if c.keys is None:
            return {}, {"offset": 0}
        return _kv_encode(c, c.offset), {"offset": int(c.offset)}

    def decode(self, t: Tensors, meta: Meta) -> Any:
        c = mlx_cache.KVCache()
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset = int(meta["offset"])
        return c


class _QuantKVCodec(_KVCodec):
    cls = mlx_cache.QuantizedKVCache

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "group_size": int(c.group_size), "bits": int(c.bits)}
        if c.keys is None:
            meta["offset"] = 0
            return {}, meta
        n = c.offset
        t = {f"k{i}": a[..., :n, :] for i, a in enumerate(c.keys)}
        t.update({f"v{i}": a[..., :n, :] for i, a in enumerate(c.values)})
        return t, meta

    def decode(self, t: Tensors, meta: Meta) -> Any:
        c: Any = mlx_cache.QuantizedKVCache(group_size=meta["group_size"], bits=meta["bits"])
        if "k0" in t:
            c.keys = tuple(_fresh(t[f"k{i}"]) for i in range(3))
            c.values = tuple(_fresh(t[f"v{i}"]) for i in range(3))
            c.offset = int(meta["offset"])
        return c


class _RotatingCodec(_Codec):
    """The ring buffer is stored as it is, with its write index: rotation state is history
    (so it can be cut only while it has not wrapped: ``layout``)."""

    cls = mlx_cache.RotatingKVCache

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "keep": int(c.keep), "max_size": int(c.max_size),
                "idx": int(c._idx)}
        if c.keys is None:
            return {}, meta
        return {"k": _fresh(c.keys), "v": _fresh(c.values)}, meta  # new objects: a rotating write is in place

    def decode(self, t: Tensors, meta: Meta) -> Any:
        c = mlx_cache.RotatingKVCache(max_size=meta["max_size"], keep=meta["keep"])
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset, c._idx = int(meta["offset"]), int(meta["idx"])
        return c


class _ChunkedCodec(_Codec):
    """Keys from ``start`` on (mlx-lm drops those before the current attention chunk; where
    such a layer may be cut is ``layout``'s)."""

    cls = mlx_cache.ChunkedKVCache

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "chunk_size": int(c.chunk_size),
                "start": int(c.start_position)}
        if c.keys is None:
            return {}, meta
        return _kv_encode(c, c.offset - c.start_position), meta

    def decode(self, t: Tensors, meta: Meta) -> Any:
        c = mlx_cache.ChunkedKVCache(meta["chunk_size"])
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset, c.start_position = int(meta["offset"]), int(meta["start"])
        return c


class _ArraysCodec(_Codec):
    """Recurrent state (conv and SSM states): only valid at exactly its own length."""

    cls = mlx_cache.ArraysCache

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        if getattr(c, "left_padding", None) is not None or getattr(c, "lengths", None) is not None:
            raise Unsupported("ArraysCache with batch padding/lengths (a batched cache)")
        t = {f"a{i}": _fresh(a) for i, a in enumerate(c.cache) if a is not None}  # not the host's objects
        return t, {"size": len(c.cache)}

    def decode(self, t: Tensors, meta: Meta) -> Any:
        c: Any = mlx_cache.ArraysCache(meta["size"])
        for i in range(meta["size"]):
            if f"a{i}" in t:
                c.cache[i] = _fresh(t[f"a{i}"])
        return c


class _CacheListCodec(_Codec):
    """Its members in order."""

    cls = mlx_cache.CacheList

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        tensors: Tensors = {}
        subs = []
        for j, sub in enumerate(c.caches):
            t, meta = encode_layer(sub)
            tensors.update({f"s{j}.{k}": v for k, v in t.items()})
            subs.append(meta)
        return tensors, {"sub": subs}

    def decode(self, t: Tensors, meta: Meta) -> Any:
        subs = []
        for j, m in enumerate(meta["sub"]):
            p = f"s{j}."
            subs.append(decode_layer({k[len(p):]: v for k, v in t.items() if k.startswith(p)}, m))
        return mlx_cache.CacheList(*subs)


class _StateCodec(_Codec):
    """Any other cache class that follows mlx-lm's own protocol, what its
    ``save_prompt_cache`` / ``load_prompt_cache`` rely on: a ``_BaseCache`` of an
    ``mlx_lm.models`` module whose ``state`` is arrays, scalars and None, rebuilt by
    ``from_state``. One whole snapshot, never cut (valid at exactly its own length, like
    recurrent state). A stored class name is only resolved to such a class of a module
    already imported (the model's own): stored data never imports anything."""

    cls = mlx_cache._BaseCache

    @staticmethod
    def follows(c: Any) -> bool:
        t = type(c)
        setter = getattr(getattr(t, "state", None), "fset", None)
        return (isinstance(c, mlx_cache._BaseCache) and t.__module__.startswith("mlx_lm.models.") and setter is not None
                and getattr(c, "left_padding", None) is None and getattr(c, "lengths", None) is None)

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        state = c.state
        if not isinstance(state, (list, tuple)) or len(state) > 64:
            raise Unsupported(f"{type(c).__name__}.state is not a short tuple")
        tensors: Tensors = {}
        items: list[list] = []
        for i, v in enumerate(state):
            if isinstance(v, mx.array):
                tensors[f"t{i}"] = _fresh(v)  # not the host's object: it may write it in place
                items.append(["a"])
            elif v is None:
                items.append(["n"])
            elif type(v) in ITEM_KINDS and (not isinstance(v, str) or len(v) <= 256):
                items.append([ITEM_KINDS[type(v)], v])
            else:
                raise Unsupported(f"{type(c).__name__}.state holds a {type(v).__name__}")
        try:  # what decode will do: a class whose from_state cannot take its own state is refused
            type(c).from_state(tuple(state))
        except Exception as e:
            raise Unsupported(f"{type(c).__name__}.from_state cannot rebuild it from its state ({e})") from None
        return tensors, {"type": f"{type(c).__module__}:{type(c).__qualname__}", "items": items}

    def decode(self, t: Tensors, meta: Meta) -> Any:
        cls = _state_class(meta["type"])
        state = [_fresh(t[f"t{i}"]) if it[0] == "a" else (None if it[0] == "n" else it[1])
                 for i, it in enumerate(meta["items"])]
        return cls.from_state(tuple(state))


def _state_class(name: str) -> type[mlx_cache._BaseCache]:
    """The class a stored ``module:qualname`` names, if it is a protocol-following cache
    class of an imported ``mlx_lm.models`` module; Unsupported otherwise."""
    import sys

    module, _, qual = name.partition(":")
    cls = getattr(sys.modules.get(module), qual, None) if module.startswith("mlx_lm.models.") else None
    if not (isinstance(cls, type) and issubclass(cls, mlx_cache._BaseCache) and cls.__name__ not in CODECS):
        raise Unsupported(f"stored cache class {name!r} is not an imported mlx-lm cache class")
    return cls


CODECS: dict[str, _Codec] = {
    one.cls.__name__: one
    for one in (_KVCodec(), _QuantKVCodec(), _RotatingCodec(), _ChunkedCodec(),
                _ArraysCodec(), _CacheListCodec())
}


STATE_CODEC = _StateCodec()
STORED: dict[str, _Codec] = {**CODECS, STATE: STATE_CODEC}  # every class name a stored layout may hold
assert set(STORED) == set(CLASSES), "layout.CLASSES names every stored class, codec encodes each"


def codec_of(c: Any) -> _Codec:
    """The codec of a live cache object's exact class (a dedicated one, else the generic
    ``State`` codec for classes following mlx-lm's protocol); Unsupported if none fits."""
    known = CODECS.get(type(c).__name__)
    if known is not None and type(c) is known.cls:
        return known
    if known is None and STATE_CODEC.follows(c):
        return STATE_CODEC
    why = "" if known is not None else " and it does not follow mlx-lm's state / from_state protocol"
    raise Unsupported(f"no codec for cache class {type(c).__module__}.{type(c).__name__}{why}")


def encode_layer(c: Any) -> tuple[Tensors, dict]:
    """One cache layer to (tensors, meta); meta["class"] names the codec."""
    one = codec_of(c)
    tensors, meta = one.encode(c)
    meta["class"] = STATE if one is STATE_CODEC else one.cls.__name__
    return tensors, meta


def decode_layer(t: Tensors, meta: Meta) -> Any:
    one = STORED.get(meta.get("class", ""))
    if one is None:
        raise Unsupported(f"unknown cache class in stored layout: {meta.get('class')!r}")
    return one.decode(t, meta)


def encode_cache(cache: list[Any]) -> tuple[Tensors, Layout]:
    """A whole prompt cache (one object per layer) to named tensors ``"{layer}.{name}"``."""
    if not isinstance(cache, (list, tuple)) or not cache:
        raise Unsupported(f"a prompt cache is a non-empty list of cache objects, got {type(cache).__name__}")
    tensors: Tensors = {}
    metas = []
    for i, c in enumerate(cache):
        t, meta = encode_layer(c)
        tensors.update({f"{i}.{k}": v for k, v in t.items()})
        metas.append(meta)
    return tensors, Layout.of(metas)


def decode_cache(tensors: Tensors, cache_layout: Layout) -> list[Any]:
    """Rebuild cache objects of the stored classes; arrays are fresh views of ``tensors``."""
    out = []
    for i, meta in enumerate(cache_layout):
        p = f"{i}."
        out.append(decode_layer({k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}, meta))
    return out


def flat_layers(cache: Sequence[Any]) -> list[Any]:
    """Cache objects with CacheList members in their place."""
    out: list[Any] = []
    for c in cache:
        subs = getattr(c, "caches", None)
        out.extend(flat_layers(list(subs)) if isinstance(subs, (list, tuple)) else [c])
    return out


def layer_arrays(layer: Any) -> list[mx.array]:
    """Every array a cache object holds (keys, values, packed parts, recurrent state)."""
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
        out.extend(layer_arrays(sub))
    return out


def slice_tokens(tensors: Tensors | dict, a: int, b: int) -> dict:
    """Token range [a, b) of chunkable tensors (token axis is -2); works on mx or numpy."""
    return {k: v[..., a:b, :] for k, v in tensors.items()}


def cache_nbytes(tensors: Tensors) -> int:
    return sum(int(v.nbytes) for v in tensors.values())


def trimmable(cache: list[Any]) -> bool:
    """mlx-lm's own answer (every layer's ``is_trimmable``): not kvstore's cut rule, which
    is ``Layout.can_cut`` (mlx-lm says True for a ChunkedKVCache at any cut point)."""
    return bool(cache) and all(c.is_trimmable() for c in cache)


def cache_can_cut(cache: list[Any], n: int) -> bool:
    """``Layout.can_cut`` for live cache objects (False for objects kvstore cannot encode)."""
    try:
        return encode_cache(cache)[1].can_cut(n)
    except Unsupported:
        return False


def cuts_anywhere(cache: list[Any]) -> bool:
    """Whether caches of these classes can be cut at any point, whatever they hold (plain
    and quantised KV only): a family that needs no message-boundary snapshots."""
    return bool(cache) and all(c is not None and type(c).__name__ in CODECS and CLASSES[type(c).__name__].chunkable
                               for c in flat_layers(cache))


def held(cache: Any) -> int | None:
    """Positions a live cache holds: the smallest integer ``offset`` of its layers."""
    if not isinstance(cache, (list, tuple)):
        return None
    offs = [c.offset for c in flat_layers(cache) if isinstance(getattr(c, "offset", None), int)]
    return min(offs) if offs else None


def check_holds(cache: Sequence[Any], n: int | None = None) -> str | None:
    """Why a prompt cache does not hold what it claims (a layer whose arrays have fewer
    positions than its offset, or, with ``n``, an offset other than ``n``), or None."""
    for i, c in enumerate(flat_layers(cache)):
        off = getattr(c, "offset", None)
        if n is not None and isinstance(off, int) and off != n:
            return f"layer {i} holds {off} positions, not {n}"
        known = CODECS.get(type(c).__name__)
        dense = known is not None and type(c) is known.cls and CLASSES[type(c).__name__].dense
        why = _dense_holds(c) if dense else None
        if why:
            return f"layer {i} ({why})"
    return None


def _dense_holds(c: Any) -> str | None:
    """Why a layer of a class whose arrays hold every position it claims (``dense``) holds
    fewer, or None."""
    keys, off = c.keys, c.offset
    k = keys[0] if isinstance(keys, (tuple, list)) else keys
    if k is not None and isinstance(off, int) and k.shape[-2] < off:
        return f"{type(c).__name__} claims {off} positions but its arrays hold {k.shape[-2]}"
    return None
