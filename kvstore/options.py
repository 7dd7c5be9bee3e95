"""``StoreOptions``: a store's settings as one frozen value, the one home of their defaults.

``KVStore``, the ``LRUPromptCache`` drop-in, the vllm-mlx and exo adapters and the CLI take
it (or its keywords, checked by name) instead of restating the list. Importable without MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .pressure import DEFAULT_MEMORY_FLOOR

if TYPE_CHECKING:
    from .shared import SharedConfig


@dataclass(frozen=True)
class StoreOptions:
    """Every setting of a ``KVStore``, with its default (``max_entries`` / ``max_bytes``:
    the memory tier's limits, which mlx-lm names ``max_size`` / ``max_bytes``).

    ``cache_dir`` None: ``$KVSTORE_DIR`` or the user cache dir. ``shared`` None: the store
    reads ``$KVSTORE_SHARED``; False: no shared tier."""

    cache_dir: str | Path | None = None
    max_entries: int = 10
    max_bytes: int = 1 << 63
    max_disk_bytes: int | None = None
    chunk_tokens: int = 256
    queue_size: int = 16
    touch_on_hit: bool = True
    memory_only: bool = False
    on_disk_error: str = "raise"
    kv_bits: int | None = None
    kv_group_size: int = 64
    shared_dir: bool = False
    shared: "str | SharedConfig | None | bool" = None
    persist: str = "all"
    max_write_bytes_per_day: int | None = None
    memory_floor: float | int | None = DEFAULT_MEMORY_FLOOR
    min_disk_hit: int = 0
    min_memory_hit: int = 0

    def but(self, **changes: Any) -> StoreOptions:
        """A copy with ``changes``; TypeError naming a keyword that is no option."""
        unknown = sorted(set(changes) - NAMES)
        if unknown:
            raise TypeError(f"unknown store option(s): {', '.join(unknown)} (one of {', '.join(sorted(NAMES))})")
        return replace(self, **changes)


NAMES = frozenset(f.name for f in fields(StoreOptions))
