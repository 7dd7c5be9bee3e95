"""kvstore leaves its host's global state as it found it (issue 22).

Every public entry point of ``KVStore`` and of the ``LRUPromptCache`` drop-in is called on
a real model directory (tiny-llama), with a real cache directory, and this thread's MLX
random key, default device and stream, MLX's memory / cache / wired limits and the
logging configuration are compared before and after (``kvstore.hoststate.snapshot``).
The first lookup of a model derives its identity, which builds the model lazily: that
used to draw from the caller's random key, so a seeded request sampled other text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kvstore import KVStore
from kvstore.adapters.mlx_lm import LRUPromptCache
from kvstore.hoststate import changes, isolated, snapshot


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def unchanged(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, asserting it changed no host state."""
    mx.random.seed(1234)
    before = snapshot()
    out = fn()
    diff = changes(before, snapshot())
    assert not diff, f"{what} changed the host's state: {diff}"
    return out


def prefilled(tiny_llama: Any, tokens: list[int]) -> list[Any]:
    model, _ = tiny_llama
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def test_kvstore_entry_points_leave_host_state_alone(tiny_llama: Any, model_dir: Path, tmp_path: Path) -> None:
    tokens = list(range(10, 80))
    cache = prefilled(tiny_llama, tokens)
    store = unchanged("KVStore()", lambda: KVStore(tmp_path / "c"))
    unchanged("identity (first: builds the model lazily)", lambda: store.identity(str(model_dir)))
    fresh = KVStore(tmp_path / "c2")
    unchanged("fetch (first lookup derives the identity)", lambda: fresh.fetch(str(model_dir), tokens))
    fresh.close()
    unchanged("insert", lambda: store.insert(str(model_dir), tokens, cache))
    unchanged("fetch (memory hit)", lambda: store.fetch(str(model_dir), tokens + [5]))
    unchanged("peek", lambda: store.peek(str(model_dir), tokens))
    unchanged("flush", lambda: store.flush())
    unchanged("trim_to", lambda: store.trim_to(0))
    unchanged("stats", lambda: store.stats())
    unchanged("close", lambda: store.close())
    again = KVStore(tmp_path / "c")
    got = unchanged("fetch (disk hit, new store)", lambda: again.fetch(str(model_dir), tokens))
    assert got.source == "disk" and got.n == len(tokens)
    again.trim_to(0)
    report = unchanged("preload", lambda: again.preload(str(model_dir)))
    assert report.entries == 1
    again.close()


def test_prompt_cache_entry_points_leave_host_state_alone(tiny_llama: Any, model_dir: Path,
                                                          tmp_path: Path) -> None:
    key = (str(model_dir), None, None)
    tokens = list(range(20, 90))
    cache = prefilled(tiny_llama, tokens)
    pc = unchanged("LRUPromptCache()", lambda: LRUPromptCache(4, cache_dir=tmp_path / "c"))
    c, rest = unchanged("fetch_nearest_cache (miss, first lookup)", lambda: pc.fetch_nearest_cache(key, tokens))
    assert c is None and rest == tokens
    unchanged("insert_cache", lambda: pc.insert_cache(key, tokens, cache, cache_type="system"))
    c, rest = unchanged("fetch_nearest_cache (hit)", lambda: pc.fetch_nearest_cache(key, tokens + [7]))
    assert c is not None and rest == [7]
    unchanged("stats_by_type", pc.stats_by_type)
    unchanged("stats", pc.stats)
    unchanged("trim_to", lambda: pc.trim_to(n_sequences=0))
    unchanged("preload", lambda: pc.preload(key))
    unchanged("close", pc.close)


def test_isolated_keeps_the_callers_random_key_and_returns_or_raises() -> None:
    """The mechanism: MLX's random key is per thread, so a draw on ``isolated``'s thread
    leaves the caller's key as it was; results and exceptions come back."""
    mx.random.seed(5)
    key = mx.random.state[0].tolist()
    assert isolated(lambda: mx.random.uniform(shape=(3,)).shape) == (3,)
    assert mx.random.state[0].tolist() == key
    mx.random.uniform(shape=(1,))  # a draw here does change it: the comparison can fail
    assert mx.random.state[0].tolist() != key
    with pytest.raises(KeyError, match="boom"):
        isolated(lambda: {}["boom"])


def test_generate_entry_points_leave_host_state_alone(tiny_llama: Any, model_dir: Path, tmp_path: Path) -> None:
    """``kvstore.generate``: the warm-up pass ``kvstore serve`` runs before it is ready, and
    a whole ``stream_generate`` (fetch, prefill, insert, greedy decoding) on a fresh store."""
    from kvstore.generate import stream_generate, warm_up

    model, tokenizer = tiny_llama
    unchanged("warm_up", lambda: warm_up(model))
    with KVStore(tmp_path / "c") as store:
        steps = unchanged("stream_generate", lambda: list(stream_generate(
            store, model, tokenizer, list(range(30, 90)), model_key=str(model_dir), max_tokens=4)))
        assert len(steps) == 4
