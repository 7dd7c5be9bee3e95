"""The chat request mlx_lm.server's generation thread just rendered, for the lookup that follows.

``install`` wraps ``ResponseGenerator._tokenize`` (innermost but for ``system_render``, which
changes no request: it sees the request as the template renders it, tools sorted by
``--sort-tools`` included) to keep, per thread, the
chat ``messages`` and ``tools`` it rendered and the chat template arguments: references,
no copy, no work per request. The lookup of those tokens (``LRUPromptCache``, on the same
thread right after) asks ``namer`` for a function naming a miss's part (``kvstore.parts``),
which renders and decodes only when a miss is made. Every route that renders chat messages
through ``_tokenize`` (chat completions, ``/v1/messages``) gets it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import parts
from ..misses import Miss

_LOCAL = threading.local()


@dataclass(frozen=True)
class Rendered:
    """One rendered chat request: what ``parts.locate`` needs, and which tokens it made."""

    messages: list[Any]
    tools: list[Any] | None
    tokenizer: Any
    template_args: dict[str, Any]
    n: int
    tail: tuple[int, ...]
    blocks: dict[int, list[int]]  # message index -> its content blocks' text lengths (joined before rendering)

    def render(self, messages: list[Any], tools: list[Any] | None) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=False, **self.template_args))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids))

    def name(self, tokens: Sequence[int]) -> Callable[[Miss], parts.Part]:
        """What names a miss of ``tokens``, now or later (``Misses.name_pending``): on a copy,
        since mlx-lm appends the generated tokens to the list it looked up."""
        held = list(tokens)
        return lambda miss: parts.locate(miss, held, self.messages, self.tools, self.render, self.decode,
                                         self.blocks)


def install(server_mod: Any) -> None:
    """Keep each chat request ``server_mod.ResponseGenerator._tokenize`` renders for the
    lookup that follows on its thread; idempotent. Install it before the other wrappers
    of ``_tokenize`` (it must see the request as rendered)."""
    generator = server_mod.ResponseGenerator
    if getattr(generator, "_kvstore_rendered", False):
        return
    tokenize = generator._tokenize

    def _tokenize(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        _LOCAL.last = None
        blocks = block_lengths(getattr(request, "messages", None))  # before _tokenize joins them
        got = tokenize(self, tokenizer, request, args)
        try:
            if getattr(request, "request_type", None) == "chat" and tokenizer.has_chat_template:
                template_args = dict(getattr(self.model_provider.cli_args, "chat_template_args", None) or {})
                template_args.update(getattr(args, "chat_template_kwargs", None) or {})
                prompt = got[0]
                _LOCAL.last = Rendered(request.messages, request.tools or None, tokenizer, template_args,
                                       len(prompt), tuple(prompt[-4:]), blocks)
        except Exception:  # naming a miss's part is a diagnosis: the request is served regardless
            _LOCAL.last = None
        return got

    generator._tokenize = _tokenize
    generator._kvstore_rendered = True


def block_lengths(messages: Any) -> dict[int, list[int]]:
    """Per message whose content is a list of text blocks, each block's text length."""
    out: dict[int, list[int]] = {}
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and len(content) > 1:
            out[i] = [len(b["text"]) if isinstance(b, dict) and isinstance(b.get("text"), str) else 0 for b in content]
    return out


def namer(tokens: Sequence[int]) -> Callable[[Miss], parts.Part] | None:
    """What names a miss of ``tokens``' lookup, if this thread just rendered them."""
    last: Rendered | None = getattr(_LOCAL, "last", None)
    if last is None or last.n != len(tokens) or tuple(tokens[-4:]) != last.tail:
        return None
    return last.name(tokens)
