"""The index: one LMDB environment naming every entry, chunk and pack file of a directory.

An LMDB commit is the only thing that makes an entry exist: pack files are written and
synced before the transaction that names them, and unlinked only after the transaction
that drops them (``WriteTxn``). LMDB gives one writer at a time across threads and
processes and lock-free readers, so several servers and the CLI share a cache directory.

What protects a process from a damaged index. LMDB has no page checksums: a damaged page
that a cursor steps on can fault (SIGBUS, SIGSEGV) or fail an assertion (abort) in the
process reading it. So an index is read by kvstore only in a state that was checked or
that kvstore's own LMDB code produced from a checked state:
- a ``clean`` stamp next to the data file records its device, inode, size, mtime, ctime
  and last transaction id, written only after a check ran to completion and found the
  file clean, and at every clean close of a writer whose open was so checked (a process
  that saw damage writes none). A check that did not complete (timed out, killed or
  stopped from outside, could not start) is logged and proves nothing: the index is
  opened unchecked for this process and left unstamped, so the next open checks again. An open whose data file matches the
  stamp skips the check: it costs a stat and one meta page, whatever the index holds.
- a writer stopped without a clean close (killed, out of memory, power lost), or still
  running: each writer whose open was so checked makes, before its first commit, a
  writer mark (``marks``): a file it holds under a lock for its life (the kernel releases
  it when the process ends, in whatever pid namespace), recording the data file exactly
  as its last transaction left it (device, inode, size, mtime, ctime, transaction id),
  and removes it at its clean close (a process that never writes makes none). A file
  exactly as a live writer left it needs no check; one a writer that is gone left, or
  was committing to, was written since the check by LMDB's commits only, which write a
  transaction's pages before the meta page naming them: ``pages.crash_check`` checks
  what such a stop can leave (a file shorter than its pages, a page a root names of the
  wrong kind) by pread, in time that does not grow with the index, and the open stamps
  the file as after a full check. A mark whose writer is gone is removed once the file
  is checked or stamped again. No mark vouches for a file edited in place since its
  writer's last transaction (a new ctime), nor for another file.
- any other state (the file edited, replaced, copied in from elsewhere: each changes
  ctime or inode; or a crash check that found something) is checked before this process
  maps it: a child process reads every record (and, for a writer, probes a write), so
  a damaged page kills the child, not the server. A damaged index is moved aside and its
  readable records salvaged (``pages.salvage``, which reads pages itself, without LMDB).
Damage that reaches a file without going through the filesystem (bit rot under an
unchanged ctime), an edit of a file inside the clock tick of a writer's last commit, or
one between a crash inside a commit and the next open, is not caught at open; ``kvstore verify`` walks every page. The crash check, the child's walk
and the salvage are ``checks``, imported only by an open whose file does not match its stamp.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import lmdb

from .. import files
from ..escape import LazyLogger
from ..keys import FORMAT_VERSION
from ..records import MAX_CHUNK, IdentityRecord, RecordError, parse
from . import marks
from .marks import WRITER, OwnMark
from .meta import last_txnid, unwritten_roots
from .txn import DBS, Reader, WriteTxn, count

log = LazyLogger("kvstore")  # logs only when something is wrong: ``ls`` never imports logging
T = TypeVar("T")

INITIAL_MAP = 64 << 20  # bytes LMDB maps at first (it grows; the fault harness shrinks this)
_PROBE_KEY = b"\x00kvstore-open-probe"  # main database; never committed
_LOCK_BYTES = 64 << 10  # lock.mdb: LMDB's reader table for max_readers=512 needs ~33 KiB
STAMP = "clean"
DAMAGED = "damaged"  # written by a process that met damage: the next writable open salvages

# Errors that mean the data file itself is damaged: only these move an index aside.
CORRUPTION = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
              lmdb.VersionMismatchError, lmdb.PanicError)


@dataclass
class _Shared:
    """One environment of this process, with the handles using it and the data file's
    state as this process last left it (checked at open, or after its own commit)."""

    env: lmdb.Environment
    readonly: bool
    refs: int
    state: dict[str, Any] | None = None
    verified: bool = False  # a check completed (or kvstore made the file): a clean close may stamp
    mark: OwnMark | None = None  # this process's writer mark, made before its first commit (removed at its clean close)
    marked: bool = False  # a mark was attempted (once per process and environment)
    chained: bool = True  # every transaction started from a file a check, this writer or a marked one left
    txn_lock: threading.Lock = field(default_factory=threading.Lock)  # a write transaction and its mark record


_SHARED: dict[tuple[int, str], _Shared] = {}
_SHARED_LOCK = threading.Lock()


class IndexOpenError(RuntimeError):
    """The index cannot be opened or used; the message says what to do."""


class FormatError(IndexOpenError):
    """The index is of another format (``found``), refused before anything was written
    into it; a writable opener sets the store aside (``formats.set_aside``)."""

    def __init__(self, message: str, found: int) -> None:
        super().__init__(message)
        self.found = found


class Index:
    """The LMDB index of one cache directory (``root/index``; its packs under
    ``root/blobs``). Safe to share between threads; open one per process (after fork).
    Every method is one short transaction."""

    def __init__(self, root: Path, *, readonly: bool = False, modes: files.Modes = files.PRIVATE,
                 path: Path | None = None) -> None:
        self.root = Path(root)
        self.path = Path(path) if path is not None else self.root / "index"
        self.blob_root = self.root / "blobs"
        self.readonly = readonly
        self.modes = modes
        self._verified = False
        self.damaged = False  # set by a caller that met damage: no clean stamp at close
        self._shared: _Shared | None = None
        self.env = self._shared_open()
        try:
            self._check_format()  # before any database is created in it
            before = self._state()
            self._db = {name: self.env.open_db(name.encode(), create=not readonly) for name in DBS}
            self._own_writes(before)
            self._tag_format()
        except BaseException:
            self.close()  # a refused index must not stay registered in this process
            raise

    # -- environment -------------------------------------------------------------------

    def _shared_open(self) -> lmdb.Environment:
        """LMDB forbids opening one environment twice in a process, so every Index on the
        same directory in this process shares one (a writable one serves read-only users
        too). Keyed by pid: a forked child opens its own, as LMDB requires."""
        key = (os.getpid(), os.path.realpath(self.path))
        with _SHARED_LOCK:
            got = _SHARED.get(key)
            if got is not None and (self.readonly or not got.readonly):
                got.refs += 1
                self._shared = got
                return got.env
            if got is not None:  # open read-only so far; a writer needs its own handle
                raise IndexOpenError(f"index {self.path} is already open read-only in this process; "
                                     "open the writable store first")
            env = self._open()
            self._shared = _SHARED[key] = _Shared(env, self.readonly, 1, self._state(), self._verified)
            return env

    def _own_writes(self, before: dict[str, Any] | None) -> None:
        """The databases this open created are this process's commits: the file as it
        leaves it (``_Shared.state``), as after a transaction."""
        shared, after = self._shared, self._state()
        if (shared is None or self.readonly or before is None or after is None or before == after
                or shared.state != before or before["txnid"] is None or after["txnid"] is None):
            return
        if (before["dev"], before["ino"]) == (after["dev"], after["ino"]) and \
                0 <= after["txnid"] - before["txnid"] <= len(DBS):
            shared.state = after

    def _own_files(self) -> None:
        """IndexOpenError unless ``data.mdb`` and ``lock.mdb`` are regular files (or
        absent): LMDB would block reading a FIFO, and write through a symlink into a
        file outside the cache directory."""
        for name in ("data.mdb", "lock.mdb"):
            try:
                st = os.lstat(self.path / name)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise IndexOpenError(f"cannot use index file {self.path / name}: {e.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                raise IndexOpenError(f"index file {self.path / name} is not a regular file (a symlink, FIFO or "
                                     f"device kvstore did not make): remove it, or use another cache directory")

    def _open(self) -> lmdb.Environment:
        self._own_files()
        from .formats import stored_format

        self._refuse_format(stored_format(self.path / "data.mdb"))  # read without LMDB: nothing written yet
        try:
            why = self.marked_damaged()
            if why is not None and not self.readonly:
                raise lmdb.CorruptedError(f"a process met damage in it: {why}")
            if not self.readonly:
                self._allocate_lock_file()
                self._create_data_file()
            checked = not self._stamp_matches()
            self._verified, live = not checked, False
            if checked:  # the checks: only for a file not as its stamp says (``checks``)
                from .checks import check

                self._verified, damage, live = check(self.path, readonly=self.readonly, state=self._state(),
                                                     marks=marks.marks(self.path),
                                                     marked_damaged=self.marked_damaged() is not None,
                                                     initial_map=INITIAL_MAP)
                if damage:
                    raise lmdb.CorruptedError(damage)
            # a file as a live writer's last commit left it: that writer's open was checked
            # and probed, and it goes on writing (no stamp: the next commit changes the file)
            env = self._open_env(probe=checked and not live)
            if checked and self._verified and not live:
                self._write_stamp()
            if self._verified:
                marks.sweep(self.path)
            return env
        except lmdb.Error as e:
            if self.readonly or not isinstance(e, CORRUPTION):
                raise IndexOpenError(f"cannot open index {self.path}: {e}") from None
            return self._replace_damaged(e)

    def _replace_damaged(self, e: Exception) -> lmdb.Environment:
        """Keep a damaged data file for inspection and start a new index holding every
        record still readable from it (read page by page, without LMDB). Lookups check
        token ids and checksums as always; packs of lost records become orphans that
        ``kvstore verify --fix`` / ``gc`` remove."""
        aside = aside_name(self.path, "corrupt")
        os.replace(self.path, aside)
        files.make_dir(self.path, self.modes)
        self._allocate_lock_file()
        self._create_data_file()
        env = self._open_env(probe=False)
        from .checks import salvage_into

        kept = salvage_into(env, aside / "data.mdb")
        self._verified = True  # written by this process from records read page by page
        self._write_stamp()
        log.warning("kvstore: index %s is unreadable (%s); moved aside to %s, new index kept "
                    "%d readable records", self.path, e, aside, kept)
        return env

    def _open_env(self, *, probe: bool) -> lmdb.Environment:
        data = self.path / "data.mdb"
        size = max(INITIAL_MAP, data.stat().st_size if data.exists() else 0)
        env = lmdb.open(str(self.path), map_size=size, max_dbs=len(DBS) + 2, subdir=True,
                        readonly=self.readonly, lock=True, readahead=False, max_readers=512,
                        mode=self.modes.file)
        try:
            with env.begin() as txn:  # a truncated / foreign file fails here, at open
                txn.stat()
            # LMDB reads pages through a memory map: a page past the end of a truncated file
            # is a SIGBUS, not an error. The trees' roots must be in the file (the child's
            # walk, or the stamp, covers the other pages); ``last_pgno`` need not be.
            why = unwritten_roots(data)
            if why is not None:
                raise lmdb.CorruptedError(why)
            if probe and not self.readonly:
                # LMDB reads its free-page list only when a write allocates a page: probe one
                # now, so a damaged list is found at open (and recovered from), not by the
                # first write of a running server. Nothing is left behind.
                with env.begin(write=True) as txn:
                    txn.put(_PROBE_KEY, b"")
                    txn.delete(_PROBE_KEY)
        except BaseException:
            env.close()
            raise
        return env

    def _state(self) -> dict[str, int | None] | None:
        """What the stamp records of the data file (its stat and last transaction id, read
        from its meta pages), or None if it cannot be read."""
        data = self.path / "data.mdb"
        try:
            st = os.stat(data, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):  # reading a FIFO planted there would block
            return None
        return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "ctime_ns": st.st_ctime_ns, "txnid": last_txnid(data)}

    def _stamp_matches(self) -> bool:
        """The data file is as a check or a clean close of kvstore left it."""
        try:
            fd = files.open_regular(self.path / STAMP)  # a FIFO there must not block the open
        except files.BlobError:
            return False
        try:
            with os.fdopen(fd, "rb") as f:
                stamp = json.loads(f.read(1 << 16))
        except (OSError, ValueError, RecursionError):
            return False
        state = self._state()
        return isinstance(stamp, dict) and state is not None and state["txnid"] is not None and stamp == state

    def _read_stamp(self) -> Any:
        """What the stamp records (None if there is none or it is unreadable)."""
        try:
            with os.fdopen(files.open_regular(self.path / STAMP), "rb") as f:
                return json.loads(f.read(1 << 16))
        except (OSError, ValueError, RecursionError, files.BlobError):
            return None

    def _write_stamp(self) -> None:
        """Record that the data file, as it is now, is one kvstore checked or wrote. Best
        effort: without a stamp the next open checks the file."""
        state = self._state()
        if state is None or self.damaged:
            return
        try:
            files.replace_file(self.path / STAMP, json.dumps(state).encode(), self.modes)
        except OSError as e:
            log.info("kvstore: could not stamp index %s clean (%s); the next open checks it", self.path, e)

    def mark_damaged(self, why: str) -> None:
        """Record that LMDB reported this index damaged (best effort). Some damage (a page
        of LMDB's free-page list) shows only when a write reads it, and may have moved
        out of reach of every page walk by then: the mark makes ``verify`` report it and
        the next writable open salvage the index, as for damage found at open."""
        self.damaged = True
        try:
            files.replace_file(self.path / DAMAGED, why[:500].encode(errors="replace"), self.modes)
        except OSError as e:
            log.warning("kvstore: could not mark index %s damaged (%s)", self.path, e)

    def marked_damaged(self) -> str | None:
        """Why a process marked this index damaged (``mark_damaged``), or None."""
        try:
            fd = files.open_regular(self.path / DAMAGED)
        except files.BlobError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(500).decode(errors="replace") or "damaged"

    def _drop_stamp(self) -> None:
        try:
            os.unlink(self.path / STAMP)
        except OSError:
            pass

    def _mark_once(self) -> None:
        """Before this process's first commit, its writer mark (if its open was checked):
        a process that never writes (``ls``, a server serving hits only) leaves none."""
        shared = self._shared
        if shared is None or shared.marked or self.readonly or not shared.verified:
            return
        with _SHARED_LOCK:
            if not shared.marked:
                shared.mark, shared.marked = self._write_mark(shared.state), True

    def _write_mark(self, state: dict[str, Any] | None) -> OwnMark | None:
        """Mark the index as held by this writer, recording the state its open checked
        (``marks``). Best effort: without a mark, the open after a crash walks the index."""
        if state is None:
            return None
        try:
            return OwnMark.make(self.path, state, self.modes)
        except OSError as e:
            log.info("kvstore: could not mark index %s open (%s); after a crash it is checked whole", self.path, e)
            return None

    def _starting(self) -> dict[str, Any] | None:
        """Inside a write transaction (LMDB's writer lock held), before it writes: the file
        it starts from, recorded in this writer's mark as the one it is committing to. A
        file that neither this writer's last transaction, a check's stamp nor another
        marked writer left was changed by someone else: this writer vouches for nothing
        from then on (no state in its mark, no stamp at its close)."""
        shared = self._shared
        if shared is None or shared.mark is None:
            return None
        before = self._state()
        if shared.chained and not marks.chained(before, shared.state, self.path, self._read_stamp):
            shared.chained = shared.verified = False
            log.info("kvstore: index %s was changed by another process outside kvstore's commits; after a crash "
                     "it is checked whole", self.path)
        try:
            shared.mark.record(None, committing=before if shared.chained else None)
        except OSError:
            pass
        return before

    def _finished(self, before: dict[str, Any] | None) -> None:
        """After a write transaction (committed or not): the file as this process left it,
        recorded in its mark when it is this writer's commit on the file it started from."""
        shared = self._shared
        if shared is None or self.readonly:
            return
        shared.state = after = self._state()
        if shared.mark is None:
            return
        ours = (shared.chained and before is not None and after is not None and after["txnid"] is not None
                and before["txnid"] is not None and (after["dev"], after["ino"]) == (before["dev"], before["ino"])
                and before["txnid"] <= after["txnid"] <= before["txnid"] + 1)
        try:
            shared.mark.record(after if ours else None)
        except OSError:
            pass

    def _create_data_file(self) -> None:
        """Make ``data.mdb`` (empty: LMDB starts a new environment in it) with this
        directory's modes when there is none, rather than leave it to LMDB's umask."""
        try:
            os.close(files.create(self.path / "data.mdb", self.modes))
        except FileExistsError:
            pass

    def _allocate_lock_file(self) -> None:
        """Give ``lock.mdb`` real blocks before LMDB maps it: LMDB extends the file sparse
        and writes its reader table through the map, which is a SIGBUS on a full disk.
        Existing bytes (a live process's reader table) are never changed, and a full disk
        is ENOSPC here, a clear error at open: ``posix_fallocate`` where there is one and
        the filesystem supports it, else ``_append_zeros`` (macOS has no posix_fallocate)."""
        try:
            fd = files.create(self.path / "lock.mdb", self.modes)
        except FileExistsError:  # non-blocking: _own_files refused a FIFO, but it may have just appeared
            fd = os.open(self.path / "lock.mdb", os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, _LOCK_BYTES)
                    return
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
            _append_zeros(fd, _LOCK_BYTES)
        finally:
            os.close(fd)

    def _refuse_format(self, fmt: int | None) -> None:
        """FormatError if ``fmt`` (the stored format, None if none) is not this kvstore's."""
        if fmt is None or fmt == FORMAT_VERSION:
            return
        who = "an older" if 0 <= fmt < FORMAT_VERSION else "a newer" if fmt > FORMAT_VERSION else "another"
        raise FormatError(f"index {self.path} has format {fmt} (written by {who} kvstore), this kvstore reads "
                          f"{FORMAT_VERSION}: `kvstore serve` or `kvstore gc` on {self.root} sets that store aside "
                          f"(kept, as a cache directory {who} kvstore can still use) and starts a new one; "
                          "nothing was changed", fmt)

    def _check_format(self) -> None:
        """FormatError if the index records another format (read before any database is
        created in it: a refused index is left as it was)."""
        try:
            db = self.env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            return
        with self.env.begin(db=db) as txn:
            have = txn.get(b"format")
        if have is None:
            return
        try:
            fmt = int(have)
        except ValueError:
            fmt = -1
        self._refuse_format(fmt)

    def _tag_format(self) -> None:
        if self.readonly or self.meta(b"format") is not None:
            return

        def tag(t: Any) -> None:
            if not t.meta(b"format"):
                t.set_meta(b"format", str(FORMAT_VERSION).encode())

        self.transact(tag)

    def close(self) -> None:
        """Release this handle; the environment closes with the last one in the process.
        A writer's last handle leaves a clean stamp if the data file is as this process
        last left it (see the module docstring); otherwise it removes the stamp."""
        key = (os.getpid(), os.path.realpath(self.path))
        with _SHARED_LOCK:
            got = _SHARED.get(key)
            if got is None or got is not self._shared:
                got = None
            elif got.refs > 1:
                got.refs -= 1
                return
            else:
                del _SHARED[key]
        if got is not None and not got.readonly:
            if not self.damaged and got.verified and got.state is not None and self._state() == got.state:
                self._write_stamp()
            else:
                self._drop_stamp()  # damage seen, or someone else wrote after this process
            if got.mark is not None:
                got.mark.close()
        self.env.close()

    def forget(self) -> None:
        """Take this environment out of the per-process registry without closing it (the
        index was replaced on disk; threads may still be inside a transaction on it)."""
        with _SHARED_LOCK:
            for key, got in list(_SHARED.items()):
                if got.env is self.env:
                    del _SHARED[key]

    # -- transactions ------------------------------------------------------------------

    def transact(self, fn: Callable[[WriteTxn], T]) -> T:
        """Run ``fn`` in one write transaction and commit; then unlink the files it
        scheduled (``WriteTxn.unlink_after_commit``). An exception in ``fn`` aborts the
        transaction and unlinks nothing. The map grows and ``fn`` runs again when full."""
        self._mark_once()
        lock = self._shared.txn_lock if self._shared is not None else threading.Lock()
        while True:
            before = None
            try:
                with lock:  # this process's transactions are one at a time anyway (LMDB's writer lock)
                    try:
                        with self.env.begin(write=True) as txn:
                            before = self._starting()
                            w = WriteTxn(txn, self._db, self.blob_root)
                            out = fn(w)
                    finally:
                        self._finished(before)  # the data file as this process left it (committed or not)
                break
            except lmdb.MapFullError:
                new = self.env.info()["map_size"] * 2
                log.info("kvstore: index map full, growing to %d MiB", new >> 20)
                self.env.set_mapsize(new)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)
        for path in w.unlink:
            try:
                files.unlink_own(path)  # kvstore's own pack files only: never through a symlink
            except OSError as e:
                log.warning("kvstore: could not remove %s: %s", path.name, e)
        return out

    def view(self, fn: Callable[[Reader], T]) -> T:
        """Run ``fn`` on a ``Reader`` over one read transaction (one consistent snapshot)."""
        while True:
            try:
                with self.env.begin() as txn:
                    return fn(Reader(txn, self._db, self.blob_root))
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)

    # -- one-record reads (each its own transaction) -------------------------------------

    def entry(self, key: bytes) -> Any:
        """``Reader.entry`` in a transaction of its own (None absent; RecordError damaged)."""
        return self.view(lambda r: r.entry(key))

    def chunk(self, key: bytes) -> Any:
        """``Reader.chunk`` in a transaction of its own."""
        return self.view(lambda r: r.chunk(key))

    def pack(self, pack: bytes) -> Any:
        """``Reader.pack`` in a transaction of its own."""
        return self.view(lambda r: r.pack(pack))

    def tokens(self, key: bytes) -> bytes | None:
        """``Reader.tokens`` in a transaction of its own."""
        return self.view(lambda r: r.tokens(key))

    def meta(self, key: bytes) -> bytes | None:
        """``Reader.meta`` in a transaction of its own."""
        return self.view(lambda r: r.meta(key))

    def total_bytes(self) -> int:
        """The pack files' total size as the index counts it."""
        return self.view(lambda r: r.total_bytes())

    def counts(self) -> dict[str, int]:
        """Records per database (entries, chunks, packs, identities), from LMDB's stats."""
        return self.view(lambda r: {n: r.txn.stat(r.db[n])["entries"] for n in ("entries", "chunks", "packs", "identities")})

    def file_bytes(self) -> int:
        """The index data file's size on disk. OSError if it is gone."""
        return (self.path / "data.mdb").stat().st_size

    def identities(self) -> dict[str, IdentityRecord]:
        """Every identity description by hex digest (an unreadable one as an empty one)."""
        def run(r: Reader) -> dict[str, IdentityRecord]:
            out = {}
            for k, v in r.txn.cursor(db=r.db["identities"]):
                try:
                    out[bytes(k).hex()] = parse("identities", v)
                except RecordError:
                    out[bytes(k).hex()] = IdentityRecord({})
            return out
        return self.view(run)

    def put_identity(self, digest: bytes, info: dict[str, Any]) -> None:
        """Describe identity ``digest`` (once: an existing description is kept).
        RecordError if ``info`` is not a description kvstore can store."""
        rec = IdentityRecord(info)
        if self.view(lambda r: r.raw("identities", digest)) is None:
            self.transact(lambda t: t.put_identity(digest, rec))

    def meta_setdefault(self, key: bytes, value: bytes) -> bytes | None:
        """The ``meta`` value under ``key``, storing ``value`` first when there is none
        (a read-only index stores nothing and returns None then)."""
        have = self.meta(key)
        if have is not None or self.readonly:
            return have

        def run(t: WriteTxn) -> bytes:
            cur = t.meta(key)
            if cur is None:
                t.set_meta(key, value)
                return value
            return cur

        return self.transact(run)


def _append_zeros(fd: int, size: int) -> None:
    """Extend the file open for writing on ``fd`` to at least ``size`` bytes by writing
    zeros at its end (real blocks, not a hole), where ``posix_fallocate`` is missing or
    unsupported. Only past the end, in append mode (each write lands at the end as it is
    then): a process that has the file mapped uses only bytes inside it, and one that
    extended it meanwhile keeps its bytes; racing openers at most append a few zeros more."""
    import fcntl

    have = os.fstat(fd).st_size
    if have >= size:
        return
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    zeros = memoryview(bytes(size - have))
    while zeros:
        zeros = zeros[os.write(fd, zeros):]


def aside_name(path: Path, what: str) -> Path:
    """A new name beside ``path`` to move it to (``<name>.<what>-<time>-<random hex>``),
    which nobody can have planted in advance."""
    return path.with_name(f"{path.name}.{what}-{int(time.time())}-{os.urandom(4).hex()}")


__all__ = ["CORRUPTION", "Index", "IndexOpenError", "count"]


def chunk_size(stored: bytes | None, asked: int, where: Path) -> int:
    """The directory's chunk size: the stored one (``asked`` if none is stored yet);
    IndexOpenError if it is not one kvstore writes (a damaged or crafted record)."""
    if stored is None:
        return int(asked)
    try:
        n = int(stored)
    except ValueError:
        n = 0
    if not 0 < n <= MAX_CHUNK:
        raise IndexOpenError(f"index {where} records chunk_tokens={stored[:24]!r}, which kvstore never writes "
                             "(a damaged or foreign index): use another cache directory, or remove this one "
                             "(its cache is rebuilt as requests come)")
    return n
