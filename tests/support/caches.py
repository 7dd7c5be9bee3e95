"""Synthetic caches for store tests, and the identities and token lists they are stored under.

- ``synth(tokens)``: KVCache layers whose position i holds keys / values derived from
  (tokens[i], i) only, so the right content of any prefix is known (``assert_synth``);
  ``snapshot=True`` adds a recurrent-state layer.
- ``synth_kv_cache(layers, heads, n, dim)``: KVCache layers of seeded random keys / values,
  for tests that need bytes of a given size rather than checkable content; ``kv_prefix``
  cuts such a cache to its first positions (a conversation's earlier turn).

(The fault harness has its own prefix-hash caches, ``tools.harness.faults.synth.syn_cache``.)
"""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from kvstore.identity import Identity
from tests.support.stores import cache_digest


def synth(tokens: list[int], *, layers: int = 2, snapshot: bool = False) -> list:
    """A cache whose position i holds keys/values derived from (tokens[i], i) only, so the
    right content of any prefix is known. ``snapshot=True`` adds a recurrent-state layer
    (ArraysCache, a function of the whole prefix): such a cache is stored as one snapshot
    and is only valid at exactly its length."""
    t = mx.array(tokens, dtype=mx.float32)
    pos = mx.arange(len(tokens), dtype=mx.float32)
    base = mx.stack([t, pos, t * 0.5 + 1, pos * 2 + 3], axis=-1)[None, None]  # (1, 1, n, 4)
    cache = []
    for layer in range(layers):
        c = KVCache()
        c.keys, c.values, c.offset = base + layer, base * 2 - layer, len(tokens)
        cache.append(c)
    if snapshot:
        a = ArraysCache(1)
        a[0] = mx.array([[float(sum(tokens) % 100003), float(len(tokens))]])
        cache.insert(0, a)
    mx.eval([x for c in cache for x in ([c.keys, c.values] if isinstance(c, KVCache) else c.cache)])
    return cache


def assert_synth(cache: list, tokens: list[int], *, snapshot: bool = False) -> None:
    """``cache`` is exactly what ``synth(tokens)`` builds."""
    assert cache is not None
    assert cache_digest(cache) == cache_digest(synth(tokens, snapshot=snapshot))


def ident(name: str) -> Identity:
    return Identity.from_components({"test": name}, name=name)


def rand_tokens(n: int, seed: int, vocab: int = 50000) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(vocab) for _ in range(n)]


def synth_kv_cache(layers: int, heads: int, n: int, dim: int, *, dtype=mx.float32, seed: int = 0,
                   shared: bool = False) -> list:
    """``layers`` KVCache objects holding ``n`` positions of random keys / values.

    ``shared=True`` makes every layer hold the same two arrays (cheap to build, the same
    bytes to write as distinct arrays)."""
    key = mx.random.key(seed)
    cache = []
    k = v = None
    for i in range(layers):
        if k is None or not shared:
            k1, k2, key = mx.random.split(key, 3)
            k = mx.random.normal((1, heads, n, dim), key=k1).astype(dtype)
            v = mx.random.normal((1, heads, n, dim), key=k2).astype(dtype)
            mx.eval(k, v)
        c = KVCache()
        c.keys, c.values, c.offset = k, v, n
        cache.append(c)
    return cache


def kv_prefix(cache: list, k: int) -> list:
    """The first ``k`` positions of KVCache layers ``cache`` as a cache of their own (copies,
    evaluated): what a conversation's earlier turn inserted."""
    out = []
    for c in cache:
        p = KVCache()
        p.keys, p.values, p.offset = mx.array(c.keys[..., :k, :]), mx.array(c.values[..., :k, :]), k
        out.append(p)
    mx.eval([a for p in out for a in (p.keys, p.values)])
    return out
