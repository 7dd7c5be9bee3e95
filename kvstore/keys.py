"""Stable keys over token prefixes: chained xxh3-128 with a fixed integer encoding.

Tokens are encoded as little-endian signed 64-bit integers (``TOKEN_BYTES`` each), so a
key depends only on the token ids, never on the process (no ``hash()``, no seed, no pickle). Every key chain starts from a
root derived from the identity digest and the format version, so two identities can never
share a key. Signed 64 bits hold every id mlx-lm puts in a prompt-cache key: token ids, and
for a request with images the negative id mlx_lm.server 0.32 gives each image's patch
tokens (``-1 - int(sha256(url)[:15], 16)``, down to -2**60), so two images never share a key.

The chain is cut at fixed ``chunk`` boundaries: ``bounds[k]`` names the prefix
``tokens[:k * chunk]`` and is also the key of the chunk that ends there. An entry's own key
adds the residual tokens after its last boundary.

The index's trie edges (``edge_keys``) file each entry and chunk under its boundary, sorted
by the token ids that follow it, so a lookup seeks straight to the children sharing the
longest prefix with the query instead of reading every child of a boundary. An edge spells
``EDGE_TOKENS`` tokens; a longer residual is also filed, one level down, under a
sub-boundary naming those tokens, and so on, so children sharing many tokens are told apart
by seeks too.
"""

from __future__ import annotations

from typing import Sequence


FORMAT_VERSION = 4  # 4: token ids as int64; 3: binary records, pack files of segments; 2: trie edges sorted
KEY_BYTES = 16  # bytes of a key, an identity digest, a pack id, a checksum
TOKEN_BYTES = 8  # one encoded token id: little-endian int64
EDGE_WIDTH = 1 + TOKEN_BYTES  # one token spelled in a trie edge (``edge_tokens``)
MIN_TOKEN_ID, MAX_TOKEN_ID = -(2**63), 2**63 - 1
_RANGE = "[-2**63, 2**63)"
EDGE_TOKENS = 48  # residual tokens spelled out in a trie edge key (LMDB keys are <= 511 bytes)


class TokenError(ValueError):
    """Raised for token lists that cannot be keyed (not integers, or beyond 64 bits)."""


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian int64 bytes; raises TokenError naming the first bad token."""
    import numpy as np
    try:
        arr = np.asarray(tokens)
    except Exception as e:  # ragged or exotic input
        raise TokenError(f"tokens must be a flat sequence of integers: {e}") from None
    if arr.ndim != 1:
        raise TokenError(f"tokens must be a flat sequence of integers, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        bads = [t for t in tokens if not isinstance(t, (int, np.integer)) or isinstance(t, bool)][:1]
        if not bads:  # all integers, but numpy could not hold one of them (beyond int64)
            big = next(t for t in tokens if not MIN_TOKEN_ID <= int(t) <= MAX_TOKEN_ID)
            raise TokenError(f"token id {big} is out of range {_RANGE}")
        bad = bads[0]
        raise TokenError(f"tokens must be integers, got {type(bad).__name__}: {bad!r}")
    hi = int(arr.max())
    if hi > MAX_TOKEN_ID:  # a uint64 array beyond int64
        raise TokenError(f"token id {hi} is out of range {_RANGE}")
    return arr.astype("<i8", copy=False).tobytes()


def decode_tokens(data: bytes) -> list[int]:
    """Inverse of encode_tokens."""
    import numpy as np
    return np.frombuffer(data, dtype="<i8").tolist()


def _h(*parts: bytes) -> bytes:
    import xxhash  # here, not at the top: ``kvstore ls`` hashes nothing (the extension costs start-up)

    x = xxhash.xxh3_128()
    for p in parts:
        x.update(p)
    return x.digest()


def common_tokens(a: bytes, b: bytes) -> int:
    """Common prefix length, in tokens, of two encoded token strings."""
    w = TOKEN_BYTES
    n = min(len(a), len(b)) // w
    if a[: n * w] == b[: n * w]:
        return n
    lo, hi = 0, n  # binary search on equal prefixes (bytes compare is fast)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * w] == b[: mid * w]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def root_key(identity_digest: bytes) -> bytes:
    """Key of the empty prefix for one identity and this format version."""
    return _h(b"kvstore/root/v%d/" % FORMAT_VERSION, identity_digest)


def chunk_key(parent: bytes, chunk_tokens: bytes) -> bytes:
    """Key of the prefix ``parent + chunk``: the next boundary of the chain."""
    return _h(b"C", parent, chunk_tokens)


def entry_key(boundary: bytes, residual_tokens: bytes) -> bytes:
    """Key of a whole stored prefix: its last boundary plus the residual tokens after it."""
    return _h(b"E", boundary, residual_tokens)


def boundaries(root: bytes, tokens: bytes, chunk: int) -> list[bytes]:
    """``[root, b1, ..., bK]`` for ``K = n_tokens // chunk`` (tokens given encoded)."""
    out = [root]
    step = chunk * TOKEN_BYTES
    for k in range(len(tokens) // step):
        out.append(chunk_key(out[-1], tokens[k * step : (k + 1) * step]))
    return out


def key_of(root: bytes, tokens: bytes, chunk: int) -> bytes:
    """The entry key of a whole token prefix (tokens given encoded)."""
    b = boundaries(root, tokens, chunk)
    return entry_key(b[-1], tokens[(len(b) - 1) * chunk * TOKEN_BYTES :])


def residual(tokens: bytes, chunk: int) -> bytes:
    """The encoded tokens after the last full ``chunk`` boundary of ``tokens``."""
    return tokens[(len(tokens) // TOKEN_BYTES // chunk) * chunk * TOKEN_BYTES :]


def edge_tokens(residual_tokens: bytes) -> bytes:
    """The first ``EDGE_TOKENS`` residual tokens in an order-preserving spelling: each
    token as ``0x01`` + its int64 with the sign bit flipped, big-endian (``EDGE_WIDTH``
    bytes). Byte order of the result is the order of the token sequences, a prefix sorting
    first (an edge key ends the spelling with ``0x00``)."""
    import numpy as np
    toks = np.frombuffer(residual_tokens[: EDGE_TOKENS * TOKEN_BYTES], dtype="<i8")
    out = np.empty((len(toks), EDGE_WIDTH), dtype=np.uint8)
    out[:, 0] = 1
    flipped = toks.view("<u8") ^ np.uint64(1 << 63)
    out[:, 1:] = flipped.astype(">u8").view(np.uint8).reshape(-1, TOKEN_BYTES)
    return out.tobytes()


COMPLETE, CONTINUES = b"\x00", b"\xff"  # after the spelled tokens: the residual ends / goes on


def edge_key(boundary: bytes, residual_tokens: bytes, child: bytes) -> bytes:
    """The trie edge filing ``child`` (an entry, or the chunk that ends at it) under
    ``boundary``: ``boundary + edge_tokens(residual) + COMPLETE | CONTINUES + child``.
    Boundary first and child last, so ``key[:KEY_BYTES]`` and ``key[-KEY_BYTES:]`` read
    them back; CONTINUES says the residual is longer than the spelled tokens."""
    more = len(residual_tokens) > EDGE_TOKENS * TOKEN_BYTES
    return boundary + edge_tokens(residual_tokens) + (CONTINUES if more else COMPLETE) + child


def sub_boundary(boundary: bytes, spelled_tokens: bytes) -> bytes:
    """The key under which residuals continuing past ``EDGE_TOKENS`` spelled tokens are
    filed one level down (``spelled_tokens``: those tokens, encoded)."""
    return _h(b"S", boundary, spelled_tokens)


def edge_keys(boundary: bytes, residual_tokens: bytes, child: bytes) -> list[bytes]:
    """Every trie edge of ``child``: one per ``EDGE_TOKENS`` stretch of its residual, the
    first under ``boundary``, each next one under the sub-boundary of the stretch before."""
    step = EDGE_TOKENS * TOKEN_BYTES
    out = [edge_key(boundary, residual_tokens, child)]
    while len(residual_tokens) > step:
        boundary, residual_tokens = sub_boundary(boundary, residual_tokens[:step]), residual_tokens[step:]
        out.append(edge_key(boundary, residual_tokens, child))
    return out
