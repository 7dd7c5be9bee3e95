"""Generation with a KVStore, for engines that run their own loop (exo, custom servers).

``stream_generate`` does, in this order: fetch the nearest stored prefix -> prefill the
rest -> snapshot the prompt-only KV *after* prefill (a snapshot taken before it stores a
cache that does not hold the prompt: the bug found in review of vllm-mlx PR #90) ->
stream tokens. On an exact full hit it keeps one prompt token for the model to process
(a forward pass needs one input token; vllm-mlx PR #574 handles the same edge).

Caches that cannot be trimmed (hybrid linear-attention models such as Qwen3-Next,
sliding-window layers) are only reusable at exactly their own length, so the helper also
checkpoints at message boundaries (``checkpoints``; see ``message_boundaries``), as
mlx-lm's server does with its system / user cache types: a new question under the same
system prompt is then a hit on such a model too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, cast

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import codec
from .store import KVStore


@dataclass
class Step:
    """One streamed token, with what the prefix cache did for this request."""

    token: int
    text: str
    cached_tokens: int          # prompt tokens restored instead of prefilled
    cache_source: str | None    # "memory", "disk" or None
    prompt_tokens: int
    ttft: float                 # seconds from call to this request's first token
    finish_reason: str | None = None


def message_boundaries(tokenizer: Any, messages: Sequence[dict], prompt: Sequence[int],
                       **template_args: Any) -> list[tuple[int, str]]:
    """Token offsets where the system prompt and the last user message end, if the chat
    template renders them as prefixes of ``prompt``: ``[(offset, cache_type), ...]``."""
    out: list[tuple[int, str]] = []
    wanted = []
    if messages and messages[0].get("role") == "system":
        wanted.append((1, "system"))
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
    if last_user is not None and last_user > 0:
        wanted.append((last_user, "user"))  # everything before the last user message
    for k, kind in wanted:
        toks = tokenizer.apply_chat_template(list(messages[:k]), tokenize=True,
                                             add_generation_prompt=False, **template_args)
        toks = list(getattr(toks, "input_ids", toks))
        if 0 < len(toks) < len(prompt) and list(prompt[: len(toks)]) == toks:
            if all(len(toks) != o for o, _ in out):
                out.append((len(toks), kind))
    return out


def warm_up(model: Any, n_tokens: int = 16) -> float:
    """One forward pass of ``n_tokens`` tokens on a throwaway cache, so that the next call
    does not pay first-call costs (weights read in from disk, kernels and BLAS threads set
    up). Returns its seconds; changes no store."""
    t0 = time.perf_counter()
    warm_cache(model, n_tokens)
    return time.perf_counter() - t0


def warm_cache(model: Any, n_tokens: int = 16) -> list[Any]:
    """``warm_up``'s pass: a throwaway cache holding ``n_tokens`` tokens (ids 1..n_tokens)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, n_tokens + 1))]), cache=cache))
    return cache


ProgressFn = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: see ``stream_generate``."""


def _prefill(model: Any, cache: list[Any], tokens: Sequence[int], step: int,
             on_step: Callable[[int], None] | None = None) -> mx.array | None:
    logits = None
    for i in range(0, len(tokens), step):
        logits = model(mx.array([list(tokens[i : i + step])]), cache=cache)
        mx.eval(logits)
        if on_step is not None:
            on_step(min(i + step, len(tokens)))
    return logits


def stream_generate(
    store: KVStore,
    model: Any,
    tokenizer: Any,
    prompt: Sequence[int],
    *,
    model_key: Any,
    max_tokens: int = 256,
    sampler: Callable[[mx.array], mx.array] | None = None,
    checkpoints: Sequence[tuple[int, str]] = (),
    prefill_step: int = 512,
    cache_type: str = "assistant",
    progress: ProgressFn | None = None,
) -> Iterator[Step]:
    """Generate from ``prompt`` (token ids) reusing and feeding ``store``.

    ``model_key`` names the model to the store (an ``Identity``, a model dir, or mlx-lm's
    ``(path, adapter, draft)``). ``checkpoints`` are extra prefix lengths to snapshot on
    the way (only used for caches that cannot be trimmed). The prompt-only cache is
    inserted once prefill is complete; generated tokens are never stored.

    ``progress(stage, done, total)``, if given, is called with ``total`` = prompt tokens:
    once with stage ``"restore"`` when the lookup (and restore) is over, ``done`` = prompt
    tokens restored (0 on a miss); then with ``"prefill"`` after every prefill step,
    ``done`` = prompt tokens in the cache so far (the last call has ``done == total``).
    """
    t0 = time.perf_counter()
    prompt = list(prompt)
    if not prompt:
        raise ValueError("prompt is empty: a forward pass needs at least one token")
    sampler = sampler or (lambda logits: mx.argmax(logits, axis=-1))
    cache, n, source = _restored(store, model, model_key, prompt)
    if progress is not None:
        progress("restore", n, len(prompt))
    logits = _prefill_and_insert(store, model, model_key, prompt, cache, n, checkpoints, prefill_step, cache_type,
                                 progress)
    y = sampler(logits[:, -1, :])
    mx.eval(y)
    ttft = time.perf_counter() - t0
    detok = tokenizer.detokenizer
    detok.reset()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    for i in range(max_tokens):
        tok = int(cast(int, y.item()))  # a token id (mlx types item() as any scalar)
        finish = "stop" if tok in eos else ("length" if i == max_tokens - 1 else None)
        if finish != "stop":
            detok.add_token(tok)
        if finish is not None:
            detok.finalize()
        yield Step(tok, detok.last_segment, n, source, len(prompt), ttft, finish)
        if finish is not None:
            return
        logits = model(y.reshape(1, 1), cache=cache)
        y = sampler(logits[:, -1, :])


def _restored(store: KVStore, model: Any, model_key: Any, prompt: list[int]) -> tuple[list[Any], int, str | None]:
    """The cache to start from: the nearest stored prefix, keeping at least one prompt
    token to feed (a forward pass needs one), else a fresh cache. (cache, n, tier)."""
    got = store.fetch(model_key, prompt)
    cache, n, source = got.cache, got.n, got.source
    if cache is not None and n == len(prompt):  # keep one token for the model
        if codec.cache_can_cut(cache, n - 1):
            for c in cache:
                c.trim(1)
            n -= 1
        else:
            got = store.fetch(model_key, prompt[:-1])
            cache, n, source = got.cache, got.n, got.source
    if cache is None:
        return make_prompt_cache(model), 0, None
    return cache, n, source


def _prefill_and_insert(store: KVStore, model: Any, model_key: Any, prompt: list[int], cache: list[Any], n: int,
                        checkpoints: Sequence[tuple[int, str]], step: int, cache_type: str,
                        progress: ProgressFn | None = None) -> mx.array:
    """Prefill ``prompt[n:]``, snapshotting at the checkpoints (caches that cannot be
    trimmed only) and inserting the prompt-only cache after prefill; returns the logits."""
    trimmable_family = codec.cuts_anywhere(make_prompt_cache(model))
    marks = sorted((c, kind) for c, kind in checkpoints if n < c < len(prompt)) if not trimmable_family else []
    pos = n

    def prefilled(start: int) -> Callable[[int], None] | None:
        return None if progress is None else lambda k: progress("prefill", start + k, len(prompt))

    for mark, kind in marks:
        _prefill(model, cache, prompt[pos:mark], step, prefilled(pos))
        store.insert(model_key, prompt[:mark], cache, cache_type=kind)
        pos = mark
    logits = _prefill(model, cache, prompt[pos:], step, prefilled(pos))
    assert logits is not None, "_restored leaves at least one prompt token to prefill"
    store.insert(model_key, prompt, cache, cache_type=cache_type)  # after prefill, prompt only
    return logits
