"""A drop-in for ``mlx_lm.models.cache.LRUPromptCache`` with a disk tier underneath.

Switching is one import line::

    from kvstore import LRUPromptCache   # was: from mlx_lm.models.cache import LRUPromptCache

The memory tier behaves as mlx-lm's does (same matching, same three LRU lists, same
limits, same prefix pruning; tests pin this against mlx-lm 0.31 and 0.32), and a memory
miss falls through to disk. Constructed with mlx-lm's arguments alone it stores in
``$KVSTORE_DIR``, else the user cache dir. A cache directory that cannot be used makes it
warn and run memory-only, so an engine never fails to start because of its cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..misses import Miss, log_line
from ..options import DROP_IN, StoreOptions, store_changes
from ..parts import Part
from ..salt import Salt, salt_of
from ..store import KVStore, Preloaded
from ..escape import logger

log = logger("kvstore")


class LRUPromptCache:
    """mlx-lm's prompt cache API over a two-tier KVStore.

    ``model`` is mlx-lm's ``(model path, adapter path, draft model path)`` key; it maps to
    the identity digest of those files, so entries survive restarts and never cross models.
    ``shared``: a shared tier behind the disk (a Redis URL or ``SharedConfig``; None reads
    ``$KVSTORE_SHARED``, False turns it off; see ``KVStore``).

    ``salt``: entries are reused only by calls with the same salt (``kvstore.salt``), in
    every tier; given as a keyword, or carried by the token list itself
    (``salt.SaltedTokens``: how ``kvstore serve`` hands a request's ``cache_salt`` through
    mlx_lm.server's generation thread). None (the default) is mlx-lm's behaviour. ``min_disk_hit``: the fewest
    tokens a disk hit must restore when memory holds none of the prompt (``KVStore``);
    ``min_memory_hit`` the same for a memory hit (0: mlx-lm's own rules; ``kvstore serve``
    passes its ``--min-disk-hit``).

    Settings: ``options`` (a ``StoreOptions``; default ``options.DROP_IN``, the drop-in's: a
    hit does not move an entry, as mlx-lm's does not; an unusable cache directory means
    memory only; ``MIN_DISK_HIT``) and that value's keywords; ``max_size`` / ``max_bytes``
    (mlx-lm's, its defaults) are ``max_entries`` / ``max_bytes``; ``disk=False``: memory only.
    ``store``: an open store to use instead (the settings are then checked, not used).
    """

    def __init__(self, max_size: int | None = None, max_bytes: int | None = None, *,
                 options: StoreOptions | None = None, store: KVStore | None = None,
                 disk: bool | None = None, **store_keywords: Any) -> None:
        # the store's settings: ``options`` (default ``DROP_IN``) with the keywords (checked by
        # name: TypeError), mlx-lm's two limits (None: the options') and ``disk`` (False: memory only)
        changes = store_changes(disk=disk, **store_keywords)
        changes.update({k: v for k, v in (("max_entries", max_size), ("max_bytes", max_bytes)) if v is not None})
        self.store = store or KVStore(options=(options or DROP_IN).but(**changes))
        # token ids -> text, for a miss's log line (``kvstore serve`` sets the model's tokenizer)
        self.decode: Callable[[list[int]], str] | None = None
        # a lookup's tokens -> what names a miss's part of the request (``kvstore serve``:
        # ``serve.context.name_part``), or None
        self.name_part: Callable[[list[int]], Callable[[Miss], Part] | None] | None = None
        # a lookup's tokens -> what a miss's log line adds after the text ("; <what moved>":
        # ``kvstore serve --stable-prefix``, read from the request the tokens carry), or None
        self.miss_note: Callable[[list[int]], str] | None = None

    @property
    def max_size(self) -> int:
        return self.store.memory.max_entries

    @max_size.setter
    def max_size(self, v: int) -> None:
        self.store.memory.max_entries = v

    @property
    def max_bytes(self) -> int:
        """The user's hard cap on the memory tier (below it, the tier follows the machine's
        available memory: ``KVStore(memory_floor=)``)."""
        return self.store.max_bytes

    @max_bytes.setter
    def max_bytes(self, v: int) -> None:
        self.store.max_bytes = v
        self.store.memory.max_bytes = v  # the next filing lowers it again to what memory allows

    def __len__(self) -> int:
        return len(self.store.memory)

    @property
    def nbytes(self) -> int:
        return self.store.memory.nbytes

    def fetch_nearest_cache(self, model: Any, tokens: list[int], *,
                            salt: Salt | None = None) -> tuple[list[Any] | None, list[int]]:
        """(cache or None, the tokens still to process): exact, longer-trimmed or shorter
        hit from memory, else the longest stored prefix on disk. A restore from disk or
        the shared tier is logged (``log_restore``); a miss (``Fetched.miss``, counted by
        the store: ``KVStore.misses``) is logged when it recomputed at least the threshold of
        tokens a stored prefix held (``misses.log_line``, its text decoded with ``decode``)."""
        t0 = time.perf_counter()
        name = self.name_part(tokens) if self.name_part is not None else None
        got = self.store.fetch(model, tokens, salt=salt if salt is not None else salt_of(tokens), name=name)
        if got.source in ("disk", "shared"):
            log_restore(got.n, len(tokens), got.source, time.perf_counter() - t0)
        if got.miss is not None and self.store.misses.worth_logging(got.miss):
            log.info(log_line(got.miss, tokens, self.decode) + (self.miss_note(tokens) if self.miss_note is not None else ""))
        return got.cache, tokens[got.n :]

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant", salt: Salt | None = None) -> None:
        """Keep the cache hot and queue it for disk; returns without waiting for the disk."""
        self.store.insert(model, tokens, prompt_cache, cache_type=cache_type,
                          salt=salt if salt is not None else salt_of(tokens))

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self.store.trim_to(n_sequences, n_bytes)

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return self.store.memory.stats_by_type()

    def stats(self, salt: Salt | None = None) -> dict[str, Any]:
        """The store's counters (hits by tier, bytes, dropped writes, ...) and why lookups
        missed (``Misses.stats``: ``miss_<reason>``, ``recent_misses``...); with ``salt``,
        that salt's lookups' (``KVStore.stats``)."""
        return self.store.stats(salt)

    def preload(self, model: Any, how: int | str = "auto", **options: Any) -> Preloaded:  # salt=: KVStore.preload
        """Restore ``model``'s stored entries into the memory tier ahead of traffic
        (``KVStore.preload``: pinned first, never evicting what is already in memory)."""
        return self.store.preload(model, how, **options)

    def close(self) -> None:
        """Flush the write-behind queue and close the index."""
        self.store.close()


def log_restore(n: int, of: int, source: str, seconds: float) -> None:
    """One INFO line on the ``kvstore`` logger for a request served from disk or the shared
    tier: what an operator reading a server's log looks for after a restart (a server's
    own log shows only its memory cache). ``seconds``: the whole lookup, restore included."""
    tier = "the shared tier" if source == "shared" else source
    log.info("kvstore: restored %s of %s prompt tokens from %s in %.2f s; %s left to prefill",
             f"{n:,}", f"{of:,}", tier, seconds, f"{of - n:,}")
