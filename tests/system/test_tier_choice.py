"""Which tier a lookup serves from, over a memory hit and a disk entry (issue 52.10).

A memory hit is kept unless the disk holds the whole prompt (an entry the query is a
prefix of, served all but the one token kept when it must be cut; a shorter prefix, even
one token short, does not) or more than ``MIN_DISK_GAIN`` tokens more
(``floors.restore_floor``). Real components: tiny-llama
(trimmable) and tiny-qwen3next (recurrent: a snapshot that cannot be cut) caches prefilled
by the real model, the real ``LRUPromptCache`` and its log, a real LMDB cache directory
across a restart, the restored-equals-cold oracle. Then a property over synthetic caches
whose content tells which tokens they hold: the tier chosen serves the most the floors
allow, and never a token the query does not have.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.floors import MIN_DISK_GAIN, memory_floor, restore_floor, serves
from kvstore.keys import common_tokens, encode_tokens
from tests.support.caches import assert_synth, ident, synth
from tests.support.prompts import text_prompt

MEMORY, QUERY = 100, 110  # memory holds L[:100]; the request is L[:110]


@pytest.mark.parametrize("family, disk_n, want_n, want_tier", [
    ("tiny-llama", 140, QUERY - 1, "disk"),   # the case: the disk entry holds the whole prompt, cut back
    ("tiny-llama", QUERY, QUERY, "disk"),     # the prompt itself: served whole
    ("tiny-llama", QUERY - 1, MEMORY, "memory"),  # one token short is not the whole prompt: 9 more are not worth it
    ("tiny-llama", 105, MEMORY, "memory"),    # shorter by 5: 5 tokens more than memory are not worth a restore
    ("tiny-qwen3next", 140, MEMORY, "memory"),  # recurrent state: it cannot be cut at 109, memory serves
    ("tiny-qwen3next", QUERY, QUERY, "disk"),   # the prompt itself: no cut needed
    ("tiny-qwen3next", QUERY - 1, MEMORY, "memory"),
], ids=["longer", "equal", "one-short", "shorter", "uncuttable-longer", "uncuttable-equal", "uncuttable-one-short"])
def test_a_disk_entry_holding_the_whole_prompt_beats_a_memory_hit(tmp_path, load_named, caplog, family, disk_n,
                                                                   want_n, want_tier) -> None:
    from kvstore.adapters.mlx_lm import LRUPromptCache
    from tools.testing.model_builds import model_path
    from tools.testing.oracle import assert_restore, prefill

    model, tokenizer = load_named(family)
    mdir = model_path(family)
    L = text_prompt(tokenizer, 140)
    first = LRUPromptCache(cache_dir=tmp_path / "cache", chunk_tokens=64)
    first.insert_cache(mdir, L[:disk_n], prefill(model, L[:disk_n]))
    first.store.close()
    lru = LRUPromptCache(cache_dir=tmp_path / "cache", chunk_tokens=64)  # a restart: memory holds nothing of it
    lru.insert_cache(mdir, L[:MEMORY], prefill(model, L[:MEMORY]))
    caplog.set_level(logging.INFO, logger="kvstore")
    cache, rest = lru.fetch_nearest_cache(mdir, L[:QUERY])
    stats = lru.store.stats()
    assert cache is not None and QUERY - len(rest) == want_n, (family, disk_n, QUERY - len(rest))
    assert rest == L[want_n:QUERY]
    restored = [r.getMessage() for r in caplog.records if "kvstore: restored" in r.getMessage()]
    if want_tier == "disk":
        assert stats["hits_disk"] == 1 and stats["tokens_disk"] == want_n and stats["hits_memory"] == 0, stats
        assert len(restored) == 1 and re.fullmatch(
            rf"kvstore: restored {want_n} of {QUERY} prompt tokens from disk in [0-9.]+ s; {QUERY - want_n} left to prefill",
            restored[0]), restored
    else:
        assert stats["hits_memory"] == 1 and stats["tokens_memory"] == want_n and stats["hits_disk"] == 0, stats
        assert restored == []
    if want_n < QUERY:  # the KV served is the prompt's own: continuing from it equals a cold prefill
        assert_restore(model, L[:QUERY], cache, want_n, n_gen=4)
    lru.store.close()


# -- the property: the tier chosen serves the most the floors allow, and only the query's tokens --

BASE = st.lists(st.integers(0, 9), min_size=2, max_size=90)  # a small vocabulary: variants share prefixes


@st.composite
def variant(draw, base: list[int]) -> list[int]:
    """A prefix of ``base``, or a prefix that then parts from it, or ``base`` going on."""
    cut = draw(st.integers(1, len(base)))
    kind = draw(st.sampled_from(["prefix", "diverge", "extend"]))
    if kind == "prefix":
        return base[:cut]
    more = draw(st.lists(st.integers(10, 19), min_size=1, max_size=40))  # tokens base never has
    return (base[:cut] if kind == "diverge" else list(base)) + more


def tier_serves(entry: list[int], query: list[int], trimmable: bool) -> int:
    """What one stored entry serves the query by the one rule (``floors.serves``)."""
    return serves(len(entry), common_tokens(encode_tokens(entry), encode_tokens(query)), len(query), trimmable) or 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), base=BASE, trim_m=st.booleans(), trim_d=st.booleans(), floor=st.sampled_from([0, 8]))
def test_the_tier_chosen_serves_what_the_floors_allow(data, base, trim_m, trim_d, floor) -> None:
    """Memory holds M, the disk D (and M, written behind), a query Q; M, D and Q are
    prefixes of one list, or part from it, or go on past it; each cache is trimmable or a
    snapshot that cannot be cut. The fetch serves exactly what the floors choose: memory's
    hit, unless the disk's exceeds ``restore_floor``; the cache holds exactly Q's first n
    tokens (synthetic content: a function of each token and position); a miss names the
    length of a stored entry. The rule is stated here as the docs say it, and
    ``restore_floor`` must agree with it on every example."""
    from kvstore import KVStore

    m, d, q = data.draw(variant(base)), data.draw(variant(base)), data.draw(variant(base))
    if len(q) < 2:
        q = base[:2]
    who = ident("tier-choice")
    with tempfile.TemporaryDirectory() as tmp:
        s = KVStore(Path(tmp), chunk_tokens=16, memory_floor=None)
        s.insert(who, d, synth(d, snapshot=not trim_d))
        s.close()
        s = KVStore(Path(tmp), chunk_tokens=16, memory_floor=None, min_disk_hit=floor, min_memory_hit=floor)
        s.insert(who, m, synth(m, snapshot=not trim_m))
        f = s.fetch(who, q)
        s.close()
    n_q = len(q)
    # the rule as docs/serve.md says it, and its one home (floors) agreeing with it
    mem = tier_serves(m, q, trim_m)
    mem = mem if mem >= floor or mem >= n_q - 1 else 0
    assert (mem > 0) == (mem >= max(memory_floor(n_q, floor), 1))
    disk = tier_serves(d, q, trim_d)
    whole = common_tokens(encode_tokens(d), encode_tokens(q)) >= n_q  # D agrees with all of Q: it holds the prompt
    take = disk > mem and (whole or (disk > mem + MIN_DISK_GAIN if mem else disk >= floor or disk >= n_q - 1))
    assert take == (disk > restore_floor(mem, n_q, floor, holds_prompt=whole)), (mem, disk, n_q, floor, whole)
    want, tier, held = (disk, "disk", (d, trim_d)) if take else (mem, "memory" if mem else None, (m, trim_m))
    assert (f.n, f.source) == (want, tier), dict(m=m, d=d, q=q, trim_m=trim_m, trim_d=trim_d, mem=mem, disk=disk)
    if f.cache is not None:
        assert f.n <= common_tokens(encode_tokens(held[0]), encode_tokens(q))
        assert_synth(f.cache, q[: f.n], snapshot=not held[1])
    if f.miss is not None and f.miss.reason in ("diverged", "cut_refused"):
        assert f.miss.stored in (len(m), len(d)), (f.miss, len(m), len(d))
        assert f.miss.lost == max(0, min(f.miss.stored, len(q)) - f.n)
