"""The lookup plan: the longest reusable stored prefix of a query, found by walking its
chunk boundaries through the index's trie (one read transaction).

First the chain of stored full chunks matching the query is followed as far as it goes;
then the boundaries from the deepest down to the end of that chain are searched for
entries (and, at the chain's end, a chunk to trim). Every token of a plan is compared with
the stored token ids; no hash is trusted alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..index import Reader
from ..keys import KEY_BYTES, TOKEN_BYTES, chunk_key, entry_key
from ..keys import common_tokens as _common
from ..misses import AFTER, rank
from ..query import Query
from ..records import Kind, RecordError
from ..floors import bound, holds_prompt, serves
from .tier import Tier


@dataclass(frozen=True)
class Plan:
    """What to read to restore ``n`` tokens of a query: the full ``chunks`` in order, then
    ``last`` (an entry's tail or snapshot, or a chunk to trim), ``stored_n`` tokens in all."""

    n: int
    chunks: tuple[bytes, ...]
    last: tuple[Kind, bytes] | None
    stored_n: int
    chunked: bool
    entry: bytes | None = None     # entry credited with the hit (last_used, hits)
    cache_type: str = "assistant"  # kept when the hit is promoted to memory
    chain: tuple[bytes, ...] = ()  # the query's full chunks found stored here, verified (the walk's)
    holds_prompt: bool = False     # it agrees with every query token (``floors.holds_prompt``)


def record(r: Reader, kind: Kind, key: bytes) -> Any:
    """The entry or chunk record ``key``, or None when missing or unreadable."""
    try:
        return r.entry(key) if kind is Kind.ENTRY else r.chunk(key)
    except RecordError:
        return None  # not kvstore's: passed over (verify --fix drops it)


def lookup(tier: Tier, q: Query, skip: frozenset[bytes] = frozenset()) -> Plan | None:
    """The longest reusable stored prefix of the query ``q`` (its identity and chain
    under this directory's chunk size), or None (``DiskTier.lookup``).

    One read transaction. First the chain of stored full chunks matching the query is
    followed as far as it goes; then the boundaries from the deepest down to the end of
    that chain are searched for entries (and, at the chain's end, a chunk to trim),
    stopping as soon as nothing shallower can be longer. Each boundary costs a few
    seeks however many children it has (``trie.edges``). Records kvstore did not write
    are passed over, and so are the entries in ``skip`` (a cut a restore refused). The
    query's chain is the one every tier reads (hashed once); the plan returns the part
    of it found stored and verified (``Plan.chain``: no second walk). ``q.near`` is told
    the stored entries the walk compared (``misses.Near``: why a query was not served
    further). Raises ValueError for a query chained under another chunk size."""
    if q.chunk != tier.chunk:
        raise ValueError(f"a query chained every {q.chunk} tokens, this directory every {tier.chunk}")
    return tier.index.view(lambda r: find(r, q, skip))


def find(r: Reader, q: Query, skip: frozenset[bytes] = frozenset()) -> Plan | None:
    """The longest reusable stored prefix of ``q`` in the read transaction ``r``, or None
    (see ``lookup``). The plan carries the chain it verified (``Plan.chain``)."""
    enc, bounds, C, near = q.enc, q.bounds, q.chunk, q.near
    n_q = q.n
    # Full chunks whose stored token ids equal the query's. Their keys chain from the
    # identity's root, so a chunk found under the query's own boundary is this identity's.
    chain: list[bytes] = []
    for k in range(1, len(bounds)):
        if record(r, Kind.CHUNK, bounds[k]) is None or r.tokens(bounds[k]) != enc[(k - 1) * C * TOKEN_BYTES : k * C * TOKEN_BYTES]:
            break
        chain.append(bounds[k])
    best: Plan | None = None
    if chain:  # the chain alone is reusable (keeping one token to feed when it is all)
        n = len(chain) * C
        best = Plan(serves(n, n, n_q, whole=False) or 0, tuple(chain[:-1]), (Kind.CHUNK, chain[-1]), n, True,
                    holds_prompt=holds_prompt(n, n_q))
    for k in range(len(bounds) - 1, len(chain) - 1, -1):
        if best is not None and best.n >= (k + 1) * C:
            break  # everything filed at boundary k or above holds fewer tokens
        after = enc[k * C * TOKEN_BYTES : (k + 1) * C * TOKEN_BYTES]
        for child, kind, in_common, exact in r.edges(bounds[k], after):
            top = bound(k * C + in_common, n_q, exact)
            beat = _beat(best)
            if best is not None and top <= beat and (near is None or k * C + in_common < near.common):
                break  # what follows shares no more (trie.edges), so it cannot do better; a miss's
                # explanation (near) still sees the candidates sharing as much: its cost is the one holding most
            got = None if child in skip else _candidate(r, q, k, child, kind, chain, beat)
            if child in skip and near is not None:
                near.refused(k * C + in_common)
            if got is not None and (best is None or got.n > best.n or (got.holds_prompt and got.n > beat)):
                best = got
    return replace(best, chain=tuple(chain)) if best is not None else None


def _beat(best: Plan | None) -> int:
    """The tokens a candidate must exceed to replace ``best``: as many as it serves, or one
    fewer when ``best`` does not hold the whole prompt (so one that does, serving as
    many, is taken: ``floors.restore_floor`` takes it over a memory hit)."""
    if best is None:
        return 0
    return best.n if best.holds_prompt else best.n - 1


def _candidate(r: Reader, q: Query, k: int, child: bytes, kind: Kind | None, chain: list[bytes],
               beat: int) -> Plan | None:
    """What one child of boundary ``k`` can restore for the query if it is more than
    ``beat`` tokens, else None. Chunked pieces need the verified chain up to ``k``; the
    stored token ids decide every length (compared first: the cheap test)."""
    enc, boundary, C, n_q, near = q.enc, q.bounds[k], q.chunk, q.n, q.near
    stored = r.tokens(child)
    if stored is None or len(stored) % TOKEN_BYTES or kind is None:
        return None
    if kind is Kind.ENTRY:
        n_e = len(stored) // TOKEN_BYTES
        common = _common(stored, enc)
        if not _keyed(boundary, k, child, kind, stored, C):
            return None
        if near is not None:  # seen even when it would not be taken: a miss costs what the best prefix held
            near.saw("disk", common, n_e, stored[common * TOKEN_BYTES : (common + AFTER) * TOKEN_BYTES])
        if (serves(n_e, common, n_q) or 0) <= beat:
            return None
        rec = record(r, kind, child)
        if rec is None or rec.identity != q.digest or rec.n != n_e or (rec.chunked and k > len(chain)):
            return None
        usable = serves(n_e, common, n_q, rec.trimmable)  # the stored layout decides the cut point (restore)
        if near is not None and usable is None:
            near.refused(min(common, n_q - 1))
        if not usable:
            return None
        return Plan(usable, tuple(chain[:k]) if rec.chunked else (), (kind, child), n_e, rec.chunked,
                    entry=child, cache_type=rec.cache_type, holds_prompt=holds_prompt(common, n_q))
    if k != len(chain):
        return None
    m = _common(stored, enc[k * C * TOKEN_BYTES :])
    usable = serves((k + 1) * C, k * C + m, n_q, whole=False) or 0
    if near is not None and m > 0:
        near.saw("disk", k * C + m, (k + 1) * C, stored[m * TOKEN_BYTES : (m + AFTER) * TOKEN_BYTES], below=child)
    if m <= 0 or usable <= beat or not _keyed(boundary, k, child, kind, stored, C):
        return None
    if record(r, kind, child) is None:
        return None
    return Plan(usable, tuple(chain[:k]), (kind, child), (k + 1) * C, True, holds_prompt=holds_prompt(k * C + m, n_q))


def _keyed(boundary: bytes, k: int, child: bytes, kind: Kind, stored: bytes, C: int) -> bool:
    """The stored token ids hash to the key they are filed under. Token ids are what every
    hit is checked against, so a damaged (or foreign) token record must not be trusted: a
    flip in an entry's last partial chunk would otherwise serve its KV to another prompt."""
    if kind is Kind.ENTRY:
        return len(stored) // TOKEN_BYTES // C == k and entry_key(boundary, stored[k * C * TOKEN_BYTES :]) == child
    return len(stored) == C * TOKEN_BYTES and chunk_key(boundary, stored) == child


# ----------------------------------------------------------------------------- a miss's nearest entry

BELOW_EDGES = 1024  # trie edges ``entry_below`` reads at most (a few per chunk of a conversation)


def nearest(tier: Tier, q: Query) -> bool:
    """Name the stored entry ``q.near``'s nearest prefix is, when the walk left it at a
    chunk others go on from (``entry_below``: a miss's cost is the entry's own length,
    not the query's; ``DiskTier.nearest``). One read transaction; True when one was found."""
    return tier.index.view(lambda r: entry_below(r, q))


def entry_below(r: Reader, q: Query, budget: int = BELOW_EDGES) -> bool:
    """Name the entry the nearest stored prefix is (``near``: ``q.near``), when the walk
    left it at chunks others go on from (``near.below``: every entry filed below them shares the same ``near.common``
    tokens with the query): of those entries, the nearest by ``misses.rank`` (the one
    holding most of the query's length, then the shorter), found depth first through the
    trie under those chunks, reading at most ``budget`` edges. True when one was found
    (``Near.resolved``); else ``near`` keeps the chunk's end as a lower bound. Run on a
    miss only, after the walk (a hit never pays it); each entry's token ids are checked
    to share exactly ``near.common`` tokens with the query, so a damaged edge names nothing."""
    near = q.near
    if near is None or not near.below:
        return False
    enc, C, n_q, common = q.enc, q.chunk, q.n, near.common
    best: tuple[tuple[int, int, int], bytes] | None = None
    depth = common // C * C + C  # the tokens up to the chunks' end (the query parts inside them)
    stack = [(key, depth) for key in reversed(near.below)]  # (a chunk's key, the tokens up to its end)
    while stack and budget > 0:
        boundary, depth = stack.pop()
        if best is not None and best[0][1] == n_q and -best[0][2] <= depth:
            continue  # every entry below holds at least ``depth`` tokens: none is nearer
        for edge in r.keys_from("bounds", boundary):
            budget -= 1
            if edge[:KEY_BYTES] != boundary or budget < 0:
                break
            child, kind = edge[-KEY_BYTES:], r.raw("bounds", edge)
            if kind == Kind.CHUNK.value:
                stack.append((child, depth + C))
                continue
            stored = r.tokens(child) if kind == Kind.ENTRY.value else None
            if stored is None or len(stored) % TOKEN_BYTES or _common(stored, enc) != common:
                continue
            got = rank(common, len(stored) // TOKEN_BYTES, n_q)
            if best is None or got > best[0]:
                best = (got, stored)
    if best is None:
        return False
    near.resolved(len(best[1]) // TOKEN_BYTES, best[1][common * TOKEN_BYTES : (common + AFTER) * TOKEN_BYTES])
    return True


# ----------------------------------------------------------------------------- chunks held here


def held_chunks(tier: Tier, bounds: list[bytes], tokens: bytes) -> set[bytes]:
    """The chunk keys of ``bounds[1:]`` (a query's chain) indexed here with exactly the
    query's token ids (one read transaction; unreadable records are not held;
    ``DiskTier.held_chunks``)."""
    return tier.index.view(lambda r: held(r, bounds, tokens, tier.chunk))


def held(r: Reader, bounds: list[bytes], tokens: bytes, C: int) -> set[bytes]:
    """The chunk keys of ``bounds[1:]`` (a query's chain) indexed with exactly the query's
    token ids (unreadable records are not held)."""
    return {bounds[k] for k in range(1, len(bounds)) if record(r, Kind.CHUNK, bounds[k]) is not None
            and r.tokens(bounds[k]) == tokens[(k - 1) * C * TOKEN_BYTES : k * C * TOKEN_BYTES]}
