"""A prompt's lookup facts, computed once and handed to every tier.

A ``Query`` holds the token ids, their encoding (``keys.encode_tokens``), and, under one
identity, the chain of chunk keys (``keys.boundaries``) and the entry key. The chain is
hashed at most once per query, when a tier first asks for it: the disk plan, the shared
tier, the write policy and a persist all read the same list. ``prefix(n)`` is the query of
the first ``n`` tokens and shares the chain's first links, so cutting a job to a prefix
hashes only the residual. A lookup's query also carries ``near`` (``misses.Near``), which
every tier's search tells what it saw of the stored prefixes nearest the query (why a
lookup served no more); ``reporting`` is the same query telling another one (or none).
MLX-free.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Sequence

from .keys import TOKEN_BYTES, boundaries, decode_tokens, entry_key, residual, root_key

if TYPE_CHECKING:
    from .misses import Near


class Query:
    """``tokens`` (encoded once) under the identity ``digest``, chained every ``chunk``
    tokens. Immutable by convention; the chain and key are computed on first use. ``near``:
    what the searches of the lookup asking this query saw (None: nobody asks)."""

    def __init__(self, enc: bytes, digest: bytes, chunk: int, *, tokens: Sequence[int] | None = None,
                 bounds: list[bytes] | None = None, near: "Near | None" = None) -> None:
        self.enc, self.digest, self.chunk, self.near = enc, digest, chunk, near
        self._tokens = list(tokens) if tokens is not None else None
        if bounds is not None:
            self.__dict__["bounds"] = bounds

    @property
    def n(self) -> int:
        return len(self.enc) // TOKEN_BYTES

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = decode_tokens(self.enc)
        return self._tokens

    @cached_property
    def bounds(self) -> list[bytes]:
        """``[root, b1, ..., bK]``: the key of every full chunk's prefix (``keys.boundaries``)."""
        return boundaries(root_key(self.digest), self.enc, self.chunk)

    @cached_property
    def key(self) -> bytes:
        """The entry key of the whole prefix (``keys.key_of``, from the chain above)."""
        return entry_key(self.bounds[-1], residual(self.enc, self.chunk))

    def hashed_bounds(self) -> list[bytes] | None:
        """The chain if a tier has hashed it already, else None (never hashes)."""
        return self.__dict__.get("bounds")

    def reporting(self, near: "Near | None") -> "Query":
        """This query with its searches telling ``near`` (None: nobody): the same tokens,
        and the chain computed so far, shared (not hashed again)."""
        return Query(self.enc, self.digest, self.chunk, tokens=self._tokens, bounds=self.hashed_bounds(), near=near)

    def prefix(self, n: int) -> "Query":
        """The query of the first ``n`` tokens; shares the chain computed so far (a shorter
        one reports to nobody: it is not the lookup's)."""
        if n >= self.n:
            return self
        bounds = self.hashed_bounds()
        return Query(self.enc[: n * TOKEN_BYTES], self.digest, self.chunk,
                     tokens=self._tokens[:n] if self._tokens is not None else None,
                     bounds=bounds[: n // self.chunk + 1] if bounds is not None else None)
