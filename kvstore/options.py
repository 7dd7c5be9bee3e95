"""``StoreOptions``: a store's settings as one frozen value, the one home of their defaults.

``KVStore``, the ``LRUPromptCache`` drop-in, the vllm-mlx and exo adapters and the CLI take
it (or its keywords, checked by name: ``but``, ``checked``) instead of restating the list.
The front ends that start from other settings than ``KVStore``'s name them here too
(``DROP_IN``, ``VLLM_BATCHED``, ``EXO``), so every default is written once. Values are
checked where they are used (``KVStore`` raises ``ValueError`` naming a bad one); names here.
Importable without MLX.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .floors import MIN_DISK_HIT
from .pressure import DEFAULT_MEMORY_FLOOR

if TYPE_CHECKING:
    from .shared import SharedConfig

__all__ = ["StoreOptions", "NAMES", "checked", "store_changes", "DROP_IN", "VLLM_BATCHED", "EXO"]


@dataclass(frozen=True)
class StoreOptions:
    """Every setting of a ``KVStore``, with its default (``max_entries`` / ``max_bytes``:
    the memory tier's limits, which mlx-lm names ``max_size`` / ``max_bytes``).

    ``cache_dir`` None: ``$KVSTORE_DIR`` or the user cache dir. ``shared`` None: the store
    reads ``$KVSTORE_SHARED``; False: no shared tier. The meaning of each: ``KVStore``."""

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
    whole_copy_min_bytes: int | None = 64 << 20  # ``disk.whole``: the smallest entry copied; None: no copies

    def but(self, **changes: Any) -> StoreOptions:
        """A copy with ``changes``; TypeError naming a keyword that is no option."""
        return replace(self, **checked(changes)) if changes else self


NAMES = frozenset(f.name for f in fields(StoreOptions))


def checked(changes: Mapping[str, Any]) -> dict[str, Any]:
    """``changes`` as a dict, every key an option's name; TypeError naming those that are
    not (what a wrong keyword to ``KVStore`` raised before the options had one home)."""
    unknown = sorted(set(changes) - NAMES)
    if unknown:
        raise TypeError(f"unknown store option(s): {', '.join(unknown)} (one of {', '.join(sorted(NAMES))})")
    return dict(changes)


def store_changes(*, disk: bool | None = None, **keywords: Any) -> dict[str, Any]:
    """The drop-in's keywords as store options (checked): ``disk`` (``LRUPromptCache``'s
    word; False: memory only) is ``memory_only=not disk``, the others are options' names."""
    changes = checked(keywords)
    if disk is not None:
        changes["memory_only"] = not disk
    return changes


# mlx-lm's drop-in (``LRUPromptCache``; so ``kvstore serve`` and vllm-mlx's SimpleEngine): a
# hit does not refresh an entry's place (mlx-lm's LRU, which its suite pins), a cache
# directory that cannot be used means memory only (an engine never fails to start for its
# cache), and a disk hit must be worth its restore (``floors.MIN_DISK_HIT``).
DROP_IN = StoreOptions(touch_on_hit=False, on_disk_error="memory", min_disk_hit=MIN_DISK_HIT)
# vllm-mlx's batched engine (``adapters.vllm_mlx_batched``): its own prefix cache is the
# memory tier (kvstore's holds nothing), no shared tier unless asked for.
VLLM_BATCHED = StoreOptions(max_entries=0, on_disk_error="memory", shared=False)
# exo (``adapters.exo``): exo's cache decides what stays (its entries own the store's, which
# are taken out with them), so kvstore's memory tier is not the one to evict.
EXO = StoreOptions(max_entries=1 << 40, on_disk_error="memory")
