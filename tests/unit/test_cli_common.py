"""kvstore.cli.common: sizes, durations and byte counts as the commands read and print them."""

from __future__ import annotations

import pytest

DAY = 86400.0


def test_units():
    import argparse

    from kvstore.cli import common

    assert common.parse_size("10G") == 10 << 30 and common.parse_size("500M") == 500 << 20
    assert common.parse_size("1.5GiB") == 3 << 29 and common.parse_size("64kb") == 65536
    assert common.parse_size("1234B") == 1234 and common.parse_size("0") == 0
    assert common.parse_size("2000000") == 2000000
    assert common.parse_duration("7d") == 7 * DAY and common.parse_duration("12h") == 43200
    assert common.parse_duration("30m") == 1800 and common.parse_duration("45") == 45
    for bad in ("", "G", "-1G", "1X", "20", "1234"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.parse_size(bad)
    assert common.human_bytes(0) == "0 B" and common.human_bytes(1536) == "1.5 KiB"
    assert common.human_bytes(10 << 30) == "10.0 GiB"
