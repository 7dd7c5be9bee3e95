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
- custom model code (``model_code``): with ``"model_file"`` in config.json mlx-lm builds
  the model from that file (``trust_remote_code``); it and every ``*.py`` under the model
  directory (what it may import or load beside it) are hashed, the model file also
  watched like weights (``source_files`` says why the rest is not),
- the model's implementation (``code_digest``): the source of the mlx-lm module that
  builds the model, of every ``mlx_lm.models`` module it uses (RoPE, attention helpers),
  and of the cache classes in its layout, so an mlx-lm upgrade that changes how KV is
  computed starts a new identity while one that leaves that code alone keeps the cache,
- kvstore's format version.

mlx / mlx-lm versions are recorded, not hashed: the code digest is what decides.
``watch`` gives the stat signature of the files an identity was derived from, so a
process notices a model directory that changed under it (see ``KVStore.identity``): a
fixed set whatever the directory holds (it is taken on every fetch and insert).

A model directory is not kvstore's: every file of it is read through ``files.read_foreign``
/ ``open_foreign`` (non-blocking open, regular files only), and a directory holding a FIFO,
device or socket is refused before mlx-lm opens anything in it (``check_model_dir``), so a
directory named by a file's metadata can never block an import or a server.
"""

from __future__ import annotations

import errno
import inspect
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import xxhash

from .files import open_foreign, read_foreign, special_files
from .keys import FORMAT_VERSION
from .model_layout import ModelLayout, Record, layout_from_config, layout_of_model
from .escape import logger

log = logger("kvstore")
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
    """File digests remembered by ``file_stamp`` in a JSON file made with the cache
    directory's ``modes`` (0600, or 0660 for its group when shared). Safe across
    processes: a lost update only costs one re-hash; a damaged memo is ignored. Written
    whole through an unpredictable temp name (``files.replace_file``). A memo this user
    may not read or write is warned about once, naming the file and the fix, and the
    digests are computed without it: it never costs the identity. ``write=False``: the
    memo is read, never written (a reader such as ``kvstore why``)."""

    def __init__(self, path: Path | None, modes: Any = None, *, write: bool = True) -> None:
        self.path = path
        self.modes = modes
        self.write = write
        self._lock = threading.Lock()
        self._warned = False

    def _denied(self, e: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvstore: cannot use the digest memo %s (%s): weights are hashed again at every "
                        "start; run `chmod %s %s` (or remove it)", self.path, e.strerror,
                        "g+rw" if getattr(self.modes, "gid", None) is not None else "u+rw", self.path)

    def _read(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        from .files import BlobError, open_regular

        try:
            fd = open_regular(self.path)  # a FIFO planted there must not block
        except BlobError:
            return {}
        except OSError as e:
            self._denied(e)
            return {}
        try:
            with os.fdopen(fd, "rb") as f:
                memo = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            return {}
        return memo if isinstance(memo, dict) else {}

    def digest(self, file: Path) -> str:
        """``hash_file(file)``, remembered by the file's ``file_stamp``."""
        return self.remembered(str(file.resolve()), file_stamp(file.stat()), lambda: hash_file(file))

    def remembered(self, key: str, stamp: list, compute: Callable[[], str]) -> str:
        """The value filed under ``key`` with this ``stamp`` (a JSON list: what the value is
        a function of), else ``compute()``, filed."""
        with self._lock:
            memo = self._read()
            hit = memo.get(key)
            if isinstance(hit, list) and len(hit) == 2 and hit[0] == stamp and isinstance(hit[1], str):
                return hit[1]
            value = compute()
            if self.path is not None and self.write:
                from .files import PRIVATE, replace_file

                memo[key] = [stamp, value]
                try:
                    replace_file(self.path, json.dumps(memo).encode(), self.modes or PRIVATE)
                except OSError as e:
                    self._denied(e)
            return value


def hash_file(path: Path) -> str:
    """xxh3-128 of a regular file (a symlink to one is fine: hub snapshots are made of
    them). OSError for a FIFO or device, without waiting on it."""
    fd = open_foreign(path)
    h = xxhash.xxh3_128()
    with os.fdopen(fd, "rb") as f:
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


def _text(path: Path) -> str | None:
    """A model file's text (``read_foreign``), None when there is none; OSError for a
    file that is there but not a regular file or not readable."""
    try:
        return read_foreign(path).decode("utf-8")
    except FileNotFoundError:
        return None


def read_config(model_dir: Path) -> dict:
    """A model directory's config.json ({} when it has none); OSError for one that is not
    a regular file, ValueError for one that is not a JSON object."""
    text = _text(Path(model_dir) / "config.json")
    config = json.loads(text) if text is not None else {}
    if not isinstance(config, dict):
        raise ValueError(f"{model_dir}/config.json is not a JSON object")
    return config


def check_model_dir(model_dir: Path) -> None:
    """OSError naming the first FIFO, device or socket in ``model_dir``: mlx-lm and the
    tokenizer libraries open its files with a blocking open."""
    odd = special_files(Path(model_dir))
    if odd:
        raise OSError(errno.EINVAL, "not a regular file (a FIFO, device or socket in a model directory)", str(odd[0]))


def _chat_template(model_dir: Path) -> str | None:
    parts = []
    cfg = _text(model_dir / "tokenizer_config.json")
    if cfg is not None:
        try:
            parts.append(json.dumps(json.loads(cfg).get("chat_template"), sort_keys=True))
        except (ValueError, AttributeError):
            parts.append(cfg)
    for name in TEMPLATE_FILES:
        text = _text(model_dir / name)
        if text is not None:
            parts.append(text)
    return xxhash.xxh3_128_hexdigest("\0".join(parts).encode()) if parts else None


def weight_files(model_dir: Path) -> list[Path]:
    """The weight files of a model directory (what the weights component hashes)."""
    return [p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]


def code_files(model_dir: Path) -> tuple[list[Path], list[Path]]:
    """(source files, directories holding them) of custom model code: when config.json
    names a ``model_file`` (mlx-lm then builds the model from it, with trust_remote_code),
    that file and every ``*.py`` in the model directory's tree; nothing otherwise (mlx-lm
    builds the model from its own modules, which ``code_digest`` covers). Every ``*.py``
    rather than the imports followed: a model file can reach its neighbours in ways no
    static reading sees (``importlib``, ``exec``, paths built from ``__file__``), a model
    directory holds few of them, and hashing one too many only costs a cold cache."""
    try:
        main = read_config(model_dir).get("model_file")
    except (OSError, ValueError):
        return [], []
    if not isinstance(main, str) or not main:
        return [], []
    files, dirs = [model_dir / main], []
    for top, subdirs, names in os.walk(model_dir):
        subdirs.sort()
        dirs.append(Path(top))
        files += [Path(top) / n for n in sorted(names) if n.endswith(".py")]
    return sorted(set(files)), dirs


def _code_component(model_dir: Path) -> str | None:
    """The digest of ``code_files``: each file's path relative to the model directory
    and its content (a missing ``model_file`` hashes as missing)."""
    files, _ = code_files(model_dir)
    if not files:
        return None
    h = xxhash.xxh3_128()
    for f in files:
        h.update(os.path.relpath(f, model_dir).encode() + b"\0")
        try:
            h.update(hash_file(f).encode())
        except OSError as e:
            h.update(f"missing: {e.errno}".encode())
    return h.hexdigest()


def source_files(model_dir: Path) -> list[Path]:
    """The files ``watch`` follows for an identity of ``model_dir``: the directory itself
    (its mtime changes when a file is added, removed or renamed in), its weights, config,
    tokenizer and template files and its ``model_file``: a set that does not grow with the
    directory's tree. The other ``*.py`` of a ``model_file`` model are hashed when the
    identity is derived, not watched: Python imports a module once per process (mlx-lm
    runs ``model_file`` afresh at each load, its imports come from ``sys.modules``), so
    the code a running process computes with is the code it derived its identity from,
    and a new process hashes the tree again."""
    names = ("config.json",) + TOKENIZER_FILES + TEMPLATE_FILES
    try:
        main = read_config(model_dir).get("model_file")
    except (OSError, ValueError):
        main = None
    code = [model_dir / main] if isinstance(main, str) and main else []
    extra = [p for p in code if p.exists()]
    return [model_dir] + weight_files(model_dir) + [model_dir / n for n in names if (model_dir / n).exists()] + extra


def watch(*dirs: Path | None) -> tuple:
    """The stat signature of every file identities of ``dirs`` derive from: equal
    signatures mean unchanged files (see ``file_stamp``). A few stat calls per directory
    (``source_files``: a fixed set), cheap enough to take on every use of an identity."""
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
    check_model_dir(model_dir)
    config = read_config(model_dir)
    comps = {
        "weights": _hash_files(weight_files(model_dir), memo),
        "config": xxhash.xxh3_128_hexdigest(json.dumps(config, sort_keys=True).encode()),
        "tokenizer": _hash_files([model_dir / n for n in TOKENIZER_FILES if (model_dir / n).exists()]),
        "chat_template": _chat_template(model_dir),
    }
    code = _code_component(model_dir)
    if code is not None:  # only then: identities of models without custom code stay as they were
        comps["model_code"] = code
    return comps


def code_digest(config: dict, layout: Record, memo: DigestMemo | None = None) -> str | None:
    """A digest of the code that computes this model's KV: the source of the mlx-lm module
    that builds the model, of every ``mlx_lm.models`` module it reaches (attention, RoPE,
    activations), and of each cache class in ``layout`` with its kvstore-relevant bases.
    ``mlx_lm.models.cache`` is hashed per class, so a change to an unrelated class (the
    prompt cache, say) keeps the cache. None when mlx-lm cannot name the model's module.

    With a ``memo`` the digest is remembered by what it is a function of: the Python
    version (``inspect`` finds a class's source), the modules' names and the
    ``file_stamp`` of each source file, and the layout's classes; a restart then skips
    ``inspect.getsource``, which parses the whole of ``mlx_lm/models/cache.py`` once per
    class (60 ms each here, most of a restarted server's identity)."""
    try:
        from mlx_lm.utils import _get_classes  # present in mlx-lm 0.31 and 0.32

        root = sys.modules[_get_classes(config)[0].__module__]
    except Exception:
        return None
    others = sorted((n, m) for n, m in _model_modules(root).items() if m is not root)
    modules = [("", root)] + others
    classes = sorted(ModelLayout.from_json(layout).classes)
    stamp = _code_stamp(root, [m for _, m in modules], classes) if memo is not None else None
    if memo is None or stamp is None:
        return _code_digest(modules, classes)
    return memo.remembered(f"code:{root.__name__}:{','.join(classes)}", stamp, lambda: _code_digest(modules, classes))


def _code_stamp(root: Any, modules: list[Any], classes: list[str]) -> list | None:
    """What ``_code_digest`` of these modules and classes is a function of (JSON); None
    when a source file cannot be named or stat'ed (then nothing is remembered)."""
    from mlx_lm.models import cache as mlx_cache

    files = []
    for module in modules + [mlx_cache]:
        try:
            path = inspect.getsourcefile(module)
            if not path:
                return None
            files.append([module.__name__, path, *file_stamp(os.stat(path))])
        except (OSError, TypeError):
            return None
    return [sys.version, root.__name__, files, classes]


def _code_digest(modules: list[tuple[str, Any]], classes: list[str]) -> str:
    h = xxhash.xxh3_128()
    for name, module in modules:  # the root's own name (model_type) is not code
        h.update(name.encode() + b"\0")
        try:
            h.update(Path(inspect.getsourcefile(module) or "").read_bytes())
        except (OSError, TypeError):
            h.update(b"?")
    from mlx_lm.models import cache as mlx_cache

    for cls_name in classes:
        for cls in getattr(getattr(mlx_cache, cls_name, None), "__mro__", ()):
            if getattr(cls, "__module__", None) == mlx_cache.__name__:
                try:
                    h.update(class_source(cls).encode())
                except (OSError, TypeError):
                    h.update(cls.__qualname__.encode())
    return h.hexdigest()


def class_source(cls: type, tries: int = 3) -> str:
    """``inspect.getsource(cls)``, which parses the class's module with ``ast``. CPython 3.11
    (seen on 3.11.7) can fail that parse with ``SystemError: AST constructor recursion depth
    mismatch`` when another thread builds an AST at the same time; the source did not
    change, so the parse is tried again (a fallback digest would split the cache)."""
    for attempt in range(tries):
        try:
            return inspect.getsource(cls)
        except SystemError:
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


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


def model_identity(
    model_path: str | Path,
    *,
    adapter_path: str | Path | None = None,
    draft_path: str | Path | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    layout: Record | None = None,
    memo: DigestMemo | None = None,
    built: Any = None,
) -> Identity:
    """The identity of an mlx-lm model directory (plus adapter / draft / KV quantisation).

    ``layout`` defaults to what mlx-lm builds for this config; pass ``layout_of(cache)``
    when the engine builds caches its own way (e.g. ``max_kv_size``). ``built``: the model
    the engine loaded from ``model_path`` (``mlx_lm.load``): the layout is probed on it
    rather than on a second, lazily built one (``layout_of_model``: the same record, so
    the same digest). Ignored with an adapter: the layout stays the base model's, probed
    as before, whatever the adapter's layers do.
    """
    model_path = Path(model_path)
    comps: dict[str, Any] = dir_components(model_path, memo)
    comps["adapter"] = _hash_files(list(Path(adapter_path).glob("*")), memo) if adapter_path else None
    comps["draft"] = dir_components(Path(draft_path), memo) if draft_path else None
    comps["kv_bits"] = kv_bits
    comps["kv_group_size"] = kv_group_size if kv_bits else None
    if layout is None:
        layout = layout_of_model(built) if built is not None and adapter_path is None else layout_from_config(model_path)
    comps["layout"] = layout
    config = read_config(model_path)
    comps["code"] = code_digest(config, comps["layout"], memo)
    try:
        import mlx.core as mx
        import mlx_lm
        versions = {"mlx": getattr(mx, "__version__"), "mlx_lm": getattr(mlx_lm, "__version__")}  # untyped attributes
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
