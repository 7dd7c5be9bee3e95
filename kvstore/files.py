"""Which files kvstore may touch, and how it opens, creates, replaces and syncs them.

The rules live here, in one place: how kvstore finds, opens and removes its pack files,
how it creates and replaces every file it makes in the cache directory, how it makes them
durable, and how it reads a file it did not write (a model directory's, a key file). What
is inside a pack file is ``segments``'.

Guarantees:
- Only kvstore's own pack files (``pack_path``, ``open_own``, ``unlink_own``,
  ``create_own``, ``own_packs``): a pack's name is derived from 16 random bytes, never from
  a string in a record; kvstore opens, reads, creates and unlinks only regular files under
  ``blobs/<2 hex>/`` named ``<32 hex>.kvpack``, never follows a symlink there (``blobs/``,
  the fan-out directory and the file are each reached with ``O_NOFOLLOW``, through
  directory descriptors) and never waits on a FIFO or device (non-blocking open,
  ``S_ISREG`` checked on the open descriptor).
- Every file kvstore creates is made by ``create`` (``O_EXCL | O_NOFOLLOW | O_NONBLOCK``:
  never through a symlink, never blocking on a FIFO, never an existing file), files it
  replaces by ``replace_file`` (a new file at an unpredictable temp name, renamed over),
  and every file and directory follows the cache directory's sharing mode (``Modes``).
- A file kvstore did not write is read through ``open_foreign`` only: regular files,
  never a blocking open (``read_foreign``: and never more than a bounded size).
- ``sync`` makes a file durable before anything written after it (on macOS
  ``F_BARRIERFSYNC``, which orders it before the index commit that names it, at a
  fraction of ``F_FULLFSYNC``'s cost).
- An open refused because the path is not kvstore's raises ``BlobError``; an error about
  the process or the system (EMFILE, EIO, EACCES...) is raised as the OSError it is, so no
  caller drops a record for it.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from .keys import KEY_BYTES

PACK_SUFFIX = ".kvpack"
_PACK_NAME = re.compile(r"([0-9a-f]{2})[0-9a-f]{30}\.kvpack")
_FANOUT = re.compile(r"[0-9a-f]{2}")


class BlobError(Exception):
    """A blob is missing, truncated, corrupt, not kvstore's, or not what its record says."""

    # set by the disk tier's restore: ("entry" | "chunk", key) of the record that failed
    record: tuple[str, bytes] | None = None
    # set when the segment's own header names another record: the record lies about it,
    # so dropping the record must not release the segment (another record owns it)
    foreign: bool = False


# ----------------------------------------------------------------------------- pack files


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


def fd_path(fd: int) -> str:
    """A path that opens the file behind descriptor ``fd`` itself (for a reader that takes
    only paths, such as MLX's loader): ``/proc/self/fd/N`` on Linux, ``/dev/fd/N`` on
    macOS and the BSDs. Whatever the name the file had is renamed, replaced or swapped
    for a symlink meanwhile, this opens the file already checked through ``fd``."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


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


# ----------------------------------------------------------------------------- files kvstore did not write


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


# ----------------------------------------------------------------------------- creating files


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


def create_own(path: Path, modes: Modes = PRIVATE) -> int:
    """A write descriptor of a NEW pack file at pack path ``path`` (``create``), made in
    its fan-out directory reached as ``open_own`` reaches it: never through a symlink."""
    dfd = _fanout_fd(path)
    try:
        return create(path.name, modes, dir_fd=dfd)
    finally:
        os.close(dfd)


# ----------------------------------------------------------------------------- finding pack files


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


def named_files(directory: Path, name: re.Pattern[str]) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the regular files in ``directory`` whose whole name matches ``name``:
    what kvstore's small record directories hold (``side_records``, stored responses). A
    link, a directory or a FIFO of that name is not listed, and nothing is followed; an
    entry gone between the listing and its stat is skipped. OSError if ``directory`` cannot
    be listed (the caller says what that means)."""
    out = []
    with os.scandir(directory) as it:
        for e in it:
            if not name.fullmatch(e.name):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append((e.name, st))
    return out


def _scan(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


# ----------------------------------------------------------------------------- durability and read-ahead


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
    """``sync`` a directory: the names made in it are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        sync(fd)
    finally:
        os.close(fd)


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
