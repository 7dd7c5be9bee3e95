"""kvstore.counters: duration histograms."""

from __future__ import annotations

import pytest


def test_durations_buckets_are_cumulative_and_inclusive() -> None:
    from kvstore.counters import Durations

    d = Durations((0.01, 0.1, 1.0))
    for x in (0.005, 0.01, 0.05, 2.0):
        d.observe(x)
    snap = d.snapshot()
    assert snap["counts"] == [2, 3, 3] and snap["count"] == 4  # le is "<=": 0.01 falls in the first
    assert snap["sum"] == pytest.approx(2.065)
