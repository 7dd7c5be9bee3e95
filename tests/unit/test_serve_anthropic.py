"""kvstore.serve.anthropic: an Anthropic Messages body read as a chat request."""

from __future__ import annotations

from typing import Any

QUESTION = [{"role": "user", "content": "Which shelf holds the ledgers kept for five years?"}]


def test_thinking_types_map_to_the_templates_switch() -> None:
    """``adaptive`` turns the template's thinking switch on, as ``enabled`` does;
    ``budget_tokens`` is accepted (it cannot be enforced) and changes nothing rendered."""
    from kvstore.serve.anthropic import chat_request

    def switch(thinking: dict[str, Any]) -> Any:
        return chat_request({"max_tokens": 8, "messages": QUESTION, "thinking": thinking}, False)["chat_template_kwargs"]

    assert switch({"type": "adaptive"}) == switch({"type": "enabled", "budget_tokens": 1024}) == {"enable_thinking": True}
    assert switch({"type": "disabled"}) == {"enable_thinking": False}
