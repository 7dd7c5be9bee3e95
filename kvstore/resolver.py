"""Model keys to identities, for one store: what an entry may be reused by.

``Resolver.identity`` maps what an engine calls its model (an ``Identity``, a model
directory, mlx-lm's server key ``(model, adapter, draft)``) to the identity every key of its
entries is rooted in, remembers it, and derives it again when any file it came from
changed (``identity.watch``: a few stat calls per use). A key that names no local files
has no identity: its caches stay in memory, said once (``MemoryOnly``). The identity a
key had before a change is kept (``previous``): a miss it would have served is explained
as another identity's (``misses.OTHER_IDENTITY``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Hashable

from .identity import DigestMemo, Identity, file_stamp, model_identity, read_config, watch
from .salt import Salt, check_salt, salted
from .escape import logger

log = logger("kvstore")


class MemoryOnly:
    """Why some models' caches are kept in memory only (``stats()["memory_only_reason"]``),
    at most 64 models named, each said once in the log."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}
        self._lock = threading.Lock()

    def record(self, name: str, why: str) -> bool:
        """``why`` under ``name``; True if it is new."""
        with self._lock:
            if name in self.reasons or len(self.reasons) >= 64:
                return False
            self.reasons[name] = why
        return True

    def note(self, name: str, why: str) -> None:
        """Record and, the first time, log that ``name``'s caches stay in memory."""
        if self.record(name, why):
            log.warning("kvstore: %s: %s; its caches are served from memory only", name, why)


# Identities are derived one at a time in a process (they are derived once per model and
# change of its files): two threads (a server's generation thread and its preload, say)
# asking for a new model's identity at once wait for one derivation instead of making two,
# which cost a second each and could disagree (one failing: its caches filed under another
# key than the other's lookups use).
_DERIVING = threading.RLock()


class Resolver:
    """A store's model keys and their identities. ``file_identity`` files a new identity's
    description in the index (None: no disk tier); ``warn_once`` is the store's."""

    def __init__(self, memo: DigestMemo, memory_only: MemoryOnly, warn_once: Callable[..., None],
                 file_identity: Callable[[Identity], None] | None, kv_bits: int | None = None,
                 kv_group_size: int = 64) -> None:
        self.memo, self.memory_only, self._warn_once, self._file = memo, memory_only, warn_once, file_identity
        self._idents: dict[Hashable, tuple[Identity | None, tuple | None, tuple | None]] = {}
        self.previous: dict[bytes, Identity] = {}  # a re-derived identity's digest -> the one it replaced
        self._vocab: dict[bytes, int | None] = {}
        self._kv_quant = (kv_bits, kv_group_size if kv_bits else None)

    def identity(self, model: Any, built: Any = None) -> Identity | None:
        """``model``'s identity; None if it names no local files (said once, memory only).
        ``built``: the engine's loaded model of that key, used if the identity is derived
        now (``model_identity``: its layout probed on it, the same digest)."""
        if isinstance(model, Identity):
            return model
        try:
            key: Hashable = model if isinstance(model, Hashable) else repr(model)
        except TypeError:
            key = repr(model)
        known = self._idents.get(key)
        if known is not None and self._current(known):
            return known[0]
        with _DERIVING:  # one derivation at a time: a thread that waited takes the one just made
            again = self._idents.get(key)
            if again is not None and again is not known and self._current(again):
                return again[0]
            ident = self._derive(model, key, built)
        if known is not None and known[0] is not None and ident is not None and known[0].digest != ident.digest:
            self.previous[ident.digest] = known[0]
        return ident

    @staticmethod
    def _current(known: tuple[Identity | None, tuple | None, tuple | None]) -> bool:
        ident, dirs, stamp = known
        return dirs is None or (stamp is not None and _unchanged(stamp)) or watch(*dirs) == stamp

    def _derive(self, model: Any, key: Hashable, built: Any = None) -> Identity | None:
        ident, dirs, stamp = None, None, None
        try:
            parts = list(model) if isinstance(model, (tuple, list)) else [model]
            parts += [None] * (3 - len(parts))
            path, adapter, draft = (local_model_dir(p) if p is not None else None for p in parts[:3])
            if path is not None:
                dirs = (path, adapter, draft)
                stamp = watch(*dirs)
                ident = model_identity(path, adapter_path=adapter, draft_path=draft, memo=self.memo, built=built,
                                       kv_bits=self._kv_quant[0], kv_group_size=self._kv_quant[1])
                if self._file is not None:
                    self._file(ident)
        except Exception as e:  # unresolvable: memory only, said once (and in stats())
            self._warn_once("identity", "kvstore: no identity for model %r (%s); memory only", model, e)
            self.memory_only.record(str(model)[:200], f"no identity for the model ({e})")
        if ident is None:
            dirs = None
            self._warn_once("identity", "kvstore: model %r is not a local directory; memory only", model)
            self.memory_only.record(str(model)[:200], "the model is not a local directory: no identity")
        self._idents[key] = (ident, dirs, stamp)
        return ident

    def salted(self, model: Any, salt: Salt | None) -> Identity | None:
        """The identity ``model``'s entries under ``salt`` are filed under (``salt.salted``)."""
        return salted(self.identity(model), check_salt(salt, "salt"))

    def set_kv_quant(self, kv_bits: int | None, kv_group_size: int | None = 64) -> None:
        """The KV quantisation the engine runs with: identities resolved so far are resolved again."""
        quant = (kv_bits, kv_group_size if kv_bits else None)
        if quant != self._kv_quant:
            self._kv_quant = quant
            self._idents.clear()

    def register(self, model: Hashable, identity: Identity) -> None:
        """Use ``identity`` for ``model`` (engines whose key is not a path)."""
        self._idents[model] = (identity, None, None)
        if self._file is not None:
            self._file(identity)

    def vocab_size(self, ident: Identity) -> int | None:
        """The model's vocabulary size from its config.json (None when unknown)."""
        if ident.digest in self._vocab:
            return self._vocab[ident.digest]
        vocab = None
        path = ident.info.get("path")
        if path:
            try:
                cfg = read_config(Path(path))
                v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
                vocab = int(v) if v else None
            except (OSError, ValueError, TypeError, AttributeError):
                vocab = None
        self._vocab[ident.digest] = vocab
        return vocab


def _unchanged(stamp: tuple) -> bool:
    """True if every path in ``stamp`` (``identity.watch``'s) still stats as recorded: one
    ``os.stat`` each. A file added to or removed from a watched directory changes that
    directory's own stamp, so this is ``watch(...) == stamp`` without listing anything."""
    try:
        return all(len(e) == 6 and tuple(file_stamp(os.stat(e[0]))) == e[1:] for e in stamp)
    except OSError:
        return False


def local_model_dir(p: Any) -> Path | None:
    """A model key as a local directory: a path, or a hub repo id already in the local
    hub cache (never downloaded); None otherwise."""
    path = Path(str(p)).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
        got = Path(snapshot_download(str(p), local_files_only=True))
        return got if got.is_dir() else None
    except Exception:
        return None
