"""Damaging files, blobs and the LMDB index; filling a disk; tmpfs mounts."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path


def damage_file(path: Path, mode: str, rng: random.Random, *, other: Path | None = None) -> str:
    """Damage one file in place; returns a description. Modes: flip (1-4 random bits),
    flip_head (a bit in the first 64 bytes), flips (8-64 random bytes), zero (a range),
    truncate, empty, delete, append, swap (replace by ``other``)."""
    data = bytearray(path.read_bytes()) if path.exists() else bytearray()
    size = len(data)
    if mode == "delete":
        path.unlink()
        return "deleted"
    if mode == "swap" and other is not None:
        shutil.copyfile(other, path)
        return f"replaced by {other.name}"
    if mode == "append":
        with open(path, "ab") as f:
            f.write(os.urandom(rng.randint(1, 64)))
        return "appended"
    if mode == "empty" or size == 0:
        path.write_bytes(b"")
        return "emptied"
    if mode == "truncate":
        n = rng.randrange(size)
        with open(path, "r+b") as f:
            f.truncate(n)
        return f"truncated to {n} of {size}"
    if mode == "zero":
        a = rng.randrange(size)
        b = min(size, a + rng.randint(1, 4096))
        data[a:b] = bytes(b - a)
        desc = f"zeroed [{a},{b})"
    elif mode == "flip_head":
        off = rng.randrange(min(size, 64))
        data[off] ^= 1 << rng.randrange(8)
        desc = f"bit flip at {off}"
    elif mode == "flips":
        offs = sorted(rng.randrange(size) for _ in range(rng.randint(8, 64)))
        for o in offs:
            data[o] ^= rng.randint(1, 255)
        desc = f"{len(offs)} byte flips in [{offs[0]},{offs[-1]}]"
    else:  # flip
        offs = sorted(rng.randrange(size) for _ in range(rng.randint(1, 4)))
        for o in offs:
            data[o] ^= 1 << rng.randrange(8)
        desc = f"bit flips at {offs}"
    with open(path, "r+b") as f:  # in place (same inode)
        f.write(data)
    return desc


BLOB_MODES = ("flip", "flip", "flip_head", "flips", "zero", "truncate", "empty", "delete", "append", "swap",
              "rename", "stray_blob", "stray_tmp")
LMDB_MODES = ("flip", "flip", "flip", "flips", "flips", "flip_meta", "flip_page_header", "flip_page_header",
              "zero_page", "truncate", "truncate_page", "empty", "delete", "garbage", "lock_flips",
              "lock_delete", "lock_garbage", "index_dir_delete",
              "value_flip", "value_flip", "value_flip:tokens", "value_flip:entries", "value_flip:chunks")


def damage_blob_case(cdir: Path, tpl: dict, rng: random.Random, mode: str) -> tuple[str, set[str]]:
    """Damage one random blob of the case directory as ``mode`` (one of ``BLOB_MODES``) says;
    returns a description and the entry keys whose misses the damage explains."""
    blobs_root = cdir / "blobs"
    users = tpl["blob_users"]
    blob = rng.choice(sorted(users))
    path = blobs_root / blob
    targets = set(users[blob])
    if mode == "swap":
        other = rng.choice([b for b in sorted(users) if b != blob])
        return f"{blob}: {damage_file(path, 'swap', rng, other=blobs_root / other)}", targets
    if mode == "rename":
        new = path.with_name(path.name.split("-")[0] + "-deadbeef.safetensors")
        os.replace(path, new)
        return f"{blob}: renamed to {new.name}", targets
    if mode == "stray_blob":
        src = path
        key = "%032x" % rng.getrandbits(128)
        dst = blobs_root / key[:2] / f"{key}-{rng.getrandbits(32):08x}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        shutil.copyfile(src, dst)
        return f"orphan copy of {blob} at {dst.name}", set()
    if mode == "stray_tmp":
        where = rng.choice([cdir, blobs_root / blob.split("/")[0]])
        tmp = where / f"{path.name}.{rng.randint(100, 99999)}.abcd1234.tmp"
        tmp.write_bytes(os.urandom(rng.randint(0, 5000)))
        return f"stray temp file {tmp.relative_to(cdir)}", set()
    return f"{blob}: {damage_file(path, mode, rng)}", targets


def flip_record(idx: Path, rng: random.Random, dbname: str | None = None) -> str:
    """A bit flip inside one stored value (a record, token ids, a trie edge), written through
    LMDB: what a flip LMDB cannot detect looks like to kvstore."""
    import lmdb
    env = lmdb.open(str(idx), max_dbs=16, subdir=True)
    try:
        names = [dbname] if dbname else ["entries", "entries", "chunks", "tokens", "tokens", "bounds", "meta"]
        name = rng.choice(names)
        db = env.open_db(name.encode(), create=False)
        with env.begin(write=True) as txn:
            items = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
            if not items:
                return f"{name}: empty"
            k, v = rng.choice(items)
            if not v:
                return f"{name}: empty value"
            buf = bytearray(v)
            off = rng.randrange(len(buf))
            buf[off] ^= 1 << rng.randrange(8)
            txn.put(k, bytes(buf), db=db)
            return f"{name}[{k.hex()[:12]}] byte {off} of {len(buf)}: {v[max(0, off - 12):off + 12]!r} -> {bytes(buf[max(0, off - 12):off + 12])!r}"
    finally:
        env.close()


def damage_lmdb_case(cdir: Path, rng: random.Random, mode: str) -> str:
    """Damage the case directory's index as ``mode`` (one of ``LMDB_MODES``) says; returns
    a description."""
    idx = cdir / "index"
    data, lock = idx / "data.mdb", idx / "lock.mdb"
    size = data.stat().st_size
    pages = max(1, size // 4096)
    if mode.startswith("value_flip"):
        return flip_record(idx, rng, mode.split(":")[1] if ":" in mode else None)
    if mode == "index_dir_delete":
        shutil.rmtree(idx)
        return "index/ removed"
    if mode.startswith("lock_"):
        if not lock.exists():
            return "no lock.mdb"
        m = {"lock_flips": "flips", "lock_delete": "delete", "lock_garbage": "garbage"}[mode]
        if m == "garbage":
            lock.write_bytes(os.urandom(lock.stat().st_size))
            return "lock.mdb: random bytes"
        return "lock.mdb: " + damage_file(lock, m, rng)
    if mode == "garbage":
        data.write_bytes(os.urandom(size))
        return "data.mdb: random bytes"
    if mode == "truncate_page":
        n = rng.randrange(pages) * 4096
        os.truncate(data, n)
        return f"data.mdb truncated to page {n // 4096} of {pages}"
    if mode in ("flip_meta", "flip_page_header", "zero_page"):
        buf = bytearray(data.read_bytes())
        if mode == "flip_meta":
            off = rng.choice([0, 4096]) + rng.randrange(160)
            buf[off] ^= 1 << rng.randrange(8)
            desc = f"meta page bit flip at {off}"
        elif mode == "flip_page_header":
            page = rng.randrange(2, max(3, pages))
            off = page * 4096 + rng.randrange(16)
            if off >= len(buf):
                off = rng.randrange(len(buf))
            buf[off] ^= 1 << rng.randrange(8)
            desc = f"page header bit flip at {off} (page {off // 4096})"
        else:
            page = rng.randrange(2, max(3, pages))
            a = min(page * 4096, max(0, len(buf) - 4096))
            buf[a : a + 4096] = bytes(len(buf[a : a + 4096]))
            desc = f"page {a // 4096} zeroed"
        with open(data, "r+b") as f:
            f.write(buf)
        return "data.mdb: " + desc
    return "data.mdb: " + damage_file(data, mode, rng)


def damage_open_file(path: Path, rng: random.Random) -> list[str]:
    """1-6 bit flips and zeroed ranges written in place through a descriptor (what a
    store that has the file open and mapped sees change under it); returns descriptions."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    descs = []
    try:
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.3:
                page = rng.randrange(2, max(3, size // 4096))
                a, b = page * 4096 + rng.randrange(4096), 0
                b = min(size, a + rng.randint(16, 1024))
                os.pwrite(fd, bytes(b - a), a)
                descs.append(f"zero [{a},{b})")
            else:
                off = rng.randrange(size)
                cur = os.pread(fd, 1, off)
                os.pwrite(fd, bytes([cur[0] ^ (1 << rng.randrange(8))]), off)
                descs.append(f"flip {off}")
    finally:
        os.close(fd)
    return descs


def _fill(path: Path, nbytes: int) -> int:
    """Write up to ``nbytes`` into ``path`` (stops at ENOSPC); returns bytes written."""
    done = 0
    block = b"\xa5" * (64 << 10)
    try:
        f = open(path, "ab", buffering=0)  # unbuffered: nothing left to fail at close
    except OSError:  # not even room for the file
        return 0
    with f:
        while done < nbytes:
            try:
                n = f.write(block[: min(len(block), nbytes - done)])
            except OSError:
                break
            if not n:
                break
            done += n
    return done


def _mount_tmpfs(path: Path, size: str = "4m") -> str | None:
    """Mount a tmpfs at ``path``; returns an error message if that is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return None if p.returncode == 0 else f"mount failed: {p.stderr.strip()}"


def _umount(path: Path) -> None:
    """Lazy unmount (a worker may still hold a file open)."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
