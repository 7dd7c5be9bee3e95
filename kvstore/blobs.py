"""The blob format and kvstore's own files: pack files of safetensors segments.

A persist writes ONE pack file holding every new segment of the entry (its new chunks and
its tail or snapshot). Each segment is a complete safetensors buffer (8-byte little-endian
header length, JSON header with dtype / shape / data_offsets and ``__metadata__``, raw data),
so any safetensors reader opens a segment cut out of its pack; its xxh3-128 is its checksum.
kvstore writes and parses the framing itself: it streams KV views straight to the file while
hashing them, and reads a file straight into the memory of the arrays it restores.

Guarantees:
- Only kvstore's own files (``pack_path``, ``open_own``, ``own_packs``): a pack's name is
  derived from 16 random bytes, never from a string in a record; kvstore opens, reads and
  unlinks only regular files under ``blobs/<2 hex>/`` named ``<32 hex>.kvpack``, never
  follows a symlink there (``blobs/``, the fan-out directory and the file are each reached
  with ``O_NOFOLLOW``, through directory descriptors) and never waits on a FIFO or device
  (non-blocking open, ``S_ISREG`` checked on the open descriptor).
- Every file kvstore creates is made by ``create`` (``O_EXCL | O_NOFOLLOW | O_NONBLOCK``:
  never through a symlink, never blocking on a FIFO, never an existing file), files it
  replaces by ``replace_file`` (a new file at an unpredictable temp name, renamed over),
  and every file and directory follows the cache directory's sharing mode (``Modes``).
- ``PackWriter`` writes a new, never reused name (``O_EXCL``): a crash leaves at most an
  unnamed file, which the index never points at. ``seal`` makes it durable (file and
  directory synced; on macOS ``F_BARRIERFSYNC``, which orders it before the index commit
  that names it, at a fraction of ``F_FULLFSYNC``'s cost) before any record names it.
- ``read_into`` / ``SegmentRead`` hand back nothing unverified: a size, header or checksum
  mismatch raises ``BlobError``, and the caller drops the arrays it was filling.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import xxhash

from .keys import KEY_BYTES
from .records import Segment

if TYPE_CHECKING:
    import numpy as np

PACK_SUFFIX = ".kvpack"
_PACK_NAME = re.compile(r"([0-9a-f]{2})[0-9a-f]{30}\.kvpack")
_FANOUT = re.compile(r"[0-9a-f]{2}")
MAX_HEADER = 16 << 20  # bytes of one segment's JSON header
_PIECE = 1 << 20       # bytes read (or written) and hashed at a time: still in cache when hashed
_SPAN = 4 << 20        # bytes of one restore read task: a segment is read by several at once
_IOV_MAX = 512

# mlx dtype name -> (safetensors dtype, numpy dtype used on the host side)
_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"), "float16": ("F16", "<f2"), "bfloat16": ("BF16", "<u2"),
    "float64": ("F64", "<f8"), "int8": ("I8", "i1"), "uint8": ("U8", "u1"),
    "int16": ("I16", "<i2"), "uint16": ("U16", "<u2"), "int32": ("I32", "<i4"),
    "uint32": ("U32", "<u4"), "int64": ("I64", "<i8"), "uint64": ("U64", "<u8"),
    "bool": ("BOOL", "?"),
}
_FROM_ST = {st: (name, npd) for name, (st, npd) in _DTYPES.items()}

Specs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape), file order


class BlobError(Exception):
    """A blob is missing, truncated, corrupt, not kvstore's, or not what its record says."""

    # set by the disk tier's restore: ("entry" | "chunk", key) of the record that failed
    record: tuple[str, bytes] | None = None
    # set when the segment's own header names another record: the record lies about it,
    # so dropping the record must not release the segment (another record owns it)
    foreign: bool = False


# ----------------------------------------------------------------------------- files


def pack_path(blob_root: Path, pack: bytes) -> Path:
    """The one path pack ``pack`` (16 bytes) may have: ``blobs/<2 hex>/<32 hex>.kvpack``."""
    if len(pack) != KEY_BYTES:
        raise BlobError(f"a pack id is {KEY_BYTES} bytes, got {len(pack)}")
    h = pack.hex()
    return blob_root / h[:2] / f"{h}{PACK_SUFFIX}"


# What an open of kvstore's own path may meet that means "this is not kvstore's file":
# a symlink (O_NOFOLLOW), a non-directory where a directory belongs, a directory where a
# file belongs. Anything else (EMFILE, ENFILE, ENOMEM, EIO, EACCES, ...) says nothing
# about the file: it is raised as the OSError it is, so no caller drops a record for it.
_NOT_OURS = (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO)


def _refuse(e: OSError, what: str) -> BlobError:
    """BlobError for an open refused because the path is not kvstore's; re-raise ``e``
    when the error is about the process or the system, not the path."""
    if e.errno not in _NOT_OURS:
        raise e
    why = "a symlink" if e.errno == errno.ELOOP else e.strerror
    return BlobError(f"{what} ({why})")


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _fanout_fd(path: Path) -> int:
    """A descriptor of the fan-out directory of pack path ``path`` (``blobs/<2 hex>/``),
    reached without following a symlink at ``blobs/`` or at the fan-out directory (a
    symlink there would lead kvstore to read or remove someone else's files); BlobError
    otherwise."""
    try:
        root = os.open(path.parent.parent, _DIR_FLAGS)
    except FileNotFoundError:
        raise BlobError(f"{path.name}: blob file is missing") from None
    except OSError as e:
        raise _refuse(e, f"{path.parent.parent}: not kvstore's directory") from None
    try:
        return os.open(path.parent.name, _DIR_FLAGS, dir_fd=root)
    except FileNotFoundError:
        raise BlobError(f"{path.name}: blob file is missing") from None
    except OSError as e:
        raise _refuse(e, f"{path.parent.name}/: not kvstore's directory") from None
    finally:
        os.close(root)


def open_own(path: Path) -> int:
    """A read-only descriptor of pack file ``path`` if it is a regular file reached without
    following a symlink anywhere under the cache directory (``blobs/``, its fan-out
    directory, the file); BlobError otherwise (missing, a symlink, a FIFO, a device, a
    directory). Never blocks: the open is non-blocking, the type checked on it."""
    dfd = _fanout_fd(path)
    try:
        return open_regular(Path(path.name), dir_fd=dfd)
    finally:
        os.close(dfd)


def unlink_own(path: Path) -> bool:
    """Remove pack file ``path`` if it is kvstore's: a regular file reached as ``open_own``
    reaches one. Anything else there (a symlink, a FIFO, a directory, or a path through a
    symlinked directory) is left alone. True if no pack file is left at ``path``."""
    try:
        dfd = _fanout_fd(path)
    except BlobError:
        return not os.path.lexists(path)
    try:
        if not stat.S_ISREG(os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_mode):
            return False
        os.unlink(path.name, dir_fd=dfd)
    except FileNotFoundError:
        pass
    finally:
        os.close(dfd)
    return True


def open_regular(path: Path, *, dir_fd: int | None = None) -> int:
    """A read-only descriptor of ``path`` (relative to ``dir_fd`` if given) if it is a
    regular file reached without following a symlink at its last component; BlobError
    otherwise. Never blocks on a FIFO or a device: the open is non-blocking, the type
    checked on the open descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise BlobError(f"{path.name}: blob file is missing") from None
    except OSError as e:
        raise _refuse(e, f"{path.name}: not kvstore's file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BlobError(f"{path.name}: not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


MAX_FOREIGN = 64 << 20  # bytes ``read_foreign`` reads of a file kvstore did not write


def open_foreign(path: Path, *, follow: bool = True) -> int:
    """A blocking read-only descriptor of a file kvstore did not write (a model
    directory's config, tokenizer, weights, code; a file a record's metadata names) if it
    is a regular file; OSError otherwise (EINVAL for a FIFO, device, socket or directory).
    The open itself never blocks on a FIFO or device: it is non-blocking, the type checked
    on the open descriptor. ``follow=False`` refuses a symlink at the last component
    (ELOOP); hub snapshots are made of symlinks, so model files follow them."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_foreign(path: Path, *, follow: bool = True, limit: int = MAX_FOREIGN) -> bytes:
    """The bytes of a file kvstore did not write, opened by ``open_foreign``; OSError
    (EFBIG) when it holds more than ``limit`` bytes, which no metadata file does."""
    fd = open_foreign(path, follow=follow)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
    return data


def special_files(directory: Path) -> list[Path]:
    """The entries of ``directory`` (not recursive) that are FIFOs, devices or sockets,
    symlinks followed: what a library opening the directory's files would block on."""
    out = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    mode = e.stat().st_mode
                except OSError:
                    continue
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    out.append(Path(e.path))
    except OSError:
        pass
    return out


def real_dir(path: Path) -> bool:
    """``path`` is a directory itself, not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class Modes:
    """How kvstore creates every file and directory of one cache directory (the one
    helper for it: ``Modes.of``). Private: files 0600, directories 0700, a stricter umask
    wins. Shared with a group (``--shared-dir``): files 0660, directories 2770 exactly,
    whatever the creator's umask, and owned by the cache directory's group (``gid``), so
    every member of that group can read and write what any member created."""

    file: int = 0o600
    dir: int = 0o700
    gid: int | None = None  # shared: the cache directory's group

    @classmethod
    def of(cls, root: Path, shared: bool) -> "Modes":
        """The modes for cache directory ``root`` (which must exist when ``shared``)."""
        return cls(0o660, 0o2770, os.stat(root).st_gid) if shared else cls()

    def apply(self, fd: int) -> None:
        """Give a file or directory kvstore just created (open on ``fd``) the shared
        group and mode; nothing for a private directory (the umask applied at create)."""
        if self.gid is None:
            return
        if os.fstat(fd).st_gid != self.gid:
            os.fchown(fd, -1, self.gid)
        os.fchmod(fd, self.dir if stat.S_ISDIR(os.fstat(fd).st_mode) else self.file)


PRIVATE = Modes()
_NEW_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK
              | getattr(os, "O_CLOEXEC", 0))


def create(path: Path | str, modes: Modes = PRIVATE, *, dir_fd: int | None = None) -> int:
    """A write descriptor of a NEW regular file at ``path`` (relative to ``dir_fd`` if
    given), made with ``modes``: the one way kvstore creates a file. ``O_EXCL`` and
    ``O_NOFOLLOW``: anything already there (a file, a symlink, a FIFO) is an error, never
    opened, followed or waited on (FileExistsError)."""
    fd = os.open(path, _NEW_FLAGS, modes.file, dir_fd=dir_fd)
    try:
        os.set_blocking(fd, True)
        modes.apply(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def temp_name(path: Path) -> Path:
    """A name beside ``path`` nobody can predict (``<name>.<16 random hex>.tmp``)."""
    return path.with_name(f"{path.name}.{os.urandom(8).hex()}.tmp")


TEMP_NAME = re.compile(r".+\.[0-9a-f]{16}\.tmp")


def replace_file(path: Path, data: bytes, modes: Modes = PRIVATE) -> None:
    """Put ``data`` at ``path`` atomically: written to a new file at an unpredictable
    temp name (``create``), then renamed over ``path`` (a rename replaces whatever is at
    ``path``, a symlink or FIFO included, without following or opening it). OSError if
    it cannot; nothing is left at the temp name then."""
    tmp = temp_name(path)
    fd = create(tmp, modes)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def make_dir(path: Path, modes: Modes = PRIVATE) -> bool:
    """Create directory ``path`` (parent must exist) with ``modes``; True if it was created.
    An existing symlink or file there raises BlobError: kvstore never writes through one."""
    try:
        os.mkdir(path, modes.dir)
    except FileExistsError:
        if not real_dir(path):
            raise BlobError(f"{path} exists and is not a directory of kvstore's (a symlink or a file)") from None
        return False
    if modes.gid is not None:
        fd = os.open(path, _DIR_FLAGS)
        try:
            modes.apply(fd)
        finally:
            os.close(fd)
    return True


@dataclass(frozen=True)
class OwnFile:
    """A pack file found under ``blobs/``: its id, path and ``lstat``."""

    pack: bytes
    path: Path
    st: os.stat_result


def own_packs(blob_root: Path) -> tuple[list[OwnFile], list[Path]]:
    """(kvstore's pack files, every other entry) under ``blob_root``, found without following
    any symlink: ``blob_root`` and its fan-out directories must be real directories, a file
    is kvstore's only if it is a regular file named as ``pack_path`` names it. Others are
    listed so they can be reported, and are never opened, renamed or unlinked."""
    if not real_dir(blob_root):
        return [], ([blob_root] if os.path.lexists(blob_root) else [])
    own: list[OwnFile] = []
    foreign: list[Path] = []
    for sub in _scan(blob_root):
        if not (_FANOUT.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
            foreign.append(Path(sub.path))
            continue
        for f in _scan(Path(sub.path)):
            m = _PACK_NAME.fullmatch(f.name)
            try:
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if m and m.group(1) == sub.name and stat.S_ISREG(st.st_mode):
                own.append(OwnFile(bytes.fromhex(f.name[: 2 * KEY_BYTES]), Path(f.path), st))
            else:
                foreign.append(Path(f.path))
    return own, foreign


def _scan(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def sync(fd: int) -> None:
    """Make what was written to ``fd`` durable before anything written after it: fsync;
    on macOS ``F_BARRIERFSYNC`` (an ordering barrier: the index commit that follows cannot
    reach the disk before this file does), falling back to ``F_FULLFSYNC``, then fsync."""
    if sys.platform == "darwin":
        import fcntl

        for op in (getattr(fcntl, "F_BARRIERFSYNC", 85), fcntl.F_FULLFSYNC):
            try:
                fcntl.fcntl(fd, op)
                return
            except OSError:
                continue
    os.fsync(fd)


def sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        sync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- framing


def _dtype_name(d: Any) -> str:
    return str(d).split(".")[-1]


def host_views(tensors: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Prepare MLX tensors for a writer thread: ``name -> (safetensors dtype, evaluated
    array)``. Runs on the caller's thread (MLX ops stay there); bfloat16 becomes a free
    uint16 view so the writer needs nothing but numpy's buffer protocol."""
    import mlx.core as mx

    out: dict[str, tuple[str, Any]] = {}
    for name, a in tensors.items():
        dn = _dtype_name(a.dtype)
        if dn not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {dn}, which blobs cannot hold")
        out[name] = (_DTYPES[dn][0], a.view(mx.uint16) if dn == "bfloat16" else a)
    mx.eval([a for _, a in out.values()])
    return out


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a writable view (no copy)."""
    import numpy as np
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12 (the checked target is 3.10)
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _rows(a: np.ndarray) -> Iterator[np.ndarray]:
    """``a`` as C-order runs of contiguous memory: itself, or its last-two-axes slabs (a
    token slice of a KV array is contiguous per head)."""
    import numpy as np
    if a.flags.c_contiguous:
        yield a
        return
    for idx in np.ndindex(a.shape[:-2]):
        r = a[idx]
        if not r.flags.c_contiguous:
            r = np.ascontiguousarray(r)
        yield r


def frame(tensors: dict[str, tuple[str, Any]], metadata: dict[str, str]) -> tuple[bytes, list[np.ndarray]]:
    """A segment's header prefix and its tensors' host arrays, in file (name) order."""
    import numpy as np
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        st, a = tensors[name]
        arr = np.asarray(a)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    return header_prefix(header), arrays


def header_prefix(header: dict[str, Any]) -> bytes:
    """The bytes of a safetensors header: its length (8 bytes, little-endian), then the
    JSON, padded with spaces to a multiple of 8."""
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb


@dataclass(frozen=True)
class Header:
    """A segment's parsed header: ``meta`` (``__metadata__``), tensor ``specs`` in file
    order, and ``start``, the bytes before the data. Unverified until the segment's
    checksum matched; its specs exactly tile the segment (nothing it says can make a reader
    allocate more than the segment holds)."""

    meta: dict[str, str]
    specs: Specs
    start: int
    prefix: bytes


def parse_header(data: bytes, length: int) -> Header:
    """The header of a segment of ``length`` bytes whose first bytes are ``data`` (at
    least 8 + the header length); BlobError if malformed or not tiling the segment."""
    if len(data) < 8 or length < 8:
        raise BlobError("segment shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(length - 8, MAX_HEADER) or n > len(data) - 8:
        raise BlobError(f"header length {n} does not fit a {length}-byte segment")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as e:
        raise BlobError(f"header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise BlobError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BlobError("header metadata is not a string map")
    return Header(meta, _specs(header, length - 8 - n), 8 + n, bytes(data[: 8 + n]))


def _specs(header: dict[str, Any], data_size: int) -> Specs:
    """Tensor specs in file order; BlobError unless they tile ``data_size`` bytes exactly."""
    import numpy as np
    try:
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        out: Specs = {}
        end = 0
        for name, spec in items:
            st = spec["dtype"]
            shape = tuple(int(d) for d in spec["shape"])
            a, b = (int(x) for x in spec["data_offsets"])
            nbytes = np.dtype(_FROM_ST[st][1]).itemsize * math.prod(shape)
            if len(shape) > 8 or min(shape, default=0) < 0 or a != end or b - a != nbytes:
                raise BlobError(f"tensor {name!r}: offsets {a}-{b} do not fit {st} {list(shape)}")
            out[str(name)] = (st, shape)
            end = b
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise BlobError(f"malformed tensor entry: {e!r}") from None
    if end != data_size:
        raise BlobError(f"tensors cover {end} bytes of a {data_size}-byte data section")
    return out


# ----------------------------------------------------------------------------- writing


class PackWriter:
    """One new pack file: ``add`` segments, ``seal`` it, then let the index name it.

    Until the index commit names it, the file is an orphan that ``gc`` may remove once old
    enough; ``still_there`` lets that commit check, inside its write transaction, that the
    file it is about to name is still the one written here."""

    def __init__(self, blob_root: Path, *, modes: Modes = PRIVATE) -> None:
        self.pack = os.urandom(KEY_BYTES)
        self.path = pack_path(blob_root, self.pack)
        self.blob_root = blob_root
        self._new_dir = make_dir(self.path.parent, modes)
        dfd = _fanout_fd(self.path)  # created in kvstore's own directory, never through a symlink
        try:
            self.fd = create(self.path.name, modes, dir_fd=dfd)
        finally:
            os.close(dfd)
        self.size = 0

    def add(self, tensors: dict[str, tuple[str, Any]], metadata: dict[str, str]) -> Segment:
        """Append one segment (``tensors`` from ``host_views``, or numpy arrays with their
        safetensors dtype); returns where it is and its checksum."""
        prefix, arrays = frame(tensors, metadata)
        h = xxhash.xxh3_128(prefix)
        start = self.size
        self._write([memoryview(prefix)])
        batch: list[memoryview] = []
        size = 0
        for arr in arrays:
            for row in _rows(arr):
                mv = byte_view(row)
                for i in range(0, len(mv), _PIECE):
                    batch.append(mv[i : i + _PIECE])
                    size += len(batch[-1])
                    if size >= _PIECE or len(batch) >= _IOV_MAX:
                        self._write(batch, h)
                        batch, size = [], 0
        self._write(batch, h)
        return Segment(self.pack, start, self.size - start, h.digest())

    def add_framed(self, data: bytes | memoryview, checksum: bytes) -> Segment:
        """Append one segment already framed elsewhere (a shared tier's copy of a segment
        some writer ``add``-ed); BlobError, with nothing appended past it that a record
        names, unless its bytes hash to ``checksum``."""
        h = xxhash.xxh3_128()
        start = self.size
        view = memoryview(data)
        for batch in _batches([view[i : i + _PIECE] for i in range(0, len(view), _PIECE)]):
            self._write(batch, h)
        if h.digest() != checksum:
            raise BlobError("segment checksum mismatch")
        return Segment(self.pack, start, self.size - start, checksum)

    def _write(self, views: list[memoryview], h: Any = None) -> None:
        while views:
            n = os.writev(self.fd, views)
            self.size += n
            done = 0
            while views and done + len(views[0]) <= n:
                done += len(views[0])
                if h is not None:
                    h.update(views[0])
                views = views[1:]
            if views and n > done:  # a short write: finish the partial view
                if h is not None:
                    h.update(views[0][: n - done])
                views[0] = views[0][n - done :]

    def seal(self) -> None:
        """Make the file and its name durable (see ``sync``)."""
        sync(self.fd)
        sync_dir(self.path.parent)
        if self._new_dir:
            sync_dir(self.blob_root)

    def still_there(self) -> bool:
        """The file at ``path`` is still the one this writer wrote (not removed by a gc)."""
        try:
            a, b = os.stat(self.path, follow_symlinks=False), os.fstat(self.fd)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        """Close and remove the file (nothing names it)."""
        self.close()
        unlink_own(self.path)


# ----------------------------------------------------------------------------- reading


def read_header(fd: int, seg: Segment, name: str = "segment") -> Header:
    """Read and parse the header of ``seg`` in the open pack ``fd`` (unverified)."""
    head = os.pread(fd, min(seg.length, 64 << 10), seg.offset)
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n > len(head) and n <= min(seg.length - 8, MAX_HEADER):
            head += os.pread(fd, 8 + n - len(head), seg.offset + len(head))
    try:
        return parse_header(head, seg.length)
    except BlobError as e:
        raise BlobError(f"{name}: {e}") from None


def read_into(fd: int, seg: Segment, header: Header, dests: dict[str, np.ndarray], name: str = "segment") -> None:
    """Read ``seg``'s tensors straight into ``dests`` (see ``SegmentRead``) on this thread
    and verify them; BlobError if a tensor is not the one expected, the file is short or
    the bytes do not match the checksum. Until it returns, ``dests`` hold unverified bytes."""
    r = SegmentRead(fd, seg, header, name)
    for i in r.add(dests):
        r.read(i)
    r.verify()


class SegmentRead:
    """One segment read straight into the arrays that will hold it, in ``spans`` of about
    ``_SPAN`` bytes that any threads may ``read`` in any order, many in flight at once.

    ``add`` gives the next tensors in file order their destinations (name -> writable
    numpy array of the stored shape and host dtype: contiguous, or a token slice of one)
    and returns the indices of their spans, so reading can start before every array
    exists. The bytes are hashed in file order as they land, by whichever reader
    completes the next span, from the memory they landed in (what is verified is what
    is handed out). ``verify`` raises BlobError unless every tensor was added, every
    span landed and the checksum matched; until it returns, the destinations hold
    unverified bytes. numpy, I/O and xxhash only: ``preadv`` and xxhash (for large
    buffers) release the GIL, so reads overlap each other and the hashing."""

    def __init__(self, fd: int, seg: Segment, header: Header, name: str = "segment", span: int = 0) -> None:
        self.fd, self.seg, self.header, self.name = fd, seg, header, name
        self.spans: list[tuple[int, list[memoryview]]] = []  # (file position, destination views)
        self._span = span or _SPAN
        self._tensors = list(header.specs)  # file order
        self._added = 0
        self._pos = seg.offset + header.start
        self._hash = xxhash.xxh3_128(header.prefix)
        self._landed: list[bool] = []
        self._next = 0          # the first span not hashed yet
        self._hashing = False   # a reader is hashing spans from ``_next`` on
        self._lock = threading.Lock()

    def add(self, dests: dict[str, np.ndarray]) -> range:
        """Destinations for the next ``len(dests)`` tensors in file order; the indices of
        their spans. BlobError if they are not those tensors, shapes and dtypes."""
        names = self._tensors[self._added : self._added + len(dests)]
        if set(names) != set(dests) or (len(dests) == 0 and self._added < len(self._tensors)):
            raise BlobError(f"{self.name}: tensors {self._tensors}, expected {sorted(dests)}")
        spans = _spans(_dest_views(self.header, dests, names, self.name), self._pos, self._span)
        self._added += len(names)
        if spans:
            self._pos = spans[-1][0] + sum(len(v) for v in spans[-1][1])
        if self._added == len(self._tensors) and self._pos != self.seg.end:
            raise BlobError(f"{self.name}: tensors end at {self._pos - self.seg.offset}, the segment at {self.seg.length}")
        with self._lock:
            first = len(self.spans)
            self.spans.extend(spans)
            self._landed.extend([False] * len(spans))
        return range(first, first + len(spans))

    def read(self, i: int, fd: int | None = None) -> None:
        """Read span ``i`` into its destinations (from ``fd`` if given, an open descriptor
        of the same pack file, else the one this read was made with), then hash every span
        that is next in file order and has landed (unless another reader is doing so)."""
        pos, views = self.spans[i]
        for batch in _batches(views):
            got = _preadv(self.fd if fd is None else fd, batch, pos)
            if got != sum(len(v) for v in batch):
                raise BlobError(f"{self.name}: short read (the pack file is truncated)")
            pos += got
        with self._lock:
            self._landed[i] = True
            if self._hashing or self._next != i:
                return
            self._hashing = True
        while True:
            for v in self.spans[self._next][1]:
                self._hash.update(v)
            with self._lock:
                self._next += 1
                if self._next == len(self.spans) or not self._landed[self._next]:
                    self._hashing = False
                    return

    def verify(self) -> None:
        """BlobError unless every byte landed and hashed to the segment's checksum."""
        with self._lock:
            if self._added != len(self._tensors) or self._next != len(self.spans) or self._hashing:
                raise BlobError(f"{self.name}: not every tensor was read")
        if self._hash.digest() != self.seg.checksum:
            raise BlobError(f"{self.name}: checksum mismatch")


def _dest_views(header: Header, dests: dict[str, np.ndarray], names: list[str], name: str) -> list[memoryview]:
    """The memory of ``dests`` for tensors ``names`` in file order, in pieces of at most
    ``_PIECE`` bytes; BlobError unless each has the header's shape and dtype."""
    import numpy as np
    views: list[memoryview] = []
    for tname in names:
        st, shape = header.specs[tname]
        d = dests[tname]
        if d.shape != shape or d.dtype != np.dtype(_FROM_ST[st][1]):
            raise BlobError(f"{name}: tensor {tname!r} is {st} {list(shape)}, expected {list(d.shape)} {d.dtype}")
        for row in _dest_rows(d):
            mv = byte_view(row)
            views.extend(mv[i : i + _PIECE] for i in range(0, len(mv), _PIECE))
    return views


def _spans(views: list[memoryview], pos: int, span: int) -> list[tuple[int, list[memoryview]]]:
    """``views`` (contiguous in the file from ``pos``) grouped into runs of about ``span``
    bytes: (file position, views)."""
    out: list[tuple[int, list[memoryview]]] = []
    run: list[memoryview] = []
    start = size = 0
    for v in views:
        if not run:
            start = pos
        run.append(v)
        size += len(v)
        pos += len(v)
        if size >= span:
            out.append((start, run))
            run, size = [], 0
    if run:
        out.append((start, run))
    return out


def prefetch(fd: int, offset: int, length: int) -> None:
    """Ask the OS to start reading ``length`` bytes at ``offset`` into the page cache now
    (``POSIX_FADV_WILLNEED``; ``F_RDADVISE`` on macOS), so the device works while the
    caller does something else. Advice only: a no-op where neither exists or it fails."""
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        elif sys.platform == "darwin":
            import fcntl

            step = 1 << 30  # ra_count is an int
            for off in range(offset, offset + length, step):
                fcntl.fcntl(fd, getattr(fcntl, "F_RDADVISE", 44), struct.pack("qi4x", off, min(step, offset + length - off)))
    except OSError:
        pass


def _dest_rows(d: np.ndarray) -> Iterator[np.ndarray]:
    import numpy as np
    rows = [d] if d.flags.c_contiguous else (d[i] for i in np.ndindex(d.shape[:-2]))
    for r in rows:
        if not r.flags.c_contiguous or not r.flags.writeable:
            raise RuntimeError("destination is not writable in contiguous rows")  # kvstore's arrays, not the file
        yield r


def _batches(views: list[memoryview]) -> Iterator[list[memoryview]]:
    batch: list[memoryview] = []
    size = 0
    for v in views:
        batch.append(v)
        size += len(v)
        if size >= _PIECE or len(batch) >= _IOV_MAX:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _preadv(fd: int, views: list[memoryview], pos: int) -> int:
    """Fill ``views`` from ``pos`` (a short count only at the end of the file)."""
    if hasattr(os, "preadv"):
        total = want = sum(len(v) for v in views)
        got = os.preadv(fd, views, pos)
        while got < total:  # preadv may stop early; finish with plain preads
            done = 0
            for v in views:
                if got < done + len(v):
                    part = v[got - done :]
                    n = os.preadv(fd, [part], pos + got)
                    if n <= 0:
                        return got
                    got += n
                    break
                done += len(v)
        return min(got, want)
    got = 0
    for v in views:
        data = os.pread(fd, len(v), pos + got)
        v[: len(data)] = data
        got += len(data)
        if len(data) < len(v):
            break
    return got


def hash_segment(fd: int, seg: Segment) -> bytes:
    """xxh3-128 of a segment's bytes as they are on disk (``verify``)."""
    h = xxhash.xxh3_128()
    pos, end = seg.offset, seg.end
    while pos < end:
        data = os.pread(fd, min(8 << 20, end - pos), pos)
        if not data:
            break
        h.update(data)
        pos += len(data)
    return h.digest()


# ----------------------------------------------------------------------------- dtypes


def host_dtype(st: str) -> np.dtype:
    """The numpy dtype holding a safetensors dtype on the host (``uint16`` for ``BF16``)."""
    import numpy as np
    return np.dtype(_FROM_ST[st][1])


def mlx_dtype_name(st: str) -> str:
    """The MLX dtype name of a safetensors dtype (``bfloat16`` for ``BF16``)."""
    return _FROM_ST[st][0]
