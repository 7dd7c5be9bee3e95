"""The coding-agent session ``benchmarks.agent_session`` plays: its system prompt, tools,
turns and the ways real clients vary them (``--vary``), with no server and no client.

``Session`` builds each turn's Anthropic Messages request and reads the reply back into the
history; ``benchmarks.responses_trace`` plays the same turns as Codex-shaped Responses
requests. Kept apart from the runner so both can import it.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("file module function test commit branch diff patch error trace import class value path "
          "config build lint format review index cache token buffer stream thread lock queue").split()


def _prose(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."


def tools(n: int = 8, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` client tool definitions the way Claude Code sends them (long descriptions)."""
    rng = random.Random(seed)
    names = ["Read", "Write", "Edit", "Bash", "Grep", "Glob", "TodoWrite", "WebFetch", "Task", "NotebookEdit"]
    out = []
    for i in range(n):
        props = {f"arg_{j}": {"type": "string", "description": _prose(rng, 12)} for j in range(4)}
        out.append({"name": names[i % len(names)] + ("" if i < len(names) else str(i)),
                    "description": " ".join(_prose(rng, 20) for _ in range(6)),
                    "input_schema": {"type": "object", "properties": props, "required": ["arg_0"]}})
    return out


def system_prompt(paragraphs: int, seed: int = 2) -> str:
    rng = random.Random(seed)
    head = "You are a coding agent. Use the tools to read, edit and test the code of the user's repository.\n"
    return head + "\n".join(f"Rule {i}: " + _prose(rng, 40) for i in range(paragraphs))


def billing_header(turn: int, rng: random.Random) -> dict[str, str]:
    """Claude Code's per-request first system block: a new ``cch`` on every request."""
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.{turn}.{rng.randrange(1000)}; "
                                    f"cc_entrypoint=cli; cch={rng.getrandbits(20):05x};"}


VARY = ("uuid", "date", "tools")  # what changes when the agent's client process starts again (--vary)


def client_epoch(system: str, tool_defs: list[dict[str, Any]], vary: tuple[str, ...],
                 epoch: int) -> tuple[str, list[dict[str, Any]]]:
    """(system text, tools) as the ``epoch``-th client process sends them: with "uuid" a
    session UUID in a path near the start of the system prompt, with "date" today's date
    at its end (a day later per epoch), with "tools" the tools in another order per
    process (as MCP servers connect); epoch 0 of each is fixed by the seed."""
    import datetime
    import uuid

    rng = random.Random(1000 + epoch)
    if "uuid" in vary:
        system = f"Session directory: /home/dev/.agent/sessions/{uuid.UUID(int=rng.getrandbits(128))}/\n" + system
    if "date" in vary:
        system += f"\nToday's date: {datetime.date(2026, 11, 25) + datetime.timedelta(days=epoch)}."
    if "tools" in vary:
        tool_defs = list(tool_defs)
        random.Random(2000 + epoch).shuffle(tool_defs)
    return system, tool_defs


class Session:
    """The request of each turn, built from the replies so far (the client's side).

    Turn kinds cycle: a user question (text), then a reply answered with a tool_use the agent
    made plus its tool_result, then a plain follow-up. The reply text the server gave is
    sent back as the assistant's text, as a client does. ``vary`` (of ``VARY``): what a new
    client process changes in the prompt (``client_epoch``), every ``vary_every`` turns."""

    def __init__(self, system: str, tool_defs: list[dict[str, Any]], max_tokens: int, seed: int = 3,
                 result_lines: int = 8, model: str = "local", vary: tuple[str, ...] = (),
                 vary_every: int = 0) -> None:
        self.system, self.tools, self.max_tokens, self.result_lines = system, tool_defs, max_tokens, result_lines
        self.model = model  # vllm-mlx answers 404 to any name but the served one
        self.vary, self.vary_every = vary, vary_every
        self.rng = random.Random(seed)
        self.messages: list[dict[str, Any]] = []
        self.turn = 0

    @property
    def epoch(self) -> int:
        """The client process the current turn is sent from (0: the first)."""
        return (self.turn - 1) // self.vary_every if self.vary and self.vary_every else 0

    def request(self) -> dict[str, Any]:
        self.turn += 1
        if not self.messages:
            self.messages.append({"role": "user", "content": "Fix the failing test in the " + _prose(self.rng, 8)})
        system, tool_defs = client_epoch(self.system, self.tools, self.vary, self.epoch)
        return {"model": self.model, "max_tokens": self.max_tokens, "tools": tool_defs,
                "system": [billing_header(self.turn, self.rng), {"type": "text", "text": system}],
                "messages": list(self.messages), "extra_body": {"temperature": 0}}

    def answer(self, content: list[dict[str, Any]]) -> None:
        """Record the reply of the current turn and add the user's next message."""
        text = "".join(b.get("text", "") for b in content if b.get("type") == "text")
        calls = [b for b in content if b.get("type") == "tool_use"]
        kind = self.turn % 3
        if kind == 1 and not calls:  # the agent decided to look at a file
            calls = [{"type": "tool_use", "id": f"toolu_{self.turn:03d}", "name": self.tools[0]["name"],
                      "input": {"arg_0": f"src/module_{self.turn}.py"}}]
        blocks: list[dict[str, Any]] = ([{"type": "text", "text": text}] if text else []) + [
            {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["input"]} for c in calls]
        self.messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "."}]})
        if calls:
            body = "\n".join(f"{n:4d}  " + _prose(self.rng, 10) for n in range(1, self.result_lines + 1))
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": c["id"], "content": body} for c in calls]})
        else:
            self.messages.append({"role": "user", "content": [{"type": "text", "text": _prose(self.rng, 15)}]})

    def record(self, row: dict[str, Any]) -> None:
        """Take the reply out of ``run_turn``'s row and answer it."""
        self.answer(row.pop("content"))
