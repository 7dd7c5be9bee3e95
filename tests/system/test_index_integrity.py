"""The index's integrity checks against real LMDB files: they assert only what LMDB keeps
(a healthy file after a large gc is healthy), and the salvage keeps every record that
is still readable (damage is confined to the node it is in)."""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest
from tests.support import ROOT
from tests.support.caches import ident, rand_tokens, synth_kv_cache
from tests.support.children import child_env

from kvstore import KVStore
from kvstore import maintenance
from kvstore.disk import DiskTier
from kvstore.index.pages import db_roots, page_size


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=300, env=child_env(), cwd=str(ROOT))


def _unwritten_tail(data: Path) -> tuple[int, int]:
    """(file size, what ``last_pgno`` would need): LMDB's own view of the file."""
    env = lmdb.open(str(data.parent), readonly=True, lock=False, max_dbs=16)
    try:
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()
    return data.stat().st_size, need


def test_index_after_a_gc_of_most_entries_is_healthy(tmp_path):
    """Regression (issue 31, item 4): a gc removing most entries in one transaction leaves
    a file shorter than (last_pgno + 1) pages (pages allocated and freed inside that
    transaction count in last_pgno but are never written). The open asserted the
    opposite: `ls`, `stats`, `verify` exited 1 ("data.mdb is truncated") and the next
    writable open moved the healthy index aside and rebuilt it. Now they read it, and a
    writable open keeps it (no `index.corrupt-*`)."""
    rng = random.Random(1)
    who = ident("gc-most")
    with KVStore(tmp_path, chunk_tokens=16) as s:
        for i in range(30):
            toks = rand_tokens(rng.randrange(20, 300), seed=100 + i)
            s.insert(who, toks, synth_kv_cache(1, 1, len(toks), 4, seed=i))
            assert s.flush()  # one pack (and one commit) each
    p = _cli("gc", "--max-bytes", "1B", "--cache-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    data = tmp_path / "index" / "data.mdb"
    have, need = _unwritten_tail(data)
    assert have < need, (have, need)  # the state this test is about (seed 1 makes it)
    for cmd in (["ls"], ["stats"], ["verify"]):
        p = _cli(*cmd, "--cache-dir", str(tmp_path))
        assert p.returncode == 0, (cmd, p.stdout, p.stderr)
        assert "truncated" not in p.stderr
    left = 0
    with KVStore(tmp_path) as s:
        left = s.stats()["disk_entries"]
    assert not list(tmp_path.glob("index.corrupt-*"))
    with KVStore(tmp_path) as s:  # and it writes: a new entry, read back
        toks = rand_tokens(40, seed=7)
        s.insert(who, toks, synth_kv_cache(1, 1, 40, 4, seed=99))
        assert s.flush()
        s.memory.clear()
        assert s.fetch(who, toks).source == "disk"
        assert s.stats()["disk_entries"] == left + 1


def test_a_truncated_index_is_still_refused(tmp_path):
    """The check that replaced last_pgno still finds what it is for: a data file cut
    before the pages its trees use is refused by a read-only open (never mapped past
    its end), and salvaged by a writable one."""
    who = ident("cut")
    toks = rand_tokens(40, seed=2)
    with KVStore(tmp_path, chunk_tokens=16) as s:
        s.insert(who, toks, synth_kv_cache(1, 1, 40, 4))
        assert s.flush()
    data = tmp_path / "index" / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(2 * page_size(data))  # the meta pages only
    p = _cli("ls", "--cache-dir", str(tmp_path))
    assert p.returncode == 1 and "truncated" in p.stderr, (p.stdout, p.stderr)
    with KVStore(tmp_path) as s:
        assert s.fetch(who, toks).n == 0
    assert list(tmp_path.glob("index.corrupt-*"))


# --------------------------------------------------------------------------- after a crash

_CRASH = r"""
import json, os, signal, sys
from kvstore import KVStore
from kvstore.budget import evict_to
from tests.support.caches import ident, rand_tokens, synth_kv_cache
a = json.loads(sys.argv[1])
s = KVStore(a["cache"], chunk_tokens=16)
toks = rand_tokens(40, seed=a["seed"])
s.insert(ident("crash"), toks, synth_kv_cache(1, 1, 40, 4, seed=a["seed"]))
assert s.flush()
if a["gc"]:
    assert evict_to(s.disk, 1)  # most entries gone in one transaction, then the crash
os.kill(os.getpid(), signal.SIGKILL)  # no clean close: the index keeps no matching stamp
"""


def _crashed_store(tmp_path: Path, *, gc: bool) -> tuple[Path, list[list[int]]]:
    """A store of 30 entries closed cleanly, then written by a writer SIGKILLed after its
    commit (after a gc of most entries with ``gc``): the state a crash leaves."""
    cache = tmp_path / "cache"
    who = ident("crash")
    prompts = [rand_tokens(20 + 9 * i, seed=200 + i) for i in range(30)]
    with KVStore(cache, chunk_tokens=16) as s:
        for i, toks in enumerate(prompts):
            s.insert(who, toks, synth_kv_cache(1, 1, len(toks), 4, seed=i))
            assert s.flush()
    p = subprocess.run([sys.executable, "-c", _CRASH, json.dumps({"cache": str(cache), "seed": 9, "gc": gc})],
                       capture_output=True, text=True, timeout=300, env=child_env(), cwd=str(ROOT))
    assert p.returncode == -9, p.stderr
    return cache, prompts + [rand_tokens(40, seed=9)]


@pytest.mark.parametrize("gc", [False, True])
def test_open_after_a_crash_checks_without_walking_the_index(tmp_path, monkeypatch, gc):
    """Issue 47, item 1: after a writer was killed, every open (server start, `ls`,
    `stats`) ran the whole-index check in a child, in time growing with the index. Now a
    file a checked writer left (its mark) is checked by what a crash can leave only: no
    child is started (one that cannot start would leave the index unstamped and warn),
    the index is stamped, and every entry (the killed writer's committed one too) is
    served. With ``gc``: a file shorter than ``last_pgno`` (pages freed in the same
    transaction) passes, as its unwritten tail is on the free-page list."""
    import logging

    cache, prompts = _crashed_store(tmp_path, gc=gc)
    data = cache / "index" / "data.mdb"
    if gc:
        have, need = _unwritten_tail(data)
        assert have < need, (have, need)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))  # no walk can run
    warned: list[str] = []
    handler = type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.INFO)
    logging.getLogger("kvstore").addHandler(handler)
    try:
        with KVStore(cache) as s:
            assert (cache / "index" / "clean").is_file(), warned
            served = [s.fetch(ident("crash"), toks).n for toks in prompts]
    finally:
        logging.getLogger("kvstore").removeHandler(handler)
    assert not any("did not complete" in w or "checking every record" in w for w in warned), warned
    assert gc or served == [len(t) for t in prompts], served
    assert not list(cache.glob("index.corrupt-*"))
    assert not list((cache / "index").glob("writer-*"))  # the dead writer's mark is gone, and ours


def test_a_truncated_index_after_a_crash_is_still_refused(tmp_path):
    """The crash check keeps what the whole-index check is for: a data file cut short
    after a writer's crash is refused by a read-only open (`ls` exits 1, never a SIGBUS)
    and salvaged by a writable one."""
    cache, prompts = _crashed_store(tmp_path, gc=False)
    data = cache / "index" / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    p = _cli("ls", "--cache-dir", str(cache))
    assert p.returncode == 1 and "index" in p.stderr, (p.returncode, p.stdout, p.stderr)
    with KVStore(cache) as s:
        s.fetch(ident("crash"), prompts[0])
    assert list(cache.glob("index.corrupt-*"))


# --------------------------------------------------------------------------- salvage

def _leaf(data: Path, db: str) -> tuple[int, int, list[int]]:
    """(page size, page number, node offsets) of database ``db``'s root, a leaf."""
    psize = page_size(data)
    root = db_roots(data)[db]
    b = data.read_bytes()[root * psize : (root + 1) * psize]
    flags, lower = struct.unpack_from("<HH", b, 10)
    assert flags & 0x02, "the tokens database must fit one leaf page for this test"
    offs = [int.from_bytes(b[16 + 2 * i : 18 + 2 * i], "little") for i in range(((lower - 16) // 2))]
    return psize, root, offs


def _damage_node(data: Path, i: int, how: str) -> bytes:
    """Damage node ``i`` of the tokens database's leaf page; returns that node's key."""
    psize, root, offs = _leaf(data, "tokens")
    with open(data, "r+b") as f:
        f.seek(root * psize + offs[i])
        node = f.read(8)
        ksize = struct.unpack_from("<H", node, 6)[0]
        key = f.read(ksize)
        if how == "offset":  # the node's pointer leaves the page
            f.seek(root * psize + 16 + 2 * i)
            f.write((psize - 2).to_bytes(2, "little"))
        elif how == "key_size":  # its key runs past the page
            f.seek(root * psize + offs[i] + 6)
            f.write((0xFFFF).to_bytes(2, "little"))
        else:  # "key": its key's bytes, now out of order with the next
            f.seek(root * psize + offs[i] + 8)
            f.write(b"\xff" * ksize)
    return key


# a key out of order is not something LMDB's own walk at open notices: verify finds it
@pytest.mark.parametrize("how, path", [("offset", "open"), ("key_size", "open"), ("offset", "verify"),
                                       ("key_size", "verify"), ("key", "verify")])
def test_salvage_keeps_the_intact_records_beside_a_damaged_node(tmp_path, monkeypatch, how, path):
    """Regression (issue 31, item 5): when one node of a damaged leaf page failed to
    decode, every later node of that page was skipped, so intact entries beside the
    damage were lost by the salvage. Now damage is confined to its node: the salvage
    (at a writable open that finds the damage, or by `verify --fix`) keeps the other 8
    token records, the entry that lost its token ids is dropped, and the 8 are served."""
    from kvstore.index import checks

    who = ident("salvage")
    prompts = [rand_tokens(12, seed=40 + i) for i in range(9)]
    with KVStore(tmp_path, chunk_tokens=64) as s:
        for i, toks in enumerate(prompts):
            s.insert(who, toks, synth_kv_cache(1, 1, 12, 4, seed=i))
        assert s.flush()
    data = tmp_path / "index" / "data.mdb"
    _, _, offs = _leaf(data, "tokens")
    assert len(offs) == 9
    lost = _damage_node(data, 4, how)
    if path == "verify":
        monkeypatch.setattr(checks, "CHECK_AT_OPEN", False)  # reach the damage with verify, not at open
    disk = DiskTier(tmp_path)
    try:
        if path == "verify":
            got = maintenance.verify(disk, blob_age=0)
            assert [p.kind for p in got] == ["corrupt_index"], got
            got = maintenance.verify(disk, fix=True, blob_age=0)
            assert got[0].kind == "corrupt_index" and got[0].fixed, got
        else:
            assert list(tmp_path.glob("index.corrupt-*"))  # the open found it and salvaged
        with disk.index.env.begin() as txn:
            keys = [bytes(k) for k, _ in txn.cursor(db=disk.index._db["tokens"])]
        assert len(keys) == 8 and lost not in keys, keys
        maintenance.verify(disk, fix=True, blob_age=0)  # the entry without token ids goes
        assert maintenance.verify(disk, blob_age=0) == []
        assert disk.index.counts()["entries"] == 8
    finally:
        disk.close()
    with KVStore(tmp_path) as s:
        served = [s.fetch(who, toks).n for toks in prompts]
    assert sorted(served) == [0] + [12] * 8, served


# --------------------------------------------------------------------------- lock.mdb


_HOLD = r"""
import json, sys, time, lmdb
env = lmdb.open(sys.argv[1], max_dbs=16, max_readers=512)  # LMDB's own sparse lock file, live
txn = env.begin()
print("ready", flush=True)
sys.stdin.readline()
txn.abort()
with env.begin(write=True) as w:
    w.put(b"from-the-live-process", b"1")
print("done", flush=True)
"""


def test_lock_file_fallback_keeps_a_live_process_reader_table(tmp_path, monkeypatch):
    """The fallback never changes a byte a live process uses: with LMDB's own (shorter,
    sparse) lock file held open by another process inside a read transaction, an open
    without posix_fallocate appends zeros past its end; that process's reader slot is
    still listed, and it still commits a write this process then reads."""
    monkeypatch.delattr(os, "posix_fallocate")
    idx = tmp_path / "index"
    idx.mkdir(mode=0o700)
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(idx)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=child_env())
    try:
        assert p.stdout.readline().strip() == "ready"
        before = (idx / "lock.mdb").stat().st_size
        disk = DiskTier(tmp_path)
        try:
            assert (idx / "lock.mdb").stat().st_size > before
            assert f"{p.pid}" in disk.index.env.readers()
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "done"
            with disk.index.env.begin() as txn:
                assert txn.get(b"from-the-live-process") == b"1"
        finally:
            disk.close()
    finally:
        p.kill()
        p.wait()


def test_salvage_keeps_the_subtrees_beside_a_damaged_branch_node(tmp_path):
    """The same unit one level up: a branch page whose one node points out of the page
    loses that child's subtree only; every record under the other children is kept (a
    damaged node made the salvage skip the whole branch page, here every token record)."""
    who = ident("branch")
    prompts = [rand_tokens(12, seed=400 + i) for i in range(120)]
    with KVStore(tmp_path, chunk_tokens=64) as s:
        for i, toks in enumerate(prompts):
            s.insert(who, toks, synth_kv_cache(1, 1, 12, 4, seed=i))
            if i % 8 == 7:
                assert s.flush()  # the writer's queue is bounded: none dropped
        assert s.flush()
    data = tmp_path / "index" / "data.mdb"
    psize = page_size(data)
    root = db_roots(data)["tokens"]
    b = data.read_bytes()[root * psize : (root + 1) * psize]
    flags, lower = struct.unpack_from("<HH", b, 10)
    n = (lower - 16) // 2
    assert flags & 0x01 and n >= 3, "the tokens database must have a branch root for this test"
    leaf_sizes = []
    for i in range(n):
        off = int.from_bytes(b[16 + 2 * i : 18 + 2 * i], "little")
        lo, hi, fl = struct.unpack_from("<HHH", b, off)
        child = data.read_bytes()[(lo | hi << 16 | fl << 32) * psize :][:psize]
        leaf_sizes.append((struct.unpack_from("<H", child, 12)[0] - 16) // 2)
    with open(data, "r+b") as f:  # node 1's pointer leaves the page
        f.seek(root * psize + 16 + 2)
        f.write((psize - 2).to_bytes(2, "little"))
    disk = DiskTier(tmp_path)  # the open's check meets it: moved aside, salvaged
    try:
        assert list(tmp_path.glob("index.corrupt-*"))
        with disk.index.env.begin() as txn:
            kept = sum(1 for _ in txn.cursor(db=disk.index._db["tokens"]))
    finally:
        disk.close()
    assert kept == sum(leaf_sizes) - leaf_sizes[1], (kept, leaf_sizes)


# --------------------------------------------------------------------------- writer marks

_WRITER = r"""
import json, sys
from kvstore import KVStore
from tests.support.caches import ident, rand_tokens, synth_kv_cache
a = json.loads(sys.argv[1])
s = KVStore(a["cache"], chunk_tokens=64)
for i in range(9):
    s.insert(ident("marks"), rand_tokens(12, seed=40 + i), synth_kv_cache(1, 1, 12, 4, seed=i))
assert s.flush()
print("ready", flush=True)
sys.stdin.readline()  # holds the store open (its writer mark) until told, or killed
s.close()
print("closed", flush=True)
"""

_OPENER = r"""
import json, sys
from kvstore import KVStore
from tests.support.caches import ident, rand_tokens
with KVStore(sys.argv[1]) as s:
    print(json.dumps([s.fetch(ident("marks"), rand_tokens(12, seed=40 + i)).n for i in range(9)]))
"""


def _pid_namespace() -> list[str] | None:
    """The command prefix that runs a program as PID 1 of a new pid namespace, or None
    where this system has none (then the test plants what such a writer leaves)."""
    import shutil

    if not shutil.which("unshare"):
        return None
    for extra in ([], ["--user", "--map-root-user"]):
        cmd = ["unshare", *extra, "--pid", "--fork", "--mount-proc"]
        p = subprocess.run([*cmd, sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, timeout=60)
        if p.returncode == 0 and p.stdout.strip() == "1":
            return cmd
    return None


def _start_writer(cache: Path, prefix: list[str] | None = None) -> tuple[subprocess.Popen, int]:
    """A writer of 9 entries holding the store open: (its process, the pid of its Python
    as this namespace sees it)."""
    p = subprocess.Popen([*(prefix or []), sys.executable, "-c", _WRITER, json.dumps({"cache": str(cache)})],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(), cwd=str(ROOT))
    assert p.stdout.readline().strip() == "ready"
    if not prefix:
        return p, p.pid
    kids = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()  # unshare's one child
    assert len(kids) == 1, kids
    return p, int(kids[0])


def _edit_in_place(data: Path) -> None:
    """Damage node 4 of the tokens leaf, in place (same inode), once the file system's
    clock has moved past the file's last change (so the edit is a new ctime, as any
    edit after a writer's commit is)."""
    probe = data.parent.parent / "clock-probe"
    deadline = time.monotonic() + 60
    while True:
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > data.stat().st_ctime_ns or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    probe.unlink()
    _damage_node(data, 4, "offset")


def _open_and_fetch(cache: Path) -> list[int]:
    """Tokens each of the 9 prompts is served, by a new process (a fault kills it, not us)."""
    p = subprocess.run([sys.executable, "-c", _OPENER, str(cache)], capture_output=True, text=True,
                       timeout=300, env=child_env(), cwd=str(ROOT))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("between", ["an open", "nothing"])
def test_a_writer_killed_as_pid_1_vouches_for_no_later_damage(tmp_path, between):
    """Issue 52, item 9: a writer SIGKILLed as PID 1 of its pid namespace (a container's
    entrypoint) left a mark every later open kept (pid 1 is "alive" everywhere), and it
    vouched for whatever the file became: after an in-place damage the next process died
    of SIGBUS. A mark now proves its writer alive by a lock the kernel releases at its
    death, and vouches only for the file exactly as its last commit left it: the damage
    is found by the child's walk, the index salvaged, and the 8 intact entries served.
    With ``between``: an open after the crash, which removes the dead mark, as the next
    open after the crash does; without: the dead mark is still there at the damage."""
    cache = tmp_path / "cache"
    prefix = _pid_namespace()
    p, pid = _start_writer(cache, prefix)
    os.kill(pid, signal.SIGKILL)  # PID 1 of its namespace: only the outside can kill it
    p.wait(timeout=60)
    idx = cache / "index"
    if prefix is None:  # no pid namespace here: the same mark, as such a writer names it
        for m in idx.glob("writer-*"):
            m.rename(idx / ("writer-1-" + m.name.split("-", 2)[2]))
    assert [m.name.split("-")[1] for m in idx.glob("writer-*")] == ["1"]
    if between == "an open":
        assert _open_and_fetch(cache) == [12] * 9  # the crash check: no damage yet
        assert not list(idx.glob("writer-*"))  # the dead writer's mark went with it
    _edit_in_place(idx / "data.mdb")
    served = _open_and_fetch(cache)
    assert list(cache.glob("index.corrupt-*")), "the damage was not found at open"
    assert sorted(served) == [0] + [12] * 8, served
    assert _open_and_fetch(cache) == served  # and the salvaged index opens again


def test_a_live_writers_mark_does_not_vouch_for_a_file_edited_in_place(tmp_path):
    """A live writer's mark vouches for the file as that writer's last commit left it,
    never for an edit of it in place by someone else (same device, inode and transaction
    id, a new ctime): the next open walks it in a child, finds the damage and salvages,
    while the writer still holds its mark."""
    cache = tmp_path / "cache"
    p, _ = _start_writer(cache)
    try:
        assert len(list((cache / "index").glob("writer-*"))) == 1
        _edit_in_place(cache / "index" / "data.mdb")
        served = _open_and_fetch(cache)
        assert list(cache.glob("index.corrupt-*")), "the damage was not found at open"
        assert sorted(served) == [0] + [12] * 8, served
        assert p.poll() is None  # the writer was alive (its lock held) throughout
    finally:
        p.kill()
        p.wait()


def test_a_live_writers_mark_vouches_for_its_own_commits(tmp_path, monkeypatch):
    """What the mark is for: beside a live writer that has committed, an open walks
    nothing (no child could start here) and serves the writer's entries; and a mark made
    for another file (the index replaced by a copy: another inode) vouches for nothing."""
    import logging

    cache = tmp_path / "cache"
    p, _ = _start_writer(cache)
    try:
        monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))  # no walk can run
        warned: list[str] = []
        handler = type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.INFO)
        logging.getLogger("kvstore").addHandler(handler)
        try:
            with KVStore(cache) as s:
                assert [s.fetch(ident("marks"), rand_tokens(12, seed=40 + i)).n for i in range(9)] == [12] * 9
            assert not any("did not complete" in w for w in warned), warned
            data = cache / "index" / "data.mdb"
            copy = data.with_name("copy")
            copy.write_bytes(data.read_bytes())
            os.replace(copy, data)  # the same bytes, another inode
            with KVStore(cache):
                pass
            assert any("did not complete" in w for w in warned), warned  # it tried to walk it
        finally:
            logging.getLogger("kvstore").removeHandler(handler)
    finally:
        p.kill()
        p.wait()
