"""The store's counters: one object, one lock.

Request threads (hits, misses, restores), the writer thread (writes, write errors) and the
publisher thread all count into the same ``Counters``; every ``add`` takes its lock, so no
increment is lost to a race (``x += 1`` on a shared dict is a read and a write). The keys
and their order are what ``KVStore.stats()`` reports.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

KEYS = ("hits_memory", "hits_disk", "hits_shared", "misses", "tokens_saved", "bytes_read",
        "bytes_written", "restore_seconds", "restores", "write_seconds", "writes",
        "corrupt", "races", "io_errors", "write_errors", "unpersistable", "refused_cuts",
        "warnings_suppressed", "tokens_memory", "tokens_disk", "tokens_shared", "evictions_memory",
        "evictions_disk", "gc_runs", "gc_freed_bytes", "writes_skipped_policy", "writes_skipped_budget",
        "evictions_pressure", "restores_one_pass", "whole_copies_written", "whole_copies_dropped")
SECONDS = ("restore_seconds", "write_seconds")  # floats; the others count
HISTOGRAMS = ("restore_seconds", "persist_seconds")  # distributions, reported as "<name>_histogram"

# restore and persist times of a KV cache span sub-millisecond (a small entry in the page
# cache) to seconds (a long context from a cold SSD)
BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Durations:
    """A thread-safe histogram of durations in seconds (Prometheus' ``le`` buckets)."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            self._counts[bisect_left(self.buckets, seconds)] += 1
            self._sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``{"le": bounds, "counts": cumulative counts per bound, "count", "sum"}`` (JSON)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, run = [], 0
        for c in counts[:-1]:
            run += c
            cumulative.append(run)
        return {"le": list(self.buckets), "counts": cumulative, "count": run + counts[-1], "sum": total}


class Counters:
    """Named counters (``KEYS``), safe to add to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int | float] = {k: 0.0 if k in SECONDS else 0 for k in KEYS}
        self._hist = {k: Durations() for k in HISTOGRAMS}

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

    def observe(self, name: str, seconds: float) -> None:
        """Record one duration in histogram ``name`` (one of ``HISTOGRAMS``)."""
        self._hist[name].observe(seconds)

    def histograms(self) -> dict[str, dict[str, Any]]:
        """``{"<name>_histogram": Durations.snapshot()}`` for every histogram."""
        return {f"{k}_histogram": d.snapshot() for k, d in self._hist.items()}
