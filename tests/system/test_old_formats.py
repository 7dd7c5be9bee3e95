"""Stores written by kvstore's landed versions (tests/data/old_stores, made by their own code:
make.py there): another format is set aside whole and persistence goes on; the previous
landed version's store of this format is restored in place."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import lmdb
import pytest
from tests.support import ROOT
from tests.support.caches import ident, rand_tokens, synth_kv_cache
from tests.support.children import child_env
from tests.support.stores import cache_digest

from kvstore import KVStore

OLD = ROOT / "tests" / "data" / "old_stores"
PROMPTS = [(12 + 5 * i, 300 + i) for i in range(3)]  # as make.py wrote them


def _unpack(name: str, into: Path) -> Path:
    with tarfile.open(OLD / f"{name}.tar.gz") as t:
        t.extractall(into, filter="data")
    root = into / name
    os.chmod(root, 0o700)
    return root


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (relative name -> sha1 of its bytes)."""
    return {str(p.relative_to(path)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=300, env=child_env(), cwd=str(ROOT))


def _newer(into: Path) -> Path:
    """A store of a format after this kvstore's (a downgrade): the previous version's, its
    format record rewritten to 5."""
    root = _unpack("format-4-5209c45", into)
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"5", db=env.open_db(b"meta", txn=txn))
    env.close()
    (root / "index" / "clean").unlink()
    return root


@pytest.mark.parametrize("name", ["format-2-a21c03f", "format-3-d37dbcc", "format 5"])
def test_a_store_of_another_format_is_set_aside_and_persistence_goes_on(tmp_path, name):
    """Issue 52, item 11: a cache directory of format 2 or 3 (kvstore a21c03f, d37dbcc)
    left today's kvstore memory-only at every start; `ls`, `stats`, `verify` and `gc`
    exited 1, no command could reclaim it, and opening it wrote into it (an empty `packs`
    database, a clean stamp). Now a read-only command refuses it changing nothing; a
    writable open moves it aside whole (index and pack files, byte for byte, named and
    sized in the log) and starts a new store that persists; `kvstore gc --old-formats`
    removes it, and leaves alone a planted `format-*` that is not a directory of its own."""
    root = _newer(tmp_path) if name == "format 5" else _unpack(name, tmp_path)
    found = "5" if name == "format 5" else name.split("-")[1]
    before = _tree(root)
    for cmd in ("ls", "stats", "verify"):
        p = _cli(cmd, "--cache-dir", str(root))
        assert p.returncode == 1 and f"has format {found}" in p.stderr, (cmd, p.stdout, p.stderr)
    assert _tree(root) == before, "a refusing command wrote into the store"

    warned: list[str] = []
    handler = type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.INFO)
    logging.getLogger("kvstore").addHandler(handler)
    who, toks = ident("new-format"), rand_tokens(40, seed=5)
    try:
        with KVStore(root, chunk_tokens=16) as s:
            s.insert(who, toks, synth_kv_cache(1, 1, 40, 4, seed=5))
            assert s.flush()
    finally:
        logging.getLogger("kvstore").removeHandler(handler)
    aside = [p for p in root.iterdir() if p.name.startswith(f"format-{found}-")]
    assert len(aside) == 1, list(root.iterdir())
    kept = {k: v for k, v in before.items()}
    assert _tree(aside[0]) == kept, "the set-aside store is not the old one, byte for byte"
    said = [w for w in warned if "set it aside" in w]
    assert len(said) == 1 and str(aside[0]) in said[0] and "KiB" in said[0], warned

    with KVStore(root) as s:  # persistence goes on: the new entry from disk, no word of the old store
        got = s.fetch(who, toks)
        assert (got.n, got.source) == (40, "disk")
    for cmd in ("ls", "stats", "verify"):
        p = _cli(cmd, "--cache-dir", str(root))
        assert p.returncode == 0, (cmd, p.stdout, p.stderr)
        assert cmd != "stats" or (aside[0].name in p.stdout and "--old-formats" in p.stdout), p.stdout

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not kvstore's")
    os.symlink(outside, root / "format-9-planted")
    p = _cli("gc", "--old-formats", "--cache-dir", str(root))
    assert p.returncode == 0 and aside[0].name in p.stdout, (p.stdout, p.stderr)
    assert not aside[0].exists() and (outside / "keep").is_file() and (root / "format-9-planted").is_symlink()
    with KVStore(root) as s:
        assert s.fetch(who, toks).n == 40


def test_a_store_of_the_previous_landed_version_restores_in_place(tmp_path):
    """Within format 4, a store written by the previous landed version (5209c45, the last
    landing before this wave) is restored in place: every entry served from disk, its KV
    bit for bit, nothing set aside or salvaged."""
    root = _unpack("format-4-5209c45", tmp_path)
    with KVStore(root) as s:
        for i, (n, seed) in enumerate(PROMPTS):
            got = s.fetch(ident("old-store"), rand_tokens(n, seed=seed))
            assert (got.n, got.source) == (n, "disk"), (i, got.n, got.source)
            assert cache_digest(got.cache) == cache_digest(synth_kv_cache(1, 1, n, 4, seed=i))
    assert sorted(p.name for p in root.iterdir()) == ["blobs", "index"]


_OPEN = r"""
import sys
from kvstore import KVStore
from tests.support.caches import ident, rand_tokens, synth_kv_cache
i = int(sys.argv[2])
with KVStore(sys.argv[1], chunk_tokens=16) as s:
    s.insert(ident("racing"), rand_tokens(30, seed=i), synth_kv_cache(1, 1, 30, 4, seed=i))
    assert s.flush()
"""


def test_openers_racing_on_an_older_store_set_it_aside_once(tmp_path):
    """Three processes opening a format-3 store at once: one sets it aside (a lock on the
    cache directory), the others open the new store; every one's entry persists."""
    root = _unpack("format-3-d37dbcc", tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _OPEN, str(root), str(i)], env=child_env(), cwd=str(ROOT),
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert len([p for p in root.iterdir() if p.name.startswith("format-3-")]) == 1, list(root.iterdir())
    with KVStore(root) as s:
        assert [s.fetch(ident("racing"), rand_tokens(30, seed=i)).n for i in range(3)] == [30] * 3
