"""mlx-lm's system-prompt probe rendered once per system prompt (issue 47, item 4):
``kvstore.serve.system_render`` on mlx_lm.server's own ``_tokenize``, a real tokenizer
and chat template (tiny-llama with the agent trace's tool template)."""

from __future__ import annotations

import types
from typing import Any

import pytest


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from mlx_lm.utils import load_tokenizer

    from tools.testing.model_builds import model_path
    from tools.testing.templates import TOOL_TEMPLATE

    return load_tokenizer(model_path("tiny-llama"), tokenizer_config_extra={"chat_template": TOOL_TEMPLATE})


def _generator(patched: bool) -> Any:
    """mlx_lm.server's ``ResponseGenerator`` (a subclass: the real one stays as it is), whose
    ``_tokenize`` renders through ``system_render.Probed`` when ``patched``, and the ``self``
    its ``_tokenize`` reads."""
    import mlx_lm.server as server_mod

    from kvstore.serve import system_render

    cls = type("Generator", (server_mod.ResponseGenerator,), {})
    if patched:  # kvstore's _tokenize step 4 (kvstore.serve.generator): mlx-lm's own, with Probed
        mlx_tokenize = server_mod.ResponseGenerator._tokenize
        cls._tokenize = lambda self, tokenizer, request, args: mlx_tokenize(
            self, system_render.Probed(tokenizer), request, args)
    self = types.SimpleNamespace(model_provider=types.SimpleNamespace(
        processor=None, cli_args=types.SimpleNamespace(chat_template_args={})))
    return cls, self


def _request(system: str, user: str) -> Any:
    import mlx_lm.server as server_mod

    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return server_mod.CompletionRequest("chat", "", messages, tools, None)


def _counting(tokenizer: Any) -> list[dict[str, Any]]:
    """Every ``apply_chat_template`` call the tokenizer renders, from now on."""
    calls: list[dict[str, Any]] = []
    render = type(tokenizer).apply_chat_template

    def counted(messages: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append({"messages": len(messages), **{k: v for k, v in kwargs.items() if k != "tools"}})
        return render(tokenizer, messages, *args, **kwargs)

    tokenizer.apply_chat_template = counted
    return calls


def test_the_system_probe_is_rendered_once_per_system_prompt(tokenizer: Any) -> None:
    from kvstore.serve import system_render

    system_render.forget()
    args = types.SimpleNamespace(chat_template_kwargs=None)
    plain_cls, plain_self = _generator(False)
    cls, self = _generator(True)
    turns = [("You are a coding agent. " * 40, "Fix the test."), ("You are a coding agent. " * 40, "Now run it."),
             ("You are a careful coding agent. " * 40, "Fix the test.")]
    try:
        calls = _counting(tokenizer)
        for system, user in turns:
            want = plain_cls._tokenize(plain_self, tokenizer, _request(system, user), args)
            before = len(calls)
            got = cls._tokenize(self, tokenizer, _request(system, user), args)
            assert got[:4] == want[:4]  # the same prompt, segments, segment types and state
            assert got[2] == ["system", "user"] and len(got[1][0]) > 100, got[2]
            renders = calls[before:]
            assert all(c["tokenize"] for c in renders), renders
            if (system, user) == turns[1]:  # the second turn of one system prompt: the prompt only
                assert [c["add_generation_prompt"] for c in renders] == [True], renders
            else:  # a system prompt not seen before: the prompt, then the probe
                assert [c["add_generation_prompt"] for c in renders] == [True, False], renders
    finally:
        del tokenizer.apply_chat_template
        system_render.forget()


def test_only_the_probe_is_remembered(tokenizer: Any) -> None:
    """A prompt render, a text render and another tokenizer's probe are never answered
    from what was remembered."""
    from kvstore.serve.system_render import Probed, forget

    forget()
    probe = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}]
    try:
        calls = _counting(tokenizer)
        first = Probed(tokenizer).apply_chat_template(probe, tokenize=True, add_generation_prompt=False)
        again = Probed(tokenizer).apply_chat_template(probe, tokenize=True, add_generation_prompt=False)
        assert again == first and again is not first and len(calls) == 1
        Probed(tokenizer).apply_chat_template(probe, tokenize=True, add_generation_prompt=True)
        Probed(tokenizer).apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
        assert len(calls) == 3
        other = types.SimpleNamespace(apply_chat_template=lambda messages, **kw: [1, 2, 3])
        assert Probed(other).apply_chat_template(probe, tokenize=True, add_generation_prompt=False) == [1, 2, 3]
        assert Probed(tokenizer).has_chat_template is tokenizer.has_chat_template
    finally:
        del tokenizer.apply_chat_template
        forget()


def test_one_callers_probe_never_answers_anothers() -> None:
    """A remembered probe is faster: it is kept per ``cache_salt``, so no caller learns by
    timing that another rendered the same system prompt."""
    from kvstore.serve import system_render

    calls: list[int] = []

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            calls.append(1)
            return [1, 2, 3]

    system_render.forget()
    tok = Tokenizer()
    probe = [{"role": "system", "content": "tools"}, {"role": "user", "content": ""}]
    kw = {"tokenize": True, "add_generation_prompt": False}
    for salt in ("tenant-a", "tenant-a", "tenant-b", None):
        system_render.Probed(tok, salt).apply_chat_template(probe, **kw)
    assert len(calls) == 3, calls  # a's second probe remembered; b's and the unsalted one rendered
    system_render.forget()
