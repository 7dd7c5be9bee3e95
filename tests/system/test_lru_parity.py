"""Pin mlx-lm's ``LRUPromptCache`` behaviour and hold kvstore's drop-in to it.

Every parametrized test runs on three implementations:

- ``mlx_lm``: ``mlx_lm.models.cache.LRUPromptCache``, the reference. Every test passes on it
  (mlx-lm 0.31.3 and 0.32.x: ``PromptTrie`` / ``LRUPromptCache`` are the same in both).
- ``kvstore_memory``: ``kvstore.LRUPromptCache(..., disk=False)``: identical in everything,
  including a fetch after eviction being a miss.
- ``kvstore_disk``: ``kvstore.LRUPromptCache(..., cache_dir=tmp)``: identical in everything
  observable about the memory tier (len, nbytes, stats_by_type, returned caches and
  remaining tokens). Its one intended difference, an entry gone from memory coming back from
  disk, is left out of the parametrized tests (their "evicted -> miss" checks run on the
  memory-only implementations) and tested on its own at the end, after ``store.flush()``.

The rules pinned here are read from mlx-lm's source (``PromptTrie.search``,
``LRUPromptCache.fetch_nearest_cache`` / ``insert_cache`` / ``trim_to``, ``CacheOrder.pop``).
Caches are real mlx-lm ``KVCache`` objects (trimmable) filled with ``update_and_fetch``, and
``RotatingKVCache`` objects that wrapped (offset >= max_size: not trimmable). No model runs:
model keys are mlx-lm server keys ``(model dir, None, None)`` naming real tiny model
directories, so the disk implementation resolves them to identities. kvstore persists only
caches whose layers match the model's (their count, attention KV vs recurrent state, and each
attention layer's KV heads, head_dim and dtype), so the caches here have the model's layer
count and KV geometry (2 heads x head_dim 32, float32: tiny-llama's and tiny-gemma3's).

By default ``kv()`` sizes each KVCache's buffer to exactly the positions it holds, so mlx-lm's
byte count (the allocated buffer) and the filled size agree; the ordinary over-allocated
buffers are checked on their own (``test_nbytes_counts_the_allocated_buffer``).

One deliberate difference is pinned as such: the disk tier answers some lookups where
mlx-lm's matching rules give a miss (it walks every stored prefix).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

import mlx.core as mx
from mlx_lm.models import cache as mlc

import kvstore

IMPLS = ("mlx_lm", "kvstore_memory", "kvstore_disk")
TYPES = ("assistant", "user", "system")
BIG = 1 << 63

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models() -> tuple[tuple[str, None, None], tuple[str, None, None]]:
    """Two distinct model keys, as mlx-lm's server builds them."""
    import json

    from tools.testing.model_builds import model_path

    keys = []
    for name, layers in (("tiny-llama", LAYERS), ("tiny-gemma3", LAYERS_2)):
        path = model_path(name)
        assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == layers
        keys.append((str(path), None, None))
    return keys[0], keys[1]


@pytest.fixture
def M(models: Any) -> tuple[str, None, None]:
    return models[0]


class Impl:
    """Builds prompt caches of one implementation; closes kvstore's at teardown."""

    def __init__(self, kind: str, tmp_path: pathlib.Path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.opened: list[Any] = []

    @property
    def memory_only(self) -> bool:
        """A fetch of an entry gone from memory is a miss (no disk behind)."""
        return self.kind != "kvstore_disk"

    def new(self, max_size: int = 10, max_bytes: int = BIG, *,
            cache_dir: pathlib.Path | None = None) -> Any:
        if self.kind == "mlx_lm":
            return mlc.LRUPromptCache(max_size, max_bytes)
        d = cache_dir or self.tmp_path / f"kv{len(self.opened)}"
        # min_disk_hit=0: these toy prompts are a few tokens long; the rules compared here
        # are the lookup's own, not the floor on tiny disk hits (tests/system/test_newcomer.py)
        pc = kvstore.LRUPromptCache(max_size, max_bytes, cache_dir=d, disk=self.kind == "kvstore_disk",
                                    min_disk_hit=0)
        self.opened.append(pc)
        return pc

    def close(self) -> None:
        for pc in self.opened:
            pc.close()


@pytest.fixture(params=IMPLS)
def impl(request: Any, tmp_path: pathlib.Path) -> Any:
    it = Impl(request.param, tmp_path)
    yield it
    it.close()


@pytest.fixture
def disk_impl(tmp_path: pathlib.Path) -> Any:
    it = Impl("kvstore_disk", tmp_path)
    yield it
    it.close()


# --------------------------------------------------------------------------- caches

H, D = 2, 32   # tiny-llama's and tiny-gemma3's KV heads and head_dim (a cache of other shapes stays in memory)
LAYERS, LAYERS_2 = 3, 4   # tiny-llama's and tiny-gemma3's layer counts


def kv(n: int, seed: int = 0, *, layers: int = LAYERS, exact: bool = True) -> list[Any]:
    """Real mlx-lm KVCache layers holding ``n`` positions (random keys and values).

    ``exact`` allocates the buffer to exactly ``n`` positions (as a cache restored by
    ``load_prompt_cache`` has); otherwise mlx-lm's 256-position steps apply."""
    out = []
    for i in range(layers):
        c = mlc.KVCache()
        if exact:
            c.step = n
        k = mx.random.normal((1, H, n, D), key=mx.random.key(1000 * seed + 2 * i))
        v = mx.random.normal((1, H, n, D), key=mx.random.key(1000 * seed + 2 * i + 1))
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def rotating(n: int, max_size: int, seed: int = 0, *, layers: int = LAYERS) -> list[Any]:
    """RotatingKVCache layers fed ``n`` positions at once; not trimmable once n >= max_size."""
    out = []
    for i in range(layers):
        c = mlc.RotatingKVCache(max_size=max_size)
        k = mx.random.normal((1, H, n, D), key=mx.random.key(1000 * seed + 2 * i + 500))
        v = mx.random.normal((1, H, n, D), key=mx.random.key(1000 * seed + 2 * i + 501))
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


class Fake:
    """Not an mlx-lm cache: the small stand-in mlx-lm's own tests insert."""

    def __init__(self, length: int, tag: int = 0, nbytes: int = 100, trimmable: bool = True) -> None:
        self.length = length
        self.tag = tag
        self._nbytes = nbytes
        self.trimmable = trimmable

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(self.length, n)
        self.length -= n
        return n


def fake(length: int, tag: int = 0, nbytes: int = 100, trimmable: bool = True) -> list[Fake]:
    return [Fake(length, tag, nbytes, trimmable)]


def size(cache: list[Any]) -> int:
    """mlx-lm's byte count of a cache: ``sum(c.nbytes for c in cache)``."""
    return sum(c.nbytes for c in cache)


def snapshot(cache: list[Any], n: int | None = None) -> list[tuple]:
    """What a cache holds (its first ``n`` positions for KVCache), for comparisons."""
    out: list[tuple] = []
    for c in cache:
        if isinstance(c, Fake):
            out.append(("Fake", c.tag, c.length if n is None else n, c.nbytes, c.trimmable))
        elif type(c) is mlc.KVCache:
            m = c.offset if n is None else n
            assert m <= c.offset
            if c.keys is None:
                out.append(("KVCache", 0, None, None))
            else:
                out.append(("KVCache", m, c.keys[..., :m, :], c.values[..., :m, :]))
        elif type(c) is mlc.RotatingKVCache:
            assert n is None or n == c.offset
            out.append(("RotatingKVCache", c.offset, c._idx, c.max_size, c.keep, c.keys, c.values))
        else:  # pragma: no cover
            raise AssertionError(f"unexpected cache class {type(c)}")
    return out


def assert_same(got: list[Any] | None, want: list[tuple] | None) -> None:
    if want is None:
        assert got is None
        return
    assert got is not None
    have = snapshot(got)
    assert len(have) == len(want)
    for a, b in zip(have, want):
        assert len(a) == len(b) and a[0] == b[0]
        for x, y in zip(a[1:], b[1:]):
            if isinstance(x, mx.array) or isinstance(y, mx.array):
                assert x.shape == y.shape and mx.array_equal(x, y).item()
            else:
                assert x == y


def fetch(pc: Any, model: Any, tokens: list[int]) -> tuple[Any, list[int]]:
    cache, rest = pc.fetch_nearest_cache(model, list(tokens))
    return cache, list(rest)


def check(pc: Any, model: Any, tokens: list[int], want: list[tuple] | None,
          rest: list[int]) -> list[Any] | None:
    """fetch_nearest_cache returns a cache holding ``want`` and the tokens ``rest``."""
    cache, got_rest = fetch(pc, model, tokens)
    assert got_rest == rest
    assert_same(cache, want)
    return cache


def stats(pc: Any, **by_type: tuple[int, int]) -> None:
    """len, nbytes and stats_by_type are exactly ``by_type`` (type -> (sequences, bytes))."""
    counts = {t: by_type.get(t, (0, 0)) for t in TYPES}
    want = {t: {"n_sequences": n, "n_bytes": b} for t, (n, b) in counts.items()}
    assert pc.stats_by_type() == want
    assert len(pc) == sum(v["n_sequences"] for v in want.values())
    assert pc.nbytes == sum(v["n_bytes"] for v in want.values())


# --------------------------------------------------------------------------- matching


def test_empty_cache_misses(impl: Impl, M: Any) -> None:
    pc = impl.new()
    stats(pc)
    check(pc, M, [1, 2, 3], None, [1, 2, 3])
    check(pc, M, [], None, [])
    stats(pc)


def test_exact_hit_returns_cache_and_no_tokens(impl: Impl, M: Any) -> None:
    pc = impl.new()
    a = kv(5, seed=1)
    pc.insert_cache(M, [1, 2, 3, 4, 5], a)
    stats(pc, assistant=(1, size(a)))
    check(pc, M, [1, 2, 3, 4, 5], snapshot(a), [])
    check(pc, M, [1, 2, 3, 4, 5], snapshot(a), [])   # a hit changes nothing
    check(pc, M, [9, 9], None, [9, 9])               # nothing in common
    stats(pc, assistant=(1, size(a)))


def test_longest_shorter_prefix(impl: Impl, M: Any) -> None:
    pc = impl.new()
    long_, short = kv(4, seed=1), kv(2, seed=2)
    pc.insert_cache(M, [1, 2, 3, 4], long_)
    pc.insert_cache(M, [1, 2], short)        # a prefix inserted after: both stay
    stats(pc, assistant=(2, size(long_) + size(short)))
    check(pc, M, [1, 2, 3, 4, 5, 6], snapshot(long_), [5, 6])   # the longest stored prefix
    check(pc, M, [1, 2, 7], snapshot(short), [7])
    check(pc, M, [1, 2, 3, 4], snapshot(long_), [])
    check(pc, M, [1, 2], snapshot(short), [])
    stats(pc, assistant=(2, size(long_) + size(short)))


def test_one_token_prefix_only_through_the_trim_path(impl: Impl, M: Any) -> None:
    """mlx-lm's search counts a stored prefix as "shorter" only when it has 2+ tokens
    (``last_index > 0``). A 1-token entry is still found as the "longer" candidate (the node
    it ends on), which is used when trimmable (nothing to trim) and ignored otherwise."""
    pc = impl.new()
    one = kv(1, seed=1)
    pc.insert_cache(M, [7], one)
    check(pc, M, [7, 8, 9], snapshot(one), [8, 9])
    check(pc, M, [7], snapshot(one), [])

    pc.insert_cache(M, [5], fake(1, tag=5, trimmable=False))
    check(pc, M, [5, 8, 9], None, [5, 8, 9])                      # miss
    check(pc, M, [5], snapshot(fake(1, tag=5, trimmable=False)), [])  # exact still hits

    two = kv(2, seed=2)
    pc.insert_cache(M, [3, 4], two)
    check(pc, M, [3, 4, 9], snapshot(two), [9])                   # 2 tokens: shorter prefix
    stats(pc, assistant=(3, size(one) + 100 + size(two)))


def test_longer_entry_trimmed_to_common_prefix(impl: Impl, M: Any) -> None:
    """A longer trimmable entry is trimmed to ``min(len(tokens) - 1, common_prefix)``."""
    pc = impl.new()
    a = kv(6, seed=1)
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], a)
    check(pc, M, [1, 2, 3, 9], snapshot(a, 3), [9])           # diverges after 3
    check(pc, M, [1, 2, 3, 9, 9, 9, 9, 9], snapshot(a, 3), [9, 9, 9, 9, 9])
    check(pc, M, [1, 2, 3], snapshot(a, 2), [3])              # a prefix: keep one token to run
    check(pc, M, [1, 2, 3, 4, 5], snapshot(a, 4), [5])
    check(pc, M, [1], snapshot(a, 0), [1])                    # min(0, 1): trimmed to nothing
    check(pc, M, [1, 9], snapshot(a, 1), [9])
    check(pc, M, [2, 3], None, [2, 3])
    stats(pc, assistant=(1, size(a)))                         # the stored entry is untouched
    check(pc, M, [1, 2, 3, 4, 5, 6], snapshot(a), [])


def test_trimmed_longer_beats_shorter_only_when_it_shares_more(impl: Impl, M: Any) -> None:
    pc = impl.new()
    long_, short = kv(6, seed=1), kv(2, seed=2)
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], long_)
    pc.insert_cache(M, [1, 2], short)
    check(pc, M, [1, 2, 3, 9], snapshot(long_, 3), [9])       # 3 shared > 2 stored
    check(pc, M, [1, 2, 9], snapshot(short), [9])             # 2 shared, not > 2: shorter
    check(pc, M, [1, 2, 3], snapshot(long_, 2), [3])          # common 3 > 2, prefix min(2, 3)
    stats(pc, assistant=(2, size(long_) + size(short)))


def test_non_trimmable_longer_entry_is_not_used(impl: Impl, M: Any) -> None:
    pc = impl.new()
    rot = rotating(6, max_size=4, seed=1)
    assert not rot[0].is_trimmable()
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], rot)
    check(pc, M, [1, 2, 3, 9], None, [1, 2, 3, 9])
    check(pc, M, [1, 2, 3], None, [1, 2, 3])
    check(pc, M, [1, 2, 3, 4, 5, 6], snapshot(rot), [])      # exact hit is fine
    check(pc, M, [1, 2, 3, 4, 5, 6, 7], snapshot(rot), [7])  # and as a shorter prefix

    short = kv(2, seed=2)
    pc.insert_cache(M, [1, 2], short)
    check(pc, M, [1, 2, 3, 9], snapshot(short), [3, 9])      # falls back to the shorter one
    stats(pc, assistant=(2, size(rot) + size(short)))

    pc2 = impl.new()
    pc2.insert_cache(M, [1, 2, 3, 4, 5, 6], fake(6, tag=1, trimmable=False))
    check(pc2, M, [1, 2, 3, 9], None, [1, 2, 3, 9])


# --------------------------------------------------------------------------- copies


def test_returned_cache_is_a_copy(impl: Impl, M: Any) -> None:
    pc = impl.new()
    a = kv(6, seed=1)
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], a)
    want = snapshot(a)

    def extend(cache: list[Any], n: int, seed: int) -> None:
        for i, c in enumerate(cache):
            k = mx.random.normal((1, H, n, D), key=mx.random.key(9000 + seed + i))
            c.update_and_fetch(k, k + 1)
            mx.eval(c.keys, c.values)

    got = check(pc, M, [1, 2, 3, 4, 5, 6], want, [])           # exact hit, extended
    extend(got, 3, 1)
    assert got[0].offset == 9
    check(pc, M, [1, 2, 3, 4, 5, 6], want, [])

    got = check(pc, M, [1, 2, 3, 9], snapshot(a, 3), [9])      # trimmed hit, overwritten in place
    extend(got, 1, 2)
    assert got[0].offset == 4
    check(pc, M, [1, 2, 3, 4, 5, 6], want, [])
    check(pc, M, [1, 2, 3, 4, 5, 9], snapshot(a, 5), [9])

    got = check(pc, M, [1, 2, 3, 4, 5, 6, 7], want, [7])       # shorter-prefix hit
    extend(got, 300, 3)                                        # past a buffer step
    check(pc, M, [1, 2, 3, 4, 5, 6, 7], want, [7])

    pc.insert_cache(M, [8, 8], fake(2, tag=8))
    got, _ = fetch(pc, M, [8, 8])
    got[0].trim(2)
    got[0].tag = -1
    check(pc, M, [8, 8], snapshot(fake(2, tag=8)), [])
    stats(pc, assistant=(2, size(a) + 100))


# --------------------------------------------------------------------------- eviction


def test_max_size_eviction_follows_cache_order(impl: Impl, M: Any) -> None:
    """``CacheOrder.pop``: the first of assistant / user / system that is non-empty and at
    least as long as the next list gives its oldest entry; failing that, system does."""
    pc = impl.new(max_size=3)
    c = {name: kv(2, seed=i) for i, name in enumerate(["A1", "U1", "U2", "S1", "A2", "S2", "S3"])}
    tok = {name: [10 + i, 20 + i] for i, name in enumerate(c)}
    B = size(c["A1"])

    pc.insert_cache(M, tok["A1"], c["A1"], cache_type="assistant")
    pc.insert_cache(M, tok["U1"], c["U1"], cache_type="user")
    pc.insert_cache(M, tok["U2"], c["U2"], cache_type="user")
    stats(pc, assistant=(1, B), user=(2, 2 * B))
    pc.insert_cache(M, tok["S1"], c["S1"], cache_type="system")   # a=1 < u=2; u=2 >= s=1: U1
    stats(pc, assistant=(1, B), user=(1, B), system=(1, B))
    pc.insert_cache(M, tok["A2"], c["A2"], cache_type="assistant")  # a=2 >= u=1: A1
    stats(pc, assistant=(1, B), user=(1, B), system=(1, B))
    pc.insert_cache(M, tok["S2"], c["S2"], cache_type="system")   # a=1 >= u=1: A2
    stats(pc, user=(1, B), system=(2, 2 * B))
    pc.insert_cache(M, tok["S3"], c["S3"], cache_type="system")   # a empty; u=1 < s=3: S1
    stats(pc, user=(1, B), system=(2, 2 * B))

    for name in ("U2", "S2", "S3"):
        check(pc, M, tok[name], snapshot(c[name]), [])
    if impl.memory_only:
        for name in ("A1", "U1", "S1", "A2"):
            check(pc, M, tok[name], None, tok[name])


def test_max_size_evicts_one_entry_per_insert(impl: Impl, M: Any) -> None:
    pc = impl.new(max_size=4)
    caches = [kv(2, seed=i) for i in range(6)]
    for i, c in enumerate(caches):
        pc.insert_cache(M, [i + 1, 50], c)
    B = size(caches[0])
    stats(pc, assistant=(4, 4 * B))
    pc.max_size = 2                     # a lower limit applies at the next insert, one pop
    pc.insert_cache(M, [99, 50], kv(2, seed=99))
    stats(pc, assistant=(4, 4 * B))
    pc.trim_to(n_sequences=2)
    stats(pc, assistant=(2, 2 * B))
    check(pc, M, [6, 50], snapshot(caches[5]), [])
    check(pc, M, [99, 50], snapshot(kv(2, seed=99)), [])


def test_max_bytes_eviction(impl: Impl, M: Any) -> None:
    a, b, c = kv(4, seed=1), kv(4, seed=2), kv(4, seed=3)
    B = size(a)
    pc = impl.new(max_size=10, max_bytes=2 * B + B // 2)
    pc.insert_cache(M, [1, 1, 1, 1], a, cache_type="system")
    pc.insert_cache(M, [2, 2, 2, 2], b)
    stats(pc, assistant=(1, B), system=(1, B))
    pc.insert_cache(M, [3, 3, 3, 3], c)                 # over: a=2 >= u=0, an assistant goes
    stats(pc, assistant=(1, B), system=(1, B))
    check(pc, M, [1, 1, 1, 1], snapshot(a), [])
    check(pc, M, [3, 3, 3, 3], snapshot(c), [])
    if impl.memory_only:
        check(pc, M, [2, 2, 2, 2], None, [2, 2, 2, 2])

    big = kv(12, seed=4)                                # 3 entries' worth: pops until it
    pc.insert_cache(M, [4] * 12, big, cache_type="user")  # fits: c (a=1 >= u=1), then itself
    stats(pc, system=(1, B))                            # (a=0; u=1 >= s=1)
    if impl.memory_only:
        check(pc, M, [4] * 12, None, [4] * 12)

    pc.insert_cache(M, [5, 5], fake(2, tag=5, nbytes=B))  # any object's nbytes counts
    pc.insert_cache(M, [6, 6], fake(2, tag=6, nbytes=B))
    pc.insert_cache(M, [7, 7], fake(2, tag=7, nbytes=B))
    stats(pc, assistant=(1, B), system=(1, B))         # [5, 5] then [6, 6] went
    check(pc, M, [7, 7], snapshot(fake(2, tag=7, nbytes=B)), [])
    check(pc, M, [5, 5], None, [5, 5])                  # fakes are never on disk


def test_trim_to(impl: Impl, M: Any) -> None:
    pc = impl.new()
    caches = {t: kv(3, seed=i) for i, t in enumerate(TYPES)}
    B = size(caches["user"])
    for i, t in enumerate(TYPES):
        pc.insert_cache(M, [i + 1, 0, 0], caches[t], cache_type=t)
    pc.insert_cache(M, [9, 0, 0], kv(3, seed=9), cache_type="user")
    stats(pc, assistant=(1, B), user=(2, 2 * B), system=(1, B))
    pc.trim_to()                                         # no limits: nothing happens
    stats(pc, assistant=(1, B), user=(2, 2 * B), system=(1, B))
    pc.trim_to(n_sequences=3)                            # a=1 < u=2; u=2 >= s=1: oldest user
    stats(pc, assistant=(1, B), user=(1, B), system=(1, B))
    check(pc, M, [9, 0, 0], snapshot(kv(3, seed=9)), [])
    pc.trim_to(n_bytes=2 * B)                            # a=1 >= u=1: the assistant
    stats(pc, user=(1, B), system=(1, B))
    pc.trim_to(n_sequences=5, n_bytes=B + 1)             # both limits; bytes: u=1 >= s=1
    stats(pc, system=(1, B))
    check(pc, M, [3, 0, 0], snapshot(caches["system"]), [])
    pc.trim_to(n_sequences=-5)                           # clamped to 0
    stats(pc)
    if impl.memory_only:
        check(pc, M, [3, 0, 0], None, [3, 0, 0])
    pc.trim_to(n_sequences=0, n_bytes=0)                 # on an empty cache
    stats(pc)


# --------------------------------------------------------------------------- inserting


def test_trimmable_insert_drops_stored_prefixes(impl: Impl, M: Any) -> None:
    pc = impl.new()
    e5, e1, e2, e4 = kv(1, seed=5), kv(1, seed=1), kv(2, seed=2), kv(4, seed=4)
    empty = [mlc.KVCache() for _ in range(LAYERS)]
    pc.insert_cache(M, [], empty, cache_type="system")  # an empty cache under []
    stats(pc, system=(1, 0))
    pc.insert_cache(M, [5], e5, cache_type="user")      # [] is a prefix of everything
    stats(pc, user=(1, size(e5)))
    pc.insert_cache(M, [1], e1)
    stats(pc, assistant=(1, size(e1)), user=(1, size(e5)))
    pc.insert_cache(M, [1, 2], e2, cache_type="system")  # drops [1], whatever its type
    stats(pc, user=(1, size(e5)), system=(1, size(e2)))
    pc.insert_cache(M, [1, 2, 3, 4], e4)                # drops [1, 2]; [5] is no prefix
    stats(pc, assistant=(1, size(e4)), user=(1, size(e5)))
    check(pc, M, [1, 2, 3, 4], snapshot(e4), [])
    check(pc, M, [5], snapshot(e5), [])

    rot = rotating(6, max_size=4, seed=6)               # not trimmable: prefixes stay
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], rot)
    stats(pc, assistant=(2, size(e4) + size(rot)), user=(1, size(e5)))
    check(pc, M, [1, 2, 3, 4, 5, 6], snapshot(rot), [])
    check(pc, M, [1, 2, 3, 4, 5], snapshot(e4), [5])    # rot is longer but not trimmable

    f = fake(8, tag=8)                                  # a trimmable non-mlx object drops
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6, 7, 8], f)     # them too, trimmable or not
    stats(pc, assistant=(1, 100), user=(1, size(e5)))
    check(pc, M, [1, 2, 3, 4, 5, 6, 7, 8], snapshot(f), [])


def test_reinsert_replaces_the_entry(impl: Impl, M: Any) -> None:
    pc = impl.new()
    a, b, c = kv(3, seed=1), kv(3, seed=2), fake(3, tag=3, nbytes=7)
    pc.insert_cache(M, [1, 2, 3], a, cache_type="user")
    stats(pc, user=(1, size(a)))
    pc.insert_cache(M, [1, 2, 3], b, cache_type="system")   # moves to the system list
    stats(pc, system=(1, size(b)))
    check(pc, M, [1, 2, 3], snapshot(b), [])
    pc.insert_cache(M, [1, 2, 3], c)                       # and to assistant, new byte count
    stats(pc, assistant=(1, 7))
    check(pc, M, [1, 2, 3], snapshot(c), [])


def test_reinsert_refreshes_lru_position(impl: Impl, M: Any) -> None:
    pc = impl.new(max_size=2)
    x, y, z = kv(2, seed=1), kv(2, seed=2), kv(2, seed=3)
    pc.insert_cache(M, [1, 1], x)
    pc.insert_cache(M, [2, 2], y)
    pc.insert_cache(M, [1, 1], x)       # x is now the newest
    pc.insert_cache(M, [3, 3], z)       # y goes
    stats(pc, assistant=(2, size(x) + size(z)))
    check(pc, M, [1, 1], snapshot(x), [])
    check(pc, M, [3, 3], snapshot(z), [])
    if impl.memory_only:
        check(pc, M, [2, 2], None, [2, 2])

    # a hit does not refresh: the oldest inserted goes next
    check(pc, M, [1, 1], snapshot(x), [])
    pc.insert_cache(M, [4, 4], kv(2, seed=4))
    stats(pc, assistant=(2, size(z) + size(kv(2, seed=4))))
    check(pc, M, [3, 3], snapshot(z), [])
    if impl.memory_only:
        check(pc, M, [1, 1], None, [1, 1])


def test_empty_token_list(impl: Impl, M: Any) -> None:
    pc = impl.new()
    check(pc, M, [], None, [])
    empty = [mlc.KVCache() for _ in range(LAYERS)]
    pc.insert_cache(M, [], empty, cache_type="system")
    stats(pc, system=(1, 0))
    got = check(pc, M, [], snapshot(empty), [])
    assert all(c.offset == 0 and c.keys is None for c in got)
    check(pc, M, [1, 2], None, [1, 2])        # the root entry is only ever an exact hit
    pc.insert_cache(M, [], fake(0, tag=1, nbytes=5), cache_type="user")   # replaced
    stats(pc, user=(1, 5))
    check(pc, M, [], snapshot(fake(0, tag=1, nbytes=5)), [])
    pc.insert_cache(M, [1, 2], kv(2, seed=2))  # a trimmable entry drops the root entry
    stats(pc, assistant=(1, size(kv(2))))
    check(pc, M, [], None, [])


def test_models_never_share_entries(impl: Impl, models: Any) -> None:
    m1, m2 = models
    pc = impl.new()
    a, b = kv(4, seed=1), kv(6, seed=2, layers=LAYERS_2)
    pc.insert_cache(m1, [1, 2, 3, 4], a)
    check(pc, m2, [1, 2, 3, 4], None, [1, 2, 3, 4])
    check(pc, m2, [1, 2, 3, 4, 5], None, [1, 2, 3, 4, 5])
    check(pc, m2, [1, 2, 9], None, [1, 2, 9])
    pc.insert_cache(m2, [1, 2, 3, 4, 5, 6], b)          # no prefix dropping across models
    stats(pc, assistant=(2, size(a) + size(b)))
    check(pc, m1, [1, 2, 3, 4], snapshot(a), [])
    check(pc, m1, [1, 2, 3, 4, 5, 6], snapshot(a), [5, 6])
    check(pc, m2, [1, 2, 3, 4], snapshot(b, 3), [4])
    check(pc, m2, [1, 2, 3, 4, 5, 6], snapshot(b), [])
    pc.insert_cache(m2, [1, 2, 3, 4], fake(4, tag=2))
    stats(pc, assistant=(3, size(a) + size(b) + 100))
    check(pc, m1, [1, 2, 3, 4], snapshot(a), [])


def test_non_mlx_cache_objects(impl: Impl, M: Any) -> None:
    """Objects with only ``nbytes``, ``is_trimmable()`` and ``trim()`` work (kvstore keeps
    them in memory only, without error)."""
    pc = impl.new(max_size=3)
    pc.insert_cache(M, [1, 2, 3, 4], fake(4, tag=1, nbytes=10))
    pc.insert_cache(M, [5, 6], fake(2, tag=2, nbytes=20, trimmable=False), cache_type="user")
    stats(pc, assistant=(1, 10), user=(1, 20))
    check(pc, M, [1, 2, 3, 4], snapshot(fake(4, tag=1, nbytes=10)), [])
    check(pc, M, [1, 2, 9], [("Fake", 1, 2, 10, True)], [9])        # trimmed by trim(2)
    check(pc, M, [1, 2, 3, 4, 5], snapshot(fake(4, tag=1, nbytes=10)), [5])
    check(pc, M, [5, 6, 7], snapshot(fake(2, tag=2, nbytes=20, trimmable=False)), [7])
    check(pc, M, [5, 9], None, [5, 9])                              # not trimmable
    pc.insert_cache(M, [7, 7], fake(2, tag=3, nbytes=30), cache_type="system")
    pc.insert_cache(M, [8, 8], fake(2, tag=4, nbytes=40))          # a=2 >= u=1: [1, 2, 3, 4]
    stats(pc, assistant=(1, 40), user=(1, 20), system=(1, 30))
    check(pc, M, [1, 2, 3, 4], None, [1, 2, 3, 4])                  # never on disk
    pc.trim_to(n_bytes=50)                                          # a=1 >= u=1: [8, 8]
    stats(pc, user=(1, 20), system=(1, 30))
    check(pc, M, [8, 8], None, [8, 8])


def test_nbytes_counts_the_allocated_buffer(impl: Impl, M: Any, request: Any) -> None:
    """mlx-lm counts ``KVCache.nbytes``: the allocated buffer (256-position steps), not the
    filled part. That is also what a stored entry keeps alive (a slice shares its buffer)."""
    pc = impl.new()
    a = kv(5, seed=1, exact=False)
    assert a[0].keys.shape[2] == 256
    pc.insert_cache(M, [1, 2, 3, 4, 5], a)
    stats(pc, assistant=(1, size(a)))
    pc2 = impl.new(max_bytes=size(a) - 1)
    pc2.insert_cache(M, [1, 2, 3, 4, 5], a)
    stats(pc2)


# --------------------------------------------------------------------------- disk only


def test_disk_evicted_entry_comes_back(disk_impl: Impl, M: Any) -> None:
    pc = disk_impl.new(max_size=1)
    a, b = kv(4, seed=1), kv(4, seed=2)
    pc.insert_cache(M, [1, 2, 3, 4], a)
    pc.insert_cache(M, [5, 6, 7, 8], b)                 # evicts a from memory
    assert pc.store.flush(60)
    stats(pc, assistant=(1, size(b)))
    check(pc, M, [1, 2, 3, 4], snapshot(a), [])         # from disk
    assert pc.stats()["hits_disk"] == 1
    stats(pc, assistant=(1, size(a)))                   # promoted (max_size 1: b left memory)
    check(pc, M, [1, 2, 3, 4, 9], snapshot(a), [9])     # memory hit now
    check(pc, M, [1, 2, 3, 9], snapshot(a, 3), [9])
    check(pc, M, [5, 6, 7, 8, 1], snapshot(b), [1])     # b from disk as a shorter prefix
    assert pc.stats()["hits_disk"] == 2


def test_disk_trim_to_and_restart(disk_impl: Impl, M: Any, tmp_path: pathlib.Path) -> None:
    d = tmp_path / "shared"
    pc = disk_impl.new(cache_dir=d)
    a, s = kv(6, seed=1), kv(3, seed=2)
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], a)
    pc.insert_cache(M, [7, 8, 9], s, cache_type="system")
    pc.trim_to(n_sequences=0)
    assert pc.store.flush(60)
    stats(pc)
    check(pc, M, [1, 2, 3, 4, 5, 6], snapshot(a), [])
    pc.close()

    pc = disk_impl.new(cache_dir=d)                     # a new process, same directory
    stats(pc)
    check(pc, M, [1, 2, 3, 9], snapshot(a, 3), [9])     # trimmed from disk
    check(pc, M, [7, 8, 9, 10], snapshot(s), [10])
    check(pc, M, [7, 8], snapshot(s, 1), [8])
    assert pc.stats()["hits_disk"] >= 2
    assert len(pc) >= 1


def test_disk_dropped_prefix_comes_back(disk_impl: Impl, M: Any) -> None:
    """A prefix dropped from memory by a longer trimmable insert is still on disk: where
    mlx-lm trims the longer entry (keeping one token to run), the disk has the exact one."""
    pc = disk_impl.new()
    short, long_ = kv(3, seed=1), kv(6, seed=2)
    pc.insert_cache(M, [1, 2, 3], short)
    pc.insert_cache(M, [1, 2, 3, 4, 5, 6], long_)
    assert pc.store.flush(60)
    stats(pc, assistant=(1, size(long_)))
    check(pc, M, [1, 2, 3], snapshot(short), [])        # mlx-lm: snapshot(long_, 2), [3]
    assert pc.stats()["hits_disk"] == 1


def test_disk_models_never_share_entries(disk_impl: Impl, models: Any, tmp_path: pathlib.Path) -> None:
    m1, m2 = models
    d = tmp_path / "shared"
    pc = disk_impl.new(cache_dir=d)
    pc.insert_cache(m1, [1, 2, 3, 4], kv(4, seed=1))
    pc.close()
    pc = disk_impl.new(cache_dir=d)
    check(pc, m2, [1, 2, 3, 4], None, [1, 2, 3, 4])
    check(pc, m2, [1, 2, 3, 4, 5], None, [1, 2, 3, 4, 5])
    check(pc, m1, [1, 2, 3, 4, 5], snapshot(kv(4, seed=1)), [5])


def test_disk_non_mlx_objects_stay_in_memory(disk_impl: Impl, M: Any, tmp_path: pathlib.Path) -> None:
    d = tmp_path / "shared"
    pc = disk_impl.new(cache_dir=d)
    pc.insert_cache(M, [1, 2, 3], fake(3, tag=1))
    assert pc.store.flush(60)
    check(pc, M, [1, 2, 3], snapshot(fake(3, tag=1)), [])
    assert pc.stats()["unpersistable"] == 1
    pc.trim_to(n_sequences=0)
    check(pc, M, [1, 2, 3], None, [1, 2, 3])
    pc.close()
    pc = disk_impl.new(cache_dir=d)
    check(pc, M, [1, 2, 3], None, [1, 2, 3])


def test_disk_hit_keeps_its_cache_type(disk_impl: Impl, M: Any) -> None:
    pc = disk_impl.new()
    s = kv(3, seed=1)
    pc.insert_cache(M, [1, 2, 3], s, cache_type="system")
    assert pc.store.flush(60)
    pc.trim_to(n_sequences=0)
    check(pc, M, [1, 2, 3], snapshot(s), [])
    stats(pc, system=(1, size(s)))


def test_disk_serves_prefixes_the_mlx_rules_skip(disk_impl: Impl, M: Any) -> None:
    """A deliberate difference: mlx-lm's matching misses a 1-token non-trimmable prefix and a
    trimmable entry hidden behind a non-trimmable "longer" candidate; kvstore's disk lookup
    walks every stored prefix, so it serves both (correct caches of the stored tokens)."""
    pc = disk_impl.new()
    pc.insert_cache(M, [7], rotating(1, max_size=1, seed=1))
    pc.insert_cache(M, [1, 2, 3, 4], rotating(4, max_size=2, seed=2))
    pc.insert_cache(M, [1, 2, 3, 5, 6], kv(5, seed=3))
    assert pc.store.flush(60)
    n = len(pc)
    bad = []
    for tokens in ([7, 8, 9], [1, 2, 3, 9]):
        cache, rest = fetch(pc, M, tokens)
        if cache is not None:  # mlx-lm: (None, tokens) for both
            bad.append((tokens, rest))
    assert bad == [([7, 8, 9], [8, 9]), ([1, 2, 3, 9], [9])], bad
    assert len(pc) > n  # the disk hits were promoted into memory


def test_trie_search_matches_mlx_lm():
    """kvstore's Trie (linear search for the nearest longer entry) answers exactly as
    mlx-lm's PromptTrie on random tries, ties included; and a query leaving a 20k-token
    entry at its first token gets that entry back as the longer match."""
    import random

    from mlx_lm.models.cache import PromptTrie

    from kvstore.memory import Trie

    r = random.Random(7)
    for trial in range(200):
        theirs, ours = PromptTrie(), Trie()
        stored = [[r.randrange(3) for _ in range(r.randrange(0, 12))] for _ in range(r.randrange(1, 15))]
        for i, t in enumerate(stored):
            theirs.add("m", t, i)
            ours.add("m", t, i)
        queries = stored + [[r.randrange(3) for _ in range(r.randrange(0, 14))] for _ in range(20)]
        for q in queries + [s[:-1] for s in stored if s]:
            assert ours.search("m", q) == theirs.search("m", q), (stored, q)
        assert ours.search("other", [1]) == theirs.search("other", [1])
    long = list(range(1, 20_001))
    ours = Trie()
    ours.add("m", long, "v")
    res = ours.search("m", [1, 0])
    assert res.longer == long and res.common_prefix == 1 and res.shorter is None and res.exact is None
