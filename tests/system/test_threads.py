"""What a fetch hands out can be used on any thread (issue 31.12).

MLX streams are per thread (on Metal from MLX 0.31.2: vllm-mlx #563's "There is no
Stream(gpu, N) in current thread"). The CPU backend shows the same with a stream the
fetching thread made itself: a lazy array built on it cannot be evaluated on another
thread. So a host that fetches on one thread and runs the model on another needs every
array of the hit evaluated before ``fetch`` returns, from memory as from disk.
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
from tests.support.stores import CHUNK

from kvstore import KVStore
from tools.testing.model_builds import model_path
from tools.testing.oracle import cold_run, prefill


def _fetch_on_own_stream(store: KVStore, model_dir: Any, tokens: list[int]) -> Any:
    """``store.fetch`` on a new thread whose default stream is one it made (gone with it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        with mx.stream(mx.new_stream(mx.cpu)):
            out["got"] = store.fetch(model_dir, tokens)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["got"]


def test_memory_hit_runs_on_another_thread(tmp_path, tiny_llama, make_prompt) -> None:
    """A memory hit (exact, and a longer entry cut back) fetched on one thread's stream
    runs the model on another thread, and its next token is the cold prefill's."""
    model, tok = tiny_llama
    mdir = model_path("tiny-llama")
    prompt = make_prompt(tok, 3 * CHUNK + 10, seed=5)
    longer = prompt + [7, 8, 9]
    with KVStore(tmp_path / "cache", chunk_tokens=CHUNK) as s:
        s.insert(mdir, longer, prefill(model, longer))
        s.flush()
        for query, held in ((longer + [11], len(longer)), (prompt + [12], len(prompt))):
            got = _fetch_on_own_stream(s, mdir, query)
            assert got.source == "memory" and got.n == held, (got.source, got.n)
            ref = cold_run(model, query)
            logits = model(mx.array([query[got.n:]]), cache=got.cache)  # this thread, not the fetcher's
            assert int(mx.argmax(logits[0, -1]).item()) == ref.tokens[0]


def _lazy_kv(heads: int, n: int, dim: int) -> Any:
    """A KVCache whose keys and values are still being computed (a chain of matmuls no
    one evaluated yet, as mlx-lm's async generation leaves a cache), on this thread."""
    from mlx_lm.models.cache import KVCache

    x = mx.random.normal((768, 768), key=mx.random.key(3))
    mx.eval(x)
    y = x
    for _ in range(24):
        y = (y @ x) * (1.0 / 768)
    flat = y.reshape(-1)[: heads * n * dim].reshape(1, heads, n, dim)
    c = KVCache()
    c.keys, c.values, c.offset = flat, flat + 1, n
    return c


def test_insert_on_one_thread_memory_hit_on_another(tmp_path) -> None:
    """An insert on one thread (its own stream, its cache still computing) and a lookup on
    another that finds the entry while the insert is under way: what the lookup hands out
    is evaluated, so a third thread runs it. Before: the lookup handed out the inserting
    thread's lazy slices (filed before they were computed), which no other thread can
    evaluate ("There is no Stream(cpu, N) in current thread")."""
    from tests.support.caches import ident

    tokens = list(range(1, 201))
    who = ident("threads")
    with KVStore(tmp_path / "cache", chunk_tokens=CHUNK) as s:
        done = threading.Event()

        def insert() -> None:
            with mx.stream(mx.new_stream(mx.cpu)):
                s.insert(who, tokens, [_lazy_kv(2, len(tokens), 16)])
            done.set()

        t = threading.Thread(target=insert)
        t.start()
        got = None
        while got is None or (got.n == 0 and not done.is_set()):
            got = s.fetch(who, tokens)
        assert got.source == "memory" and got.n == len(tokens)
        errors: list[BaseException] = []

        def use() -> None:
            try:
                mx.eval([got.cache[0].keys, got.cache[0].values])
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        u = threading.Thread(target=use)  # at once: the insert may still be under way
        u.start()
        u.join()
        t.join()
        assert not errors, errors
