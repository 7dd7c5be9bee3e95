"""Adapter entry points as a user without the engine installed meets them (subprocesses)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.floors import MIN_DISK_HIT

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "from kvstore.adapters import vllm_mlx; vllm_mlx.install(cache_dir='unused')"


def compat_recipe() -> list[str]:
    """The pins tools/gates/compat_env.sh installs vllm-mlx with."""
    sh = (ROOT / "tools" / "gates" / "compat_env.sh").read_text()
    pins = re.findall(r'^(?:MLX_LM|VLLM_MLX)="([^"]+)"', sh, re.M)
    deps = re.findall(r'"([^"]+)"', re.search(r"^VLLM_MLX_DEPS=\(([^)]*)\)", sh, re.M).group(1))
    assert len(pins) == 2 and len(deps) == 6, (pins, deps)  # engines: 2, server: 4
    return pins + deps


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT), env=dict(os.environ, **env))


@pytest.mark.skipif(importlib.util.find_spec("vllm_mlx") is not None,
                    reason="vllm-mlx is installed here (tests/compat runs the adapter)")
def test_vllm_mlx_install_says_how_to_install_vllm_mlx() -> None:
    assert python("import kvstore.adapters.vllm_mlx").returncode == 0  # importing needs no vllm-mlx
    p = python(INSTALL)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith(
        "ModuleNotFoundError: kvstore.adapters.vllm_mlx needs vllm-mlx, which is not installed"), p.stderr
    assert "pip install --no-deps 'vllm-mlx==" in last
    for pin in compat_recipe():
        assert pin in last, (pin, last)
    assert "During handling" not in p.stderr  # one clear error, not a chained traceback
    docs = (ROOT / "docs" / "adapters.md").read_text()  # the recipe the user reads
    for pin in compat_recipe():
        assert pin in docs, pin


@pytest.mark.skipif(importlib.util.find_spec("vllm_mlx") is not None,
                    reason="vllm-mlx is installed here (tests/compat runs the command)")
def test_kvstore_vllm_mlx_serve_says_how_to_install_vllm_mlx(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "vllm-mlx", "serve", "some/model",
                        "--continuous-batching", "--cache-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert p.returncode == 1, p
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstore vllm-mlx: error: kvstore.adapters.vllm_mlx needs vllm-mlx"), p.stderr
    for pin in compat_recipe():
        assert pin in last, (pin, last)
    assert "Traceback" not in p.stderr


def test_kvstore_vllm_mlx_serve_help_lists_kvstores_flags_first() -> None:
    """`--help` shows kvstore's flags, then vllm-mlx's (here: vllm-mlx's missing, said after)."""
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "vllm-mlx", "serve", "--help"],
                       capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    for flag in ("--cache-dir DIR", "--max-disk-bytes SIZE", "--persist {all,system,reused}", "--max-write-bytes-per-day"):
        assert flag in p.stdout, p.stdout
    assert p.stdout.index("kvstore's flags") < p.stdout.index("vllm-mlx's flags follow")


def test_vllm_mlx_install_names_a_missing_dependency(tmp_path: Path) -> None:
    """vllm-mlx present (a stand-in package first on the path) but one of its imports missing."""
    engine = tmp_path / "vllm_mlx" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "vllm_mlx" / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "simple.py").write_text("import jsonschema_not_installed_here\n")
    p = python(INSTALL, PYTHONPATH=str(tmp_path))
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "vllm-mlx is installed but cannot be imported" in last, p.stderr
    assert "'jsonschema_not_installed_here'" in last and "pip install --no-deps 'vllm-mlx==" in last


# -- image requests: mlx_lm.server 0.32's negative ids in prompt-cache keys ----------------

pytest_plugins = ("tests.support.redis_servers",)
PATCH = 200  # the stand-in image patch token (tiny-llama has no vision tower; see README)


def image_key(url: str, patch: int = PATCH) -> tuple[list[int], list[int], int]:
    """(prompt, mlx_lm.server's cache key, where the image starts) of a prompt holding one
    24-token image: the key comes from mlx_lm.server's own ``_make_vision``, which gives the
    image's patch tokens the negative id ``-1 - int(sha256(url)[:15], 16)``."""
    from mlx_lm.server import _make_vision

    prompt = list(range(30, 70)) + [patch] * 24 + list(range(90, 110))
    vision = _make_vision(prompt, urls=[url], pixel_values=[], token_id=patch)
    assert vision.starts == [40] and min(vision.cache_key) < -(2**50), vision.cache_key
    return prompt, vision.cache_key, 40


def arrays(cache: list[Any]) -> list[np.ndarray]:
    """The keys and values each layer holds (its first ``offset`` positions)."""
    return [np.array(a[..., : c.offset, :]) for c in cache for a in (c.keys, c.values)]


def prefilled(tiny_llama: Any, tokens: list[int]) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = tiny_llama
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def test_image_keys_hit_their_own_image_in_memory_and_after_a_restart(tiny_llama: Any, tmp_path: Path) -> None:
    """kvstore's drop-in takes the keys mlx_lm.server 0.32 makes for image requests (its key
    encoding used to reject negative ids: every image request failed), answers as
    mlx-lm's own LRUPromptCache does, and after a restart serves the same image from disk;
    another image of the same size (same tokens, another id) gets at most the text before
    the image."""
    from mlx_lm.models.cache import LRUPromptCache as Upstream

    from kvstore.adapters.mlx_lm import LRUPromptCache
    from tools.testing.model_builds import model_path

    key = (str(model_path("tiny-llama")), None, None)
    prompt_a, key_a, start = image_key("data:image/png;base64,AAAA")
    prompt_b, key_b, _ = image_key("data:image/png;base64,BBBB", patch=PATCH + 1)
    cache_a = prefilled(tiny_llama, prompt_a)
    ref, ours = Upstream(), LRUPromptCache(cache_dir=tmp_path / "c")
    for pc in (ref, ours):
        pc.insert_cache(key, key_a, prefilled(tiny_llama, prompt_a))
    for query in (key_a + [5, 6], key_a[:50], key_b, key_b[:start] + [7]):
        (c_ref, rest_ref), (c, rest) = ref.fetch_nearest_cache(key, query), ours.fetch_nearest_cache(key, query)
        assert rest == rest_ref and (c is None) == (c_ref is None), (query[start - 1 : start + 1], rest, rest_ref)
        if c is not None:
            assert all(np.array_equal(x, y) for x, y in zip(arrays(c), arrays(c_ref), strict=True)), len(query)
    assert len(ours.fetch_nearest_cache(key, key_b)[1]) >= len(key_b) - start  # never image a's KV
    ours.close()
    floored = LRUPromptCache(cache_dir=tmp_path / "f", min_memory_hit=MIN_DISK_HIT)  # kvstore serve's floor
    floored.insert_cache(key, key_a, prefilled(tiny_llama, prompt_a))
    longer = key_b[:start] + [7] * MIN_DISK_HIT  # the 40 shared tokens are not the whole prompt
    assert start < MIN_DISK_HIT and floored.fetch_nearest_cache(key, longer) == (None, longer)
    floored.close()
    again = LRUPromptCache(cache_dir=tmp_path / "c")
    c, rest = again.fetch_nearest_cache(key, key_a + [5])
    assert rest == [5] and again.stats()["hits_disk"] == 1, again.stats()
    assert all(np.array_equal(x, y) for x, y in zip(arrays(c), arrays(cache_a)))
    c, rest = again.fetch_nearest_cache(key, key_b)
    assert len(rest) >= len(key_b) - start, len(rest)
    again.close()


def test_image_keys_through_the_shared_tier(tiny_llama: Any, tmp_path: Path, redis_server: Any) -> None:
    """Machine A stores an image request's cache; machine B (its own cache directory, the
    same Redis) restores it from the shared tier under the same negative-id key, and a
    request with another image gets at most the text before the image there too."""
    from kvstore import KVStore
    from kvstore.shared import SharedConfig
    from tools.testing.model_builds import model_path

    model = str(model_path("tiny-llama"))
    prompt_a, key_a, start = image_key("https://example.com/a.png")
    _, key_b, _ = image_key("https://example.com/b.png")
    cache_a = prefilled(tiny_llama, prompt_a)
    with KVStore(tmp_path / "a", shared=SharedConfig.from_url(redis_server.url)) as a:
        a.insert(model, key_a, cache_a)
        assert a.flush(30) and a.stats()["shared_published"] == 1, a.stats()
    with KVStore(tmp_path / "b", shared=SharedConfig.from_url(redis_server.url)) as b:
        got = b.fetch(model, key_a + [3])
        assert (got.source, got.n) == ("shared", len(key_a)), (got.source, got.n)
        assert all(np.array_equal(x, y) for x, y in zip(arrays(got.cache), arrays(cache_a)))
        other = b.fetch(model, key_b)
        assert other.n <= start, other.n


def test_memory_only_fallbacks_are_in_stats(tmp_path) -> None:
    """Every way the store falls back to memory only is said in ``stats()`` as well as the
    log, for the adapters built on it (mlx-lm's LRUPromptCache, vllm-mlx, the server): a
    model key that is not a local directory, and a cache directory that cannot be used.
    Before: only the log said so (``memory_only_reason`` stayed empty)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore import LRUPromptCache

    cache = LRUPromptCache(cache_dir=tmp_path / "kv")
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4)))
    cache.insert_cache("no-such-model-dir", list(range(8)), [c])
    assert "not a local directory" in cache.stats()["memory_only_reason"]["no-such-model-dir"]
    cache.close()
    (tmp_path / "file").write_text("x")
    broken = LRUPromptCache(cache_dir=tmp_path / "file")
    assert "cannot be used" in broken.stats()["memory_only_reason"]["*"]
    broken.close()
