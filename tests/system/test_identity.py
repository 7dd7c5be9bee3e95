"""Identity: an entry is only ever returned to the identity that wrote it.

Each component gets its own test: copy tiny-llama's directory, change exactly that
component, and check (in memory and, through a freshly opened store, on disk) that an
entry written under the original is a miss under the variant while the original still
hits. The differing identity components are checked too, so each test changes what it
says it changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.support.stores import CHUNK, cache_digest

from kvstore import KVStore, model_identity
from kvstore.identity import Identity
from kvstore.model_layout import layout_of
from tools.testing.model_builds import MODELS, model_path
from tools.testing.oracle import prefill

N_PROMPT = 100


@pytest.fixture(scope="module")
def llama(tiny_llama, make_prompt):
    model, tok = tiny_llama
    prompt = make_prompt(tok, N_PROMPT, seed=11)
    return {"model": model, "path": model_path("tiny-llama"), "prompt": prompt,
            "cache": prefill(model, prompt)}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _components(path, **kw) -> dict:
    return model_identity(path, **kw).info["components"]


def _changed(a: dict, b: dict) -> set[str]:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def assert_separated(store_dir: Path, llama, original, variant, *, write_kw=None, read_kw=None,
                     variant_kw=None) -> None:
    """An entry written under ``original`` is a miss under ``variant`` (memory and disk);
    ``original`` still hits (memory and disk)."""
    write_kw, read_kw = write_kw or {}, read_kw or {}
    variant_kw = read_kw if variant_kw is None else variant_kw
    prompt = llama["prompt"]
    longer = prompt + [7, 8, 9]
    with KVStore(store_dir, chunk_tokens=CHUNK, **write_kw) as s:
        s.insert(original, prompt, llama["cache"])
        if not variant_kw and not read_kw:  # same store settings: check the memory tier too
            assert s.identity(variant) != s.identity(original)
            for q in (prompt, longer, prompt[:60]):
                assert s.fetch(variant, q).cache is None, "memory tier served another identity"
        got = s.fetch(original, prompt)
        assert (got.n, got.source) == (len(prompt), "memory")
    with KVStore(store_dir, **variant_kw) as s:
        for q in (prompt, longer, prompt[:60]):
            f = s.fetch(variant, q)
            assert f.cache is None and f.n == 0, f"disk served another identity ({f.n} tokens)"
        assert s.stats()["hits_disk"] == 0
    with KVStore(store_dir, **read_kw) as s:
        got = s.fetch(original, prompt)
        assert (got.n, got.source) == (len(prompt), "disk")
        assert cache_digest(got.cache) == cache_digest(llama["cache"])


def test_weights_component(tmp_path, llama):
    variant = _copy(llama["path"], tmp_path / "m")
    w = variant / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight; same size
    w.write_bytes(bytes(data))
    assert _changed(_components(llama["path"]), _components(variant)) == {"weights"}
    assert_separated(tmp_path / "s", llama, llama["path"], variant)


def test_config_component(tmp_path, llama):
    variant = _copy(llama["path"], tmp_path / "m")
    cfg = json.loads((variant / "config.json").read_text())
    cfg["rms_norm_eps"] = 2e-5
    (variant / "config.json").write_text(json.dumps(cfg))
    assert _changed(_components(llama["path"]), _components(variant)) == {"config"}
    assert_separated(tmp_path / "s", llama, llama["path"], variant)


def test_tokenizer_component(tmp_path, llama):
    variant = _copy(llama["path"], tmp_path / "m")
    tj = json.loads((variant / "tokenizer.json").read_text())
    added = next(t for t in tj["added_tokens"] if t["content"] == "<|im_end|>")
    added["content"] = "<|im_stop|>"
    (variant / "tokenizer.json").write_text(json.dumps(tj))
    assert _changed(_components(llama["path"]), _components(variant)) == {"tokenizer"}
    assert_separated(tmp_path / "s", llama, llama["path"], variant)


def test_chat_template_component(tmp_path, llama):
    variant = _copy(llama["path"], tmp_path / "m")
    tc = json.loads((variant / "tokenizer_config.json").read_text())
    tc["chat_template"] = tc["chat_template"].replace("'\\n'", "'\\n\\n'")
    assert tc["chat_template"] != json.loads((llama["path"] / "tokenizer_config.json").read_text())["chat_template"]
    (variant / "tokenizer_config.json").write_text(json.dumps(tc))
    # tokenizer_config.json is also a tokenizer file, so both components move
    assert _changed(_components(llama["path"]), _components(variant)) == {"tokenizer", "chat_template"}
    assert_separated(tmp_path / "s", llama, llama["path"], variant)


def test_chat_template_file_component(tmp_path, llama):
    """A separate chat_template.jinja is the chat_template component alone."""
    variant = _copy(llama["path"], tmp_path / "m")
    (variant / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert _changed(_components(llama["path"]), _components(variant)) == {"chat_template"}
    assert_separated(tmp_path / "s", llama, llama["path"], variant)


def test_another_model(tmp_path, llama):
    other = model_path("tiny-qwen3next")
    assert_separated(tmp_path / "s", llama, llama["path"], other)


def test_adapter_and_draft_components(tmp_path, llama):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapters.safetensors").write_bytes(b"\0" * 64)
    (adapter / "adapter_config.json").write_text("{}")
    draft = model_path("tiny-gemma3")
    base = _components(llama["path"])
    assert _changed(base, _components(llama["path"], adapter_path=adapter)) == {"adapter"}
    assert _changed(base, _components(llama["path"], draft_path=draft)) == {"draft"}
    path = str(llama["path"])
    assert_separated(tmp_path / "s1", llama, (path, None, None), (path, str(adapter), None))
    assert_separated(tmp_path / "s2", llama, (path, None, None), (path, None, str(draft)))
    assert_separated(tmp_path / "s3", llama, (path, str(adapter), None), (path, None, None))


def test_kv_quantisation_component(tmp_path, llama, load_named):
    """Entries written by a kv_bits=8 / group 32 store are invisible to stores running
    another KV quantisation (none, other group size, other bits), and the other way round."""
    spec = MODELS["tiny-llama-q"]
    qmodel = load_named("tiny-llama-q")[0]
    qcache = prefill(qmodel, llama["prompt"], **spec.cache_kwargs)
    assert type(qcache[0]).__name__ == "QuantizedKVCache"
    q = {"kv_bits": 8, "kv_group_size": 32}
    path = llama["path"]
    assert _changed(_components(path), _components(path, **q)) == {"kv_bits", "kv_group_size"}
    qllama = dict(llama, cache=qcache)
    for i, other in enumerate([{}, {"kv_bits": 8, "kv_group_size": 64}, {"kv_bits": 4, "kv_group_size": 32}]):
        assert_separated(tmp_path / f"q{i}", qllama, path, path, write_kw=q, read_kw=q, variant_kw=other)
    # and a plain entry is invisible to the quantised store
    assert_separated(tmp_path / "plain", llama, path, path, write_kw={}, read_kw={}, variant_kw=q)


def test_same_tokens_two_identities_each_get_their_own(tmp_path, llama, tiny_gemma3):
    """Same token ids written under two models: each model gets back exactly its own cache."""
    gmodel = tiny_gemma3[0]
    gpath = model_path("tiny-gemma3")
    gcache = prefill(gmodel, llama["prompt"])
    want = {str(llama["path"]): cache_digest(llama["cache"]), str(gpath): cache_digest(gcache)}
    d = tmp_path / "s"
    with KVStore(d, chunk_tokens=CHUNK) as s:
        s.insert(llama["path"], llama["prompt"], llama["cache"])
        s.insert(gpath, llama["prompt"], gcache)
        for p in want:
            f = s.fetch(p, llama["prompt"])
            assert f.source == "memory" and cache_digest(f.cache) == want[p]
    with KVStore(d) as s:
        assert s.stats()["disk_entries"] == 2
        for p in want:
            f = s.fetch(p, llama["prompt"])
            assert f.source == "disk" and cache_digest(f.cache) == want[p]


def test_tuple_key_maps_to_the_path_identity(tmp_path, llama):
    path = llama["path"]
    d = tmp_path / "s"
    with KVStore(d, chunk_tokens=CHUNK) as s:
        ident = s.identity(path)
        assert isinstance(ident, Identity)
        for key in (str(path), (str(path), None, None), (path, None, None), (str(path),), [str(path), None, None]):
            assert s.identity(key) == ident, key
        assert ident == model_identity(path)
        s.insert((str(path), None, None), llama["prompt"], llama["cache"])
        f = s.fetch(str(path), llama["prompt"])
        assert (f.n, f.source) == (len(llama["prompt"]), "memory")
    with KVStore(d) as s:
        f = s.fetch((str(path), None, None), llama["prompt"])
        assert (f.n, f.source) == (len(llama["prompt"]), "disk")
        assert s.stats()["disk_identities"] == 1


def test_unresolvable_model_is_memory_only(tmp_path, llama):
    d = tmp_path / "s"
    with KVStore(d, chunk_tokens=CHUNK) as s:
        assert s.identity("no/such-model-dir") is None
        s.insert("no/such-model-dir", llama["prompt"], llama["cache"])
        assert s.fetch("no/such-model-dir", llama["prompt"]).source == "memory"
        assert s.fetch(llama["path"], llama["prompt"]).cache is None
    with KVStore(d) as s:
        assert s.stats()["disk_entries"] == 0


# --------------------------------------------------------------------------- KV geometry


def _kv_geometry(layout: list) -> list:
    """Per attention-KV layer (CacheList flattened): KV heads x head_dim of keys and values, dtype."""
    out = []
    for m in layout:
        if "sub" in m:
            out += _kv_geometry(m["sub"])
        elif m["class"] in ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache"):
            out.append((m.get("k"), m.get("v"), m.get("dtype")))
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-q", "tiny-gemma3", "tiny-qwen3next", "tiny-cachelist"])
def test_layout_records_the_kv_geometry_real_caches_have(name, load_named):
    """The layout component (built without evaluating anything) records what a real prefilled
    cache has: its classes and parameters, and per attention layer the KV heads, head_dim and
    dtype, so a cache of another model with the same classes is told apart."""
    spec = MODELS[name]
    cache = prefill(load_named(name)[0], list(range(40)), **spec.cache_kwargs)
    got = _components(model_path(name), kv_bits=spec.kv_bits, kv_group_size=spec.kv_group_size)["layout"]
    assert all(k and v and d for k, v, d in _kv_geometry(got)), got
    assert _kv_geometry(got) == _kv_geometry(layout_of(cache))
    if spec.kv_bits is None:  # (a kv_bits engine quantises mlx-lm's KVCache layers itself)
        assert got == layout_of(cache)


def test_layout_dtype_follows_the_weights(tmp_path, llama):
    """bfloat16 weights make bfloat16 KV: the identity says so (read from the safetensors
    header, no data), and differs from the float32 model's layout."""
    import mlx.core as mx
    from mlx_lm import load

    variant = _copy(llama["path"], tmp_path / "m")
    w = mx.load(str(variant / "model.safetensors"))
    mx.save_safetensors(str(variant / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in w.items()},
                        {"format": "mlx"})
    cache = prefill(load(str(variant))[0], llama["prompt"][:20])
    got = _components(variant)["layout"]
    assert got == layout_of(cache)
    assert {d for _, _, d in _kv_geometry(got)} == {"bfloat16"}
    assert _changed(_components(llama["path"]), _components(variant)) == {"weights", "layout"}


def test_layout_falls_back_without_weights_or_probe(tmp_path, llama, monkeypatch):
    """No loadable weights (a GGUF-only directory): heads and head_dim from config.json, no
    dtype (a lazily initialised model is float32 whatever the weights are). An architecture
    whose forward reads a value (which would evaluate the model): the probe refuses to
    evaluate and the layout is classes only. Identity creation never fails for either."""
    from mlx_lm.models import llama as arch
    from mlx_lm.models.cache import make_prompt_cache

    variant = _copy(llama["path"], tmp_path / "m")
    (variant / "model.safetensors").rename(variant / "model.gguf")
    assert _kv_geometry(_components(variant)["layout"]) == [([2, 32], [2, 32], None)] * 3

    forward = arch.Model.__call__

    def reads_a_value(self, inputs, *a, **kw):
        int(inputs.sum().item())
        return forward(self, inputs, *a, **kw)

    monkeypatch.setattr(arch.Model, "__call__", reads_a_value)
    layout = _components(llama["path"])["layout"]
    assert layout == layout_of(make_prompt_cache(llama["model"]))
    assert _kv_geometry(layout) == [(None, None, None)] * 3


def test_threads_asking_at_once_share_one_derivation(tmp_path):
    """A new model's identity asked for by several threads at once (a server's generation
    thread, its preload, a stats request) is derived once and is the same for all: two
    derivations at once cost twice the time and, when one failed (CPython 3.11's ast can
    fail under a second thread's parse: ``identity.class_source``), filed one thread's
    caches under another key than the other's lookups used."""
    import threading

    from kvstore.identity import DigestMemo
    from kvstore.resolver import MemoryOnly, Resolver

    path = _copy(model_path("tiny-llama"), tmp_path / "model")
    filed: list[Identity] = []
    warned: list[tuple] = []
    resolver = Resolver(DigestMemo(None, None), MemoryOnly(), lambda *a: warned.append(a), filed.append)
    threads, start, got = 6, threading.Barrier(6), []

    def ask() -> None:
        start.wait()
        got.append(resolver.identity((str(path), None, None)))

    workers = [threading.Thread(target=ask) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not warned, warned
    assert len(got) == threads and None not in got
    assert len({i.digest for i in got}) == 1
    assert len(filed) == 1, f"derived {len(filed)} times for {threads} threads"


LOADED_MODELS = [n for n in MODELS if n != "bench-qwen3-0.6b"]  # every model but the 2.4 GB one (built on demand)


@pytest.mark.parametrize("name", LOADED_MODELS)
def test_layout_of_the_loaded_model_is_the_one_built_lazily(name, load_named):
    """``kvstore serve`` derives its identity with the model it loaded (``built=``) instead
    of building a second one lazily: the layout record, so the digest, is the very same on
    every architecture (a different digest would orphan every stored cache of the model),
    and the probe, traced on the served model, leaves that model computing what it did."""
    from kvstore.model_layout import layout_from_config, layout_of_model

    import mlx.core as mx

    spec, path = MODELS[name], model_path(name)
    model = load_named(name)[0]
    tokens = mx.array([[1, 2, 3, 4]])
    try:
        before = model(tokens)
        mx.eval(before)
    except Exception:  # tiny-muse-spark's kernels run on Metal only
        before = None
    assert layout_of_model(model) == layout_from_config(path)
    if before is not None:  # the probe left the served model as it was: the same logits
        after = model(tokens)
        assert mx.array_equal(before, after).item(), name
    quant = {"kv_bits": spec.kv_bits, "kv_group_size": spec.kv_group_size}
    assert model_identity(path, built=model, **quant).digest == model_identity(path, **quant).digest


def test_the_code_digest_is_remembered_by_its_source_files(tmp_path):
    """A memo gives the code digest computed without it, and its entry is used only while
    its stamp (the Python version, each source file's stat) is current: a restart skips
    parsing mlx-lm's sources, an mlx-lm upgrade (a source file replaced) computes it again."""
    from kvstore.identity import DigestMemo, code_digest, read_config
    from kvstore.model_layout import layout_from_config

    path = model_path("tiny-gemma3")
    config, layout = read_config(path), layout_from_config(path)
    real = code_digest(config, layout)
    memo_file = tmp_path / "memo.json"
    assert code_digest(config, layout, DigestMemo(memo_file)) == real
    [(key, (stamp, value))] = [(k, v) for k, v in json.loads(memo_file.read_text()).items() if k.startswith("code:")]
    assert value == real
    memo_file.write_text(json.dumps({key: [stamp, "remembered"]}))
    assert code_digest(config, layout, DigestMemo(memo_file)) == "remembered"  # a hit: no source is read
    stamp[2][0][-1] += 1  # the model module's ctime moved (its file was replaced): computed again
    memo_file.write_text(json.dumps({key: [stamp, "remembered"]}))
    assert code_digest(config, layout, DigestMemo(memo_file)) == real
