"""The chat request mlx_lm.server's generation thread just rendered, for the lookup that follows.

``of`` (a step of ``kvstore.serve.generator``'s ``_tokenize``, after mlx-lm's own render)
keeps the chat ``messages`` and ``tools`` it rendered (tools sorted by ``--sort-tools``
included) and the chat template arguments: references, no copy, no work per request, in
the request's ``RequestContext``. The lookup of those tokens (``LRUPromptCache``, right
after) asks the context for a function naming a miss's part (``kvstore.parts``), which
renders and decodes only when a miss is made. Every route that renders chat messages
through ``_tokenize`` (chat completions, ``/v1/messages``) gets it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import parts
from ..misses import Miss

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


def of(provider: Any, tokenizer: Any, request: Any, args: Any, prompt: Sequence[int],
       blocks: dict[int, list[int]]) -> Rendered | None:
    """The chat request ``request`` as mlx_lm.server's ``_tokenize`` rendered it into
    ``prompt`` with ``tokenizer`` (the real one), for naming a miss's part; None for a text
    request, a tokenizer without a chat template, or anything that fails here (naming a
    miss's part is a diagnosis: the request is served regardless). ``blocks``:
    ``block_lengths`` of its messages, read before ``_tokenize`` joined them."""
    try:
        if getattr(request, "request_type", None) != "chat" or not tokenizer.has_chat_template:
            return None
        template_args = dict(getattr(provider.cli_args, "chat_template_args", None) or {})
        template_args.update(getattr(args, "chat_template_kwargs", None) or {})
        return Rendered(request.messages, request.tools or None, tokenizer, template_args,
                        len(prompt), tuple(prompt[-4:]), blocks)
    except Exception:
        return None


def block_lengths(messages: Any) -> dict[int, list[int]]:
    """Per message whose content is a list of text blocks, each block's text length."""
    out: dict[int, list[int]] = {}
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and len(content) > 1:
            out[i] = [len(b["text"]) if isinstance(b, dict) and isinstance(b.get("text"), str) else 0 for b in content]
    return out
