"""kvstore.floors: which disk, shared and memory hits are long enough to be taken."""

from __future__ import annotations

from kvstore.floors import MIN_DISK_GAIN, MIN_DISK_HIT, memory_floor, restore_floor


def taken(n: int, memory_n: int, wanted: int, min_hit: int = 0) -> bool:
    """Whether a disk hit of ``n`` tokens is taken (it must exceed the floor)."""
    return n > restore_floor(memory_n, wanted, min_hit)


def test_without_a_memory_hit_any_disk_hit_is_taken_at_the_exact_rules() -> None:
    assert restore_floor(0, 1000) == 0 and taken(1, 0, 1000)
    assert restore_floor(0, 1) == 0 and restore_floor(0, 0) == 0


def test_over_a_memory_hit_a_disk_hit_must_gain_more_than_min_disk_gain() -> None:
    """A disk hit replaces a memory hit of ``m`` tokens only holding more than ``m + 16``
    (from a one-token memory hit up), or the whole prompt (``wanted - 1``) when that is nearer."""
    assert MIN_DISK_GAIN == 16
    for m in (1, 2, 10, 500):
        assert restore_floor(m, 1000) == m + MIN_DISK_GAIN
        assert not taken(m + MIN_DISK_GAIN, m, 1000) and taken(m + MIN_DISK_GAIN + 1, m, 1000)
    assert restore_floor(990, 1000) == 999 and taken(1000, 990, 1000) and not taken(999, 990, 1000)
    assert restore_floor(983, 1000) == 999 and restore_floor(982, 1000) == 998


def test_min_hit_bounds_a_hit_unless_it_holds_the_whole_prompt() -> None:
    """``min_hit`` tokens at least (the floor is ``min_hit - 1``), but never more than the
    prompt short of its last two tokens: a short prompt served whole is always a hit."""
    assert restore_floor(0, 1000, MIN_DISK_HIT) == MIN_DISK_HIT - 1
    assert taken(MIN_DISK_HIT, 0, 1000, MIN_DISK_HIT) and not taken(MIN_DISK_HIT - 1, 0, 1000, MIN_DISK_HIT)
    assert restore_floor(0, 10, MIN_DISK_HIT) == 8 and taken(9, 0, 10, MIN_DISK_HIT)
    assert restore_floor(0, 2, MIN_DISK_HIT) == 0 and restore_floor(0, 1, MIN_DISK_HIT) == 0
    assert restore_floor(0, 1000, 1) == 0 and restore_floor(0, 1000, 2) == 1
    assert restore_floor(10, 1000, MIN_DISK_HIT) == MIN_DISK_HIT - 1  # min_hit above memory + gain
    assert restore_floor(60, 1000, MIN_DISK_HIT) == 60 + MIN_DISK_GAIN  # memory + gain above min_hit


def test_a_memory_hit_must_serve_min_hit_tokens_or_all_but_one() -> None:
    assert memory_floor(1000) == 0 and memory_floor(1000, MIN_DISK_HIT) == MIN_DISK_HIT
    assert memory_floor(10, MIN_DISK_HIT) == 9 and memory_floor(65, MIN_DISK_HIT) == 64
    assert memory_floor(1, MIN_DISK_HIT) == 0 and memory_floor(0, MIN_DISK_HIT) == 0
