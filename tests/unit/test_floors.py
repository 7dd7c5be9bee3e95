"""kvstore.floors: which tokens of a query a stored candidate serves (the rule of every tier), and
which disk, shared and memory hits are long enough to be taken."""

from __future__ import annotations

from kvstore.floors import MIN_DISK_GAIN, MIN_DISK_HIT, bound, holds_prompt, memory_floor, restore_floor, serves


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


# -- what a candidate serves --------------------------------------------------------


def test_a_stored_prefix_of_the_query_serves_all_it_holds() -> None:
    assert serves(10, 10, 20) == 10 and serves(10, 10, 20, False) == 10  # no cut needed
    assert serves(10, 12, 20) == 10  # a common run past what it holds: still what it holds
    assert serves(20, 20, 20) == 20  # an exact entry serves the whole query (the caller keeps a token)


def test_a_chain_of_chunks_never_serves_the_whole_query() -> None:
    """``whole=False``: one token is always left for the model."""
    assert serves(20, 20, 20, whole=False) == 19
    assert serves(20, 20, 20, False, whole=False) is None  # which needs a cut
    assert serves(10, 10, 20, False, whole=False) == 10  # shorter than the query: no cut


def test_a_longer_or_diverging_candidate_is_cut_to_the_common_prefix() -> None:
    assert serves(30, 20, 20) == 19  # one query token kept for the model
    assert serves(30, 12, 20) == 12 and serves(12, 11, 20) == 11
    assert serves(30, 0, 20) == 0  # a cut to nothing is a (useless) zero
    assert serves(30, 12, 20, False) is None  # a candidate that may not be cut is a miss
    assert serves(30, 5, 1) == 0 and serves(30, 5, 0) == 0  # never below 0


def test_a_cut_predicate_is_asked_about_the_cut_length() -> None:
    asked: list[int] = []

    def every_fourth(n: int) -> bool:
        asked.append(n)
        return n % 4 == 0

    assert serves(30, 12, 20, every_fourth) == 12 and serves(30, 25, 20, every_fourth) is None
    assert asked == [12, 19]
    assert serves(12, 12, 20, every_fourth) == 12 and asked == [12, 19]  # no cut: not asked


def test_bound_is_the_most_serves_can_give() -> None:
    assert bound(10, 20, True) == 10 and bound(10, 20, False) == 10
    assert bound(20, 20, True) == 20 and bound(20, 20, False) == 19
    for common in range(0, 25):
        for stored in range(1, 25):
            got = serves(stored, common, 20)
            assert got is None or got <= bound(common, 20, stored <= common), (stored, common)


def test_only_a_candidate_agreeing_with_every_query_token_holds_the_prompt() -> None:
    """As long as the query or longer, it holds the whole prompt; one token short, or no
    query at all, it does not."""
    assert holds_prompt(20, 20) and holds_prompt(30, 20) and holds_prompt(1, 1)
    assert not holds_prompt(19, 20) and not holds_prompt(0, 1)
    assert not holds_prompt(0, 0) and not holds_prompt(5, 0)
