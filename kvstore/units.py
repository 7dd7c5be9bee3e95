"""Sizes and durations as people write them (``20GiB``, ``500M``, ``7d``) and as kvstore
prints them: the one parser every command and ``kvstore serve`` use, so a flag reads a
value the same way wherever it is given."""

from __future__ import annotations

import argparse
import re

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


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``1.5GiB``, ``64k``, ``2000000``, ``20B`` -> bytes. K/M/G/T/P are
    powers of 1024 (with or without ``i``/``B``), as du and Docker read them. A bare number
    (no unit) must be 0 or at least ``BARE_MIN`` (1 MiB): ``20`` is refused with a message
    to add a unit (or write ``20B``). Anything else raises ``argparse.ArgumentTypeError``
    naming the value."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use a number with an optional unit, e.g. 500M, 10G")
    power = "_kmgtp".index(m.group(2).lower()) if m.group(2) else 0
    n = int(float(m.group(1)) * 1024 ** power)
    if not m.group(2) and not m.group(3) and 0 < n < BARE_MIN:
        raise argparse.ArgumentTypeError(
            f"size {text.strip()!r} has no unit and is under 1 MiB: almost surely a typo (did you mean "
            f"{text.strip()}G?); add a unit (K, M, G, T), or write {text.strip()}B for bytes")
    return n


_DUR = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w``, ``3600`` (seconds) -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 7d, 12h, 30m, 45s")
    return float(m.group(1)) * _DUR[(m.group(2) or "s").lower()]


def memory_floor(text: str) -> float | int:
    """``0.2`` (a fraction of the machine's memory, below 1), ``4G`` or ``0`` -> the value
    ``KVStore(memory_floor=)`` takes."""
    try:
        v = float(text)
    except ValueError:
        return parse_size(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"invalid memory floor {text!r}: a fraction below 1 (e.g. 0.2) or a size "
                                         "(e.g. 4G)")
    return v
