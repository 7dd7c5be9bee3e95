"""Control characters made visible: what kvstore prints to a terminal or writes to a log.

Prompts are client-controlled, and byte-level tokenizers round-trip ESC and BEL: printed
raw, a stored prompt (or a model name, a path, an error message quoting either) could set
the operator's window title, write the clipboard (OSC 52), clear the screen and print
fake output, or forge log lines. ``visible`` is the one helper for it: C0 controls (but
tab and, where allowed, newline), DEL, C1 controls and the bidirectional overrides become
``\\xNN`` / ``\\uNNNN``; every other character, unicode included, stays as it is.
``--json`` output is not passed through it (JSON escapes controls itself and stays exact).
"""

from __future__ import annotations

import functools
import io
import re
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import logging

_BIDI = "\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c"


@functools.cache
def _control(newlines: bool) -> re.Pattern[str]:
    """What ``visible`` escapes, compiled when some text first needs it (the bidi ranges
    make it slow to compile: start-up of every command otherwise)."""
    first = "\x0b" if newlines else "\x0a"  # newline kept, or escaped too
    return re.compile(f"[\x00-\x08{first}-\x1f\x7f-\x9f{_BIDI}]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def visible(text: Any, *, newlines: bool = True) -> str:
    """``str(text)`` with control characters shown as escapes (see the module docstring);
    ``newlines=False`` escapes newlines too (one log record stays one line)."""
    s = str(text)
    bare = s.replace("\t", "")
    if newlines:
        bare = bare.replace("\n", "")
    if bare.isprintable():  # every character escaped is unprintable (Cc, Cf): none here
        return s
    return _control(newlines).sub(_escape, s)


def shortened(text: str, limit: int = 100) -> str:
    """``text`` as an error message repeats what a client sent: whole up to ``limit``
    characters, else its first ``limit - 36`` and how long it was (a 60 KB id is not echoed
    back whole)."""
    return text if len(text) <= limit else f"{text[: limit - 36]}... ({len(text):,} characters)"


class VisibleWriter(io.TextIOBase):
    """A text stream that writes ``visible(text)`` to ``raw`` (newlines kept)."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(visible(text))
        return len(text)

    def flush(self) -> None:
        self.raw.flush()

    def isatty(self) -> bool:
        return self.raw.isatty()


def _visible_record(record: "logging.LogRecord") -> bool:
    """A logging filter: makes a record's message visible, on one line (added to kvstore's
    own loggers by ``logger``; the host's loggers and handlers are left alone)."""
    msg = record.getMessage()
    clean = visible(msg, newlines=False)
    if clean != msg:
        record.msg, record.args = clean, None
    return True


def logger(name: str = "kvstore") -> "logging.Logger":
    """kvstore's logger ``name`` with its records made visible (``_visible_record``, added
    once). Every kvstore module gets its logger here, so no record of kvstore's is written
    unfiltered, and a command that never logs (``ls``) never imports ``logging``."""
    import logging

    log = logging.getLogger(name)
    if _visible_record not in log.filters:
        log.addFilter(_visible_record)
    return log


class LazyLogger:
    """``logger(name)``, made on first use: for a module on the CLI's start-up path that
    logs only when something is wrong (``index.core``)."""

    def __init__(self, name: str = "kvstore") -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(logger(self._name), attr)
