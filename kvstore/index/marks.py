"""Writer marks: what lets an open skip the whole-index walk after a writer's crash or
beside a live writer, and only then (``core``'s docstring says why that is enough).

A mark is a file ``writer-<pid>-<random hex>`` beside the data file, made by a writer
whose open was checked, before its first commit. The writer holds it open under an
exclusive ``flock`` for its life: the kernel releases that lock when the process ends,
however it ends and whatever pid namespace it ran in, so a mark whose lock can be taken
belongs to a writer that is gone. A pid proves nothing: a writer that ran as PID 1 of a
container left a pid that is "alive" in every other namespace, and its mark vouched for
every later file (issue 52, item 9). The pid in the name is for people only.

The mark records the data file as the writer's last transaction left it (device, inode,
size, mtime, ctime, LMDB transaction id), and while a transaction is open only the
file and transaction it started from (``committing``). A mark vouches for a data file:
- whose state is exactly its record (the writer's last transaction, live or not): any
  other write (an edit in place, a copy, a truncation) changes ctime;
- or, for a writer that is gone, the file it was committing to, at that transaction id
  or the next (it died inside a commit: the crash check covers what that can leave).
Nothing else: not a live writer's mark for a file edited since its last transaction,
not a mark for another file (device and inode), not an unreadable mark. A writer whose
transaction found the file changed by someone other than a marked writer or a check
(``chained``) records no state from then on, so its mark vouches for nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import files

WRITER = "writer-"  # writer-<pid>-<random hex>
_SIZE = 512  # bytes of a mark's record (padded: rewritten in place, never shorter)
_FILE = ("dev", "ino", "size", "mtime_ns", "ctime_ns", "txnid")


@dataclass
class Mark:
    """A mark found beside a data file: its record (None if unreadable) and whether its
    writer still holds its lock."""

    path: Path
    record: dict[str, Any] | None
    live: bool


class OwnMark:
    """This process's mark, locked for its life (``make``); ``record`` rewrites it in place."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def make(cls, directory: Path, state: dict[str, Any], modes: files.Modes) -> "OwnMark":
        """A new mark recording ``state``, locked before it gets its name (a mark nobody
        holds is a dead writer's). OSError if it cannot be made."""
        name = f"{WRITER}{os.getpid()}-{os.urandom(8).hex()}"
        tmp = directory / f"{name}.tmp"
        fd = files.create(tmp, modes)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            mark = cls(directory / name, fd)
            mark.record(state)
            os.rename(tmp, mark.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return mark

    def record(self, state: dict[str, Any] | None, *, committing: dict[str, Any] | None = None) -> None:
        """Record the data file as this writer's last transaction left it (None: vouch for
        nothing), or the file a transaction is starting from (``committing``)."""
        rec = {"file": {k: state[k] for k in _FILE} if state is not None and committing is None else None,
               "committing": {k: committing[k] for k in ("dev", "ino", "txnid")} if committing else None}
        data = json.dumps(rec).encode()
        if len(data) > _SIZE:  # never: six integers
            data = b'{"file": null, "committing": null}'
        os.pwrite(self.fd, data.ljust(_SIZE), 0)

    def close(self) -> None:
        """Remove the mark (a clean close), then release its lock."""
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)


def _held(fd: int, how: int) -> bool:
    """Someone else holds the lock of the file open on ``fd`` (else this process took it)."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # no verdict: count it as live (it then vouches only for its exact record)
    return False


def marks(directory: Path) -> list[Mark]:
    """Every mark beside the data file, with its record and whether its writer is alive."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(WRITER) and not n.endswith(".tmp")]
    except OSError:
        return []
    out = []
    for name in names:
        path = directory / name
        try:
            fd = files.open_regular(path)  # a FIFO planted there must not block the open
        except (OSError, files.BlobError):
            continue
        try:
            live = _held(fd, fcntl.LOCK_SH)
            try:
                rec = json.loads(os.pread(fd, _SIZE, 0))
            except (OSError, ValueError, RecursionError):
                rec = None
            out.append(Mark(path, rec if isinstance(rec, dict) else None, live))
        finally:
            os.close(fd)
    return out


def vouch(found: list[Mark], state: dict[str, Any] | None) -> str | None:
    """How a mark vouches for the data file in ``state``: "live" (exactly as a live
    writer's last transaction left it), "crash" (as a writer that is gone left it, or was
    committing to it: ``pages.crash_check`` covers what a stop can leave), or None."""
    if state is None or state.get("txnid") is None:
        return None
    now = {k: state[k] for k in _FILE}
    how = None
    for m in found:
        rec = m.record or {}
        if rec.get("file") == now:
            if m.live:
                return "live"
            how = "crash"
        c = rec.get("committing")
        if (not m.live and isinstance(c, dict) and c.get("dev") == state["dev"] and c.get("ino") == state["ino"]
                and type(c.get("txnid")) is int and c["txnid"] <= state["txnid"] <= c["txnid"] + 1):
            how = "crash"
    return how


def chained(before: dict[str, Any] | None, own: dict[str, Any] | None, directory: Path,
            stamp: Callable[[], Any]) -> bool:
    """The data file a transaction starts from (``before``) is one this process's last
    transaction left (``own``), a checked open stamped (``stamp()``), or a marked writer's
    transaction left (its record, or the commit it is still recording: the transaction
    just before ``before``'s on the same file): no one else changed it since a check."""
    if before is None or own is None or before.get("txnid") is None:
        return False
    now = {k: before[k] for k in _FILE}
    if now == {k: own.get(k) for k in _FILE} or stamp() == before:
        return True
    for m in marks(directory):
        rec = m.record or {}
        c = rec.get("committing")
        if rec.get("file") == now or (isinstance(c, dict) and c.get("dev") == now["dev"] and c.get("ino") == now["ino"]
                                      and c.get("txnid") == now["txnid"] - 1):
            return True
    return False


def sweep(directory: Path) -> None:
    """Remove the marks of writers that are gone (their lock can be taken), and the
    names a mark was being made under when its writer stopped."""
    try:
        names = [n for n in os.listdir(directory) if n.startswith(WRITER)]
    except OSError:
        return
    for name in names:
        path = directory / name
        try:
            fd = files.open_regular(path)
        except (OSError, files.BlobError):
            continue
        try:
            if not _held(fd, fcntl.LOCK_EX):
                os.unlink(path)
        except OSError:
            pass
        finally:
            os.close(fd)


__all__ = ["Mark", "OwnMark", "WRITER", "chained", "marks", "sweep", "vouch"]
