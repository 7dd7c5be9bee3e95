"""kvstore.keys: token encoding, the chunk-chained keys and trie edges, pinned to fixed values."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import keys
from kvstore.keys import TokenError

# Pinned values: a change here means stored caches stop matching (bump FORMAT_VERSION).
# -1 and -2**60: the ids mlx_lm.server 0.32 gives image patch tokens (-1 - sha256(url)[:15]).
PINNED_TOKENS = [0, 1, 2, 3, 255, 256, 65535, 65536, 151643, 2**32 - 1, -1, -2**60, 2**63 - 1, -2**63]
PINNED_IDENTITY = bytes(range(16))
PINNED_ROOT = "fa84a1b94b55721219312ab6f96b4fff"  # format 4 (3: 97b3efa1..., 2: 760e1feb..., 1: 6ba87e3a...)
PINNED_KEY_CHUNK4 = "4ca23ecc3592e3057a565065b198dddf"
PINNED_BOUNDS_CHUNK4 = [PINNED_ROOT, "207410f216fe46172461c2ac741b3bde", "d9fc3272d6796e61e8222c87493759a5",
                        "ea140d0e250761dd17e2f8c461eea141"]
W = keys.TOKEN_BYTES


def test_keys_are_pinned():
    root = keys.root_key(PINNED_IDENTITY)
    enc = keys.encode_tokens(PINNED_TOKENS)
    got = {
        "root": root.hex(),
        "key": keys.key_of(root, enc, 4).hex(),
        "bounds": [b.hex() for b in keys.boundaries(root, enc, 4)],
    }
    assert got == {"root": PINNED_ROOT, "key": PINNED_KEY_CHUNK4, "bounds": PINNED_BOUNDS_CHUNK4}
    # the documented construction, spelled out with xxhash directly
    import xxhash

    h = lambda *parts: xxhash.xxh3_128_digest(b"".join(parts))  # noqa: E731
    assert h(b"kvstore/root/v%d/" % keys.FORMAT_VERSION, PINNED_IDENTITY) == root
    b1 = h(b"C", root, enc[: 4 * W])
    b2 = h(b"C", b1, enc[4 * W : 8 * W])
    b3 = h(b"C", b2, enc[8 * W : 12 * W])
    assert [root, b1, b2, b3] == keys.boundaries(root, enc, 4)
    assert h(b"E", b3, enc[12 * W :]) == keys.key_of(root, enc, 4)


def test_edge_keys_sort_by_token_ids():
    """Trie edges order children by the tokens after the boundary (a prefix first, negative
    ids before the others), so a lookup's seek lands next to the children sharing the most
    with the query."""
    b, child = b"B" * 16, b"K" * 16
    enc = keys.encode_tokens(PINNED_TOKENS)
    e = keys.edge_key(b, enc[8 * W : 11 * W], child)
    assert e.hex() == ("42" * 16 + "01800000000002505b" + "0180000000ffffffff" + "017fffffffffffffff"
                       + "00" + "4b" * 16)
    assert e[: keys.KEY_BYTES] == b and e[-keys.KEY_BYTES:] == child
    seqs = [[-2**63], [-2**60], [-1], [], [0], [0, 0], [0, 1], [1], [1, -1], [1, 2], [1, 2, 0], [1, 3], [255], [256],
            [65536], [2**32 - 1], [2**63 - 1]]
    ks = [keys.edge_key(b, keys.encode_tokens(t), child) for t in seqs]
    assert ks[3:] == sorted(ks[3:]) and ks[:3] == sorted(ks[:3])  # the empty residual sorts first of all
    long = keys.encode_tokens(list(range(100)))
    assert len(keys.edge_key(b, long, child)) == 16 + keys.EDGE_WIDTH * keys.EDGE_TOKENS + 1 + 16 <= 511
    assert keys.residual(long, 32) == long[96 * W :] and keys.residual(long[: 64 * W], 32) == b""
    # a residual longer than the spelled-out part goes on one level down, stretch by stretch
    E = keys.EDGE_TOKENS
    assert keys.edge_keys(b, long[: E * W], child) == [keys.edge_key(b, long[: E * W], child)]
    got = keys.edge_keys(b, long, child)  # 100 tokens: stretches of 48, 48, 4
    s1 = keys.sub_boundary(b, long[: E * W])
    s2 = keys.sub_boundary(s1, long[E * W : 2 * E * W])
    assert got == [keys.edge_key(b, long, child), keys.edge_key(s1, long[E * W :], child),
                   keys.edge_key(s2, long[2 * E * W :], child)]
    assert got[0][-17:-16] == keys.CONTINUES and got[2][-17:-16] == keys.COMPLETE


def test_key_structure():
    root = keys.root_key(PINNED_IDENTITY)
    enc = keys.encode_tokens(list(range(10)))
    b = keys.boundaries(root, enc, 4)
    assert len(b) == 3 and b[0] == root
    assert b[1] == keys.chunk_key(root, enc[: 4 * W]) and b[2] == keys.chunk_key(b[1], enc[4 * W : 8 * W])
    assert keys.key_of(root, enc, 4) == keys.entry_key(b[2], enc[8 * W :])
    # a prefix shares the boundaries; another identity shares nothing
    assert keys.boundaries(root, enc[: 9 * W], 4) == b
    other = keys.root_key(bytes(16))
    assert not set(keys.boundaries(other, enc, 4)) & set(b)
    assert keys.key_of(root, enc[: 8 * W], 4) != keys.key_of(root, enc[: 9 * W], 4)
    assert len({keys.key_of(root, enc[: i * W], 4) for i in range(11)}) == 11


@pytest.mark.parametrize("bad", [
    [2**63], [-2**63 - 1], [1.0], [1, 2.5], [2**64], [5, 2**70], [-2**70], [-1, 2**64 - 1], [[1, 2]], [[1], [2, 3]],
    np.array([2**64 - 1], dtype=np.uint64),
    ["1"], [True, False], [None], np.array([1.0, 2.0]),
])
def test_token_errors(bad):
    with pytest.raises(TokenError):
        keys.encode_tokens(bad)
    assert issubclass(TokenError, ValueError)


def test_token_error_names_the_token():
    with pytest.raises(TokenError, match=r"token id 1180591620717411303424 is out of range"):
        keys.encode_tokens([5, 2**70])
    with pytest.raises(TokenError, match="got NoneType"):
        keys.encode_tokens([5, None])
