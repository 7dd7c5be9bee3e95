"""A request as the prompt mlx_lm.server renders: the one opt-in rewrite, and the tokens.

- ``--sort-tools`` (``with_sorted_tools``, a step of ``kvstore.serve.generator``'s ``_tokenize``): tool definitions sorted by name before the
  chat template renders them, on every route that renders one (``/v1/chat/completions``
  and ``/v1/messages``, which runs through the same handler). Clients that list the same
  tools in another order per process (MCP servers connecting in any order) then share one
  cached prefix; the model sees the tools sorted. Off by default; nothing else in a
  prompt is rewritten (the Anthropic billing header aside: ``anthropic``; and the
  volatile lines of ``--stable-prefix``: ``stable_prefix``).
- ``request_tokens``: the tokens ``kvstore serve`` would look up for a request body (an
  OpenAI chat-completions or an Anthropic Messages body, or a plain text), rendered by
  mlx_lm.server's own ``_tokenize`` with the model's tokenizer and chat template, without
  loading its weights (``kvstore why``).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from typing import Any

from ..parts import tool_name
from . import stable_prefix

def sorted_tools(tools: list[Any]) -> list[Any]:
    """``tools`` sorted by name (stable: tools of one name keep their order)."""
    return sorted(tools, key=tool_name)


def with_sorted_tools(request: Any) -> Any:
    """``request`` (mlx_lm.server's CompletionRequest) with its tools sorted by name
    (``--sort-tools``): a copy when it has tools, else the request itself (never changed)."""
    if not getattr(request, "tools", None):
        return request
    request = copy.copy(request)
    request.tools = sorted_tools(request.tools)
    return request


def body_kind(body: Any) -> str:
    """"anthropic" for a Messages body (``max_tokens`` and a ``system`` or content blocks
    with Anthropic block types, or ``anthropic_version``), "openai" for another body with
    ``messages``, "text" for a completions body (``prompt``). ValueError otherwise."""
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if "prompt" in body and "messages" not in body:
        return "text"
    if not isinstance(body.get("messages"), list):
        raise ValueError("the request has neither messages (a chat request) nor prompt (a completion)")
    if "system" in body or "anthropic_version" in body or any(
            isinstance(t, dict) and "input_schema" in t for t in body.get("tools") or []):
        return "anthropic"
    blocks = [b for m in body["messages"] if isinstance(m, dict) and isinstance(m.get("content"), list)
              for b in m["content"]]
    if any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in blocks):
        return "anthropic"
    return "openai"


def request_tokens(tokenizer: Any, body: Any, *, sort_tools: bool = False,
                   keep_billing_header: bool = False, chat_template_args: dict[str, Any] | None = None,
                   stable: stable_prefix.Render | None = None) -> list[int]:
    """The prompt tokens ``kvstore serve`` renders for ``body`` (``body_kind``; a str is a
    text completion's prompt), through mlx_lm.server's ``_tokenize`` on ``tokenizer``
    (mlx-lm's ``TokenizerWrapper``), its messages rewritten as ``--stable-prefix`` does when
    ``stable`` is given (``stable.moved`` says how). ValueError for a body it cannot render."""
    return render_request(tokenizer, body, sort_tools=sort_tools, keep_billing_header=keep_billing_header,
                          chat_template_args=chat_template_args, stable=stable).tokens


@dataclass
class RenderedRequest:
    """A request as ``kvstore serve`` renders it: its tokens and, for a chat request, the
    ``messages`` and ``tools`` the chat template rendered (what ``kvstore.parts`` names a
    miss's part in), ``blocks`` (``serve.rendered.block_lengths``) and the template's
    arguments."""

    tokens: list[int]
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    blocks: dict[int, list[int]] = field(default_factory=dict)
    template_args: dict[str, Any] = field(default_factory=dict)


def render_request(tokenizer: Any, body: Any, *, sort_tools: bool = False, keep_billing_header: bool = False,
                   chat_template_args: dict[str, Any] | None = None,
                   stable: stable_prefix.Render | None = None) -> RenderedRequest:
    """``request_tokens``, with what the chat template rendered (``RenderedRequest``)."""
    import mlx_lm.server as server_mod

    from .rendered import block_lengths

    from . import anthropic

    if isinstance(body, str):
        body = {"prompt": body}
    kind = body_kind(body)
    if kind == "anthropic":
        try:
            body = anthropic.chat_request({"max_tokens": 1, **body}, False, keep_billing_header)
        except anthropic.RequestError as e:
            raise ValueError(str(e)) from None
    if kind == "text":
        request = server_mod.CompletionRequest("text", str(body["prompt"]), [], None, None)
    else:
        messages = copy.deepcopy(body["messages"])
        if stable is not None:
            messages, stable.moved = stable_prefix.stabilize(messages, stable.rules, stable.memory,
                                                             salt_key=stable.salt_key,
                                                             inline=stable_prefix.inline_for(tokenizer),
                                                             tools=body.get("tools"))
        request = server_mod.CompletionRequest("chat", "", messages, body.get("tools") or None,
                                               body.get("role_mapping"))
    if sort_tools and request.tools:
        request.tools = sorted_tools(request.tools)
    provider = types.SimpleNamespace(processor=None, cli_args=types.SimpleNamespace(
        chat_template_args=dict(chat_template_args or {})))
    args = types.SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
    generator: Any = types.SimpleNamespace(model_provider=provider)  # all _tokenize reads of its self
    blocks = block_lengths(request.messages)
    try:
        got = mlx_own(server_mod.ResponseGenerator, server_mod)._tokenize(generator, tokenizer, request, args)
    except Exception as e:  # the template's own complaint
        raise ValueError(f"the request cannot be rendered by the model's chat template: {e}") from None
    template_args = {**(chat_template_args or {}), **(body.get("chat_template_kwargs") or {})}
    return RenderedRequest([int(t) for t in got[0]], request.messages if kind != "text" else None,
                    request.tools or None, blocks, template_args)


def mlx_own(cls: type, server_mod: Any) -> Any:
    """mlx_lm.server's own class of ``cls`` (``cls`` itself, or the first class of its MRO
    defined in ``server_mod``): kvstore's subclasses, once ``patch`` named them there, are
    skipped (``render_request`` renders as mlx-lm does, the rewrites given explicitly)."""
    return next((c for c in cls.__mro__ if c.__module__ == server_mod.__name__), cls)
