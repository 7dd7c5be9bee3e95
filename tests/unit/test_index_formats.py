"""kvstore.index.formats: another format is read without LMDB and refused unchanged;
set aside whole; reclaimed without following what is planted."""

from __future__ import annotations

import os

import lmdb
import pytest

from kvstore import files
from kvstore.index import FormatError, Index
from kvstore.index.formats import reclaim, set_aside, set_aside_stores, stored_format


def _store(root, fmt: bytes):
    (root / "blobs" / "ab").mkdir(parents=True)
    (root / "blobs" / "ab" / "old.kvpack").write_bytes(b"pack")
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", fmt, db=env.open_db(b"meta", txn=txn))
    env.close()
    os.unlink(root / "index" / "lock.mdb")
    return root


def test_another_format_is_refused_before_anything_is_written(tmp_path):
    root = _store(tmp_path, b"3")
    assert stored_format(root / "index" / "data.mdb") == 3
    before = sorted(p.name for p in (root / "index").iterdir()), (root / "index" / "data.mdb").read_bytes()
    for readonly in (True, False):
        with pytest.raises(FormatError) as e:
            Index(root, readonly=readonly)
        assert e.value.found == 3 and "has format 3" in str(e.value)
    assert (sorted(p.name for p in (root / "index").iterdir()), (root / "index" / "data.mdb").read_bytes()) == before


def test_a_store_is_set_aside_whole_and_reclaimed(tmp_path):
    root = _store(tmp_path, b"2")
    moved = set_aside(root, 2, 4, files.PRIVATE)
    assert moved is not None and moved[1] > 0
    aside = moved[0]
    assert (aside / "blobs" / "ab" / "old.kvpack").read_bytes() == b"pack" and (aside / "index" / "data.mdb").is_file()
    assert sorted(os.listdir(root / "index")) == [] and sorted(os.listdir(root / "blobs")) == []
    assert set_aside(root, 2, 4, files.PRIVATE) is None  # already moved: another opener's is not moved twice
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    os.symlink(outside, root / "format-7-planted")
    (root / "format-8-file").write_text("a file, not a store")
    assert [p for p, _ in set_aside_stores(root)] == [aside]
    assert [p for p, _ in reclaim(root, dry_run=True)] == [aside] and aside.is_dir()
    assert [p for p, _ in reclaim(root)] == [aside]
    assert not aside.exists() and (outside / "keep").is_file() and (root / "format-8-file").is_file()


def test_a_damaged_or_foreign_file_has_no_format(tmp_path):
    data = tmp_path / "data.mdb"
    for junk in (b"", b"\0" * 8192, os.urandom(16384)):
        data.write_bytes(junk)
        assert stored_format(data) is None
