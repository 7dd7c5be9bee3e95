"""docs/serve.md: "a lookup sees every earlier insert". mlx_lm.server ends a response
(``rqueue.put(None)``) just before its generation thread inserts that response's cache, so a
client that asks for the cache as soon as its response is complete (mlx-lm's own
``test_completion_quantizes_the_cache`` does) looks up while the insert is only starting.
The drop-in counts an insert as under way from its first instruction: such a lookup waits
for it and finds it, as with mlx-lm's own prompt cache.
"""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Queue

from kvstore.adapters.mlx_lm import LRUPromptCache
from tests.support.caches import rand_tokens, synth

ROUNDS = 60


def test_a_lookup_right_after_the_end_of_a_response_finds_its_cache(tmp_path: Path) -> None:
    from tools.testing.model_builds import model_path

    model = (str(model_path("tiny-llama")), None, None)  # mlx_lm.server's model key: a real model's files
    cache = LRUPromptCache(max_size=ROUNDS + 1, cache_dir=tmp_path / "cache")
    ended: Queue[list[int] | None] = Queue()
    looked: Queue[bool] = Queue()
    errors: list[BaseException] = []

    def generation_thread() -> None:  # mlx_lm.server's order: the end of the response, then the insert
        try:
            for i in range(ROUNDS):
                tokens = rand_tokens(40 + i, seed=i, vocab=256)
                kv = synth(tokens)
                ended.put(tokens)
                cache.insert_cache(model, tokens, kv)
                looked.get(timeout=120)  # the client looked before the next response
        except BaseException as e:  # reported by the test thread
            errors.append(e)
            ended.put(None)

    thread = threading.Thread(target=generation_thread, daemon=True)
    thread.start()
    found = 0
    try:
        for _ in range(ROUNDS):
            tokens = ended.get(timeout=120)
            assert tokens is not None, errors
            got, rest = cache.fetch_nearest_cache(model, tokens)  # as soon as the response is complete
            found += got is not None and len(rest) <= 1
            looked.put(True)
    finally:
        thread.join(120)
        cache.close()
    assert not errors, errors
    assert found == ROUNDS, f"{ROUNDS - found} of {ROUNDS} lookups missed the insert that ended just before them"
