"""The restored-equals-cold oracle.

A restored prompt cache is correct when continuing from it gives what a cold prefill of the
whole prompt gives. ``check_restore`` runs both and compares:

(i) cold: a fresh cache (``make_cache``), prefill the prompt, greedy-generate ``n_gen``
    tokens, keep the log-probs at the last prompt position and at every generated step;
(ii) cached: feed ``prompt_tokens[n_cached:]`` (at least one token) into the supplied cache,
    which must already hold exactly ``prompt_tokens[:n_cached]``, then greedy-generate.

Two criteria:
- ``exact=True``: bit-identical log-probs at every compared position and identical tokens.
  The cold run then prefills with the same split the cache was made with
  (``prompt[:n_cached]`` in chunks of ``chunk``, then the rest), so a byte-exact restore of
  a cache made in the same process compares equal bit for bit.
- otherwise: identical tokens and ``max|logprob diff| <= atol`` at the last prompt position,
  with the cold run prefilling the whole prompt in one call.

Everything is plain model calls (``model(mx.array([tokens]), cache=cache)``). KV
quantisation (``kv_bits``): unlike mlx_lm.generate (which converts KVCache layers to
QuantizedKVCache once their offset passes ``quantized_kv_start``, default 5000), caches are
quantised from the first token (``make_cache`` converts every KVCache layer up front), so
prefill splits do not change which attention path ran. A supplied cache that still has float
KVCache layers is converted with ``to_quantized`` before use, as mlx_lm does.

``cold_run`` computes a cold reference once; pass it as ``reference=`` to check many caches
against the same prompt without re-running cold each time (CPU prefill is slow).

Note: ``check_restore`` advances the supplied cache (pass ``copy_cache=True`` to keep it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

DEFAULT_ATOL = 1e-3


@dataclass
class OracleResult:
    tokens_cold: list[int]
    tokens_cached: list[int]
    logprobs_max_abs_diff: float  # last-prompt-position log-probs, cold vs cached
    same_tokens: bool
    ok: bool
    detail: str
    # max |diff| over the generated steps whose token histories agree (informational)
    gen_logprobs_max_abs_diff: float = 0.0
    exact: bool = False
    n_cached: int = 0


def make_cache(model, *, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """``make_prompt_cache(model)``, with every KVCache layer made a QuantizedKVCache when
    ``kv_bits`` is set (other classes, e.g. RotatingKVCache, stay as they are)."""
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        _quantize_layers(cache, kv_bits, kv_group_size)
    return cache


def _quantize_layers(cache: list, kv_bits: int, kv_group_size: int) -> None:
    for i, c in enumerate(cache):
        if type(c) is KVCache:  # exactly KVCache: RotatingKVCache.to_quantized is NYI
            cache[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


def _eval_cache(cache: list) -> None:
    mx.eval([c.state for c in cache])


def _feed(model, cache: list, tokens: list[int], chunk: int | None) -> mx.array:
    """Run ``tokens`` through the model into ``cache`` (in chunks of ``chunk``; one call if
    None) and return the last call's logits (1, L, V)."""
    if not tokens:
        raise ValueError("no tokens to feed")
    step = len(tokens) if not chunk else int(chunk)
    if step <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    logits = None
    for start in range(0, len(tokens), step):
        logits = model(mx.array([tokens[start : start + step]]), cache=cache)
        if start + step < len(tokens):
            _eval_cache(cache)
    return logits


def prefill(
    model,
    tokens: list[int],
    cache: list | None = None,
    *,
    chunk: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> list:
    """Feed ``tokens`` into ``cache`` (a fresh ``make_cache`` if None) and return the filled,
    evaluated cache. ``chunk``: prefill step size (None: one call)."""
    tokens = [int(t) for t in tokens]
    if cache is None:
        cache = make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    elif kv_bits is not None:
        _quantize_layers(cache, kv_bits, kv_group_size)
    if tokens:
        _feed(model, cache, tokens, chunk)
        _eval_cache(cache)
    return cache


def _logprobs(logits: mx.array) -> mx.array:
    last = logits[0, -1, :].astype(mx.float32)
    return last - mx.logsumexp(last, axis=-1, keepdims=True)


def _greedy(
    model, cache: list, tokens: list[int], n_gen: int, chunk: int | None = None
) -> tuple[list[int], list[np.ndarray]]:
    """Feed ``tokens`` then greedy-decode ``n_gen`` tokens. Returns the tokens and the
    log-prob vectors they were picked from (index 0: last prompt position)."""
    lp = _logprobs(_feed(model, cache, tokens, chunk))
    out_tokens: list[int] = []
    out_lps: list[np.ndarray] = []
    for i in range(n_gen):
        mx.eval(lp)
        out_lps.append(np.array(lp, copy=True))
        tok = int(np.argmax(out_lps[-1]))
        out_tokens.append(tok)
        if i + 1 < n_gen:
            lp = _logprobs(model(mx.array([[tok]]), cache=cache))
    return out_tokens, out_lps


def cache_offset(cache: list) -> int | None:
    """Best-effort token count of a cache: the first layer (or CacheList member) with an
    integer ``offset``. None when nothing reports one (e.g. only ArraysCache layers)."""
    for c in cache:
        for sub in getattr(c, "caches", (c,)):
            off = getattr(sub, "offset", None)
            if isinstance(off, int):
                return off
    return None


@dataclass
class ColdRun:
    """A cold reference run: fresh cache, prefill, greedy decode. Reusable across many
    ``check_restore`` calls on the same prompt (pass it as ``reference=``)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[np.ndarray]  # [0]: last prompt position; [i]: the step that chose tokens[i]
    split: int | None  # prefill split point (None: the whole prompt in one call)
    chunk: int | None  # prefill step used for prompt[:split]
    kv_bits: int | None
    kv_group_size: int

    @property
    def n_gen(self) -> int:
        return len(self.tokens)


def cold_run(
    model,
    prompt_tokens: list[int],
    *,
    n_gen: int = 16,
    split: int | None = None,
    chunk: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> ColdRun:
    """Fresh cache; prefill ``prompt_tokens`` (in one call, or ``prompt[:split]`` in chunks of
    ``chunk`` then the rest in one call); greedy-decode ``n_gen`` tokens."""
    prompt = [int(t) for t in prompt_tokens]
    if n_gen < 1:
        raise ValueError(f"n_gen must be >= 1, got {n_gen}")
    if split is not None and not 0 <= split < len(prompt):
        raise ValueError(f"split={split} must leave at least one of {len(prompt)} tokens")
    cache = make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    if split:
        _feed(model, cache, prompt[:split], chunk)
        _eval_cache(cache)
    tokens, lps = _greedy(model, cache, prompt[split or 0 :], n_gen)
    return ColdRun(prompt, tokens, lps, split or None, chunk if split else None, kv_bits, kv_group_size)


def check_restore(
    model,
    prompt_tokens: list[int],
    cache: list | None,
    n_cached: int,
    *,
    n_gen: int = 16,
    atol: float = DEFAULT_ATOL,
    exact: bool = False,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    chunk: int | None = None,
    copy_cache: bool = False,
    reference: ColdRun | None = None,
) -> OracleResult:
    """Compare continuing from ``cache`` (claimed to hold ``prompt_tokens[:n_cached]``) with
    a cold prefill of ``prompt_tokens``. See the module docstring for the criteria.

    ``cache=None`` means a fresh cache (then ``n_cached`` must be 0). ``chunk`` is the
    prefill step the cache was made with; only the exact-mode cold run uses it.
    ``reference``: a ``cold_run`` result to reuse instead of running cold again; it must be
    for the same prompt, n_gen and kv settings, and split the way this mode needs (exact:
    ``split=n_cached, chunk=chunk``; tolerance: ``split=None``).
    """
    prompt = [int(t) for t in prompt_tokens]
    if n_gen < 1:
        raise ValueError(f"n_gen must be >= 1, got {n_gen}")
    if not 0 <= n_cached < len(prompt):
        raise ValueError(
            f"n_cached={n_cached} must leave at least one of the {len(prompt)} prompt tokens "
            "to feed"
        )
    want_split = (n_cached or None) if exact else None
    want_chunk = chunk if want_split else None
    if reference is not None:
        got = (reference.prompt, reference.n_gen, reference.split, reference.chunk,
               reference.kv_bits, reference.kv_group_size if reference.kv_bits else None)
        want = (prompt, n_gen, want_split, want_chunk, kv_bits, kv_group_size if kv_bits else None)
        if got != want:
            raise ValueError(
                "reference does not match this check (prompt, n_gen, split, chunk, kv_bits, "
                f"kv_group_size): {got[1:]} vs {want[1:]}"
                + ("" if reference.prompt == prompt else " and a different prompt")
            )
    if cache is None:
        if n_cached != 0:
            raise ValueError(f"cache=None (a fresh cache) holds 0 tokens, not n_cached={n_cached}")
        cache = make_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size)
    elif copy_cache:
        cache = copy.deepcopy(cache)
    if kv_bits is not None:
        _quantize_layers(cache, kv_bits, kv_group_size)

    # (i) cold
    if reference is None:
        reference = cold_run(
            model, prompt, n_gen=n_gen, split=want_split, chunk=want_chunk,
            kv_bits=kv_bits, kv_group_size=kv_group_size,
        )
    tokens_cold, lps_cold = reference.tokens, reference.logprobs

    # (ii) cached
    tokens_cached, lps_cached = _greedy(model, cache, prompt[n_cached:], n_gen)

    same_tokens = tokens_cold == tokens_cached
    # Steps whose histories agree: all of them up to and including the first differing token.
    n_cmp = next(
        (i + 1 for i, (a, b) in enumerate(zip(tokens_cold, tokens_cached)) if a != b), n_gen
    )
    diffs = [float(np.max(np.abs(lps_cold[i] - lps_cached[i]))) for i in range(n_cmp)]
    last_diff = diffs[0]
    gen_diff = max(diffs[1:], default=0.0)
    finite = all(np.isfinite(d) for d in diffs)

    if exact:
        bit_equal = all(np.array_equal(lps_cold[i], lps_cached[i]) for i in range(n_cmp))
        ok = same_tokens and bit_equal
        crit = f"exact: log-probs bit-identical at {n_cmp} position(s): {bit_equal}"
    else:
        ok = same_tokens and finite and last_diff <= atol
        crit = f"atol={atol:g}: last-position max|diff|={last_diff:.3g}"
    detail = (
        f"{'OK' if ok else 'MISMATCH'} n_cached={n_cached} prompt={len(prompt)} "
        f"fed={len(prompt) - n_cached}; {crit}; generated-steps max|diff|={gen_diff:.3g}; "
        f"tokens {'identical' if same_tokens else 'differ'}"
    )
    if not same_tokens:
        first = n_cmp - 1
        detail += (
            f" (first at step {first}: cold {tokens_cold[first]} vs cached "
            f"{tokens_cached[first]}; cold={tokens_cold} cached={tokens_cached})"
        )
    return OracleResult(
        tokens_cold=list(tokens_cold),
        tokens_cached=tokens_cached,
        logprobs_max_abs_diff=last_diff,
        same_tokens=same_tokens,
        ok=ok,
        detail=detail,
        gen_logprobs_max_abs_diff=gen_diff,
        exact=exact,
        n_cached=n_cached,
    )


def assert_restore(*args, **kwargs) -> OracleResult:
    """``check_restore`` that raises AssertionError(detail) unless ok; returns the result."""
    result = check_restore(*args, **kwargs)
    if not result.ok:
        raise AssertionError(result.detail)
    return result
