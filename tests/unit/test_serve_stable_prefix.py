"""kvstore.serve.stable_prefix: each built-in rule on a logged real request, and the
rewrite's guarantees (no model, no server: tests/system/test_stable_prefix.py has those)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvstore.serve import anthropic
from kvstore.serve import stable_prefix as sp
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


def test_git_status_and_date_rules_on_claude_code_2_1_197() -> None:
    """Claude Code 2.1.197 (one minor version back) ends its system text with
    ``gitStatus: This is the git status ...`` (fields between blank lines, no trailing
    newline) before ~17k tokens of tools, and dates its first user turn: both are spans, on
    the clean tree, the changed one and the next day's new session, and moved they leave
    the system text the same string on both days of one work tree."""
    systems = set()
    for name, status in (("claude_code_2_1_197_first", "Status:\n(clean)\n"),
                         ("claude_code_2_1_197_changed_tree", "Status:\nM app.py\n?? TODO.md\n"),
                         ("nextday_claude_2_1_197_day1_first", "Status:\n(clean)\n"),
                         ("nextday_claude_2_1_197_day2_new", "Status:\nM app.py\n?? TODO.md\n")):
        messages = chat(agents.body(name))
        spans = sp.find_spans(messages, sp.BUILTIN)
        assert [(s.message, s.rule) for s in spans] == [(0, "git-status"), (1, "date")], spans
        git = spans[0]
        assert git.text.startswith("gitStatus: This is the git status at the start of the conversation.")
        assert status in git.text and git.end == len(messages[0]["content"]), git.text[-200:]
        assert "Recent commits:\n" in git.text and spans[1].text.startswith("Today's date is 2026-12-0")
        got, moved = sp.stabilize(messages, sp.BUILTIN, sp.Memory(None, learn=False))
        assert moved is not None and "gitStatus" not in got[0]["content"]
        if name.startswith("nextday"):
            systems.add(got[0]["content"])
    assert len(systems) == 1


def test_date_rule_on_opencode_system_prompt() -> None:
    messages = chat(agents.body("opencode_stable_first"))
    assert [(s.message, s.rule, s.text) for s in sp.find_spans(messages, sp.BUILTIN)] == [(0, "date", OC_DAY)]


def test_codex_date_rule_on_codex_environment_context() -> None:
    """Codex CLI 0.171.0 sends today's date in the <environment_context> of its first user
    message (after the developer messages and tools), rendered through /v1/responses."""
    from kvstore.serve import responses

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


def _moved_block(message: dict[str, Any]) -> str:
    """The text ``stabilize`` appended to ``message`` (the opening's last): its last part,
    or what follows its last blank line."""
    content = message["content"]
    return content[-1]["text"] if isinstance(content, list) else content


def test_spans_move_to_the_end_of_the_opening_and_a_resumed_request_keeps_its_first_values(tmp_path) -> None:
    """Claude Code: the first request's git status (first user turn) and date (the
    environment message after it) leave their places and end the opening (its last message,
    the environment), with the values the conversation began with; the resumed one (changed
    tree, next day, a new Memory on the same directory: a restart) renders its opening
    exactly as the first did and carries today's git status and date in one update just
    before its latest user turn, which stays there on the next turn."""
    first = chat(agents.body("claude_code_stable_first"))
    got, moved = sp.stabilize(first, sp.BUILTIN, sp.Memory(tmp_path))
    assert moved is not None and moved.home == 2 and not moved.updates
    assert "gitStatus" not in json.dumps(got[1]) and CC_DAY not in got[2]["content"][:-200]
    block = got[2]["content"]
    assert block.endswith("\n\n" + sp.block_text([s.text for s in sp.find_spans(first, sp.BUILTIN)]))
    assert got[0] == first[0] and len(got) == len(first)
    assert len([p for p in (tmp_path / sp.DIRECTORY).iterdir()]) >= 1

    resumed = chat(agents.claude_code_resumed())
    again, moved = sp.stabilize(resumed, sp.BUILTIN, sp.Memory(tmp_path))
    assert moved is not None and moved.recorded
    assert again[:3] == got and again[3] == resumed[3]  # system, first turn, environment, the answer
    assert [m["role"] for m in again] == ["system", "user", "system", "assistant", "system", "user"]
    update = again[4]["content"]
    assert update.startswith(sp.UPDATE_HEAD) and CHANGED_STATUS in update and CC_NEXT in update
    assert again[5] == resumed[4] and moved.updates == (4,)
    said = moved.describe()
    assert said.startswith("--stable-prefix: git-status, date moved to the end of message 2;"), said
    assert 'git-status "(clean)" kept, " M app.py" in the update' in said, said
    assert f'date "{CC_DAY}" kept, "{CC_NEXT}" in the update' in said and "before message 4" in said

    later = resumed + [{"role": "assistant", "content": "It says: shelf."},
                       {"role": "user", "content": "Thanks. Anything else?"}]
    third, moved2 = sp.stabilize(later, sp.BUILTIN, sp.Memory(tmp_path))
    assert moved2 is not None and not moved2.recorded
    assert third[:len(again)] == again and third[len(again):] == later[len(resumed):]  # the update did not move


def test_a_new_session_renders_system_prompt_and_tools_as_every_other(tmp_path) -> None:
    """OpenCode's date sits in its system prompt, before ~6k tokens of tools: moved, the
    system message of a session begun on another day is the same string, so the system
    prompt and tools share one cached prefix; each session's block holds its own date."""
    memory = sp.Memory(tmp_path)
    day1 = chat(agents.body("opencode_stable_first"))
    day2 = copy.deepcopy(day1)
    day2[0]["content"] = day2[0]["content"].replace(OC_DAY, OC_NEXT)
    a, _ = sp.stabilize(day1, sp.BUILTIN, memory)
    b, moved = sp.stabilize(day2, sp.BUILTIN, memory)
    assert a[0] == b[0] and OC_DAY not in a[0]["content"] and OC_NEXT not in b[0]["content"]
    assert moved is not None and moved.home == len(day2) - 1
    assert _moved_block(a[-1]).endswith(OC_DAY) and _moved_block(b[-1]).endswith(OC_NEXT)


def test_an_update_goes_inside_the_user_turn_for_a_system_first_template() -> None:
    memory = sp.Memory(None)
    first, _ = sp.stabilize(chat(agents.body("opencode_stable_first")), sp.BUILTIN, memory)
    resumed = chat(agents.opencode_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory, inline=True)
    assert moved is not None and moved.inline and len(got) == len(resumed)
    assert got[:2] == first and OC_DAY not in got[0]["content"] and OC_DAY in _moved_block(got[1])
    assert got[2] == resumed[2]
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

    fresh = sp.Memory(None)  # no user turn after the opening to carry a new value: its own values, moved
    only = [{"role": "user", "content": "Hi"}, {"role": "system", "content": OC_DAY}]
    sp.stabilize(only, sp.BUILTIN, fresh)
    changed = [only[0], {"role": "system", "content": OC_NEXT}, {"role": "assistant", "content": "ok"}]
    got, moved = sp.stabilize(changed, sp.BUILTIN, fresh)
    assert moved is not None and got[1]["content"] == OC_NEXT and got[2] == changed[2] and not moved.updates


def test_records_are_per_tenant(tmp_path) -> None:
    """Another salt finds no record: its request is rendered with its own values, never
    with the values another tenant's session began with."""
    memory = sp.Memory(tmp_path)
    sp.stabilize(chat(agents.body("opencode_stable_first")), sp.BUILTIN, memory, salt_key=salt_key("tenant-a"))
    resumed = chat(agents.opencode_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory, salt_key=salt_key("tenant-b"))
    assert moved is not None and OC_NEXT in _moved_block(got[1]) and OC_DAY not in json.dumps(got)
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory, salt_key=salt_key("tenant-a"))
    assert moved is not None and OC_DAY in _moved_block(got[1])


def test_a_damaged_record_is_no_record(tmp_path) -> None:
    memory = sp.Memory(tmp_path, learn=False)
    first = chat(agents.body("opencode_stable_first"))
    sp.stabilize(first, sp.BUILTIN, memory)
    [rec] = list((tmp_path / sp.DIRECTORY).iterdir())
    rec.write_text('{"began": [1]}')
    resumed = chat(agents.opencode_resumed())
    got, moved = sp.stabilize(resumed, sp.BUILTIN, memory)
    assert moved is not None and not moved.updates and OC_NEXT in _moved_block(got[1])  # its own values
    assert rec.read_text() == '{"began": [1]}'  # never made from a later request: today's are no first values
    sp.stabilize(first, sp.BUILTIN, memory)  # a first request makes it again
    assert json.loads(rec.read_text())["began"] == [OC_DAY]


def test_user_rules_and_a_bad_one() -> None:
    rules = sp.user_rules([r"Build id: \w+"])
    memory = sp.Memory(None)
    a = [{"role": "system", "content": "Agent. Build id: a1"}, {"role": "user", "content": "Hi"}]
    sp.stabilize(a, rules, memory)
    b = [{"role": "system", "content": "Agent. Build id: b2"}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Build it."}]
    got, moved = sp.stabilize(b, rules, memory)
    assert moved is not None and got[0]["content"] == "Agent. " and got[1]["content"] == "Hi\n\nBuild id: a1"
    assert "Build id: b2" in got[3]["content"]
    with pytest.raises(ValueError, match=r"--volatile '\(' is not a regular expression"):
        sp.user_rules(["("])


# -- issue 52.2: every span search linear and bounded ---------------------------------------------


class Counting:
    """A rule's pattern that counts the characters it is given to search (then searches)."""

    def __init__(self, pattern: Any) -> None:
        self.pattern, self.seen = pattern, []

    def finditer(self, text: str, *bounds: int) -> Any:
        self.seen.append(min(len(text), bounds[1]) if len(bounds) > 1 else len(text))
        return self.pattern.finditer(text, *bounds)


def test_rules_search_a_bounded_window_of_each_request() -> None:
    """However long a client's messages, each rule is given at most ``SCAN_CHARS`` of one
    text and ``SCAN_TOTAL`` of a request (main: the whole 4 MB, 1 MB per message); a span
    inside the window is still found, one beyond it is plain text."""
    rules = [sp.Rule(r.name, Counting(r.pattern)) for r in sp.BUILTIN]
    big = "x" * (1 << 20)
    messages = [{"role": "system", "content": f"Agent.\n{OC_DAY}\n{big}{OC_NEXT}\n"},
                *({"role": "user", "content": big} for _ in range(3))]
    spans = sp.find_spans(messages, rules)
    assert [s.text for s in spans] == [OC_DAY]
    for r in rules:
        assert max(r.pattern.seen) <= sp.SCAN_CHARS and sum(r.pattern.seen) <= sp.SCAN_TOTAL, r.pattern.seen


def test_every_rule_runs_in_re2_and_an_adversarial_megabyte_is_plain_text() -> None:
    """The built-in rules and every --volatile pattern are RE2 (linear in the text: the
    git-status rule was quadratic in Python's re, 552 KB 15.6 s); a megabyte of git-status
    headers without a commit list, in one message and split over many, finds no span and
    renders as sent."""
    import re2

    kind = type(re2.compile("a"))
    assert all(isinstance(r.pattern, kind) for r in sp.BUILTIN + sp.user_rules([r"Build \w+"]))
    header = "# gitStatus\nThis is the git status at the start of the conversation.\n"
    text = header * ((1 << 20) // len(header))
    for messages in ([{"role": "user", "content": text}],
                     [{"role": "user", "content": [{"type": "text", "text": header * 500}] * 40}]):
        assert sp.find_spans(messages, sp.BUILTIN) == []
        got, moved = sp.stabilize(messages, sp.BUILTIN, sp.Memory(None))
        assert got is messages and moved is None


@pytest.mark.parametrize("pattern,why", [(r"(a)\1", "invalid escape sequence"), (r"a(?=b)", "invalid perl operator"),
                                         (r"(?<!x)y", "invalid perl operator")])
def test_a_pattern_re2_cannot_run_is_refused_saying_why(pattern, why) -> None:
    with pytest.raises(ValueError) as e:
        sp.user_rules(["fine", pattern])
    said = str(e.value)
    assert said.startswith(f"--volatile {pattern!r} cannot be searched in linear time") and why in said, said
    assert "backreferences" in said and "lookaround" in said


def test_a_span_cut_by_the_window_or_too_long_is_not_kept(tmp_path) -> None:
    """A match the window cuts is dropped (its value would be a piece); a span longer than
    ``MAX_VALUE`` makes the request render as sent, nothing recorded."""
    cut = "y" * (sp.SCAN_CHARS - len(OC_DAY) + 3) + OC_DAY + " and more"
    assert sp.find_spans([{"role": "system", "content": cut}], sp.BUILTIN) == []
    long = [{"role": "system", "content": f"{OC_DAY}{'z' * sp.MAX_VALUE}\n"}, {"role": "user", "content": "Hi"}]
    assert len(sp.find_spans(long, sp.BUILTIN)[0].text) > sp.MAX_VALUE
    memory = sp.Memory(tmp_path, learn=False)
    got, moved = sp.stabilize(long, sp.BUILTIN, memory)
    assert got is long and moved is None and not (tmp_path / sp.DIRECTORY).exists()


# -- issue 52.3: a record per conversation --------------------------------------------------------


def _opening(day: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"You are an agent.\n<env>\n  {day}\n</env>\n"},
            {"role": "user", "content": question}]


def _later(day: str, question: str, answer: str, follow: str) -> list[dict[str, Any]]:
    return [*_opening(day, question), {"role": "assistant", "content": answer}, {"role": "user", "content": follow}]


def test_a_new_conversation_gets_only_its_own_values(tmp_path) -> None:
    """Conversation A on day 1, then conversation B on day 2 under the same system prompt
    (another first question): B is rendered with its own date only (main before issue 52:
    A's date and "The environment changed"); B's next turn keeps B's date; A resumed on
    day 2 still keeps A's first date, today's in the update."""
    memory = sp.Memory(tmp_path, learn=False)
    a1 = _opening(OC_DAY, "Which file prints hello?")
    a1_got, _ = sp.stabilize(a1, sp.BUILTIN, memory)
    b1 = _opening(OC_NEXT, "What does README.md say?")
    got, moved = sp.stabilize(b1, sp.BUILTIN, memory)
    assert moved is not None and got[0] == a1_got[0] and got[1]["content"].endswith(OC_NEXT)
    assert OC_DAY not in json.dumps(got)
    b2 = _later(OC_NEXT, "What does README.md say?", "It says hi.", "And LICENSE?")
    got2, moved = sp.stabilize(b2, sp.BUILTIN, sp.Memory(tmp_path, learn=False))  # a restart between
    assert moved is not None and got2[:2] == got and got2[2:] == b2[2:] and OC_DAY not in json.dumps(got2)
    a2 = _later(OC_NEXT, "Which file prints hello?", "main.py", "Thanks. Anything else?")
    got, moved = sp.stabilize(a2, sp.BUILTIN, sp.Memory(tmp_path, learn=False))
    assert moved is not None and got[:2] == a1_got and OC_NEXT not in json.dumps(got[:3])
    assert got[3]["role"] == "system" and got[3]["content"].startswith(sp.UPDATE_HEAD) and OC_NEXT in got[3]["content"]
    assert len(list((tmp_path / sp.DIRECTORY).iterdir())) == 2


def test_two_conversations_with_one_opening_and_other_values_get_none(tmp_path) -> None:
    """Two first requests that differ only in their spans' values cannot be told apart
    later: the record is marked shared and each later request is rendered with its own
    values (the cache is lost, never a value crosses)."""
    memory = sp.Memory(tmp_path, learn=False)
    sp.stabilize(_opening(OC_DAY, "Hi"), sp.BUILTIN, memory)
    assert not sp.stabilize(_opening(OC_DAY, "Hi"), sp.BUILTIN, memory)[1].updates  # the same values: a retry
    sp.stabilize(_opening(OC_NEXT, "Hi"), sp.BUILTIN, memory)
    for day, other in ((OC_DAY, OC_NEXT), (OC_NEXT, OC_DAY)):
        later = _later(day, "Hi", "Hello.", "Go on.")
        got, moved = sp.stabilize(later, sp.BUILTIN, memory)
        assert moved is not None and not moved.updates and day in got[1]["content"] and other not in json.dumps(got)
    [rec] = list((tmp_path / sp.DIRECTORY).iterdir())
    assert json.loads(rec.read_text())["began"] is None


# -- issue 52.4: bounded records ------------------------------------------------------------------


def test_records_are_bounded_by_count_and_bytes_oldest_first_by_sequence(tmp_path) -> None:
    """At most ``max_count`` records and ``max_bytes`` bytes; the oldest by kvstore's own
    sequence go first, whatever the files' mtimes say (the oldest touched into the future,
    the newest back to 1970)."""
    import os

    memory = sp.Memory(tmp_path, max_count=3, learn=False)
    for k in range(3):
        sp.stabilize(_opening(OC_DAY, f"question {k}"), sp.BUILTIN, memory)
    files = {json.loads(p.read_text())["seq"]: p for p in (tmp_path / sp.DIRECTORY).iterdir()}
    os.utime(files[min(files)], (4e9, 4e9))
    os.utime(files[max(files)], (1, 1))
    memory = sp.Memory(tmp_path, max_count=3, learn=False)  # a restart: the order is read back from the records
    for k in range(3, 5):
        sp.stabilize(_opening(OC_DAY, f"question {k}"), sp.BUILTIN, memory)
    left = sorted(p.name for p in (tmp_path / sp.DIRECTORY).iterdir())
    assert len(left) == 3 and files[min(files)].name not in left and files[max(files)].name in left

    (tmp_path / "small").mkdir()
    small = sp.Memory(tmp_path / "small", max_bytes=600, learn=False)
    for k in range(20):
        sp.stabilize(_opening(OC_DAY, f"question {k}"), sp.BUILTIN, small)
    sizes = [p.stat().st_size for p in (tmp_path / "small" / sp.DIRECTORY).iterdir()]
    assert 0 < sum(sizes) <= 600 and len(sizes) < 20


def test_a_record_too_large_drops_its_oldest_updates(tmp_path) -> None:
    """Updates are kept until the record reaches ``MAX_RECORD``; then the oldest go, so a
    record never exceeds it (each value is at most ``MAX_VALUE``)."""
    memory = sp.Memory(tmp_path, learn=False)
    value = "v" * (sp.MAX_VALUE - 40)
    opening = [{"role": "system", "content": f"{OC_DAY} {value}0\n"}, {"role": "user", "content": "Hi"}]
    sp.stabilize(opening, sp.BUILTIN, memory)
    history: list[dict[str, Any]] = list(opening)
    for k in range(1, 60):
        history = [{"role": "system", "content": f"{OC_DAY} {value}{k}\n"}, *history[1:],
                   {"role": "assistant", "content": f"a{k}"}, {"role": "user", "content": f"u{k}"}]
        sp.stabilize(history, sp.BUILTIN, memory)
    [rec] = list((tmp_path / sp.DIRECTORY).iterdir())
    assert 0 < rec.stat().st_size <= sp.MAX_RECORD and 10 < len(json.loads(rec.read_text())["updates"]) < 59


# -- properties on arbitrary message lists (hypothesis) -------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

DATES = ["Today's date is 2026-11-28.", "Today's date is 2026-11-29.", "Today's date: Sat Nov 28 2026",
         "<current_date>2026-11-30</current_date>", "Build b7"]
NEXT = {DATES[0]: DATES[1], DATES[1]: "Today's date is 2026-11-30.", DATES[2]: "Today's date: Sun Nov 29 2026",
        DATES[3]: "<current_date>2026-12-01</current_date>", DATES[4]: "Build c8"}  # each value's next day
ODD = st.text(st.characters(blacklist_categories=()), max_size=40)  # surrogates, controls, NUL, any plane
TEXT = st.lists(st.one_of(ODD, st.sampled_from(DATES), st.just("\n")), max_size=6).map("".join)
JUNK = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ODD),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(ODD, inner, max_size=3)),
                    max_leaves=12)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), JUNK)
CONTENT = st.one_of(TEXT, st.lists(PART, max_size=4), JUNK)
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool", None, 7])
MESSAGE = st.one_of(st.fixed_dictionaries({"role": ROLE, "content": CONTENT}), JUNK)
RULES = sp.BUILTIN + sp.user_rules([r"Build \w+"])
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(st.lists(MESSAGE, max_size=8), st.booleans())
def test_any_message_list_renders_or_is_left_as_sent(messages, inline) -> None:
    """Whatever the list holds, ``stabilize`` returns: the very list when it has no span;
    else a list whose messages after the opening are those sent (with at most updates
    between them), never changing the list it was given."""
    memory = sp.Memory(None)
    sent = copy.deepcopy(messages)
    for _ in range(2):
        got, moved = sp.stabilize(messages, RULES, memory, inline=inline)
        assert repr(messages) == repr(sent)  # never changed in place
        n = sp.head_length(messages)
        if not sp.find_spans(messages, RULES):
            assert got is messages and moved is None
        if moved is None:
            assert got is messages
        else:
            tail = [m for m in got[n:] if not (isinstance(m, dict) and str(m.get("content", "")).startswith(
                sp.UPDATE_HEAD))]
            assert len(got) >= len(messages) and len(tail) >= len(messages) - n


@PROPS
@given(st.lists(st.sampled_from(DATES), min_size=1, max_size=3), st.lists(st.sampled_from(DATES), min_size=1,
       max_size=3), TEXT, TEXT, st.booleans())
def test_never_another_conversations_value(a_values, b_values, a_question, b_question, a_first) -> None:
    """Two conversations (any values, any first questions, either first) in one memory:
    every value any request of B is rendered with is one of B's own, and A's."""
    memory = sp.Memory(None)

    def opening(values: list[str], question: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "Agent.\n" + "\n".join(values) + "\n"}, {"role": "user", "content": question}]

    def later(values: list[str], question: str) -> list[dict[str, Any]]:
        return [*opening(values, question), {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]

    def rendered(messages: list[Any]) -> str:
        return "\n".join(str(m["content"]) for m in messages)

    order = [("a", a_values, a_question), ("b", b_values, b_question)]
    today = {"a": [NEXT[v] for v in a_values], "b": [NEXT[v] for v in b_values]}  # the next day's values
    own = {name: set(values) | set(today[name]) for name, values, _ in order}
    for name, values, question in (order if a_first else order[::-1]):
        sp.stabilize(opening(values, question), RULES, memory)
    for name, values, question in order:
        for request in (opening(values, question), later(today[name], question)):
            got, _ = sp.stabilize(request, RULES, memory)
            other = own["b" if name == "a" else "a"] - own[name]
            leaked = {v for v in other if v in rendered(got) and v not in question}
            assert not leaked, (name, leaked, got)


def test_deep_huge_and_odd_requests_render_as_sent() -> None:
    """A part nested a hundred thousand deep, a list of a hundred thousand parts, lone
    surrogates next to a span: no exception, the request renders as sent."""
    deep: Any = "x"
    for _ in range(100_000):
        deep = [deep]
    cases = [
        [{"role": "system", "content": [{"type": "text", "text": OC_DAY}, {"type": "image", "data": deep}]},
         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}],
        [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}],
        [{"role": "system", "content": f"\ud800 {OC_DAY}\n"}, {"role": "user", "content": "\udfff"}],
    ]
    memory = sp.Memory(None)
    for messages in cases:
        got, moved = sp.stabilize(messages, sp.BUILTIN, memory)
        assert got is messages and moved is None


# -- mutation gate (tools.gates.mutation): behaviour the tests above left open -----------


def test_describe_says_each_changed_value_and_where_the_update_went() -> None:
    """``kvstore serve``'s log line and ``kvstore why``: exact text, values escaped to one
    line and cut to ``width`` (a value of exactly ``width`` is whole)."""
    M = sp.Moved
    assert M((("date", "Today's date is 2026-11-28.", "Today's date is 2026-11-29."),), (3,), False,
             home=1).describe() == (
        '--stable-prefix: date moved to the end of message 1; date "Today\'s date is 2026-11-28." kept, '
        '"Today\'s date is 2026-11-29." in the update (before message 3)')
    assert M((("date", "a", "b"), ("git-status", "x\ny\nz", "x\nY\nz")), (2, 5), True).describe() == (
        '--stable-prefix: date, git-status kept in place; date "a" kept, "b" in the update; '
        'git-status "y" kept, "Y" in the update (inside messages 2, 5)')
    assert M((("date", "a", "a"), ("date", "b", "b")), (), False, home=0).describe() == (
        "--stable-prefix: date moved to the end of message 0; values as the session began (no update)")
    assert M((("r", "k" * 60, "n" * 48),), (1,), False).describe() == (
        f'--stable-prefix: r kept in place; r "{"k" * 45}..." kept, "{"n" * 48}" in the update (before message 1)')
    assert M((("r", "k" * 49, "n"),), (1,), False).describe(width=49).startswith(
        f'--stable-prefix: r kept in place; r "{"k" * 49}"')
    line = M((("r", "a\x1b\nb", "c\nb"),), (1,), True).describe()
    assert "\n" not in line and "\x1b" not in line and line.endswith("(inside message 1)"), line


def test_first_change_is_the_first_line_that_differs() -> None:
    assert sp._first_change("g", "x\ny\nz", "x\nY\nz") == ("g", "y", "Y")
    assert sp._first_change("g", "a\nb", "c\nb") == ("g", "a\nb", "c\nb")  # the first line: whole values
    assert sp._first_change("g", "x\ny", "x\ny\nz") == ("g", "", "z")  # a line added after the common ones
    assert sp._first_change("g", "x\ny\nz\nw", "x\ny") == ("g", "z", "")
    assert sp._first_change("g", "", "q") == ("g", "", "q")


def test_update_text_lists_only_changed_values_each_without_trailing_newlines() -> None:
    spans = [sp.Span(0, None, 0, 1, "a", "x"), sp.Span(0, None, 2, 3, "b", "y"), sp.Span(0, None, 4, 5, "c", "z")]
    assert sp.update_text(spans, ["a", "b", "c"], ["\nA\n\n", "b", "C"]) == sp.UPDATE_HEAD + "\n\n\nA\n\nC"


def test_an_inline_update_heads_the_user_turn() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "q"}]}
    assert sp._insert(parts, "U", True) == [{"role": "user", "content": [{"type": "text", "text": "U"},
                                                                          {"type": "text", "text": "q"}]}]
    assert sp._insert({"role": "user", "content": None}, "U", True) == [{"role": "user", "content": "U\n\n"}]
    assert sp._insert({"role": "user", "content": "q"}, "U", False) == [{"role": "system", "content": "U"},
                                                                        {"role": "user", "content": "q"}]


def test_user_rules_are_named_from_one_and_a_refusal_is_not_logged_by_re2(capfd) -> None:
    assert [r.name for r in sp.user_rules(["a+", "b+"])] == ["volatile-1", "volatile-2"]
    with pytest.raises(ValueError) as e:
        sp.compile_rule(r"(a)\1")
    assert str(e.value) == (r"--volatile '(a)\\1' cannot be searched in linear time (invalid escape sequence: \1): "
                            "patterns run in RE2, which has no backreferences and no lookaround; write it without them")
    out, err = capfd.readouterr()
    assert "invalid escape" not in out + err  # said once, by kvstore: RE2's own log is off


def test_anchors_depend_on_the_salt_and_every_message() -> None:
    plain = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
             {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]
    other = [*plain[:2], {"role": "assistant", "content": "b"}, plain[3]]
    key = sp.session_key(plain[:2], None)
    at = sp.anchors(plain, key, None)
    assert sorted(at) == [1, 3] and at[1] != at[3]
    assert sp.anchors(plain, key, b"k")[3] != at[3] and sp.anchors(plain, key, b"k")[1] != at[1]
    assert sp.anchors(other, key, None)[1] == at[1] and sp.anchors(other, key, None)[3] != at[3]


@pytest.mark.parametrize("rec", [{"began": [1], "updates": {}}, {"began": "abc", "updates": {}},
                                 {"began": ["a"], "updates": {"x": "abc"}}, {"began": ["a"], "updates": []},
                                 {"began": ["a"]}, {"updates": {}}])
def test_a_record_of_the_wrong_shape_is_no_record(tmp_path, rec) -> None:
    memory = sp.Memory(tmp_path)
    key = sp.session_key([{"role": "user", "content": "q"}], None)
    memory.records.write(f"{key}.json", rec)
    assert memory.load(key) is None
    memory.records.write(f"{key}.json", {"began": None, "updates": {"x": ["a"]}})
    assert memory.load(key) == {"began": None, "updates": {"x": ["a"]}}


def test_session_keys_are_stable_across_versions() -> None:
    """A record on disk is found after an upgrade only if the key of an opening never
    changes: pinned, with non-ASCII text, a lone surrogate, keys out of order and a value
    JSON has no type for (a part's bytes)."""
    head = [{"role": "system", "content": "é ☃ \ud800"},
            {"content": [{"type": "text", "text": "q"}, {"type": "image", "data": b"x"}], "role": "user"}]
    assert sp.session_key(head, None) == "50bd1799c9126fbb06561a3d85615432"
    assert sp.session_key(head, b"k") == "a20a66b8a4bc56360e3f4a9f7d6cea65"
    assert sp.session_key([], None) == "a9aed74ec725304da2878f1258b8df83"


def test_masked_marks_each_span_by_rule_and_shares_the_rest() -> None:
    msgs = [{"role": "system", "content": "Today's date is 2026-11-28.\nX <current_date>2026-11-28</current_date>"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Today's date: Sat"}]},
            {"role": "assistant", "content": "Today's date is never"}, {"role": "user", "content": "Today's date is later"}]
    sent = copy.deepcopy(msgs)
    spans = sp.find_spans(msgs, sp.BUILTIN)
    assert [(s.message, s.part, s.start, s.end, s.rule) for s in spans] == [
        (0, None, 0, 27, "date"), (0, None, 30, 69, "codex-date"), (1, 1, 0, 17, "date")]
    out = sp.masked(msgs, spans)
    assert out == [{"role": "system", "content": "\x00date\x00\nX \x00codex-date\x00"},
                   {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\x00date\x00"}]},
                   *msgs[2:]]
    assert out[2] is msgs[2] and out[3] is msgs[3] and msgs == sent  # the request itself is never changed


def test_overlapping_matches_the_earlier_then_the_longer_then_the_rule_name_wins() -> None:
    rules = (sp.Rule("ab", sp.compile_rule("ab+")), sp.Rule("b", sp.compile_rule("b+c")),
             sp.Rule("long", sp.compile_rule("abbb")), sp.Rule("short", sp.compile_rule("ab")))
    spans = sp.find_spans([{"role": "user", "content": "abbbc abc"}], rules)
    assert [(s.start, s.end, s.rule, s.text) for s in spans] == [(0, 4, "ab", "abbb"), (6, 8, "ab", "ab")]


def test_at_most_max_spans_are_kept_across_messages() -> None:
    line = "Today's date is 2026-11-28.\n"
    msgs = [{"role": "system", "content": line * 20}, {"role": "user", "content": line * 20},
            {"role": "user", "content": line}]
    spans = sp.find_spans(msgs, sp.BUILTIN)
    assert len(spans) == sp.MAX_SPANS == 32
    assert [s.message for s in spans] == [0] * 20 + [1] * 12
    assert spans[20].start == 0 and spans[-1].start == 11 * len(line)
