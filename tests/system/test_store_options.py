"""``StoreOptions`` through the store and its front ends: a store built from a ``StoreOptions``
and one built from the same keywords behave the same (real stores: writer thread, LMDB index,
pack files, restarts); a bad value raises the same ``ValueError`` either way; a name that is
no option is a ``TypeError`` naming it, at ``KVStore``, ``LRUPromptCache`` and every adapter's
``install`` (before the engine is imported: none is installed here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

from kvstore import KVStore, LRUPromptCache, StoreOptions
from kvstore.floors import MIN_DISK_HIT
from kvstore.options import DROP_IN
from tests.support.caches import ident, rand_tokens, synth

C = 4  # chunk tokens
ID = ident("store-options")
SETTINGS = {"chunk_tokens": C, "max_entries": 1, "persist": "system", "min_disk_hit": 2 * C, "shared": False}


def run(store: KVStore) -> dict[str, Any]:
    """Insert a system prompt, a chat over it and a second chat (the memory tier holds one);
    what each tier then serves, in this store and after a restart with the defaults."""
    system = rand_tokens(3 * C, 1)
    chat, other = system + rand_tokens(2 * C, 2), rand_tokens(3 * C, 3)
    near = system[:C] + rand_tokens(2 * C, 4)  # shares one chunk with the system prompt
    with store as s:
        for toks, kind in ((system, "system"), (chat, "assistant"), (other, "assistant")):
            s.insert(ID, toks, synth(toks), cache_type=kind)
        s.flush()
        now = [(g.source, g.n) for g in (s.fetch(ID, other), s.fetch(ID, near), s.fetch(ID, chat))]
        st = s.stats()
        d = s.cache_dir
    with KVStore(d, chunk_tokens=C) as s:  # a restart: what reached the disk
        later = (s.fetch(ID, chat).source, s.fetch(ID, chat).n, s.stats()["disk_entries"])
    return {"now": now, "later": later, "writes": st["writes"], "skipped": st["writes_skipped_policy"]}


def test_options_and_their_keywords_make_the_same_store(tmp_path: Path) -> None:
    by_options = KVStore(tmp_path / "a", options=StoreOptions(**SETTINGS))
    assert by_options.options == StoreOptions(cache_dir=tmp_path / "a", **SETTINGS)
    got = run(by_options)
    assert got == run(KVStore(tmp_path / "b", **SETTINGS))
    # max_entries=1: the last insert alone is in memory; min_disk_hit: one chunk of the system
    # prompt is not worth a restore; persist="system": the system prompt alone reached the disk
    assert got == {"now": [("memory", 3 * C), (None, 0), ("disk", 3 * C)], "later": ("disk", 3 * C, 1),
                   "writes": 1, "skipped": 2}, got
    # options and keywords together: the keywords change the options
    both = KVStore(tmp_path / "c", options=StoreOptions(**SETTINGS), persist="all", memory_only=True)
    assert both.options == StoreOptions(cache_dir=tmp_path / "c", **{**SETTINGS, "persist": "all", "memory_only": True})
    assert both.disk is None and both.write_policy.persist == "all"
    both.close()


def test_the_drop_in_starts_from_its_own_defaults(tmp_path: Path) -> None:
    lru = LRUPromptCache(4, cache_dir=tmp_path / "a", chunk_tokens=C)
    assert lru.store.options == DROP_IN.but(max_entries=4, cache_dir=tmp_path / "a", chunk_tokens=C)
    assert (lru.max_size, lru.store.memory.touch_on_hit, lru.store.min_disk_hit) == (4, False, MIN_DISK_HIT)
    same = LRUPromptCache(options=DROP_IN.but(max_entries=4, cache_dir=tmp_path / "b", chunk_tokens=C))
    assert same.store.options == lru.store.options.but(cache_dir=tmp_path / "b") and same.max_size == 4
    # mlx-lm's limits, positional, win over the options'; disk=False: memory only
    off = LRUPromptCache(2, 1000, options=same.store.options, disk=False)
    assert (off.max_size, off.max_bytes, off.store.disk, off.store.options.memory_only) == (2, 1000, None, True)
    assert LRUPromptCache(cache_dir=tmp_path / "c").max_size == DROP_IN.max_entries == 10
    for c in (lru, same, off):
        c.close()
    # an unusable cache directory: the drop-in serves from memory, whichever way it is given
    (tmp_path / "file").write_text("")
    for broken in (LRUPromptCache(cache_dir=tmp_path / "file"),
                   LRUPromptCache(options=DROP_IN.but(cache_dir=tmp_path / "file"))):
        assert broken.store.disk is None
        broken.close()


@pytest.mark.parametrize("bad, message", [({"persist": "some"}, "persist must be one of"),
                                          ({"max_write_bytes_per_day": -1}, "max_write_bytes_per_day must be >= 0"),
                                          ({"memory_floor": 1.5}, "memory_floor must be a fraction"),
                                          ({"min_disk_hit": -1}, "min_disk_hit must be a number of tokens"),
                                          ({"min_memory_hit": "1"}, "min_memory_hit must be a number of tokens")])
def test_a_bad_value_raises_the_same_error_either_way(tmp_path: Path, bad: dict, message: str) -> None:
    builds: list[Callable[[], Any]] = [lambda: KVStore(tmp_path, **bad),
                                       lambda: KVStore(tmp_path, options=StoreOptions(**bad)),
                                       lambda: LRUPromptCache(cache_dir=tmp_path, **bad),
                                       lambda: LRUPromptCache(options=DROP_IN.but(cache_dir=tmp_path, **bad))]
    for build in builds:
        with pytest.raises(ValueError, match=re.escape(message)):
            build()
    assert not tmp_path.joinpath("index").exists()  # refused before anything was created


def test_a_name_that_is_no_option_is_a_type_error_naming_it(tmp_path: Path) -> None:
    from kvstore.adapters import exo, vllm_mlx, vllm_mlx_batched, vllm_mlx_system

    memory = KVStore(tmp_path / "m", memory_only=True)
    calls: list[Callable[[], Any]] = [
        lambda: KVStore(tmp_path, max_disk_byte=1),
        lambda: KVStore(tmp_path, options=StoreOptions(), max_disk_byte=1),
        lambda: LRUPromptCache(cache_dir=tmp_path, max_disk_byte=1),
        lambda: LRUPromptCache(store=memory, max_disk_byte=1),  # checked with a store too
        lambda: vllm_mlx.install(max_disk_byte=1), lambda: vllm_mlx.install_all(max_disk_byte=1),
        lambda: vllm_mlx_batched.install(max_disk_byte=1), lambda: vllm_mlx_system.install(max_disk_byte=1),
        lambda: exo.install(max_disk_byte=1),
    ]
    for call in calls:
        with pytest.raises(TypeError, match=r"unknown store option\(s\): max_disk_byte \(one of cache_dir, "):
            call()
    memory.close()
    assert not tmp_path.joinpath("index").exists()
