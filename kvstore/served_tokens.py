"""Which tokens of a query a stored candidate serves: the one rule every tier applies.

A candidate (an entry, a chain of chunks, a memory snapshot) holds ``stored`` tokens and
shares ``common`` of them with a query of ``n_q`` tokens. If it is a prefix of the query it
serves all it holds (an exact entry serves the whole query: the caller keeps a token for
the model). Otherwise it is cut back to the common prefix, leaving at least one query token
for the model to feed, and only where the candidate can be cut there: trimmability is a
property of the cut point (see ``layout.Layout.can_cut``), and a cut it refuses is a miss. mlx-free
(the disk planner and the shared tier use it without loading MLX).
"""

from __future__ import annotations

from typing import Callable


def serves(stored: int, common: int, n_q: int, cut: bool | Callable[[int], bool] = True, *,
           whole: bool = True) -> int | None:
    """Tokens the candidate restores for the query, None if it cannot serve it (a cut it
    refuses). A cut may leave 0 tokens (mlx-lm's LRU hands such a cache out; the tiers
    that read KV from storage treat 0 as nothing). ``cut``: whether (or at which points, a
    predicate on the cut length) it may be cut. ``whole=False``: not an entry (a chain of
    chunks): it never serves the whole query, one token is kept."""
    if common >= stored and (whole or stored < n_q):
        return stored
    n = max(0, min(common, stored, n_q - 1))
    return n if (cut(n) if callable(cut) else cut) else None


def holds_prompt(common: int, n_q: int) -> bool:
    """The candidate agrees with every one of the query's ``n_q`` tokens (it is as long as
    the query or longer): it holds the whole prompt, served whole or, when cut, all but the
    one token kept (``floors.restore_floor``: such a hit beats any shorter memory hit). A
    shorter prefix, even one token short, does not."""
    return n_q > 0 and common >= n_q


def bound(common: int, n_q: int, ends_inside: bool) -> int:
    """The most a candidate sharing ``common`` query tokens can serve: ``common`` if it
    may end inside the query, else (a longer one, to be cut) one token fewer than the
    query at most. An upper bound of ``serves`` for a planner's early stop."""
    return common if ends_inside else min(common, n_q - 1)


class CutRefused(Exception):
    """A stored candidate cannot be cut to the length asked (its layout refuses that cut
    point): a miss, never damage (the entry stays; it serves other queries)."""
