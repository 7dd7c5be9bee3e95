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
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models import cache as C

Tensors = dict[str, mx.array]
Layout = list[dict[str, Any]]


class Unsupported(TypeError):
    """This cache object cannot be persisted (it stays memory-only)."""


def _fresh(x: mx.array) -> mx.array:
    return x[:] if x.ndim else x


def _kv_encode(c: Any, n: int) -> Tensors:
    return {"k": c.keys[..., :n, :], "v": c.values[..., :n, :]}


class _KVCodec:
    cls = C.KVCache
    chunkable = True

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        if c.keys is None:
            return {}, {"offset": 0}
        return _kv_encode(c, c.offset), {"offset": int(c.offset)}

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = C.KVCache()
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset = int(meta["offset"])
        return c


class _QuantKVCodec:
    cls = C.QuantizedKVCache
    chunkable = True

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
        c = C.QuantizedKVCache(group_size=meta["group_size"], bits=meta["bits"])
        if "k0" in t:
            c.keys = tuple(_fresh(t[f"k{i}"]) for i in range(3))
            c.values = tuple(_fresh(t[f"v{i}"]) for i in range(3))
            c.offset = int(meta["offset"])
        return c


class _RotatingCodec:
    """The ring buffer is stored as it is, with its write index: rotation state is history."""

    cls = C.RotatingKVCache
    chunkable = False

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "keep": int(c.keep), "max_size": int(c.max_size),
                "idx": int(c._idx)}
        if c.keys is None:
            return {}, meta
        return {"k": c.keys, "v": c.values}, meta

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = C.RotatingKVCache(max_size=meta["max_size"], keep=meta["keep"])
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset, c._idx = int(meta["offset"]), int(meta["idx"])
        return c


class _ChunkedCodec:
    cls = C.ChunkedKVCache
    chunkable = False

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        meta = {"offset": int(c.offset), "chunk_size": int(c.chunk_size),
                "start": int(c.start_position)}
        if c.keys is None:
            return {}, meta
        return _kv_encode(c, c.offset - c.start_position), meta

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = C.ChunkedKVCache(meta["chunk_size"])
        if "k" in t:
            c.keys, c.values = _fresh(t["k"]), _fresh(t["v"])
            c.offset, c.start_position = int(meta["offset"]), int(meta["start"])
        return c


class _ArraysCodec:
    """Recurrent state (conv and SSM states): only valid at exactly its own length."""

    cls = C.ArraysCache
    chunkable = False

    def encode(self, c: Any) -> tuple[Tensors, dict]:
        if getattr(c, "left_padding", None) is not None or getattr(c, "lengths", None) is not None:
            raise Unsupported("ArraysCache with batch padding/lengths (a batched cache)")
        t = {f"a{i}": a for i, a in enumerate(c.cache) if a is not None}
        return t, {"size": len(c.cache)}

    def decode(self, t: Tensors, meta: dict) -> Any:
        c = C.ArraysCache(meta["size"])
        for i in range(meta["size"]):
            if f"a{i}" in t:
                c.cache[i] = _fresh(t[f"a{i}"])
        return c


class _CacheListCodec:
    cls = C.CacheList
    chunkable = False  # decided per sub-cache by is_chunkable

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
        return C.CacheList(*subs)


CODECS: dict[str, Any] = {
    codec.cls.__name__: codec
    for codec in (_KVCodec(), _QuantKVCodec(), _RotatingCodec(), _ChunkedCodec(),
                  _ArraysCodec(), _CacheListCodec())
}


def encode_layer(c: Any) -> tuple[Tensors, dict]:
    """One cache layer to (tensors, meta); meta["class"] names the codec."""
    codec = CODECS.get(type(c).__name__)
    if codec is None or type(c) is not codec.cls:
        raise Unsupported(f"no codec for cache class {type(c).__module__}.{type(c).__name__}")
    tensors, meta = codec.encode(c)
    meta["class"] = codec.cls.__name__
    return tensors, meta


def decode_layer(t: Tensors, meta: dict) -> Any:
    codec = CODECS.get(meta.get("class", ""))
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


def _walk(layout: Layout) -> list[dict]:
    flat: list[dict] = []
    for meta in layout:
        flat.extend(_walk(meta["sub"]) if meta["class"] == "CacheList" else [meta])
    return flat


def is_chunkable(layout: Layout, n_tokens: int) -> bool:
    """True when every layer is plain or quantised KV holding exactly ``n_tokens`` positions:
    such a cache can be cut into token chunks and glued back (prefix reuse at any length)."""
    return all(CODECS[m["class"]].chunkable and m["offset"] == n_tokens for m in _walk(layout))


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
    def strip(m: dict) -> dict:
        m = {k: v for k, v in m.items() if k not in ("offset", "idx", "start")}
        if "sub" in m:
            m["sub"] = [strip(s) for s in m["sub"]]
        return m
    return [strip(m) for m in layout]


def slice_tokens(tensors: Tensors | dict, a: int, b: int) -> dict:
    """Token range [a, b) of chunkable tensors (token axis is -2); works on mx or numpy."""
    return {k: v[..., a:b, :] for k, v in tensors.items()}


def concat_tokens(parts: list[Tensors]) -> Tensors:
    """Glue token-range tensors back together along the token axis."""
    if len(parts) == 1:
        return parts[0]
    return {k: mx.concatenate([p[k] for p in parts], axis=-2) for k in parts[0]}


def cache_nbytes(tensors: Tensors) -> int:
    return sum(int(v.nbytes) for v in tensors.values())


def trimmable(cache: list[Any]) -> bool:
    return bool(cache) and all(c.is_trimmable() for c in cache)


Factory = Callable[[], list[Any]]
