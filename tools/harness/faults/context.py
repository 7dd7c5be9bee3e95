"""What a fault kind's runner gets from the harness (``Ctx``): the kinds and the checks
import it for their type hints, the harness builds it, so neither imports the other."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from .worker import Checker

if TYPE_CHECKING:
    from .check import Tally


class Ctx:
    """What a kind's runner gets: the work directory, seed and sizes, and the two
    long-lived worker processes (``checker``, ``misc``), started when first used."""
    def __init__(self, work: Path, seed: int, size: dict, verbose: bool) -> None:
        self.work, self.seed, self.size, self.verbose = work, seed, size, verbose
        self.logdir = work / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._checker: Checker | None = None
        self._misc: Checker | None = None

    @property
    def checker(self) -> Checker:
        if self._checker is None:
            self._checker = Checker(self.logdir, "check")
        return self._checker

    @property
    def misc(self) -> Checker:
        if self._misc is None:
            self._misc = Checker(self.logdir, "misc")
        return self._misc

    def say(self, msg: str) -> None:
        print(msg, flush=True)

    def debug(self, msg: str) -> None:
        if self.verbose:
            print("   " + msg, flush=True)

    def progress(self, t: Tally, i: int, n: int) -> None:
        """A progress line after every tenth of the ``n`` trials."""
        if (i + 1) % max(1, n // 10) == 0 or i + 1 == n:
            c = t.c
            self.say(f"  {t.kind}: {i + 1}/{n}  wrong={c['wrong_restores']} escaped={c['escaped_exceptions']} "
                    f"crashes={c['crashes']} lost={c['entries_lost']} unexplained={c['unexplained_misses']} "
                    f"unclean={c['verify_unclean']}  ({time.time() - t.t0:.0f}s)")

    def close(self) -> None:
        for c in (self._checker, self._misc):
            if c is not None:
                c.close()
