"""Damaging files, blobs and the LMDB index; filling a disk; tmpfs mounts."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Callable


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
              "rename", "stray_pack", "stray_tmp", "misplaced_pack")
IN_SEGMENT = ("flip", "flip_head", "flips", "zero")  # damage inside the bytes of one segment
LMDB_MODES = ("flip", "flip", "flip", "flips", "flips", "flip_meta", "flip_page_header", "flip_page_header",
              "zero_page", "truncate", "truncate_page", "empty", "delete", "garbage", "lock_flips",
              "lock_delete", "lock_garbage", "index_dir_delete",
              "value_flip", "value_flip", "value_flip:tokens", "value_flip:entries", "value_flip:chunks",
              "value_flips:entries", "value_flips:chunks", "value_flip:packs", "value_flip:identities",
              "value_truncate:entries", "value_truncate:chunks", "value_truncate:packs", "value_zero:entries")

Seg = dict  # {"pack": path relative to the cache directory, "offset", "length", "users": [entry key hex]}


def damage_in_segment(path: Path, offset: int, length: int, mode: str, rng: random.Random) -> str:
    """Damage bytes inside one segment of a pack file, in place (same inode): ``flip`` 1-4
    bits, ``flip_head`` a bit of its first 64 bytes (header length or JSON header),
    ``flips`` 8-64 bytes, ``zero`` a range of up to 4 KiB. Every byte of a segment is
    covered by its checksum, so each of these damages exactly that segment."""
    fd = os.open(path, os.O_RDWR)
    try:
        if mode == "zero":
            a = offset + rng.randrange(length)
            b = min(offset + length, a + rng.randint(1, 4096))
            if not any(os.pread(fd, b - a, a)):  # already zero: flip one of them instead
                os.pwrite(fd, b"\x01", a)
                return f"set byte {a} (of a zero range) in segment @{offset}+{length}"
            os.pwrite(fd, bytes(b - a), a)
            return f"zeroed [{a},{b}) in segment @{offset}+{length}"
        if mode == "flip_head":
            offs = [offset + rng.randrange(min(length, 64))]
        elif mode == "flips":
            offs = sorted({offset + rng.randrange(length) for _ in range(rng.randint(8, 64))})
        else:
            offs = sorted({offset + rng.randrange(length) for _ in range(rng.randint(1, 4))})
        for o in offs:
            cur = os.pread(fd, 1, o)[0]
            new = cur ^ (rng.randint(1, 255) if mode == "flips" else 1 << rng.randrange(8))
            os.pwrite(fd, bytes([new]), o)
        return f"{mode} at {offs[:6]}{'...' if len(offs) > 6 else ''} in segment @{offset}+{length}"
    finally:
        os.close(fd)


def _users(segs: list[Seg]) -> set[str]:
    return {u for s in segs for u in s["users"]}


def damage_segments(cdir: Path, segs: list[Seg], n: int, rng: random.Random,
                    excuse: Callable[[set[str]], None]) -> None:
    """Damage up to ``n`` of ``segs`` (``check.segment_users``): flip or zero bytes inside
    the segment, or truncate or delete its whole pack file. Before each step touches a
    file, ``excuse`` gets the entry keys (hex) that step can cost: the segment's users, or
    every user of the pack. So a failure or kill between steps never leaves damage done
    and unexcused. A segment whose pack an earlier step truncated or deleted is passed
    over: its users are excused already, and its bytes may no longer exist (flipping a
    byte past the end of a truncated file raised IndexError in the middle of the damage,
    and the trial lost the excuses of the steps before it)."""
    whole: set[str] = set()
    for seg in rng.sample(segs, min(n, len(segs))):
        path = cdir / seg["pack"]
        if seg["pack"] in whole or not path.exists():
            continue
        mode = rng.choice(["flip", "truncate", "delete", "zero"])
        if mode in IN_SEGMENT:  # its users now, and any entry that shares it later (``segment_target``)
            excuse(set(seg["users"]) | {segment_target(seg)})
            damage_in_segment(path, seg["offset"], seg["length"], mode, rng)
        else:
            whole.add(seg["pack"])
            excuse(_users([s for s in segs if s["pack"] == seg["pack"]]))
            damage_file(path, mode, rng)


def segment_target(seg: Seg) -> str:
    """A damaged segment as a check target: every entry that uses it when the check runs
    is explained, including one a later persist built on it (a persist shares an indexed
    chunk without reading its bytes: damage inside a file is a read's to find)."""
    return f"segment:{seg['pack']}@{seg['offset']}"


def _new_pack_name(rng: random.Random) -> str:
    h = "%032x" % rng.getrandbits(128)
    return f"{h[:2]}/{h}.kvpack"


def damage_pack_case(cdir: Path, segs: list[Seg], rng: random.Random, mode: str
                     ) -> tuple[str, set[str], dict[str, str]]:
    """Damage the pack files of a case directory as ``mode`` (one of ``BLOB_MODES``) says:
    inside one segment (``IN_SEGMENT``), or a whole pack (truncated inside a segment,
    emptied, deleted, appended to, swapped with another, renamed), or stray files added
    (a copy under a new pack name, ``*.tmp`` files, a pack in the wrong place). Returns a
    description, the entry keys whose misses the damage explains, and the files kvstore
    did not write (relative path -> xxh3) that must survive untouched."""
    seg = rng.choice(segs)
    path = cdir / seg["pack"]
    pack = [s for s in segs if s["pack"] == seg["pack"]]
    if mode in IN_SEGMENT:
        return damage_in_segment(path, seg["offset"], seg["length"], mode, rng), set(seg["users"]), {}
    if mode == "truncate":
        cut = seg["offset"] + rng.randrange(seg["length"])
        os.truncate(path, cut)
        return f"{seg['pack']} truncated to {cut}", _users([s for s in pack if s["offset"] + s["length"] > cut]), {}
    if mode == "swap":
        other = rng.choice(sorted({s["pack"] for s in segs} - {seg["pack"]}))
        tmp = path.with_name("swap-in-progress")
        os.replace(path, tmp)
        os.replace(cdir / other, path)
        os.replace(tmp, cdir / other)
        return f"{seg['pack']} swapped with {other}", _users(pack) | _users([s for s in segs if s["pack"] == other]), {}
    if mode in ("rename", "stray_pack"):
        new = cdir / "blobs" / _new_pack_name(rng)
        new.parent.mkdir(mode=0o700, exist_ok=True)
        (os.replace if mode == "rename" else shutil.copyfile)(path, new)
        targets = _users(pack) if mode == "rename" else set()
        return f"{seg['pack']} {mode}: now also at {new.relative_to(cdir)}", targets, {}
    if mode in ("stray_tmp", "misplaced_pack"):
        return _plant_stray(cdir, seg, path, rng, mode)
    return f"{seg['pack']}: {damage_file(path, mode, rng)}", _users(pack), {}


def _plant_stray(cdir: Path, seg: Seg, path: Path, rng: random.Random, mode: str
                 ) -> tuple[str, set[str], dict[str, str]]:
    """Files kvstore did not write, next to its own: a ``*.tmp`` file (in a fan-out
    directory or the cache root), or a copy of a pack under a pack-like name in the wrong
    fan-out directory or with another suffix. They are reported and never touched."""
    import xxhash
    if mode == "stray_tmp":
        where = rng.choice([cdir, path.parent, cdir / "blobs"])
        stray = where / f"{path.name}.{rng.randint(100, 99999)}.abcd1234.tmp"
        stray.write_bytes(os.urandom(rng.randint(0, 5000)))
    else:
        h = "%032x" % rng.getrandbits(128)
        wrong_dir = "%02x" % ((int(h[:2], 16) + 1) % 256)
        stray = rng.choice([cdir / "blobs" / wrong_dir / f"{h}.kvpack", path.with_name(f"{h}.kvpack.bak"),
                            cdir / "blobs" / f"{h}.kvpack"])
        stray.parent.mkdir(mode=0o700, exist_ok=True)
        shutil.copyfile(path, stray)
    rel = str(stray.relative_to(cdir))
    return f"stray file {rel}", set(), {rel: xxhash.xxh3_64_hexdigest(stray.read_bytes())}


def damage_record(idx: Path, rng: random.Random, how: str = "flip", dbname: str | None = None) -> str:
    """Damage one stored value (a binary record, token ids, a trie edge, a counter),
    written through LMDB: what damage LMDB cannot detect looks like to kvstore. ``how``:
    ``flip`` one bit, ``flips`` 2-8 bytes, ``truncate`` the value to a shorter length,
    ``zero`` a range of it."""
    import lmdb
    env = lmdb.open(str(idx), max_dbs=16, subdir=True, map_size=max(64 << 20, 2 * (idx / "data.mdb").stat().st_size))
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
            buf, desc = _damaged_value(bytearray(v), how, rng)
            txn.put(k, bytes(buf), db=db)
            return f"{name}[{k.hex()[:12]}] {desc} (of {len(v)} bytes)"
    finally:
        env.close()


def _damaged_value(buf: bytearray, how: str, rng: random.Random) -> tuple[bytearray, str]:
    """``buf`` damaged as ``damage_record`` says, and a description."""
    if how == "truncate":
        n = rng.randrange(len(buf))
        return buf[:n], f"truncated to {n}"
    if how == "zero":
        a = rng.randrange(len(buf))
        b = min(len(buf), a + rng.randint(1, 16))
        buf[a:b] = bytes(b - a)
        return buf, f"zeroed [{a},{b})"
    offs = sorted({rng.randrange(len(buf)) for _ in range(rng.randint(2, 8) if how == "flips" else 1)})
    before = bytes(buf)
    for off in offs:
        buf[off] ^= rng.randint(1, 255) if how == "flips" else 1 << rng.randrange(8)
    o = offs[0]
    return buf, f"{how} at {offs}: {before[max(0, o - 8):o + 8]!r} -> {bytes(buf[max(0, o - 8):o + 8])!r}"


def damage_lmdb_case(cdir: Path, rng: random.Random, mode: str) -> str:
    """Damage the case directory's index as ``mode`` (one of ``LMDB_MODES``) says; returns
    a description."""
    idx = cdir / "index"
    data, lock = idx / "data.mdb", idx / "lock.mdb"
    size = data.stat().st_size
    pages = max(1, size // 4096)
    if mode.startswith("value_"):
        how, _, db = mode[len("value_"):].partition(":")
        return damage_record(idx, rng, how, db or None)
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


def fill(path: Path, nbytes: int) -> int:
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


def mount_tmpfs(path: Path, size: str = "4m") -> str | None:
    """Mount a tmpfs at ``path``; returns an error message if that is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return None if p.returncode == 0 else f"mount failed: {p.stderr.strip()}"


def umount(path: Path) -> None:
    """Lazy unmount (a worker may still hold a file open)."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True)
