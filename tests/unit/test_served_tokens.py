"""kvstore.served_tokens: which tokens of a query a stored candidate serves, the rule of every tier."""

from __future__ import annotations

from kvstore.served_tokens import bound, serves


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

