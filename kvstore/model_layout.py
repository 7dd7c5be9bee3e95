"""What cache layout a model makes, as one frozen value: ``ModelLayout``.

A model's layout is, per cache layer, its class and parameters (``Layout.signature``) and
what the model's own cache gives its arrays: for attention KV the geometry (KV heads and
head_dim of keys and values, the KV dtype), for other arrays (recurrent state, a ``State``
class's items) their whole shapes and dtypes. It is what tells a cache of one model from a
cache of another with the same layer classes. ``layout_from_config`` derives it from
mlx-lm's own ``make_prompt_cache`` and a lazy one-token forward (``layout_of_model``: the same,
probed on a model the engine already loaded); ``layout_of`` reads it off a prompt cache. An identity records it as JSON (``ModelLayout.to_json``: the ``layout``
component, hashed, so its form never changes); ``fit`` checks caches against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from .hoststate import isolated
from .layout import ATTENTION, Layout, facts, family

Record = list[dict[str, Any]]  # a ModelLayout as an identity records it (JSON)
Geometry = tuple[tuple[int, int], tuple[int, int]]  # (KV heads, head_dim) of keys and of values
Shapes = tuple[tuple[str, tuple["int | None", ...]], ...]  # array name -> shape (None: any length)


@dataclass(frozen=True)
class ModelLayer:
    """One layer of a model's layout. ``params``: its class and parameters in their stored
    order ("class" among them); ``kv`` / ``dtype``: an attention-KV layer's geometry and
    KV dtype; ``shapes`` / ``dtypes``: any other layer's arrays by name; ``sub``: a
    CacheList's members. None: not recorded (an empty layer, a layout without dtypes)."""

    params: tuple[tuple[str, Any], ...]
    kv: Geometry | None = None
    dtype: str | None = None
    shapes: Shapes | None = None
    dtypes: tuple[tuple[str, str], ...] | None = None
    sub: ModelLayout | None = None

    @property
    def cls(self) -> str:
        return str(self.param("class"))

    def param(self, key: str) -> Any:
        """A parameter's value (lists as tuples), None when the layer has none of that name."""
        return next((v for k, v in self.params if k == key), None)

    def params_json(self) -> dict[str, Any]:
        """Class and parameters as the record has them."""
        return {k: _thaw(v) for k, v in self.params}

    def to_json(self) -> dict[str, Any]:
        out = self.params_json()
        if self.sub is not None:
            out["sub"] = self.sub.to_json()
        if self.kv is not None:
            out["k"], out["v"] = list(self.kv[0]), list(self.kv[1])
        if self.dtype is not None:
            out["dtype"] = self.dtype
        if self.shapes is not None:
            out["shapes"] = {n: list(s) for n, s in self.shapes}
        if self.dtypes is not None:
            out["dtypes"] = dict(self.dtypes)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ModelLayer:
        """A recorded layer; fields of an unexpected form count as not recorded."""
        k, v, sub, shapes, dtypes = (obj.get(n) for n in ("k", "v", "sub", "shapes", "dtypes"))
        pair = [tuple(x) for x in (k, v) if isinstance(x, list) and len(x) == 2]
        return cls(tuple((n, _freeze(x)) for n, x in obj.items()
                         if n not in ("k", "v", "dtype", "shapes", "dtypes", "sub")),
                   kv=(pair[0], pair[1]) if len(pair) == 2 else None,
                   dtype=obj["dtype"] if isinstance(obj.get("dtype"), str) else None,
                   shapes=tuple((n, tuple(s)) for n, s in shapes.items()) if isinstance(shapes, dict) else None,
                   dtypes=tuple(dtypes.items()) if isinstance(dtypes, dict) else None,
                   sub=ModelLayout.from_json(sub) if isinstance(sub, list) else None)


@dataclass(frozen=True)
class ModelLayout:
    """A model's layout, one ``ModelLayer`` per cache layer (see the module doc)."""

    layers: tuple[ModelLayer, ...] = ()

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Any:
        return iter(self.layers)

    def to_json(self) -> Record:
        """The identity's record of it (the ``layout`` component)."""
        return [m.to_json() for m in self.layers]

    @classmethod
    def from_json(cls, obj: list) -> ModelLayout:
        """The layout an identity records (non-dict layers read as empty ones)."""
        return cls(tuple(ModelLayer.from_json(m if isinstance(m, dict) else {}) for m in obj))

    @property
    def classes(self) -> set[str]:
        """Every class name it holds (CacheList members too)."""
        return {m.cls for m in self.layers} | {c for m in self.layers if m.sub is not None for c in m.sub.classes}

    @property
    def has_shapes(self) -> bool:
        """Some layer records whole array shapes (recurrent state)."""
        return any(m.shapes is not None or (m.sub is not None and m.sub.has_shapes) for m in self.layers)

    def with_fixed_axes(self, two: ModelLayout) -> ModelLayout:
        """This layout (after one token) with each recorded state axis that another length
        gives otherwise (``two``: after two tokens) made None, any length: a state that
        keeps the last few tokens (longcat_flash_ngram's n-gram context) grows up to its
        size, while a conv or SSM state is the same whatever the prompt."""
        out = []
        for a, b in zip(self.layers, two.layers):
            if a.sub is not None:
                a = replace(a, sub=a.sub.with_fixed_axes(b.sub or ModelLayout()))
            if a.shapes is not None:
                other = dict(b.shapes or ())
                a = replace(a, shapes=tuple((n, tuple(d if d == e else None for d, e in zip(s, other.get(n, s))))
                                            for n, s in a.shapes))
            out.append(a)
        return ModelLayout(tuple(out))

    def without_dtype(self) -> ModelLayout:
        """The layout with no dtype recorded (a lazily initialised model's are float32)."""
        return ModelLayout(tuple(replace(m, dtype=None, dtypes=None, sub=m.sub and m.sub.without_dtype())
                                 for m in self.layers))


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def _thaw(v: Any) -> Any:
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


def layout_from_config(model_dir: Path) -> Record:
    """The identity's record of the layout mlx-lm builds for this model, with each
    attention-KV layer's geometry (KV heads and head_dim of keys and values, and the KV
    dtype).

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
    return isolated(lambda: _layout(*_lazy_model(Path(model_dir))).to_json(), "kvstore-identity")  # draws no RNG of the caller


def layout_of_model(model: Any) -> Record:
    """``layout_from_config``'s record, probed on a model the engine already loaded from
    that directory (``mlx_lm.load``, no adapter): the same record, without building the
    model a second time (config read, weight headers, module tree, quantisation). The
    probe is the same lazy one-token forward, traced, never evaluated, on a thread of its
    own; the model's weights are neither read nor changed. ``tests/system/test_identity``
    proves the records equal on every tiny architecture."""
    return isolated(lambda: _layout(model, True).to_json(), "kvstore-identity")


def _layout(model: Any, real: bool) -> ModelLayout:
    """The layout of ``model``; its dtypes only when ``real`` (its weights were loaded)."""
    from mlx_lm.models.cache import make_prompt_cache

    try:
        made = model_layout_of(_probe(model))
        if made.has_shapes:  # recurrent state: which of its axes grow with the prompt?
            made = made.with_fixed_axes(model_layout_of(_probe(model, 2)))
    except Exception:  # an architecture the probe cannot run: classes only
        return model_layout_of(make_prompt_cache(model))
    return made if real else made.without_dtype()


def _lazy_model(model_dir: Path) -> tuple[Any, bool]:
    """The model, unevaluated: lazily loaded from its weight files (True) or, when mlx-lm
    cannot load the directory (no safetensors, a GGUF), lazily initialised (False)."""
    try:
        from mlx_lm.utils import load_model

        return load_model(model_dir, lazy=True)[0], True
    except Exception:
        from mlx_lm.utils import _get_classes  # present in mlx-lm 0.31 and 0.32

        from .files import read_foreign

        model_config = json.loads(read_foreign(model_dir / "config.json"))
        model_cls, args_cls = _get_classes(model_config)
        return model_cls(args_cls.from_dict(model_config)), False


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


def layout_of(cache: list) -> Record:
    """The identity's record of a (possibly empty) prompt cache's layout: classes and
    parameters without lengths, and each layer's geometry when it holds arrays (see
    ``describe_layout``)."""
    return model_layout_of(cache).to_json()


def model_layout_of(cache: list) -> ModelLayout:
    """``layout_of`` as a value."""
    from .codec import encode_cache

    return describe_layout(*encode_cache(cache))


def describe_layout(tensors: dict[str, Any], cache_layout: Layout, prefix: str = "") -> ModelLayout:
    """``cache_layout``'s classes and parameters plus, for every attention-KV layer (also inside
    a CacheList) whose tensors are present, its geometry (``kv_geometry``): what tells a
    cache of this model from one of another model with the same layer classes; for every
    other layer holding arrays (recurrent state, a ``State`` class), their whole shapes and
    dtypes by name (they hold no token axis kvstore knows). With batch 1 and the token
    axis, that is every array's whole shape (``fit``). Reads array shapes and dtypes only."""
    out = []
    for i, m in enumerate(cache_layout):
        at = f"{prefix}{i}."
        params = tuple((k, _freeze(v)) for k, v in m.signature().items() if k != "sub")
        if m.facts.nested:
            out.append(ModelLayer(params, sub=describe_layout(tensors, m["sub"], f"{at}s")))
        elif family(m.cls) == ATTENTION:
            geo = kv_geometry(tensors, m, at)
            out.append(ModelLayer(params, kv=geo[0], dtype=geo[1]) if geo else ModelLayer(params))
        else:
            held = {n[len(at):]: a for n, a in tensors.items() if n.startswith(at) and "." not in n[len(at):]}
            out.append(ModelLayer(params, shapes=tuple((n, tuple(int(d) for d in a.shape)) for n, a in sorted(held.items())),
                                  dtypes=tuple((n, dtype_name(a)) for n, a in sorted(held.items())))
                       if held else ModelLayer(params))
    return ModelLayout(tuple(out))


def dtype_name(a: Any) -> str:
    """An array's dtype name (``float32``) for an mx / numpy array or an ``ArraySpec``."""
    return str(a.dtype).rsplit(".", 1)[-1]


def kv_geometry(tensors: dict[str, Any], meta: Mapping[str, Any], prefix: str = "") -> tuple[Geometry, str] | None:
    """((KV heads, head_dim) of keys and of values, KV dtype name) of one attention-KV
    layer's encoded tensors (``prefix`` + ``k`` / ``v``, or the packed ``k0..2`` /
    ``v0..2`` of a quantised class, whose head_dim is unpacked from ``bits``); None when
    the layer holds no arrays or they are not (batch, heads, tokens, dim)."""
    if facts(meta.get("class")).quantized:
        k, v, scales = (tensors.get(prefix + n) for n in ("k0", "v0", "k1"))
        bits = int(meta.get("bits") or 32)  # k0 / v0 pack head_dim * bits / 32 uint32 words
    else:
        k, v = (tensors.get(prefix + n) for n in ("k", "v"))
        scales, bits = k, 32
    if k is None or v is None or scales is None or k.ndim != 4 or v.ndim != 4:
        return None
    return (((int(k.shape[1]), int(k.shape[-1]) * 32 // bits), (int(v.shape[1]), int(v.shape[-1]) * 32 // bits)),
            dtype_name(scales))
