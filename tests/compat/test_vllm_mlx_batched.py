"""kvstore's ``MemoryAwarePrefixCache`` (``KVPrefixCache``) in process, on a real model.

Needs vllm-mlx (tools/gates/compat_env.sh). Caches are real mlx-lm KVCaches from a prefill of
tools.testing.model_builds' tiny-llama; each "restart" is a new cache instance after the old one closed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

pytest.importorskip("vllm_mlx")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from vllm_mlx.memory_cache import MemoryAwarePrefixCache, MemoryCacheConfig  # noqa: E402

from kvstore.adapters import vllm_mlx_batched as vb  # noqa: E402


@pytest.fixture(scope="module")
def model() -> Any:
    import mlx_lm

    from tools.testing.model_builds import model_path

    path = model_path("tiny-llama")
    m, _tok = mlx_lm.load(str(path))
    vb.remember_model(m, path)
    return m


def prefill(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(n)]  # tiny-llama: vocab 259


def kv_cache(model: Any, tmp: Path, **options: Any) -> Any:
    cls = vb.prefix_cache_class()
    return cls(model, MemoryCacheConfig(max_memory_mb=64), cache_dir=tmp, **options)


def same_kv(a: list[Any], b: list[Any]) -> bool:
    return all(mx.array_equal(x.state[0], y.state[0]).item() and mx.array_equal(x.state[1], y.state[1]).item()
               for x, y in zip(a, b))


def test_entry_written_through_and_restored_after_restart(model: Any, tmp_path: Path) -> None:
    conv = tokens(600)
    first = kv_cache(model, tmp_path)
    # the scheduler's completion entry: prompt + output, the cache one token short
    assert first.store(conv, prefill(model, conv[:-1]))
    first._kv_store.flush(60)
    assert len(first) == 1 and first.kv_stats()["disk_entries"] == 1  # on disk while still in RAM
    first.close()

    again = kv_cache(model, tmp_path)
    ask = conv[:400] + tokens(50, seed=9)
    cache, remaining = again.fetch(ask)
    assert again._last_match_type == "prefix" and cache is not None
    n = len(ask) - len(remaining)
    assert 256 <= n <= 400 and remaining == ask[n:]
    assert same_kv(cache, prefill(model, ask[:n]))
    assert again.get_stats()["hits"] == 1 and again.get_stats()["misses"] == 0
    assert len(again) == 1  # promoted into vllm-mlx's RAM tier
    again.close()


def test_disk_beats_a_shorter_memory_hit(model: Any, tmp_path: Path) -> None:
    system, conv = tokens(300), tokens(300) + tokens(500, seed=3)
    first = kv_cache(model, tmp_path)
    assert first.store(conv + [7], prefill(model, conv))
    first.close()

    cache = kv_cache(model, tmp_path)
    upstream = MemoryAwarePrefixCache(model, MemoryCacheConfig(max_memory_mb=64))
    for c in (cache, upstream):
        assert c.store(system, prefill(model, system))
    ask = conv + tokens(20, seed=5)
    _, rest_upstream = upstream.fetch(ask)
    got, rest = cache.fetch(ask)
    assert len(rest_upstream) == len(ask) - 300  # vllm-mlx: its RAM prefix, the disk unasked
    assert len(rest) < len(rest_upstream) and cache._last_match_type == "prefix"
    assert same_kv(got, prefill(model, ask[: len(ask) - len(rest)]))
    cache.close()


def test_a_whole_prompt_on_disk_leaves_the_last_token_to_run(model: Any, tmp_path: Path) -> None:
    prompt = tokens(300)
    first = kv_cache(model, tmp_path, chunk_tokens=16)
    assert first.store(prompt, prefill(model, prompt))
    first.close()
    again = kv_cache(model, tmp_path, chunk_tokens=16)
    cache, remaining = again.fetch(prompt)
    assert cache is not None and remaining == prompt[-1:] and again._last_match_type == "prefix"
    again.close()


@pytest.mark.parametrize("persist, written", [("all", 1), ("system", 0)])
def test_persist_policy_applies(model: Any, tmp_path: Path, persist: str, written: int) -> None:
    c = kv_cache(model, tmp_path, persist=persist)
    conv = tokens(300)
    assert c.store(conv, prefill(model, conv))
    c._kv_store.flush(60)
    assert c.kv_stats().get("disk_entries", 0) == written
    c.close()


def test_store_never_raises_and_bad_entries_stay_off_disk(model: Any, tmp_path: Path) -> None:
    c = kv_cache(model, tmp_path)
    big = [300] * 300  # token ids out of the model's vocabulary: kvstore refuses them
    assert c.store(big, prefill(model, [5] * 300)) is True  # vllm-mlx keeps it in RAM
    assert c.store([1, 2, 3], [object()]) in (True, False)
    c._kv_store.flush(60)
    assert c.kv_stats().get("disk_entries", 0) == 0
    c.close()


def test_a_model_without_a_known_path_is_memory_only(tmp_path: Path) -> None:
    class Anonymous:
        pass

    c = vb.prefix_cache_class()(Anonymous(), MemoryCacheConfig(max_memory_mb=64), cache_dir=tmp_path)
    assert c._kv_store is None and c.kv_stats() == {}
    assert not (tmp_path / "index").exists()


def test_quantised_entries_restore_as_vllm_mlx_serves_them_from_ram(model: Any, tmp_path: Path) -> None:
    """``--kv-cache-quantization``: stored quantised (under their own identity), restored
    dequantised, equal to what vllm-mlx's own class hands out from RAM for the same entry."""
    config = MemoryCacheConfig(max_memory_mb=64, kv_quantize=True, kv_bits=8, kv_group_size=32)
    conv = tokens(600)
    first = vb.prefix_cache_class()(model, config, cache_dir=tmp_path)
    assert first.store(conv, prefill(model, conv[:-1]))
    first._kv_store.flush(60)
    assert first.kv_stats()["disk_entries"] == 1
    first.close()

    ask = conv[:512] + tokens(40, seed=4)
    plain = kv_cache(model, tmp_path)  # another identity: the unquantised one
    assert plain.fetch(ask)[0] is None
    plain.close()

    again = vb.prefix_cache_class()(model, config, cache_dir=tmp_path)
    got, rest = again.fetch(ask)
    n = len(ask) - len(rest)
    assert got is not None and n == 512 and again._last_match_type == "prefix"
    upstream = MemoryAwarePrefixCache(model, config)
    assert upstream.store(conv, prefill(model, conv[:-1]))
    ram, ram_rest = upstream.fetch(ask)
    assert len(ram_rest) == len(rest)
    for mine, theirs in zip(got, ram):
        # vllm-mlx 0.6 trims its entry (which holds one position fewer than its key) as if
        # it held them all: its cache covers 511 positions where it reports 512 cached
        m = min(mine.offset, theirs.offset)
        assert mine.offset == n and m >= n - 1
        for a, b in zip(mine.state, theirs.state):
            assert mx.array_equal(a[..., :m, :], b[..., :m, :]).item()
    again.close()


def test_a_completion_entry_hit_from_ram_runs_from_where_its_cache_ends(model: Any, tmp_path: Path) -> None:
    """vllm-mlx's class trims a completion entry (key prompt + output, cache one position
    short) as if it held every key token: 511 positions reported as 512 cached, the 512th
    token never run. kvstore's class hands out the same cache with the tokens from 511 on."""
    conv = tokens(600)
    ask = conv[:512] + tokens(40, seed=4)
    upstream = MemoryAwarePrefixCache(model, MemoryCacheConfig(max_memory_mb=64))
    ours = kv_cache(model, tmp_path)
    for c in (upstream, ours):
        assert c.store(conv, prefill(model, conv[:-1]))
    theirs, their_rest = upstream.fetch(ask)
    got, rest = ours.fetch(ask)
    assert theirs[0].offset == 511 and len(ask) - len(their_rest) == 512  # the gap
    assert got[0].offset == 511 and rest == ask[511:]
    assert same_kv(got, prefill(model, ask[:511]))
    ours.close()
