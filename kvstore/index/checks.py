"""The checks an index open runs when the data file is not as its ``clean`` stamp says
(``core``'s module docstring says when, and why each is enough): the crash check after a
checked writer stopped without a clean close, else the whole-index walk in a child process;
and the salvage of a damaged index. Imported only when an open needs one of them: an open
whose stamp matches (every open after a clean close) starts without this code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lmdb

from ..escape import logger
from ..records import RecordError, parse
from .marks import Mark, vouch
from .txn import DBS

log = logger("kvstore")

CHECK_AT_OPEN = True  # tests turn it off to reach a damaged page on purpose
CHECK_SECONDS = 30.0  # a check gets this long plus 1 s per 20 MiB of data file
_FATAL = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")  # signal names: ``signal`` costs start-up
# The child ``check_in_child`` runs: reads every value of every database (a damaged page
# kills it, not the caller) and, for a writer, probes a write. Exit 0 clean, 3 damaged,
# 4 or 5 no verdict.
_WALK = r"""
import sys, lmdb
path, ro, size = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
try:
    env = lmdb.open(path, readonly=ro, lock=True, max_dbs=64, subdir=True, readahead=False,
                    max_readers=512, map_size=size, create=False)
except lmdb.Error as e:
    print(f"cannot open: {e}", file=sys.stderr)
    sys.exit(5)  # no verdict: the parent's own open reports what is wrong
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError)
unread = []
bad = []
try:
    with env.begin() as txn:
        names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:  # one transaction each: an error spoils the transaction it happens in
        try:
            db = env.open_db(name, create=False)
            with env.begin(db=db, buffers=True) as txn:
                for k, v in txn.cursor():
                    if len(v):  # first and last byte: a value running past the file faults
                        v[0], v[len(v) - 1]
        except DAMAGE as e:
            bad.append(f"{name.decode(errors='replace')}: {e}")
        except lmdb.Error as e:
            unread.append(f"{name.decode(errors='replace')}: {e}")
    if not ro:
        with env.begin(write=True) as txn:
            txn.put(b"\x00kvstore-open-probe", b"")
            txn.delete(b"\x00kvstore-open-probe")
except DAMAGE as e:
    bad.append(str(e))
except lmdb.Error as e:
    unread.append(str(e))
if bad:  # a damaged B-tree: the next read of it may fault instead of failing
    print("; ".join(bad), file=sys.stderr)
    sys.exit(3)
if unread:  # not read to the end (readers table full, out of memory...): no verdict
    print("; ".join(unread), file=sys.stderr)
    sys.exit(4)
"""


def check(path: Path, *, readonly: bool, state: dict[str, Any] | None, marks: list[Mark],
          marked_damaged: bool, initial_map: int) -> tuple[bool, str | None, bool]:
    """Check index directory ``path`` (its data file in ``state``, as ``Index`` reads it)
    before this process maps it: (whether a check ran to completion, why the index would
    crash a process reading it or None, whether a live writer's mark vouched for it). A
    writer's mark (``marks``) vouches for a file exactly as a live writer's last commit left
    it; the crash check runs for one a writer that is gone left or was committing to
    (``marks.vouch``); any other file is walked in a child (``check_in_child``)."""
    how = vouch(marks, state) if CHECK_AT_OPEN and not marked_damaged else None
    if how == "live":
        return True, None, True
    if how == "crash" and crash_checked(path / "data.mdb"):
        return True, None, False
    verified, damage = check_in_child(path, readonly=readonly, initial_map=initial_map)
    return verified, damage, False


def crash_checked(data: Path) -> bool:
    """``pages.crash_check`` finds nothing a stopped writer could have left in ``data``
    (a file a writer that is gone vouches for): the open needs no walk (``core``'s docstring)."""
    from .pages import crash_check  # the page walker: only after a crash

    why = crash_check(data)
    if why is not None:
        log.info("kvstore: index %s after an unclean stop: %s; checking every record", data.parent, why)
        return False
    return True


def check_in_child(path: Path, *, readonly: bool, initial_map: int) -> tuple[bool, str | None]:
    """(whether a check ran to completion, why the index would crash a process reading
    it or None). Only a child that exited 0 found the file clean; one that could not
    start, took too long (a stopped child does), or was killed by a signal other than a
    fault of its own (SIGKILL from the OOM killer) checked nothing: logged, (False, None)."""
    data = path / "data.mdb"
    try:
        size = data.stat().st_size
    except OSError:
        return True, None  # nothing to check: LMDB makes a new file
    if size == 0:
        return True, None
    if not CHECK_AT_OPEN or not sys.executable:
        return False, None
    import signal  # only a check starts a process
    import subprocess

    timeout = CHECK_SECONDS + size / (20 << 20)
    cmd = [sys.executable, "-c", _WALK, str(path), "1" if readonly else "0", str(max(initial_map, size))]
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return _unchecked(path, f"it took over {timeout:.0f} s and was killed")
    except OSError as e:
        return _unchecked(path, f"it could not start: {e}")
    why = p.stderr.decode(errors="replace").strip().splitlines()
    if p.returncode == 3:
        return True, f"reading {data} fails: {why[-1] if why else 'damaged'}"
    if p.returncode < 0 and -p.returncode in {getattr(signal, n) for n in _FATAL if hasattr(signal, n)}:
        return True, (f"reading {data} kills the process ({signal.Signals(-p.returncode).name}"
                      + (f": {why[-1]}" if why else "") + ")")
    if p.returncode == 5:  # the child could not open it: the parent's own open says why
        log.info("kvstore: the check of index %s could not open it: %s", path, why[-1] if why else "")
        return False, None
    if p.returncode != 0:
        how = f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit {p.returncode}"
        return _unchecked(path, f"it ended without a verdict ({how}{': ' + why[-1] if why else ''})")
    return True, None


def _unchecked(path: Path, why: str) -> tuple[bool, None]:
    log.warning("kvstore: the check of index %s did not complete (%s); opening it unchecked for this "
                "process and leaving it unstamped, so the next open checks it again", path, why)
    return False, None


def salvage_into(env: lmdb.Environment, data: Path) -> int:
    """Copy the readable records of a damaged data file into a new environment, the byte
    counter recomputed from the pack records kept. Returns the number of records kept."""
    from .pages import salvage

    _, found = salvage(data)
    kept, total = 0, 0
    with env.begin(write=True) as txn:
        for name in DBS:
            db = env.open_db(name.encode(), txn=txn)
            for k, v in found.get(name, []):
                if name == "meta" and k == b"bytes":
                    continue
                if name == "packs":
                    try:
                        total += parse("packs", v).size
                    except RecordError:
                        pass  # unreadable: verify reports it
                try:
                    txn.put(k, v, db=db)
                    kept += 1
                except lmdb.Error:  # a key LMDB cannot hold (damaged length)
                    pass
        txn.put(b"bytes", str(total).encode(), db=env.open_db(b"meta", txn=txn))
    return kept


__all__ = ["CHECK_AT_OPEN", "CHECK_SECONDS", "check", "check_in_child", "crash_checked", "salvage_into"]
