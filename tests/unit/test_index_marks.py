"""kvstore.index.marks: a mark is live while its lock is held (whatever its pid says), and
vouches only for the data file exactly as its writer's last transaction left it."""

from __future__ import annotations

import os

from kvstore import files
from kvstore.index.core import Index
from kvstore.index.marks import OwnMark, marks, sweep, vouch


def _index(tmp_path) -> Index:
    (tmp_path / "index").mkdir(mode=0o700, exist_ok=True)
    return Index(tmp_path)


def _state(tmp_path):
    idx = _index(tmp_path)
    idx.transact(lambda t: t.set_meta(b"x", b"1"))
    idx.close()
    return None, tmp_path / "index"


def _file_state(directory):
    from kvstore.index.meta import last_txnid

    st = os.stat(directory / "data.mdb")
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "txnid": last_txnid(directory / "data.mdb")}


def test_a_mark_is_live_while_held_and_vouches_only_for_its_exact_file(tmp_path):
    _, d = _state(tmp_path)
    now = _file_state(d)
    m = OwnMark.make(d, now, files.PRIVATE)
    assert [x.live for x in marks(d)] == [True]
    assert vouch(marks(d), now) == "live"
    assert vouch(marks(d), dict(now, ctime_ns=now["ctime_ns"] + 1)) is None  # edited in place
    assert vouch(marks(d), dict(now, ino=now["ino"] + 1)) is None  # another file
    sweep(d)
    assert len(marks(d)) == 1  # a live writer's mark stays
    os.close(m.fd)  # the writer dies without removing it: the kernel releases the lock
    assert [x.live for x in marks(d)] == [False]
    assert vouch(marks(d), now) == "crash"
    assert vouch(marks(d), dict(now, mtime_ns=now["mtime_ns"] + 1)) is None
    sweep(d)
    assert marks(d) == []


def test_a_mark_committing_vouches_after_its_writers_death_only_for_that_transaction(tmp_path):
    _, d = _state(tmp_path)
    now = _file_state(d)
    m = OwnMark.make(d, now, files.PRIVATE)
    m.record(None, committing=now)
    moved = dict(now, size=now["size"] + 4096, mtime_ns=now["mtime_ns"] + 1, ctime_ns=now["ctime_ns"] + 1)
    assert vouch(marks(d), moved) is None  # a live writer inside a commit vouches for nothing
    os.close(m.fd)
    for txnid, want in ((now["txnid"], "crash"), (now["txnid"] + 1, "crash"), (now["txnid"] + 2, None)):
        assert vouch(marks(d), dict(moved, txnid=txnid)) == want, txnid


def test_an_unreadable_or_planted_mark_vouches_for_nothing(tmp_path):
    _, d = _state(tmp_path)
    now = _file_state(d)
    (d / "writer-1-00").write_bytes(b"{not json")
    os.mkfifo(d / "writer-2-00")  # never opened blocking
    (d / "writer-3-00").write_text('{"file": ' + __import__("json").dumps(now) + "}")  # right bytes, nobody's lock
    got = {m.path.name: m for m in marks(d)}
    assert got["writer-1-00"].record is None and "writer-2-00" not in got
    assert vouch([got["writer-1-00"]], now) is None
    assert vouch([got["writer-3-00"]], now) == "crash"  # what a dead writer leaves: the crash check still runs


def test_a_writers_mark_follows_its_commits(tmp_path):
    idx = _index(tmp_path)
    try:
        for i in range(3):
            idx.transact(lambda t: t.set_meta(b"k", str(i).encode()))
            assert vouch(marks(idx.path), _file_state(idx.path)) == "live"
        with idx.env.begin(write=True) as txn:  # a commit outside kvstore's transactions (unmarked)
            txn.put(b"foreign", b"1")
        assert vouch(marks(idx.path), _file_state(idx.path)) is None
        idx.transact(lambda t: t.set_meta(b"k", b"after"))  # starts from a file nobody vouched for
        assert vouch(marks(idx.path), _file_state(idx.path)) is None
    finally:
        idx.close()
    assert marks(idx.path) == []  # a clean close removes the mark
