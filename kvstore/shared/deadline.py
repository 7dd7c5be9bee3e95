"""Wall-time budgets for calls to Redis: a watchdog that abandons a late call's sockets.

A socket timeout bounds one read, not a call: a server (or a path) that sends a few bytes
before every timeout keeps a many-MB reply going for minutes. ``watch(until, abandon)``
registers ``abandon`` (close the call's connections) to run on the watchdog thread once
``time.monotonic()`` passes ``until``; closing a socket wakes the reader blocked on it
with an error, so the call fails at once and the client reconnects next time.
``Watch.cancel()`` (when the call ends in time) and ``Watch.fired`` (whether it was cut
off: the error is then a deadline, not the server's) are the caller's.

One daemon thread for the process, started on first use; ``abandon`` must not block and
its exceptions are swallowed (the call is failing anyway).

``bound(until)`` marks the current thread as working for a call with that deadline
(``current()`` reads it), so that code the call reaches without being handed ``until`` (a
redis-py reconnect, ``wire``) keeps to it; a thread a call starts takes the mark with it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["Watch", "watch", "remaining", "bound", "current"]


class Watch:
    """One registered deadline (see ``watch``)."""

    def __init__(self, until: float, abandon: Callable[[], None]) -> None:
        self.until = until
        self.abandon = abandon
        self.fired = False
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


_cond = threading.Condition()
_heap: list[tuple[float, int, Watch]] = []
_seq = itertools.count()
_thread: threading.Thread | None = None


def watch(until: float, abandon: Callable[[], None]) -> Watch:
    """Run ``abandon`` at monotonic time ``until`` unless cancelled first."""
    global _thread
    w = Watch(until, abandon)
    with _cond:
        heapq.heappush(_heap, (until, next(_seq), w))
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="kvstore-shared-deadline", daemon=True)
            _thread.start()
        _cond.notify()
    return w


def remaining(until: float | None) -> float | None:
    """Seconds left before ``until`` (never below 0), None for no deadline."""
    return None if until is None else max(0.0, until - time.monotonic())


_local = threading.local()


@contextmanager
def bound(until: float | None) -> Iterator[None]:
    """This thread works for a call with deadline ``until`` (None: no deadline) until the
    block ends; the previous mark is restored after."""
    saved = getattr(_local, "until", None)
    _local.until = until
    try:
        yield
    finally:
        _local.until = saved


def current() -> float | None:
    """The deadline of the call this thread works for (``bound``), None outside one."""
    return getattr(_local, "until", None)


def _run() -> None:
    while True:
        with _cond:
            while _heap and _heap[0][2].cancelled:
                heapq.heappop(_heap)
            wait = None if not _heap else _heap[0][0] - time.monotonic()
            if wait is None or wait > 0:
                _cond.wait(wait)
                continue
            w = heapq.heappop(_heap)[2]
        w.fired = True
        try:
            w.abandon()
        except Exception:
            pass
