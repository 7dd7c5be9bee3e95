"""kvstore.serve.context: one request's facts ride with its request and its tokens, never
with a thread (issue 53 item 3)."""

from __future__ import annotations

import pickle
import threading
import types
from typing import Any

import pytest

from kvstore.salt import SaltedTokens, salt_of
from kvstore.serve import context


class Generator:
    """Stands in for the server's generator: keeps what ``generate`` queued."""

    cli_args = "the server's"

    def __init__(self) -> None:
        self.queued: list[Any] = []

    def generate(self, request: Any, args: Any, progress_callback: Any = None) -> Any:
        self.queued.append((request, args, progress_callback))
        return "ctx", iter(())


def test_a_requests_view_attaches_its_context_to_what_it_queues() -> None:
    generator = Generator()
    ctx = context.RequestContext(salt="tenant-a")
    view = context.RequestView(generator, ctx)
    request = types.SimpleNamespace(messages=[])
    assert view.generate(request, "args", progress_callback=print)[0] == "ctx"
    queued, args, progress = generator.queued[0]
    assert queued is request and context.of(queued) is ctx and (args, progress) == ("args", print)
    assert view.cli_args == "the server's"  # everything else is the generator's own
    other = context.RequestContext(salt="tenant-b")
    context.RequestView(generator, other).generate(request, "args")
    assert context.of(request) is ctx  # one it carries already stays
    assert context.of(types.SimpleNamespace()).salt is None  # a request no handler made: no salt


def test_a_request_that_cannot_carry_its_context_is_refused() -> None:
    with pytest.raises(RuntimeError, match="cannot carry"):
        context.attach(("a", "tuple"), context.RequestContext(salt="s"))


def test_the_tokens_carry_the_context_to_the_lookup_on_any_thread() -> None:
    """What the prompt cache's lookup reads (``name_part`` / ``miss_note``) comes from the
    tokens it is handed, whichever thread looks them up; slices are plain salted lists."""
    moved = types.SimpleNamespace(describe=lambda: "the date moved")
    named: list[Any] = []
    ctx = context.RequestContext(salt="tenant-a", moved=moved)
    ctx.rendered = types.SimpleNamespace(n=3, tail=(1, 2, 3), name=lambda tokens: named.append(list(tokens)) or "namer")
    tokens = context.RequestTokens([1, 2, 3], ctx)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.extend([context.miss_note(tokens), context.name_part(tokens)]))
    thread.start()
    thread.join()
    assert got == ["; the date moved", "namer"] and named == [[1, 2, 3]]
    assert salt_of(tokens) == "tenant-a" and type(tokens[1:]) is SaltedTokens and salt_of(tokens[1:]) == "tenant-a"
    assert context.name_part(context.RequestTokens([9, 9], ctx)) is None  # not the rendered prompt
    assert context.miss_note([1, 2, 3]) == "" and context.name_part([1, 2, 3]) is None  # no context: nothing
    assert context.miss_note(context.RequestTokens([1], context.RequestContext())) == ""
    back = pickle.loads(pickle.dumps(tokens))
    assert type(back) is SaltedTokens and back == [1, 2, 3] and salt_of(back) == "tenant-a"
    assert pickle.loads(pickle.dumps(ctx)) == context.RequestContext(salt="tenant-a")  # the salt only
