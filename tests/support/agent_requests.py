"""The logged real agent requests of tests/data/agent_requests/ (``*_stable_*``: captured by
``tools/testing/capture_agent_requests.py`` from Claude Code 2.1.332 and OpenCode 1.18.33),
and the next-day, changed-work-tree requests made from them for ``--stable-prefix``.

Claude Code 2.1.332 sends its git-status snapshot as a reminder in the session's first user
turn and its environment (today's date) as a system message after it; ``--continue`` keeps
that first turn as stored and regenerates the environment message. The resumed request
here is the real ``--continue`` request with the first turn's git status as Claude Code
sent it on the changed tree (``claude_code_stable_changed_tree``: a client that
regenerates it) and the next day's date (the one edit: the clock was not moved)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[1] / "data" / "agent_requests"
CC_DAY, CC_NEXT = "Today's date is 2026-11-28.", "Today's date is 2026-11-29."
OC_DAY, OC_NEXT = "Today's date: Sat Nov 28 2026", "Today's date: Sun Nov 29 2026"
CHANGED_STATUS = "Status:\n M app.py\n?? TODO.md\n"


def body(name: str) -> dict[str, Any]:
    """The request body logged as ``name`` (e.g. ``claude_code_stable_first``)."""
    return dict(json.loads((DATA / f"{name}.json").read_text())["body"])


def _dated(text: str, day: str, nxt: str) -> str:
    assert day in text, day
    return text.replace(day, nxt)


def claude_code_resumed() -> dict[str, Any]:
    """The ``--continue`` request on the changed tree, the next day (see the module)."""
    resumed = copy.deepcopy(body("claude_code_stable_continue"))
    resumed["messages"][0] = copy.deepcopy(body("claude_code_stable_changed_tree")["messages"][0])
    env = resumed["messages"][1]
    env["content"] = _dated(env["content"], CC_DAY, CC_NEXT)
    return resumed


def opencode_resumed() -> dict[str, Any]:
    """``opencode run --continue``'s request the next day (its date line moved on)."""
    resumed = copy.deepcopy(body("opencode_stable_continue"))
    resumed["messages"][0]["content"] = _dated(resumed["messages"][0]["content"], OC_DAY, OC_NEXT)
    return resumed


def served(body: dict[str, Any], max_tokens: int = 1) -> dict[str, Any]:
    """``body`` as a test posts it: greedy, ``max_tokens`` tokens, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "thinking",
                                                      "context_management", "output_config")}
    return {**out, "max_tokens": max_tokens, "temperature": 0, "stream": False}
