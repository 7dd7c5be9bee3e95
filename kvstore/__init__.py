"""kvstore: a persistent, disk-backed KV-cache tier for MLX language-model inference.

Names are imported on first use, so ``kvstore ls`` and friends start without loading
mlx-lm (which costs seconds).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "FORMAT_VERSION": "keys", "TokenError": "keys",
    "Identity": "identity", "model_identity": "identity",
    "Fetched": "store", "KVStore": "store", "StoreOpenError": "cachedir", "default_cache_dir": "cachedir",
    "StoreOptions": "options",
    "LRUPromptCache": "adapters.mlx_lm",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
