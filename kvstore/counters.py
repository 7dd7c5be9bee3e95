"""The store's counters: one object, one lock.

Request threads (hits, misses, restores), the writer thread (writes, write errors) and the
publisher thread all count into the same ``Counters``; every ``add`` takes its lock, so no
increment is lost to a race (``x += 1`` on a shared dict is a read and a write). The keys
and their order are what ``KVStore.stats()`` reports.
"""

from __future__ import annotations

import threading

KEYS = ("hits_memory", "hits_disk", "hits_shared", "misses", "tokens_saved", "bytes_read",
        "bytes_written", "restore_seconds", "restores", "write_seconds", "writes",
        "corrupt", "races", "io_errors", "write_errors", "unpersistable", "refused_cuts",
        "warnings_suppressed")
SECONDS = ("restore_seconds", "write_seconds")  # floats; the others count


class Counters:
    """Named counters (``KEYS``), safe to add to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int | float] = {k: 0.0 if k in SECONDS else 0 for k in KEYS}

    def add(self, name: str, n: int | float = 1, **more: int | float) -> None:
        """Add ``n`` to counter ``name`` (and each ``more`` to its own), atomically."""
        with self._lock:
            self._values[name] += n
            for k, v in more.items():
                self._values[k] += v

    def __getitem__(self, name: str) -> int | float:
        return self._values[name]

    def snapshot(self) -> dict[str, int | float]:
        """Every counter, read under the lock (one consistent view), in ``KEYS`` order."""
        with self._lock:
            return dict(self._values)
