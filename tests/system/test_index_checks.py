"""kvstore.index.checks, called directly on real LMDB files: the verdicts of the whole-index walk
in a child (each way a child can end), when a writer's mark spares the walk, and the salvage of
a damaged file's records. (tests/system/test_index_integrity.py drives the same code through
whole stores and crashed writers.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import lmdb
import pytest

from kvstore import KVStore
from kvstore.index import checks
from kvstore.index.txn import DBS
from kvstore.records import parse
from tests.support.caches import ident, rand_tokens, synth_kv_cache


def make_index(path: Path, n: int = 20) -> Path:
    """An LMDB directory of two named databases holding ``n`` records each; its data file."""
    env = lmdb.open(str(path), max_dbs=4, subdir=True, map_size=1 << 24)
    for name in (b"a", b"b"):
        db = env.open_db(name)
        with env.begin(write=True, db=db) as txn:
            for i in range(n):
                txn.put(b"k%04d" % i, b"v" * (i + 1))
    env.close()
    return path / "data.mdb"


def state_of(data: Path, txnid: int | None = 5) -> dict:
    st = data.stat()
    return {"dev": st.st_dev, "ino": st.st_ino, "txnid": txnid}


def walk_with(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """The child runs ``script`` instead of the walk: a child that ends the way it says."""
    monkeypatch.setattr(checks, "_WALK", script)


def test_a_clean_index_is_checked_clean_and_a_writers_probe_leaves_nothing(tmp_path: Path) -> None:
    data = make_index(tmp_path)
    assert checks.check_in_child(tmp_path, readonly=True, initial_map=1 << 20) == (True, None)
    assert checks.check_in_child(tmp_path, readonly=False, initial_map=1 << 20) == (True, None)
    env = lmdb.open(str(tmp_path), max_dbs=4, readonly=True)
    with env.begin() as txn:
        assert [bytes(k) for k, _ in txn.cursor()] == [b"a", b"b"]  # no probe key left
    env.close()
    assert data.stat().st_size > 0


def test_no_data_file_or_an_empty_one_needs_no_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    walk_with(monkeypatch, "import sys; sys.exit(3)")  # a child that would say damaged: never started
    assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (True, None)
    (tmp_path / "data.mdb").write_bytes(b"")
    assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (True, None)


def test_checks_turned_off_or_no_interpreter_check_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_index(tmp_path)
    monkeypatch.setattr(checks, "CHECK_AT_OPEN", False)
    assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (False, None)
    monkeypatch.setattr(checks, "CHECK_AT_OPEN", True)
    monkeypatch.setattr(checks.sys, "executable", "")
    assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (False, None)


def test_a_damaged_index_is_named_by_the_real_walk(tmp_path: Path) -> None:
    data = make_index(tmp_path, n=400)
    size = data.stat().st_size
    with open(data, "r+b") as f:  # every page after the meta pages: garbage
        f.seek(2 * 4096)
        f.write(os.urandom(size - 2 * 4096))
    ok, why = checks.check_in_child(tmp_path, readonly=True, initial_map=1 << 20)
    assert ok and why is not None and why.startswith(f"reading {data} ")


@pytest.mark.parametrize("script, verdict", [
    ("import sys; print('x', file=sys.stderr); print('page 7 bad', file=sys.stderr); sys.exit(3)",
     "reading {data} fails: page 7 bad"),
    ("import sys; sys.exit(3)", "reading {data} fails: damaged"),
    ("import sys; sys.stderr.buffer.write(b'bad \\xff page'); sys.exit(3)", "reading {data} fails: bad \ufffd page"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "reading {data} kills the process (SIGSEGV)"),
    ("import os, signal, sys; print('at page 3', file=sys.stderr, flush=True); os.kill(os.getpid(), signal.SIGBUS)",
     "reading {data} kills the process (SIGBUS: at page 3)"),
])
def test_a_child_that_finds_damage_or_faults_is_a_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          script: str, verdict: str) -> None:
    data = make_index(tmp_path)
    walk_with(monkeypatch, script)
    assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (True, verdict.format(data=data))


@pytest.mark.parametrize("script, logged", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "it ended without a verdict (killed by SIGKILL)"),
    ("import sys; print('readers full', file=sys.stderr); sys.exit(4)", "it ended without a verdict (exit 4: readers full)"),
    ("import sys; sys.exit(4)", "it ended without a verdict (exit 4)"),
    ("import time; time.sleep(20)", "it took over 0 s and was killed"),  # 20 s: a mutant that waits costs no more
])
def test_a_child_without_a_verdict_leaves_the_index_unchecked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture, script: str,
                                                              logged: str) -> None:
    data = make_index(tmp_path)
    walk_with(monkeypatch, script)
    if "sleep" in script:  # a stopped child: given a quarter of a second in all (it never ends by itself)
        monkeypatch.setattr(checks, "CHECK_SECONDS", 0.25 - data.stat().st_size / (20 << 20))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (False, None)
    assert f"the check of index {tmp_path} did not complete ({logged}); " in caplog.text, caplog.text
    assert "opening it unchecked for this process and leaving it unstamped" in caplog.text


def test_a_child_that_cannot_open_or_start_checks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    make_index(tmp_path)
    walk_with(monkeypatch, "import sys; print('no such file', file=sys.stderr); sys.exit(5)")
    with caplog.at_level(logging.INFO, logger="kvstore"):
        assert checks.check_in_child(tmp_path, readonly=False, initial_map=1) == (False, None)
    assert f"kvstore: the check of index {tmp_path} could not open it: no such file" in caplog.messages
    caplog.clear()
    walk_with(monkeypatch, "import sys; sys.exit(5)")
    with caplog.at_level(logging.INFO, logger="kvstore"):
        assert checks.check_in_child(tmp_path, readonly=False, initial_map=1) == (False, None)
    assert f"kvstore: the check of index {tmp_path} could not open it: " in caplog.messages
    monkeypatch.setattr(checks.sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        assert checks.check_in_child(tmp_path, readonly=True, initial_map=1) == (False, None)
    assert f"the check of index {tmp_path} did not complete (it could not start:" in caplog.text


def test_the_child_is_given_the_path_the_mode_and_a_map_as_large_as_the_file(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    data = make_index(tmp_path)
    walk_with(monkeypatch, "import sys; print(repr(sys.argv[1:]), file=sys.stderr); sys.exit(3)")
    size = data.stat().st_size
    for readonly, mode in ((True, "1"), (False, "0")):
        for initial, mapped in ((1, size), (size * 4, size * 4)):
            _, why = checks.check_in_child(tmp_path, readonly=readonly, initial_map=initial)
            assert why == f"reading {data} fails: {[str(tmp_path), mode, str(mapped)]!r}"


def test_salvage_copies_every_readable_record_and_recounts_the_bytes(tmp_path: Path) -> None:
    who = ident("salvage")
    prompts = [rand_tokens(12 + i, seed=60 + i) for i in range(6)]
    with KVStore(tmp_path / "cache", chunk_tokens=64) as s:
        for i, toks in enumerate(prompts):
            s.insert(who, toks, synth_kv_cache(1, 1, len(toks), 4, seed=i))
        assert s.flush()
    old = tmp_path / "cache" / "index" / "data.mdb"
    records: dict[str, dict[bytes, bytes]] = {}
    env = lmdb.open(str(old.parent), max_dbs=len(DBS) + 2, readonly=True, lock=False)
    with env.begin() as txn:
        for name in DBS:
            db = env.open_db(name.encode(), txn=txn, create=False)
            records[name] = {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
    env.close()
    (records["meta"]).pop(b"bytes")
    records["meta"][b"bytes"] = b"12345"  # a stale counter: recomputed, not copied
    assert records["packs"] and records["entries"]
    new = lmdb.open(str(tmp_path / "new"), max_dbs=len(DBS) + 2, map_size=1 << 26)
    kept = checks.salvage_into(new, old)
    with new.begin() as txn:
        got = {name: {bytes(k): bytes(v) for k, v in txn.cursor(db=new.open_db(name.encode(), txn=txn))}
               for name in DBS}
    new.close()
    want_bytes = sum(parse("packs", v).size for v in records["packs"].values())
    assert got["meta"].pop(b"bytes") == str(want_bytes).encode() and want_bytes > 0
    records["meta"].pop(b"bytes")
    assert got == records and kept == sum(len(r) for r in records.values())


def test_salvage_of_a_file_without_kvstores_databases_keeps_nothing(tmp_path: Path) -> None:
    data = make_index(tmp_path / "foreign")
    new = lmdb.open(str(tmp_path / "new"), max_dbs=len(DBS) + 2, map_size=1 << 24)
    assert checks.salvage_into(new, data) == 0
    with new.begin() as txn:
        assert bytes(txn.get(b"bytes", db=new.open_db(b"meta", txn=txn))) == b"0"
    new.close()
