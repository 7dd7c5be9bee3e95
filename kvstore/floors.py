"""What a hit serves, and what it must serve to be taken: the one rule every tier applies.

Which tokens of a query a stored candidate serves (``serves``): a candidate (an entry, a
chain of chunks, a memory snapshot) holds ``stored`` tokens and shares ``common`` of them
with a query of ``n_q`` tokens. If it is a prefix of the query it serves all it holds (an
exact entry serves the whole query: the caller keeps a token for the model). Otherwise it
is cut back to the common prefix, leaving at least one query token for the model to feed,
and only where the candidate can be cut there: trimmability is a property of the cut point
(see ``layout.Layout.can_cut``), and a cut it refuses is a miss.

How much a disk, shared or memory hit must serve to be taken (the floors a lookup
applies: ``restore_floor``, ``memory_floor``).

Plain integers and functions, importable without MLX (the disk planner and the shared tier
use it without loading MLX; ``kvstore serve --help`` shows ``MIN_DISK_HIT`` before anything
heavy is imported).
"""

from __future__ import annotations

from typing import Callable

# A disk hit replaces a shorter memory hit only when it holds more than this many tokens
# more: restoring a whole prefix to save the prefill of a chat template's role header
# costs more than it saves (after a restart with a preloaded system prompt, every
# conversation on disk extends that prompt by its user header's few tokens).
MIN_DISK_GAIN = 16

# A disk or shared hit with nothing in memory must restore at least this many tokens
# (``LRUPromptCache(min_disk_hit=)``, ``kvstore serve --min-disk-hit``, ``kvstore warm``;
# ``KVStore`` itself defaults to 0: the exact lookup rules), unless it holds the whole
# prompt. Without it a never-seen prompt "hits" on the few tokens a chat template's
# system header shares with any stored prompt (``<|im_start|>system\nYou are``: 5 tokens)
# and pays a lookup, a whole chunk segment read and checksummed, and a cache built, to
# save a prefill of 5 tokens, while ``cached_tokens`` tells the client its prompt was
# cached. 64: 4x MIN_DISK_GAIN, above any role header plus an opening sentence (~10-30
# tokens), a quarter of the default 256-token chunk such a hit reads anyway, and below
# any system prompt worth caching.
MIN_DISK_HIT = 64


def restore_floor(memory_n: int, wanted: int, min_hit: int = 0, *, holds_prompt: bool = False) -> int:
    """The tokens a disk or shared hit must exceed, given a memory hit of ``memory_n`` of
    ``wanted`` tokens: it must hold the whole prompt, or at least ``min_hit`` tokens and
    (over a memory hit) more than ``MIN_DISK_GAIN`` tokens more than memory.
    ``holds_prompt``: the candidate agrees with every token of the prompt (an entry as long
    or longer, ``holds_prompt``): it holds the whole prompt, so it need only
    serve more than memory, also when it is cut back to ``wanted - 1`` tokens (the one
    token kept for the model to feed: ``serves``); a repeated short prompt
    after a restart sits inside its own longer entry (prompt and reply). Without the flag
    (a caller that knows only a count: ``KVStore.peek``'s) serving all ``wanted`` tokens
    is the whole prompt; ``min_hit`` stops at ``wanted - 1`` tokens of any shape."""
    if holds_prompt:
        return memory_n
    beat = min(memory_n + MIN_DISK_GAIN, wanted - 1) if memory_n > 0 else 0
    return max(beat, min(max(min_hit - 1, 0), max(wanted - 2, 0)))


def memory_floor(wanted: int, min_hit: int = 0) -> int:
    """The fewest tokens a memory hit must serve to be a hit: the rule ``restore_floor``
    applies to the disk, for every tier. A prompt that shares only a chat template's
    header with one in memory is a miss (``cached_tokens: 0``, counted as a miss), as it
    is after a restart; one served whole (all but the one token kept) is always a hit."""
    return min(min_hit, max(wanted - 1, 0))


# -- what a candidate serves -------------------------------------------------------

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
    one token kept (``restore_floor``: such a hit beats any shorter memory hit). A
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
