"""Trust boundaries of a cache directory (issue 11): what someone else put in or around it.

Each test is the reproduction of one finding of the adversarial review, run on real
stores, real files and real processes: it failed before the fix it names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from store_util import CHUNK, ROOT, run_py, synth_kv_cache

from kvstore import KVStore
from kvstore.identity import Identity, code_digest, layout_of, model_identity
from tools.faults import craft
from tools.models import model_path
from tools.oracle import prefill

N_PROMPT = 80


@pytest.fixture(scope="module")
def llama(tiny_llama, make_prompt):
    model, tok = tiny_llama
    prompt = make_prompt(tok, N_PROMPT, seed=5)
    return {"model": model, "prompt": prompt, "cache": prefill(model, prompt)}


def _swap_weights_keep_stat(model_dir: Path) -> None:
    """Different weights of the same size, with the old mtime put back (what ``cp -p``,
    ``rsync -a`` and ``touch -r`` do)."""
    w = model_dir / "model.safetensors"
    st = w.stat()
    data = bytearray(w.read_bytes())
    data[-64:] = bytes(b ^ 0x5A for b in data[-64:])
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (w.stat().st_size, w.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


# -- finding 2: a stale identity restores the old weights' KV ----------------------------


def test_weights_swapped_under_old_mtime_miss_in_a_new_process(tmp_path, llama):
    mdir = shutil.copytree(model_path("tiny-llama"), tmp_path / "model")
    cache_dir = tmp_path / "cache"
    with KVStore(cache_dir, chunk_tokens=CHUNK) as s:
        s.insert(mdir, llama["prompt"], llama["cache"])
    _swap_weights_keep_stat(mdir)
    got = run_py("""
        import json, sys
        from kvstore import KVStore
        a = json.loads(sys.argv[1])
        with KVStore(a["cache"], chunk_tokens=a["chunk"]) as s:
            f = s.fetch(a["model"], a["prompt"])
        print(json.dumps({"n": f.n, "source": f.source}))
    """, {"cache": str(cache_dir), "model": str(mdir), "prompt": llama["prompt"], "chunk": CHUNK})
    assert got == {"n": 0, "source": None}, "the old weights' KV was restored for new weights"


def test_running_store_notices_weights_swapped_under_it(tmp_path, llama):
    mdir = shutil.copytree(model_path("tiny-llama"), tmp_path / "model")
    with KVStore(tmp_path / "cache", chunk_tokens=CHUNK) as s:
        s.insert(mdir, llama["prompt"], llama["cache"])
        before = s.identity(mdir)
        assert s.fetch(mdir, llama["prompt"]).n == len(llama["prompt"])
        _swap_weights_keep_stat(mdir)
        assert s.identity(mdir) != before
        got = s.fetch(mdir, llama["prompt"])
        assert (got.n, got.cache) == (0, None), "a running store kept the old identity"
        s.flush()
    with KVStore(tmp_path / "cache", chunk_tokens=CHUNK) as s:  # and the disk tier agrees
        assert s.fetch(mdir, llama["prompt"]).n == 0


def test_identity_includes_the_model_code(tmp_path):
    """The code component follows the mlx-lm module that builds the model: a copy of
    llama.py under another model_type gives the same digest as llama; one changed line in
    it (a RoPE detail) gives another. Run in a new process, where the copy is importable
    as ``mlx_lm.models.<name>`` exactly as an upgraded mlx-lm would ship it."""
    got = run_py("""
        import json, sys, pathlib
        import mlx_lm.models, mlx_lm.models.llama as L
        from kvstore.identity import code_digest
        a = json.loads(sys.argv[1])
        src = pathlib.Path(L.__file__).read_text()
        d = pathlib.Path(a["tmp"])
        (d / "kvtest_same.py").write_text(src)
        (d / "kvtest_changed.py").write_text(src.replace("args.rope_theta,", "args.rope_theta * 1.0,", 1))
        mlx_lm.models.__path__.append(str(d))
        layout = [{"class": "KVCache"}]
        out = {n: code_digest({"model_type": n}, layout) for n in ("llama", "kvtest_same", "kvtest_changed", "gemma3")}
        out["rotating"] = code_digest({"model_type": "llama"}, [{"class": "RotatingKVCache"}])
        print(json.dumps(out))
    """, {"tmp": str(tmp_path)})
    assert got["llama"] and got["llama"] == got["kvtest_same"]
    assert got["kvtest_changed"] != got["llama"]
    assert got["gemma3"] != got["llama"]
    assert got["rotating"] != got["llama"]  # the cache classes' code is part of it


def test_code_component_is_in_the_identity():
    comps = model_identity(model_path("tiny-llama")).info["components"]
    cfg = json.loads((model_path("tiny-llama") / "config.json").read_text())
    assert comps["code"] == code_digest(cfg, comps["layout"]) is not None


# -- helpers for the findings below: synthetic entries, the CLI and fetches in new processes


SYN = Identity.from_components({"test": "trust", "layout": layout_of(synth_kv_cache(2, 2, 1, 8))},
                               name="trust-synthetic")
FETCH = """
    import json, sys
    from kvstore import KVStore
    from kvstore.identity import Identity
    a = json.loads(sys.argv[1])
    ident = Identity(bytes.fromhex(a["digest"]), a["info"])
    try:
        s = KVStore(a["cache"], chunk_tokens=a["chunk"], shared_dir=a.get("shared", False))
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        raise SystemExit(0)
    with s:
        got = [s.fetch(ident, t).n for t in a["prompts"]]
        if a.get("model"):  # a model directory: its identity reads the digest memo
            got.append(s.fetch(a["model"], [1, 2, 3]).n)
        st = s.stats()
    print(json.dumps({"n": got, "disk": s.disk is not None or st.get("disk_off") is None,
                      "stats": {k: st[k] for k in ("corrupt", "races", "warnings_suppressed", "misses")}}))
"""


def _synthetic_store(cache_dir: Path, n: int = 1, length: int = 100) -> list[list[int]]:
    """A store holding ``n`` synthetic entries of ``length`` tokens (each its own pack);
    returns their prompts."""
    prompts = [[(7 * i + j) % 200 for j in range(length)] for i in range(n)]
    with KVStore(cache_dir, chunk_tokens=CHUNK) as s:
        for i, toks in enumerate(prompts):
            s.insert(SYN, toks, synth_kv_cache(2, 2, length, 8, seed=i))
            s.flush()
    return prompts


def _fetch_in_new_process(cache_dir: Path, prompts: list[list[int]], timeout: float = 60, **more: object) -> dict:
    """Fetch each prompt (synthetic identity) in a new process: tokens served and counters
    (or the exception opening the store raised: ``error`` and ``message``)."""
    try:
        return run_py(FETCH, {"cache": str(cache_dir), "digest": SYN.digest.hex(), "info": SYN.info,
                              "prompts": prompts, "chunk": CHUNK, **more}, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening the store and fetching hung (over {timeout:.0f} s)")


def _cli(cache_dir: Path, *args: str, timeout: float = 20) -> subprocess.CompletedProcess:
    """``kvstore ARGS --cache-dir DIR`` in a new process, which must finish within
    ``timeout`` seconds with exit 0 or 1 and no traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        p = subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--cache-dir", str(cache_dir)],
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        pytest.fail(f"`kvstore {' '.join(args)}` hung (over {timeout:.0f} s)")
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, (args, p.returncode, p.stderr[-3000:])
    return p


# -- finding: a symlinked fan-out directory is followed --------------------------------


def test_symlinked_fanout_dir_is_not_followed(tmp_path):
    """blobs/<2 hex>/ replaced by a symlink to someone's directory that holds a file under
    the pack's name: a restore must not read it, and gc must not delete it."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache)
    pack = craft.packs(cache)[0]
    user = tmp_path / "user-files"
    before = craft.user_files(user, [pack])
    shutil.rmtree(pack.parent)
    os.symlink(user, pack.parent)
    got = _fetch_in_new_process(cache, prompts)
    assert got["n"] == [0], "the KV was read from a file outside blobs/"
    _cli(cache, "gc", "--max-bytes", "0", "--blob-age", "0")
    _cli(cache, "verify", "--fix", "--blob-age", "0")
    assert craft.tree_state(user) == before, "a file outside the cache directory was changed"
    assert os.path.islink(pack.parent)  # reported as foreign, left alone


# -- finding: a FIFO where kvstore reads a file blocks it forever -----------------------


@pytest.mark.parametrize("where", ["pack", "index/clean", "file-digests.json", "index/data.mdb"])
def test_fifo_in_place_of_a_file_never_blocks(tmp_path, where):
    """A FIFO with no writer where kvstore expects one of its files: every fetch and
    command returns within 20 s (a clear error or a miss) instead of waiting forever, and
    a FIFO among the pack files is left where it is."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache)
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        s.identity(str(model_path("tiny-llama")))  # writes the digest memo
    target = craft.packs(cache)[0] if where == "pack" else cache / where
    assert target.is_file()
    target.unlink()
    os.mkfifo(target, 0o600)
    got = _fetch_in_new_process(cache, prompts, timeout=20, model=str(model_path("tiny-llama")))
    if where == "index/data.mdb":
        assert got.get("error") == "StoreOpenError" and "data.mdb" in got["message"], got
    else:
        assert got["n"][0] == (0 if where == "pack" else len(prompts[0])), got
    for cmd in (["ls"], ["stats"], ["verify"], ["verify", "--fix", "--blob-age", "0"], ["gc", "--blob-age", "0"]):
        _cli(cache, *cmd, timeout=20)
    if where == "pack":
        assert craft.tree_state(target.parent)[target.name] == "fifo", "a file kvstore did not write was removed"


# -- finding: crafted records with out-of-range fields ----------------------------------


@pytest.mark.parametrize("value", [b"s2", b"0", b"-5", b"99999999999", b"\xff" * 40],
                         ids=["letters", "zero", "negative", "huge", "binary"])
def test_crafted_chunk_size_record_is_refused_clearly(tmp_path, value):
    """The index's chunk size (meta ``chunk_tokens``, which places every key boundary)
    replaced by one kvstore never writes: opening the store is a StoreOpenError naming
    it (not a ValueError from int(), and not a store that divides by zero or keys every
    prompt under a chunk of 10**11 tokens), and the CLI says so instead of a traceback."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache)
    craft.put_raw(cache, "meta", b"chunk_tokens", value)
    got = _fetch_in_new_process(cache, prompts)
    assert got.get("error") == "StoreOpenError" and "chunk_tokens" in got["message"], got
    for cmd in (["ls"], ["verify"], ["gc"]):
        p = _cli(cache, *cmd)
        assert p.returncode == 1 and "chunk_tokens" in p.stderr, (cmd, p.stderr)


# -- finding: a crafted record that names what another entry owns ----------------------


def _snapshot_cache(n: int, seed: int) -> list:
    """A snapshot-only cache (recurrent state + KV): one segment, one pack per entry."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache

    a = ArraysCache(1)
    a.cache[0] = mx.full((1, 4), float(seed))
    return [a] + synth_kv_cache(1, 2, n, 8, seed=seed)


SNAP = Identity.from_components({"test": "trust-snapshots", "layout": layout_of(_snapshot_cache(1, 0))},
                                name="trust-snapshots")


def test_record_naming_another_entrys_segment_costs_only_itself(tmp_path):
    """An entry record rewritten to name another entry's segment (a real one, whose
    checksum verifies): fetching it is a miss and drops it, and the other entry, alone in
    its pack file, is still served: the drop must not release a segment the record
    does not own (it did, and the other entry's pack file was unlinked)."""
    from dataclasses import replace

    from kvstore.keys import encode_tokens, key_of, root_key

    cache = tmp_path / "cache"
    liar, owner = list(range(40)), list(range(100, 150))
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        for i, toks in enumerate((liar, owner)):
            s.insert(SNAP, toks, _snapshot_cache(len(toks), i + 1))
            s.flush()
    k_liar, k_owner = (key_of(root_key(SNAP.digest), encode_tokens(t), CHUNK) for t in (liar, owner))
    recs = craft.records(cache, "entries")
    craft.put_raw(cache, "entries", k_liar, replace(recs[k_liar], tail=recs[k_owner].tail).to_bytes())
    code = """
        import json, sys
        from kvstore import KVStore
        from kvstore.identity import Identity
        a = json.loads(sys.argv[1])
        ident = Identity(bytes.fromhex(a["digest"]), a["info"])
        with KVStore(a["cache"], chunk_tokens=a["chunk"]) as s:
            got = [s.fetch(ident, t).n for t in a["prompts"]]
        print(json.dumps(got))
    """
    args = {"cache": str(cache), "digest": SNAP.digest.hex(), "info": SNAP.info, "chunk": CHUNK}
    assert run_py(code, dict(args, prompts=[liar])) == [0]
    assert run_py(code, dict(args, prompts=[owner])) == [len(owner)], "the other entry's pack file was removed"
    _cli(cache, "verify", "--fix", "--blob-age", "0")
    assert _cli(cache, "verify").returncode == 0
    assert run_py(code, dict(args, prompts=[owner])) == [len(owner)]


@pytest.mark.parametrize("how", ["verify --fix", "gc --max-age"])
def test_record_with_another_entrys_chunk_list_costs_only_itself(tmp_path, how):
    """A chunked entry's chunk list replaced by another entry's (same count): removing
    the liar (``verify --fix`` finds it inconsistent; ``gc --max-age`` finds it old) must
    not take the other entry's chunks with it (their reference count went to 0 and they
    were removed, so the other entry was lost)."""
    from dataclasses import replace

    cache = tmp_path / "cache"
    prompts = [[(7 * i + j) % 200 for j in range(2 * CHUNK + 10)] for i in range(2)]
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        for i, toks in enumerate(prompts):
            s.insert(SYN, toks, synth_kv_cache(2, 2, len(toks), 8, seed=i))
            s.flush()
    recs = craft.records(cache, "entries")
    (k_liar, liar), (k_owner, owner) = sorted(recs.items(), key=lambda kr: kr[1].created)
    assert len(liar.chunks) == len(owner.chunks) == 2
    craft.put_raw(cache, "entries", k_liar, replace(liar, chunks=owner.chunks, last_used=1.0).to_bytes())
    if how == "verify --fix":
        _cli(cache, "verify", "--fix", "--blob-age", "0")
    else:
        assert "removed" in _cli(cache, "gc", "--max-age", "1h", "--keep-orphans").stdout
    assert _fetch_in_new_process(cache, [prompts[1]])["n"] == [len(prompts[1])], "the other entry was lost"
    _cli(cache, "verify", "--fix", "--blob-age", "0")
    assert _cli(cache, "verify").returncode == 0
    assert _fetch_in_new_process(cache, [prompts[1]])["n"] == [len(prompts[1])]


def test_refused_index_is_refused_the_same_way_every_time(tmp_path):
    """An index claiming another format is refused naming the format, and again on the
    next open in the same process, read-only or not (a server retrying, or the CLI's
    read-only then writable opens): the refused open left its environment registered,
    and every later open said the index was "already open read-only in this process"."""
    cache = tmp_path / "cache"
    _synthetic_store(cache)
    craft.put_raw(cache, "meta", b"format", b"2")
    got = run_py("""
        import json, sys
        from pathlib import Path
        from kvstore import KVStore, StoreOpenError
        from kvstore.store import open_disk
        a = json.loads(sys.argv[1])
        out = []
        for how in ("readonly", "write", "store", "store"):
            try:
                if how == "store":
                    KVStore(a["cache"]).close()
                else:
                    open_disk(Path(a["cache"]), readonly=how == "readonly").close()
                out.append("opened")
            except StoreOpenError as e:
                out.append(str(e))
        print(json.dumps(out))
    """, {"cache": str(cache)})
    assert all("has format 2" in m for m in got), got
