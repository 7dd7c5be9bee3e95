"""Does a stored or live cache fit a model: ``layout_problem``, ``shape_problem``.

A cache fits an identity's model when it has the layers the model makes (same count, per
layer the same class family and, for recurrent state, the same parameters), each
attention layer of the recorded KV geometry, and every array the shape and dtype the
model's own cache gives it (``expected_arrays``, read from ``layout.CLASSES``: which
arrays a class holds and what their axes are). What the model makes is the identity's
``ModelLayout``. Runs on shapes alone (arrays, or ``ArraySpec`` from a blob header),
before anything is allocated or stored, without MLX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .layout import ATTENTION, KV, MEMBERS, QUANT_KV, STATE_ARRAYS, STATE_ITEMS, Layer, Layout, facts, family
from .model_layout import ModelLayer, ModelLayout, describe_layout, dtype_name

# The shape an array must have, axis by axis: an int (that length), TOKENS (the token axis:
# any length, the same in every array of the layer), None (any length: an axis the
# identity's record does not fix) and, last, ``...`` (any further axes).
Pattern = tuple[Any, ...]
Expected = dict[str, tuple[Pattern, "str | None"]]  # array name -> (pattern, dtype name or None: any)
TOKENS = "T"
ALL, ALL_OR_NONE, ANY = "all", "all or none", "any"  # which of its expected arrays a layer holds


class IdentityLike(Protocol):
    """What the checks read of an identity: its components and its name."""

    @property
    def info(self) -> dict[str, Any]: ...  # read-only: Identity is a frozen dataclass

    @property
    def name(self) -> str: ...


def expected_layout(ident: IdentityLike) -> ModelLayout | None:
    """The layout the identity records for its model; None without one, or with a draft
    model (whose layers the engine appends)."""
    comps = ident.info.get("components") or {}
    want = comps.get("layout")
    return ModelLayout.from_json(want) if isinstance(want, list) and not comps.get("draft") else None


def layout_problem(ident: IdentityLike, tensors: dict[str, Any], cache_layout: Layout) -> str | None:
    """Why a cache does not fit the identity's model, or None: it must have the layers the
    model makes (same count; per layer the same class family: attention KV in any of its
    forms, or the same recurrent class) and, where the identity records it, each attention
    layer's KV geometry (heads and head_dim of keys and values, and dtype). Unknown (None)
    for identities without a layout component, or with a draft model (whose layers the
    engine appends); identities without geometry are checked on classes only."""
    want = expected_layout(ident)  # ``tensors``: arrays, or ``ArraySpec`` from a blob header
    if want is None:
        return shape_problem(ident, tensors, cache_layout)

    def diff(a: ModelLayout, b: ModelLayout, where: str) -> str | None:
        if len(a) != len(b):
            return f"cache has {len(a)} layers{where}, {ident.name} makes {len(b)} (a cache from another model?)"
        for i, (x, y) in enumerate(zip(a, b)):
            fam = family(x.cls)
            if fam != family(y.cls):
                return (f"cache layer {i}{where} is {x.cls}, {ident.name} makes {y.cls} "
                        "(a cache from another model?)")
            if fam != ATTENTION and not facts(x.cls).nested and dict(x.params) != dict(y.params):  # recurrent state: exact
                return (f"cache layer {i}{where} is {x.params_json()}, {ident.name} makes {y.params_json()} "
                        "(a cache from another model?)")
            d = _geometry_problem(x, y) if fam == ATTENTION else None
            if d:
                return f"cache layer {i}{where} {d[0]}, {ident.name} makes {d[1]} (a cache from another model?)"
            if facts(x.cls).nested:
                sub = diff(x.sub or ModelLayout(), y.sub or ModelLayout(), f" (in layer {i})")
                if sub:
                    return sub
        return None

    return diff(describe_layout(tensors, cache_layout), want, "") or shape_problem(ident, tensors, cache_layout)


def shape_problem(ident: IdentityLike, tensors: dict[str, Any], cache_layout: Layout) -> str | None:
    """Why an array of the cache is not one the identity's model makes, or None: every
    array of every layer (any class, inside CacheLists too) must be one its class holds,
    with the whole shape the model's own cache gives it but for the token axis (batch 1,
    the recorded heads, head_dim, state sizes; ``expected_arrays``), the same token
    length across the layer, and the recorded dtype; a quantised layer must be of the
    identity's ``kv_bits`` / ``kv_group_size`` when it names them (an engine that
    quantises on its own, as exo does, leaves them None: then the layer's own bits).
    Where the identity records no layout (or one the engine extends: a draft model),
    each class's own rules still hold (batch 1, four axes for attention KV). Runs on
    shapes alone, before anything is allocated."""
    comps = ident.info.get("components") or {}
    want = expected_layout(ident)
    quant = (comps["kv_bits"], comps.get("kv_group_size")) if isinstance(comps.get("kv_bits"), int) else None
    groups: dict[str, dict[str, Any]] = {}
    for name, a in tensors.items():
        p, _, n = name.rpartition(".")
        groups.setdefault(p, {})[n] = a

    def layers(metas: Layout, wants: ModelLayout | None, prefix: str, where: str) -> str | None:
        for i, m in enumerate(metas):
            y = wants.layers[i] if wants is not None and i < len(wants) else None
            p, at = f"{prefix}{i}", f"cache layer {i}{where}"
            try:
                expected, rule = expected_arrays(m, y, quant)
            except ValueError as e:
                return f"{at} {e} ({ident.name})"
            why = _arrays_problem(groups.pop(p, {}), expected, rule)
            if why:
                return f"{at} {why[0]}, {ident.name} makes {why[1]} (not a cache this model makes)"
            if m.facts.nested:
                sub = layers(m["sub"], y.sub if y is not None else None, f"{p}.s", f" (in layer {i})")
                if sub:
                    return sub
        return None

    why = layers(cache_layout, want, "", "")
    if why is None and groups:
        name = next(f"{p}.{n}" for p, g in groups.items() for n in g)
        why = f"the cache holds an array {name!r} of no layer"
    return why


def expected_arrays(meta: Layer, want: ModelLayer | None,
                    quant: tuple[int, int | None] | None = None) -> tuple[Expected, str]:
    """Every array a layer of stored ``meta`` may hold, with the shape and dtype the model's
    own cache gives it (``want``: the identity's record of the layer, None when it has
    none: then only what every prompt cache of the class has, such as batch 1; ``quant``:
    the identity's KV quantisation, (bits, group size)), and which of them it holds (ALL,
    ALL_OR_NONE, ANY). ValueError when no cache the model makes is of this meta. A cache of
    these shapes is one the model's code can run (mlx-lm's batching merges a layer's
    arrays into a batch-1 slot; a batch of 2 or a fifth axis kills the generation thread)."""
    arrays = meta.facts.arrays
    geo = want.kv if want is not None and want.kv is not None else ((None, None), (None, None))
    dtype = want.dtype if want is not None else None
    if arrays == KV:  # (1, KV heads, tokens, head_dim)
        (kh, kd), (vh, vd) = geo
        return {"k": ((1, kh, TOKENS, kd), dtype), "v": ((1, vh, TOKENS, vd), dtype)}, ALL_OR_NONE
    if arrays == QUANT_KV:
        named = quant if quant is not None else (want.param("bits"), want.param("group_size")) if want else (None, None)
        return _quant_arrays(meta, named, geo, dtype), ALL_OR_NONE
    if arrays == STATE_ARRAYS:  # the recorded state arrays, exactly and all; else any of ``size`` of batch 1
        if want is not None and want.shapes is not None:
            dts = dict(want.dtypes or ())
            return {n: (tuple(s), dts.get(n)) for n, s in want.shapes}, ALL
        return {f"a{i}": ((1, ...), None) for i in range(meta["size"])}, ANY
    if arrays == STATE_ITEMS:  # every array item; recorded: its number of axes, batch and dtype
        rec, dts = dict(want.shapes or ()) if want else {}, dict(want.dtypes or ()) if want else {}
        out: Expected = {}
        for i, it in enumerate(meta["items"]):
            if it[0] == "a":
                s = rec.get(f"t{i}")
                out[f"t{i}"] = ((*s[:1], *[None] * (len(s) - 1)) if isinstance(s, tuple) else (...,), dts.get(f"t{i}"))
        return out, ALL
    assert arrays == MEMBERS, arrays  # a CacheList holds its members' arrays, none of its own
    return {}, ALL


def _quant_arrays(meta: Layer, named: tuple[Any, Any], geo: tuple, dtype: str | None) -> Expected:
    """``mx.quantize``'s parts of keys and values: the packed words (head_dim * bits / 32
    uint32) and the scales and biases (head_dim / group_size, the KV dtype), of the bits
    and group size ``named`` (the identity's ``kv_bits``, or a recorded quantised layer's)
    when it names them."""
    bits, group = meta.get("bits"), meta.get("group_size")
    if not isinstance(bits, int) or not 0 < bits <= 8 or not isinstance(group, int) or group <= 0:
        raise ValueError(f"is {bits}-bit KV in groups of {group}, which no quantisation makes")
    if named[0] is not None and tuple(named) != (bits, group):
        raise ValueError(f"is {bits}-bit KV in groups of {group}, the model's is {named[0]}-bit in groups "
                         f"of {named[1]}")
    out: Expected = {}
    for n, (h, d) in zip("kv", geo):
        if d is not None and (d * bits % 32 or d % group):
            raise ValueError(f"is {bits}-bit KV in groups of {group}, which head_dim {d} does not fit")
        out[f"{n}0"] = ((1, h, TOKENS, None if d is None else d * bits // 32), "uint32")
        out[f"{n}1"] = out[f"{n}2"] = ((1, h, TOKENS, None if d is None else d // group), dtype)
    return out


def _arrays_problem(held: dict[str, Any], expected: Expected, rule: str) -> tuple[str, str] | None:
    """(what one layer's arrays ``held`` (name -> array or spec) are, what the model
    makes) when they differ, else None."""
    extra = sorted(set(held) - set(expected))
    if extra:
        return f"holds an array {extra[0]!r}", _expected_text(expected)
    if rule != ANY and len(held) != len(expected) and (held or rule == ALL):
        return f"holds {', '.join(sorted(held)) or 'no arrays'} only", _expected_text(expected)
    tokens = set()
    for n, a in sorted(held.items()):
        pattern, dtype = expected[n]
        shape = tuple(int(d) for d in a.shape)
        open_ = bool(pattern) and pattern[-1] is ...
        fixed = pattern[:-1] if open_ else pattern
        if len(shape) < len(fixed) or (not open_ and len(shape) != len(fixed)) or any(
                p is not None and p != TOKENS and p != d for p, d in zip(fixed, shape)):
            return f"holds {n} of shape {list(shape)}", _pattern_text(pattern)
        tokens |= {d for p, d in zip(fixed, shape) if p == TOKENS}
        if dtype is not None and dtype_name(a) != dtype:
            return f"holds {n} of dtype {dtype_name(a)}", dtype
    if len(tokens) > 1:
        return f"holds arrays of {' and '.join(map(str, sorted(tokens)))} positions", "one length"
    return None


def _pattern_text(pattern: tuple) -> str:
    """``[1, 2, T, 32]``: T the token axis, ? any length, ... any further axes."""
    return "[" + ", ".join("?" if p is None else "..." if p is ... else str(p) for p in pattern) + "]"


def _expected_text(expected: Expected) -> str:
    return ", ".join(f"{n} {_pattern_text(p)}" for n, (p, _) in sorted(expected.items())) or "no arrays"


def _geometry_problem(got: ModelLayer, want: ModelLayer) -> tuple[str, str] | None:
    """(what the cache layer holds, what the model makes) when their recorded KV geometry
    differs; None when it agrees or either side does not record it (an empty layer, an
    identity without geometry or without dtype)."""
    if got.kv is None or want.kv is None:
        return None
    if got.kv != want.kv:
        return f"has {_shape_text(got.kv, True)}", _shape_text(want.kv, False)
    if got.dtype and want.dtype and got.dtype != want.dtype:
        return f"holds {got.dtype} KV", want.dtype
    return None


def _shape_text(geo: tuple, long: bool) -> str:
    (kh, kd), (vh, vd) = geo
    if (kh, kd) == (vh, vd):
        return f"{kh} KV heads x head_dim {kd}" if long else f"{kh} x {kd}"
    return f"keys {kh} x {kd} and values {vh} x {vd}"


@dataclass(frozen=True)
class ArraySpec:
    """An array's shape and dtype name without its data (from a blob header): what
    ``describe_layout`` reads of a tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)
