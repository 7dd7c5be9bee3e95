"""The index: one LMDB environment naming every entry, chunk and blob on disk.

An LMDB commit is the only thing that makes an entry exist: blobs are written and fsynced
before the transaction that names them, and unlinked only after the transaction that drops
them. LMDB gives one writer at a time across threads and processes and lock-free readers,
so several servers and the CLI can share a cache directory.

Databases (keys are 16-byte xxh3-128 digests from ``keys``):
- ``entries``: entry key -> JSON record (identity, token count, chunks, own blob, size,
  checksum, layout, created / last_used / hits / pinned, cache_type)
- ``chunks``: chunk key -> JSON record (identity, blob, size, checksum, refs)
- ``tokens``: entry or chunk key -> the exact token ids (uint32 LE), checked on every hit
- ``bounds``: ``keys.edge_keys(boundary, residual tokens, child)`` -> b"c" (chunk) or b"e"
  (entry): the trie over token prefixes, walked one chunk boundary at a time; under each
  boundary the children sort by the token ids that follow it, so a lookup seeks to the
  ones sharing the longest prefix with the query (``Reader.edges``)
- ``identities``: identity digest -> JSON description (model name, path, dtype ...)
- ``meta``: format version, total blob bytes
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import lmdb

from .keys import (COMPLETE, EDGE_TOKENS, FORMAT_VERSION, KEY_BYTES, edge_keys, edge_tokens, residual,
                   sub_boundary)

log = logging.getLogger("kvstore")
T = TypeVar("T")

_DBS = ("entries", "chunks", "tokens", "bounds", "identities", "meta")
_INITIAL_MAP = 256 << 20
_PROBE_KEY = b"\x00kvstore-open-probe"  # main database; never committed
_LOCK_BYTES = 64 << 10  # lock.mdb: LMDB's reader table for max_readers=512 needs ~33 KiB


# Errors that mean the data file itself is damaged: only these move an index aside.
_CORRUPTION = (lmdb.CorruptedError, lmdb.InvalidError, lmdb.PageNotFoundError,
               lmdb.VersionMismatchError, lmdb.PanicError)
# Before a process maps an index, a child process reads every record of it (and, for a
# writer, probes a write): LMDB has no page checksums, so a damaged page can fault (SIGBUS,
# SIGSEGV) or fail an assertion (SIGABRT) in whatever process reads it. A child that dies
# that way, or that LMDB tells of a damaged B-tree (whose next read may fault instead),
# marks the index as damaged: a writer moves it aside, a reader reports it.
CHECK_AT_OPEN = True
_FATAL = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}
_WALK = r"""
import sys, lmdb
path, ro, size = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
try:
    env = lmdb.open(path, readonly=ro, lock=True, max_dbs=64, subdir=True, readahead=False,
                    max_readers=512, map_size=size, create=False)
except lmdb.Error:
    sys.exit(0)  # the parent's own open reports what is wrong
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError)
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
        except lmdb.Error:
            pass
    if not ro:
        with env.begin(write=True) as txn:
            txn.put(b"\x00kvstore-open-probe", b"")
            txn.delete(b"\x00kvstore-open-probe")
except DAMAGE as e:
    bad.append(str(e))
except lmdb.Error:
    pass
if bad:  # a damaged B-tree: the next read of it may fault instead of failing
    print("; ".join(bad), file=sys.stderr)
    sys.exit(3)
"""
_SHARED: dict[tuple[int, str], tuple[lmdb.Environment, bool, int]] = {}
_SHARED_LOCK = threading.Lock()


def _salvage_into(env: lmdb.Environment, data: Path) -> int:
    """Copy the readable records of a damaged data file into a new environment, the blob
    byte counter recomputed from them. Returns the number of records kept."""
    from .maintenance.pages import salvage  # lazy: maintenance imports this module

    _, found = salvage(data)
    kept, total = 0, 0
    with env.begin(write=True) as txn:
        for name in _DBS:
            db = env.open_db(name.encode(), txn=txn)
            for k, v in found.get(name, []):
                if name == "meta" and k == b"bytes":
                    continue
                if name in ("entries", "chunks"):
                    try:
                        total += _size(json.loads(v))
                    except (ValueError, AttributeError):
                        pass  # unreadable: verify reports it
                try:
                    txn.put(k, v, db=db)
                    kept += 1
                except lmdb.Error:  # a key LMDB cannot hold (damaged length)
                    pass
        txn.put(b"bytes", str(total).encode(), db=env.open_db(b"meta", txn=txn))
    return kept


class IndexError_(RuntimeError):
    """The index cannot be opened or used; the message says what to do."""


def _dump(rec: dict) -> bytes:
    return json.dumps(rec, separators=(",", ":")).encode()


def _count(v: bytes | memoryview | None) -> int:
    """The blob byte counter; a damaged value counts as 0 (``verify`` reports the drift and
    ``--fix`` recomputes it) rather than failing every write that updates it."""
    try:
        return int(bytes(v)) if v else 0
    except ValueError:
        return 0


def _size(rec: dict) -> int:
    try:
        return int(rec.get("size") or 0)
    except (TypeError, ValueError):
        return 0


def _load(b: bytes | memoryview | None) -> dict | None:
    return None if b is None else json.loads(bytes(b))


def entry_edges(key: bytes, rec: dict, tokens: bytes | None) -> list[bytes] | None:
    """The trie edges that make entry ``key`` reachable, or None if its record or token
    ids are too damaged to say."""
    try:
        return edge_keys(bytes.fromhex(rec["boundary"]), residual(bytes(tokens), int(rec["chunk"])), key)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def chunk_edges(key: bytes, rec: dict, tokens: bytes | None) -> list[bytes] | None:
    """The trie edges from a chunk's parent boundary to the chunk ([]: no parent; None:
    unknown)."""
    try:
        return edge_keys(bytes.fromhex(rec["parent"]), bytes(tokens), key) if rec.get("parent") else []
    except (KeyError, TypeError, ValueError):
        return None


def drop_edges(txn: lmdb.Transaction, db: Any, boundary: bytes, child: bytes, edges: list[bytes] | None) -> None:
    """Delete ``child``'s edges: by their keys, or (token ids damaged, so the keys are
    unknown) the first-level ones by scanning ``boundary``'s children; deeper ones are
    then left to ``verify --fix``, which deletes edges leading nowhere."""
    if edges is not None and all([txn.delete(e, db=db) for e in edges]):
        return
    cur = txn.cursor(db=db)
    dead = []
    if cur.set_range(boundary):
        for k in cur.iternext(keys=True, values=False):
            if k[:KEY_BYTES] != boundary:
                break
            if k[-KEY_BYTES:] == child:
                dead.append(bytes(k))
    for k in dead:
        txn.delete(k, db=db)


def _lcp5(a: bytes, b: bytes) -> int:
    """Common prefix, in tokens, of two ``edge_tokens`` spellings."""
    n = 0
    for i in range(0, min(len(a), len(b)) - 4, 5):
        if a[i : i + 5] != b[i : i + 5]:
            break
        n += 1
    return n


class Reader:
    """Reads inside one read transaction: a consistent view for one lookup."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
        self.txn, self._db = txn, dbs

    def entry(self, key: bytes) -> dict | None:
        return _load(self.txn.get(key, db=self._db["entries"]))

    def chunk(self, key: bytes) -> dict | None:
        return _load(self.txn.get(key, db=self._db["chunks"]))

    def tokens(self, key: bytes) -> bytes | None:
        return self.txn.get(key, db=self._db["tokens"])

    def edges(self, boundary: bytes, after: bytes, base: int = 0) -> Iterator[tuple[bytes, str, int, bool]]:
        """Children of ``boundary`` that may share a prefix with the query tokens ``after``
        it, best first: ``(child, "c" | "e", shared, exact)``. ``shared`` bounds how many
        of the query's tokens after the boundary the child shares (``base`` of them before
        ``after``: a sub-boundary's); ``exact``: the child's residual may end inside the
        query (else it is longer, so it must be trimmed). Along the iteration ``shared``
        never grows, so a caller may stop once it cannot gain. A few seeks per level;
        children extending the query's last stretch are visited in turn (any one will do).
        Every child is a candidate only: its stored token ids decide."""
        db = self._db["bounds"]
        m = len(after) // 4
        q = edge_tokens(after)
        head = boundary + q
        cur = self.txn.cursor(db=db)
        seen: set[bytes] = set()

        def child(k: bytes, v: bytes) -> tuple[bytes, str]:
            return bytes(k[-KEY_BYTES:]), bytes(v).decode(errors="replace")

        def spelled(k: bytes) -> bytes:
            return bytes(k[KEY_BYTES : -KEY_BYTES - 1])

        def complete(k: bytes) -> bool:
            return k[-KEY_BYTES - 1 : -KEY_BYTES] == COMPLETE

        shared = 0
        if m and cur.set_range(head) and cur.key()[: len(head)] == head:
            shared = len(q) // 5  # some children share every spelled-out query token
            if m > EDGE_TOKENS:  # those going on are filed one level down, by the next stretch
                step = EDGE_TOKENS * 4
                yield from self.edges(sub_boundary(boundary, after[:step]), after[step:], base + EDGE_TOKENS)
            else:
                for k, v in cur:
                    if k[: len(head)] != head:
                        break
                    seen.add(bytes(k))
                    yield (*child(k, v), base + m, complete(k) and len(spelled(k)) == len(q))
        elif m:  # the neighbours around the query's place share the most
            side: list[tuple[int, int]] = []  # (shared tokens, direction)
            if cur.set_range(head):
                nxt = cur.key()
                if nxt[:KEY_BYTES] == boundary:
                    side.append((_lcp5(spelled(nxt), q), 1))
                if cur.prev() and cur.key()[:KEY_BYTES] == boundary:
                    side.append((_lcp5(spelled(cur.key()), q), -1))
            elif cur.last() and cur.key()[:KEY_BYTES] == boundary:
                side.append((_lcp5(spelled(cur.key()), q), -1))
            shared = max((n for n, _ in side), default=0)
            if shared:
                pre = boundary + q[: shared * 5]
                for _, step in (x for x in side if x[0] == shared):
                    if not cur.set_range(head):
                        cur.last()
                    elif step < 0:
                        cur.prev()
                    for _ in range(32):  # children sharing exactly `shared`: any usable one will do
                        k = cur.key()
                        if k[: len(pre)] != pre or _lcp5(spelled(k), q) != shared:
                            break
                        if bytes(k) not in seen:
                            seen.add(bytes(k))
                            yield (*child(k, cur.value()), base + shared,
                                   complete(k) and len(spelled(k)) == shared * 5)
                        if not (cur.next() if step > 0 else cur.prev()):
                            break
            elif base and cur.set_range(boundary):  # none shares the next token, all share `base`
                for _ in range(32):
                    k = cur.key()
                    if k[:KEY_BYTES] != boundary:
                        break
                    if bytes(k) not in seen:
                        seen.add(bytes(k))
                        yield (*child(k, cur.value()), base, False)
                    if not cur.next():
                        break
        # children whose whole residual is a shorter prefix of the query
        for n in range(min(shared, m, EDGE_TOKENS), -1, -1):
            pre = boundary + q[: n * 5] + COMPLETE
            if cur.set_range(pre):
                for k, v in cur:
                    if k[: len(pre)] != pre:
                        break
                    if bytes(k) not in seen:
                        seen.add(bytes(k))
                        yield (*child(k, v), base + n, True)


class Index:
    """The LMDB index of one cache directory. Safe to share between threads; open one per
    process (after fork). Every method is one short transaction."""

    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self.env = self._shared_open()
        self._db = {name: self.env.open_db(name.encode(), create=not readonly) for name in _DBS}
        if not readonly:
            self._check_format()

    # -- environment -------------------------------------------------------------------

    def _shared_open(self) -> lmdb.Environment:
        """LMDB forbids opening one environment twice in a process, so every Index on the
        same directory in this process shares one (a writable one serves read-only users
        too). Keyed by pid: a forked child opens its own, as LMDB requires."""
        if not self.readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        key = (os.getpid(), os.path.realpath(self.path))
        with _SHARED_LOCK:
            got = _SHARED.get(key)
            if got is not None and (self.readonly or not got[1]):
                _SHARED[key] = (got[0], got[1], got[2] + 1)
                return got[0]
            if got is not None:  # open read-only so far; a writer needs its own handle
                raise IndexError_(f"index {self.path} is already open read-only in this process; "
                                  "open the writable store first")
            env = self._open()
            _SHARED[key] = (env, self.readonly, 1)
            return env

    def _open(self) -> lmdb.Environment:
        try:
            if not self.readonly:
                self._allocate_lock_file()
            damage = self._check_in_child()
            if damage:
                raise lmdb.CorruptedError(damage)
            return self._open_env()
        except lmdb.Error as e:
            if self.readonly or not isinstance(e, _CORRUPTION):
                raise IndexError_(f"cannot open index {self.path}: {e}") from None
            # A damaged data file: keep it for inspection, start a new index holding every
            # record still readable from it (read page by page, without LMDB). Lookups check
            # token ids and blob checksums as always; blobs of lost records become orphans
            # that `kvstore verify --fix` / `gc` remove.
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            os.replace(self.path, aside)
            self.path.mkdir(parents=True)
            self._allocate_lock_file()
            env = self._open_env()
            kept = _salvage_into(env, aside / "data.mdb")
            log.warning("kvstore: index %s is unreadable (%s); moved aside to %s, new index kept "
                        "%d readable records", self.path, e, aside, kept)
            return env

    def _open_env(self) -> lmdb.Environment:
        size = _INITIAL_MAP
        data = self.path / "data.mdb"
        if data.exists():
            size = max(size, data.stat().st_size)
        env = lmdb.open(str(self.path), map_size=size, max_dbs=len(_DBS) + 2, subdir=True,
                        readonly=self.readonly, lock=True, readahead=False, max_readers=512)
        try:
            # touch every named database once so a truncated / foreign file fails here, at open
            with env.begin() as txn:
                txn.stat()
            # LMDB reads pages through a memory map: a page past the end of a truncated file
            # is a SIGBUS, not an error. The meta page names the last page in use.
            need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
            have = data.stat().st_size if data.exists() else 0
            if have < need:
                raise lmdb.CorruptedError(f"{data} is truncated: {have} bytes, its pages need {need}")
            if not self.readonly:
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

    def _check_in_child(self) -> str | None:
        """Why the index would crash a process reading it (see ``CHECK_AT_OPEN``), or None.
        A check that cannot run, takes too long or is killed from outside checks nothing."""
        data = self.path / "data.mdb"
        try:
            size = data.stat().st_size
        except OSError:
            return None
        if not CHECK_AT_OPEN or not sys.executable or size == 0:
            return None
        timeout = 30 + size / (20 << 20)
        cmd = [sys.executable, "-c", _WALK, str(self.path), "1" if self.readonly else "0",
               str(max(_INITIAL_MAP, size))]
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("kvstore: checking index %s took over %.0fs; opening it unchecked", self.path, timeout)
            return None
        except OSError:
            return None
        why = p.stderr.decode(errors="replace").strip().splitlines()
        if p.returncode == 3:
            return f"reading {data} fails: {why[-1] if why else 'damaged'}"
        if p.returncode < 0 and -p.returncode in _FATAL:
            return (f"reading {data} kills the process ({signal.Signals(-p.returncode).name}"
                    + (f": {why[-1]}" if why else "") + ")")
        return None

    def _allocate_lock_file(self) -> None:
        """Give ``lock.mdb`` real blocks before LMDB maps it: LMDB extends the file sparse
        and writes its reader table through the map, which is a SIGBUS on a full disk.
        ``posix_fallocate`` never changes existing bytes (safe next to live processes); a
        full disk makes it raise ENOSPC, a clear error at open."""
        if not hasattr(os, "posix_fallocate"):
            return
        fd = os.open(self.path / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, _LOCK_BYTES)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        finally:
            os.close(fd)

    def _check_format(self) -> None:
        def run(txn: lmdb.Transaction) -> None:
            v = txn.get(b"format", db=self._db["meta"])
            if v is None:
                txn.put(b"format", str(FORMAT_VERSION).encode(), db=self._db["meta"])
            elif int(v) != FORMAT_VERSION:
                raise IndexError_(f"index {self.path} has format {int(v)}, this kvstore reads "
                                  f"{FORMAT_VERSION}: use another --cache-dir or remove it")
        self.write(run)

    def close(self) -> None:
        """Release this handle; the environment closes with the last one in the process."""
        key = (os.getpid(), os.path.realpath(self.path))
        with _SHARED_LOCK:
            got = _SHARED.get(key)
            if got is not None and got[0] is self.env:
                if got[2] > 1:
                    _SHARED[key] = (got[0], got[1], got[2] - 1)
                    return
                del _SHARED[key]
        self.env.close()

    def write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction; grows the map and retries when it is full."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                new = self.env.info()["map_size"] * 2
                log.info("kvstore: index map full, growing to %d MiB", new >> 20)
                self.env.set_mapsize(new)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)

    def read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        while True:
            try:
                with self.env.begin() as txn:
                    return fn(txn)
            except lmdb.MapResizedError:
                self.env.set_mapsize(0)

    # -- reads -------------------------------------------------------------------------

    def entry(self, key: bytes) -> dict | None:
        return self.read(lambda t: _load(t.get(key, db=self._db["entries"])))

    def chunk(self, key: bytes) -> dict | None:
        return self.read(lambda t: _load(t.get(key, db=self._db["chunks"])))

    def tokens(self, key: bytes) -> bytes | None:
        return self.read(lambda t: t.get(key, db=self._db["tokens"]))

    def view(self, fn: Callable[[Reader], T]) -> T:
        """Run ``fn`` on a ``Reader`` over one read transaction (one consistent snapshot)."""
        return self.read(lambda txn: fn(Reader(txn, self._db)))

    def entries(self) -> Iterator[tuple[bytes, dict]]:
        """Every entry record (a snapshot taken in one read transaction)."""
        return iter(self.read(lambda t: [(bytes(k), _load(v)) for k, v in t.cursor(db=self._db["entries"])]))

    def chunks(self) -> Iterator[tuple[bytes, dict]]:
        return iter(self.read(lambda t: [(bytes(k), _load(v)) for k, v in t.cursor(db=self._db["chunks"])]))

    def identities(self) -> dict[str, dict]:
        return self.read(lambda t: {bytes(k).hex(): _load(v) for k, v in t.cursor(db=self._db["identities"])})

    def total_bytes(self) -> int:
        return _count(self.read(lambda t: t.get(b"bytes", db=self._db["meta"])))

    def counts(self) -> dict[str, int]:
        def run(txn: lmdb.Transaction) -> dict[str, int]:
            return {n: txn.stat(self._db[n])["entries"] for n in ("entries", "chunks", "identities")}
        return self.read(run)

    def file_bytes(self) -> int:
        return (self.path / "data.mdb").stat().st_size

    def meta_setdefault(self, key: bytes, value: bytes) -> bytes | None:
        """The ``meta`` value under ``key``, storing ``value`` first when there is none
        (a read-only index stores nothing and returns None then)."""
        db = self._db["meta"]
        if self.readonly:
            got = self.read(lambda t: t.get(key, db=db))
            return None if got is None else bytes(got)

        def run(txn: lmdb.Transaction) -> bytes:
            cur = txn.get(key, db=db)
            if cur is None:
                txn.put(key, value, db=db)
                return value
            return bytes(cur)

        return self.write(run)

    # -- writes ------------------------------------------------------------------------

    def put_identity(self, digest: bytes, info: dict) -> None:
        db = self._db["identities"]
        def run(txn: lmdb.Transaction) -> None:
            if txn.get(digest, db=db) is None:
                txn.put(digest, _dump(info), db=db)
        self.write(run)

    def _add_bytes(self, txn: lmdb.Transaction, n: int) -> None:
        db = self._db["meta"]
        cur = txn.get(b"bytes", db=db)
        txn.put(b"bytes", str(max(0, _count(cur) + n)).encode(), db=db)

    def commit_entry(self, key: bytes, record: dict, tokens: bytes, boundary: bytes,
                     new_chunks: dict[bytes, tuple[dict, bytes, bytes]],
                     reused_chunks: list[bytes]) -> str:
        """Make one entry exist, in one transaction.

        ``new_chunks`` maps chunk key -> (record, tokens, parent boundary) for chunk blobs this
        writer just wrote; ``reused_chunks`` are chunks it found already indexed. Returns
        ``"ok"``, ``"exists"`` (entry already indexed: the caller removes its own new blobs),
        or ``"retry"`` if a reused chunk vanished meanwhile (gc): the caller writes it again.
        Chunk blobs in ``new_chunks`` that turn out to be indexed already are reported back
        through ``record["_dup_blobs"]`` for the caller to unlink.
        """
        e_db, c_db, t_db, b_db = (self._db[n] for n in ("entries", "chunks", "tokens", "bounds"))

        def run(txn: lmdb.Transaction) -> str:
            if txn.get(key, db=e_db) is not None:
                return "exists"
            for ck in reused_chunks:
                if txn.get(ck, db=c_db) is None:
                    return "retry"
            added = record.get("size", 0)
            dups = []
            for ck in list(reused_chunks) + list(new_chunks):
                old = _load(txn.get(ck, db=c_db))
                if old is not None:
                    old["refs"] += 1
                    txn.put(ck, _dump(old), db=c_db)
                    if ck in new_chunks:
                        dups.append(new_chunks[ck][0]["blob"])
                else:
                    crec, ctoks, parent = new_chunks[ck]
                    crec = dict(crec, refs=1)
                    txn.put(ck, _dump(crec), db=c_db)
                    txn.put(ck, ctoks, db=t_db)
                    for e in edge_keys(parent, ctoks, ck):
                        txn.put(e, b"c", db=b_db)
                    added += crec["size"]
            rec = dict(record)
            txn.put(key, _dump(rec), db=e_db)
            txn.put(key, tokens, db=t_db)
            for e in edge_keys(boundary, residual(tokens, int(record["chunk"])), key):
                txn.put(e, b"e", db=b_db)
            self._add_bytes(txn, added)
            record["_dup_blobs"] = dups
            return "ok"

        return self.write(run)

    def remove_entries(self, keys: list[bytes], *, only_if: Callable[[bytes, dict], bool] | None = None,
                       removed: list[bytes] | None = None) -> list[str]:
        """Drop entries (and chunks no longer referenced) in one transaction; returns the
        blob paths (relative) that the caller must unlink after this commit. ``only_if(key,
        record)`` is asked inside the transaction; ``removed`` collects the keys dropped."""
        e_db, c_db, t_db, b_db = (self._db[n] for n in ("entries", "chunks", "tokens", "bounds"))

        def run(txn: lmdb.Transaction) -> list[str]:
            blobs: list[str] = []
            freed = 0
            for key in keys:
                rec = _load(txn.get(key, db=e_db))
                if rec is None or (only_if is not None and not only_if(key, rec)):
                    continue
                if removed is not None:
                    removed.append(key)
                drop_edges(txn, b_db, bytes.fromhex(rec["boundary"]), key,
                           entry_edges(key, rec, txn.get(key, db=t_db)))
                txn.delete(key, db=e_db)
                txn.delete(key, db=t_db)
                if rec.get("blob"):
                    blobs.append(rec["blob"])
                    freed += _size(rec)  # a damaged record goes too (verify --fix recounts)
                parent = bytes.fromhex(rec["root"])
                for ck_hex in rec.get("chunks", []):
                    ck = bytes.fromhex(ck_hex)
                    crec = _load(txn.get(ck, db=c_db))
                    if crec is not None:
                        crec["refs"] -= 1
                        if crec["refs"] <= 0:
                            drop_edges(txn, b_db, parent, ck, chunk_edges(ck, crec, txn.get(ck, db=t_db)))
                            txn.delete(ck, db=c_db)
                            txn.delete(ck, db=t_db)
                            blobs.append(crec["blob"])
                            freed += _size(crec)
                        else:
                            txn.put(ck, _dump(crec), db=c_db)
                    parent = ck
            self._add_bytes(txn, -freed)
            return blobs

        return self.write(run)

    def update_entry(self, key: bytes, fn: Callable[[dict], dict | None]) -> dict | None:
        """Read-modify-write one entry record (touch, pin); returns the new record."""
        db = self._db["entries"]

        def run(txn: lmdb.Transaction) -> dict | None:
            rec = _load(txn.get(key, db=db))
            if rec is None:
                return None
            new = fn(rec)
            if new is not None:
                txn.put(key, _dump(new), db=db)
            return new

        return self.write(run)

    def touch_many(self, hits: dict[bytes, tuple[float, int]]) -> None:
        """Record uses: ``key -> (last_used, extra hits)``; missing keys are skipped."""
        db = self._db["entries"]

        def run(txn: lmdb.Transaction) -> None:
            for key, (when, n) in hits.items():
                rec = _load(txn.get(key, db=db))
                if rec is not None:
                    rec["last_used"] = max(rec.get("last_used", 0), when)
                    rec["hits"] = rec.get("hits", 0) + n
                    txn.put(key, _dump(rec), db=db)

        self.write(run)

    def drop_chunk_orphans(self, chunk_keys: list[bytes]) -> list[str]:
        """Remove chunk records with no referencing entry (repair); returns their blobs."""
        c_db, t_db, b_db = (self._db[n] for n in ("chunks", "tokens", "bounds"))

        def run(txn: lmdb.Transaction) -> list[str]:
            blobs = []
            for ck in chunk_keys:
                crec = _load(txn.get(ck, db=c_db))
                if crec is None:
                    continue
                if crec.get("parent"):
                    drop_edges(txn, b_db, bytes.fromhex(crec["parent"]), ck,
                               chunk_edges(ck, crec, txn.get(ck, db=t_db)))
                txn.delete(ck, db=c_db)
                txn.delete(ck, db=t_db)
                blobs.append(crec["blob"])
                self._add_bytes(txn, -crec["size"])
            return blobs

        return self.write(run)
