"""Deterministic prompts for tests (and for the programs they run in child processes)."""

from __future__ import annotations

import random

_WORDS = (
    "the a cache of keys and values is stored on disk so that a later request with the same "
    "prefix can skip prefill entirely while the model still produces exactly what a cold run "
    "would give river mountain city seven blue quickly under over system user assistant token "
    "layer window rotate quantize restore memory page block hash index write read sync"
).split()


def text_prompt(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``n_tokens`` tokens of deterministic pseudo-English text."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words.extend(rng.choice(_WORDS) for _ in range(64))
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        if len(ids) >= n_tokens:
            return [int(t) for t in ids[:n_tokens]]
