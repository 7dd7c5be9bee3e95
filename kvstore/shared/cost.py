"""When a shared hit pays: moving estimates of this link and of this machine's prefill.

A shared hit moves ``bytes`` over the link to save prefilling ``tokens``; it pays when

    latency + bytes / bandwidth  <  tokens / prefill_rate

``Link`` keeps the link's side: a moving average (EWMA) of the bandwidth of value
transfers (round trip 2: bytes received over wall time) and of the round-trip latency
(round trip 1), plus bytes per token per model. ``PrefillRates`` keeps the other side per
model identity: kvstore never runs the prefill itself, so it measures it as the time from
a fetch that served ``n`` of a prompt's tokens to the insert of that prompt's cache
(``kvstore.generate`` inserts right after prefill; an adapter that inserts after
generating too makes the rate look slower, so more hits are taken, never fewer).

Until both sides have a sample the answer is "take it" (nothing to compare yet). A
first deadline passed sets the bandwidth estimate to what the link delivered in that
time, a later one halves it, so a link that is or turned slow soon stops being asked
while one stall does not stop a good link; a decision older than ``PROBE_AFTER``
seconds without a transfer lets one lookup through to measure the link again.
Thread-safe.
"""

from __future__ import annotations

import threading
import time

ALPHA = 0.3          # weight of a new sample in the moving averages
PROBE_AFTER = 30.0   # seconds without a transfer after which one lookup measures again
RATE_WINDOW = 600.0  # a fetch older than this is not the prefill of the next insert


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class Link:
    """Moving estimates of one shared store's link (see the module docstring)."""

    def __init__(self) -> None:
        self.bandwidth: float | None = None  # bytes/s of value transfers
        self.latency: float | None = None    # seconds per small round trip
        self._bpt: dict[bytes, float] = {}   # identity -> value bytes per token
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def round_trip(self, seconds: float) -> None:
        with self._lock:
            self.latency = _ewma(self.latency, max(seconds, 0.0))

    def transfer(self, identity: bytes, nbytes: int, tokens: int, seconds: float) -> None:
        """A completed transfer of ``nbytes`` holding ``tokens`` tokens' KV."""
        with self._lock:
            self._last = time.monotonic()
            if nbytes > 0 and seconds > 0:
                self.bandwidth = _ewma(self.bandwidth, nbytes / seconds)
            if nbytes > 0 and tokens > 0:
                self._bpt[identity] = _ewma(self._bpt.get(identity), nbytes / tokens)

    def late(self, nbytes: float | None = None, seconds: float | None = None, received: int | None = None) -> None:
        """A transfer of ``nbytes`` cut off at its deadline after ``seconds``, ``received``
        bytes in: the link is slower than nbytes / seconds. Not measured yet, the estimate
        becomes what it delivered, received / seconds (or that bound when nothing came: a
        stall says nothing of the link); measured, it halves (at most the bound), so one
        stall does not stop a good link being asked."""
        with self._lock:
            self._last = time.monotonic()
            bound = nbytes / seconds if nbytes and seconds else None
            measured = received / seconds if received and seconds else None
            if self.bandwidth is None:
                known = [b for b in (bound, measured) if b is not None]
                self.bandwidth = min(known) if known else None
            else:
                self.bandwidth = min(self.bandwidth / 2, bound) if bound is not None else self.bandwidth / 2

    def bytes_per_token(self, identity: bytes) -> float | None:
        with self._lock:
            return self._bpt.get(identity)

    def seconds(self, nbytes: float) -> float | None:
        """Expected wall time to move ``nbytes`` (None: not measured yet, or time to probe)."""
        with self._lock:
            if self.bandwidth is None or time.monotonic() - self._last > PROBE_AFTER:
                return None
            return (self.latency or 0.0) + nbytes / self.bandwidth


class PrefillRates:
    """Per identity: prefill tokens per second on this machine, measured fetch -> insert."""

    def __init__(self) -> None:
        self._rate: dict[bytes, float] = {}
        self._open: dict[bytes, tuple[float, int]] = {}  # identity -> (fetch time, tokens served)
        self._lock = threading.Lock()

    def fetched(self, identity: bytes, served: int) -> None:
        with self._lock:
            self._open[identity] = (time.monotonic(), served)

    def inserted(self, identity: bytes, n: int) -> None:
        """The insert of a ``n``-token prompt: its prefill ran since the last fetch."""
        with self._lock:
            got = self._open.pop(identity, None)
        if got is None:
            return
        t, served = got
        dt = time.monotonic() - t
        if n > served and 0 < dt < RATE_WINDOW:
            self.observe(identity, n - served, dt)

    def observe(self, identity: bytes, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds`` (also for a caller that times
        its own prefill, or knows the rate)."""
        if tokens > 0 and seconds > 0:
            with self._lock:
                self._rate[identity] = _ewma(self._rate.get(identity), tokens / seconds)

    def rate(self, identity: bytes) -> float | None:
        with self._lock:
            return self._rate.get(identity)

    def seconds(self, identity: bytes, tokens: int) -> float | None:
        """Expected prefill time of ``tokens`` tokens (None: not measured yet)."""
        r = self.rate(identity)
        return None if r is None else tokens / r
