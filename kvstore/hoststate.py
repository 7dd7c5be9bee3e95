"""kvstore never changes its host process's global state; this module is how.

An engine seeds MLX's random generator and then asks kvstore for a cache (mlx_lm.server
does exactly that on its generation thread), so anything kvstore does on the caller's
thread that draws random numbers (building a model: ``nn.Linear`` initialises its
weights from the global key, even lazily) would change the sampled text. MLX keeps its
random state, default device and default stream per thread, so ``isolated`` runs such
work on a short-lived thread of its own: the caller's state is never read or written.

``snapshot`` records what kvstore promises to leave alone (random key, default device
and stream, memory / cache limits, logging configuration), for tests to compare before
and after any entry point.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable, TypeVar, cast

T = TypeVar("T")


def isolated(fn: Callable[[], T], name: str = "kvstore-isolated") -> T:
    """``fn()`` run on a fresh thread: its result, or its exception re-raised here.

    Whatever ``fn`` does to MLX's per-thread state (random key, default stream) stays on
    that thread. Blocks until ``fn`` returns."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e
        finally:
            release_streams()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def release_streams() -> None:
    """Destroy the MLX streams this thread made, now: call it last on every thread kvstore
    starts that may run MLX work (never on a caller's thread: its streams are the host's).

    Why: MLX 0.32 gives each thread its own default stream and otherwise destroys it in
    the thread's C++ thread-local destructors, after ``Thread.join`` has already returned.
    If the interpreter is finalizing by then (a short program that joins the thread and
    exits), that destructor's wait for the GIL ends the thread by a forced unwind through
    a ``noexcept`` frame and the whole process aborts: "terminate called without an active
    exception", rc -6 (ml-explore/mlx#4110; MLX asks threads to call ``clear_streams``
    before they end). A no-op when MLX was never imported or has no ``clear_streams``."""
    mx = sys.modules.get("mlx.core")
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()


def releasing(run: Callable[[], Any]) -> Callable[[], None]:
    """``run`` as the target of a thread kvstore starts: its MLX streams released at its end
    (``release_streams``), however it ends."""

    def target() -> None:
        try:
            run()
        finally:
            release_streams()

    return target


def _limits(mx: Any) -> dict[str, Any]:
    """MLX's memory, cache and wired limits (each read by setting it back at once)."""
    got = {}
    for name in ("set_memory_limit", "set_cache_limit", "set_wired_limit"):
        setter = getattr(mx, name, None)
        if setter is None:
            continue
        try:
            prev = setter(0)
            setter(prev)
            got[name] = prev
        except (RuntimeError, ValueError):  # e.g. no wired limit on this backend
            got[name] = None
    return got


def _logging() -> dict[str, Any]:
    loggers = {"": logging.getLogger()}
    loggers.update((n, lg) for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger))
    return {
        "disable": logging.root.manager.disable,
        "loggers": {n: (lg.level, lg.propagate, lg.disabled, tuple(id(h) for h in lg.handlers))
                    for n, lg in loggers.items()},
    }


def snapshot() -> dict[str, Any]:
    """This thread's MLX random key, default device and stream, MLX's limits, and the
    logging configuration (levels, handlers, propagation of every existing logger)."""
    import mlx.core as mx

    device = mx.default_device()
    return {
        "random_key": cast(Any, mx.random.state)[0].tolist(),
        "device": str(device),
        "stream": str(mx.default_stream(device)),
        "limits": _limits(mx),
        "logging": _logging(),
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The parts of two snapshots that differ, ``{part: (before, after)}``; loggers that
    appeared in between count only if configured (a new logger with no level, handler
    or non-default flag is what ``logging.getLogger`` makes on first use)."""
    out = {k: (before[k], after[k]) for k in before if k != "logging" and before[k] != after[k]}
    lb, la = before["logging"], after["logging"]
    if lb["disable"] != la["disable"]:
        out["logging.disable"] = (lb["disable"], la["disable"])
    for name, conf in la["loggers"].items():
        old = lb["loggers"].get(name, (logging.NOTSET, True, False, ()))
        if conf != old:
            out[f"logger {name or 'root'}"] = (old, conf)
    return out
