"""A lookup is computed once: one disk plan per fetch, the chain of chunk keys hashed once
per fetch and once per persist, with and without the shared tier (a real Redis).

Counted, not estimated: every module's binding of ``keys.boundaries`` (the one function
that hashes a chain; ``key_of`` calls it) is wrapped to count the calls made on the
query's own tokens, and ``disk.plan.find`` (one read transaction's trie walk) to count plans.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import tests.support.stores as U
from tests.support.caches import ident, rand_tokens, synth

import kvstore.disk.plan
import kvstore.keys
from kvstore import KVStore
from kvstore.keys import encode_tokens
from kvstore.shared import SharedConfig

pytest_plugins = ("tests.support.redis_servers",)

C = U.CHUNK
WHO = ident("query")


@contextmanager
def counting(tokens: list[int]) -> Iterator[dict[str, int]]:
    """Count chain hashes of ``tokens`` (any prefix of them of at least one chunk) and
    disk plans while the block runs."""
    enc = encode_tokens(tokens)
    counts = {"chains": 0, "plans": 0}
    real_bounds, real_plan = kvstore.keys.boundaries, kvstore.disk.plan.find

    def bounds(root: bytes, toks: bytes, chunk: int) -> list[bytes]:
        if len(toks) >= chunk * 8 and enc.startswith(bytes(toks)):
            counts["chains"] += 1
        return real_bounds(root, toks, chunk)

    def plan(*a, **kw):
        counts["plans"] += 1
        return real_plan(*a, **kw)

    patched = [(m, "boundaries") for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("kvstore") and getattr(m, "boundaries", None) is real_bounds]
    for m, name in patched:
        setattr(m, name, bounds)
    kvstore.disk.plan.find = plan
    try:
        yield counts
    finally:
        for m, name in patched:
            setattr(m, name, real_bounds)
        kvstore.disk.plan.find = real_plan


def _persist_and_fetch(store: KVStore, tokens: list[int], written: int) -> tuple[dict[str, int], dict[str, int]]:
    """Counts while ``tokens`` are persisted (``written`` of them reach disk), then while a
    longer prompt is fetched from disk."""
    with counting(tokens) as persist:
        store.insert(WHO, tokens, synth(tokens))
        assert store.flush(60)
    store.trim_to(0)
    assert store.flush(60)
    query = tokens + rand_tokens(20, seed=9)
    with counting(query) as fetch:
        got = store.fetch(WHO, query)
    assert got.source == "disk" and got.n == written, got
    return persist, fetch


def test_one_plan_and_one_chain_per_fetch_and_per_persist(tmp_path) -> None:
    tokens = rand_tokens(5 * C + 7, seed=1)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        persist, fetch = _persist_and_fetch(s, tokens, len(tokens))
    assert persist == {"chains": 1, "plans": 0}, persist
    assert fetch == {"chains": 1, "plans": 1}, fetch


def test_with_the_shared_tier_and_a_write_policy_still_one_plan_and_one_chain(tmp_path, redis_server) -> None:
    tokens = rand_tokens(5 * C + 7, seed=2)
    config = SharedConfig.from_url(redis_server.url)
    with KVStore(tmp_path, chunk_tokens=C, shared=config, persist="reused") as s:
        s.insert(WHO, tokens[: 2 * C], synth(tokens[: 2 * C]))  # "reused": a prefix seen before
        assert s.flush(60)
        persist, fetch = _persist_and_fetch(s, tokens, 2 * C)  # the policy writes the prefix seen before
        assert s.stats()["shared_lookups"] >= 1  # the fetch asked the shared tier (with the same plan)
    assert persist == {"chains": 1, "plans": 0}, persist
    assert fetch == {"chains": 1, "plans": 1}, fetch
