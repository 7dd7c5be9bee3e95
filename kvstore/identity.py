"""Model identity: a digest of everything that makes a KV cache valid for reuse.

An entry is only ever returned to the identity that wrote it. The digest covers:
- the weights (xxh3-128 of every weight file; remembered by device, inode, size, mtime and
  ctime so a restart does not re-hash gigabytes: ctime is what ``cp -p``, ``rsync -a`` or
  ``touch -r`` cannot set back, so a file replaced under an old mtime is hashed again),
- the model config, the tokenizer files and the chat template (each its own component),
- KV quantisation (bits, group size) and the per-layer cache layout (classes and
  parameters such as RotatingKVCache max_size / keep, and for attention-KV layers the KV
  heads, head_dim and dtype), derived with mlx-lm's own ``make_prompt_cache`` and a lazy
  (never evaluated) one-token forward, so it tracks what the installed mlx-lm builds,
- adapter and draft model files, when the caller has them,
- the model's implementation (``code_digest``): the source of the mlx-lm module that
  builds the model, of every ``mlx_lm.models`` module it uses (RoPE, attention helpers),
  and of the cache classes in its layout, so an mlx-lm upgrade that changes how KV is
  computed starts a new identity while one that leaves that code alone keeps the cache,
- kvstore's format version.

mlx / mlx-lm versions are recorded, not hashed: the code digest is what decides.
``watch`` gives the stat signature of every file an identity was derived from, so a
process notices a model directory that changed under it (see ``KVStore.identity``).
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .hoststate import isolated
from .keys import FORMAT_VERSION

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class Identity:
    """What an entry belongs to. ``digest`` is the 16-byte key; ``info`` describes it."""

    digest: bytes
    info: dict[str, Any] = field(compare=False, hash=False)

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def name(self) -> str:
        return str(self.info.get("name", self.hex[:12]))

    @classmethod
    def from_components(cls, components: dict[str, Any], **described: Any) -> "Identity":
        """An identity from explicit components (engines that are not an mlx-lm dir)."""
        comps = dict(components, format=FORMAT_VERSION)
        digest = xxhash.xxh3_128_digest(json.dumps(comps, sort_keys=True, default=str).encode())
        return cls(digest, dict(described, components=comps))


def file_stamp(st: os.stat_result) -> list[int]:
    """What identifies a file's content without reading it: device, inode, size, mtime and
    ctime (ns). ctime is set by the kernel on every change and cannot be set back by a
    user (only by changing the clock), unlike mtime."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class DigestMemo:
    """File digests remembered by ``file_stamp`` in a private JSON file (0600). Safe across
    processes: a lost update only costs one re-hash; an unreadable memo is ignored."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()

    def _read(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        from .blobs import BlobError, open_regular

        try:
            fd = open_regular(self.path)  # a FIFO planted there must not block
        except BlobError:
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                memo = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            return {}
        return memo if isinstance(memo, dict) else {}

    def digest(self, file: Path) -> str:
        st = file.stat()
        key = str(file.resolve())
        stamp = file_stamp(st)
        with self._lock:
            memo = self._read()
            hit = memo.get(key)
            if isinstance(hit, list) and len(hit) == 2 and hit[0] == stamp and isinstance(hit[1], str):
                return hit[1]
            value = hash_file(file)
            if self.path is not None:
                memo[key] = [stamp, value]
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    with os.fdopen(fd, "w") as f:
                        f.write(json.dumps(memo))
                    os.replace(tmp, self.path)
                except OSError:
                    pass
            return value


def hash_file(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(files: list[Path], memo: DigestMemo | None = None) -> str | None:
    if not files:
        return None
    h = xxhash.xxh3_128()
    for f in sorted(files):
        h.update(f.name.encode())
        h.update((memo.digest(f) if memo else hash_file(f)).encode())
    return h.hexdigest()


def _chat_template(model_dir: Path) -> str | None:
    parts = []
    cfg = model_dir / "tokenizer_config.json"
    if cfg.exists():
        try:
            parts.append(json.dumps(json.loads(cfg.read_text()).get("chat_template"), sort_keys=True))
        except ValueError:
            parts.append(cfg.read_text())
    for name in TEMPLATE_FILES:
        if (model_dir / name).exists():
            parts.append((model_dir / name).read_text())
    return xxhash.xxh3_128_hexdigest("\0".join(parts).encode()) if parts else None


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a model directory (what the weights component hashes)."""
    return [p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]


def source_files(model_dir: Path) -> list[Path]:
    """Every file an identity of ``model_dir`` is derived from, the directory included
    (its mtime changes when a file is added, removed or renamed in)."""
    names = ("config.json",) + TOKENIZER_FILES + TEMPLATE_FILES
    return [model_dir] + weight_files(model_dir) + [model_dir / n for n in names if (model_dir / n).exists()]


def watch(*dirs: Path | None) -> tuple:
    """The stat signature of every file identities of ``dirs`` derive from: equal
    signatures mean unchanged files (see ``file_stamp``). A few stat calls per directory,
    cheap enough to take on every use of an identity."""
    out: list = []
    for d in dirs:
        if d is None:
            continue
        try:
            files = source_files(Path(d)) if Path(d).is_dir() else [Path(d)]
            out.extend((str(f), *file_stamp(f.stat())) for f in files)
        except OSError as e:
            out.append((str(d), "error", e.errno))
    return tuple(out)


def dir_components(model_dir: Path, memo: DigestMemo | None = None) -> dict[str, Any]:
    """Digests of one mlx-lm model directory: weights, config, tokenizer, chat template."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return {
        "weights": _hash_files(weight_files(model_dir), memo),
        "config": xxhash.xxh3_128_hexdigest(json.dumps(config, sort_keys=True).encode()),
        "tokenizer": _hash_files([model_dir / n for n in TOKENIZER_FILES if (model_dir / n).exists()]),
        "chat_template": _chat_template(model_dir),
    }


def code_digest(config: dict, layout: list) -> str | None:
    """A digest of the code that computes this model's KV: the source of the mlx-lm module
    that builds the model, of every ``mlx_lm.models`` module it reaches (attention, RoPE,
    activations), and of each cache class in ``layout`` with its kvstore-relevant bases.
    ``mlx_lm.models.cache`` is hashed per class, so a change to an unrelated class (the
    prompt cache, say) keeps the cache. None when mlx-lm cannot name the model's module."""
    try:
        from mlx_lm.utils import _get_classes  # present in mlx-lm 0.31 and 0.32

        root = sys.modules[_get_classes(config)[0].__module__]
    except Exception:
        return None
    h = xxhash.xxh3_128()
    others = sorted((n, m) for n, m in _model_modules(root).items() if m is not root)
    for name, module in [("", root)] + others:  # the root's own name (model_type) is not code
        h.update(name.encode() + b"\0")
        try:
            h.update(Path(inspect.getsourcefile(module) or "").read_bytes())
        except (OSError, TypeError):
            h.update(b"?")
    from mlx_lm.models import cache as C

    for cls_name in sorted(_classes(layout)):
        for cls in getattr(getattr(C, cls_name, None), "__mro__", ()):
            if getattr(cls, "__module__", None) == C.__name__:
                try:
                    h.update(inspect.getsource(cls).encode())
                except (OSError, TypeError):
                    h.update(cls.__qualname__.encode())
    return h.hexdigest()


def _model_modules(root: Any) -> dict[str, Any]:
    """``root`` and every ``mlx_lm.models`` module reachable from its globals (modules,
    classes and functions it uses), except ``mlx_lm.models.cache``."""
    found: dict[str, Any] = {}
    todo = [root]
    while todo:
        mod = todo.pop()
        if mod.__name__ in found:
            continue
        found[mod.__name__] = mod
        for value in list(vars(mod).values()):
            name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            if (isinstance(name, str) and name.startswith("mlx_lm.models.") and name != "mlx_lm.models.cache"
                    and name not in found and name in sys.modules):
                todo.append(sys.modules[name])
    return found


def _classes(layout: list) -> set[str]:
    out: set[str] = set()
    for m in layout:
        if isinstance(m, dict):
            out.add(str(m.get("class")))
            out |= _classes(m.get("sub") or [])
    return out


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
    except Exception:  # an architecture the probe cannot run: classes only
        return layout_of(make_prompt_cache(model))
    return layout if real else _without_dtype(layout)


def _lazy_model(model_dir: Path) -> tuple[Any, bool]:
    """The model, unevaluated: lazily loaded from its weight files (True) or, when mlx-lm
    cannot load the directory (no safetensors, a GGUF), lazily initialised (False)."""
    try:
        from mlx_lm.utils import load_model

        return load_model(model_dir, lazy=True)[0], True
    except Exception:
        from mlx_lm.utils import _get_classes  # present in mlx-lm 0.31 and 0.32

        config = json.loads((model_dir / "config.json").read_text())
        model_cls, args_cls = _get_classes(config)
        return model_cls(args_cls.from_dict(config)), False


def _probe(model: Any) -> list:
    """A prompt cache after one token went through ``model``, never evaluated: its arrays
    have the shapes and dtype the engine's caches will have. The forward runs while
    ``mx.compile`` traces it, where MLX refuses any evaluation (an architecture that reads
    a value mid-forward raises instead of computing, or reading, the whole model)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.compile(lambda tokens: model(tokens, cache=cache))(mx.array([[0]]))
    return cache


def _without_dtype(layout: list) -> list:
    out = []
    for m in layout:
        m = {k: v for k, v in m.items() if k != "dtype"}
        if "sub" in m:
            m["sub"] = _without_dtype(m["sub"])
        out.append(m)
    return out


def layout_of(cache: list) -> list:
    """Classes and parameters of a (possibly empty) prompt cache, without lengths, and each
    attention-KV layer's geometry when it holds arrays (see ``describe_layout``)."""
    from .codec import encode_cache

    return describe_layout(*encode_cache(cache))


def describe_layout(tensors: dict[str, Any], layout: list) -> list:
    """``codec.layout_signature(layout)`` plus, for every attention-KV layer (also inside a
    CacheList) whose tensors are present, ``k`` / ``v`` = [KV heads, head_dim] and
    ``dtype``: what tells a cache of this model from one of another model with the same
    layer classes. Reads array shapes and dtypes only."""
    from .codec import layout_signature

    sig = layout_signature(layout)
    for i, (s, m) in enumerate(zip(sig, layout)):
        _add_geometry(s, m, tensors, f"{i}.")
    return sig


def _add_geometry(sig: dict, meta: dict, tensors: dict[str, Any], prefix: str) -> None:
    from .codec import KV_CLASSES

    if meta.get("class") == "CacheList":
        for j, (s, m) in enumerate(zip(sig.get("sub", []), meta.get("sub", []))):
            _add_geometry(s, m, tensors, f"{prefix}s{j}.")
    elif meta.get("class") in KV_CLASSES:
        sig.update(kv_geometry(tensors, meta, prefix))


def kv_geometry(tensors: dict[str, Any], meta: dict, prefix: str = "") -> dict:
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
            "dtype": str(scales.dtype).rsplit(".", 1)[-1]}


def layout_problem(ident: Identity, tensors: dict[str, Any], layout: list) -> str | None:
    """Why a cache does not fit the identity's model, or None: it must have the layers the
    model makes (same count; per layer the same class family: attention KV in any of its
    forms, or the same recurrent class) and, where the identity records it, each attention
    layer's KV geometry (heads and head_dim of keys and values, and dtype). Unknown (None)
    for identities without a layout component, or with a draft model (whose layers the
    engine appends); identities without geometry are checked on classes only."""
    from .codec import KV_CLASSES

    comps = ident.info.get("components") or {}
    want = comps.get("layout")  # ``tensors``: arrays, or ``ArraySpec`` from a blob header
    if not isinstance(want, list) or comps.get("draft"):
        return None

    def fam(m: dict) -> str:
        return "attention KV" if m.get("class") in KV_CLASSES else str(m.get("class"))

    def diff(a: list, b: list, where: str) -> str | None:
        if len(a) != len(b):
            return f"cache has {len(a)} layers{where}, {ident.name} makes {len(b)} (a cache from another model?)"
        for i, (x, y) in enumerate(zip(a, b)):
            if fam(x) != fam(y):
                return (f"cache layer {i}{where} is {x.get('class')}, {ident.name} makes {y.get('class')} "
                        "(a cache from another model?)")
            if fam(x) not in ("attention KV", "CacheList") and x != y:  # recurrent state: exact
                return f"cache layer {i}{where} is {x}, {ident.name} makes {y} (a cache from another model?)"
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


@dataclass(frozen=True)
class ArraySpec:
    """An array's shape and dtype name without its data (from a blob header): what
    ``describe_layout`` reads of a tensor."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)


def model_identity(
    model_path: str | Path,
    *,
    adapter_path: str | Path | None = None,
    draft_path: str | Path | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    layout: list | None = None,
    memo: DigestMemo | None = None,
) -> Identity:
    """The identity of an mlx-lm model directory (plus adapter / draft / KV quantisation).

    ``layout`` defaults to what mlx-lm builds for this config; pass ``layout_of(cache)``
    when the engine builds caches its own way (e.g. ``max_kv_size``).
    """
    model_path = Path(model_path)
    comps: dict[str, Any] = dir_components(model_path, memo)
    comps["adapter"] = _hash_files(list(Path(adapter_path).glob("*")), memo) if adapter_path else None
    comps["draft"] = dir_components(Path(draft_path), memo) if draft_path else None
    comps["kv_bits"] = kv_bits
    comps["kv_group_size"] = kv_group_size if kv_bits else None
    comps["layout"] = layout if layout is not None else layout_from_config(model_path)
    config = json.loads((model_path / "config.json").read_text()) if (model_path / "config.json").exists() else {}
    comps["code"] = code_digest(config, comps["layout"])
    try:
        import mlx.core as mx
        import mlx_lm
        versions = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}
    except Exception:  # pragma: no cover - versions are descriptive only
        versions = {}
    return Identity.from_components(
        comps,
        name=model_path.name,
        path=str(model_path.resolve()),
        model_type=config.get("model_type"),
        kv_bits=kv_bits,
        versions=versions,
    )
