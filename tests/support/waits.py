"""Waits with a hang guard, for tests that must not assert on how long something took.

How long a call takes depends on how loaded the machine is, so a test asserts what the call
did (a counter, an order, an event) and bounds only a hang: ``bounded`` runs a call and fails
if it has not returned within ``HANG_S``; ``wait_for`` polls a condition under the same kind
of deadline. Neither deadline is the assertion.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

HANG_S = 60.0  # a call or a wait this long hung (what the tests wait for takes seconds at most)


def wait_for(predicate: Callable[[], object], timeout: float = HANG_S, step: float = 0.02) -> None:
    """Poll until ``predicate()`` is true; fails after ``timeout`` (a hang, not a slow machine)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(step)


def bounded(fn: Callable[..., Any], *args: Any, limit: float = HANG_S, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run on a thread; its result (or its exception, raised here).
    Fails when it has not returned within ``limit``: the guard against a hang."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn(*args, **kwargs))
        except BaseException as e:  # raised below, on the caller's thread
            errors.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {limit} s"
    if errors:
        raise errors[0]
    return out[0]
