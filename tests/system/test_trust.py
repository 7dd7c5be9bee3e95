"""Trust boundaries of a cache directory (issue 11): what someone else put in or around it.

Each test is the reproduction of one finding, run on real stores, real LMDB edits (records
written with ``lmdb`` directly, ``tools.harness.faults.craft``), real files, symlinks and FIFOs,
and real processes (fetches and the ``kvstore`` CLI in new processes, with time limits).
Tests of a finding fixed in kvstore failed before that fix (its commit says which); the
others pin what the store already did right (they fail if that regresses). The fault
harness's ``hostile`` kind runs the same attacks at random over a populated directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.support import ROOT
from tests.support.children import child_env, run_module
from tests.support.caches import synth_kv_cache
from tests.support.children import run_py
from tests.support.stores import CHUNK

from kvstore import KVStore
from kvstore.identity import Identity, code_digest, model_identity
from kvstore.model_layout import layout_of
from tools.harness.faults import craft
from tools.testing.model_builds import model_path
from tools.testing.oracle import prefill

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


def _synthetic_store(cache_dir: Path, n: int = 1, length: int = 100) -> list[list[int]]:
    """A store holding ``n`` synthetic entries of ``length`` tokens (each its own pack);
    returns their prompts."""
    prompts = [[(7 * i + j) % 200 for j in range(length)] for i in range(n)]
    with KVStore(cache_dir, chunk_tokens=CHUNK) as s:
        for i, toks in enumerate(prompts):
            s.insert(SYN, toks, synth_kv_cache(2, 2, length, 8, seed=i))
            s.flush()
    return prompts


def _fetch_in_new_process(cache_dir: Path, prompts: list[list[int]], timeout: float = 300, **more: object) -> dict:
    """Fetch each prompt (synthetic identity) in a new process: tokens served and counters
    (or the exception opening the store raised: ``error`` and ``message``)."""
    try:
        return run_module("tests.support.programs.trust_fetch",
                          {"cache": str(cache_dir), "digest": SYN.digest.hex(), "info": SYN.info,
                           "prompts": prompts, "chunk": CHUNK, **more}, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"opening the store and fetching hung (over {timeout:.0f} s)")


def _cli(cache_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``kvstore ARGS --cache-dir DIR`` in a new process, which must finish with exit 0 or 1
    and no traceback; ``timeout`` bounds a hang (a FIFO blocks forever), not a busy machine."""
    env = child_env()
    try:
        p = subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--cache-dir", str(cache_dir)],
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        pytest.fail(f"`kvstore {' '.join(args)}` hung (over {timeout:.0f} s)")
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, (args, p.returncode, p.stderr[-3000:])
    return p


# -- finding: a symlinked fan-out directory is followed --------------------------------


def test_symlinked_fanout_dir_is_not_followed(tmp_path: Path) -> None:
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
def test_fifo_in_place_of_a_file_never_blocks(tmp_path: Path, where: str) -> None:
    """A FIFO with no writer where kvstore expects one of its files: every fetch and
    command returns (a clear error or a miss) instead of waiting forever, and
    a FIFO among the pack files is left where it is."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache)
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        s.identity(str(model_path("tiny-llama")))  # writes the digest memo
    target = craft.packs(cache)[0] if where == "pack" else cache / where
    assert target.is_file()
    target.unlink()
    os.mkfifo(target, 0o600)
    got = _fetch_in_new_process(cache, prompts, model=str(model_path("tiny-llama")))
    if where == "index/data.mdb":
        assert got.get("error") == "StoreOpenError" and "data.mdb" in got["message"], got
    else:
        assert got["n"][0] == (0 if where == "pack" else len(prompts[0])), got
    for cmd in (["ls"], ["stats"], ["verify"], ["verify", "--fix", "--blob-age", "0"], ["gc", "--blob-age", "0"]):
        _cli(cache, *cmd)
    if where == "pack":
        assert craft.tree_state(target.parent)[target.name] == "fifo", "a file kvstore did not write was removed"


# -- finding: crafted records with out-of-range fields ----------------------------------


@pytest.mark.parametrize("value", [b"s2", b"0", b"-5", b"99999999999", b"\xff" * 40],
                         ids=["letters", "zero", "negative", "huge", "binary"])
def test_crafted_chunk_size_record_is_refused_clearly(tmp_path: Path, value: bytes) -> None:
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


def test_record_naming_another_entrys_segment_costs_only_itself(tmp_path: Path) -> None:
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
def test_record_with_another_entrys_chunk_list_costs_only_itself(tmp_path: Path, how: str) -> None:
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


def test_refused_index_is_refused_the_same_way_every_time(tmp_path: Path) -> None:
    """An index claiming another format is refused naming the format by a read-only open,
    and again on the next one in the same process; a writable open after them sets it
    aside and opens a new store (issue 52, item 11): the refused open left its environment
    registered, and every later open said the index was "already open read-only in this
    process"."""
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
        for how in ("readonly", "readonly", "write", "store"):
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
    assert ["has format 2" in m for m in got] == [True, True, False, False], got
    assert got[2:] == ["opened", "opened"], got


# -- finding: path traversal (not expressible in format 3) -----------------------------


def test_crafted_records_cannot_reach_outside_blobs(tmp_path: Path) -> None:
    """Records hold 16-byte pack ids, never paths: whatever bytes a crafted record puts
    there (``../../../../etc/``, slashes, NULs), the one path kvstore derives from them is
    ``blobs/<2 hex>/<32 hex>.kvpack``. With such records (and an identity whose path
    climbs out of the cache dir), fetch, ``verify --fix``, ``gc --max-bytes 0
    --missing-models --blob-age 0`` leave every file next to the cache dir as it was."""
    from dataclasses import replace

    from kvstore.files import pack_path
    from kvstore.records import PackRecord, Segment

    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=3)
    before = craft.user_files(tmp_path / "outside", craft.packs(cache))
    ids = [b"../../../../etc/", b"/" * 16, b"\0" * 16]
    for pid in ids:
        assert pack_path(cache / "blobs", pid).parent.parent == cache / "blobs"
    recs = craft.records(cache, "entries")
    for (key, rec), pid in zip(sorted(recs.items()), ids):
        t = rec.tail
        craft.put_raw(cache, "entries", key, replace(rec, tail=Segment(pid, t.offset, t.length, t.checksum)).to_bytes())
        craft.put_raw(cache, "packs", pid, PackRecord(t.length, 1, t.length, 0.0).to_bytes())
    craft.put_raw(cache, "identities", SYN.digest, json.dumps({"name": "x", "path": "../../outside"}).encode())
    assert _fetch_in_new_process(cache, prompts)["n"] == [0, 0, 0]
    _cli(cache, "verify", "--fix", "--blob-age", "0")
    _cli(cache, "gc", "--max-bytes", "0", "--missing-models", "--blob-age", "0")
    assert craft.tree_state(tmp_path / "outside") == before


# -- finding: foreign files, and blobs/ as a symlink ------------------------------------


def test_blobs_symlink_is_refused_and_left_alone(tmp_path: Path) -> None:
    """blobs/ replaced by a symlink to a directory of someone's files laid out as blobs/
    is: KVStore refuses the directory naming blobs/ (LRUPromptCache warns and serves from
    memory), every command refuses it too, and nothing in that directory changes."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=2)
    user = tmp_path / "user-files"
    shutil.copytree(cache / "blobs", user)
    before = craft.user_files(user, [])
    shutil.rmtree(cache / "blobs")
    os.symlink(user, cache / "blobs")
    got = _fetch_in_new_process(cache, prompts)
    assert got.get("error") == "StoreOpenError" and "blobs" in got["message"], got
    lru = run_py("""
        import json, logging, sys
        from kvstore import LRUPromptCache
        seen = []
        Seen = type("Seen", (logging.Handler,), {"emit": lambda s, r: seen.append(r.getMessage())})
        logging.getLogger("kvstore").addHandler(Seen())
        c = LRUPromptCache(cache_dir=json.loads(sys.argv[1]))
        print(json.dumps({"disk": c.store.disk is not None, "warned": seen}))
        c.close()
    """, str(cache))
    assert lru["disk"] is False and any("blobs" in w for w in lru["warned"]), lru
    for cmd in (["ls"], ["verify", "--fix", "--blob-age", "0"], ["gc", "--blob-age", "0"]):
        p = _cli(cache, *cmd)
        assert p.returncode == 1 and "blobs" in p.stderr, (cmd, p.stderr)
    assert craft.tree_state(user) == before and os.path.islink(cache / "blobs")


def test_foreign_files_survive_fetch_verify_fix_and_gc(tmp_path: Path) -> None:
    """Files kvstore did not write, next to its own: ``*.tmp`` files (one named as
    kvstore names its stamp's temp file), a ``sha256-...`` file and directory, copies of
    a pack under pack-like names in the wrong places. After a fetch, ``verify --fix``,
    ``gc`` and ``gc --blob-age 0`` every one is still there, byte-identical, and verify
    reports them as foreign (and nothing else)."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=2)
    pack = craft.packs(cache)[0]
    h, fan = "ab" * 16, pack.parent.name
    wrong = "%02x" % ((int(fan, 16) + 1) % 256)
    planted = {"x.tmp": b"tmp", "index/clean.4242.tmp": b"{}", f"blobs/{fan}/y.kvpack.tmp": b"1",
               f"blobs/sha256-{'0' * 64}": b"model", f"blobs/sha256-{'1' * 8}/data": b"d",
               f"blobs/{wrong}/{fan}{h[2:]}.kvpack": pack.read_bytes(), f"blobs/{h}.kvpack": pack.read_bytes(),
               f"blobs/{fan}/{pack.stem.upper()}.kvpack": pack.read_bytes(), f"{h}.kvpack": b"x"}
    for rel, data in planted.items():
        (cache / rel).parent.mkdir(parents=True, exist_ok=True)
        (cache / rel).write_bytes(data)
    before = {rel: craft.tree_state(cache)[rel] for rel in planted}
    assert _fetch_in_new_process(cache, prompts)["n"] == [len(p) for p in prompts]
    for cmd in (["verify", "--fix", "--blob-age", "0"], ["gc"], ["gc", "--blob-age", "0"]):
        _cli(cache, *cmd)
    after = craft.tree_state(cache)
    assert {rel: after.get(rel) for rel in planted} == before
    report = json.loads(_cli(cache, "verify", "--json").stdout)
    assert report["ok"] and set(report["counts"]) == {"foreign_file"}, report["counts"]
    assert _fetch_in_new_process(cache, prompts)["n"] == [len(p) for p in prompts]


# -- finding: identity descriptions nested without bound, or of the wrong types ---------


@pytest.mark.parametrize("description", ["deep", "types", "huge"])
def test_crafted_identity_description_is_harmless(tmp_path: Path, llama: dict, description: str) -> None:
    """tiny-llama's identity record replaced by JSON nested 100,000 levels deep, by one
    whose fields have the wrong types ("path": 5, "name": [1]), or by 2 MiB of JSON:
    ``ls``, ``stats``, ``inspect`` (decoding the prompt), ``verify``, ``gc
    --missing-models`` finish in time without a traceback (no unbounded recursion), gc
    removes nothing, and a new process still serves the entry (the record only describes
    the identity; the digest comes from the model's files)."""
    cache = tmp_path / "cache"
    mdir = str(model_path("tiny-llama"))
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        s.insert(mdir, llama["prompt"], llama["cache"])
        digest = s.identity(mdir).digest
    value = {"deep": b"[" * 100_000 + b"]" * 100_000,
             "types": json.dumps({"name": [1], "path": 5, "components": "x", "kv_bits": "8"}).encode(),
             "huge": json.dumps({"name": "x" * (2 << 20), "path": mdir}).encode()}[description]
    craft.put_raw(cache, "identities", digest, value)
    key = next(iter(craft.records(cache, "entries"))).hex()
    for cmd in (["ls"], ["ls", "--json"], ["stats"], ["inspect", key], ["verify"]):
        _cli(cache, *cmd)
    _cli(cache, "gc", "--missing-models")
    assert len(craft.records(cache, "entries")) == 1, "gc --missing-models removed the entry"
    got = run_py("""
        import json, sys
        from kvstore import KVStore
        a = json.loads(sys.argv[1])
        with KVStore(a["cache"], chunk_tokens=a["chunk"]) as s:
            print(json.dumps(s.fetch(a["model"], a["prompt"]).n))
    """, {"cache": str(cache), "chunk": CHUNK, "model": mdir, "prompt": llama["prompt"]})
    assert got == len(llama["prompt"])


# -- finding: an ArraysCache layout size in a segment header is allocated ----------------


def test_arrays_cache_size_in_a_header_is_refused_before_allocating(tmp_path: Path, tiny_qwen3next: tuple) -> None:
    """A tiny-qwen3next snapshot rewritten (checksum true, so only the layout check
    stands in the way) with a header whose layout claims an ArraysCache of 20,000,000
    arrays: the restore refuses it before allocating anything, fast, in a new process
    whose memory does not grow; the entry is dropped as damaged."""
    from dataclasses import replace

    cache = tmp_path / "cache"
    model, _ = tiny_qwen3next
    mdir = str(model_path("tiny-qwen3next"))
    prompt = list(range(3, 27))
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        s.insert(mdir, prompt, prefill(model, prompt))
    (key, rec), = craft.records(cache, "entries").items()
    header, body = craft.frame_of(craft.segment_bytes(cache, rec.tail))
    layout = json.loads(header["__metadata__"]["kvstore.layout"])
    assert any(m["class"] == "ArraysCache" for m in layout)
    for m in layout:
        if m["class"] == "ArraysCache":
            m["size"] = 20_000_000
    header["__metadata__"]["kvstore.layout"] = json.dumps(layout)
    (seg,) = craft.new_pack(cache, [craft.reframed(header, body)], rec.created)
    craft.put_raw(cache, "entries", key, replace(rec, tail=seg).to_bytes())
    assert "bad_checksum" not in _cli(cache, "verify").stdout  # a true checksum: the layout is all that is wrong
    got = run_py("""
        import json, resource, sys
        from kvstore import KVStore
        a = json.loads(sys.argv[1])
        with KVStore(a["cache"], chunk_tokens=a["chunk"]) as s:
            s.identity(a["model"])
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            n = s.fetch(a["model"], a["prompt"]).n
            out = {"n": n, "corrupt": s.stats()["corrupt"],
                   "grew": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024}
        print(json.dumps(out))
    """, {"cache": str(cache), "chunk": CHUNK, "model": mdir, "prompt": prompt})
    assert got["n"] == 0 and got["corrupt"] == 1, got
    assert got["grew"] < 64 << 20, got  # nothing sized by the planted claim (20 M positions) was made


# -- finding: a cache directory others can write, or another user's ---------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("case", ["group-writable", "world-writable", "index group-writable", "another user"])
def test_foreign_owner_or_mode_is_refused_naming_the_fix(tmp_path: Path, case: str) -> None:
    """A cache directory (or its index/) others can write, or owned by another user:
    KVStore raises StoreOpenError naming the problem and the fix; LRUPromptCache warns
    and runs memory-only; ``shared_dir=True`` accepts a group-shared or other user's
    directory, never a world-writable one. Nothing is changed by the refusals."""
    cache = tmp_path / "cache"
    _synthetic_store(cache)
    where, fix = {"group-writable": (cache, lambda: os.chmod(cache, 0o770)),
                  "world-writable": (cache, lambda: os.chmod(cache, 0o777)),
                  "index group-writable": (cache / "index", lambda: os.chmod(cache / "index", 0o770)),
                  "another user": (cache, lambda: os.chown(cache, 65534, 65534))}[case]
    fix()
    before = craft.tree_state(cache)
    got = run_module("tests.support.programs.trust_open_ways",
                     {"cache": str(cache), "ways": ["raise", "lru"]})
    assert craft.tree_state(cache) == before, "a refused open changed the directory"
    words = {"group-writable": ("writable by its group", "chmod 700", "shared_dir"),
             "world-writable": ("writable by every user", "chmod 700"),
             "index group-writable": ("writable by its group", "chmod 700"),
             "another user": ("belongs to another user", "shared_dir")}[case]
    assert str(where) in got["raise"] and all(w in got["raise"] for w in words), got["raise"]
    assert got["lru"]["disk"] is False and got["lru"]["warned"], got["lru"]
    shared = run_module("tests.support.programs.trust_open_ways",
                        {"cache": str(cache), "ways": ["shared"]})["shared"]
    if case == "world-writable":
        assert "writable by every user" in shared, shared
    else:
        assert shared == "opened", shared


def test_new_directories_0700_files_0600_under_umask_022(tmp_path: Path) -> None:
    """A store created and used (an insert, a model identity, a clean close) by a
    process whose umask is 022 leaves every directory 0700 and every file 0600: cached
    prompts are readable by nobody else."""
    cache = tmp_path / "new" / "cache"
    got = run_py("""
        import json, os, sys
        os.umask(0o022)
        from kvstore import KVStore
        from kvstore.identity import Identity
        a = json.loads(sys.argv[1])
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache
        c = [KVCache() for _ in range(2)]
        for x in c:
            x.update_and_fetch(mx.ones((1, 2, 70, 8)), mx.ones((1, 2, 70, 8)))
        with KVStore(a["cache"], chunk_tokens=32) as s:
            s.insert(Identity(bytes.fromhex(a["digest"]), a["info"]), list(range(70)), c)
            s.identity(a["model"])
        out = {}
        for d, dirs, files in os.walk(a["cache"]):
            for n in ["."] + dirs + files:
                p = os.path.join(d, n)
                out[os.path.relpath(p, a["cache"])] = oct(os.lstat(p).st_mode & 0o7777)
        print(json.dumps(out))
    """, {"cache": str(cache), "digest": SYN.digest.hex(), "info": SYN.info, "model": str(model_path("tiny-llama"))})
    dirs = {p for p in got if (cache / p).is_dir()}
    assert {"index/data.mdb", "index/lock.mdb", "file-digests.json"} <= set(got) and any(".kvpack" in p for p in got)
    assert {p: m for p, m in got.items() if m != ("0o700" if p in dirs else "0o600")} == {}


# -- finding: a slow writer's pack file removed by gc before its commit ------------------


def test_slow_writer_keeps_its_entry_when_gc_runs_before_its_commit(tmp_path: Path) -> None:
    """A writer whose pack file is written and sealed but not yet named by the index
    while another process runs ``kvstore gc --blob-age 0`` (which removes pack files no
    record names): the gc runs in a real second process at exactly that point (called
    from the writer's PackWriter.seal, after the real seal), removes the file, and the
    entry is committed anyway (the writer checks its file under the index's write lock
    and writes it again), then served by a new process."""
    cache = tmp_path / "cache"
    toks = list(range(2 * CHUNK + 9))
    got = run_py("""
        import json, os, subprocess, sys
        import kvstore.segments as ks
        from kvstore import KVStore
        from kvstore.identity import Identity
        from tests.support.caches import synth_kv_cache
        a = json.loads(sys.argv[1])
        real, gcs = ks.PackWriter.seal, []
        def seal_then_gc(self):
            real(self)
            if not gcs:  # the first pack: sealed, not yet committed
                p = subprocess.run([sys.executable, "-m", "kvstore.cli", "gc", "--blob-age", "0", "--json",
                                    "--cache-dir", a["cache"]], capture_output=True, text=True)
                gcs.append({"rc": p.returncode, "out": json.loads(p.stdout), "gone": not os.path.exists(self.path)})
        ks.PackWriter.seal = seal_then_gc
        with KVStore(a["cache"], chunk_tokens=a["chunk"]) as s:
            ident = Identity(bytes.fromhex(a["digest"]), a["info"])
            s.insert(ident, a["toks"], synth_kv_cache(2, 2, len(a["toks"]), 8))
            s.flush()
            st = s.stats()
        print(json.dumps({"gc": gcs[0], "writes": st["writes"], "write_errors": st["write_errors"]}))
    """, {"cache": str(cache), "chunk": CHUNK, "digest": SYN.digest.hex(), "info": SYN.info, "toks": toks})
    removed = [p for p in got["gc"]["out"]["problems"] if p["kind"] == "orphan_blob" and p["fixed"]]
    assert got["gc"]["rc"] == 0 and removed and got["gc"]["gone"], got["gc"]
    assert (got["writes"], got["write_errors"]) == (1, 0), got
    assert _fetch_in_new_process(cache, [toks])["n"] == [len(toks)], "the slow writer's entry was lost"
    assert _cli(cache, "verify").returncode == 0


# -- finding: timestamps from a skewed clock ---------------------------------------------


def test_future_timestamps_count_as_now(tmp_path: Path) -> None:
    """Records last used ten years from now (another host's clock) are read as used now,
    never later: they sort last in LRU order but cannot outlive an entry used after
    them, ``gc --max-age 1h`` keeps them and removes the entry used two hours ago; an
    orphan pack file whose mtime is a year ahead is removed by ``gc --blob-age 0``."""
    import time
    from dataclasses import replace

    from kvstore.files import pack_path

    cache = tmp_path / "cache"
    _synthetic_store(cache, n=3)
    now = time.time()
    recs = sorted(craft.records(cache, "entries").items(), key=lambda kr: kr[1].created)
    (old, _), (future, _), (recent, _) = recs
    for (key, rec), when in zip(recs, (now - 7200, now + 10 * 365 * 86400, now - 60)):
        craft.put_raw(cache, "entries", key, replace(rec, last_used=when).to_bytes())
    orphan = pack_path(cache / "blobs", os.urandom(16))
    orphan.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(craft.packs(cache)[0], orphan)
    os.utime(orphan, (now + 365 * 86400, now + 365 * 86400))
    got = run_py("""
        import json, sys, time
        from pathlib import Path
        from kvstore.budget import lru_order
        from kvstore.index import scan
        from kvstore.store import open_disk
        disk = open_disk(Path(json.loads(sys.argv[1])), readonly=True)
        t0 = time.time()
        snap = scan(disk.index, full=False)
        out = {"t0": t0, "t1": time.time(), "used": {k.hex(): r.last_used for k, r in snap.entries.items()},
               "order": [k.hex() for k, _ in lru_order(snap.entries.items())]}
        disk.close()
        print(json.dumps(out))
    """, str(cache))
    assert got["t0"] - 1 <= got["used"][future.hex()] <= got["t1"], "a future last use was not read as now"
    assert got["order"] == [old.hex(), recent.hex(), future.hex()]
    _cli(cache, "gc", "--max-age", "1h", "--keep-orphans")
    assert set(craft.records(cache, "entries")) == {future, recent}
    assert os.path.exists(orphan)
    _cli(cache, "gc", "--blob-age", "0")
    assert not os.path.exists(orphan), "an orphan with a future mtime was kept"


# -- finding: warnings about damage are bounded; gc races are not damage -----------------


def test_many_damaged_entries_warn_once(tmp_path: Path) -> None:
    """Twelve entries whose segments are damaged: a process fetching them all logs one
    warning for the kind, counts the other eleven in ``warnings_suppressed`` and the
    twelve in ``corrupt``, and serves none of them."""
    import random

    from kvstore.files import pack_path
    from tools.harness.faults.damage import damage_in_segment

    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=12, length=40)
    for key, rec in craft.records(cache, "entries").items():
        t = rec.tail
        damage_in_segment(pack_path(cache / "blobs", t.pack), t.offset, t.length, "flips", random.Random(key))
    got = run_module("tests.support.programs.trust_watched_fetch",
                     {"cache": str(cache), "digest": SYN.digest.hex(), "info": SYN.info,
                      "prompts": prompts, "chunk": CHUNK})
    assert got["n"] == [0] * 12
    assert (got["stats"]["corrupt"], got["stats"]["warnings_suppressed"]) == (12, 11), got["stats"]
    assert len(got["warned"]) == 1 and "damaged" in got["warned"][0], got["warned"]


def test_entry_removed_by_gc_during_a_fetch_is_a_race_not_damage(tmp_path: Path) -> None:
    """A gc in another process removes an entry (and its pack file) between a fetch's
    lookup and its restore: the miss is counted in ``races``, not ``corrupt``, and
    nothing is logged as damage."""
    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=1)
    got = run_module("tests.support.programs.trust_watched_fetch",
                     {"cache": str(cache), "digest": SYN.digest.hex(), "info": SYN.info,
                      "prompts": prompts, "chunk": CHUNK, "gc_between": True})
    assert got["n"] == [0] and not craft.records(cache, "entries")
    assert (got["stats"]["races"], got["stats"]["corrupt"]) == (1, 0), got["stats"]
    assert not any("damaged" in w for w in got["warned"]), got["warned"]


def test_broken_record_with_a_future_timestamp_is_repaired(tmp_path: Path) -> None:
    """A broken entry record (its token ids no longer hash to its key) that also carries
    a last use in the future: ``verify --fix`` removes it. Timestamps from the future are
    clamped to now each time a record is read, so the record read by verify's scan and
    the one re-read in the repair's transaction never compared equal, and --fix skipped
    it every time as 'rewritten meanwhile' (found by the corruption kind: byte flips
    that hit a timestamp and the token ids)."""
    import time
    from dataclasses import replace

    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=2)
    (key, rec), _ = sorted(craft.records(cache, "entries").items())
    craft.put_raw(cache, "entries", key, replace(rec, last_used=time.time() + 10 * 365 * 86400).to_bytes())
    toks = bytearray(craft.read_raw(cache, "tokens")[key])
    toks[0] ^= 1
    craft.put_raw(cache, "tokens", key, bytes(toks))
    assert "bad_record" in _cli(cache, "verify").stdout
    _cli(cache, "verify", "--fix", "--blob-age", "0")
    left = _cli(cache, "verify")
    assert left.returncode == 0, left.stdout
    assert sorted(_fetch_in_new_process(cache, prompts)["n"]) == [0, len(prompts[0])]


# == issue 20: trust at the edges ==========================================================

# -- 20.1: custom model code (config.json "model_file") is part of the identity -----------


def _custom_model_dir(tmp_path: Path) -> Path:
    """tiny-llama whose architecture comes from a ``model_file`` in its directory (mlx-lm's
    llama.py, imports made absolute), plus a sibling helper module it does not import."""
    import mlx_lm.models.llama as L

    mdir = Path(shutil.copytree(model_path("tiny-llama"), tmp_path / "model"))
    src = re.sub(r"^from \.(\w+) import", r"from mlx_lm.models.\1 import", Path(L.__file__).read_text(), flags=re.M)
    (mdir / "custom_llama.py").write_text(src)
    (mdir / "helpers").mkdir()
    (mdir / "helpers" / "consts.py").write_text("ROPE_SCALE = 1.0\n")
    cfg = json.loads((mdir / "config.json").read_text())
    (mdir / "config.json").write_text(json.dumps({**cfg, "model_file": "custom_llama.py"}))
    return mdir


def _next_token(model, cache, tokens: list[int]) -> int:
    import mlx.core as mx

    return int(mx.argmax(model(mx.array([tokens]), cache=cache)[0, -1]).item())


def test_custom_model_file_edit_is_a_new_identity(tmp_path: Path) -> None:
    """With ``model_file`` (run by mlx-lm under trust_remote_code), one changed constant
    in that file (the RoPE base) is a new identity: the running store notices it, a new
    store restores none of the old code's KV and its next token is the cold prefill's.
    A change to any other .py file of the model directory is a new identity too."""
    from mlx_lm.utils import load_model
    from tools.testing.oracle import make_cache

    mdir = _custom_model_dir(tmp_path)
    prompt = [(37 * i + 11) % 250 + 3 for i in range(N_PROMPT)]
    model = load_model(mdir, trust_remote_code=True)[0]
    with KVStore(tmp_path / "cache", chunk_tokens=CHUNK) as s:
        s.insert(mdir, prompt, prefill(model, prompt))
        s.flush()
        old = s.identity(mdir)
        assert s.fetch(mdir, prompt + [5]).n == len(prompt)
        src = (mdir / "custom_llama.py").read_text()
        (mdir / "custom_llama.py").write_text(src.replace("args.rope_theta,", "args.rope_theta * 4,", 1))
        assert s.identity(mdir) != old, "the running store kept the old code's identity"
        assert s.fetch(mdir, prompt + [5]).n == 0
    new_model = load_model(mdir, trust_remote_code=True)[0]
    with KVStore(tmp_path / "cache", chunk_tokens=CHUNK) as s:
        got = s.fetch(mdir, prompt + [5])
        assert got.n == 0, "a new process restored KV computed by the old model code"
        edited = s.identity(mdir)
    cold = _next_token(new_model, make_cache(new_model), prompt + [5])
    assert _next_token(new_model, got.cache or make_cache(new_model), (prompt + [5])[got.n:]) == cold
    (mdir / "helpers" / "consts.py").write_text("ROPE_SCALE = 2.0\n")
    assert model_identity(mdir).digest != edited.digest


# -- 20.2: the clean stamp needs a check that ran to completion ----------------------------


def _unstamped_store(tmp_path: Path) -> Path:
    """A populated store whose index has no clean stamp: the next open checks it in a child."""
    cache = tmp_path / "cache"
    _synthetic_store(cache, n=2)
    (cache / "index" / "clean").unlink()
    return cache


def _check_children() -> list[int]:
    """Pids of this process's children running the index check (``index.checks._WALK``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"kvstore-open-probe" in cmd:
            out.append(int(d.name))
    return out


def _signal_check_children(sig: int, found: list, stop: Any) -> None:
    """Send ``sig`` to every index-check child this process starts until ``stop`` is set."""
    while not stop.is_set():
        for pid in _check_children():
            if pid not in found:
                os.kill(pid, sig)
                found.append(pid)
        stop.wait(0.005)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP", "cannot start"])
def test_check_that_did_not_complete_leaves_the_index_unstamped(tmp_path: Path, monkeypatch, how: str) -> None:
    """The index check child killed from outside (the OOM killer's SIGKILL), stopped
    (SIGSTOP: it runs into the time limit) or unable to start: the open succeeds, says
    the check did not complete, and leaves no clean stamp (neither at open nor at the
    writer's clean close), so the next open checks again instead of trusting the file."""
    import logging
    import signal
    import threading

    import kvstore.index.checks as checks
    from kvstore.index import Index

    cache = _unstamped_store(tmp_path)
    warned: list[str] = []
    handler = type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.WARNING)
    logging.getLogger("kvstore").addHandler(handler)
    found: list = []
    stop = threading.Event()
    signaller: threading.Thread | None = None
    try:
        monkeypatch.setattr(checks, "CHECK_SECONDS", 3.0)
        if how == "cannot start":
            monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
        else:
            signaller = threading.Thread(target=_signal_check_children, args=(getattr(signal, how), found, stop),
                                         daemon=True)
            signaller.start()
        for _ in range(2):  # and again: never a loop of trusting an unchecked file
            idx = Index(cache)
            assert not (cache / "index" / "clean").exists(), "an unchecked index was stamped clean at open"
            assert idx.counts()["entries"] == 2
            idx.close()
            assert not (cache / "index" / "clean").exists(), "an unchecked index was stamped clean at close"
    finally:
        stop.set()
        if signaller is not None:  # ended before the next open: a late scan must not signal its check child
            signaller.join(timeout=300)
        logging.getLogger("kvstore").removeHandler(handler)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert how == "cannot start" or len(found) == 2, found
    assert sum("did not complete" in w for w in warned) == 2, warned
    monkeypatch.undo()
    idx = Index(cache)  # a check that completes stamps it
    idx.close()
    assert (cache / "index" / "clean").is_file()


# -- 20.3: no name kvstore writes can be planted (FIFO, symlink) --------------------------


def _plant(path: Path, what: str, outside: Path) -> None:
    if os.path.lexists(path):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if what == "fifo":
        os.mkfifo(path, 0o600)
    else:
        os.symlink(outside, path)


def _planted_names() -> list[str]:
    """The fixed names of ``cachedir.CREATED`` (a "*" part is random when created)."""
    from kvstore.cachedir import CREATED

    return [n.rstrip("/") for n in CREATED if "*" not in n]


@pytest.mark.parametrize("what", ["fifo", "symlink"])
def test_planted_fifo_or_symlink_at_every_written_name(tmp_path: Path, what: str) -> None:
    """A FIFO or a symlink (to a file outside) at each name kvstore writes, and FIFOs at
    the temp names earlier versions used (``<name>.<pid>.tmp`` for the next pids): a new
    process opening the store, inserting, resolving a model identity (the digest memo),
    marking the index damaged and closing never hangs and never writes outside."""
    outside = tmp_path / "outside.txt"
    outside.write_text("someone's file")
    base = _unstamped_store(tmp_path)
    caches = {}
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())  # the one child below, and its index checks
    for name in _planted_names():
        cache = caches[name] = tmp_path / f"c-{name.replace('/', '_')}"
        shutil.copytree(base, cache, symlinks=True)
        _plant(cache / name, what, outside)
        for rel in ("index/clean", "index/damaged", "file-digests.json"):
            for pid in range(last + 1, last + 150):
                if (cache / rel).parent.is_dir() and not (cache / rel).parent.is_symlink():
                    os.mkfifo(cache / f"{rel}.{pid}.tmp", 0o600)
    # One child for every name (one Python + MLX start-up, not one per name): it says on
    # stderr which name it starts, so a hang (faulthandler ends it, or the timeout) names it.
    try:
        results = run_py("""
            import faulthandler, json, sys
            from kvstore import KVStore, StoreOpenError
            a = json.loads(sys.argv[1])
            faulthandler.dump_traceback_later(a["timeout"], exit=True)
            results = {}
            for name, cache in a["caches"].items():
                print(f"planted {name}", file=sys.stderr, flush=True)
                try:
                    with KVStore(cache, chunk_tokens=a["chunk"]) as s:
                        s.identity(a["model"])
                        if s.disk is not None:
                            s.disk.index.mark_damaged("test")
                    got = {"opened": True}
                except StoreOpenError as e:
                    got = {"refused": str(e)}
                with open(a["outside"]) as f:
                    got["outside"] = f.read()
                results[name] = got
            print(json.dumps(results))
        """, {"caches": {n: str(c) for n, c in caches.items()}, "chunk": CHUNK, "outside": str(outside),
              "model": str(model_path("tiny-llama")), "timeout": 600}, timeout=900)
    except subprocess.TimeoutExpired:
        results = {"(the child)": {"hung": True}}
    changed = [n for n, r in results.items() if r.get("outside", "someone's file") != "someone's file"]
    assert outside.read_text() == "someone's file" and not changed, f"wrote through a planted {what} at {changed}"
    assert {n: r for n, r in results.items() if "hung" in r} == {}, results
    assert {n: r for n, r in results.items() if "refused" in r and n not in
            ("index", "blobs", "index/data.mdb", "index/lock.mdb")} == {}, results


# -- 20.5: terminal injection through stored prompts and names ------------------------------

_EVIL = "\x1b]52;c;aGVsbG8=\x07\x1b]0;owned\x07\x1b[2J\x1b[Hfake output\x9b31m"


def test_control_characters_in_prompts_and_names_are_shown_escaped(tmp_path: Path) -> None:
    """A stored prompt holding OSC 52 (clipboard), OSC 0 (window title), a screen clear and
    a C1 CSI, under a model whose recorded name holds them too: ``inspect`` (head and
    --prompt), ``ls`` and ``stats`` print them as escapes, and ``--json`` keeps them exact;
    a kvstore log record shows them escaped, on one line."""
    import logging

    from transformers import AutoTokenizer

    mdir = model_path("tiny-llama")
    tok = AutoTokenizer.from_pretrained(str(mdir), local_files_only=True)
    text = "hello " + _EVIL + " bye"
    ids = tok.encode(text)
    assert tok.decode(ids) == text  # the byte-level tokenizer round-trips every control
    ident = Identity.from_components({"test": "esc", "layout": layout_of(synth_kv_cache(2, 2, 1, 8))},
                                     name="evil" + _EVIL, path=str(mdir), model_type="llama" + _EVIL)
    cache = tmp_path / "cache"
    with KVStore(cache, chunk_tokens=CHUNK) as s:
        s.register(ident.digest, ident)
        s.insert(ident, ids, synth_kv_cache(2, 2, len(ids), 8))
        s.flush()
    entry = json.loads(_cli(cache, "ls", "--json").stdout)["identities"][0]["entries"][0]["id"]
    for args in (["inspect", entry], ["inspect", entry, "--prompt"], ["ls"], ["stats"]):
        p = _cli(cache, *args)
        shown = p.stdout + p.stderr
        assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", shown), (args, shown)
        assert "\\x1b]52;c;aGVsbG8=\\x07" in p.stdout, (args, p.stdout)
    got = json.loads(_cli(cache, "inspect", entry, "--prompt", "--json").stdout)
    assert got["prompt"] == text and got["model"]["name"] == "evil" + _EVIL
    (cache / "blobs" / ("planted" + _EVIL)).write_text("x")  # a file name verify reports
    p = _cli(cache, "verify")
    assert "planted\\x1b]52;c;" in p.stdout and not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", p.stdout + p.stderr)
    seen: list[str] = []
    handler = type("H", (logging.Handler,), {"emit": lambda s, r: seen.append(s.format(r))})()
    logging.getLogger("kvstore").addHandler(handler)
    try:
        logging.getLogger("kvstore").warning("kvstore: no identity for model %s", "m\n" + _EVIL)
    finally:
        logging.getLogger("kvstore").removeHandler(handler)
    assert seen == ["kvstore: no identity for model m\\x0a" + _EVIL.replace("\x1b", "\\x1b").replace(
        "\x07", "\\x07").replace("\x9b", "\\x9b")], seen


# -- 20.4: a directory shared by a group works for every member -----------------------------

_MEMBER = """
import json, logging, os, sys
a = json.loads(sys.argv[1])
os.umask(0o022)  # the members' own umask must not lock the others out
warned = []
logging.getLogger("kvstore").addHandler(
    type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.WARNING))
from kvstore import KVStore
from kvstore.identity import Identity
from tests.support.caches import synth_kv_cache
ident = Identity(bytes.fromhex(a["digest"]), a["info"])
out = {"uid": os.getuid()}
with KVStore(a["cache"], chunk_tokens=a["chunk"], shared_dir=True, on_disk_error="memory") as s:
    out["disk"] = s.disk is not None
    out["model"] = s.identity(a["model"]) is not None
    out["got"] = [s.fetch(ident, t).n for t in a["fetch"]]
    for i, t in enumerate(a["insert"]):
        s.insert(ident, t, synth_kv_cache(2, 2, len(t), 8, seed=i))
        s.flush()
    if a.get("rebuild") and s.disk is not None:
        from kvstore.maintenance.fsck import rebuild_index
        out["rebuild"] = rebuild_index(s.disk)
out["warned"] = warned
print(json.dumps(out))
"""


def _as_member(uid: int, payload: dict) -> dict:
    """Run ``_MEMBER`` as ``uid`` with the group as its only group (a real second user)."""
    from tools.harness.faults.kinds.permissions import member_preexec

    p = subprocess.run([sys.executable, "-c", _MEMBER, json.dumps(payload)], capture_output=True, text=True,
                       timeout=300, env=child_env(HOME="/tmp"), cwd="/", preexec_fn=member_preexec(uid))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture
def group_dir() -> Any:
    """A ``--shared-dir`` directory of the group (root's, 2770) under a fresh /tmp
    directory the members can reach, and a copy of tiny-llama they can read: (cache dir,
    the payload fields every member run shares). Root only."""
    import tempfile

    from tools.harness.faults.kinds.permissions import GROUP, searchable_by_others

    if os.geteuid() != 0:
        pytest.skip("running as two other users needs root")
    base = Path(tempfile.mkdtemp(prefix="kvshared-", dir="/tmp"))
    changed = searchable_by_others([ROOT, Path(sys.prefix), Path(sys.base_prefix), base])
    try:
        mdir = Path(shutil.copytree(model_path("tiny-llama"), base / "model"))
        subprocess.run(["chmod", "-R", "a+rX", str(mdir)], check=True)
        cache = base / "shared"
        cache.mkdir()
        os.chown(cache, 0, GROUP)
        os.chmod(cache, 0o2770)
        yield cache, {"cache": str(cache), "chunk": CHUNK, "digest": SYN.digest.hex(), "info": SYN.info,
                      "model": str(mdir)}
    finally:
        for d, mode in reversed(changed):
            os.chmod(d, mode)
        shutil.rmtree(base, ignore_errors=True)


def test_two_members_of_a_group_share_a_directory(group_dir: Any) -> None:
    """Two uids of one group, each with umask 022, on a ``--shared-dir`` directory: each
    reads the other's entries and adds its own, each resolves a model identity through
    the digest memo the other wrote, and after one of them rebuilds the index (what
    ``verify --fix`` does) the other still can: no warning, no memory-only fallback.
    Every file is 0660 and every directory 2770, all of the directory's group."""
    from tools.harness.faults.kinds.permissions import GROUP, MEMBERS

    cache, common = group_dir
    prompts = [[(7 * i + j) % 200 for j in range(100)] for i in range(4)]
    a = _as_member(MEMBERS[0], {**common, "fetch": [], "insert": prompts[:2]})
    b = _as_member(MEMBERS[1], {**common, "fetch": prompts[:2], "insert": prompts[2:], "rebuild": True})
    a2 = _as_member(MEMBERS[0], {**common, "fetch": prompts, "insert": []})
    for r in (a, b, a2):
        assert r["disk"] and r["model"] and r["warned"] == [], r
    assert b["got"] == [100, 100] and a2["got"] == [100] * 4, (b, a2)
    modes = {}
    for d, dirs, files in os.walk(cache):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            modes[os.path.relpath(os.path.join(d, n), cache)] = (oct(st.st_mode & 0o7777), st.st_gid)
    bad = {p: m for p, m in modes.items() if m != (("0o2770" if os.path.isdir(cache / p) else "0o660"), GROUP)}
    assert bad == {} and "file-digests.json" in modes, bad


def test_a_member_locked_out_of_a_file_is_told_which_and_how_to_fix_it(group_dir: Any) -> None:
    """A shared directory where one file is its creator's alone (0600, as earlier versions
    made the digest memo, or the index data file after a chmod): another member gets a
    warning (memo: the identity still resolves, the disk tier still serves) or a refusal
    (data.mdb) naming the file and the ``chmod`` that fixes it, never a silent fallback."""
    from tools.harness.faults.kinds.permissions import MEMBERS

    cache, common = group_dir
    prompts = [[(7 * i + j) % 200 for j in range(100)] for i in range(2)]
    _as_member(MEMBERS[0], {**common, "fetch": [], "insert": prompts})
    os.chmod(cache / "file-digests.json", 0o600)
    b = _as_member(MEMBERS[1], {**common, "fetch": prompts, "insert": []})
    assert b["disk"] and b["model"] and b["got"] == [100, 100], b
    assert any("file-digests.json" in w and "chmod g+rw" in w for w in b["warned"]), b["warned"]
    os.chmod(cache / "index" / "data.mdb", 0o600)
    b = _as_member(MEMBERS[1], {**common, "fetch": prompts, "insert": []})
    assert not b["disk"], b
    assert any("data.mdb" in w and "chmod" in w and "g+rw" in w for w in b["warned"]), b["warned"]


# -- 20.6: the same classes elsewhere -----------------------------------------------------


def test_fifo_swapped_in_for_the_data_file_never_blocks_a_close(tmp_path: Path) -> None:
    """data.mdb replaced by a FIFO while a writer has the index open: its clean close
    (which reads the data file's meta pages to stamp it) neither blocks nor stamps."""
    cache = tmp_path / "cache"
    _synthetic_store(cache)
    got = run_py("""
        import json, os, sys
        from kvstore.index import Index
        a = json.loads(sys.argv[1])
        idx = Index(a["cache"])
        data = os.path.join(a["cache"], "index", "data.mdb")
        os.replace(data, data + ".real")
        os.mkfifo(data)
        idx.close()
        print(json.dumps({"stamp": os.path.exists(os.path.join(a["cache"], "index", "clean"))}))
    """, {"cache": str(cache)}, timeout=60)
    assert got == {"stamp": False}


def test_fifo_among_the_tokenizer_files_never_blocks_the_identity(tmp_path: Path) -> None:
    """A FIFO named like a tokenizer file in the model directory (hashed into the
    identity): resolving the identity fails at once (no identity, said once) instead of
    waiting for a writer forever."""
    mdir = Path(shutil.copytree(model_path("tiny-llama"), tmp_path / "model"))
    os.mkfifo(mdir / "vocab.json")
    got = run_py("""
        import json, sys
        from kvstore import KVStore
        a = json.loads(sys.argv[1])
        with KVStore(a["cache"]) as s:
            print(json.dumps({"identity": s.identity(a["model"]) is not None}))
    """, {"cache": str(tmp_path / "cache"), "model": str(mdir)}, timeout=120)
    assert got == {"identity": False}


def test_repair_names_cannot_be_planted_in_advance(tmp_path: Path) -> None:
    """Directories planted at every name the index repair would have used in the next
    minute (``index.corrupt-<time>``, ``index.rebuild-<time>-<pid>``) do not stop it:
    the rebuilt index opens, keeps every entry, and the planted directories are untouched."""
    import time

    from kvstore.cachedir import open_disk
    from kvstore.maintenance.fsck import rebuild_index

    cache = tmp_path / "cache"
    prompts = _synthetic_store(cache, n=3)
    now, pid = int(time.time()), os.getpid()
    planted = [cache / f"index.corrupt-{t}" for t in range(now, now + 60)]
    planted += [cache / f"index.rebuild-{t}-{pid}" for t in range(now, now + 60)]
    for d in planted:
        (d / "someone").mkdir(parents=True)
    disk = open_disk(cache)
    try:
        rebuild_index(disk)
        assert disk.index.counts()["entries"] == 3
    finally:
        disk.close()
    assert all((d / "someone").is_dir() for d in planted)
    assert _fetch_in_new_process(cache, prompts)["n"] == [100] * 3
