"""docs/serve.md: "a lookup sees every earlier insert". mlx_lm.server ends a response
(``rqueue.put(None)``) just before its generation thread inserts that response's cache, so a
client that asks for the cache as soon as its response is complete (mlx-lm's own
``test_completion_quantizes_the_cache`` does) can look up while the insert is only starting.
The drop-in counts an insert as under way from its first instruction: a lookup made once the
insert has begun waits for it and finds it, as with mlx-lm's own prompt cache. (A lookup made
before the host calls ``insert_cache`` at all cannot see it; that gap is the host's.)
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from queue import Queue

from kvstore.adapters.mlx_lm import LRUPromptCache
from tests.support.caches import rand_tokens, synth

ROUNDS = 60


class _Announced(list):
    """Token ids that say when the insert first reads them (its second step, after it counts
    itself under way), then hold the insert back a moment: the lookup started on that signal
    runs while the insert is under way, whatever the machine's load. Without the count the
    lookup would run in that moment and miss."""

    def __init__(self, tokens: list[int], began: Queue[list[int] | None]) -> None:
        super().__init__(tokens)
        self._began = began
        self._told = False

    def __iter__(self):  # list(tokens), the insert's read of them
        if not self._told:
            self._told = True
            self._began.put(list(super().__iter__()))
            time.sleep(0.05)
        return super().__iter__()


def test_a_lookup_during_an_insert_finds_its_cache(tmp_path: Path) -> None:
    from tools.testing.model_builds import model_path

    model = (str(model_path("tiny-llama")), None, None)  # mlx_lm.server's model key: a real model's files
    cache = LRUPromptCache(max_size=ROUNDS + 1, cache_dir=tmp_path / "cache")
    began: Queue[list[int] | None] = Queue()
    looked: Queue[bool] = Queue()
    errors: list[BaseException] = []

    def generation_thread() -> None:  # the insert, on its own thread, as mlx_lm.server's
        try:
            for i in range(ROUNDS):
                tokens = rand_tokens(40 + i, seed=i, vocab=256)
                cache.insert_cache(model, _Announced(tokens, began), synth(tokens))
                looked.get(timeout=120)  # the client looked before the next response
        except BaseException as e:  # reported by the test thread
            errors.append(e)
            began.put(None)

    thread = threading.Thread(target=generation_thread, daemon=True)
    thread.start()
    found = 0
    try:
        for _ in range(ROUNDS):
            tokens = began.get(timeout=120)
            assert tokens is not None, errors
            got, rest = cache.fetch_nearest_cache(model, tokens)  # while the insert is under way
            found += got is not None and len(rest) <= 1
            looked.put(True)
    finally:
        thread.join(120)
        cache.close()
    assert not errors, errors
    assert found == ROUNDS, f"{ROUNDS - found} of {ROUNDS} lookups missed the insert under way when they began"


def test_a_cache_still_being_computed_is_read_whole_elsewhere(tmp_path: Path) -> None:
    """mlx-lm inserts a cache its generation may still be computing (the insert does not
    wait for it); another thread's lookup, and the writer thread's disk
    write, each wait for it (``Snapshot.ready``) and read the right values (bfloat16 too:
    its host views are scheduled with the snapshot)."""
    import mlx.core as mx
    import numpy as np

    from kvstore.store import KVStore
    from tests.support.caches import ident

    store = KVStore(tmp_path / "cache", max_entries=8)
    alone = KVStore(tmp_path / "memory", max_entries=8, memory_only=True)  # no writer thread reads its snapshots
    model = ident("lazy")
    made: Queue[tuple[list[int], list[np.ndarray]]] = Queue()
    errors: list[BaseException] = []

    def generation_thread() -> None:  # the cache's arrays are lazy results made on this thread
        try:
            for i, dtype in enumerate((mx.float32, mx.bfloat16)):
                tokens = rand_tokens(300, seed=10 + i, vocab=256)
                kv = synth(tokens)
                want = [np.array((c.keys.astype(mx.float32) * 3 + 1).astype(dtype).astype(mx.float32)) for c in kv]
                for c in kv:
                    w = mx.ones((c.keys.shape[-1], c.keys.shape[-1]))
                    c.keys = ((c.keys @ w) * 0 + c.keys * 3 + 1).astype(dtype)  # unevaluated until someone waits
                    c.values = c.values.astype(dtype)
                store.insert(model, tokens, kv)
                alone.insert(model, tokens, kv)
                made.put((tokens, want))
        except BaseException as e:  # reported by the test thread
            errors.append(e)
            made.put(([], []))

    wants = []
    try:
        thread = threading.Thread(target=generation_thread, daemon=True)
        thread.start()
        for _ in range(2):
            tokens, want = made.get(timeout=120)
            wants.append((tokens, want))
            assert not errors, errors
            for one in (alone, store):
                got = one.fetch(model, tokens)
                assert got.n == len(tokens) and got.source == "memory"
                for c, w in zip(got.cache, want):
                    np.testing.assert_array_equal(np.array(c.keys.astype(mx.float32)), w)
        thread.join(120)
        store.flush()
        store.memory.clear()  # the next lookups read what the writer thread wrote
        for tokens, want in wants:
            got = store.fetch(model, tokens)
            assert got.source == "disk" and got.n == len(tokens)
            for c, w in zip(got.cache, want):
                np.testing.assert_array_equal(np.array(c.keys.astype(mx.float32)), w)
    finally:
        store.close()
        alone.close()
