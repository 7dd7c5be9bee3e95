"""Child processes that end with whoever started them: the tests, the benchmarks and the demo.

A loaded laptop makes everything slow, so nothing here limits how long a child may take to
do its work; what is bounded is a hang (no output for a long while) and what is guaranteed is
that no child outlives its run:

- ``die_with_parent`` (a ``preexec_fn``): on Linux the child gets SIGKILL when the process
  that started it dies, even by SIGKILL (PR_SET_PDEATHSIG), so a killed runner leaves no
  server listening behind it;
- ``start_group`` / ``end_group``: a child in a process group of its own, ended with every
  process it started (SIGTERM to the group, SIGKILL after a grace period);
- ``run_watched``: one command in its own group, its output in a file, ended when it exits,
  when its output has not grown for ``stall`` seconds, or on any exception (a finally).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

STALL_S = 1800.0  # no new output for this long is a hang, however loaded the machine


def die_with_parent() -> None:
    """Run in the child between fork and exec: SIGKILL when the parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def start_group(cmd: Sequence[str], **popen: Any) -> "subprocess.Popen[Any]":
    """``Popen(cmd)`` in a new session (its own process group) that dies with this process."""
    return subprocess.Popen(list(cmd), start_new_session=True, preexec_fn=die_with_parent, **popen)


def end_group(proc: "subprocess.Popen[Any]", grace: float = 30.0) -> int | None:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace`` seconds (or at once if
    ``proc`` has already exited, for whatever it left running); ``proc``'s exit status."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: everything has ended
        pass
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:  # unkillable (D state): report it rather than hang the caller
        return None


class Stalled(AssertionError):
    """``run_watched``'s command printed nothing for ``stall`` seconds and was ended."""


def run_watched(cmd: Sequence[str], log: Path, *, stall: float = STALL_S, **popen: Any) -> int:
    """Run ``cmd`` in its own process group with stdout and stderr in ``log``; its exit status.

    There is no limit on the total time: a slow machine is not a failure. ``Stalled`` is
    raised when ``log`` did not grow for ``stall`` seconds (a hang). Whatever happens (exit,
    stall, KeyboardInterrupt, the caller's own failure) the whole group is ended before
    this returns or raises."""
    with open(log, "wb") as out:
        proc = start_group(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)
        try:
            size, moved = -1, time.monotonic()
            while proc.poll() is None:
                now = os.stat(log).st_size
                if now != size:
                    size, moved = now, time.monotonic()
                elif time.monotonic() - moved > stall:
                    raise Stalled(f"{cmd[:4]} printed nothing for {stall:.0f} s; ended its process group")
                time.sleep(0.5)
        finally:
            end_group(proc)
    return proc.returncode
