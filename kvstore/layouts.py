"""Layout checks: what cache layout a model makes, and whether a stored cache fits it.

The layout is the per-layer cache classes and their parameters (``Layout.signature``)
plus, for each attention-KV layer, its geometry (KV heads, head_dim, dtype): what tells a
cache of one model from a cache of another with the same layer classes. ``layout_from_config``
derives it from mlx-lm's own ``make_prompt_cache`` and a lazy one-token forward (part of
every model identity); ``layout_problem`` checks a stored or live cache against it before
anything is allocated or stored. Which classes form one family (attention KV in any of its
forms) is ``cachelayout.CLASSES``'s to say (``cachelayout.family``): no class-name switch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from .cachelayout import ATTENTION, Layout, family
from .hoststate import isolated


class IdentityLike(Protocol):
    """What the checks read of an identity: its components and its name."""

    @property
    def info(self) -> dict[str, Any]: ...  # read-only: Identity is a frozen dataclass

    @property
    def name(self) -> str: ...


def layout_from_config(model_dir: Path) -> list:
    """The per-layer cache layout mlx-lm builds for this model, with each attention-KV
    layer's geometry (KV heads and head_dim of keys and values, and the KV dtype).

    Nothing is evaluated and no weight data is read: the model is built lazily (from the
    safetensors headers when mlx-lm can load the directory, else from config.json alone)
    and one token is run through it lazily, so the cache arrays' shapes and dtype are
    known while nothing is computed. The dtype is only recorded when the real weights were
    (lazily) loaded: a lazily initialised model is float32, whatever the weights are. (An
    mlx-lm adapter keeps the dtype: LoRA / DoRA cast their output to the input's.) If the
    probe fails for an architecture, the layout is classes and parameters only, as
    mlx-lm's ``make_prompt_cache`` gives them: never an error. Built on a thread of its own
    (``hoststate.isolated``): building a model draws from MLX's per-thread random key.
    """
    return isolated(lambda: _layout(Path(model_dir)), "kvstore-identity")  # draws no RNG of the caller


def _layout(model_dir: Path) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    model, real = _lazy_model(model_dir)
    try:
        layout = layout_of(_probe(model))
        if _has_shapes(layout):  # recurrent state: which of its axes grow with the prompt?
            layout = _fixed_axes(layout, layout_of(_probe(model, 2)))
    except Exception:  # an architecture the probe cannot run: classes only
        return layout_of(make_prompt_cache(model))
    return layout if real else _without_dtype(layout)


def _has_shapes(layout: list) -> bool:
    return any("shapes" in m or _has_shapes(m.get("sub") or []) for m in layout)


def _fixed_axes(one: list, two: list) -> list:
    """``one``'s layout (after one token) with each recorded state axis that another
    length gives otherwise (``two``: after two tokens) made None, any length: a state
    that keeps the last few tokens (longcat_flash_ngram's n-gram context) grows up to
    its size, while a conv or SSM state is the same whatever the prompt."""
    out = []
    for a, b in zip(one, two):
        a = dict(a)
        if "sub" in a:
            a["sub"] = _fixed_axes(a["sub"], b.get("sub") or [])
        if "shapes" in a:
            other = b.get("shapes") or {}
            a["shapes"] = {n: [d if d == e else None for d, e in zip(s, other.get(n, s))] for n, s in a["shapes"].items()}
        out.append(a)
    return out


def _lazy_model(model_dir: Path) -> tuple[Any, bool]:
    """The model, unevaluated: lazily loaded from its weight files (True) or, when mlx-lm
    cannot load the directory (no safetensors, a GGUF), lazily initialised (False)."""
    try:
        from mlx_lm.utils import load_model

        return load_model(model_dir, lazy=True)[0], True
    except Exception:
        from mlx_lm.utils import _get_classes  # present in mlx-lm 0.31 and 0.32

        from .files import read_foreign

        config = json.loads(read_foreign(model_dir / "config.json"))
        model_cls, args_cls = _get_classes(config)
        return model_cls(args_cls.from_dict(config)), False


def _probe(model: Any, n: int = 1) -> list:
    """A prompt cache after ``n`` tokens went through ``model``, never evaluated: its arrays
    have the shapes and dtype the engine's caches will have. The forward runs while
    ``mx.compile`` traces it, where MLX refuses any evaluation (an architecture that reads
    a value mid-forward raises instead of computing, or reading, the whole model)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.compile(lambda tokens: model(tokens, cache=cache))(mx.array([[0] * n]))
    return cache


def _without_dtype(layout: list) -> list:
    out = []
    for m in layout:
        m = {k: v for k, v in m.items() if k not in ("dtype", "dtypes")}
        if "sub" in m:
            m["sub"] = _without_dtype(m["sub"])
        out.append(m)
    return out


def layout_of(cache: list) -> list:
    """Classes and parameters of a (possibly empty) prompt cache, without lengths, and each
    attention-KV layer's geometry when it holds arrays (see ``describe_layout``)."""
    from .codec import encode_cache

    return describe_layout(*encode_cache(cache))


def describe_layout(tensors: dict[str, Any], layout: Layout) -> list:
    """``layout.signature()`` plus, for every attention-KV layer (also inside a
    CacheList) whose tensors are present, ``k`` / ``v`` = [KV heads, head_dim] and
    ``dtype``: what tells a cache of this model from one of another model with the same
    layer classes; for every other layer holding arrays (recurrent state, a ``State``
    class), their whole ``shapes`` and ``dtypes`` by name (they hold no token axis kvstore
    knows). With batch 1 and the token axis, that is every array's whole shape
    (``codec`` ``shapes``). Reads array shapes and dtypes only."""
    sig = layout.signature()
    for i, (s, m) in enumerate(zip(sig, layout)):
        _add_geometry(s, m, tensors, f"{i}.")
    return sig


def _add_geometry(sig: dict, meta: Mapping[str, Any], tensors: dict[str, Any], prefix: str) -> None:
    if meta.get("class") == "CacheList":
        for j, (s, m) in enumerate(zip(sig.get("sub", []), meta.get("sub", []))):
            _add_geometry(s, m, tensors, f"{prefix}s{j}.")
    elif family(str(meta.get("class"))) == ATTENTION:
        sig.update(kv_geometry(tensors, meta, prefix))
    else:
        held = {n[len(prefix):]: a for n, a in tensors.items() if n.startswith(prefix) and "." not in n[len(prefix):]}
        if held:
            sig["shapes"] = {n: [int(d) for d in a.shape] for n, a in sorted(held.items())}
            sig["dtypes"] = {n: _dtype(a) for n, a in sorted(held.items())}


def _dtype(a: Any) -> str:
    """An array's dtype name (``float32``) for an mx / numpy array or an ``ArraySpec``."""
    return str(a.dtype).rsplit(".", 1)[-1]


def kv_geometry(tensors: dict[str, Any], meta: Mapping[str, Any], prefix: str = "") -> dict:
    """``{"k": [heads, head_dim], "v": [heads, head_dim], "dtype": name}`` of one
    attention-KV layer's encoded tensors (``prefix`` + ``k`` / ``v``, or the packed
    ``k0..2`` / ``v0..2`` of a QuantizedKVCache, whose head_dim is unpacked from ``bits``);
    {} when the layer holds no arrays or they are not (batch, heads, tokens, dim)."""
    if meta.get("class") == "QuantizedKVCache":
        k, v, scales = (tensors.get(prefix + n) for n in ("k0", "v0", "k1"))
        bits = int(meta.get("bits") or 32)  # k0 / v0 pack head_dim * bits / 32 uint32 words
    else:
        k, v = (tensors.get(prefix + n) for n in ("k", "v"))
        scales, bits = k, 32
    if k is None or v is None or scales is None or k.ndim != 4 or v.ndim != 4:
        return {}
    return {"k": [int(k.shape[1]), int(k.shape[-1]) * 32 // bits],
            "v": [int(v.shape[1]), int(v.shape[-1]) * 32 // bits],
            "dtype": _dtype(scales)}


def layout_problem(ident: IdentityLike, tensors: dict[str, Any], layout: Layout) -> str | None:
    """Why a cache does not fit the identity's model, or None: it must have the layers the
    model makes (same count; per layer the same class family: attention KV in any of its
    forms, or the same recurrent class) and, where the identity records it, each attention
    layer's KV geometry (heads and head_dim of keys and values, and dtype). Unknown (None)
    for identities without a layout component, or with a draft model (whose layers the
    engine appends); identities without geometry are checked on classes only."""
    comps = ident.info.get("components") or {}
    want = comps.get("layout")  # ``tensors``: arrays, or ``ArraySpec`` from a blob header
    if not isinstance(want, list) or comps.get("draft"):
        return shape_problem(ident, tensors, layout)

    def fam(m: dict) -> str:
        return family(str(m.get("class")))

    def diff(a: list, b: list, where: str) -> str | None:
        if len(a) != len(b):
            return f"cache has {len(a)} layers{where}, {ident.name} makes {len(b)} (a cache from another model?)"
        for i, (x, y) in enumerate(zip(a, b)):
            if fam(x) != fam(y):
                return (f"cache layer {i}{where} is {x.get('class')}, {ident.name} makes {y.get('class')} "
                        "(a cache from another model?)")
            if fam(x) not in (ATTENTION, "CacheList") and _params(x) != _params(y):  # recurrent state: exact
                return (f"cache layer {i}{where} is {_params(x)}, {ident.name} makes {_params(y)} "
                        "(a cache from another model?)")
            d = _geometry_problem(x, y) if fam(x) == ATTENTION else None
            if d:
                return f"cache layer {i}{where} {d[0]}, {ident.name} makes {d[1]} (a cache from another model?)"
            if x.get("class") == "CacheList":
                sub = diff(x.get("sub", []), y.get("sub", []), f" (in layer {i})")
                if sub:
                    return sub
        return None

    return diff(describe_layout(tensors, layout), want, "") or shape_problem(ident, tensors, layout)


def shape_problem(ident: IdentityLike, tensors: dict[str, Any], layout: Layout) -> str | None:
    """Why an array of the cache is not one the identity's model makes, or None: every
    array of every layer (any class, inside CacheLists too) must be one its class holds,
    with the whole shape the model's own cache gives it but for the token axis (batch 1,
    the recorded heads, head_dim, state sizes; ``codec`` ``shapes``), the same token
    length across the layer, and the recorded dtype; a quantised layer must be of the
    identity's ``kv_bits`` / ``kv_group_size`` when it names them (an engine that
    quantises on its own, as exo does, leaves them None: then the layer's own bits).
    Where the identity records no layout (or one the engine extends: a draft model),
    each class's own rules still hold (batch 1, four axes for attention KV). Runs on
    shapes alone, before anything is allocated."""
    from .codec import STORED

    comps = ident.info.get("components") or {}
    want = comps.get("layout") if isinstance(comps.get("layout"), list) and not comps.get("draft") else None
    quant = (comps["kv_bits"], comps.get("kv_group_size")) if isinstance(comps.get("kv_bits"), int) else None
    groups: dict[str, dict[str, Any]] = {}
    for name, a in tensors.items():
        p, _, n = name.rpartition(".")
        groups.setdefault(p, {})[n] = a

    def layers(metas: Layout, wants: list | None, prefix: str, where: str) -> str | None:
        for i, m in enumerate(metas):
            y = wants[i] if wants is not None and i < len(wants) and isinstance(wants[i], dict) else {}
            if quant is not None and m["class"] != "CacheList":  # the quantisation the engine runs
                y = {**y, "bits": quant[0], "group_size": quant[1]}
            p, at = f"{prefix}{i}", f"cache layer {i}{where}"
            try:
                expected, rule = STORED[m["class"]].shapes(m, y)
            except ValueError as e:
                return f"{at} {e} ({ident.name})"
            why = _arrays_problem(groups.pop(p, {}), expected, rule)
            if why:
                return f"{at} {why[0]}, {ident.name} makes {why[1]} (not a cache this model makes)"
            if m["class"] == "CacheList":
                sub = layers(m["sub"], y.get("sub") if wants is not None else None, f"{p}.s", f" (in layer {i})")
                if sub:
                    return sub
        return None

    why = layers(layout, want, "", "")
    if why is None and groups:
        name = next(f"{p}.{n}" for p, g in groups.items() for n in g)
        why = f"the cache holds an array {name!r} of no layer"
    return why


def _arrays_problem(held: dict[str, Any], expected: dict[str, tuple[tuple, str | None]],
                    rule: str) -> tuple[str, str] | None:
    """(what one layer's arrays ``held`` (name -> array or spec) are, what the model
    makes) when they differ, else None."""
    from .codec import ALL, ANY, TOKENS

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
        if dtype is not None and _dtype(a) != dtype:
            return f"holds {n} of dtype {_dtype(a)}", dtype
    if len(tokens) > 1:
        return f"holds arrays of {' and '.join(map(str, sorted(tokens)))} positions", "one length"
    return None


def _pattern_text(pattern: tuple) -> str:
    """``[1, 2, T, 32]``: T the token axis, ? any length, ... any further axes."""
    return "[" + ", ".join("?" if p is None else "..." if p is ... else str(p) for p in pattern) + "]"


def _expected_text(expected: dict[str, tuple[tuple, str | None]]) -> str:
    return ", ".join(f"{n} {_pattern_text(p)}" for n, (p, _) in sorted(expected.items())) or "no arrays"


def _params(m: dict) -> dict:
    """A layer's class and parameters without its arrays' shapes (``shape_problem``'s)."""
    return {k: v for k, v in m.items() if k not in ("shapes", "dtypes")}


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


@dataclass(frozen=True)
class ArraySpec:
    """An array's shape and dtype name without its data (from a blob header): what
    ``describe_layout`` reads of a tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)
