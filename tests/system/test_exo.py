"""kvstore as exo's prefix cache (``kvstore.adapters.exo``), through exo's calling pattern.

exo is not on PyPI, so these tests never import it: ``tests.support.programs.exo_generate``
makes the calls exo's generation code makes (get_kv_cache, prefill with exo's two-token
rollback and snapshots, add_kv_cache / update_kv_cache, decoding on in the same cache), on
the tiny model families, and every restored cache is checked against a cold prefill.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from kvstore.adapters.exo import ExoPrefixCache, media_key, shard_components
from tests.support.children import run_module
from tests.support.models import TINY_FAMILIES, store_kwargs
from tests.support.programs.exo_generate import Region, Snapshot, request
from tools.testing import oracle
from tools.testing.model_builds import model_path
from tools.testing.procs import end_group, start_group

ROOT = Path(__file__).resolve().parents[2]
SHARD = {"kind": "PipelineShardMetadata", "model_id": "tiny", "start_layer": 0, "end_layer": 2,
         "n_layers": 4, "device_rank": 0, "world_size": 2}
NEXT_SHARD = dict(SHARD, start_layer=2, end_layer=4, device_rank=1)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def prefix_cache(tmp_path: Path, family: str, shard: dict | None = SHARD, **kw) -> ExoPrefixCache:
    return ExoPrefixCache(None, model_path=model_path(family), shard=shard, cache_dir=tmp_path / "kv",
                          chunk_tokens=64, **kw)


def kv(family: str) -> dict:
    k = store_kwargs(family)
    return {"kv_bits": k["kv_bits"], "kv_group_size": k["kv_group_size"]} if k else {}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_restarted_node_restores_what_a_cold_prefill_gives(tmp_path: Path, family: str, load_named) -> None:
    """exo's calls in this process (a new prompt, the conversation growing: update in
    place, another conversation sharing a prefix: add), then a new process on the same
    directory and shard: every hit comes from disk, equal to a cold prefill; the other
    shard of the same model finds nothing."""
    model, _ = load_named(family)
    p1 = tokens(150, 1)
    p2 = p1 + tokens(40, 2)
    p3 = p1[:50] + tokens(70, 3)
    pc = prefix_cache(tmp_path, family)
    first = [request(pc, model, p, kv=kv(family), reference=True) for p in (p1, p2, p3)]
    assert [r["n"] > 0 for r in first] == [False, True, True]
    assert all(r["oracle"] for r in first[1:]), first  # memory hits, decoding went on meanwhile
    assert len(pc.prompts) == 2  # p2 replaced p1's entry (exo's update_kv_cache), p3 was added
    pc.close()

    queries = [{"prompt": p2 + tokens(12, 4), "check": True}, {"prompt": p3, "check": True},
               {"prompt": p1, "check": True}]
    own, other = run_module("tests.support.programs.exo_generate", [
        {"family": family, "dir": str(tmp_path / "kv"), "shard": SHARD, "queries": queries},
        {"family": family, "dir": str(tmp_path / "kv"), "shard": NEXT_SHARD, "queries": queries[:1]},
    ])
    for q, got in zip(queries, own):
        assert got["n"] > 0 and got["tail_ok"] and got["oracle"], (q["prompt"][:4], got)
    assert own[-1]["stats"]["hits_disk"] >= 1, own[-1]
    assert own[0]["n"] == len(p2) - 2  # all the node held for p2: exo stores prompt - 2
    assert other[0]["n"] == 0 and other[-1]["stats"]["hits_disk"] == 0, other


def test_an_exact_hit_leaves_one_token(tmp_path: Path, tiny_llama) -> None:
    model, _ = tiny_llama
    prompt = tokens(80, 5)
    pc = prefix_cache(tmp_path, "tiny-llama")
    pc.add_kv_cache(mx.array(prompt), oracle.prefill(model, prompt))
    cache, remaining, index, exact = pc.get_kv_cache(model, mx.array(prompt))
    assert (remaining.tolist(), index, exact) == (prompt[-1:], 0, True)
    assert oracle.check_restore(model, prompt, cache, len(prompt) - 1, n_gen=4).ok


def test_a_hybrid_model_restores_the_nearest_snapshot_before_the_match(tmp_path: Path, tiny_qwen3next) -> None:
    """A recurrent cache cannot be trimmed: a query sharing 70 tokens with an entry gets the
    entry's snapshot at 64; the exact prompt with no earlier snapshot is a miss, as in exo."""
    model, _ = tiny_qwen3next
    prompt = tokens(100, 6)
    at64 = oracle.prefill(model, prompt[:64])
    whole = oracle.prefill(model, prompt[64:], at64)
    snap = Snapshot([c if type(c).__name__ == "ArraysCache" else None for c in oracle.prefill(model, prompt[:64])], 64)
    pc = prefix_cache(tmp_path, "tiny-qwen3next")
    pc.add_kv_cache(mx.array(prompt), whole, [snap])
    query = prompt[:70] + tokens(20, 7)
    cache, remaining, index, exact = pc.get_kv_cache(model, mx.array(query))
    assert (len(query) - len(remaining), index, exact) == (64, 0, False)
    assert oracle.check_restore(model, query, cache, 64, n_gen=4).ok
    pc2 = prefix_cache(tmp_path / "2", "tiny-qwen3next")
    pc2.add_kv_cache(mx.array(prompt), oracle.prefill(model, prompt))
    _, remaining, index, _ = pc2.get_kv_cache(model, mx.array(prompt))
    assert (len(remaining), index) == (len(prompt), None)


def test_another_image_cuts_the_match_at_its_region(tmp_path: Path, tiny_llama) -> None:
    """Same tokens, another image at [40, 60): the match stops at 40 (and never reuses the
    cached image's KV); the same image matches all the node holds."""
    model, _ = tiny_llama
    prompt = tokens(120, 8)
    pc = prefix_cache(tmp_path, "tiny-llama")
    request(pc, model, prompt, media=[Region("aa" * 32, 40, 60)])
    for regions, n in (([Region("aa" * 32, 40, 60)], 118), ([Region("bb" * 32, 40, 60)], 40),
                       ([Region("", 40, 60)], 40), ([], 40)):
        cache, remaining, _, _ = pc.get_kv_cache(model, mx.array(prompt), media_regions=regions)
        assert len(prompt) - len(remaining) == n, (regions, len(remaining))
    assert oracle.check_restore(model, prompt, cache, 40, n_gen=4).ok
    a, b = (media_key(prompt, [Region(h, 40, 60)]) for h in ("aa", "bb"))
    assert (a[:40] == b[:40]).all() and (a[40:60] != b[40:60]).all() and (a[60:] == b[60:]).all()
    assert a[40:60].min() >= 2**31


def test_shards_and_kinds_are_distinct_identities(tmp_path: Path, tiny_llama) -> None:
    """A node with another layer range, rank or sharding kind never restores this one's
    KV, from memory or disk; a new instance with the same shard does."""
    model, _ = tiny_llama
    prompt = tokens(100, 9)
    pc = prefix_cache(tmp_path, "tiny-llama")
    request(pc, model, prompt)
    pc.close()
    tensor = dict(SHARD, kind="TensorShardMetadata")
    for shard, want in ((NEXT_SHARD, 0), (dict(SHARD, device_rank=1), 0), (tensor, 0), (None, 0), (SHARD, 98)):
        other = prefix_cache(tmp_path, "tiny-llama", shard=shard)
        _, remaining, _, _ = other.get_kv_cache(model, mx.array(prompt))
        assert len(prompt) - len(remaining) == want, shard
        other.close()
    assert shard_components(SHARD) == SHARD


class Pressured(ExoPrefixCache):
    """Memory pressure as a script (exo reads psutil): each reading is the next value."""

    readings: list[float] = []

    def get_memory_used_percentage(self) -> float:
        return self.readings.pop(0) if self.readings else 0.0


def test_eviction_above_the_threshold_takes_the_least_recently_used(tmp_path: Path, tiny_llama) -> None:
    """exo's rule: while memory is above the threshold, the entry used longest ago leaves
    memory (here B, since A was hit after it); it stays on disk and is restored from there."""
    model, _ = tiny_llama
    a, b, c = (tokens(90, s) for s in (10, 11, 12))
    pc = Pressured(None, model_path=model_path("tiny-llama"), shard=SHARD, cache_dir=tmp_path / "kv",
                   chunk_tokens=64, threshold=0.5)
    for p in (a, b):
        request(pc, model, p)
    assert request(pc, model, a[:60] + tokens(80, 13))["n"] == 60  # a hit: b is now the oldest
    pc.readings = [0.9, 0.1]  # above the threshold once: one eviction
    request(pc, model, c)
    assert [p.tolist()[:3] for p in pc.prompts] == [a[:3], a[:3], c[:3]]
    assert pc.store.stats()["memory_entries"] == 3 and pc.caches[0] is not None
    pc.store.flush()
    cache, remaining, index, _ = pc.get_kv_cache(model, mx.array(b))
    assert (len(b) - len(remaining), index, pc.store.stats()["hits_disk"]) == (88, None, 1)
    assert oracle.check_restore(model, b, cache, 88, n_gen=4).ok
    pc.clear()
    assert (pc.prompts, pc.store.stats()["memory_entries"]) == ([], 0)
    assert len(a) - len(pc.get_kv_cache(model, mx.array(a))[1]) == 88  # the disk keeps them


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT), env={**os.environ, **env})


def test_install_without_exo_says_how_to_get_it(tmp_path: Path) -> None:
    p = python("import sys, kvstore.adapters.exo; assert 'exo' not in sys.modules")
    assert p.returncode == 0, p.stderr  # importing the adapter needs no exo
    p = python("from kvstore.adapters import exo; exo.install(cache_dir='unused')")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith(
        "ModuleNotFoundError: kvstore.adapters.exo needs exo, which is not installed"), p.stderr
    assert "not on PyPI" in last and "https://github.com/exo-explore/exo" in last
    assert "During handling" not in p.stderr
    # exo present (a stand-in package first on the path) but one of its imports missing
    pkg = tmp_path / "exo" / "worker" / "engines" / "mlx"
    pkg.mkdir(parents=True)
    for d in (pkg, *pkg.parents):
        if d == tmp_path:
            break
        (d / "__init__.py").write_text("")
    (pkg / "builder.py").write_text("import loguru_not_installed_here\n")
    p = python("from kvstore.adapters import exo; exo.install()", PYTHONPATH=f"{tmp_path}:{ROOT}")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "exo is installed but cannot be imported" in last, p.stderr
    assert "'loguru_not_installed_here'" in last and "https://github.com/exo-explore/exo" in last


BUILDER = '''
class KVPrefixCache:
    def __init__(self, group):
        self.group = group


class MlxBuilder:
    """exo's MlxBuilder's shape: load(bound_instance) (a generator; connect only with a
    group), then build() makes the cache."""

    def __init__(self):
        self.group = None

    def load(self, bound_instance):
        yield "loading"
        return "model", "tokenizer", None

    def build(self):
        return KVPrefixCache(self.group)
'''


def test_install_builds_each_node_its_own_cache(tmp_path: Path, tiny_llama) -> None:
    """``install`` against exo's builder shape (a stand-in: exo cannot be installed here):
    the cache a runner builds is kvstore's, with the node's model directory and shard;
    ``uninstall`` gives exo's class back."""
    root = tmp_path / "pkgs"
    mlx_pkg, dl = root / "exo" / "worker" / "engines" / "mlx", root / "exo" / "download"
    for d in (mlx_pkg, dl):
        d.mkdir(parents=True)
    for d in (root / "exo", root / "exo" / "worker", root / "exo" / "worker" / "engines", mlx_pkg, dl):
        (d / "__init__.py").write_text("")
    (mlx_pkg / "builder.py").write_text(BUILDER)
    (dl / "download_utils.py").write_text(f"def build_model_path(model_id):\n    return {str(model_path('tiny-llama'))!r}\n")
    got = run_module("tests.support.programs.exo_install", {"dir": str(tmp_path / "kv"), "shard": SHARD},
                     env={"PYTHONPATH": f"{ROOT}:{root}"})
    assert got["built"] == "ExoPrefixCache" and got["model_path"] == str(model_path("tiny-llama"))
    assert got["shard"] == SHARD and got["n"] == 98 and got["after_uninstall"] == "KVPrefixCache"


def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.parametrize("family,held,snapshot,want", [("tiny-llama", (90, 60), 0, 60),
                                                        ("tiny-qwen3next", (90, 64), 64, 64)])
def test_a_node_group_restores_the_same_length_on_every_node(tmp_path: Path, family: str, held: tuple,
                                                             snapshot: int, want: int) -> None:
    """Two nodes (MLX ring group on 127.0.0.1), each with its own disk holding a different
    prefix: both restore ``want`` tokens (the trimmable cache is trimmed to the other
    node's length; the recurrent one goes back to its snapshot), each equal to a cold
    prefill; memory pressure on one node evicts on both."""
    import json

    from tests.support.children import child_env

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    job = json.dumps({"family": family, "dir": str(tmp_path), "held": held, "snapshot": snapshot,
                      "pressure": [[0.9, 0.1], [0.1, 0.1]]})
    procs = [start_group([sys.executable, "-m", "tests.support.programs.exo_group", job], cwd=str(ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=child_env(MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank)))
             for rank in range(2)]
    try:
        outs = [p.communicate(timeout=1800) for p in procs]  # bounds a hang (a node waiting for its peer)
    finally:
        for p in procs:
            end_group(p, grace=0)
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [(g["n"], g["oracle"], g["index"], g["entries"]) for g in got] == [(want, True, 0, 1)] * 2, got


def test_built_without_a_model_path_says_memory_only_once(tmp_path: Path, tiny_llama, caplog) -> None:
    """An ``ExoPrefixCache`` built without a model path (outside ``install()``, or by an exo
    whose builder the patch misses) still serves from memory, and says once, in the log and
    in ``stats()["memory_only_reason"]``, that nothing reaches disk; so does one whose model
    directory has no identity. Before: it ran memory-only without a word (no ``stats()``)."""
    import logging

    model, _ = tiny_llama
    prompt = tokens(80, 7)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        pc = ExoPrefixCache(None, cache_dir=tmp_path / "kv", chunk_tokens=64)
        for _ in range(2):
            pc.add_kv_cache(mx.array(prompt), oracle.prefill(model, prompt))
            assert pc.get_kv_cache(model, mx.array(prompt))[2] is not None  # memory hits
    said = [r.getMessage() for r in caplog.records if "without a model path" in r.getMessage()]
    assert len(said) == 1 and "prefilled again" in said[0], said
    assert "without a model path" in pc.stats()["memory_only_reason"]["exo"]
    assert not (tmp_path / "kv").exists()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("[")
    pc = ExoPrefixCache(None, model_path=broken, cache_dir=tmp_path / "kv2", chunk_tokens=64)
    pc.add_kv_cache(mx.array(prompt), oracle.prefill(model, prompt))
    assert "no identity for exo model" in pc.stats()["memory_only_reason"]["exo"]


EXO_MAIN = '''
import multiprocessing as mp
import os


def runner(log):
    with open(log, "a") as f:
        f.write(f"runner {os.getpid()}\\n")


def main():
    """exo's main's shape for this purpose: it spawns its runners (macOS's default start
    method, and Python 3.14's forkserver on Linux, import the launcher again in each)."""
    log = os.environ["EXO_LAUNCH_LOG"]
    with open(log, "a") as f:
        f.write(f"main {os.getpid()}\\n")
    p = mp.get_context("spawn").Process(target=runner, args=(log,))
    p.start()
    p.join()
    assert p.exitcode == 0, p.exitcode
'''


def _launchers() -> dict[str, str]:
    """The exo launcher as the docs (docs/adapters.md) and the adapter's docstring give it."""
    import re

    import kvstore.adapters.exo as adapter

    readme = (ROOT / "docs" / "adapters.md").read_text()
    block = re.search(r"```python\n(from kvstore\.adapters import exo as kv_exo\n.*?)```", readme, re.S)
    doc = adapter.__doc__ or ""
    usage = doc[doc.index("Usage"):].split("::\n", 1)[1]
    lines = []
    for line in usage.splitlines()[1:]:
        if line and not line.startswith("    "):
            break
        lines.append(line[4:])
    assert block is not None and lines
    return {"docs": block.group(1), "docstring": textwrap.dedent("\n".join(lines))}


@pytest.mark.parametrize("where", ["docs", "docstring"])
def test_launcher_runs_main_once_when_exo_spawns_runners(tmp_path: Path, where: str) -> None:
    """The exo launcher of README and of the adapter's docstring, run as a script whose
    ``exo.main.main`` spawns a runner (exo's shape, stand-in packages: exo cannot be
    installed here): ``install`` and ``main`` run once, in the launcher's process, and the
    spawned runner runs. Before: both sat at module level, so the spawned runner, importing
    the launcher again, ran ``main`` again (and could not start its own runner)."""
    root = tmp_path / "pkgs"
    mlx_pkg = root / "exo" / "worker" / "engines" / "mlx"
    mlx_pkg.mkdir(parents=True)
    for d in (root / "exo", root / "exo" / "worker", root / "exo" / "worker" / "engines", mlx_pkg):
        (d / "__init__.py").write_text("")
    (mlx_pkg / "builder.py").write_text(BUILDER)
    (root / "exo" / "main.py").write_text(EXO_MAIN)
    launcher = tmp_path / "launch_exo.py"
    launcher.write_text(_launchers()[where].replace("~/.cache/kvstore", str(tmp_path / "kv")))
    log = tmp_path / "launch.log"
    p = subprocess.run([sys.executable, str(launcher)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env=dict(os.environ, PYTHONPATH=f"{root}:{ROOT}", EXO_LAUNCH_LOG=str(log)))
    runs = [ln.split()[0] for ln in log.read_text().splitlines()] if log.exists() else []
    assert p.returncode == 0 and runs == ["main", "runner"], (runs, p.stderr[-3000:])
