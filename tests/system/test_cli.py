"""The ``kvstore`` command line, run as real subprocesses on real stores.

A template store is built once per module with the real KVStore on tiny-llama (chunk 64, so
entries span several chunks and two of them share a prefix), plus entries of a second
identity whose model directory does not exist. Each test copies it and runs
``python -m kvstore.cli ...`` against the copy; fetches that check a command's effect run in
a fresh process too, and hits are checked with the restored-equals-cold oracle.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.support import ROOT
from tests.support.children import child_env, run_module
from tests.support.stores import SegRef, damage_segment

CHUNK = 64
DAY = 86400.0
GONE_COMPONENTS = {"weights": "a model that was deleted", "layout": [{"class": "KVCache"}] * 3}


def cli(*args: Any, cache_dir: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvstore.cli", *map(str, args)]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=str(ROOT))


def cli_json(*args: Any, cache_dir: Path, code: int = 0) -> Any:
    p = cli(*args, "--json", cache_dir=cache_dir)
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    return json.loads(p.stdout)


def main_text(*args: Any, cache_dir: Path, code: int = 0) -> str:
    """The same command in this process (quicker; the subprocess runs cover the entry point)."""
    import contextlib
    import io

    from kvstore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*map(str, args), "--cache-dir", str(cache_dir)])
    assert rc == code, (rc, out.getvalue(), err.getvalue())
    return out.getvalue()


def main_json(*args: Any, cache_dir: Path, code: int = 0) -> Any:
    return json.loads(main_text(*args, "--json", cache_dir=cache_dir, code=code))


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_llama) -> dict[str, Any]:
    """The template store and what is in it."""
    from tests.support.prompts import text_prompt
    from kvstore import Identity, KVStore
    from kvstore.disk import DiskTier
    from kvstore.keys import encode_tokens, key_of, root_key
    from tools.testing.model_builds import model_path
    from tools.testing.oracle import prefill

    model, tok = tiny_llama
    mdir = model_path("tiny-llama")
    base = tmp_path_factory.mktemp("cli-template")
    gone_path = str(base / "gone-model")  # never created
    a = text_prompt(tok, 300, seed=1)
    prompts = {
        "A": a,
        "A2": a + text_prompt(tok, 80, seed=2),   # shares A's 4 full chunks
        "B": text_prompt(tok, 250, seed=3),
        "C": text_prompt(tok, 200, seed=4),
        "E": text_prompt(tok, 280, seed=5),
        "D": text_prompt(tok, 150, seed=6),       # stored under the "gone" identity
    }
    gone = Identity.from_components(GONE_COMPONENTS, name="gone-model", path=gone_path, model_type="llama")
    cache_dir = base / "cache"
    store = KVStore(cache_dir, chunk_tokens=CHUNK)
    store.register(gone.digest, gone)
    idents = {}
    for name, toks in prompts.items():
        who = gone if name == "D" else mdir
        store.insert(who, toks, prefill(model, toks), cache_type="system")
        idents[name] = store.identity(who)
    store.close()
    keys = {n: key_of(root_key(idents[n].digest), encode_tokens(t), CHUNK).hex() for n, t in prompts.items()}
    now = time.time()
    # last use: A 10 days ago, E 20 days ago but pinned, the rest recent (B oldest of those)
    used = {"A": now - 10 * DAY, "E": now - 20 * DAY, "B": now - 3600, "C": now - 60,
            "A2": now - 30, "D": now - 120}
    disk = DiskTier(cache_dir)
    for n, k in keys.items():
        key = bytes.fromhex(k)
        disk.index.transact(lambda t, key=key, n=n: t.set_entry(
            key, replace(t.entry(key), last_used=used[n], pinned=(n == "E"))))
    disk.close()
    return {"dir": cache_dir, "prompts": prompts, "keys": keys, "model_dir": mdir,
            "ident": idents["A"].hex, "gone_ident": gone.hex, "gone_path": gone_path, "tok": tok,
            "model": model}


@pytest.fixture
def store_dir(built, tmp_path) -> Path:
    d = tmp_path / "cache"
    shutil.copytree(built["dir"], d)
    return d


def fetch_all(built, cache_dir: Path, names=None) -> dict[str, dict]:
    prompts = {n: t for n, t in built["prompts"].items() if names is None or n in names}
    # a new process opens the store, fetches every prompt (plus a short user turn) and
    # checks each hit with the oracle
    return run_module("tests.support.programs.cli_fetch",
                      {"cache_dir": str(cache_dir), "prompts": prompts, "gone": ["D"],
                       "gone_components": GONE_COMPONENTS, "gone_path": built["gone_path"],
                       "model_dir": str(built["model_dir"]), "suffix": [10, 72, 105, 33, 10]},
                      timeout=300)


def files_snapshot(cache_dir: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for p in sorted(cache_dir.rglob("*")):
        if p.is_file() and p.name != "lock.mdb":
            out[str(p.relative_to(cache_dir))] = (p.stat().st_size, xxhash.xxh3_128_hexdigest(p.read_bytes()))
    return out


def segment_of(cache_dir: Path, key_hex: str, chunk: int | None = None) -> SegRef:
    """An entry's own segment (its tail) or its ``chunk``-th chunk's."""
    from kvstore.files import pack_path
    from kvstore.disk import DiskTier

    disk = DiskTier(cache_dir, readonly=True)
    try:
        rec = disk.index.entry(bytes.fromhex(key_hex))
        seg = rec.tail if chunk is None else disk.index.chunk(rec.chunks[chunk]).segment
        return SegRef(pack_path(disk.blob_root, seg.pack), seg.offset, seg.length)
    finally:
        disk.close()


# ----------------------------------------------------------------------------- ls / stats / inspect


def test_ls_groups_by_identity(built, store_dir):
    p = cli("ls", cache_dir=store_dir)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    print(out)
    assert "tiny-llama" in out and "gone-model" in out and "(missing)" in out
    assert "float32" in out
    for k in built["keys"].values():
        assert k[:12] in out
    assert "6 entries, 2 identities" in out

    data = cli_json("ls", cache_dir=store_dir)
    groups = {g["name"]: g for g in data["identities"]}
    assert set(groups) == {"tiny-llama-v1", "gone-model"} or set(groups) >= {"gone-model"}
    gone = groups["gone-model"]
    assert gone["identity"] == built["gone_ident"] and gone["model_present"] is False
    assert [e["key"] for e in gone["entries"]] == [built["keys"]["D"]]
    llama = next(g for g in data["identities"] if g["identity"] == built["ident"])
    assert llama["model_present"] is True and llama["kv_dtype"] == "float32"
    by_key = {e["key"]: e for e in llama["entries"]}
    assert set(by_key) == {built["keys"][n] for n in "A A2 B C E".split()}
    a, a2, e = by_key[built["keys"]["A"]], by_key[built["keys"]["A2"]], by_key[built["keys"]["E"]]
    assert a["tokens"] == 300 and a["chunks"] == 4 and a2["chunks"] == 5 and a2["tokens"] == 380
    assert e["pinned"] is True and a["pinned"] is False
    # size = own blob + chunks; A2's chunks include A's four
    assert a["bytes"] > a["own_bytes"] > 0 and a2["bytes"] > a["bytes"]
    assert sum(x["bytes"] for g in data["identities"] for x in g["entries"]) > data["total_bytes"]
    assert all(x["id"] == x["key"][:12] for x in llama["entries"])


def test_stats(built, store_dir):
    from kvstore.disk import DiskTier

    p = cli("stats", cache_dir=store_dir)
    assert p.returncode == 0, p.stderr
    print(p.stdout)
    for word in ("disk tier", "6 entries", "index bytes", "blob bytes", "free space", "memory tier", "per process"):
        assert word in p.stdout
    s = cli_json("stats", cache_dir=store_dir)
    disk = DiskTier(store_dir, readonly=True)
    try:
        counts, total = disk.index.counts(), disk.index.total_bytes()
        from kvstore.index import scan

        hits = sum(r.hits for r in scan(disk.index, full=False).entries.values())
    finally:
        disk.close()
    d = s["disk"]
    assert (d["entries"], d["chunks"], d["identities"]) == (counts["entries"], counts["chunks"], 2)
    assert d["blob_bytes"] == total == d["blob_bytes_on_disk"] == d["live_bytes"]
    assert d["index_bytes"] == (store_dir / "index" / "data.mdb").stat().st_size
    assert s["hits"] == hits and d["pinned"] == 1 and s["chunk_tokens"] == CHUNK
    assert s["memory"] is None and "per" in s["memory_note"]
    assert 0 < s["filesystem"]["free_bytes"] <= s["filesystem"]["total_bytes"]
    by = {r["identity"]: r for r in s["by_identity"]}
    assert by[built["gone_ident"]]["entries"] == 1 and by[built["ident"]]["entries"] == 5
    assert sum(r["bytes"] for r in s["by_identity"]) == total


def test_inspect(built, store_dir):
    key = built["keys"]["A2"]
    toks = built["prompts"]["A2"]
    head, text = built["tok"].decode(toks[:32]), built["tok"].decode(toks)
    assert len(text) > len(head) + 100
    # by default: token counts and the first 32 tokens' text, never the rest of the prompt
    p = cli("inspect", key[:7], cache_dir=store_dir)
    assert p.returncode == 0, p.stderr
    assert "tokens      380" in p.stdout and "first 32 of 380 tokens" in p.stdout and "--prompt" in p.stdout
    assert head in p.stdout and text[-60:] not in p.stdout
    assert "KVCache" in p.stdout and "float32" in p.stdout
    info = cli_json("inspect", key[:9], cache_dir=store_dir)
    assert info["key"] == key and info["tokens"] == 380
    assert info["prompt_head"] == head and info["prompt_head_tokens"] == 32 and info["prompt"] is None
    assert text[-60:] not in json.dumps(info)
    # --prompt: the whole prompt, in the text and in the JSON
    p = cli("inspect", key[:7], "--prompt", cache_dir=store_dir)
    assert p.returncode == 0 and text in p.stdout and "all 380 tokens" in p.stdout, p.stdout + p.stderr
    assert main_json("inspect", key[:9], "--prompt", cache_dir=store_dir)["prompt"] == text
    assert [pc["piece"] for pc in info["pieces"]] == ["chunk"] * 5 + ["tail"]
    assert info["pieces"][-1]["tokens"] == [320, 380]
    assert all(pc["state"] == "ok" for pc in info["pieces"]) and info["blobs_ok"]
    assert info["checksums_checked"] is False and info["checksums_ok"] is None
    assert [pc["refs"] for pc in info["pieces"][:5]] == [2, 2, 2, 2, 1]
    assert [m["class"] for m in info["layers"]] == ["KVCache"] * 3 and info["kv_dtype"] == "float32"
    assert info["bytes"] == sum(pc["bytes"] for pc in info["pieces"])
    assert main_json("inspect", key[:9], "--verify", cache_dir=store_dir)["checksums_ok"] is True
    # a damaged chunk: inspect reads headers and records only (fast on a long entry);
    # --verify reads every byte and shows it in the checksum column and the exit code
    damage_segment(segment_of(store_dir, key, chunk=4), "flip")
    assert main_json("inspect", key[:12], "--no-prompt", cache_dir=store_dir)["blobs_ok"] is True
    bad = main_json("inspect", key[:12], "--no-prompt", "--verify", cache_dir=store_dir, code=1)
    assert [pc["state"] for pc in bad["pieces"]] == ["ok"] * 4 + ["bad_checksum", "ok"]
    assert bad["checksums_ok"] is False and "CHECKSUM" in main_text("inspect", key[:12], "--verify",
                                                                       cache_dir=store_dir, code=1)
    # the gone model: no tokenizer, said softly
    gone = main_json("inspect", built["keys"]["D"][:12], cache_dir=store_dir)
    assert gone["prompt"] is None and gone["prompt_head"] is None and "no longer exists" in gone["prompt_error"]
    assert "prompt      150 tokens (not decoded: model directory" in main_text("inspect", built["keys"]["D"][:12],
                                                                              cache_dir=store_dir)


def test_entry_prefix_errors(built, store_dir, capsys):
    from kvstore.cli import main

    assert main(["inspect", "zz", "--cache-dir", str(store_dir)]) == 1
    assert "hex prefix" in capsys.readouterr().err
    missing = next(c for c in "0123456789abcdef" if not any(k.startswith(c) for k in built["keys"].values()))
    assert main(["pin", missing, "--cache-dir", str(store_dir)]) == 1
    assert "no entry matches" in capsys.readouterr().err
    assert main(["inspect", "", "--cache-dir", str(store_dir)]) == 1
    capsys.readouterr()
    # A and A2 share no key prefix necessarily; an ambiguous one-char prefix among 6 keys may exist
    firsts = [k[0] for k in built["keys"].values()]
    dup = next((c for c in firsts if firsts.count(c) > 1), None)
    if dup is not None:
        assert main(["inspect", dup, "--cache-dir", str(store_dir)]) == 1
        assert "several entries" in capsys.readouterr().err


def test_missing_cache_dir_and_usage_errors(tmp_path, capsys):
    nothere = tmp_path / "nothere"
    p = cli("ls", cache_dir=nothere)
    assert p.returncode == 1 and "does not exist" in p.stderr and "--cache-dir" in p.stderr
    assert not nothere.exists()
    from kvstore.cli import main

    for cmd in (["stats"], ["inspect", "ab"], ["verify"], ["gc", "--dry-run"], ["pin", "ab"], ["verify", "--fix"]):
        assert main([*cmd, "--cache-dir", str(nothere)]) == 1, cmd
        assert "does not exist" in capsys.readouterr().err
    assert not nothere.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["ls", "--cache-dir", str(empty)]) == 1
    assert "not a kvstore cache directory" in capsys.readouterr().err
    assert list(empty.iterdir()) == []
    assert main(["gc", "--max-bytes", "ten", "--cache-dir", str(empty)]) == 2
    assert "invalid size" in capsys.readouterr().err
    assert main(["gc", "--max-age", "7x", "--cache-dir", str(empty)]) == 2
    assert main(["frobnicate"]) == 2
    assert main([]) == 2
    assert main(["--help"]) == 0


def test_missing_command_module_breaks_nothing(monkeypatch, built, store_dir, capsys):
    import importlib

    m = importlib.import_module("kvstore.cli.main")  # the module (kvstore.cli.main is also the function)
    monkeypatch.setitem(m.COMMANDS, "nosuch", ("nosuch_module", "a command that is not installed"))
    assert m.main(["nosuch"]) == 1
    assert "not available" in capsys.readouterr().err
    assert m.main(["ls", "--cache-dir", str(store_dir)]) == 0
    assert built["keys"]["A"][:12] in capsys.readouterr().out


# ----------------------------------------------------------------------------- pin


def test_pin_unpin(built, store_dir):
    from kvstore.disk import DiskTier

    a, e = built["keys"]["A"], built["keys"]["E"]
    p = cli("pin", a[:10], cache_dir=store_dir)
    assert p.returncode == 0 and f"pinned {a[:12]}" in p.stdout, p.stderr
    p = cli("unpin", e[:10], cache_dir=store_dir)
    assert p.returncode == 0 and f"unpinned {e[:12]}" in p.stdout, p.stderr
    disk = DiskTier(store_dir, readonly=True)
    try:
        assert disk.index.entry(bytes.fromhex(a)).pinned is True
        assert disk.index.entry(bytes.fromhex(e)).pinned is False
    finally:
        disk.close()
    # the pin is what --max-age honours: A (10 days) stays, E (20 days, now unpinned) goes
    res = main_json("gc", "--max-age", "2d", cache_dir=store_dir)
    assert [r["key"] for r in res["removed"]] == [e]


# ----------------------------------------------------------------------------- verify


def _inject_faults(built, d: Path) -> dict[str, Any]:
    """One of each fault kind; returns what was damaged."""
    from kvstore.disk import DiskTier

    keys = built["keys"]
    damage_segment(segment_of(d, keys["B"]), "flip")            # B's tail: one flipped bit
    damage_segment(segment_of(d, keys["C"], chunk=1), "truncate")  # C's pack cut inside chunk 1
    damage_segment(segment_of(d, keys["D"]), "delete")          # D's pack: deleted
    src = segment_of(d, keys["A"], chunk=0).path                # a stray copy nobody names
    orphan = d / "blobs" / "ee" / ("ee" * 16 + ".kvpack")
    orphan.parent.mkdir(exist_ok=True)
    shutil.copy(src, orphan)
    (src.parent / (src.name + ".4242.deadbeef.tmp")).write_bytes(b"partial")  # not kvstore's
    disk = DiskTier(d)                                          # A2's own 5th chunk record: gone
    try:
        ck = disk.index.entry(bytes.fromhex(keys["A2"])).chunks[4]
        disk.index.transact(lambda t: t.delete_raw("chunks", ck))
    finally:
        disk.close()
    return {"intact": ["A", "E"], "broken": ["A2", "B", "C", "D"]}


def test_verify_detects_each_fault_and_fix_repairs(built, store_dir):
    assert main_json("verify", cache_dir=store_dir)["ok"]
    faults = _inject_faults(built, store_dir)
    keys = built["keys"]

    p = cli("verify", "--blob-age", "0", cache_dir=store_dir)
    assert p.returncode == 1 and "kvstore verify --fix" in p.stdout
    print(p.stdout)
    rep = main_json("verify", "--blob-age", "0", cache_dir=store_dir, code=1)
    kinds: dict[str, list[dict]] = {}
    for prob in rep["problems"]:
        kinds.setdefault(prob["kind"], []).append(prob)
    assert {"bad_checksum", "truncated", "missing_blob", "orphan_blob", "foreign_file", "missing_chunk",
            "dangling_bound"} <= set(kinds), sorted(kinds)
    entry_keys = lambda kind: [p["key"] for p in kinds[kind] if p["record"] == "entry"]  # noqa: E731
    assert entry_keys("bad_checksum") == [keys["B"]]
    assert entry_keys("missing_blob") == [keys["D"]] and entry_keys("missing_chunk") == [keys["A2"]]
    assert entry_keys("truncated") == [keys["C"]]  # and C's chunks: the whole pack is suspect
    assert any("ee" * 16 in p["path"] for p in kinds["orphan_blob"])
    assert [p["path"].endswith(".tmp") for p in kinds["foreign_file"]] == [True]
    # the default grace period keeps young files out of it (a live writer's pack)
    young = main_json("verify", cache_dir=store_dir, code=1)
    assert not [p for p in young["problems"] if "ee" * 16 in (p["path"] or "")]

    fixed = cli_json("verify", "--fix", "--blob-age", "0", cache_dir=store_dir)
    assert fixed["ok"] and all(p["fixed"] for p in fixed["problems"] if p["kind"] != "foreign_file")
    again = cli("verify", "--blob-age", "0", cache_dir=store_dir)
    assert again.returncode == 0 and again.stdout.startswith("ok:"), again.stdout
    assert "left alone" in again.stdout  # the file kvstore did not write is reported, never touched

    got = fetch_all(built, store_dir)
    for name in faults["intact"]:
        assert got[name]["n"] == len(built["prompts"][name]) and got[name]["source"] == "disk", (name, got)
        assert got[name]["oracle"] is True, (name, got)
    for name in faults["broken"]:  # gone, or (A2) only its intact shared prefix
        assert got[name]["n"] < len(built["prompts"][name]), (name, got)
        assert got[name]["oracle"] in (None, True), (name, got)
    assert got["A2"]["n"] == 300  # A's chunks + tail survive A2's removal


# ----------------------------------------------------------------------------- gc


def test_gc_dry_run_changes_nothing(built, store_dir):
    _inject_faults(built, store_dir)
    before = files_snapshot(store_dir)
    res = cli_json("gc", "--dry-run", "--max-bytes", "1B", "--max-age", "1s", "--missing-models",
                   "--include-pinned", "--blob-age", "0", cache_dir=store_dir)
    assert res["dry_run"] is True
    assert {r["key"] for r in res["removed"]} == set(built["keys"].values())
    assert res["removed"][-1]["pinned"] is True  # pinned last
    assert res["freed_bytes"] > 0
    assert {"orphan_blob", "foreign_file"} <= {p["kind"] for p in res["problems"]}
    # every entry would go; broken records make the projected bytes an upper bound
    assert res["entries_left"] == 0 and res["blob_bytes_left_exact"] is False
    text = main_text("gc", "--dry-run", "--max-bytes", "1B", "--blob-age", "0", cache_dir=store_dir)
    assert "would remove" in text and "nothing changed" in text
    assert files_snapshot(store_dir) == before


def test_gc_dry_run_totals_are_what_the_real_run_leaves(built, store_dir):
    """--dry-run's blob_bytes_left / entries_left are the totals after the run it
    describes (not today's), and match what the same gc then leaves."""
    from kvstore.disk import DiskTier

    disk = DiskTier(store_dir, readonly=True)
    try:
        before, n_before = disk.index.total_bytes(), disk.index.counts()["entries"]
    finally:
        disk.close()
    args = ["gc", "--max-age", "2d", "--max-bytes", f"{before // 2}B", "--missing-models"]
    dry = cli_json(*args, "--dry-run", cache_dir=store_dir)
    assert len(dry["removed"]) >= 3 and dry["blob_bytes_left_exact"] is True
    assert dry["blob_bytes_left"] == before - dry["freed_bytes"] <= before // 2
    assert dry["entries_left"] == n_before - len(dry["removed"])
    from kvstore.cli.common import human_bytes, plural

    text = main_text(*args, "--dry-run", cache_dir=store_dir)
    left = f"{human_bytes(dry['blob_bytes_left'])} in {plural(dry['entries_left'], 'entry', 'entries')}"
    assert f"would leave {left} (dry run: nothing changed)" in text, text
    real = cli_json(*args, cache_dir=store_dir)
    assert [r["key"] for r in real["removed"]] == [r["key"] for r in dry["removed"]]
    assert (real["blob_bytes_left"], real["entries_left"]) == (dry["blob_bytes_left"], dry["entries_left"])


def test_gc_age_and_missing_models(built, store_dir):
    keys = built["keys"]
    res = cli_json("gc", "--max-age", "2d", "--missing-models", cache_dir=store_dir)
    reasons = {r["key"]: r["reason"] for r in res["removed"]}
    # A is 10 days old; E is older but pinned; D's model directory is gone
    assert reasons == {keys["A"]: "max_age", keys["D"]: "missing_model"}
    left = main_json("ls", cache_dir=store_dir)
    have = {e["key"] for g in left["identities"] for e in g["entries"]}
    assert have == {keys[n] for n in ("A2", "B", "C", "E")}
    assert main_json("verify", cache_dir=store_dir)["ok"]
    got = fetch_all(built, store_dir, names=["A2", "A"])
    assert got["A2"]["n"] == 380 and got["A2"]["oracle"] is True  # A2 kept A's shared chunks
    assert got["A"]["n"] == 300 and got["A"]["oracle"] is True    # A: a prefix of A2's chunks


def test_gc_identity_and_max_bytes(built, store_dir):
    from kvstore.disk import DiskTier

    keys = built["keys"]
    p = cli("gc", "--identity", built["gone_ident"][:6], cache_dir=store_dir)
    assert p.returncode == 0 and f"removed {keys['D'][:12]}" in p.stdout, p.stdout + p.stderr
    disk = DiskTier(store_dir, readonly=True)
    try:
        e = disk.index.entry(bytes.fromhex(keys["E"]))
        e_bytes = disk.index.pack(e.tail.pack).size  # E shares nothing: its pack is all of it
        total = disk.index.total_bytes()
    finally:
        disk.close()
    # a budget that only the pinned entry fits: every unpinned entry goes, those that free
    # space first in LRU order (A, the oldest, frees nothing while A2 uses its chunks: it
    # goes after A2), pinned E kept
    # a bare number under 1 MiB (`--max-bytes 20`, a typo for 20G) is refused: nothing removed
    p = cli("gc", "--max-bytes", "20", cache_dir=store_dir)
    assert p.returncode == 2 and "no unit" in p.stderr and "20B" in p.stderr and "20G" in p.stderr, p.stderr
    assert sum(len(g["entries"]) for g in cli_json("ls", cache_dir=store_dir)["identities"]) == len(keys) - 1
    res = cli_json("gc", "--max-bytes", f"{e_bytes}B", cache_dir=store_dir)
    order = [r["key"] for r in res["removed"]]
    assert order == [keys[n] for n in ("B", "C", "A2", "A")], order
    assert sum(r["bytes"] for r in res["removed"]) == total - e_bytes
    assert res["blob_bytes_left"] == e_bytes
    res = main_json("gc", "--max-bytes", "0", cache_dir=store_dir)
    assert res["removed"] == [] and res["entries_left"] == 1  # pinned: kept unless asked for by flag
    res = main_json("gc", "--max-bytes", "0", "--include-pinned", cache_dir=store_dir)
    assert [r["key"] for r in res["removed"]] == [keys["E"]]  # asked for: nothing else left, the pinned one goes
    assert res["entries_left"] == 0 and res["blob_bytes_left"] == 0
    assert not [f for f in (store_dir / "blobs").rglob("*") if f.is_file()]
    from kvstore.cli import main

    assert main(["gc", "--identity", "ffffffffff", "--cache-dir", str(store_dir)]) == 1


def test_gc_refuses_a_size_or_age_it_cannot_mean(built, store_dir):
    """issue 52 item 8: ``--max-bytes 0.5`` was read as 0 (the bare-number guard checked the
    truncated value): entries 3 -> 1, and ``.9 --include-pinned`` -> 0; 400 nines ended in
    an OverflowError traceback. Every size and duration flag refuses what it cannot mean,
    naming the value, before anything is removed."""
    import contextlib
    import io

    from kvstore.cli import main

    def entries() -> list[str]:
        return sorted(e["key"] for g in cli_json("ls", cache_dir=store_dir)["identities"] for e in g["entries"])

    before = entries()
    assert len(before) == len(built["keys"])
    nines = "9" * 400
    for args, shown in ((["--max-bytes", "0.5"], "'0.5'"), (["--max-bytes", ".9", "--include-pinned"], "'.9'"),
                        (["--max-bytes", nines], repr("9" * 40))):
        p = cli("gc", *args, cache_dir=store_dir)  # the real command, a process of its own
        assert p.returncode == 2 and shown in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)
        assert "kvstore gc: error: argument --max-bytes: invalid size" in p.stderr, p.stderr
    for flag, value in (("--max-bytes", "0.9B"), ("--max-bytes", "1048575.5"), ("--max-bytes", "0.0001K"),
                        ("--max-bytes", "9" * 19 + "P"), ("--max-bytes", "\u0663G"), ("--max-age", nines),
                        ("--max-age", "1e999"), ("--max-age", nines + "d"), ("--blob-age", "inf"),
                        ("--blob-age", "nan"), ("--blob-age", "1e-400"), ("--blob-age", nines)):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["gc", flag, value, "--include-pinned", "--cache-dir", str(store_dir)])
        assert rc == 2 and f"argument {flag}: invalid" in err.getvalue(), (flag, value, err.getvalue())
        assert repr(value[:40]) in err.getvalue() or repr(value) in err.getvalue(), err.getvalue()
    assert entries() == before  # nothing removed by any of them
    # what is meant still works: half a GiB keeps everything, a whole 0 (as 0.0) empties
    assert cli_json("gc", "--max-bytes", "0.5G", cache_dir=store_dir)["removed"] == []
    assert entries() == before
    res = main_json("gc", "--max-bytes", "0.0", "--include-pinned", cache_dir=store_dir)
    assert sorted(r["key"] for r in res["removed"]) == before and res["entries_left"] == 0


# ----------------------------------------------------------------------------- concurrency


def test_gc_and_verify_fix_under_a_live_reader(built, store_dir, tmp_path):
    keys = built["keys"]
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    payload = {"cache_dir": str(store_dir), "prompts": built["prompts"], "model_dir": str(built["model_dir"]),
               "gone_components": GONE_COMPONENTS, "gone_path": built["gone_path"],
               "stop": str(stop), "ready": str(ready), "max_seconds": 1800}
    reader = subprocess.Popen([sys.executable, "-m", "tests.support.programs.cli_reader", json.dumps(payload)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=str(ROOT))
    try:
        t0 = time.time()
        while not ready.exists():
            assert reader.poll() is None, reader.communicate()[1][-3000:]
            assert time.time() - t0 < 900, "reader never got going"  # a hang, not a busy machine
            time.sleep(0.05)
        # damage B while the reader is serving it, add strays, then repair and collect
        damage_segment(segment_of(store_dir, keys["B"], chunk=2), "flip")
        (store_dir / "blobs" / "zz.safetensors.1.x.tmp").write_bytes(b"junk")
        t_begin = time.time()
        fix = cli("verify", "--fix", "--blob-age", "0", cache_dir=store_dir)
        assert fix.returncode == 0, fix.stdout + fix.stderr
        gc = cli_json("gc", "--max-bytes", "700K", "--missing-models", cache_dir=store_dir)
        removed = {r["key"] for r in gc["removed"]}
        assert keys["D"] in removed and keys["E"] not in removed
        assert gc["blob_bytes_left"] <= 700 << 10
        # keep both commands running against the live reader until it finished 3 rounds of
        # fetches meanwhile (it touches `ready` after each): counted, not timed, so a busy
        # machine takes longer and still passes; 900 s bounds a reader that hangs
        rounds, seen = 0, ready.stat().st_mtime_ns
        while rounds < 3:
            assert reader.poll() is None and time.time() - t_begin < 900, "the reader stopped fetching"
            again = cli("verify", "--fix", "--blob-age", "0", cache_dir=store_dir)
            assert again.returncode == 0, again.stdout + again.stderr
            cli_json("gc", "--max-bytes", "700K", cache_dir=store_dir)
            now = ready.stat().st_mtime_ns
            rounds, seen = rounds + (now != seen), now
        t_end = time.time()
        time.sleep(1.0)  # let the reader run a few rounds against the collected store
        stop.touch()
        out, err = reader.communicate(timeout=900)  # its last round, then it stops (bounds a hang)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert reader.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    during = sum(t_begin <= t <= t_end for t in res.pop("round_ends"))
    print({k: v for k, v in res.items() if k != "stats"}, "rounds during verify --fix and gc:", during)
    assert res["errors"] == [] and res["wrong"] == [], res
    assert during >= 3  # the reader kept fetching while both commands ran
    assert res["hits"] > 0 and res["misses"] > 0 and res["oracle_runs"] > 0 and res["rounds"] >= 3
    assert main_json("verify", cache_dir=store_dir)["ok"]


# ----------------------------------------------------------------------------- warm


def test_warm_then_fetch_in_a_new_process(built, tmp_path):
    from kvstore import KVStore
    from tools.testing.oracle import check_restore

    model, tok, mdir = built["model"], built["tok"], built["model_dir"]
    cache_dir = tmp_path / "fresh-cache"  # does not exist yet: warm creates it
    system = "You are a terse assistant for a storage team. " * 6
    (tmp_path / "system.txt").write_text(system)
    p = cli("warm", "--model", mdir, "--system-file", tmp_path / "system.txt", "--chunk-tokens", CHUNK,
            "--step", 100, cache_dir=cache_dir)
    assert p.returncode == 0 and "warmed" in p.stdout, p.stdout + p.stderr
    assert "\r" not in p.stderr  # no progress bar when stderr is not a terminal

    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is a blob?"},
            {"role": "assistant", "content": "A file holding KV tensors."}]
    sys_toks = list(tok.apply_chat_template([msgs[0]], tokenize=True, add_generation_prompt=False))
    chat_toks = list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False))
    request = list(tok.apply_chat_template(msgs[:2], tokenize=True, add_generation_prompt=True))
    assert request[: len(sys_toks)] == sys_toks and 200 <= len(sys_toks) <= 400
    with KVStore(cache_dir, max_entries=0) as store:  # chunk size comes from the directory
        f = store.fetch(mdir, request)  # the first real request: a hit on the warmed prompt
        # stored as mlx_lm.server caches a system prompt: up to where the user's text starts
        assert f.source == "disk" and len(sys_toks) < f.n < len(request)
        assert tok.decode(request[f.n:]).startswith("What is a blob?"), tok.decode(request[f.n:])
        assert check_restore(model, request, f.cache, f.n).ok

    (tmp_path / "chat.json").write_text(json.dumps(msgs))
    p = cli("warm", "--model", mdir, "--messages-file", tmp_path / "chat.json", cache_dir=cache_dir)
    assert p.returncode == 0 and "warmed" in p.stdout and "reused" in p.stdout, p.stdout + p.stderr
    with KVStore(cache_dir, max_entries=0) as store:
        f = store.fetch(mdir, chat_toks + [10])
        assert f.source == "disk" and f.n == len(chat_toks)
        assert check_restore(model, chat_toks + [10], f.cache, f.n).ok

    from kvstore.cli import main

    assert "already warm" in main_text("warm", "--model", mdir, "--system-file", tmp_path / "system.txt",
                                       cache_dir=cache_dir)
    (tmp_path / "bad.json").write_text('{"role": "system"}')

    assert main(["warm", "--model", str(mdir), "--messages-file", str(tmp_path / "bad.json"),
                 "--cache-dir", str(cache_dir)]) == 1
    assert main(["warm", "--model", str(tmp_path / "no-model"), "--system-file", str(tmp_path / "system.txt"),
                 "--cache-dir", str(cache_dir)]) == 1


def on_terminal(args: list[Any], timeout: float = 300) -> tuple[int, str, str]:
    """Run ``python -m kvstore.cli ARGS`` with stderr on a pseudo-terminal (100x24), as a
    user at a shell sees it: (return code, stdout, what the terminal received)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *map(str, args)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=slave, env=child_env(), cwd=str(ROOT))
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        seen += data
    out, _ = p.communicate(timeout=timeout)
    os.close(master)
    return p.returncode, out.decode(), seen.decode(errors="replace")


def test_warm_reports_each_step(built, tmp_path):
    """Not on a terminal: one line per step, exact token counts, tok/s for prefill. On a
    terminal: tqdm bars (carriage returns, a rate) with the same labels."""
    tok, mdir = built["tok"], built["model_dir"]
    system = "You keep the storage team's runbook short and exact. " * 5
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Where do blobs live?"}]
    (tmp_path / "system.txt").write_text(system)
    (tmp_path / "chat.json").write_text(json.dumps(msgs))
    # mlx_lm.server's system segment: where [system, empty user turn] leaves the real prompt
    empty = list(tok.apply_chat_template(msgs[:1] + [{"role": "user", "content": ""}], tokenize=True))
    real = list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True))
    n_sys = next(i for i, (a, b) in enumerate(zip(empty, real)) if a != b)
    n_chat = len(list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=False)))
    cache_dir = tmp_path / "cache"

    p = cli("warm", "--model", mdir, "--system-file", tmp_path / "system.txt", "--step", 64, cache_dir=cache_dir)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    print(p.stderr)
    assert "\r" not in p.stderr and len(lines) == 5, lines
    assert lines[0].startswith("kvstore: BLAS:")
    assert lines[1].startswith(f"load model {mdir}: ")
    assert lines[2].startswith(f"look up {n_sys:,} prompt tokens: ") and lines[2].endswith("(nothing stored)")
    assert re.fullmatch(rf"prefill {n_sys:,} of {n_sys:,} prompt tokens: \d+\.\d s, [\d,]+ tok/s", lines[3]), lines[3]
    assert lines[4].startswith(f"write {n_sys:,} tokens' KV to disk (write-behind flush): ")

    rc, out, seen = on_terminal(["warm", "--model", mdir, "--messages-file", tmp_path / "chat.json",
                                 "--step", 16, "--cache-dir", cache_dir])
    assert rc == 0 and "warmed" in out, (out, seen)
    print(seen)
    assert f"restore {n_sys:,} of {n_chat:,} prompt tokens" in seen
    assert f"prefill the last {n_chat - n_sys:,} of {n_chat:,} prompt tokens (the rest restored)" in seen
    assert "\r" in seen and "tok/s" in seen and f"{n_chat}/{n_chat}" in seen


# -- the maintenance commands never load MLX (issue 21.1) --------------------------------

_LOADS = """
import json, sys
from kvstore.cli.main import main
got = []
for args in json.loads(sys.argv[1]):
    rc = main(args)
    got.append({"rc": rc, "mlx": "mlx" in sys.modules, "mlx_lm": "mlx_lm" in sys.modules})
print(json.dumps(got), file=sys.stderr)
"""


def _modules_after(runs: list[list[str]]) -> list[dict]:
    """Run ``kvstore ARGS`` for each ARGS of ``runs``, in order, in one new process (one
    Python start-up, not one per command): each command's exit code and whether mlx / mlx_lm
    were imported by the time it returned (read from ``sys.modules``; nothing imports them
    before the first command, so the first command that does is the first one flagged)."""
    p = subprocess.run([sys.executable, "-c", _LOADS, json.dumps(runs)], capture_output=True, text=True,
                       timeout=240, env=child_env(), cwd=str(ROOT))
    return json.loads(p.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("populated", [False, True])
def test_maintenance_commands_never_import_mlx(built, tmp_path, populated):
    """ls, stats, inspect (decoding the prompt), verify, gc and pin/unpin on an empty and on
    a populated store (and ls on a missing directory) never import mlx or mlx_lm."""
    d = tmp_path / "cache"
    if populated:
        shutil.copytree(built["dir"], d)
        entry = built["keys"]["A"][:12]
    else:
        from kvstore.cachedir import open_disk

        open_disk(d).close()
        entry = "abcdef"
    runs = [["ls"], ["ls", "--json"], ["stats"], ["inspect", entry], ["inspect", entry, "--prompt"],
            ["verify"], ["gc", "--dry-run", "--max-bytes", "1G"], ["gc", "--max-bytes", "1G"],
            ["pin", entry], ["unpin", entry]]
    argv = [[*a, "--cache-dir", str(d)] for a in runs] + [["ls", "--cache-dir", str(tmp_path / "none")]]
    got = dict(zip([" ".join(a) for a in runs] + ["ls (missing dir)"], _modules_after(argv), strict=True))
    assert {k: v for k, v in got.items() if v["mlx"] or v["mlx_lm"]} == {}
    codes = {k: v["rc"] for k, v in got.items()}
    assert codes["ls"] == 0 and codes["ls (missing dir)"] == 1
    assert codes["inspect " + entry] == (0 if populated else 1), codes
