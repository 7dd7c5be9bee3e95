"""A circuit breaker: stop asking a server that keeps failing, probe it again later.

States: ``closed`` (calls go through), ``open`` (calls are refused without I/O until the
backoff ends), ``half-open`` (exactly one probe call is let through; its outcome closes the
breaker or opens it again with the backoff doubled, up to a cap).

Guarantees: thread-safe; ``allow()`` never blocks beyond a short lock and does no I/O; at
most one probe is in flight at a time; a success resets the backoff to its base.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"


class Breaker:
    """Opens after ``failures`` consecutive failures, for ``backoff`` seconds doubling per
    failed probe up to ``backoff_max``."""

    def __init__(self, failures: int = 3, backoff: float = 0.5, backoff_max: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or backoff <= 0 or backoff_max < backoff:
            raise ValueError("breaker needs failures >= 1 and 0 < backoff <= backoff_max")
        self.failures = failures
        self.backoff = backoff
        self.backoff_max = backoff_max
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive = 0
        self._interval = backoff
        self._reopen_at = 0.0
        self.opens = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def retry_in(self) -> float:
        """Seconds until the next probe is allowed (0 when closed or due)."""
        with self._lock:
            if self._state != OPEN:
                return 0.0
            return max(0.0, self._reopen_at - self._clock())

    def allow(self) -> bool:
        """May a call go out now? When the backoff has ended, True for one caller (the probe)."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self._clock() >= self._reopen_at:
                self._state = HALF_OPEN
                return True
            return False

    def success(self) -> bool:
        """Record a call that reached the server. True if this closed an open breaker."""
        with self._lock:
            recovered = self._state != CLOSED
            self._state = CLOSED
            self._consecutive = 0
            self._interval = self.backoff
            return recovered

    def failure(self) -> bool:
        """Record a failed call. True if this opened the breaker."""
        with self._lock:
            if self._state == HALF_OPEN:
                self._interval = min(self._interval * 2, self.backoff_max)
                self._open()
                return True
            if self._state == OPEN:  # a call allowed before the breaker opened
                return False
            self._consecutive += 1
            if self._consecutive >= self.failures:
                self._interval = self.backoff
                self._open()
                return True
            return False

    def abandon(self) -> None:
        """The allowed call ended without an outcome (a caller's bug): let the next call probe."""
        with self._lock:
            if self._state == HALF_OPEN:
                self._state = OPEN
                self._reopen_at = self._clock()

    def _open(self) -> None:
        self._state = OPEN
        self._consecutive = 0
        self._reopen_at = self._clock() + self._interval
        self.opens += 1
