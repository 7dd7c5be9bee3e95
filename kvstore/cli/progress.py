"""Progress of one long step (model conversion, prefill, restore, write-behind flush).

On a terminal: a tqdm bar on stderr, redrawn every half second so the elapsed time moves
even while one prefill step runs. Otherwise: exactly one line per step, written when the
step ends (``label: 12.3 s, 208 tok/s``), so logs and CI output stay readable.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO


class Progress:
    """One step. ``total``: units the step covers (None: unknown, only time is shown);
    ``initial``: units already done when it starts (e.g. tokens restored before prefill);
    the rate counts only the units done during the step; ``since``: the ``perf_counter()``
    the step began at, when that was before its bar could be drawn (default: now). Use as a
    context manager, or call ``close``."""

    def __init__(self, label: str, *, total: int | None = None, initial: int = 0,
                 unit: str = "tok", file: TextIO | None = None, since: float | None = None,
                 rate: bool = True) -> None:
        self.label, self.total, self.initial, self.done, self.unit = label, total, initial, initial, unit
        self.rate = rate  # False: the end line gives the time only
        self.file = file or sys.stderr
        self.t0 = time.perf_counter() if since is None else since
        self.bar: Any = None
        self._stop = threading.Event()
        if _isatty(self.file):
            from tqdm import tqdm

            fmt = None if total is not None else "{desc}: {elapsed}{postfix}"
            wide = _columns(self.file) > 0  # a terminal that reports no size: 100x24
            self.bar = tqdm(total=total, initial=initial, desc=label, unit=unit, file=self.file,
                            bar_format=fmt, dynamic_ncols=wide, ncols=None if wide else 100,
                            nrows=None if wide else 24, leave=True)
            threading.Thread(target=self._tick, daemon=True).start()

    def update_to(self, done: int) -> None:
        """Units done so far (absolute, not a delta)."""
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done

    def close(self, label: str | None = None, note: str = "") -> float:
        """End the step (``label`` replaces the one given at the start, e.g. once the counts
        are known) and return its seconds. Idempotent."""
        seconds = time.perf_counter() - self.t0
        if self._stop.is_set():
            return seconds
        self._stop.set()
        label = label or self.label
        if self.bar is not None:
            self.bar.set_description_str(label, refresh=False)
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.close()
            return seconds
        line = f"{label}: {seconds:.1f} s"
        n = self.done - self.initial
        if self.rate and self.total is not None and n > 0 and seconds > 0:
            line += f", {n / seconds:,.0f} {self.unit}/s"
        print(line + (f" ({note})" if note else ""), file=self.file, flush=True)
        return seconds

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.bar.refresh()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(note="failed" if exc[0] is not None else "")


def _columns(f: TextIO) -> int:
    try:
        return os.get_terminal_size(f.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _isatty(f: TextIO) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


class PromptSteps:
    """A prompt's lookup (and restore) then its prefill, as two steps labelled with exact
    token counts. Callable as ``kvstore.generate.stream_generate``'s ``progress``:
    ``("restore", restored, total)`` ends the lookup and starts the prefill,
    ``("prefill", done, total)`` advances it; it ends when ``done == total``."""

    def __init__(self, total: int, *, file: TextIO | None = None) -> None:
        self.file = file
        self.lookup = Progress(f"look up {total:,} prompt tokens", file=file)
        self.prefill: Progress | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage == "restore":
            if done:
                self.lookup.close(f"restore {done:,} of {total:,} prompt tokens")
            else:
                self.lookup.close(note="nothing stored")
            # after a restore: the few tokens left, without a rate (first-call costs make
            # "14 tokens: 2.2 s, 6 tok/s" read as a slow machine, not as a cache that worked)
            label = (f"prefill the last {total - done:,} of {total:,} prompt tokens (the rest restored)" if done
                     else f"prefill {total:,} of {total:,} prompt tokens")
            self.prefill = Progress(label, total=total, initial=done, file=self.file, rate=not done)
        elif self.prefill is not None:
            self.prefill.update_to(done)
        if self.prefill is not None and done >= total:
            self.prefill.close()

    def __enter__(self) -> "PromptSteps":
        return self

    def __exit__(self, *exc: Any) -> None:
        for step in (self.lookup, self.prefill):
            if step is not None:
                step.__exit__(*exc)


def write_behind(tokens: int, *, file: TextIO | None = None) -> Progress:
    """The step that waits for the write-behind queue to put ``tokens`` tokens' KV on disk."""
    return Progress(f"write {tokens:,} tokens' KV to disk (write-behind flush)", file=file)
