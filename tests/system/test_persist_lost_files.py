"""A persist never shares a chunk whose file is gone: an entry committed on top of a pack
file that was deleted or cut short (damage nobody had read yet) would be lost on its first
read. The chunk is written again and its record moves to the new segment, so the new entry
and every other entry built on that chunk are whole again. Real stores, real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore import KVStore
from kvstore import files
from tests.support.caches import assert_synth, ident, rand_tokens, synth

C = 4
ID = ident("lost-files")


def _packs_of(store: KVStore, tokens: list[int]) -> set[Path]:
    from kvstore.keys import encode_tokens, key_of, root_key

    key = key_of(root_key(ID.digest), encode_tokens(tokens), C)
    assert store.disk is not None
    rec = store.disk.index.entry(key)
    chunks = [store.disk.index.chunk(ck) for ck in rec.chunks]
    return {files.pack_path(store.disk.blob_root, s.pack) for s in [c.segment for c in chunks]}


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_new_entry_over_a_lost_chunk_file_is_whole(tmp_path: Path, damage: str) -> None:
    system = rand_tokens(8, 1)  # two whole chunks, shared by both conversations
    first, second = system + rand_tokens(3, 2), system + rand_tokens(3, 3)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(ID, first, synth(first))
        assert s.flush(30)
        (pack,) = _packs_of(s, first)
    if damage == "delete":
        os.unlink(pack)
    else:
        os.truncate(pack, pack.stat().st_size // 3)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(ID, second, synth(second))
        assert s.flush(30)
        assert s.stats()["writes"] == 1
    with KVStore(tmp_path, chunk_tokens=C) as s:  # a new process's view: disk only
        got = s.fetch(ID, second)
        assert got.n == len(second) and got.source == "disk", (got.n, got.source, s.stats()["corrupt"])
        assert_synth(got.cache, second)
        again = s.fetch(ID, system + rand_tokens(5, 4))  # the shared system prompt, for anyone
        assert again.n == len(system)
        assert_synth(again.cache, system)
