"""mlx_lm.server's second chat-template render of a request, made once per system prompt.

mlx-lm's ``ResponseGenerator._tokenize`` renders every chat request that ends with a user
message twice: the prompt, then its leading system messages followed by an empty user
message (``tokenize=True``, ``add_generation_prompt=False``), only to find where the system
prompt's tokens end (the prompt cache's system segment). An agent's system prompt (its
instructions and tool definitions: most of the prompt) is the same every turn, so that second
render is too: at 12.5k tokens it was half of the ~62 ms ``_tokenize`` took per turn.

``Probed`` (a step of ``kvstore.serve.generator``'s ``_tokenize``) hands mlx-lm's ``_tokenize`` a tokenizer that answers that probe, and only that
call shape, from the last ``KEEP`` probes it rendered, keyed by everything the template
reads (the messages, the tools, the template's keyword arguments), the tokenizer itself and
the request's ``cache_salt`` (one caller's probe never answers another's: a remembered probe
is faster, a timing side channel); every other call goes to the tokenizer unchanged. The tokens are the template's own
(a copy is handed out). What the probe decides is only where the system segment ends, so
even a template that reads the clock (a date) cannot make a wrong prompt: the prompt itself
is rendered every time.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

KEEP = 8  # system prompts remembered (per process; a few tenants' agents at once)
_LOCK = threading.Lock()
_PROBES: OrderedDict[str, tuple[Any, list[int]]] = OrderedDict()


def _probe_key(messages: Any, kwargs: dict[str, Any], salt: Any) -> str | None:
    """The memo key of an ``apply_chat_template`` call, if it is mlx-lm's system probe."""
    if kwargs.get("tokenize") is not True or kwargs.get("add_generation_prompt") is not False:
        return None
    if not isinstance(messages, list) or len(messages) < 2 or messages[-1] != {"role": "user", "content": ""}:
        return None
    try:
        return json.dumps([repr(salt), messages, sorted(kwargs.items())], sort_keys=True, default=repr)
    except (TypeError, ValueError):  # not a JSON request's messages: render as before
        return None


class Probed:
    """``tokenizer`` for one ``_tokenize`` call under the caller's ``salt``: its system probe
    remembered, all else its own."""

    def __init__(self, tokenizer: Any, salt: Any = None) -> None:
        self._tokenizer, self._salt = tokenizer, salt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        key = _probe_key(messages, kwargs, self._salt) if not args else None
        if key is None:
            return self._tokenizer.apply_chat_template(messages, *args, **kwargs)
        with _LOCK:
            got = _PROBES.get(key)
            if got is not None and got[0] is self._tokenizer:
                _PROBES.move_to_end(key)
                return list(got[1])
        tokens = self._tokenizer.apply_chat_template(messages, **kwargs)
        if isinstance(tokens, list):
            with _LOCK:
                _PROBES[key] = (self._tokenizer, list(tokens))
                while len(_PROBES) > KEEP:
                    _PROBES.popitem(last=False)
        return tokens


def forget() -> None:
    """Drop every remembered probe (tests)."""
    with _LOCK:
        _PROBES.clear()
