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
- A record that is unreadable, torn, not JSON, too large or for another id is a miss.
- Bounded: at most ``max_count`` records and ``max_bytes`` bytes (defaults
  ``DEFAULT_MAX_COUNT``, ``DEFAULT_MAX_BYTES``); the oldest (by modification time) are
  removed first once a write passes either bound; a record larger than ``max_bytes`` alone
  is not stored (said in the log).
- Without a disk tier (the cache directory could not be used) records are kept in process
  memory under the same bounds, and are lost with the process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from .. import files
from ..salt import Salt, salt_key
from ..escape import logger

log = logger("kvstore")
DIRECTORY = "responses"
DEFAULT_MAX_COUNT = 1000
DEFAULT_MAX_BYTES = 256 << 20
_NAME = re.compile(r"[0-9a-f]{32}\.json")


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

    def put(self, salt: Salt | None, response_id: str, record: dict[str, Any]) -> bool:
        """Keep ``record`` as ``response_id``'s (replacing one of that id); True if kept."""
        data = json.dumps({"id": response_id, **record}, separators=(",", ":")).encode()
        if len(data) > self.max_bytes:
            log.warning("kvstore: response %s not stored: %d bytes, more than the %d the store keeps",
                        response_id, len(data), self.max_bytes)
            return False
        name = record_name(salt, response_id)
        with self._lock:
            if self.dir is None:
                self._memory.pop(name, None)
                self._memory[name] = data
                self._evict_memory()
                return True
            try:
                files.make_dir(self.dir, self.modes)
                files.replace_file(self.dir / name, data, self.modes)
                self._evict_files()
            except (OSError, files.BlobError) as e:
                log.warning("kvstore: response %s not stored: %s", response_id, e)
                return False
        return True

    def get(self, salt: Salt | None, response_id: str) -> dict[str, Any] | None:
        """``response_id``'s record for the tenant of ``salt``, or None (a miss)."""
        name = record_name(salt, response_id)
        data = self._memory.get(name) if self.dir is None else self._read(name)
        if data is None:
            return None
        try:
            record = json.loads(data)
        except (ValueError, RecursionError):
            return None
        return record if isinstance(record, dict) and record.get("id") == response_id else None

    def delete(self, salt: Salt | None, response_id: str) -> bool:
        """Remove ``response_id``'s record; True if the tenant of ``salt`` had one."""
        if self.get(salt, response_id) is None:
            return False
        name = record_name(salt, response_id)
        with self._lock:
            if self.dir is None:
                return self._memory.pop(name, None) is not None
            return self._unlink(name)

    # -- files ---------------------------------------------------------------------------

    def _read(self, name: str) -> bytes | None:
        assert self.dir is not None
        if not files.real_dir(self.dir):
            return None
        try:
            fd = files.open_regular(self.dir / name)
        except (OSError, files.BlobError):
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read(self.max_bytes + 1)
        return data if len(data) <= self.max_bytes else None

    def _unlink(self, name: str) -> bool:
        assert self.dir is not None
        try:
            if not stat.S_ISREG(os.lstat(self.dir / name).st_mode):
                return False
            os.unlink(self.dir / name)
        except OSError:
            return False
        return True

    def _evict_files(self) -> None:
        """Remove the oldest records until both bounds hold."""
        assert self.dir is not None
        found = []
        with os.scandir(self.dir) as it:
            for e in it:
                if not _NAME.fullmatch(e.name):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, e.name, st.st_size))
        found.sort()
        count, total = len(found), sum(size for _, _, size in found)
        for _, name, size in found:
            if count <= self.max_count and total <= self.max_bytes:
                break
            if self._unlink(name):
                count, total = count - 1, total - size

    def _evict_memory(self) -> None:
        total = sum(len(v) for v in self._memory.values())
        while self._memory and (len(self._memory) > self.max_count or total > self.max_bytes):
            _, data = self._memory.popitem(last=False)
            total -= len(data)
