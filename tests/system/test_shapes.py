"""Every array is checked whole against the shape the model's own cache has (issue 31.2).

A cache whose arrays have the model's layer classes, KV heads and head_dim but a batch of 2
(or a fifth axis) killed mlx_lm.server's generation thread at the first request that
restored it (``BatchKVCache.merge`` cannot put (2, ...) into a batch-1 slot; ``/health``
503 from then on, again after every restart). Here, on real tiny models of every cache
class: the check itself, ``kvstore import`` of files rewritten with mlx-lm's own
``save_prompt_cache`` (real CLI, real files), an entry planted on disk behind the checks
of ``insert`` (served by ``kvstore serve`` as a miss, answered as a cold server answers)
and the same entry published to a shared tier (a miss, dropped there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import pytest

from tests.support.servers import Server, cached_tokens, reply
from tests.system.test_cli import cli

FAMILIES = ["tiny-llama", "tiny-llama-q", "tiny-gemma3", "tiny-qwen3next", "tiny-cachelist", "tiny-llama4"]
CRAFTS: dict[str, Callable[[mx.array], mx.array]] = {
    "batch 2": lambda a: mx.concatenate([a, a], axis=0),
    "fifth axis": lambda a: a[None],
}


def _identity(name: str) -> Any:
    from kvstore.identity import model_identity
    from tools.testing.model_builds import MODELS, model_path

    spec = MODELS[name]
    return model_identity(model_path(name), kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size)


def _entries(cache_dir: Path) -> list[dict]:
    if not (cache_dir / "index" / "data.mdb").exists():
        return []
    p = cli("ls", "--json", cache_dir=cache_dir)
    assert p.returncode == 0, p.stderr
    return [e for g in json.loads(p.stdout)["identities"] for e in g["entries"]]


@pytest.mark.parametrize("name", FAMILIES)
def test_every_array_of_every_class_is_checked_whole(name, load_named):
    """KVCache, QuantizedKVCache, RotatingKVCache, ArraysCache, CacheList and
    ChunkedKVCache: a real prefilled cache fits its model; the same cache with any one
    array given a batch of 2 or a fifth axis does not, and the problem names the array."""
    from kvstore.codec import encode_cache
    from kvstore.fit import ArraySpec, layout_problem
    from tools.testing.model_builds import MODELS
    from tools.testing.oracle import prefill

    ident = _identity(name)
    tensors, layout = encode_cache(prefill(load_named(name)[0], list(range(1, 41)), **MODELS[name].cache_kwargs))
    assert layout_problem(ident, tensors, layout) is None
    specs = {n: ArraySpec(tuple(a.shape), str(a.dtype).rsplit(".", 1)[-1]) for n, a in tensors.items()}
    assert layout_problem(ident, specs, layout) is None  # what a restore checks: the segments' headers
    for n, a in tensors.items():
        for how, craft in CRAFTS.items():
            bad = craft(a)
            why = layout_problem(ident, {**specs, n: ArraySpec(tuple(bad.shape), specs[n].dtype)}, layout)
            assert why is not None and f"of shape {list(bad.shape)}" in why, (n, how, why)
    # one layer's keys and values of different lengths, and an array no layer holds
    k = next(n for n in tensors if n.endswith(("k", "k0")))
    short = ArraySpec((*specs[k].shape[:-2], specs[k].shape[-2] - 1, specs[k].shape[-1]), specs[k].dtype)
    assert "positions" in (layout_problem(ident, {**specs, k: short}, layout) or "")
    assert "of no layer" in (layout_problem(ident, {**specs, "99.k": specs[k]}, layout) or "")


def _export(tmp_path: Path, name: str, load_named) -> Path:
    """A real entry of ``name`` written by ``kvstore export``."""
    from kvstore import KVStore
    from tools.testing.model_builds import MODELS, model_path
    from tools.testing.oracle import prefill

    spec = MODELS[name]
    tokens = list(range(1, 41))
    with KVStore(tmp_path / "src", kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size or 64) as s:
        s.insert(model_path(name), tokens, prefill(load_named(name)[0], tokens, **spec.cache_kwargs))
        s.flush()
    [entry] = _entries(tmp_path / "src")
    out = tmp_path / "real.safetensors"
    p = cli("export", entry["id"], out, cache_dir=tmp_path / "src")
    assert p.returncode == 0, p.stderr
    return out


def _rewrite(src: Path, dst: Path, craft: Callable[[mx.array], mx.array]) -> None:
    """``src`` loaded and saved again by mlx-lm's own functions, each layer's arrays
    crafted, the metadata (model, kvstore's token ids and identity) unchanged."""
    from mlx_lm.models.cache import ArraysCache, load_prompt_cache, save_prompt_cache

    cache, meta = load_prompt_cache(str(src), return_metadata=True)
    for c in cache:
        if isinstance(c, ArraysCache):
            c.cache = [None if a is None else craft(a) for a in c.cache]
        else:
            c.keys, c.values = craft(c.keys), craft(c.values)
    save_prompt_cache(str(dst), cache, meta)


@pytest.mark.parametrize("name,how", [("tiny-llama", "batch 2"), ("tiny-llama", "fifth axis"),
                                      ("tiny-qwen3next", "batch 2")])
def test_import_refuses_a_file_of_another_shape_and_stores_nothing(tmp_path, load_named, name, how):
    """``kvstore import`` of an export rewritten by ``save_prompt_cache`` with every layer's
    arrays of batch 2 (or a fifth axis): a clear error naming the array and its shape,
    nothing stored. It stored it, and ``verify`` called it fine. The file as exported
    imports (the refusal is the shape's)."""
    from tools.testing.model_builds import model_path

    real = _export(tmp_path, name, load_named)
    crafted = tmp_path / "crafted.safetensors"
    _rewrite(real, crafted, CRAFTS[how])
    c = tmp_path / "c"
    p = cli("import", crafted, "--model", model_path(name), cache_dir=c)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "does not fit --model" in p.stderr and "of shape [" in p.stderr and "nothing stored" in p.stderr, p.stderr
    assert ("[2, " if how == "batch 2" else "[1, 1, ") in p.stderr, p.stderr
    assert _entries(c) == []
    p = cli("import", real, "--model", model_path(name), cache_dir=c)
    assert p.returncode == 0, p.stderr
    assert len(_entries(c)) == 1


def _plant(src: Path, dst: Path, model_dir: Path, craft: Callable[[mx.array], mx.array]) -> int:
    """Every entry of ``src`` with its arrays crafted, written into ``dst`` by the disk
    tier itself (``DiskTier.persist``: behind ``insert``'s layout check, as a foreign or
    older writer would); the number planted."""
    from kvstore import KVStore
    from kvstore.segments import host_views
    from kvstore.codec import encode_cache
    from kvstore.disk import PersistJob
    from kvstore.index import scan
    from kvstore.query import Query

    jobs = []
    with KVStore(src) as s:
        ident = s.identity(model_dir)
        for key, rec in scan(s.disk.index, full=False).entries.items():
            toks = bytes(s.disk.index.tokens(key))
            plan = s.disk.plan(ident, toks)
            assert plan is not None and plan.n == rec.n
            tensors, layout = encode_cache(s.disk.restore(plan, ident).cache)
            tensors = {n: craft(a) for n, a in tensors.items()}
            mx.eval(tensors)
            job = PersistJob(ident, Query(toks, ident.digest, s.disk.chunk), host_views(tensors), layout, rec.cache_type)
            assert job.query.key == key
            jobs.append(job)
    with KVStore(dst) as d:
        for job in jobs:
            d.disk.persist(job)
    return len(jobs)


@pytest.mark.parametrize("how", list(CRAFTS))
def test_a_planted_entry_of_another_shape_is_a_miss_and_the_server_answers_as_cold(tmp_path, how):
    """``kvstore serve`` on a directory holding entries whose arrays have a batch of 2 (or
    a fifth axis), planted behind ``insert``'s check: the request restoring them is a
    miss (counted corrupt, dropped) and answered exactly as the cold server answered it,
    the server stays healthy, and a restart serves it again. Before the check the
    generation thread died at the first such request (HTTP 503 from then on)."""
    from tools.testing.model_builds import model_path

    mdir = model_path("tiny-llama")
    msgs = [{"role": "user", "content": "Name three rivers of France and say which is the longest."}]
    with Server(mdir, tmp_path / "a", tmp_path / "a.log") as s:
        cold = reply(s.chat(msgs))
        s.wait_flushed()
    assert _plant(tmp_path / "a", tmp_path / "b", mdir, CRAFTS[how]) >= 1
    for run in range(2):  # and after a restart, when what is left is the server's own writes
        with Server(mdir, tmp_path / "b", tmp_path / f"b{run}.log") as s:
            got = s.chat(msgs)
            assert reply(got) == cold, s.log()
            stats = s.stats()
            if run == 0:
                assert cached_tokens(got) == 0 and stats.get("corrupt", 0) >= 1, stats
            else:
                assert stats.get("corrupt", 0) == 0, stats
            assert s.get("/health") is not None  # 200 (get() asserts it)
            assert reply(s.chat(msgs)) == cold
            s.wait_flushed()


pytest_plugins = ("tests.support.redis_servers",)


def test_a_shared_entry_of_another_shape_is_a_miss_and_dropped_there(tmp_path, load_named, redis_server):
    """Machine A publishes an entry (two chunks and a tail) whose arrays have a batch of 2
    (planted behind ``insert``'s check, as an older or foreign publisher would): each
    other machine's fetch is a miss that writes nothing and deletes from the shared tier
    the record it met (the entry, then a chunk, then the other), until none is found.
    Before the check the first one handed out the batch-2 cache."""
    from kvstore import KVStore
    from kvstore.segments import host_views
    from kvstore.codec import encode_cache
    from kvstore.disk import PersistJob
    from kvstore.keys import encode_tokens, key_of, root_key
    from kvstore.query import Query
    from kvstore.shared import SharedConfig
    from kvstore.shared.tier import PublishItem
    from tools.testing.oracle import prefill

    C = 16
    ident = _identity("tiny-llama")
    tokens = list(range(1, 41))
    tensors, layout = encode_cache(prefill(load_named("tiny-llama")[0], tokens))
    tensors = {n: CRAFTS["batch 2"](a) for n, a in tensors.items()}
    mx.eval(tensors)
    enc = encode_tokens(tokens)
    key = key_of(root_key(ident.digest), enc, C)

    def machine(name: str) -> KVStore:
        return KVStore(tmp_path / name, chunk_tokens=C, shared=SharedConfig.from_url(redis_server.url))

    with machine("a") as a:
        assert a.disk is not None and a.shared is not None
        a.disk.persist(PersistJob(ident, Query(enc, ident.digest, C), host_views(tensors), layout))
        rec, toks, chunks = a.disk.export_entry(key)  # type: ignore[misc]
        assert a.shared.publish(PublishItem(ident.digest, key, rec, toks, chunks, a.disk.segment_bytes))
    for i in range(4):  # the entry, then (as each is met) its two chunks: each a miss that drops what it met
        with machine(f"b{i}") as b:
            got = b.fetch(ident, tokens + [7])
            assert got.cache is None, got.n
            assert b.flush(30)
            s = b.stats()
            assert s["disk_entries"] == 0 and s["shared_rejected"] == s["shared_lookup_hits"], s
            if not s["shared_lookup_hits"]:
                break
    assert i == 3, "the entry and its two chunks are met and dropped, one per fetch"
