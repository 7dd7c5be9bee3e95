"""Stored responses of ``POST /v1/responses`` (``store: true``): small JSON files in the cache
directory, so ``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}`` work after
a restart too.

Why files and not LMDB: a record is written once, read whole and removed whole; each is a
few kilobytes to a few hundred (a conversation's messages), and nothing queries across
them. One file per response, written atomically (``files.replace_file``: a fresh temp name,
renamed over), needs no map size, no second lock file and no schema beside the index's,
and a torn or foreign file is simply a miss.

Guarantees:
- Everything is made under ``<cache dir>/responses/`` by ``files`` (the cache directory's
  modes: private 0600/0700 unless it is shared on purpose); names are ``<32 hex>.json``,
  a keyed BLAKE2b of the response id under the tenant's salt (``salt.salt_key``): another
  tenant's id (another ``cache_salt``, another key under ``--isolate-keys``) names another
  file, so it is a miss (404), never that tenant's record. Nothing but such names is ever
  read or removed there, never through a symlink (``files.open_regular``, ``lstat``).
- Every record is read through ``response_record.Record.from_bytes`` (every field
  checked): one that is unreadable, torn, not JSON, nested too deep, missing a field or of
  the wrong type, too large, not a regular file or for another id is a miss, counted in
  ``stats()`` (``invalid_records``, by reason), never an exception in a handler.
- Bounded: at most ``max_count`` records and ``max_bytes`` bytes (defaults
  ``DEFAULT_MAX_COUNT``, ``DEFAULT_MAX_BYTES``). Each record carries a sequence number
  (``seq``) this store hands out, one past the largest on disk (read at its first write); once a
  write passes either bound the lowest are removed first: records no reader accepts, then
  records written before ``seq`` existed (by modification time among themselves), then by
  ``seq``. Never by the clock alone (a clock stepped back would otherwise evict the newest
  first), and never the record the write just stored. A record larger than ``max_bytes``
  alone, or one that cannot be written, is not stored: ``put`` raises ``NotStored`` saying
  why, before the caller answers. Two processes sharing the directory may hand out the same
  number; the name breaks the tie, and each catches up with the other's at its next write.
- Without a disk tier (the cache directory could not be used) records are kept in process
  memory under the same bounds, and are lost with the process.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

from .. import files
from ..salt import Salt, salt_key
from ..escape import logger
from .response_record import Record, RecordError

log = logger("kvstore")
DIRECTORY = "responses"
DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_BYTES = 256 << 20
_NAME = re.compile(r"[0-9a-f]{32}\.json")
# eviction ranks: lowest first (a rank is (class, value, name))
_INVALID, _LEGACY, _SEQ = 0, 1, 2


class NotStored(Exception):
    """A record ``put`` could not keep; the message says why (for the answer and the log)."""


def record_name(salt: Salt | None, response_id: str) -> str:
    """The file name of ``response_id`` for the tenant of ``salt`` (None: no salt)."""
    key = salt_key(salt) if salt is not None else b""
    digest = hashlib.blake2b(response_id.encode("utf-8", "surrogatepass"), digest_size=16, key=key,
                             person=b"kvstore-resp-v1").hexdigest()
    return f"{digest}.json"


class ResponseStore:
    """Stored responses of one cache directory (``root`` None: process memory only)."""

    def __init__(self, root: Path | None, modes: files.Modes = files.PRIVATE, *,
                 max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.dir = root / DIRECTORY if root is not None else None
        self.modes = modes
        self.max_count, self.max_bytes = max_count, max_bytes
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._next: int | None = None  # the next seq; None until the directory was read
        self._ranks: dict[str, tuple[tuple[int, int, int], tuple[int, int]]] = {}  # name -> (stat, rank) read
        self.invalid: Counter[str] = Counter()  # records refused on a read, by reason
        self.not_stored = self.evicted = 0

    def put(self, salt: Salt | None, response_id: str, response: dict[str, Any],
            conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` and its ``conversation`` as ``response_id``'s (replacing one of
        that id), found by ``get`` once this returns (renamed into place); NotStored saying why not."""
        try:
            self._put(record_name(salt, response_id), response_id, response, conversation)
        except NotStored as e:
            self.not_stored += 1
            log.warning("kvstore: response %s not stored: %s", response_id, e)
            raise

    def _put(self, name: str, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.max_count < 1:
            raise NotStored("--responses-max-count is 0: no response is kept")
        with self._lock:
            seq = self._next_seq()
            try:
                data = Record(response_id, response, conversation, seq).to_bytes()
            except (TypeError, ValueError, RecursionError) as e:
                raise NotStored(f"the record could not be made: {e}") from None
            if len(data) > self.max_bytes:
                raise NotStored(f"the record is {len(data):,} bytes, more than the {self.max_bytes:,} the store "
                                "keeps (--responses-max-bytes)")
            try:
                Record.from_bytes(data)  # what a reader will accept: refused now, not a later 404
            except RecordError as e:
                raise NotStored(f"the record could not be read back: {e}") from None
            self._next = seq + 1
            if self.dir is None:
                self._memory.pop(name, None)
                self._memory[name] = data
                self._evict_memory()
                return
            try:
                files.make_dir(self.dir, self.modes)
                files.replace_file(self.dir / name, data, self.modes)
            except (OSError, files.BlobError) as e:
                raise NotStored(f"it could not be written: {e}") from None
            try:
                self._evict_files(keep=name)
            except OSError as e:  # kept, but the bounds may be passed until the next write
                log.warning("kvstore: stored responses not evicted: %s", e)

    def get(self, salt: Salt | None, response_id: str) -> Record | None:
        """``response_id``'s record for the tenant of ``salt``, or None: a miss (counted in
        ``invalid`` when something that is not such a record is there)."""
        try:
            record = self._load(record_name(salt, response_id))
            if record is not None and record.id != response_id:
                raise RecordError("other_id", "the record under this name is another id's")
        except RecordError as e:
            self.invalid[e.reason] += 1
            log.warning("kvstore: stored response %s unusable (a miss): %s", response_id, e)
            return None
        return record

    def delete(self, salt: Salt | None, response_id: str) -> bool:
        """Remove ``response_id``'s record; True if the tenant of ``salt`` had one."""
        if self.get(salt, response_id) is None:
            return False
        name = record_name(salt, response_id)
        with self._lock:
            if self.dir is None:
                return self._memory.pop(name, None) is not None
            self._ranks.pop(name, None)
            return self._unlink(name)

    def stats(self) -> dict[str, Any]:
        """Counters since start: records refused on a read (``invalid_records``, and by
        reason), responses not stored, records evicted."""
        return {"invalid_records": sum(self.invalid.values()), "invalid_by_reason": dict(self.invalid),
                "not_stored": self.not_stored, "evicted": self.evicted}

    # -- files ---------------------------------------------------------------------------

    def _load(self, name: str) -> Record | None:
        """The record under ``name``: None if there is none, RecordError if what is there
        is not one."""
        if self.dir is None:
            data = self._memory.get(name)
            return Record.from_bytes(data) if data is not None else None
        if not files.real_dir(self.dir):
            return None
        try:
            fd = files.open_regular(self.dir / name)
        except files.BlobError as e:
            if not os.path.lexists(self.dir / name):
                return None
            raise RecordError("not_regular", str(e)) from None
        except OSError as e:
            raise RecordError("unreadable", str(e)) from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:
            raise RecordError("too_large", f"more than the {self.max_bytes:,} bytes the store keeps")
        return Record.from_bytes(data)

    def _unlink(self, name: str) -> bool:
        assert self.dir is not None
        try:
            if not stat.S_ISREG(os.lstat(self.dir / name).st_mode):
                return False
            os.unlink(self.dir / name)
        except OSError:
            return False
        return True

    def _next_seq(self) -> int:
        """The next sequence number: on first use, one past the largest on disk."""
        if self._next is None:
            if self.dir is not None and files.real_dir(self.dir):
                try:
                    self._next = 0
                    self._found()
                except OSError as e:
                    self._next = None
                    raise NotStored(f"the stored responses could not be listed: {e}") from None
            self._next = self._next or 0
        return self._next

    def _rank(self, name: str, st: os.stat_result) -> tuple[int, int]:
        """The eviction rank of the record file ``name`` (read once per change of its stat)."""
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        got = self._ranks.get(name)
        if got is not None and got[0] == ident:
            return got[1]
        try:
            record = self._load(name)
            rank = (_INVALID, 0) if record is None else (_LEGACY, st.st_mtime_ns) if record.seq is None else (_SEQ, record.seq)
        except RecordError:
            rank = (_INVALID, 0)
        self._ranks[name] = (ident, rank)
        return rank

    def _found(self) -> list[tuple[tuple[int, int, str], int]]:
        """Every record file (rank, size), lowest rank first; moves the next seq past theirs."""
        assert self.dir is not None
        found = []
        for name, st in files.named_files(self.dir, _NAME):
            kind, value = self._rank(name, st)
            found.append(((kind, value, name), st.st_size))
            if kind == _SEQ:
                self._next = max(self._next or 0, value + 1)
        names = {key[2] for key, _ in found}
        for gone in [n for n in self._ranks if n not in names]:
            del self._ranks[gone]
        found.sort()
        return found

    def _evict_files(self, keep: str) -> None:
        """Remove the lowest-ranked records, never ``keep``, until both bounds hold."""
        found = self._found()
        count, total = len(found), sum(size for _, size in found)
        for (_, _, name), size in found:
            if count <= self.max_count and total <= self.max_bytes:
                break
            if name != keep and self._unlink(name):
                self._ranks.pop(name, None)
                count, total, self.evicted = count - 1, total - size, self.evicted + 1

    def _evict_memory(self) -> None:
        total = sum(len(v) for v in self._memory.values())
        while len(self._memory) > 1 and (len(self._memory) > self.max_count or total > self.max_bytes):
            _, data = self._memory.popitem(last=False)
            total -= len(data)
            self.evicted += 1
