"""kvstore serve's generator: a subclass of mlx_lm.server's ``ResponseGenerator``.

mlx_lm.server builds it by name (``ResponseGenerator(model_provider, prompt_cache)``, in
``run()`` or a test), so it takes mlx-lm's constructor arguments; its ``config`` is a
class attribute (``server.patch`` names a subclass bound to the server's ``ServeConfig``;
the default: every option off). Over mlx-lm's own it
- tells a kvstore prompt cache the server's KV quantisation (``--kv-bits`` /
  ``--kv-group-size``: a quantising server's entries get their own identity), its
  tokenizer (the text of a miss's log line) and how to name a miss's part and what
  ``--stable-prefix`` moved (both read from the lookup's tokens: ``context``), before its
  generation thread starts (``__init__``);
- generates every request on the served model, never one a body names (``generate``:
  ``model_names.on_served_model``);
- renders a prompt in one ``_tokenize``, whose steps run in the order written there.
"""

from __future__ import annotations

import threading
from typing import Any

from mlx_lm.server import ResponseGenerator as MlxResponseGenerator

from ..adapters.mlx_lm import LRUPromptCache
from . import context, model_names, prompts, rendered, stable_prefix, system_render
from .config import ServeConfig


class Generator(MlxResponseGenerator):
    """mlx_lm.server's ``ResponseGenerator`` with kvstore's prompt steps (module docstring)."""

    config: ServeConfig = ServeConfig()

    def __init__(self, model_provider: Any, prompt_cache: Any, *args: Any, **kwargs: Any) -> None:
        self._memory: stable_prefix.Memory | None = None
        self._memory_lock = threading.Lock()
        if isinstance(prompt_cache, LRUPromptCache):  # before its generation thread starts
            cli = getattr(model_provider, "cli_args", None)
            if cli is not None:
                prompt_cache.store.set_kv_quant(getattr(cli, "kv_bits", None), getattr(cli, "kv_group_size", 64))
            prompt_cache.decode = _decoder(model_provider)
            prompt_cache.name_part = context.name_part  # the request's render, carried by its tokens
            prompt_cache.miss_note = context.miss_note  # what --stable-prefix moved in it
        super().__init__(model_provider, prompt_cache, *args, **kwargs)

    def generate(self, request: Any, generation_args: Any, progress_callback: Any = None) -> Any:
        """mlx-lm's, on the served model whatever the request named (``model_names``)."""
        cli_args = getattr(getattr(self, "model_provider", None), "cli_args", None)
        return super().generate(request, model_names.on_served_model(generation_args, cli_args),
                                progress_callback=progress_callback)

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> Any:
        """mlx-lm's render of ``request``, with kvstore's steps, in this order:

        1. ``--stable-prefix``: the opening's volatile spans keep the session's first values
           (a copy of the request; what moved goes into its context, for the miss line);
        2. ``--sort-tools``: the tools sorted by name (a copy);
        3. the block lengths of its messages, read before mlx-lm joins them;
        4. mlx-lm's own ``_tokenize``, with a tokenizer that renders its system-prompt probe
           once per system prompt and salt (``system_render.Probed``);
        5. what it rendered, kept in the context (what names a miss's part: ``rendered.of``);
        6. the prompt handed out as ``RequestTokens``: the salt and the context ride with the
           tokens to the prompt cache's lookup (a vision request's cache key salted too).
        """
        ctx = context.of(request)
        cfg = self.config
        request, ctx.moved = stable_prefix.rewrite(request, tokenizer, cfg.stable, self._stable_memory, ctx.salt)
        if cfg.sort_tools:
            request = prompts.with_sorted_tools(request)
        blocks = rendered.block_lengths(getattr(request, "messages", None))
        got = super()._tokenize(system_render.Probed(tokenizer, ctx.salt), request, args)
        ctx.rendered = rendered.of(self.model_provider, tokenizer, request, args, got[0], blocks)
        return _carried(got, ctx)

    def learned_spans(self, salt: Any) -> list[dict[str, str]]:
        """The spans ``--stable-prefix`` learned under ``salt`` (``GET /v1/cache/stats``:
        the caller's salt only)."""
        if not self.config.stable.enabled or not self.config.stable.learn:
            return []
        from ..salt import salt_key

        learner = self._stable_memory().learner
        return [x.as_json() for x in learner.learned(salt_key(salt) if salt is not None else None)] if learner else []

    def _stable_memory(self) -> stable_prefix.Memory:
        """The ``--stable-prefix`` records of this server's cache directory (made once)."""
        with self._memory_lock:
            if self._memory is None:
                self._memory = stable_prefix.memory_of(self.prompt_cache, self.config.stable)
            return self._memory


def _carried(got: Any, ctx: context.RequestContext) -> Any:
    """mlx-lm's ``_tokenize`` result with its prompt as ``RequestTokens`` (and a vision
    request's ``cache_key`` salted, when the request is)."""
    prompt, *rest = got
    vision = rest[-1] if rest else None
    if ctx.salt is not None and vision is not None and hasattr(vision, "cache_key"):
        from ..salt import SaltedTokens

        vision.cache_key = SaltedTokens(vision.cache_key, ctx.salt)
    return (context.RequestTokens(prompt, ctx), *rest)


def _decoder(model_provider: Any) -> Any:
    """Token ids to text with the tokenizer ``model_provider`` has loaded (it loads the
    model before the first request: a miss is only ever decoded after)."""
    def decode(ids: list[int]) -> str:
        return str(model_provider.tokenizer.decode(ids))
    return decode
