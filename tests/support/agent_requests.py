"""The logged real agent requests of tests/data/agent_requests/ (``*_stable_*``: captured by
``tools/testing/capture_agent_requests.py`` from Claude Code 2.1.332 and OpenCode 1.18.33),
and the next-day, changed-work-tree requests made from them for ``--stable-prefix``.

Claude Code 2.1.332 sends its git-status snapshot as a reminder in the session's first user
turn and its environment (today's date) as a system message after it; ``--continue`` keeps
that first turn as stored and regenerates the environment message. The resumed request
here is the real ``--continue`` request with the first turn's git status as Claude Code
sent it on the changed tree (``claude_code_stable_changed_tree``: a client that
regenerates it) and the next day's date (the one edit: the clock was not moved).

``nextday_<cli>_<step>`` are real, unedited: each step's conversation request of
``python -m tools.gates.agent_clis run CLI --scenario nextday`` (the clock moved a day on by
libfaketime or a time zone, the tree changed overnight; ``usage``: what kvstore serve read
from the cache with its default settings), for every pin; ``claude_code_2_1_197_*``
captured as the ``*_stable_*`` ones (``capture_agent_requests --drive``)."""

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
    """``body`` as a test posts it to ``kvstore serve``: to the model it serves, greedy,
    ``max_tokens`` tokens, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "thinking",
                                                      "context_management", "output_config")}
    return {**out, "model": "default_model", "max_tokens": max_tokens, "temperature": 0, "stream": False}


LONG = 1500  # characters: a longer text is cut by ``shortened``


def _cut(text: str) -> str:
    """A text over ``LONG`` characters as its first 12 and last 4 lines and the lines of
    and around (2 either side) each volatile span, runs left out shown as "[...]", lines
    cut to 240 characters: the same cut for the same text, the spans kept whole."""
    if len(text) <= LONG:
        return text
    from kvstore.serve.stable_prefix import BUILTIN

    lines = text.split("\n")
    keep = set(range(12)) | set(range(len(lines) - 4, len(lines)))
    for rule in BUILTIN:
        for m in rule.pattern.finditer(text):
            a, b = text.count("\n", 0, m.start()), text.count("\n", 0, m.end())
            keep |= set(range(a - 2, b + 3))
    out, gap = [], False
    for k, line in enumerate(lines):
        if k in keep:
            out.append(line[:240])
            gap = False
        elif not gap:
            out.append("[...]")
            gap = True
    return "\n".join(out)


def shortened(body: dict[str, Any], tools: int = 3) -> dict[str, Any]:
    """``body`` with its long texts cut (``_cut``) and its first ``tools`` tools only
    (descriptions cut to 240 characters): the message structure and the volatile spans as
    sent, at a size a CPU prefills in seconds (Claude Code's 50k-character request is a
    ten-minute prefill on a loaded 2-core VM)."""
    out = copy.deepcopy(body)
    if isinstance(out.get("system"), list):
        for block in out["system"]:
            block["text"] = _cut(block["text"])
    for m in out["messages"]:
        if isinstance(m["content"], str):
            m["content"] = _cut(m["content"])
        else:
            for block in m["content"]:
                if isinstance(block.get("text"), str):
                    block["text"] = _cut(block["text"])
    out["tools"] = out.get("tools", [])[:tools]
    for t in out["tools"]:
        fn = t.get("function", t)
        fn["description"] = str(fn.get("description", ""))[:240]
    return out
