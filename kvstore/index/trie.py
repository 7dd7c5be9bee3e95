"""The trie over token prefixes, as the index stores it (``bounds``).

Every entry and chunk is filed under the chunk boundary it follows by trie edges
(``keys.edge_keys``): ``boundary + the following tokens spelled order-preserving + child``.
Children of one boundary therefore sort by their token ids, and ``edges`` finds the ones
sharing the longest prefix with a query with a few seeks, however many children there are.
Edges are candidates only: the stored token ids decide every hit.
"""

from __future__ import annotations

from typing import Any, Generator, Iterator

from ..keys import COMPLETE, EDGE_TOKENS, EDGE_WIDTH, KEY_BYTES, TOKEN_BYTES, edge_keys, edge_tokens, residual, sub_boundary
from ..records import ChunkRecord, EntryRecord, Kind

Edge = tuple[bytes, Kind, int, bool]  # (child, kind, shared tokens, exact)


def entry_edges(key: bytes, rec: EntryRecord, tokens: bytes | None) -> list[bytes] | None:
    """The trie edges that make entry ``key`` reachable (None: its token ids are unusable)."""
    if tokens is None or len(tokens) != TOKEN_BYTES * rec.n:
        return None
    return edge_keys(rec.boundary, residual(bytes(tokens), rec.chunk), key)


def chunk_edges(key: bytes, rec: ChunkRecord, tokens: bytes | None) -> list[bytes] | None:
    """The trie edges from a chunk's parent boundary to the chunk (None: unusable tokens)."""
    if tokens is None or len(tokens) != TOKEN_BYTES * rec.n:
        return None
    return edge_keys(rec.parent, bytes(tokens), key)


def child_edges(txn: Any, db: Any, boundary: bytes, child: bytes) -> list[bytes]:
    """The first-level edges from ``boundary`` to ``child``, found by scanning the
    boundary's children (for a record whose token ids are damaged, so its edge keys are
    unknown; deeper ones are left to ``verify --fix``, which deletes edges leading nowhere)."""
    cur = txn.cursor(db=db)
    out = []
    if cur.set_range(boundary):
        for k in cur.iternext(keys=True, values=False):
            if k[:KEY_BYTES] != boundary:
                break
            if k[-KEY_BYTES:] == child:
                out.append(bytes(k))
    return out


def _lcp(a: bytes, b: bytes) -> int:
    """Common prefix, in tokens, of two ``edge_tokens`` spellings."""
    n = 0
    w = EDGE_WIDTH
    for i in range(0, min(len(a), len(b)) - w + 1, w):
        if a[i : i + w] != b[i : i + w]:
            break
        n += 1
    return n


def _child(k: bytes, v: bytes) -> tuple[bytes, Kind | None]:
    try:
        kind = Kind(bytes(v))
    except ValueError:
        kind = None  # a damaged edge value: not followed
    return bytes(k[-KEY_BYTES:]), kind


def _spelled(k: bytes) -> bytes:
    return bytes(k[KEY_BYTES : -KEY_BYTES - 1])


def _complete(k: bytes) -> bool:
    return k[-KEY_BYTES - 1 : -KEY_BYTES] == COMPLETE


def edges(txn: Any, db: Any, boundary: bytes, after: bytes, base: int = 0) -> Iterator[Edge]:
    """Children of ``boundary`` that may share a prefix with the query tokens ``after`` it,
    best first: ``(child, kind, shared, exact)``. ``shared`` bounds how many of the query's
    tokens after the boundary the child shares (``base`` of them before ``after``: a
    sub-boundary's); ``exact``: the child's residual may end inside the query (else it is
    longer, so it must be trimmed). Along the iteration ``shared`` never grows, so a caller
    may stop once it cannot gain. A few seeks per level; children extending the query's
    last stretch are visited in turn (any one will do)."""
    m = len(after) // TOKEN_BYTES
    q = edge_tokens(after)
    head = boundary + q
    cur = txn.cursor(db=db)
    seen: set[bytes] = set()
    shared = 0
    if m and cur.set_range(head) and cur.key()[: len(head)] == head:
        shared = len(q) // EDGE_WIDTH  # some children share every spelled-out query token
        if m > EDGE_TOKENS:  # those going on are filed one level down, by the next stretch
            step = EDGE_TOKENS * TOKEN_BYTES
            yield from edges(txn, db, sub_boundary(boundary, after[:step]), after[step:], base + EDGE_TOKENS)
        else:
            for k, v in cur:
                if k[: len(head)] != head:
                    break
                seen.add(bytes(k))
                yield (*_child(k, v), base + m, _complete(k) and len(_spelled(k)) == len(q))  # type: ignore[misc]
    elif m:
        shared = yield from _neighbours(cur, boundary, head, q, base, seen)
    yield from _shorter(cur, boundary, q, min(shared, m, EDGE_TOKENS), base, seen)


def _neighbours(cur: Any, boundary: bytes, head: bytes, q: bytes, base: int,
                seen: set[bytes]) -> Generator[Edge, None, int]:
    """No child shares every query token: the children around the query's place share the
    most. Yields those (up to 32 per side), returns how many tokens they share."""
    side: list[tuple[int, int]] = []  # (shared tokens, direction)
    if cur.set_range(head):
        nxt = cur.key()
        if nxt[:KEY_BYTES] == boundary:
            side.append((_lcp(_spelled(nxt), q), 1))
        if cur.prev() and cur.key()[:KEY_BYTES] == boundary:
            side.append((_lcp(_spelled(cur.key()), q), -1))
    elif cur.last() and cur.key()[:KEY_BYTES] == boundary:
        side.append((_lcp(_spelled(cur.key()), q), -1))
    shared = max((n for n, _ in side), default=0)
    if shared:
        pre = boundary + q[: shared * EDGE_WIDTH]
        for _, step in (x for x in side if x[0] == shared):
            if not cur.set_range(head):
                cur.last()
            elif step < 0:
                cur.prev()
            for _ in range(32):  # children sharing exactly `shared`: any usable one will do
                k = cur.key()
                if k[: len(pre)] != pre or _lcp(_spelled(k), q) != shared:
                    break
                if bytes(k) not in seen:
                    seen.add(bytes(k))
                    yield (*_child(k, cur.value()), base + shared, _complete(k) and len(_spelled(k)) == shared * EDGE_WIDTH)  # type: ignore[misc]
                if not (cur.next() if step > 0 else cur.prev()):
                    break
    elif base and cur.set_range(boundary):  # none shares the next token, all share `base`
        for _ in range(32):
            k = cur.key()
            if k[:KEY_BYTES] != boundary:
                break
            if bytes(k) not in seen:
                seen.add(bytes(k))
                yield (*_child(k, cur.value()), base, False)  # type: ignore[misc]
            if not cur.next():
                break
    return shared


def _shorter(cur: Any, boundary: bytes, q: bytes, top: int, base: int, seen: set[bytes]) -> Iterator[Edge]:
    """Children whose whole residual is a shorter prefix of the query, longest first."""
    for n in range(top, -1, -1):
        pre = boundary + q[: n * EDGE_WIDTH] + COMPLETE
        if cur.set_range(pre):
            for k, v in cur:
                if k[: len(pre)] != pre:
                    break
                if bytes(k) not in seen:
                    seen.add(bytes(k))
                    yield (*_child(k, v), base + n, True)  # type: ignore[misc]
