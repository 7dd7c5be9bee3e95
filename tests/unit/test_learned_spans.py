"""kvstore.serve.learned_spans: volatile spans learned from the requests seen, with the
built-in rules switched off, on the agents' captured requests and on hostile ones."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvstore.salt import salt_key
from kvstore.serve import anthropic
from kvstore.serve import learned_spans as ls
from kvstore.serve import stable_prefix as sp
from tests.support import agent_requests as agents
from tests.support.agent_requests import CC_DAY, CC_NEXT, OC_DAY, OC_NEXT

TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file. " * 200}}]


def chat(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "system" in body:
        return anthropic.chat_request({**body, "max_tokens": 1}, False)["messages"]
    return copy.deepcopy(body["messages"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: Any) -> Any:
    """A real tokenizer and a chat template that renders tools after the system text."""
    from benchmarks.agent_session import with_tool_template
    from mlx_lm.utils import load_tokenizer
    from tools.testing.model_builds import model_path

    return load_tokenizer(with_tool_template(model_path("tiny-llama"), tmp_path_factory.mktemp("m") / "model"))


def tokens(tokenizer: Any, body: dict[str, Any], memory: sp.Memory, rules: tuple[sp.Rule, ...] = (),
           salt: bytes | None = None) -> tuple[list[int], sp.Moved | None]:
    from kvstore.serve.prompts import request_tokens

    render = sp.Render(rules, memory, salt)
    return request_tokens(tokenizer, body, stable=render), render.moved


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _next_day(body: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    text = json.dumps(body)
    assert old in text
    return dict(json.loads(text.replace(old, new)))


SESSIONS = {  # day 1's first request and a new session on each of the next days, built-in rules off
    "opencode": (lambda: agents.body("opencode_stable_first"),
                 lambda k: _next_day(agents.body("opencode_stable_first"), OC_DAY,
                                     ["Today's date: Sun Nov 29 2026", "Today's date: Mon Nov 30 2026",
                                      "Today's date: Tue Dec 01 2026"][k])),
    "claude-code-2.1.332": (lambda: agents.body("claude_code_stable_first"),
                            lambda k: _next_day(agents.body("claude_code_stable_changed_tree"), CC_DAY,
                                                [CC_NEXT, "Today's date is 2026-11-30.",
                                                 "Today's date is 2026-12-01."][k])),
}


@pytest.mark.parametrize("client", sorted(SESSIONS))
def test_new_sessions_on_later_days_read_system_prompt_and_tools_from_the_second_on(tmp_path, tokenizer,
                                                                                     client) -> None:
    """No built-in rule: day 1's session, then a new session each later day (a new date;
    Claude Code's tree changed too). The first of them teaches the span(s) and misses where
    they were, as it would without learning; from the second on each shares >= 95% of its
    prompt with the one before, and only its own values are in it."""
    first, later = SESSIONS[client]
    memory = sp.Memory(tmp_path)
    prev, moved = tokens(tokenizer, first(), memory)
    assert moved is None  # nothing known yet: as sent
    teach, moved = tokens(tokenizer, later(0), sp.Memory(tmp_path))  # a restart between the days
    assert moved is not None and all(rule.startswith("learned-") for rule, _, _ in moved.spans)
    as_sent, _ = tokens(tokenizer, later(0), sp.Memory(tmp_path / "none", learn=False))
    print(f"{client} teaching: {shared(teach, prev)} of {len(teach)} from day 1's; as sent {shared(as_sent, prev)}")
    assert shared(teach, prev) >= shared(as_sent, prev) - 24  # at most the changed line's unchanged head
    prev = teach
    for k in (1, 2):
        body = later(k)
        got, moved = tokens(tokenizer, body, sp.Memory(tmp_path))
        print(f"{client} day {k + 2}: {shared(got, prev)} of {len(got)} ({shared(got, prev) / len(got):.1%})")
        assert shared(got, prev) >= 0.95 * len(got), (shared(got, prev), len(got), moved)
        assert moved is not None and {now for _, _, now in moved.spans} <= {s.text for s in sp.find_spans(
            chat(body), sp.Memory(tmp_path).learner.rules(None))}  # type: ignore[union-attr]
        prev = got
    names = [x.name for x in sp.Memory(tmp_path).learner.learned(None)]  # type: ignore[union-attr]
    assert names and names == sorted(set(names), key=names.index)


def _opening(system: str, question: str = "Which file prints hello?") -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


BASE = "You are an agent.\nPlatform: linux\nToday's date: Sat Nov 28 2026\nWorking directory: /w\n" + \
       "".join(f"Rule {k}: be careful about thing number {k}.\n" for k in range(60))


def _learn(*systems: str, question: str = "Which file prints hello?", memory: sp.Memory | None = None,
           salt: bytes | None = None, tools: Any = TOOLS) -> tuple[sp.Memory, list[ls.Learned]]:
    memory = memory or sp.Memory(None)
    for system in systems:
        sp.stabilize(_opening(system, question), (), memory, salt_key=salt, tools=tools)
    assert memory.learner is not None
    return memory, memory.learner.learned(salt)


def test_a_short_changed_line_is_learned_between_its_neighbours() -> None:
    memory, learned = _learn(BASE, BASE.replace("Sat Nov 28", "Sun Nov 29"))
    [rule] = learned
    assert (rule.before, rule.after) == ("Platform: linux\n", "\nWorking directory: /w")
    got, moved = sp.stabilize(_opening(BASE.replace("Sat Nov 28", "Mon Nov 30")), (), memory, tools=TOOLS)
    assert moved is not None and moved.spans[0][0] == rule.name
    assert got[0]["content"] == BASE.replace("Today's date: Sat Nov 28 2026", "")
    assert got[1]["content"].endswith("\n\nToday's date: Mon Nov 30 2026")


@pytest.mark.parametrize("changed", [
    "".join(f"New rule {k}.\n" for k in range(ls.MAX_LINES + 1)),  # the user rewrote their instructions
    "x" * (ls.MAX_CHARS + 1) + "\n",  # one line, too long
])
def test_a_change_that_is_not_short_is_never_learned(changed) -> None:
    _, learned = _learn(BASE, BASE.replace("Working directory: /w\n", changed))
    assert learned == []


def test_a_change_with_too_little_after_it_is_never_learned() -> None:
    short = "You are an agent.\nPlatform: linux\nToday's date: Sat Nov 28 2026\nWorking directory: /w\n"
    _, learned = _learn(short, short.replace("Sat", "Sun"), tools=None)
    assert learned == []  # fewer than MIN_AGREE characters follow it: nothing to win
    _, learned = _learn(short, short.replace("Sat", "Sun"))
    assert len(learned) == 1  # the same tools follow it: they count
    _, learned = _learn(BASE, BASE.replace("Sat", "Sun"), BASE.replace("Rule 3:", "Rule three:"))
    assert len(learned) == 2  # two changes in one text, each learned from its own pair


def test_two_changes_in_one_text_teach_nothing_at_once() -> None:
    _, learned = _learn(BASE, BASE.replace("Sat Nov 28", "Sun Nov 29").replace("Rule 40:", "Rule forty:"))
    assert learned == []  # the run from the first change to the second is not short


def test_the_question_and_a_users_own_words_are_never_learned() -> None:
    """Another first question never teaches; in a user message only a run inside a tagged
    block (what an agent injects) does."""
    memory, learned = _learn(BASE, question="Which file prints hello?")
    _, learned = _learn(BASE, question="Which file prints goodbye?", memory=memory)
    assert learned == []
    tail = "".join(f"Context line {k}.\n" for k in range(80))
    plain = f"Note: build 1\n{tail}"
    _, learned = _learn(BASE, BASE, memory=sp.Memory(None), question=plain)
    memory = sp.Memory(None)
    for q in (plain, plain.replace("build 1", "build 2")):
        sp.stabilize(_opening(BASE, q) + [{"role": "user", "content": "go"}], (), memory, tools=TOOLS)
    assert memory.learner is not None and memory.learner.learned(None) == []  # not in a tagged block
    tagged = f"<system-reminder>\nctx\nNote: build 1\n{tail}</system-reminder>\n"
    for q in (tagged, tagged.replace("build 1", "build 2")):
        sp.stabilize(_opening(BASE, q) + [{"role": "user", "content": "go"}], (), memory, tools=TOOLS)
    [rule] = memory.learner.learned(None)
    assert rule.before == "ctx\n" and rule.after == "\nContext line 0."


def test_learned_rules_are_per_salt_and_survive_a_restart(tmp_path) -> None:
    a, b = salt_key("tenant-a"), salt_key("tenant-b")
    _, learned = _learn(BASE, BASE.replace("Sat", "Sun"), memory=sp.Memory(tmp_path), salt=a)
    assert len(learned) == 1
    again = sp.Memory(tmp_path)  # a restart
    assert again.learner is not None and again.learner.learned(a) == learned and again.learner.learned(b) == []
    assert again.learner.learned(None) == []


def test_openings_and_rules_are_bounded() -> None:
    memory = sp.Memory(None)
    for k in range(ls.MAX_OPENINGS + 4):
        sp.stabilize(_opening(BASE, f"question {k}"), (), memory, tools=TOOLS)
    assert memory.learner is not None
    assert len(memory.learner._load(ls.record_name(None))["openings"]) == ls.MAX_OPENINGS
    for k in range(ls.MAX_RULES + 4):  # each agent's own text (too unlike the others to teach), then one line changed
        text = "".join(f"Agent {k} line {j}.\n" for j in range(ls.MAX_LINES + 5)) + BASE
        sp.stabilize(_opening(text), (), memory, tools=TOOLS)
        sp.stabilize(_opening(text.replace(f"Rule {3 * k}: be", f"Rule {3 * k}: be very")), (), memory, tools=TOOLS)
    learned = memory.learner.learned(None)  # (lines apart: a learned line masks its neighbours' anchors)
    assert len(learned) == ls.MAX_RULES and learned[-1].before.startswith(f"Rule {3 * (ls.MAX_RULES + 3) - 1}:")


@pytest.mark.parametrize("planted", [
    b"not json", b"[]", b'{"openings": 7, "rules": []}',
    json.dumps({"openings": [{"texts": [["system", 5]]}, "x"], "rules": [
        {"name": "evil", "before": "(a+)+$" * 100, "after": "\\1"}, {"name": 3}, "x"]}).encode(),
    json.dumps({"openings": [], "rules": [{"name": "big", "before": "b" * (ls.MAX_CHARS + 1), "after": "\n"}]}).encode(),
])
def test_a_planted_or_damaged_learn_record_is_no_rule(tmp_path, planted) -> None:
    """Whatever lies in the salt's record: no exception, no rule that is not a literal of
    bounded size (a pattern-like text is matched as itself), requests render."""
    d = tmp_path / sp.DIRECTORY
    d.mkdir(mode=0o700)
    (d / ls.record_name(None)).write_bytes(planted)
    memory = sp.Memory(tmp_path)
    assert memory.learner is not None
    for rule in memory.learner.learned(None):
        assert len(rule.before) <= ls.MAX_CHARS and rule.rule().pattern.search("aaaa\\1") is None
    got, _ = sp.stabilize(_opening(BASE), sp.BUILTIN, memory, tools=TOOLS)
    assert got[0]["content"].startswith("You are an agent.")


TEXT = st.text(st.sampled_from("ab\n<>/ x"), max_size=120)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT, TEXT, TEXT, st.integers(0, 3000), st.booleans())
def test_any_learned_rule_finds_exactly_the_changed_run(head, a_mid, b_mid, tools, user) -> None:
    """For any two texts (a shared head and tail around two middles), ``learn`` returns, and
    every rule it makes finds one span in each, inside the lines where they differ."""
    tail = "\n" + "tail line\n" * 120
    a, b = head + a_mid + tail, head + b_mid + tail
    role = "user" if user else "system"
    for rule in ls.learn([(role, a)], [(role, b)], tools, (), ["learned-1"]):
        r = rule.rule()
        for text in (a, b):
            [(start, end)] = sp.matches(r, text, len(text))
            assert text[end:].endswith(tail[1:]) or text[end:] == ""
            assert start >= len(head) - len(head.split("\n")[-1]) - 0


def test_learned_spans_are_said_in_the_miss_line_why_and_stats(tmp_path) -> None:
    """The names a learned span is said by: ``Moved.describe`` (the miss log line and
    ``kvstore why``), ``Learner.learned`` as JSON (``/v1/cache/stats``, ``kvstore why``)."""
    memory, [rule] = _learn(BASE, BASE.replace("Sat", "Sun"), memory=sp.Memory(tmp_path))
    _, moved = sp.stabilize(_opening(BASE.replace("Sat", "Mon")) + [{"role": "assistant", "content": "a"},
                            {"role": "user", "content": "b"}], (), memory, tools=TOOLS)
    assert moved is not None and f"{rule.name} moved to the end of message 1" in moved.describe()
    assert rule.as_json() == {"name": rule.name, "before": "Platform: linux\n", "after": "\nWorking directory: /w"}
    assert Path(tmp_path / sp.DIRECTORY / ls.record_name(None)).exists()


# -- the CLIs' captured next-day requests (tools/gates/agent_clis.py --scenario nextday) -----------

NEXTDAY = ("claude", "claude_2_1_197", "opencode", "codex")
STEPS = ("day1_first", "day1_continue", "day2_continue", "day2_new")


def _nextday(cli: str, step: str) -> dict[str, Any]:
    """A captured next-day request as ``kvstore serve`` renders it (a chat body), or a
    later day's made from day 2's: dates a day on, one more untracked file in the tree."""
    from kvstore.serve import responses

    day3 = step.startswith("day3")
    name = f"nextday_{cli}_{step.replace('day3', 'day2')}"
    logged = json.loads((agents.DATA / f"{name}.json").read_text())
    text = json.dumps(logged["body"])
    if day3:
        text = text.replace("2026-12-03", "2026-12-04").replace("Thu Dec 03 2026", "Fri Dec 04 2026")
        text = text.replace("?? TODO.md", "?? NOTES.md\\n?? TODO.md")
    body = json.loads(text)
    if logged["path"].startswith("/v1/messages"):
        return dict(anthropic.chat_request({**body, "max_tokens": 1}, False))
    if logged["path"].startswith("/v1/responses"):
        return dict(responses.chat_request(responses.check_body(body), [])[0])
    return dict(body)


@pytest.mark.parametrize("builtin", [True, False], ids=["default", "built-in-rules-off"])
@pytest.mark.parametrize("cli", NEXTDAY)
def test_captured_next_day_requests_read_their_prompt_from_the_cache(tmp_path, tokenizer, cli, builtin) -> None:
    """Each pinned CLI's real day-1 first turn and continue, then (a restart) its day-2
    continue and new session, then a day-3 continue and new session on a changed tree:
    with the defaults every later-day request shares >= 95% of its prompt with one before
    it; with the built-in rules off, every one after the first that teaches a span does
    (the teacher misses where the span was, as it would without learning)."""
    rules = sp.BUILTIN if builtin else ()
    seen: list[list[int]] = []
    teachers, report = [], []

    def learned() -> list[str]:
        return [x.name for x in sp.Memory(tmp_path).learner.learned(None)]  # type: ignore[union-attr]

    for step in (*STEPS, "day3_continue", "day3_new"):
        before = learned()
        got, moved = tokens(tokenizer, _nextday(cli, step), sp.Memory(tmp_path), rules)
        best = max((shared(got, s) for s in seen), default=0)
        report.append(f"{step} {best / len(got):.1%}")
        if learned() != before:
            teachers.append(step)
        elif step.startswith(("day2", "day3")):
            assert best >= 0.95 * len(got), (cli, step, best, len(got), report)
        seen.append(got)
    print(cli, "default" if builtin else "learned only", "; ".join(report), "; taught by", teachers or "none",
          "; learned:", learned())
    assert len(teachers) <= 1 and (builtin or teachers), teachers


# -- hostile: oversized, replayed, concurrent, planted -------------------------------------------


def test_an_oversized_opening_is_compared_within_its_bounds() -> None:
    """Thousands of system messages and parts: at most MAX_TEXTS texts and SCAN_TOTAL
    characters are kept and compared."""
    many = [{"role": "system", "content": "s" * 10_000} for _ in range(2000)] + [{"role": "user", "content": "q"}]
    texts = ls.leading(many)
    assert len(texts) <= ls.MAX_TEXTS and sum(len(t) for _, t in texts) <= sp.SCAN_TOTAL
    memory = sp.Memory(None)
    got, moved = sp.stabilize(many, sp.BUILTIN, memory, tools=TOOLS)
    assert got is many and moved is None


def test_a_replayed_opening_is_kept_once_and_not_written_again(tmp_path) -> None:
    memory = sp.Memory(tmp_path)
    for _ in range(50):
        sp.stabilize(_opening(BASE), (), memory, tools=TOOLS)
    path = tmp_path / sp.DIRECTORY / ls.record_name(None)
    rec = json.loads(path.read_text())
    assert len(rec["openings"]) == 1 and rec["seq"] == 0  # written by the first request only


def test_concurrent_requests_of_one_salt_keep_one_valid_record(tmp_path) -> None:
    import threading

    memory = sp.Memory(tmp_path)
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            for day in range(6):
                sp.stabilize(_opening(BASE.replace("Sat Nov 28", f"Day {day}"), f"question {k}"), (), memory,
                             tools=TOOLS)
        except BaseException as e:  # noqa: BLE001 - any failure fails the test
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rec = json.loads((tmp_path / sp.DIRECTORY / ls.record_name(None)).read_text())
    assert len(rec["openings"]) <= ls.MAX_OPENINGS and len(rec["rules"]) == 1, rec["rules"]


def test_a_planted_link_at_the_learn_record_is_never_followed(tmp_path) -> None:
    """A symlink where the salt's record goes: learning still works in this process and
    the file it points at is untouched."""
    d = tmp_path / sp.DIRECTORY
    d.mkdir(mode=0o700)
    target = tmp_path / "victim.txt"
    target.write_text("precious")
    (d / ls.record_name(None)).symlink_to(target)
    memory, learned = _learn(BASE, BASE.replace("Sat", "Sun"), memory=sp.Memory(tmp_path))
    assert len(learned) == 1 and target.read_text() == "precious"


def test_tagged_blocks_are_found_in_one_pass_whatever_the_tags() -> None:
    """The innermost tag open at the run must close after it; 30,000 tags before a run
    (a client's hostile message) are one pass (the scan per tag this replaced was
    quadratic: minutes here)."""
    inside = "<a>\n<b>x</b>\nrun\n</a>"
    at = inside.index("run")
    assert ls._in_tagged_block(inside, at, at + 3)
    assert not ls._in_tagged_block("<a>\n</a>\nrun\n", 9, 12)  # closed before it
    assert not ls._in_tagged_block("<a>\n<br>\nrun\n</a>", 9, 12)  # the innermost never closes
    hostile = "<t>" * 30_000 + "\nrun\n" + "</t>"
    at = hostile.index("run")
    assert ls._in_tagged_block(hostile, at, at + 3)
    many = "".join(f"<t{k}>" for k in range(20_000)) + "\nrun\n"
    at = many.index("run")
    assert not ls._in_tagged_block(many, at, at + 3)


def test_many_salts_keep_at_most_max_salts_in_memory_and_lose_nothing_on_disk(tmp_path) -> None:
    memory = sp.Memory(tmp_path)
    salts = [salt_key(f"tenant-{k}") for k in range(ls.MAX_SALTS + 10)]
    for s in salts:
        _learn(BASE, BASE.replace("Sat", "Sun"), memory=memory, salt=s)
    assert memory.learner is not None and len(memory.learner._cache) == ls.MAX_SALTS
    assert len(memory.learner.learned(salts[0])) == 1  # read back from its record


def test_a_planted_rule_name_is_not_one_of_ours_and_is_dropped(tmp_path) -> None:
    d = tmp_path / sp.DIRECTORY
    d.mkdir(mode=0o700)
    rules = [{"name": "x" * 100_000, "before": "a\n", "after": "\nb"},
             {"name": "learned-1\n[fake log line]", "before": "a\n", "after": "\nb"},
             {"name": "learned-2", "before": "a\n", "after": "\nb"}]
    (d / ls.record_name(None)).write_text(json.dumps({"openings": [], "rules": rules}))
    memory = sp.Memory(tmp_path)
    assert memory.learner is not None and [x.name for x in memory.learner.learned(None)] == ["learned-2"]
