"""The shared tier's foundation: config, key names and a fail-soft Redis client.

``SharedConfig`` and the key helpers need nothing beyond the standard library;
``SharedClient`` needs redis-py (``pip install 'kvstore[shared]'``) and is imported on
first use, so parsing ``$KVSTORE_SHARED`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import SharedConfig
from .keys import hash_tag, key_slot, make_key

if TYPE_CHECKING:
    from .client import SharedClient

__all__ = ["SharedClient", "SharedConfig", "hash_tag", "key_slot", "make_key"]


def __getattr__(name: str) -> Any:
    if name == "SharedClient":
        try:
            from .client import SharedClient
        except ModuleNotFoundError as e:
            if e.name != "redis":
                raise
            raise ImportError("kvstore's shared tier needs redis-py: "
                              "pip install 'kvstore[shared]'") from e
        return SharedClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
