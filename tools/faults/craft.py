"""Crafting hostile cache directories: what someone else may put in or around one.

Shared by the ``hostile`` fault kind and ``tests/test_trust.py``. Everything here works
on real files and the real LMDB index (records written with ``lmdb`` directly, as another
program would), never through kvstore's own write path, except where a test needs a
segment kvstore would accept byte for byte (``pack_with``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Iterator

import xxhash


@contextlib.contextmanager
def lmdb_txn(cache_dir: Path) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A write transaction on the index of ``cache_dir`` opened with ``lmdb`` itself, and
    its named databases: what another program editing the index sees."""
    import lmdb

    from kvstore.index import DBS
    idx = Path(cache_dir) / "index"
    size = max(64 << 20, 2 * (idx / "data.mdb").stat().st_size)
    env = lmdb.open(str(idx), max_dbs=16, subdir=True, map_size=size)
    try:
        dbs = {name: env.open_db(name.encode()) for name in DBS}
        with env.begin(write=True) as txn:
            yield txn, dbs
    finally:
        env.close()


def put_raw(cache_dir: Path, db: str, key: bytes, value: bytes) -> None:
    """Store ``value`` under ``key`` in database ``db``, bytes as given."""
    with lmdb_txn(cache_dir) as (txn, dbs):
        txn.put(key, value, db=dbs[db])


def read_raw(cache_dir: Path, db: str) -> dict[bytes, bytes]:
    """Every key / value of database ``db``."""
    with lmdb_txn(cache_dir) as (txn, dbs):
        return {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs[db])}


def tree_state(root: Path) -> dict[str, str]:
    """What is below ``root``, without following symlinks or opening anything but regular
    files: relative path -> xxh3 of a regular file, ``link:<target>``, ``fifo``, ``dir``
    or another type name. Equal states mean nothing there was changed, added or removed."""
    out: dict[str, str] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            rel = str(p.relative_to(root))
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out[rel] = xxhash.xxh3_64_hexdigest(p.read_bytes())
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = f"link:{os.readlink(p)}"
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = "fifo"
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            else:
                out[rel] = f"mode:{st.st_mode:o}"
    return out


def user_files(where: Path, like: list[Path]) -> dict[str, str]:
    """A directory of someone's files next to a cache directory: notes, and copies of
    pack files ``like`` under their own names (what a crafted record or a symlink would
    have kvstore read or remove). Returns its ``tree_state``."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "notes.txt").write_text("my own file: kvstore must never touch it\n")
    (where / "thesis.pdf").write_bytes(os.urandom(3000))
    for p in like:
        shutil.copyfile(p, where / p.name)
    return tree_state(where)


def packs(cache_dir: Path) -> list[Path]:
    """kvstore's pack files under ``cache_dir/blobs`` (regular files, in path order)."""
    return sorted(p for p in (Path(cache_dir) / "blobs").glob("*/*.kvpack") if p.is_file() and not p.is_symlink())
