"""The fields of a ``/v1/chat/completions`` or ``/v1/completions`` body that mlx_lm.server
hands its generation thread without checking them, checked on the request's own thread
(``check``) so that a bad value is that request's 400.

mlx_lm.server (0.32) checks the types of most fields, not what its generation thread does
with them there, outside any ``try``: a ``stop`` that is not text, a prompt of no tokens, a
``*_context_size`` past 32 bits, a ``top_k`` not below the vocabulary size each raised there
and ended the thread (every later request answered 404, ``/health`` 503, until a restart);
a ``logit_bias`` token id outside the vocabulary wrote past the logits (heap corruption, the
process aborted); a ``seed`` outside 0..2**64-1 raised in the request's answer after its
status line was buffered (the connection closed with no answer). Found by
tests/system/test_fuzz_routes.py. Every route that generates goes through here: kvstore's
translated routes (``/v1/messages``, ``/v1/responses``) with the chat body they built.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

from .http import BodyError

INT32 = 1 << 31
CONTEXT_SIZES = ("repetition_context_size", "presence_context_size", "frequency_context_size", "num_draft_tokens")
TOKEN_COUNTS = ("max_tokens", "max_completion_tokens")


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse(param: str, message: str) -> BodyError:
    return BodyError(400, f"{param} {message}", f"invalid_{param}", param)


def check(path: str, body: Any, vocab: int | None) -> None:
    """BodyError (400, naming the field) for a ``body`` of ``path`` that mlx_lm.server's
    generation thread could not run; ``vocab``: the served model's vocabulary size (None:
    unknown, the checks that need it are skipped). Types mlx_lm.server checks itself are
    left to it (its own 400)."""
    if not isinstance(body, dict):
        return
    prompt = body.get("prompt")
    if path == "/v1/completions" and not (isinstance(prompt, str) and prompt):
        raise _refuse("prompt", f"must be a non-empty string, got {_show(prompt)}")
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise _refuse("stop", f"must be a string or a list of strings, got {_show(stop)}")
    seed = body.get("seed")
    if _int(seed) and not 0 <= seed < 1 << 64:
        raise _refuse("seed", f"must be from 0 to 2**64-1, got {seed}")
    for key in (*CONTEXT_SIZES, *TOKEN_COUNTS, "top_k"):
        value = body.get(key)
        if _int(value) and not -INT32 <= value < INT32:
            raise _refuse(key, f"must be below 2**31, got {value}")
    top_k = body.get("top_k")
    if vocab is not None and _int(top_k) and top_k >= vocab:
        raise _refuse("top_k", f"must be below the model's vocabulary size ({vocab}), got {top_k}")
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        for k, v in bias.items():
            try:
                token = int(k)
            except ValueError:
                continue  # mlx_lm.server's own 400
            if token < 0 or (vocab is not None and token >= vocab) or token >= INT32:
                raise _refuse("logit_bias", f"token ids must be from 0 to {(vocab or INT32) - 1}, got {k!r}")
            if isinstance(v, float) and not math.isfinite(v):
                raise _refuse("logit_bias", f"values must be finite numbers, got {v!r} for {k!r}")


def vocab_size(provider: Any) -> int | None:
    """The vocabulary size (the logits' width) of the model ``provider`` (mlx_lm.server's
    ModelProvider) has loaded, from its config; None when not known."""
    args = getattr(getattr(provider, "model", None), "args", None)
    for n in (getattr(args, "vocab_size", None), getattr(getattr(args, "text_config", None), "vocab_size", None)):
        if _int(n) and n > 0:
            return int(n)
    return None


def _show(value: Any) -> str:
    return json.dumps(value)[:80]
