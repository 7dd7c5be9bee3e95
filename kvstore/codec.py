"""Cache codecs: mlx-lm cache objects <-> named tensors plus a JSON layout.

One small codec per cache class, all with the same interface (``encode`` / ``decode``), as
mlx-lm's cache classes share one. Codecs read and set the classes' attributes rather than
``state``, whose layout changed between mlx-lm 0.31 (``state`` + ``meta_state``) and 0.32
(``state`` with scalars), so one stored entry reads back on either version.

Guarantees:
- ``encode`` never copies KV data: tensors are views of the live arrays, cut to the filled
  length (mlx-lm's own ``save_prompt_cache`` writes the whole over-allocated buffer).
- ``decode`` hands out fresh array objects (free ``a[:]`` views), so a caller that extends
  the restored cache never changes the arrays it came from.
- A cache kvstore cannot serialise raises ``Unsupported`` naming the class and why.
- Each codec owns what is true of its class, as each mlx-lm cache class owns
  ``is_trimmable`` / ``trim``: ``family`` (attention KV or its own), ``can_cut(meta, n)``
  (whether the layer cut back to ``n`` positions is, in everything the model reads, what a
  cold prefill of ``n`` tokens leaves: trimmability is a property of the cut point) and
  ``holds(c)`` (why a live layer does not hold what it claims).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

Tensors = dict[str, mx.array]
Layout = list[dict[str, Any]]
# The shape an array must have, axis by axis: an int (that length), TOKENS (the token axis:
# any length, the same in every array of the layer), None (any length: an axis the
# identity's record does not fix) and, last, ``...`` (any further axes).
Pattern = tuple[Any, ...]
Expected = dict[str, tuple[Pattern, "str | None"]]  # array name -> (pattern, dtype name or None: any)
TOKENS = "T"
ALL, ALL_OR_NONE, ANY = "all", "all or none", "any"  # which of its expected arrays a layer holds

ATTENTION = "attention KV"  # the family of the attention-KV classes: a model may hold any of them


class Unsupported(TypeError):
    """This cache object cannot be persisted (it stays memory-only)."""


def _fresh(x: mx.array) -> mx.array:
    return x[:] if x.ndim else x


def _kv_encode(c: Any, n: int) -> Tensors:
    return {"k": c.keys[..., :n, :], "v": c.values[..., :n, :]}


class _Codec:
    """What every codec says unless its class says otherwise: a family of its own, never
    cut (valid only at exactly its own length), nothing to check on a live layer.
    ``chunkable``: a prefix can be cut into token chunks and glued back."""

    cls: type = object
    chunkable = False

    @property
    def family(self) -> str:
        return self.cls.__name__

    def can_cut(self, meta: dict, n: int) -> bool:
        return False

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        """The layer's tensors (views, no copies) and its meta; every concrete codec has one."""
        raise NotImplementedError(type(self).__name__)

    def decode(self, t: Tensors, meta: dict) -> Any:
        """A fresh cache object from what ``encode`` gave; every concrete codec has one."""
        raise NotImplementedError(type(self).__name__)

    def holds(self, c: Any) -> str | None:
        return None

    def check(self, key: str, value: Any) -> None:
        """A stored layout field other than the bounded integers: none unless the codec
        writes one (ValueError naming it)."""
        raise ValueError(f"unexpected layout field {key!r}")

    def signature(self, meta: dict) -> dict:
        """The layer's meta without lengths (what an identity's layout records)."""
        return {k: v for k, v in meta.items() if k not in ("offset", "idx", "start")}

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        """Every array a layer of this class (stored ``meta``) may hold, with the shape and
        dtype the model's own cache gives it (``want``: the identity's record of the
        layer, {} when it has none: then only what every prompt cache of the class has,
        such as batch 1), and which of them it holds (ALL, ALL_OR_NONE, ANY). ValueError when no
        cache the model makes is of this meta. A cache of these shapes is one the
        model's code can run (mlx-lm's batching merges a layer's arrays into a batch-1
        slot; a batch of 2 or a fifth axis kills the generation thread)."""
        return {}, ALL


def _kv_shapes(want: dict) -> tuple[Expected, str]:
    """Keys and values as mlx-lm's attention caches hold them: (1, KV heads, tokens, head_dim)."""
    (kh, kd), (vh, vd) = (want.get(n) or (None, None) for n in ("k", "v"))
    return {"k": ((1, kh, TOKENS, kd), want.get("dtype")), "v": ((1, vh, TOKENS, vd), want.get("dtype"))}, ALL_OR_NONE


class _KVCodec(_Codec):
    cls: type = mlx_cache.KVCache
    chunkable = True
    family = ATTENTION

    def can_cut(self, meta: dict, n: int) -> bool:
        return 0 <= n <= meta["offset"]

    def holds(self, c: Any) -> str | None:
        keys, off = c.keys, c.offset
        k = keys[0] if isinstance(keys, (tuple, list)) else keys
        if k is not None and isinstance(off, int) and k.shape[-2] < off:
            return f"{type(c).__name__} claims {off} positions but its arrays hold {k.shape[-2]}"
        return None

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        return _kv_shapes(want)

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        if c.keys is None:
            return {}, {"offset": 0}
        return _kv_encode(c, c.offset), {"offset": int(c.offset)}

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = mlx_cache.KVCache()
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset = int(meta["offset"])
        return c


class _QuantKVCodec(_KVCodec):
    cls = mlx_cache.QuantizedKVCache

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        """``mx.quantize``'s parts of keys and values: the packed words (head_dim * bits / 32
        uint32) and the scales and biases (head_dim / group_size, the KV dtype), of the
        bits and group size ``want`` names (the identity's ``kv_bits``, or a recorded
        QuantizedKVCache layer's) when it names them."""
        bits, group = meta.get("bits"), meta.get("group_size")
        if not isinstance(bits, int) or not 0 < bits <= 8 or not isinstance(group, int) or group <= 0:
            raise ValueError(f"is {bits}-bit KV in groups of {group}, which no quantisation makes")
        if want.get("bits") is not None and (want["bits"], want.get("group_size")) != (bits, group):
            raise ValueError(f"is {bits}-bit KV in groups of {group}, the model's is {want['bits']}-bit in groups "
                             f"of {want.get('group_size')}")
        out: Expected = {}
        for n in "kv":
            h, d = want.get(n) or (None, None)
            if d is not None and (d * bits % 32 or d % group):
                raise ValueError(f"is {bits}-bit KV in groups of {group}, which head_dim {d} does not fit")
            out[f"{n}0"] = ((1, h, TOKENS, None if d is None else d * bits // 32), "uint32")
            out[f"{n}1"] = out[f"{n}2"] = ((1, h, TOKENS, None if d is None else d // group), want.get("dtype"))
        return out, ALL_OR_NONE

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "group_size": int(c.group_size), "bits": int(c.bits)}
        if c.keys is None:
            meta["offset"] = 0
            return {}, meta
        n = c.offset
        t = {f"k{i}": a[..., :n, :] for i, a in enumerate(c.keys)}
        t.update({f"v{i}": a[..., :n, :] for i, a in enumerate(c.values)})
        return t, meta

    def decode(self, t: Tensors, meta: dict) -> Any:
        c: Any = mlx_cache.QuantizedKVCache(group_size=meta["group_size"], bits=meta["bits"])
        if "k0" in t:
            c.keys = tuple(_fresh(t[f"k{i}"]) for i in range(3))
            c.values = tuple(_fresh(t[f"v{i}"]) for i in range(3))
            c.offset = int(meta["offset"])
        return c


class _RotatingCodec(_Codec):
    """The ring buffer is stored as it is, with its write index: rotation state is history.
    It can be cut only while it has not wrapped (mlx-lm's ``is_trimmable``)."""

    cls = mlx_cache.RotatingKVCache
    family = ATTENTION

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        return _kv_shapes(want)

    def can_cut(self, meta: dict, n: int) -> bool:
        return 0 <= n <= meta["offset"] < meta["max_size"]

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "keep": int(c.keep), "max_size": int(c.max_size),
                "idx": int(c._idx)}
        if c.keys is None:
            return {}, meta
        return {"k": _fresh(c.keys), "v": _fresh(c.values)}, meta  # new objects: a rotating write is in place

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = mlx_cache.RotatingKVCache(max_size=meta["max_size"], keep=meta["keep"])
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset, c._idx = int(meta["offset"]), int(meta["idx"])
        return c


class _ChunkedCodec(_Codec):
    """Keys from ``start`` on (mlx-lm drops those before the current attention chunk).
    A cut to ``n`` is allowed only where the kept keys cover the attention chunk of
    position ``n`` (``start <= n // chunk * chunk``): llama4 builds its chunk mask from
    ``start_position``, so position ``n`` attends to keys ``n // chunk * chunk .. n``, which
    a cut inside the chunk of ``start`` no longer holds (mlx-lm's ``is_trimmable`` says
    True there: its own LRU hands out such a cache)."""

    cls = mlx_cache.ChunkedKVCache
    family = ATTENTION

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        return _kv_shapes(want)

    def can_cut(self, meta: dict, n: int) -> bool:
        size = meta["chunk_size"]
        return size > 0 and 0 <= n <= meta["offset"] and meta["start"] <= n // size * size

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "chunk_size": int(c.chunk_size),
                "start": int(c.start_position)}
        if c.keys is None:
            return {}, meta
        return _kv_encode(c, c.offset - c.start_position), meta

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = mlx_cache.ChunkedKVCache(meta["chunk_size"])
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset, c.start_position = int(meta["offset"]), int(meta["start"])
        return c


class _ArraysCodec(_Codec):
    """Recurrent state (conv and SSM states): only valid at exactly its own length."""

    cls = mlx_cache.ArraysCache

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        """The state arrays the identity records (``layouts.describe_layout``), exactly (but
        for an axis recorded as None: one that grows with the prompt) and all of them
        (state a forward leaves empty is not the model's); without a record, any of
        ``size`` arrays of batch 1 (mlx-lm's ``ArraysCache.batch_size`` is
        their first axis)."""
        rec, dts = want.get("shapes"), want.get("dtypes") or {}
        if isinstance(rec, dict):
            return {n: (tuple(s), dts.get(n)) for n, s in rec.items()}, ALL
        return {f"a{i}": ((1, ...), None) for i in range(meta["size"])}, ANY

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        if getattr(c, "left_padding", None) is not None or getattr(c, "lengths", None) is not None:
            raise Unsupported("ArraysCache with batch padding/lengths (a batched cache)")
        t = {f"a{i}": a for i, a in enumerate(c.cache) if a is not None}
        return t, {"size": len(c.cache)}

    def decode(self, t: Tensors, meta: dict) -> Any:
        c: Any = mlx_cache.ArraysCache(meta["size"])
        for i in range(meta["size"]):
            if f"a{i}" in t:
                c.cache[i] = _fresh(t[f"a{i}"])
        return c


class _CacheListCodec(_Codec):
    """Its members in order; a cut must suit every member."""

    cls = mlx_cache.CacheList

    def can_cut(self, meta: dict, n: int) -> bool:
        return all(STORED[m["class"]].can_cut(m, n) for m in meta["sub"])

    def holds(self, c: Any) -> str | None:
        return next((why for sub in c.caches if (why := codec_of(sub).holds(sub))), None)

    def check(self, key: str, value: Any) -> None:
        if key != "sub":
            super().check(key, value)

    def signature(self, meta: dict) -> dict:
        return {"class": meta["class"], "sub": layout_signature(meta["sub"])}

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        tensors: Tensors = {}
        subs = []
        for j, sub in enumerate(c.caches):
            t, meta = encode_layer(sub)
            tensors.update({f"s{j}.{k}": v for k, v in t.items()})
            subs.append(meta)
        return tensors, {"sub": subs}

    def decode(self, t: Tensors, meta: dict) -> Any:
        subs = []
        for j, m in enumerate(meta["sub"]):
            p = f"s{j}."
            subs.append(decode_layer({k[len(p):]: v for k, v in t.items() if k.startswith(p)}, m))
        return mlx_cache.CacheList(*subs)


_KINDS = {bool: "b", int: "i", float: "f", str: "s"}


class _StateCodec(_Codec):
    """Any other cache class that follows mlx-lm's own protocol, what its
    ``save_prompt_cache`` / ``load_prompt_cache`` rely on: a ``_BaseCache`` of an
    ``mlx_lm.models`` module whose ``state`` is arrays, scalars and None, rebuilt by
    ``from_state``. One whole snapshot, never cut (valid at exactly its own length, like
    recurrent state). A stored class name is only resolved to such a class of a module
    already imported (the model's own): stored data never imports anything."""

    cls = mlx_cache._BaseCache

    @property
    def family(self) -> str:
        return "State"

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
                tensors[f"t{i}"] = v
                items.append(["a"])
            elif v is None:
                items.append(["n"])
            elif type(v) in _KINDS and (not isinstance(v, str) or len(v) <= 256):
                items.append([_KINDS[type(v)], v])
            else:
                raise Unsupported(f"{type(c).__name__}.state holds a {type(v).__name__}")
        try:  # what decode will do: a class whose from_state cannot take its own state is refused
            type(c).from_state(tuple(state))
        except Exception as e:
            raise Unsupported(f"{type(c).__name__}.from_state cannot rebuild it from its state ({e})") from None
        return tensors, {"type": f"{type(c).__module__}:{type(c).__qualname__}", "items": items}

    def decode(self, t: Tensors, meta: dict) -> Any:
        cls = _state_class(meta["type"])
        state = [_fresh(t[f"t{i}"]) if it[0] == "a" else (None if it[0] == "n" else it[1])
                 for i, it in enumerate(meta["items"])]
        return cls.from_state(tuple(state))

    def check(self, key: str, value: Any) -> None:
        if key == "type" and isinstance(value, str) and len(value) <= 200 and value.startswith("mlx_lm.models."):
            return
        if key == "items" and isinstance(value, list) and len(value) <= 64 and all(_item_ok(x) for x in value):
            return
        raise ValueError(f"layout field {key}={str(value)[:80]!r} is not a state description")

    def signature(self, meta: dict) -> dict:
        return {"class": meta["class"], "type": meta["type"], "items": [x[0] for x in meta["items"]]}

    def shapes(self, meta: dict, want: dict) -> tuple[Expected, str]:
        """Every array item; where the identity records it, of its number of axes, batch and
        dtype (which axis holds tokens is the class's own: not known here)."""
        rec, dts = want.get("shapes") or {}, want.get("dtypes") or {}
        out: Expected = {}
        for i, it in enumerate(meta["items"]):
            if it[0] == "a":
                s = rec.get(f"t{i}")
                out[f"t{i}"] = ((*s[:1], *[None] * (len(s) - 1)) if isinstance(s, list) else (...,), dts.get(f"t{i}"))
        return out, ALL


def _item_ok(x: Any) -> bool:
    if not isinstance(x, list) or not x or x[0] not in ("a", "n", *_KINDS.values()):
        return False
    if x[0] in ("a", "n"):
        return len(x) == 1
    kind = {v: k for k, v in _KINDS.items()}[x[0]]
    return len(x) == 2 and type(x[1]) is kind and (not isinstance(x[1], str) or len(x[1]) <= 256)


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
    codec.cls.__name__: codec
    for codec in (_KVCodec(), _QuantKVCodec(), _RotatingCodec(), _ChunkedCodec(),
                  _ArraysCodec(), _CacheListCodec())
}


STATE = _StateCodec()
_PLAIN = _Codec()
STORED: dict[str, _Codec] = {**CODECS, "State": STATE}  # every class name a stored layout may hold


def codec_of(c: Any) -> _Codec:
    """The codec of a live cache object's exact class (a dedicated one, else the generic
    ``State`` codec for classes following mlx-lm's protocol); Unsupported if none fits."""
    codec = CODECS.get(type(c).__name__)
    if codec is not None and type(c) is codec.cls:
        return codec
    if codec is None and STATE.follows(c):
        return STATE
    why = "" if codec is not None else " and it does not follow mlx-lm's state / from_state protocol"
    raise Unsupported(f"no codec for cache class {type(c).__module__}.{type(c).__name__}{why}")


def encode_layer(c: Any) -> tuple[Tensors, dict]:
    """One cache layer to (tensors, meta); meta["class"] names the codec."""
    codec = codec_of(c)
    tensors, meta = codec.encode(c)
    meta["class"] = "State" if codec is STATE else codec.cls.__name__
    return tensors, meta


def decode_layer(t: Tensors, meta: dict) -> Any:
    codec = STORED.get(meta.get("class", ""))
    if codec is None:
        raise Unsupported(f"unknown cache class in stored layout: {meta.get('class')!r}")
    return codec.decode(t, meta)


def encode_cache(cache: list[Any]) -> tuple[Tensors, Layout]:
    """A whole prompt cache (one object per layer) to named tensors ``"{layer}.{name}"``."""
    if not isinstance(cache, (list, tuple)) or not cache:
        raise Unsupported(f"a prompt cache is a non-empty list of cache objects, got {type(cache).__name__}")
    tensors: Tensors = {}
    layout: Layout = []
    for i, c in enumerate(cache):
        t, meta = encode_layer(c)
        tensors.update({f"{i}.{k}": v for k, v in t.items()})
        layout.append(meta)
    return tensors, layout


def decode_cache(tensors: Tensors, layout: Layout) -> list[Any]:
    """Rebuild cache objects of the stored classes; arrays are fresh views of ``tensors``."""
    out = []
    for i, meta in enumerate(layout):
        p = f"{i}."
        out.append(decode_layer({k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}, meta))
    return out


def flat_layout(layout: Layout) -> list[dict]:
    """Layer metas with CacheList members in their place."""
    flat: list[dict] = []
    for meta in layout:
        flat.extend(flat_layout(meta["sub"]) if meta["class"] == "CacheList" else [meta])
    return flat


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


_INT_FIELDS = ("offset", "keep", "max_size", "idx", "chunk_size", "start", "group_size", "bits", "size")
MAX_LAYERS = 4096
MAX_ARRAYS = 1024  # an ArraysCache's size


def check_layout(obj: Any, depth: int = 0) -> Layout:
    """``obj`` if it is a layout this codec wrote (a list of layer metas of known classes
    whose fields are bounded integers, CacheList nesting at most two deep), else
    ValueError naming what is wrong. Nothing else about a stored layout is trusted before
    it passed this and the identity's layout check."""
    if not isinstance(obj, list) or not 0 < len(obj) <= MAX_LAYERS or depth > 2:
        raise ValueError("a layout is a non-empty list of layer metas")
    for m in obj:
        if not isinstance(m, dict) or m.get("class") not in STORED:
            raise ValueError(f"unknown cache class in a stored layout: {str(m)[:80]!r}")
        for k, v in m.items():
            if k in _INT_FIELDS:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 31:
                    raise ValueError(f"layout field {k}={v!r} out of range")
            elif k == "sub" and m["class"] == "CacheList":
                check_layout(v, depth + 1)
            elif k != "class":
                STORED[m["class"]].check(k, v)
        if m["class"] == "ArraysCache" and not 0 < m.get("size", 0) <= MAX_ARRAYS:
            raise ValueError(f"ArraysCache size {m.get('size')!r} out of range")
    return obj


def is_chunkable(layout: Layout, n_tokens: int) -> bool:
    """True when every layer is plain or quantised KV holding exactly ``n_tokens`` positions:
    such a cache can be cut into token chunks and glued back (prefix reuse at any length)."""
    return all(STORED[m["class"]].chunkable and m["offset"] == n_tokens for m in flat_layout(layout))


def with_offset(layout: Layout, n: int) -> Layout:
    """A chunkable layout re-labelled to hold ``n`` tokens."""
    out = []
    for meta in layout:
        meta = dict(meta)
        if meta["class"] == "CacheList":
            meta["sub"] = with_offset(meta["sub"], n)
        else:
            meta["offset"] = n
        out.append(meta)
    return out


def layout_signature(layout: Layout) -> list:
    """The layout without lengths: classes and their parameters, for identity checks."""
    return [STORED.get(m.get("class", ""), _PLAIN).signature(m) for m in layout]


def slice_tokens(tensors: Tensors | dict, a: int, b: int) -> dict:
    """Token range [a, b) of chunkable tensors (token axis is -2); works on mx or numpy."""
    return {k: v[..., a:b, :] for k, v in tensors.items()}


def cache_nbytes(tensors: Tensors) -> int:
    return sum(int(v.nbytes) for v in tensors.values())


def trimmable(cache: list[Any]) -> bool:
    """mlx-lm's own answer (every layer's ``is_trimmable``): not kvstore's cut rule, which
    is ``can_cut`` (mlx-lm says True for a ChunkedKVCache at any cut point)."""
    return bool(cache) and all(c.is_trimmable() for c in cache)


def layout_length(layout: Layout) -> int | None:
    """Positions a stored layout holds: its smallest ``offset`` (None for recurrent state
    alone, which records no length)."""
    offs = [m["offset"] for m in flat_layout(layout) if "offset" in m]
    return min(offs) if offs else None


def can_cut(layout: Layout, n: int) -> bool:
    """Whether a cache of ``layout`` cut back to ``n`` positions is, in everything the
    model reads, the cache a cold prefill of those ``n`` tokens leaves: at its own length
    always; below it only where every layer's codec allows that cut point."""
    held = layout_length(layout)
    if held is None or not 0 <= n <= held:
        return False
    return n == held or all(STORED[m["class"]].can_cut(m, n) for m in layout)


def layout_trimmable(layout: Layout) -> bool:
    """Whether some cut below its length is allowed (cut points are upward-closed: the
    last one is allowed if any is). What an entry record's ``trimmable`` flag says."""
    held = layout_length(layout)
    return held is not None and held > 0 and can_cut(layout, held - 1)


def covers_prefixes(layout: Layout) -> bool:
    """Whether every prefix of the snapshot can be cut from it (so it stands in for the
    stored snapshots of its prefixes, mlx-lm's rule for trimmable entries)."""
    return can_cut(layout, 0)


def cache_can_cut(cache: list[Any], n: int) -> bool:
    """``can_cut`` for live cache objects (False for objects kvstore cannot encode)."""
    try:
        return can_cut(encode_cache(cache)[1], n)
    except Unsupported:
        return False


def cuts_anywhere(cache: list[Any]) -> bool:
    """Whether caches of these classes can be cut at any point, whatever they hold (plain
    and quantised KV only): a family that needs no message-boundary snapshots."""
    return bool(cache) and all(c is not None and getattr(CODECS.get(type(c).__name__), "chunkable", False)
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
        codec = CODECS.get(type(c).__name__)
        why = codec.holds(c) if codec is not None and type(c) is codec.cls else None
        if why:
            return f"layer {i} ({why})"
    return None
