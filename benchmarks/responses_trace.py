"""The agent session's trace as Codex CLI sends it: the OpenAI Responses API (``--api responses``).

``ResponsesSession`` plays ``agent_session.Session``'s turns (same prompts, same replies
sent back) in the shape Codex CLI 0.171 logged: ``POST /v1/responses``, ``stream: true``,
the system prompt as two ``developer`` messages of ``input_text`` parts, an environment
message, then the conversation as items (``message``, ``function_call``,
``function_call_output``); tools flat (``{type: "function", name, parameters}``), the last
two grouped in a ``namespace``, plus a hosted ``{type: "web_search"}``; ``tool_choice:
"auto"``, ``parallel_tool_calls``, ``reasoning: {summary: "auto"}``, ``include``, a fixed
``prompt_cache_key``, a ``client_metadata`` that changes every turn; ``store: false`` and
the whole history resent every turn. Unlike Codex it sends ``max_output_tokens`` (the
trace's ``--max-tokens``), so every server generates as much.

``chain=True``: ``store: true`` and, after the first turn, ``previous_response_id`` with only
the new items (what a stateful Responses client sends): the server must still hold the
conversation, also after a restart.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.agent_trace import Session

PERMISSIONS = ("<permissions instructions>Filesystem sandboxing: workspace-write. Approval policy: on-request."
               "</permissions instructions>")
ENVIRONMENT = "<environment_context>\n  <cwd>/home/dev/repo</cwd>\n  <shell>bash</shell>\n</environment_context>"
STREAMED = ("response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta")


def codex_tools(tool_defs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic tool definitions as Codex sends tools: flat functions, the last two in a
    namespace, then the hosted web_search."""
    flat = [{"type": "function", "name": t["name"], "description": t["description"], "strict": False,
             "parameters": t["input_schema"]} for t in tool_defs]
    grouped = [{"type": "namespace", "name": "mcp__repo", "description": "Repository tools.", "tools": flat[-2:]}] \
        if len(flat) > 2 else []
    return [*flat[:len(flat) - len(grouped) * 2], *grouped, {"type": "web_search"}]


def items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic Messages turns as Responses input items."""
    out: list[dict[str, Any]] = []
    for m in messages:
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        for b in blocks:
            if b["type"] == "text":
                kind = "input_text" if m["role"] == "user" else "output_text"
                out.append({"type": "message", "role": m["role"], "content": [{"type": kind, "text": b["text"]}]})
            elif b["type"] == "tool_use":
                out.append({"type": "function_call", "call_id": b["id"], "name": b["name"],
                            "arguments": json.dumps(b["input"])})
            elif b["type"] == "tool_result":
                out.append({"type": "function_call_output", "call_id": b["tool_use_id"], "output": b["content"]})
    return out


def blocks(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the Anthropic content blocks ``Session.answer`` reads."""
    out: list[dict[str, Any]] = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(c.get("text", "") for c in item.get("content") or [] if c.get("type") == "output_text")
            if text:
                out.append({"type": "text", "text": text})
        elif item.get("type") == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except ValueError:
                args = {}
            out.append({"type": "tool_use", "id": item["call_id"], "name": item["name"],
                        "input": args if isinstance(args, dict) else {}})
    return out


class ResponsesSession(Session):
    """``Session``'s turns as Codex-shaped Responses requests (see the module docstring)."""

    def __init__(self, *args: Any, chain: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chain = chain
        self.previous: str | None = None  # chain: the last response's id
        self.new_items: list[dict[str, Any]] = []  # chain: what the server has not seen

    def request(self) -> dict[str, Any]:
        req = super().request()
        system = req["system"][-1]["text"]  # Codex sends no billing header
        head = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": system}]},
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": PERMISSIONS}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ENVIRONMENT}]}]
        body: dict[str, Any] = {
            "model": req["model"], "stream": True, "store": self.chain, "tools": codex_tools(req["tools"]),
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
            "client_metadata": {"turn_id": f"turn-{self.turn}-{time.time_ns()}", "sent_at": time.time()},
            "max_output_tokens": self.max_tokens, "temperature": 0,
            "input": [*head, *items(self.messages)]}
        if self.chain and self.previous:
            body["previous_response_id"], body["input"] = self.previous, self.new_items
        return body

    def record(self, row: dict[str, Any]) -> None:
        self.answer_response(row.pop("response"))

    def answer_response(self, response: dict[str, Any]) -> None:
        """Record a response (its output items) and the user's next items."""
        before = len(self.messages)
        got = blocks(response.get("output") or [])
        self.answer(got)
        self.previous = response.get("id") if response.get("status") != "failed" else None
        # chain: the next request carries what the server's stored output lacks (a call the
        # trace adds when the model made none) and the user's next message
        made = {b["id"] for b in got if b["type"] == "tool_use"}
        assistant, *rest = self.messages[before:]
        added = [b for b in assistant["content"] if b["type"] == "tool_use" and b["id"] not in made]
        self.new_items = items([{"role": "assistant", "content": added}, *rest])


def run_turn(client: Any, req: dict[str, Any]) -> dict[str, Any]:
    """One streamed Responses request through the ``openai`` SDK: TTFT (to the first
    output delta), usage, and the response (``"response"``); an error answer is a row
    with ``error`` (a server that lost a ``previous_response_id``)."""
    import openai

    t0 = time.perf_counter()
    ttft = None
    final: dict[str, Any] = {"output": [], "status": "failed"}
    error = None
    fields = {k: v for k, v in req.items() if k not in ("model", "input", "stream")}
    try:
        for event in client.responses.create(model=req["model"], input=req["input"], stream=True, extra_body=fields):
            if ttft is None and event.type in STREAMED:
                ttft = time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                final = event.response.model_dump(exclude_none=True)
    except openai.APIError as e:
        error = f"{type(e).__name__}: {e}"
    total = time.perf_counter() - t0
    u = final.get("usage") or {}
    prompt = int(u.get("input_tokens") or 0)
    cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "prompt_tokens": prompt,
            "input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": int(u.get("output_tokens") or 0), "stop_reason": final.get("status"),
            "read_share": cached / max(prompt, 1), "error": error, "response": final}
