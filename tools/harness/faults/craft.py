"""Crafting hostile cache directories: what someone else may put in or around one.

Shared by the ``hostile`` fault kind and ``tests/system/test_trust.py``. Everything here works
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


def records(cache_dir: Path, db: str) -> dict[bytes, Any]:
    """Every record of database ``db`` parsed as kvstore parses it (None: one kvstore
    would not read)."""
    from kvstore.records import RecordError, parse
    out: dict[bytes, Any] = {}
    for k, v in read_raw(cache_dir, db).items():
        try:
            out[k] = parse(db, v)
        except RecordError:
            out[k] = None
    return out


def frame_of(data: bytes) -> tuple[dict, bytes]:
    """A segment's bytes split into its parsed safetensors header and its data."""
    import json
    import struct
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def reframed(header: dict, body: bytes) -> bytes:
    """A segment from a header (JSON object) and its data, padded as kvstore pads."""
    from kvstore.segments import header_prefix
    return header_prefix(header) + body


def new_pack(cache_dir: Path, segments: list[bytes], created: float) -> list[Any]:
    """Write a pack file holding ``segments`` back to back under a new random name, the
    way kvstore lays one out, and index it (a PackRecord written with lmdb). Returns
    the ``Segment`` of each, with its true xxh3-128: a pack kvstore would accept byte
    for byte, whatever its headers say."""
    from kvstore.files import pack_path
    from kvstore.records import PackRecord, Segment
    pack = os.urandom(16)
    path = pack_path(Path(cache_dir) / "blobs", pack)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    out, offset = [], 0
    for data in segments:
        out.append(Segment(pack, offset, len(data), xxhash.xxh3_128_digest(data)))
        offset += len(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(segments))
    size = sum(len(d) for d in segments)
    put_raw(cache_dir, "packs", pack, PackRecord(size, len(segments), size, created).to_bytes())
    return out


def segment_bytes(cache_dir: Path, seg: Any) -> bytes:
    """The bytes of segment ``seg`` as they are in its pack file."""
    from kvstore.files import pack_path
    with open(pack_path(Path(cache_dir) / "blobs", seg.pack), "rb") as f:
        f.seek(seg.offset)
        return f.read(seg.length)


def swap_tensors_keep_stat(weights: Path, a: str, b: str) -> None:
    """Exchange the data of tensors ``a`` and ``b`` (same shape and dtype) of a
    safetensors file in place: different weights of the same size, with the file's old
    atime / mtime put back (what ``cp -p``, ``rsync -a`` and ``touch -r`` do)."""
    import json
    import struct
    st = weights.stat()
    raw = bytearray(weights.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    (a0, a1), (b0, b1) = (header[t]["data_offsets"] for t in (a, b))
    assert a1 - a0 == b1 - b0 and header[a]["shape"] == header[b]["shape"], (a, b)
    base = 8 + n
    ta, tb = bytes(raw[base + a0 : base + a1]), bytes(raw[base + b0 : base + b1])
    assert ta != tb, "the two tensors are equal: swapping them changes nothing"
    raw[base + a0 : base + a1], raw[base + b0 : base + b1] = tb, ta
    with open(weights, "r+b") as f:  # in place: same inode, same size
        f.write(raw)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
