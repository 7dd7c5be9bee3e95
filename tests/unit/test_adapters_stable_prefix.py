"""kvstore.adapters.stable_prefix: each built-in rule on a logged real request, and the
rewrite's guarantees (no model, no server: tests/system/test_stable_prefix.py has those)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvstore.adapters import anthropic
from kvstore.adapters import stable_prefix as sp
from kvstore.salt import salt_key
from tests.support import agent_requests as agents
from tests.support.agent_requests import CC_DAY, CC_NEXT, CHANGED_STATUS, OC_DAY, OC_NEXT


def chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages ``kvstore serve`` renders for a logged body (either API)."""
    if "system" in body:
        return anthropic.chat_request({**body, "max_tokens": 1}, False)["messages"]
    return copy.deepcopy(body["messages"])


def test_date_rule_on_claude_code_environment_message() -> None:
    """Claude Code 2.1.332 sends today's date at the end of its environment system message,
    after the session's first user turn."""
    messages = chat(agents.body("claude_code_stable_first"))
    dates = [s for s in sp.find_spans(messages, sp.BUILTIN) if s.rule == "date"]
    assert [(s.message, s.text) for s in dates] == [(2, CC_DAY)]
    assert messages[2]["role"] == "system" and messages[2]["content"].startswith("# Environment")


def test_git_status_rule_on_claude_code_first_turn() -> None:
    """The git-status snapshot, in the first user turn's reminder: from its header through
    the last commit line, on the clean tree and on the changed one."""
    for name, status in (("claude_code_stable_first", "Status:\n(clean)\n"),
                         ("claude_code_stable_changed_tree", CHANGED_STATUS)):
        messages = chat(agents.body(name))
        [span] = [s for s in sp.find_spans(messages, sp.BUILTIN) if s.rule == "git-status"]
        assert span.message == 1 and messages[1]["role"] == "user"
        assert span.text.startswith("# gitStatus\nThis is the git status at the start of the conversation.")
        assert status in span.text and span.text.endswith("a64c461 first commit: the shelf app\n"), span.text
        assert "Claude Code attached this context" not in span.text


def test_date_rule_on_opencode_system_prompt() -> None:
    messages = chat(agents.body("opencode_stable_first"))
    assert [(s.message, s.rule, s.text) for s in sp.find_spans(messages, sp.BUILTIN)] == [(0, "date", OC_DAY)]


def test_codex_date_rule_on_codex_environment_context() -> None:
    """Codex CLI 0.171.0 sends today's date in the <environment_context> of its first user
    message (after the developer messages and tools), rendered through /v1/responses."""
    from kvstore.adapters import responses

    body = agents.body("codex")
    messages = responses.chat_request(responses.check_body(body), [])[0]["messages"]
    spans = sp.find_spans(messages, sp.BUILTIN)
    assert [(s.rule, s.text) for s in spans] == [("codex-date", "<current_date>2026-11-28</current_date>")]
    assert messages[spans[0].message]["role"] == "user"


def test_claude_code_mid_conversation_system_message_is_accepted() -> None:
    """Claude Code 2.1.332 sends its environment as a system-role message after the first
    user turn: /v1/messages renders it as a chat system message (main answered 400:
    "messages[1]: role must be 'user' or 'assistant'")."""
    body = agents.body("claude_code_stable_first")
    assert body["messages"][1]["role"] == "system"
    messages = chat(body)
    assert [m["role"] for m in messages] == ["system", "user", "system"]
    assert messages[2]["content"] == body["messages"][1]["content"][0]["text"]
    with pytest.raises(anthropic.RequestError, match=r"messages\[0\]: role must be 'user', 'assistant' or 'system'"):
        anthropic.chat_request({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, False)


def test_first_request_is_unchanged_and_a_resumed_one_keeps_its_first_values(tmp_path) -> None:
    """Claude Code: the first request renders as sent; the resumed one (changed tree, next
    day, a new Memory on the same directory: a restart) keeps the first request's messages
    byte for byte and carries today's git status and date in one update just before its
    latest user turn, which stays there on the next turn."""
    first = chat(agents.body("claude_code_stable_first"))
    got, moved = sp.stabilize(first, sp.BUILTIN, sp.Memory(tmp_path))
    assert got is first and moved is None
    assert len(list((tmp_path / sp.DIRECTORY).iterdir())) == 1

    resumed = chat(agents.claude_code_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, sp.Memory(tmp_path))
    assert moved is not None and moved.recorded
    assert got[:3] == first and got[3] == resumed[3]  # system, first turn, environment, the answer
    assert [m["role"] for m in got] == ["system", "user", "system", "assistant", "system", "user"]
    update = got[4]["content"]
    assert update.startswith(sp.UPDATE_HEAD) and CHANGED_STATUS in update and CC_NEXT in update
    assert got[5] == resumed[4] and moved.updates == (4,)
    said = moved.describe()
    assert 'git-status "(clean)" kept in place, " M app.py" in the update' in said, said
    assert f'date "{CC_DAY}" kept in place, "{CC_NEXT}" in the update' in said and "before message 4" in said

    later = resumed + [{"role": "assistant", "content": "It says: shelf."},
                       {"role": "user", "content": "Thanks. Anything else?"}]
    again, moved2 = sp.stabilize(later, sp.BUILTIN, sp.Memory(tmp_path))
    assert moved2 is not None and not moved2.recorded
    assert again[:len(got)] == got and again[len(got):] == later[len(resumed):]  # the update did not move


def test_an_update_goes_inside_the_user_turn_for_a_system_first_template() -> None:
    memory = sp.Memory(None)
    sp.stabilize(chat(agents.body("opencode_stable_first")), sp.BUILTIN, memory)
    resumed = chat(agents.opencode_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory, inline=True)
    assert moved is not None and moved.inline and len(got) == len(resumed)
    assert OC_DAY in got[0]["content"] and OC_NEXT not in got[0]["content"]
    assert got[1:3] == resumed[1:3]
    assert got[3]["content"].startswith(sp.UPDATE_HEAD) and got[3]["content"].endswith(resumed[3]["content"])
    assert OC_NEXT in got[3]["content"]


def test_nothing_after_an_assistant_turn_or_tool_result_is_read_or_moved() -> None:
    """A date in a tool result or a later user turn is no span; a session whose spans have
    no user turn after them (today's values could not come last) renders as sent."""
    memory = sp.Memory(None)
    head = [{"role": "system", "content": f"Agent.\n{OC_DAY}\n"}, {"role": "user", "content": "Hi"}]
    sp.stabilize(head, sp.BUILTIN, memory)
    tail = [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
             "function": {"name": "date", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": OC_NEXT},
            {"role": "user", "content": f"{OC_NEXT} -- so?"}]
    messages = [{"role": "system", "content": f"Agent.\n{OC_NEXT}\n"}, head[1], *tail]
    got, moved = sp.stabilize(messages, sp.BUILTIN, memory)
    assert [s.message for s in sp.find_spans(messages, sp.BUILTIN)] == [0]
    assert moved is not None and got[2:4] == tail[:2] and got[-1] == tail[-1]
    assert got[-2]["role"] == "system" and OC_NEXT in got[-2]["content"]

    fresh = sp.Memory(None)
    only = [{"role": "user", "content": "Hi"}, {"role": "system", "content": OC_DAY}]
    sp.stabilize(only, sp.BUILTIN, fresh)
    changed = [only[0], {"role": "system", "content": OC_NEXT}]
    got, moved = sp.stabilize(changed, sp.BUILTIN, fresh)
    assert got is changed and moved is None


def test_records_are_per_tenant(tmp_path) -> None:
    """Another salt finds no record: its first request renders as sent, never with the
    values another tenant's session began with."""
    memory = sp.Memory(tmp_path)
    sp.stabilize(chat(agents.body("opencode_stable_first")), sp.BUILTIN, memory, salt_key=salt_key("tenant-a"))
    resumed = chat(agents.opencode_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory, salt_key=salt_key("tenant-b"))
    assert got is resumed and moved is None
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory, salt_key=salt_key("tenant-a"))
    assert moved is not None and OC_DAY in got[0]["content"]


def test_a_damaged_record_is_no_record(tmp_path) -> None:
    memory = sp.Memory(tmp_path)
    first = chat(agents.body("opencode_stable_first"))
    sp.stabilize(first, sp.BUILTIN, memory)
    [rec] = list((tmp_path / sp.DIRECTORY).iterdir())
    rec.write_text('{"began": [1]}')
    resumed = chat(agents.opencode_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory)
    assert got is resumed and moved is None  # as sent; the record is made again from it
    assert json.loads(rec.read_text())["began"] == [OC_NEXT]


def test_user_rules_and_a_bad_one() -> None:
    rules = sp.user_rules([r"Build id: \w+"])
    memory = sp.Memory(None)
    a = [{"role": "system", "content": "Agent. Build id: a1"}, {"role": "user", "content": "Hi"}]
    sp.stabilize(a, rules, memory)
    b = [{"role": "system", "content": "Agent. Build id: b2"}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Build it."}]
    got, moved = sp.stabilize(b, rules, memory)
    assert moved is not None and got[0]["content"] == "Agent. Build id: a1" and "Build id: b2" in got[3]["content"]
    with pytest.raises(ValueError, match=r"--volatile '\(' is not a regular expression"):
        sp.user_rules(["("])
