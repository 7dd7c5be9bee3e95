"""One long entry restores in linear work, whichever way it was made (issue 56).

Each way of making an entry (one insert; a conversation of many turns, each inserting a
longer prefix that shares the previous one's chunks; ``kvstore import`` of an mlx-lm
prompt-cache file; a shared hit from another machine's Redis) is made at two lengths, then
fetched by a fresh ``KVStore`` (a restart: nothing in memory). What the restore does is
COUNTED, not timed, through kvstore's own read path: the bytes and calls of
``segments._preadv`` (every segment byte a restore reads from a pack file goes through it),
the segment headers read, the bytes hashed to verify, the bytes copied from a shared hit's
buffers (``restore._copy_into``), and the Python calls made inside the restore on every
thread (a quadratic loop in kvstore's Python shows there, whatever it does).
Each count per token at the long length must be within ``FACTOR`` of the short one's:
a restore that re-read, re-hashed or re-walked earlier chunks per chunk grows with the
length and fails (checked by making the restore quadratic: see the report of issue 56).

The entries are tiny-llama's KV geometry (3 layers, 2 KV heads, head_dim 32, float32),
synthesized (no prefill): the work counted is per byte and per segment, not per FLOP.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, save_prompt_cache

from kvstore import KVStore
from kvstore.cli.transfer import TOKENS_KEY
from kvstore.shared import SharedConfig
from tests.support.caches import kv_prefix as prefix, rand_tokens, synth_kv_cache
from tests.system.test_cli import cli

pytest_plugins = ("tests.support.redis_servers",)

SHORT, LONG = 2100, 8300  # tokens: 8 and 32 chunks of 256, and a tail
TURN = 512                # tokens each turn of a conversation adds
FACTOR = 1.25             # the most a count per token may grow from SHORT to LONG
VOCAB = 259               # tiny-llama's
QUERY_EXTRA = [7, 8, 9]   # a follow-up after the stored prefix: the fetch restores all of it


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def kv(n: int, seed: int) -> list[KVCache]:
    """``n`` positions of tiny-llama-shaped KV (random, evaluated)."""
    return synth_kv_cache(3, 2, n, 32, seed=seed)


# ----------------------------------------------------------------------------- counting


class _Hash:
    """An xxh3_128 that counts the bytes it hashes into ``counts``."""

    def __init__(self, real: Any, counts: Counter) -> None:
        self.real, self.counts = real, counts

    def update(self, data: Any) -> None:
        self.counts["bytes_hashed"] += memoryview(data).nbytes
        self.real.update(data)

    def digest(self) -> bytes:
        return self.real.digest()


@contextmanager
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Counts of the work kvstore's read path does in the block, on every thread: bytes
    and calls of ``segments._preadv``, segment headers read, bytes hashed while reading,
    bytes copied from in-memory segments (a shared hit), and the Python calls made inside
    ``DiskTier.restore`` / ``restore_framed`` (on its reader threads too): the lookup's
    own per-token work (encoding the tokens, hashing the chain) would hide them."""
    import xxhash

    from kvstore import segments
    from kvstore.disk import DiskTier
    from kvstore.disk import restore as restore_mod

    counts: Counter = Counter()
    lock = threading.Lock()
    real_preadv, real_header, real_copy = segments._preadv, segments.read_header, restore_mod._copy_into

    def preadv(fd: int, views: list, pos: int) -> int:
        got = real_preadv(fd, views, pos)
        with lock:
            counts["reads"] += 1
            counts["bytes_read"] += got
        return got

    def read_header(*a: Any, **k: Any) -> Any:
        with lock:
            counts["headers"] += 1
        return real_header(*a, **k)

    def copy_into(data: Any, header: Any, dests: Any) -> None:
        with lock:
            counts["copies"] += 1
            counts["bytes_copied"] += len(data)
        real_copy(data, header, dests)

    class _Xx:  # segments' view of the xxhash module: its hashers count what they hash
        def __getattr__(self, name: str) -> Any:
            return getattr(xxhash, name)

        @staticmethod
        def xxh3_128(*a: Any) -> _Hash:
            h = _Hash(xxhash.xxh3_128(), counts)
            for data in a:
                h.update(data)
            return h

    calls: dict[int, int] = {}
    active = [False]  # inside DiskTier.restore / restore_framed (Python calls are counted there only)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if active[0] and event in ("call", "c_call"):
            t = threading.get_ident()
            calls[t] = calls.get(t, 0) + 1  # each thread its own key: no lost counts

    def inside(real: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            active[0] = True
            try:
                return real(*a, **k)
            finally:
                active[0] = False
        return run

    monkeypatch.setattr(segments, "_preadv", preadv)
    monkeypatch.setattr(segments, "read_header", read_header)
    monkeypatch.setattr(segments, "xxhash", _Xx())
    monkeypatch.setattr(restore_mod, "_copy_into", copy_into)
    monkeypatch.setattr(DiskTier, "restore", inside(DiskTier.restore))
    monkeypatch.setattr(DiskTier, "restore_framed", inside(DiskTier.restore_framed))
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        monkeypatch.undo()
        counts["python_calls"] = sum(calls.values())


def restored(cache_dir: Path, model_dir: Path, tokens: list[int], monkeypatch: pytest.MonkeyPatch,
             **kw: Any) -> Counter:
    """Counts of one fetch of ``tokens`` plus a follow-up by a fresh store (a restart),
    which must restore all of ``tokens`` from disk (or the shared tier, ``kw``)."""
    with KVStore(cache_dir, **kw) as store:
        store.identity(model_dir)  # the identity is derived (or read back) before counting
        with counted(monkeypatch) as counts:
            got = store.fetch(model_dir, tokens + QUERY_EXTRA)
        assert got.n == len(tokens), (got.source, got.n)
        counts["source:" + str(got.source)] += 1
        counts["stats_bytes_in"] = store.stats().get("shared_bytes_in", 0)
    return counts


# ----------------------------------------------------------------------------- ways of making


def one_insert(d: Path, model_dir: Path, tokens: list[int], **kw: Any) -> None:
    with KVStore(d, **kw) as s:
        s.insert(model_dir, tokens, kv(len(tokens), 1))
        assert s.flush(120)


def many_turns(d: Path, model_dir: Path, tokens: list[int], **kw: Any) -> None:
    """A conversation: each turn inserts a prefix ``TURN`` tokens longer, sharing the
    previous turn's chunks (each turn's new chunks land in a pack of their own)."""
    whole = kv(len(tokens), 2)
    with KVStore(d, **kw) as s:
        for k in [*range(TURN, len(tokens), TURN), len(tokens)]:
            s.insert(model_dir, tokens[:k], prefix(whole, k))
            assert s.flush(120)


def imported(d: Path, model_dir: Path, tokens: list[int], **kw: Any) -> None:
    """``kvstore import`` of an mlx-lm prompt-cache file (``save_prompt_cache``) carrying
    its token ids in kvstore's metadata key."""
    f = d.parent / f"{d.name}.safetensors"
    save_prompt_cache(str(f), kv(len(tokens), 3), {"model": str(model_dir), TOKENS_KEY: json.dumps(tokens)})
    p = cli("import", f, "--model", model_dir, cache_dir=d)
    assert p.returncode == 0, p.stderr


WAYS: dict[str, Callable[..., None]] = {"one_insert": one_insert, "many_turns": many_turns, "import": imported}
COUNTS = ("bytes_read", "reads", "headers", "bytes_hashed", "python_calls")


def per_token(counts: Counter, n: int, keys: tuple[str, ...]) -> dict[str, float]:
    return {k: counts[k] / n for k in keys}


def assert_linear(short: dict[str, float], long: dict[str, float]) -> None:
    grown = {k: round(long[k] / short[k], 3) for k in short if short[k]}
    print(f"per token at {SHORT} / {LONG}: {short} / {long}; grown {grown}")
    assert all(short[k] > 0 for k in short), f"nothing counted: {short}"
    assert max(grown.values()) <= FACTOR, f"work per token grew with the length ({LONG} / {SHORT} tokens): {grown}"


@pytest.mark.parametrize("way", list(WAYS))
def test_disk_restore_work_per_token_does_not_grow_with_the_length(way, model_dir, tmp_path, monkeypatch):
    seen = {}
    for n in (SHORT, LONG):
        tokens = rand_tokens(n, seed=n, vocab=VOCAB)
        d = tmp_path / f"{way}-{n}"
        WAYS[way](d, model_dir, tokens)
        counts = restored(d, model_dir, tokens, monkeypatch)
        assert counts["source:disk"] == 1, counts
        assert counts["bytes_read"] >= n * 3 * 2 * 2 * 32 * 4  # every KV byte came from a pack file
        seen[n] = per_token(counts, n, COUNTS)
    assert_linear(seen[SHORT], seen[LONG])


def test_shared_hit_work_per_token_does_not_grow_with_the_length(model_dir, tmp_path, monkeypatch, redis_server):
    """Machine A publishes, machine B (its own empty directory) restores the shared hit
    from the bytes received (``restore_framed``: nothing read from a pack file)."""
    cfg = SharedConfig.from_url(redis_server.url)
    seen = {}
    for n in (SHORT, LONG):
        tokens = rand_tokens(n, seed=n, vocab=VOCAB)
        a = tmp_path / f"a-{n}"
        one_insert(a, model_dir, tokens, shared=cfg)
        counts = restored(tmp_path / f"b-{n}", model_dir, tokens, monkeypatch, shared=cfg)
        assert counts["source:shared"] == 1, counts
        assert counts["bytes_copied"] >= n * 3 * 2 * 2 * 32 * 4
        seen[n] = per_token(counts, n, ("bytes_copied", "copies", "stats_bytes_in", "python_calls"))
    assert_linear(seen[SHORT], seen[LONG])
