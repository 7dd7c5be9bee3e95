"""Sizes that follow the format (issue 31.7): token ids are signed 64-bit (format 4).

Every width the index and the CLI use derives from ``keys`` (``TOKEN_BYTES``,
``EDGE_WIDTH``, ``KEY_BYTES``): a trie lookup must find a stored prefix whatever its ids
(large, negative: mlx_lm.server's image ids), and ``kvstore inspect`` must show an entry
holding ids no tokenizer takes.
"""

from __future__ import annotations

import json

import pytest

from kvstore import KVStore
from tests.support.stores import cache_digest
from tests.system.test_cli import cli
from tests.system.test_trust import SNAP, _snapshot_cache

IMAGE = -1 - 0x3A7F09B1C2D4E5F  # mlx_lm.server's id for an image's patches: -1 - int(sha256(url)[:15], 16)


@pytest.mark.parametrize("first", [5, 3 * 2**40 + 123456789, IMAGE, -7, 2**63 - 2000],
                         ids=["small", "large", "image", "negative", "top"])
def test_disk_trie_finds_a_stored_prefix_of_any_ids(tmp_path, first):
    """A snapshot (not cuttable) of 3 tokens, with 40 longer siblings filed after it: a
    query extending it, sorting after the siblings (more than the 32 neighbours a lookup
    walks), must find it by its exact spelling (``trie._shorter``), which sliced the query's spelling by format 3's 5-byte width and so
    missed every prefix whose ids have a non-zero byte there (large or negative ids)."""
    base = [first, first + 1, first + 2]
    stored = _snapshot_cache(3, 1)
    want = cache_digest(stored)
    with KVStore(tmp_path / "c", chunk_tokens=64) as s:
        s.insert(SNAP, base, stored)
        s.flush()
        for i in range(40):
            s.insert(SNAP, base + [first + 100 + i, 1], _snapshot_cache(5, i + 2))
            s.flush()
        assert s.stats()["disk_entries"] == 41
    with KVStore(tmp_path / "c", chunk_tokens=64) as s:  # memory empty: the disk trie answers
        got = s.fetch(SNAP, base + [first + 1000])
        assert got.cache is not None and got.n == 3 and got.source == "disk"
        assert cache_digest(got.cache) == want


def test_inspect_shows_an_entry_holding_image_ids(tmp_path, tiny_llama):
    """``kvstore inspect`` of an entry whose ids include mlx_lm.server's negative image ids
    (the store refuses only ids at or past the vocabulary): the text around them decoded,
    the run of one image's ids shown as ``[id N xCOUNT]``; it died with an uncaught OverflowError from the tokenizer."""
    from tools.testing.model_builds import model_path
    from tools.testing.oracle import prefill

    model, tok = tiny_llama
    mdir = model_path("tiny-llama")
    before, after = tok.encode("Describe this picture:"), tok.encode(" in one word.")
    tokens = before + [IMAGE] * 4 + after + [IMAGE - 1]
    with KVStore(tmp_path / "c") as s:
        s.insert(mdir, tokens, prefill(model, list(range(1, len(tokens) + 1))))
        s.flush()
        assert s.stats()["disk_entries"] == 1
    p = cli("ls", "--json", cache_dir=tmp_path / "c")
    [entry] = [e for g in json.loads(p.stdout)["identities"] for e in g["entries"]]
    p = cli("inspect", entry["id"], "--prompt", cache_dir=tmp_path / "c")
    assert p.returncode == 0, p.stderr
    shown = tok.decode(before) + f"[id {IMAGE} x4]" + tok.decode(after) + f"[id {IMAGE - 1}]"
    assert shown in p.stdout, p.stdout
    p = cli("inspect", entry["id"], "--tokens", "--json", cache_dir=tmp_path / "c")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["token_ids"] == tokens and info["prompt_head"].startswith(tok.decode(before) + "[id ")
