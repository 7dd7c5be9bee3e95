"""tools/testing/model_builds.py: registry, builds, cache classes, determinism, greedy behaviour, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tests.support import ROOT
from tests.support.models import have_smollm2, requires_smollm2
from tools.testing.procs import end_group, start_group

from tools.testing import model_builds
from tools.testing.oracle import cold_run, make_cache, prefill

TINY = model_builds.TINY_MODELS  # tiny-llama, tiny-llama-q, tiny-gemma3, tiny-qwen3next, tiny-cachelist
TINY_BUILDS = sorted(model_builds.TINY_CONFIGS)  # distinct weight sets


def _classes(cache) -> list[str]:
    return [type(c).__name__ for c in cache]


def test_registry_names():
    expected = {
        "smollm2",
        "smollm2-q4",
        "tiny-llama",
        "tiny-llama-q",
        "tiny-gemma3",
        "tiny-qwen3next",
        "tiny-cachelist",
        "tiny-llama4",
        "tiny-llama-hd64",
        "tiny-qwen-tools",
        "tiny-muse-spark",
        "bench-qwen3-0.6b",
    }
    assert set(model_builds.MODELS) == expected
    for name, spec in model_builds.MODELS.items():
        assert spec.name == name
        assert spec.description and "\n" not in spec.description
        assert spec.dir_name.startswith(spec.build + "-v")
    assert model_builds.MODELS["tiny-llama-q"].kv_bits == 8
    assert model_builds.MODELS["tiny-llama-q"].kv_group_size == 32
    assert model_builds.MODELS["tiny-llama-q"].dir_name == model_builds.MODELS["tiny-llama"].dir_name
    assert model_builds.MODELS["bench-qwen3-0.6b"].on_demand


def test_models_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_MODELS_DIR", str(tmp_path / "m"))
    assert model_builds.models_dir() == tmp_path / "m"
    monkeypatch.delenv("KVSTORE_MODELS_DIR")
    assert model_builds.models_dir().name == "models"


def test_model_path_builds_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_MODELS_DIR", str(tmp_path))
    calls = []

    def builder(out):
        calls.append(out)
        model_builds.build_tiny("tiny-llama", out)

    spec = model_builds.ModelSpec(
        name="t", description="t", builder=builder, build="t", version="9",
        family="llama", cache_classes=frozenset({"KVCache"}),
    )
    monkeypatch.setitem(model_builds.MODELS, "t", spec)
    p1 = model_builds.model_path("t")
    p2 = model_builds.model_path("t")
    assert p1 == p2 == tmp_path / "t-v9"
    assert len(calls) == 1 and calls[0].parent == tmp_path and calls[0] != p1
    assert (p1 / model_builds.COMPLETE_MARKER).is_file() and (p1 / "config.json").is_file()
    # No temp dirs left behind.
    assert sorted(x.name for x in tmp_path.iterdir() if x.is_dir()) == ["t-v9"]

    # A failing build leaves nothing in place.
    def broken(out):
        (out / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setitem(model_builds.MODELS, "b", model_builds.ModelSpec(
        name="b", description="b", builder=broken, build="b", version="1",
        family="llama", cache_classes=frozenset({"KVCache"}),
    ))
    with pytest.raises(RuntimeError, match="boom"):
        model_builds.model_path("b")
    assert not (tmp_path / "b-v1").exists()
    assert sorted(x.name for x in tmp_path.iterdir() if x.is_dir()) == ["t-v9"]


def test_parallel_processes_build_once(tmp_path):
    """Three processes asking for the same unbuilt model at once get one complete build."""
    env = dict(os.environ, KVSTORE_MODELS_DIR=str(tmp_path))
    cmd = [sys.executable, str(ROOT / "tools" / "testing" / "model_builds.py"), "path", "tiny-cachelist"]
    procs = [start_group(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]  # bounds a hang (a lock never released)
    finally:
        for p in procs:
            end_group(p, grace=0)
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    expected = tmp_path / model_builds.MODELS["tiny-cachelist"].dir_name
    assert paths == {str(expected)}
    assert (expected / model_builds.COMPLETE_MARKER).is_file()
    # exactly one process built (the others found it done under the lock); no temp dirs left
    assert sum("building" in err for _, err in outs) >= 1
    assert [x.name for x in tmp_path.iterdir() if x.is_dir()] == [expected.name]


@pytest.mark.parametrize("name", TINY_BUILDS)
def test_tiny_build_is_deterministic(name, tmp_path):
    a = model_builds.build_tiny(name, tmp_path / "a", seed=7)
    b = model_builds.build_tiny(name, tmp_path / "b", seed=7)
    files = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert files == sorted(p.name for p in b.iterdir())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{name}: {f} differs between builds"
    c = model_builds.build_tiny(name, tmp_path / "c", seed=8)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    config = json.loads((a / "config.json").read_text())
    assert config["model_type"] == model_builds.TINY_CONFIGS[name][0]


def _check_cache_classes(name, model):
    spec = model_builds.MODELS[name]
    cache = make_cache(model, **spec.cache_kwargs)
    assert set(_classes(cache)) == set(spec.cache_classes), _classes(cache)
    return cache


def test_cache_classes_tiny_llama(load_named):
    cache = _check_cache_classes("tiny-llama", load_named("tiny-llama")[0])
    assert _classes(cache) == ["KVCache"] * 3


def test_cache_classes_tiny_llama_q(load_named):
    model = load_named("tiny-llama-q")[0]
    cache = _check_cache_classes("tiny-llama-q", model)
    assert all(c.bits == 8 and c.group_size == 32 for c in cache)
    # Still quantised after a prefill (and the plain make_prompt_cache is float KVCache).
    cache = prefill(model, list(range(40)), **model_builds.MODELS["tiny-llama-q"].cache_kwargs)
    assert _classes(cache) == ["QuantizedKVCache"] * 3 and cache[0].offset == 40
    from mlx_lm.models.cache import make_prompt_cache

    assert _classes(make_prompt_cache(model)) == ["KVCache"] * 3


def test_cache_classes_tiny_gemma3(load_named):
    model = load_named("tiny-gemma3")[0]
    cache = _check_cache_classes("tiny-gemma3", model)
    assert _classes(cache) == ["RotatingKVCache", "KVCache"] * 2
    assert cache[0].max_size == 32
    # Test prompts are hundreds of tokens: the sliding-window layers really rotate.
    cache = prefill(model, list(range(200)), chunk=64)
    assert cache[0].offset == 200 and cache[0].size() == 32
    cache = prefill(model, [5], cache=cache)  # single-token in-place path wraps around
    assert cache[0].offset == 201 and cache[0].keys.shape[2] == 32


def test_cache_classes_tiny_qwen3next(load_named):
    cache = _check_cache_classes("tiny-qwen3next", load_named("tiny-qwen3next")[0])
    assert _classes(cache) == ["ArraysCache"] * 3 + ["KVCache"]


def test_cache_classes_tiny_cachelist(load_named):
    model = load_named("tiny-cachelist")[0]
    cache = _check_cache_classes("tiny-cachelist", model)
    nested = [[type(s).__name__ for s in c.caches] for c in cache]
    assert nested == [
        ["ArraysCache", "RotatingKVCache"],
        ["ArraysCache", "KVCache"],
        ["ArraysCache", "KVCache"],
    ]
    assert {n for pair in nested for n in pair} == model_builds.MODELS["tiny-cachelist"].nested_cache_classes


def test_cache_classes_tiny_llama4(load_named):
    model = load_named("tiny-llama4")[0]
    cache = _check_cache_classes("tiny-llama4", model)
    assert _classes(cache) == ["ChunkedKVCache"] * 3 + ["KVCache"]
    assert cache[0].chunk_size == 8
    # a prefill in steps leaves the chunked layers keys from start_position on only
    cache = prefill(model, list(range(3, 43)), chunk=7)
    assert cache[0].offset == 40 and 0 < cache[0].start_position <= 40 - 8


@requires_smollm2
@pytest.mark.parametrize("name", ["smollm2", "smollm2-q4"])
def test_smollm2_loads_with_kvcache(name, load_named):
    model, tokenizer = load_named(name)
    cache = _check_cache_classes(name, model)
    assert _classes(cache) == ["KVCache"] * 30
    assert tokenizer.encode("Hello", add_special_tokens=False)
    assert (model_builds.model_path(name) / "model.safetensors").is_file()


def _greedy(name, model, prompt, n_gen=20):
    return cold_run(model, prompt, n_gen=n_gen, **model_builds.MODELS[name].cache_kwargs).tokens


@pytest.mark.parametrize("name", TINY)
def test_greedy_output_varies_and_depends_on_prefix(name, load_named, make_prompt):
    model, tokenizer = load_named(name)
    prompt = make_prompt(tokenizer, 120, seed=1)
    out = _greedy(name, model, prompt)
    assert len(set(out)) >= 6, f"{name}: greedy output barely varies: {out}"
    special = {tokenizer.convert_tokens_to_ids(t) for t in model_builds.SPECIAL_TOKENS}
    assert not special & set(out), f"{name}: emitted a special token: {out}"
    # Changing only the FIRST prompt token changes the continuation.
    changed = [(prompt[0] + 1) % 256] + prompt[1:]
    out2 = _greedy(name, model, changed)
    assert out2 != out, f"{name}: continuation ignores the first prompt token"


def test_cli_list():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "testing" / "model_builds.py"), "list"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    lines = proc.stdout.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == list(model_builds.MODELS)
    assert all(len(line.split("\t")) == 2 and line.split("\t")[1] for line in lines)


def test_cli_path_tiny_llama():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "testing" / "model_builds.py"), "path", "tiny-llama"],
        capture_output=True, text=True, timeout=300, check=True, cwd=str(ROOT.parent),
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert os.path.isdir(last), proc.stdout
    assert os.path.isfile(os.path.join(last, "model.safetensors"))
    assert os.path.isfile(os.path.join(last, model_builds.COMPLETE_MARKER))
    assert last == str(model_builds.model_path("tiny-llama"))


def test_all_models_load_offline_in_fresh_process(tmp_path):
    """Every test model loads with plain mlx_lm.load(dir) with the hub off and an empty HF home."""
    names = [n for n, s in model_builds.MODELS.items() if not s.on_demand]
    if not have_smollm2():
        names = [n for n in names if not n.startswith("smollm2")]
    paths = {n: str(model_builds.model_path(n)) for n in names}
    script = textwrap.dedent(
        """
        import json, sys
        import mlx_lm
        from mlx_lm.models.cache import make_prompt_cache
        out = {}
        for name, path in json.loads(sys.argv[1]).items():
            model, tok = mlx_lm.load(path)
            out[name] = [type(c).__name__ for c in make_prompt_cache(model)]
        print(json.dumps(out))
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(paths)],
        capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(loaded) == set(names)
    for name in names:
        spec = model_builds.MODELS[name]
        if spec.kv_bits is None:
            assert set(loaded[name]) == set(spec.cache_classes), (name, loaded[name])


def test_prune_removes_only_stale_versions(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_MODELS_DIR", str(tmp_path))
    current = tmp_path / model_builds.MODELS["tiny-llama"].dir_name
    stale = tmp_path / "tiny-llama-v0"
    unrelated = tmp_path / "something-else-v1"
    partial = tmp_path / "tiny-gemma3-v0"  # no marker: maybe a build in progress elsewhere
    for d in (current, stale, unrelated):
        d.mkdir()
        (d / model_builds.COMPLETE_MARKER).write_text("x")
    partial.mkdir()
    assert model_builds.prune_stale() == [stale]
    assert current.is_dir() and unrelated.is_dir() and partial.is_dir() and not stale.exists()
