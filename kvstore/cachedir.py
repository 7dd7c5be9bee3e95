"""The cache directory: where it is, what kvstore creates in it, whether kvstore may trust
it, and opening its disk tier. Imports neither MLX nor mlx-lm, so the maintenance commands
(``kvstore ls``, ``stats``, ``inspect``, ``verify``, ``gc``, ``pin``) start without them.

Guarantees:
- ``open_disk`` opens a directory only if it is this user's and nobody else can write it
  (``untrusted_dir``), or a group shares it on purpose (``shared=True``, ``--shared-dir``):
  then every file and directory kvstore creates in it is group-readable and -writable and
  owned by the directory's group (``files.Modes.of``, the one helper every creation goes
  through), whatever the creating member's umask.
- A file or directory a user of the store cannot read or write is a ``StoreOpenError``
  naming it and the command that fixes it, never a silent memory-only fallback.
- ``CREATED`` lists every name kvstore creates in a cache directory: a file it replaces
  (the stamp, the damage mark, the digest memo) is first written at
  ``<name>.<16 random hex>.tmp`` (``files.replace_file``),
  every file is created with ``O_EXCL | O_NOFOLLOW | O_NONBLOCK`` (``files.create``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from . import files
from .index import CORRUPTION, Index, IndexFailure, IndexOpenError, chunk_size
from .index.core import DAMAGED, STAMP, WRITER

if TYPE_CHECKING:  # imported by ``open_disk`` only: ``kvstore ls`` starts without it
    from .disk import DiskTier

T = TypeVar("T")

MEMO = "file-digests.json"  # the identity's file-digest memo (``identity.DigestMemo``)

# Every name kvstore creates under a cache directory ("*": chosen at random when created).
CREATED: tuple[str, ...] = (
    "index/", "blobs/", "blobs/*/", "blobs/*/*.kvpack", "index/data.mdb", "index/lock.mdb",
    f"index/{STAMP}", f"index/{DAMAGED}", f"index/{WRITER}*", MEMO, "index.rebuild-*/", "index.corrupt-*/",
    "format-*/",  # a store of another format, set aside whole (index.formats)
    "responses/", "responses/*.json",  # kvstore serve's stored /v1/responses (serve.response_store)
    "stable-prefix/", "stable-prefix/*.json",  # kvstore serve --stable-prefix (serve.stable_prefix.Memory)
)


class StoreOpenError(RuntimeError):
    """The cache directory cannot be used; the message says why and what to do."""


def default_cache_dir() -> Path:
    """``$KVSTORE_DIR`` if set, else the platform's user cache dir (``.../kvstore/cache``)."""
    env = os.environ.get("KVSTORE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstore")) / "cache"


def untrusted_dir(path: Path, *, shared: bool = False, follow: bool = False) -> str | None:
    """Why kvstore must not keep a cache in directory ``path``, or None. A cache holds
    users' prompts (as token ids) and decides what KV a model is given, so its directory
    must be this user's and writable by nobody else: not owned by another user, not
    writable by its group (unless ``shared``: a group shares it on purpose), never
    writable by everyone. ``follow``: ``path`` may be a symlink to such a directory (the
    cache root a user names); directories inside it never may."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        return f"cannot use {path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory{'' if follow else ' (a symlink or a file)'}"
    mode = stat.S_IMODE(st.st_mode)
    fix = "or pass shared_dir=True (--shared-dir) if a group shares it on purpose"
    if st.st_mode & stat.S_IWOTH:
        return (f"{path} is writable by every user (mode {mode:o}): anyone could plant entries or "
                f"read cached prompts; run `chmod 700 {path}` or use another cache directory")
    if not shared and hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return (f"{path} belongs to another user (uid {st.st_uid}): they could read cached prompts "
                f"and plant entries; use a cache directory of your own, {fix}")
    if not shared and st.st_mode & stat.S_IWGRP:
        return (f"{path} is writable by its group (mode {mode:o}): run `chmod 700 {path}`, {fix}")
    return None


def make_private(path: Path) -> None:
    """Take group and other permissions off a directory this user owns (caches made by
    earlier versions under umask 022 were readable by every local user)."""
    try:
        st = os.stat(path)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:
        pass


def access_problem(path: Path, *, write: bool, shared: bool) -> str | None:
    """Why this user cannot read (and, if ``write``, write) ``path``, naming the fix; None
    if it can or ``path`` does not exist."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot use {path}: {e.strerror}"
    is_dir = stat.S_ISDIR(st.st_mode)
    need = os.R_OK | (os.W_OK if write else 0) | (os.X_OK if is_dir else 0)
    if os.access(path, need):
        return None
    if write and os.access(path, need & ~os.W_OK) and os.statvfs(path).f_flag & os.ST_RDONLY:
        return f"{path} is on a read-only filesystem: use a cache directory on a writable one"
    what = ("rw" if write else "r") + ("X" if is_dir else "")
    mode = stat.S_IMODE(st.st_mode)
    if shared:
        fix = (f"`chmod g+{what} {path}` as its owner (uid {st.st_uid}), and `chgrp GROUP {path}` if group "
               f"{st.st_gid} is not the group sharing the directory")
    else:
        fix = f"`chmod u+{what} {path}` as its owner (uid {st.st_uid})"
    return (f"{path} is not {'readable and writable' if write else 'readable'} by this user (uid {os.geteuid()}; "
            f"owner uid {st.st_uid}, group {st.st_gid}, mode {mode:o}): run {fix}, or use another --cache-dir")


def _access(path: Path, *, readonly: bool, shared: bool) -> None:
    """StoreOpenError naming the first file or directory of the store this user cannot use.
    The fan-out directories (up to 256: as many inode reads on a cold start) are checked
    only in a shared directory, where other members make them: in a private one, nobody
    else can write ``blobs/`` (``untrusted_dir``), so they are this user's; a write kvstore
    cannot make there still fails counted (``write_errors``) and said in the log."""
    checks = [(path / "index", not readonly), (path / "index" / "lock.mdb", True),
              (path / "index" / "data.mdb", not readonly), (path / "blobs", not readonly)]
    if shared and not readonly:  # (the digest memo only costs a warning: ``identity.DigestMemo``)
        checks += [(Path(d.path), True) for d in _subdirs(path / "blobs")]
    for p, write in checks:
        why = access_problem(p, write=write, shared=shared)
        if why:
            raise StoreOpenError(why)


def _subdirs(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return [d for d in it if d.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _make_root(path: Path, shared: bool) -> None:
    """Create the cache directory (and its parents) 0700, or 2770 when ``shared``."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    if shared:
        os.chmod(path, 0o2770)


class IndexDir:
    """A cache directory opened for reading its index only (``kvstore ls``): what a
    ``DiskTier`` holds without its lookup and restore code, so the command starts without
    importing them. ``root``, ``blob_root``, ``modes``, ``index``, ``close``."""

    def __init__(self, root: Path, *, shared_dir: bool = False) -> None:
        self.root = Path(root)
        self.blob_root = self.root / "blobs"
        self.modes = files.Modes.of(self.root, shared_dir)
        self.index = Index(self.root, readonly=True, modes=self.modes)
        try:  # refused as the disk tier refuses it: a chunk size kvstore never writes
            chunk_size(self.index.meta(b"chunk_tokens"), 1, self.index.path)
        except IndexOpenError:
            self.index.close()
            raise

    def close(self) -> None:
        self.index.close()


def open_disk(path: Path, chunk_tokens: int = 256, *, shared_dir: bool = False, readonly: bool = False) -> "DiskTier":
    """The disk tier of cache directory ``path``, created if needed (unless ``readonly``),
    after the checks of ``_opened``; StoreOpenError saying why and what to do otherwise."""
    from .disk import DiskTier

    return _opened(lambda: DiskTier(path, chunk_tokens=chunk_tokens, readonly=readonly, shared_dir=shared_dir),
                   path, shared_dir=shared_dir, readonly=readonly)


def open_index_dir(path: Path, *, shared_dir: bool = False) -> IndexDir:
    """Cache directory ``path`` opened read-only for its index (``IndexDir``), after the
    same checks as ``open_disk``."""
    return _opened(lambda: IndexDir(path, shared_dir=shared_dir), path, shared_dir=shared_dir, readonly=True)


def _opened(make: "Callable[[], T]", path: Path, *, shared_dir: bool, readonly: bool) -> "T":
    """``make()`` after checking that kvstore may trust directory ``path``
    (``untrusted_dir``) and that this user can use every file of it (``access_problem``);
    StoreOpenError saying why and what to do otherwise. A private directory this user
    owns is made 0700 if an earlier version left it readable by others."""
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as e:  # ENAMETOOLONG, EACCES on a parent, ELOOP...: pathlib does not swallow these
        raise StoreOpenError(f"cannot use cache directory {path}: {e.strerror}") from None
    if is_file:
        raise StoreOpenError(f"cache path {path} is a file, not a directory: pass another --cache-dir")
    if not readonly:
        try:
            _make_root(path, shared_dir)
        except OSError as e:
            raise StoreOpenError(f"cannot create cache directory {path}: {e.strerror}") from None
    for d, follow in ((path, True), (path / "index", False), (path / "blobs", False)):
        if d is path or os.path.lexists(d):
            why = untrusted_dir(d, shared=shared_dir, follow=follow)
            if why:
                raise StoreOpenError(why)
            if not shared_dir and not readonly:
                make_private(d)
    if not readonly and not os.access(path, os.W_OK | os.X_OK):
        raise StoreOpenError(f"cache directory {path} is not writable: fix its permissions or pass another --cache-dir")
    _access(path, readonly=readonly, shared=shared_dir)
    try:
        return make()
    except OSError as e:
        raise StoreOpenError(f"cannot open cache directory {path}: {e}") from None
    except (IndexOpenError, files.BlobError, *CORRUPTION, IndexFailure) as e:
        raise StoreOpenError(f"cannot open index in {path}: {e}") from None
