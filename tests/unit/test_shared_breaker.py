"""kvstore.shared.breaker: the circuit breaker's backoff."""

from __future__ import annotations

from kvstore.shared.breaker import Breaker


def test_breaker_backoff_doubles_to_cap_and_resets() -> None:
    now = [0.0]
    b = Breaker(failures=2, backoff=1.0, backoff_max=3.0, clock=lambda: now[0])
    assert b.allow() and not b.failure() and b.state == "closed"
    assert b.failure() and b.state == "open" and b.opens == 1
    assert not b.allow() and b.retry_in() == 1.0
    now[0] = 1.0
    assert b.allow() and b.state == "half-open"
    assert not b.allow()  # one probe at a time
    assert b.failure() and b.retry_in() == 2.0  # failed probe: doubled
    now[0] = 3.0
    assert b.allow() and b.failure() and b.retry_in() == 3.0  # capped
    now[0] = 6.0
    assert b.allow()
    b.abandon()  # the probe raised a non-Redis error: the next call probes instead
    assert b.state == "open" and b.allow()
    assert b.success() and b.state == "closed"
    assert not b.failure() and b.failure() and b.retry_in() == 1.0  # backoff reset
    assert b.opens == 4
