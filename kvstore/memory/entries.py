"""The entries the memory tier holds: prefix snapshots in a trie over token ids.

Matching is mlx-lm's own (its ``PromptTrie`` rules, identical in 0.31 and 0.32; ``Trie`` only
makes one search linear): an exact hit;
else a longer entry trimmed back to the common prefix when it can be cut there and that
beats the longest shorter prefix; else the longest shorter prefix. Unlike mlx-lm, "can be
cut there" is decided per cut point (``floors.serves`` with ``Layout.can_cut``): mlx-lm's LRU
cuts a ChunkedKVCache inside the attention chunk of its first kept key, a wrong cache.
Eviction is mlx-lm's too: three LRU lists (assistant, then user, then system are evicted
first), by entry count and by bytes, and inserting an entry that covers its prefixes
(every cut allowed) drops its stored prefixes. ``Entries`` is not thread-safe: the memory
tier (``kvstore.memory.MemoryTier``) serialises calls and settles inserts first.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum
from typing import Any, Hashable

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie, PromptTrieResult

from .. import codec
from ..floors import serves
from ..misses import AFTER, Near
from .snapshot import ORDERING, Snapshot

Key = tuple[Hashable, tuple[int, ...]]
Evicted = list[tuple[Hashable, list[int], Snapshot]]  # (model, tokens, snapshot) that left


class Room(Enum):
    """Why a snapshot does not go into memory now without evicting anything."""

    FULL = "full"  # it does not fit the room left
    SKIP = "skip"  # it is held already, or would drop a held prefix


class Trie(PromptTrie):
    """mlx-lm's PromptTrie with the same answers, but a linear search for the shortest
    longer entry: mlx-lm's depth-first search copies the path at every step, quadratic in
    the depth (seconds for a query leaving a 100k-token entry early). Breadth-first with
    parent links, each level ordered as mlx-lm's stack visits it (children in reverse
    insertion order), returns the same entry on ties."""

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        if model not in self._trie:
            return PromptTrieResult(model, None, None, None, 0)
        current = self._trie[model]
        if not tokens and "__value__" in current:
            return PromptTrieResult(model, [], None, None, 0)
        last_index, index = -1, 0
        while index < len(tokens) and tokens[index] in current:
            current = current[tokens[index]]
            if "__value__" in current:
                last_index = index
            index += 1
        if last_index == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last_index + 1] if last_index > 0 else None
        longer = None
        if index > 0:
            longer = tokens[:index] + _shortest_extension(current)
        return PromptTrieResult(model, None, shorter, longer, index)

    def holds_prefix(self, model: Any, tokens: list[int]) -> bool:
        """Whether a strict prefix of ``tokens`` is stored: what ``pop_prefixes`` (inserting
        a trimmable ``tokens``) would drop."""
        node = self._trie.get(model)
        for tok in tokens:
            if node is None:
                return False
            if "__value__" in node:
                return True
            node = node.get(tok)
        return False


def _shortest_extension(node: dict) -> list[int]:
    """Tokens from ``node`` to its nearest stored value (mlx-lm's tie-breaking)."""
    level: list[tuple[dict, int]] = [(node, -1)]
    links: list[tuple[int, Any]] = []  # (parent link, token) per visited node
    while level:
        nxt: list[tuple[dict, int]] = []
        for cur, link in level:
            if "__value__" in cur:
                out = []
                while link >= 0:
                    link, tok = links[link]
                    out.append(tok)
                return out[::-1]
            for tok in reversed(list(cur)):
                links.append((link, tok))
                nxt.append((cur[tok], len(links) - 1))
        level = nxt
    return []


class Entries:
    """mlx-lm's prompt cache rules over snapshots: match, LRU lists, limits. Not
    thread-safe; its own methods call only its private ones (``MemoryTier`` wraps the
    public ones in its lock)."""

    def __init__(self, max_entries: int = 10, max_bytes: int = 1 << 63, *,
                 touch_on_hit: bool = False) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.touch_on_hit = touch_on_hit
        self._trie = Trie()
        self._lrus: dict[str, OrderedDict[Key, None]] = {k: OrderedDict() for k in ORDERING}
        self._bytes_by_type = {k: 0 for k in ORDERING}

    def __len__(self) -> int:
        return self._count()

    @property
    def nbytes(self) -> int:
        return self._held()

    def _count(self) -> int:
        return sum(len(v) for v in self._lrus.values())

    def _held(self) -> int:
        return sum(self._bytes_by_type.values())

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return {k: {"n_sequences": len(self._lrus[k]), "n_bytes": self._bytes_by_type[k]}
                for k in ORDERING}

    def _find(self, model: Hashable, tokens: list[int], near: Near | None = None) -> list[tuple[Snapshot, list[int], int]]:
        """Candidates by mlx-lm's ``fetch_nearest_cache`` rules, best first:
        (snapshot, the tokens it is stored under, tokens it serves for this query).
        ``near`` is told what the search saw (``misses.Near``)."""
        result = self._trie.search(model, tokens)
        if result.exact is not None:
            return [(self._trie.get(model, result.exact), result.exact, len(tokens))]
        out = []
        short = len(result.shorter) if result.shorter is not None else 0
        if near is not None and short:
            near.saw("memory", short, short)
        if result.longer is not None and result.common_prefix > short:
            snap: Snapshot = self._trie.get(model, result.longer)
            longer, common = len(result.longer), result.common_prefix
            n = serves(longer, common, len(tokens), lambda m: snap.cut_to(longer, m))
            usable = snap.opaque is None or snap.trimmable  # mlx-lm: even with nothing to cut
            usable = usable and n is not None
            if near is not None:
                best = self._longest_sharing(model, tokens, common) or result.longer
                near.saw("memory", common, len(best), best[common : common + AFTER])
                if not usable:
                    near.refused(min(common, len(tokens) - 1))
            if usable and n is not None:
                out.append((snap, result.longer, n))
        if result.shorter is not None and short > 0:
            out.append((self._trie.get(model, result.shorter), result.shorter, short))
        return out

    def _longest_sharing(self, model: Hashable, tokens: list[int], common: int) -> tuple[int, ...] | None:
        """The stored entry sharing ``common`` tokens with ``tokens`` that holds most of
        them (the longest, up to the query's length; then the shorter: ``misses.rank``):
        what a miss there cost. The trie's ``longer`` is the shortest such entry (mlx-lm's,
        the one it cuts), which may end a few tokens past the divergence while a whole
        conversation shares it. Read off
        the entry keys (the ones sharing the query's first and last common token are
        compared whole), on a lookup that leaves a longer entry only."""
        head, n_q = tuple(tokens[:common]), len(tokens)
        keys = sorted((k for lru in self._lrus.values() for m, k in lru if m == model and len(k) > common),
                      key=lambda k: (-min(len(k), n_q), len(k)))  # misses.rank's order
        for k in keys:
            if k[common - 1] == head[-1] and k[0] == head[0] and k[:common] == head:
                return k
        return None

    def lookup(self, model: Hashable, tokens: list[int], near: Near | None = None,
               floor: int = 0) -> tuple[list[Any] | None, int, Snapshot | None]:
        """mlx-lm's ``fetch_nearest_cache`` rules: (fresh cache or None, tokens it holds,
        the snapshot it came from). The cache's arrays are evaluated: any thread may use them.
        ``floor``: candidates serving fewer tokens are passed over (``floors.memory_floor``;
        ``near`` still sees them); a cache holding fewer positions than its key serves only
        those, and none when that falls under ``floor``."""
        for snap, stored, n in self._find(model, tokens, near):
            if n < floor:
                continue
            cache = snap.materialize()
            if n < len(stored):  # a longer entry, trimmed back to the common prefix (_find allowed it)
                for c in cache:
                    c.trim(len(stored) - n)
            # Evaluated here, as a disk restore is: the views were made on this thread's
            # stream, and MLX streams are per thread (Metal, MLX >= 0.31.2), so a host
            # running the model on another thread could not evaluate them.
            mx.eval([a for c in cache for a in codec.layer_arrays(c)])
            self._touch(model, stored)
            # A snapshot is keyed by the tokens it was inserted with; a cache that holds fewer
            # positions (mlx-lm's server inserts prompt + generated tokens with a cache that
            # has not seen the last one) serves only the prefix it holds.
            held = codec.held(cache)
            if held is not None and held < n:
                n = held
                if n <= 0 or n < floor:
                    return None, 0, None
            return cache, n, snap
        return None, 0, None

    def peek(self, model: Hashable, tokens: list[int], floor: int = 0) -> int:
        """How many tokens ``lookup`` would serve, materialising nothing, touching nothing."""
        return next((n for _, _, n in self._find(model, tokens) if n >= floor), 0)

    def snapshots(self) -> list[Snapshot]:
        """Every snapshot held, in no particular order."""
        return [self._trie.get(model, list(tokens)) for lru in self._lrus.values() for model, tokens in lru]

    def holds_prefix(self, model: Hashable, tokens: list[int]) -> bool:
        """Whether a strict prefix of ``tokens`` is stored: inserting a trimmable snapshot
        of ``tokens`` would drop it (mlx-lm's rule)."""
        return self._trie.holds_prefix(model, tokens)

    def get(self, model: Hashable, tokens: list[int]) -> Snapshot | None:
        """The snapshot stored under exactly ``tokens``, or None."""
        return self._get(model, tokens)

    def _get(self, model: Hashable, tokens: list[int]) -> Snapshot | None:
        try:
            return self._trie.get(model, tokens)
        except KeyError:
            return None

    def room(self, model: Hashable, tokens: list[int], trimmable: bool, nbytes: int,
             max_bytes: int | None = None) -> Room | None:
        """None if a snapshot of ``tokens`` (``nbytes``, ``trimmable``) can go in now without
        evicting or dropping anything (within ``max_bytes`` too, if given), else why not."""
        if self._get(model, tokens) is not None or (trimmable and self._trie.holds_prefix(model, tokens)):
            return Room.SKIP
        limit = min(self.max_bytes, max_bytes if max_bytes is not None else self.max_bytes)
        if self._count() + 1 > self.max_entries or self._held() + nbytes > limit:
            return Room.FULL
        return None

    def remove(self, model: Hashable, tokens: list[int]) -> Snapshot | None:
        """Take out the snapshot stored under exactly ``tokens`` (None if there is none)."""
        if self._get(model, tokens) is None:
            return None
        snap: Snapshot = self._trie.pop(model, list(tokens))
        self._bytes_by_type[snap.cache_type] -= snap.nbytes
        self._forget((model, tuple(tokens)))
        return snap

    def insert(self, model: Hashable, tokens: list[int], snap: Snapshot, *,
               recent: bool = True) -> Evicted:
        """Store a snapshot; returns what was evicted by the limits (the store persists
        those not yet on disk). Prefixes dropped because ``snap`` covers them are not
        returned: ``snap`` itself will be persisted. ``recent=False`` files it as the least
        recently used of its list (first to go), e.g. a snapshot nobody asked for yet."""
        key: Key = (model, tuple(tokens))
        prev = self._trie.add(model, tokens, snap)
        if prev is not None:
            self._bytes_by_type[prev.cache_type] -= prev.nbytes
            self._forget(key)
        self._lrus[snap.cache_type][key] = None
        if not recent:
            self._lrus[snap.cache_type].move_to_end(key, last=False)
        self._bytes_by_type[snap.cache_type] += snap.nbytes

        evicted: Evicted = []
        if snap.trimmable:  # an entry every prefix can be cut from covers its prefixes
            for n, old in self._trie.pop_prefixes(model, tokens):
                self._bytes_by_type[old.cache_type] -= old.nbytes
                self._forget((model, tuple(tokens[:n])))
        if self._count() > self.max_entries:
            evicted.append(self._pop())
        while self._held() > self.max_bytes and self._count():
            evicted.append(self._pop())
        return evicted

    def trim_to(self, n_sequences: int | None = None, n_bytes: int | None = None) -> Evicted:
        n_sequences = max(0, n_sequences) if n_sequences is not None else 1 << 63
        n_bytes = max(0, n_bytes) if n_bytes is not None else 1 << 63
        out = []
        while self._count() > n_sequences:
            out.append(self._pop())
        while self._held() > n_bytes and self._count():
            out.append(self._pop())
        return out

    def clear(self) -> Evicted:
        return Entries.trim_to(self, n_sequences=0)

    # -- internals ---------------------------------------------------------------------

    def _touch(self, model: Hashable, tokens: list[int]) -> None:
        if not self.touch_on_hit:
            return
        key = (model, tuple(tokens))
        for lru in self._lrus.values():
            if key in lru:
                lru.move_to_end(key)
                return

    def _forget(self, key: Key) -> None:
        for k in ORDERING:
            if key in self._lrus[k]:
                del self._lrus[k][key]
                return

    def _pop(self) -> tuple[Hashable, list[int], Snapshot]:
        # mlx-lm's CacheOrder.pop: take from the first list that is at least as long as
        # the next one, so assistant turns go before user turns before system prompts.
        order = [self._lrus[k] for k in ORDERING]
        victim = order[-1]
        for a, b in zip(order, order[1:]):
            if a and len(a) >= len(b):
                victim = a
                break
        (model, tokens), _ = victim.popitem(last=False)
        snap: Snapshot = self._trie.pop(model, list(tokens))
        self._bytes_by_type[snap.cache_type] -= snap.nbytes
        return model, list(tokens), snap
