"""kvstore: a persistent, disk-backed KV-cache tier for MLX language-model inference."""

from .identity import Identity, model_identity
from .keys import FORMAT_VERSION, TokenError
from .store import Fetched, KVStore, StoreOpenError, default_cache_dir
from .adapters.mlx_lm import LRUPromptCache

__all__ = ["FORMAT_VERSION", "Fetched", "Identity", "KVStore", "LRUPromptCache", "StoreOpenError", "TokenError",
           "default_cache_dir", "model_identity"]
__version__ = "0.1.0"
