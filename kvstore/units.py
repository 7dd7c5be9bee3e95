"""Sizes and durations as people write them (``20GiB``, ``500M``, ``7d``) and as kvstore
prints them: the one parser every command and ``kvstore serve`` use, so a flag reads a
value the same way wherever it is given."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


# A bare number below this (no unit) is refused: ``--max-bytes 20`` is a typo for 20G far more
# often than a budget of 20 bytes, and a budget that small empties the cache.
BARE_MIN = 1 << 20
MAX_SIZE = (1 << 63) - 1  # 8 EiB: beyond any disk, and what every counter kvstore keeps holds
MAX_SECONDS = 10 ** 10  # ~317 years: no age, TTL or timeout means more
_DIGITS = 40  # a number written with more digits is refused before it is converted
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgtp])(i?b)?|(b))?\s*", re.IGNORECASE | re.ASCII)
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*", re.IGNORECASE | re.ASCII)
_FLOAT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d{1,3})?\s*", re.IGNORECASE | re.ASCII)


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5GiB``, ``64k``, ``2000000``, ``20B`` -> bytes. K/M/G/T/P are
    powers of 1024 (with or without ``i``/``B``), as du and Docker read them; ASCII digits
    only. The value is read exactly (no float): with a unit it is rounded to the nearest
    byte, but a value that is not 0 yet under one byte is refused; a bare number or one in
    ``B`` must be a whole number of bytes. A bare number (no unit) must be 0 or at least
    ``BARE_MIN`` (1 MiB): ``20`` or ``0.5`` is refused with a message to add a unit (or
    write ``20B``). At most ``MAX_SIZE``. Anything else raises ``argparse.ArgumentTypeError``
    naming the value, before any command acts on it."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {_shown(text)}: use a number with an optional unit, e.g. 500M, 10G")
    number, prefix, bytes_unit = m.group(1), m.group(2), m.group(3) or m.group(4)
    shown = text.strip()
    if len(number) > _DIGITS:
        raise argparse.ArgumentTypeError(f"invalid size {_shown(shown)}: too many digits (at most {MAX_SIZE:,} bytes, "
                                         "8 EiB)")
    exact = Fraction(number) * 1024 ** ("_kmgtp".index(prefix.lower()) if prefix else 0)
    if not prefix and exact.denominator != 1:
        hint = f" (did you mean {shown}G?)" if not bytes_unit else ""
        raise argparse.ArgumentTypeError(f"invalid size {shown!r}: not a whole number of bytes{hint}; "
                                         "add a unit (K, M, G, T) or write whole bytes")
    if 0 < exact < 1:
        raise argparse.ArgumentTypeError(f"invalid size {shown!r}: under one byte (write 0 for none, or at "
                                         "least 1B)")
    n = round(exact)
    if n > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"invalid size {shown!r}: over 8 EiB ({MAX_SIZE:,} bytes), larger than "
                                         "any disk")
    if not prefix and not bytes_unit and 0 < n < BARE_MIN:
        raise argparse.ArgumentTypeError(
            f"size {shown!r} has no unit and is under 1 MiB: almost surely a typo (did you mean "
            f"{shown}G?); add a unit (K, M, G, T), or write {shown}B for bytes")
    return n


_DUR = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w``, ``3600`` (seconds), ``1.5h`` -> seconds
    (ASCII digits; at most ``MAX_SECONDS``). ``argparse.ArgumentTypeError`` naming the
    value for anything else."""
    m = _DURATION.fullmatch(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {_shown(text)}: use e.g. 7d, 12h, 30m, 45s")
    if len(m.group(1)) > _DIGITS:
        raise argparse.ArgumentTypeError(f"invalid duration {_shown(text.strip())}: too many digits")
    exact = Fraction(m.group(1)) * _DUR[(m.group(2) or "s").lower()]
    return _bounded(exact, text)


def seconds(text: str) -> float:
    """A number of seconds as a float literal (``3600``, ``0.5``, ``1e3``) or a duration
    (``parse_duration``: ``7d``): finite, >= 0, at most ``MAX_SECONDS``;
    ``argparse.ArgumentTypeError`` naming the value for anything else (``nan``, ``inf``,
    ``-1``, a number that overflows or underflows a float)."""
    m = _FLOAT.fullmatch(text)
    if not m:
        return parse_duration(text)
    if len(m.group(1)) > _DIGITS:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {_shown(text.strip())}: too many digits")
    return _bounded(Fraction(text.strip()), text)


def milliseconds(text: str) -> float:
    """A positive number of milliseconds (``seconds`` rules: ``100``, ``2.5``) -> seconds."""
    v = seconds(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"invalid number of milliseconds {text.strip()!r}: must be above 0")
    return v / 1000


def positive_seconds(text: str) -> float:
    """``seconds``, above 0 (a TTL or a timeout: 0 would mean expire or give up at once)."""
    v = seconds(text)
    if v == 0:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text.strip()!r}: must be above 0")
    return v


MAX_COUNT = 1 << 31


def whole(text: str, what: str = "count") -> int:
    """A whole number from 0 below 2**31, ASCII digits only (``int()`` alone takes ``-5``,
    `` 5`` and ``１０``, full-width digits); ArgumentTypeError naming ``what`` otherwise."""
    t = text.strip()
    if not (t.isascii() and t.isdigit()) or int(t) >= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"invalid {what} {_shown(t)}: a whole number from 0 below 2**31")
    return int(t)


def count(text: str) -> int:
    """A record count bound (``--responses-max-count``, ``--stable-prefix-max-count``):
    ``whole``; 0 keeps none."""
    return whole(text, "count")


def tokens(text: str) -> int:
    """A number of tokens (``--min-disk-hit``): ``whole``."""
    return whole(text, "number of tokens")


def _bounded(exact: Fraction, text: str) -> float:
    if exact > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"invalid duration {text.strip()!r}: over {MAX_SECONDS:.0e} seconds "
                                         "(~317 years)")
    v = float(exact)
    if v == 0 and exact != 0:
        raise argparse.ArgumentTypeError(f"invalid duration {text.strip()!r}: too small to tell from 0")
    return v


def _shown(text: str) -> str:
    """``text`` quoted for an error message, cut to its first 40 characters when longer."""
    return repr(text) if len(text) <= 48 else f"{text[:40]!r}... ({len(text):,} characters)"


def memory_floor(text: str) -> float | int:
    """``0.2`` (a fraction of the machine's memory, below 1), ``4G`` or ``0`` -> the value
    ``KVStore(memory_floor=)`` takes. A number is read as a fraction, exactly enough that a
    non-zero one is never read as 0 (``1e-400``: refused); a size as ``parse_size``."""
    m = _FLOAT.fullmatch(text)
    if not m:
        return parse_size(text)
    if len(m.group(1)) <= _DIGITS:
        exact = Fraction(text.strip())
        v = float(exact) if exact < 1 else 1.0
        if 0 <= v < 1 and (v > 0 or exact == 0):
            return v
    raise argparse.ArgumentTypeError(f"invalid memory floor {_shown(text)}: a fraction below 1 (e.g. 0.2) or a size "
                                     "(e.g. 4G)")
