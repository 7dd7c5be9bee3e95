"""``kvstore serve --stable-prefix`` (kvstore.adapters.stable_prefix): each built-in rule on a
logged real request, the rewrite's guarantees, five template families, and real servers
replaying a resumed Claude Code and OpenCode session after a restart."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
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


# -- each built-in rule on a logged real request ------------------------------------------------


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


# -- the rewrite ---------------------------------------------------------------------------------


def test_no_volatile_span_is_the_same_request(tmp_path) -> None:
    """No span: the very list comes back, nothing is recorded, and the prompt's tokens are
    those rendered without the option (both APIs, the logged requests with their dates
    taken out)."""
    from benchmarks.agent_session import TOOL_TEMPLATE
    from kvstore.adapters.prompts import request_tokens

    memory = sp.Memory(tmp_path)
    messages = [{"role": "system", "content": "You file ledgers."}, {"role": "user", "content": "Where?"}]
    got, moved = sp.stabilize(messages, sp.BUILTIN, memory)
    assert got is messages and moved is None
    tokenizer = _family_tokenizer(TOOL_TEMPLATE)
    for name, day in (("opencode_stable_continue", OC_DAY), ("claude_code_stable_continue", CC_DAY)):
        body = json.loads(json.dumps(agents.body(name)).replace(day, "Today is a day.")
                          .replace("# gitStatus", "# Git"))
        stable = sp.Render(sp.BUILTIN, memory)
        assert request_tokens(tokenizer, body, stable=stable) == request_tokens(tokenizer, body)
        assert stable.moved is None
    assert not (tmp_path / sp.DIRECTORY).exists()


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
    b = [{"role": "system", "content": "Agent. Build id: b2"}, {"role": "user", "content": "Hi"}]
    got, moved = sp.stabilize(b, rules, memory)
    assert moved is not None and got[0]["content"] == "Agent. Build id: a1" and "Build id: b2" in got[1]["content"]
    with pytest.raises(ValueError, match=r"--volatile '\(' is not a regular expression"):
        sp.user_rules(["("])


def test_serve_refuses_a_bad_volatile_pattern_before_loading() -> None:
    got = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--model", "nowhere", "--volatile", "(a"],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2 and "--volatile '(a' is not a regular expression" in got.stderr, got.stderr


# -- five template families ----------------------------------------------------------------------


def _family_tokenizer(template: str) -> Any:
    from mlx_lm.utils import load_tokenizer

    from tools.testing.model_builds import model_path

    return load_tokenizer(model_path("tiny-llama"), tokenizer_config_extra={"chat_template": template})


FAMILIES = ["qwen2.5", "llama3", "gemma", "smollm2", "tools-chatml"]


@pytest.mark.parametrize("family", FAMILIES)
def test_families_render_the_rewritten_requests(family) -> None:
    """Each family renders the resumed requests rewritten (Gemma, whose template refuses a
    system message after the first, gets the update inside the user turn), and the
    rendered prompt holds the first values in place and today's after them. Claude Code's
    resumed request has a system turn between its first user turn and the answer: Gemma's
    template refuses it with or without the option (checked)."""
    from tests.support.chat_templates import families
    from kvstore.adapters.prompts import request_tokens

    tokenizer = _family_tokenizer(families()[family])
    cases = [("opencode_stable_first", agents.opencode_resumed(), OC_DAY, OC_NEXT),
             ("claude_code_stable_first", agents.claude_code_resumed(), CC_DAY, CC_NEXT)]
    for first, resumed, day, nxt in cases:
        stable = sp.Render(sp.BUILTIN, sp.Memory(None))
        plain = request_tokens(tokenizer, agents.body(first), stable=stable)
        assert stable.moved is None and plain == request_tokens(tokenizer, agents.body(first))
        if family == "gemma" and first.startswith("claude"):  # its environment system turn, then an answer
            for s in (None, stable):
                with pytest.raises(ValueError, match="roles must alternate"):
                    request_tokens(tokenizer, resumed, stable=s)
            continue
        got = request_tokens(tokenizer, resumed, stable=stable)
        assert stable.moved is not None and stable.moved.inline == (family == "gemma")
        text = tokenizer.decode(got)
        assert day in text and nxt in text and text.index(day) < text.rindex(nxt), family
        if first.startswith("claude"):
            assert text.index("(clean)") < text.rindex(CHANGED_STATUS.strip())
        before = request_tokens(tokenizer, agents.body(first))
        assert got[:len(before) - 8] == before[:len(before) - 8]  # all but the generation prompt's tail


# -- real servers: a session resumed after a restart ---------------------------------------------


def _cached(resp: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, prompt tokens read from the cache) of a chat completion or a Message."""
    u = resp["usage"]
    if "input_tokens" in u:
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _why(request: Path, model: Path, cache: Path, *extra: str) -> dict[str, Any]:
    got = subprocess.run([sys.executable, "-m", "kvstore.cli", "why", str(request), "--model", str(model),
                          "--cache-dir", str(cache), "--json", *extra], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    return dict(json.loads(got.stdout))


CLIENTS = {  # the session's first request, its resumed request (next day, changed tree), the route, tools kept
    "claude-code": (lambda: agents.body("claude_code_stable_first"), agents.claude_code_resumed, "/v1/messages", 6),
    "opencode": (lambda: agents.body("opencode_stable_first"), agents.opencode_resumed, "/v1/chat/completions", 3),
}


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_resumed_session_after_a_restart_reads_its_prompt_from_the_cache(tmp_path, client) -> None:
    """A server with --stable-prefix stores a session's first request and stops; a fresh
    process gets the session resumed the next day on a changed tree and reads >= 95% of
    the prompt from the cache, saying what it moved (its log, ``kvstore why``). Without the
    option the store serves the resumed request only up to the changed line (``kvstore
    why`` on the same directory: Claude Code's environment message after the first turn,
    OpenCode's date in the system prompt). The requests are the logged ones, cut to a size
    a CPU prefills in a minute (``agent_requests.shortened``)."""
    from benchmarks.agent_session import with_tool_template
    from kvstore.adapters.prompts import request_tokens
    from mlx_lm.utils import load_tokenizer
    from tests.support.servers import Server
    from tools.testing.model_builds import model_path

    model = with_tool_template(model_path("tiny-llama"), tmp_path / "model")
    make_first, make_resumed, path, tools = CLIENTS[client]
    first, resumed = agents.shortened(make_first(), tools), agents.shortened(make_resumed(), tools)
    cache, extra = tmp_path / "cache", ["--stable-prefix"]
    with Server(model, cache, tmp_path / "server1.log", extra) as s:
        n1, _ = _cached(s.post(path, agents.served(first), timeout=900))
        s.wait_flushed(timeout=300)
    with Server(model, cache, tmp_path / "server2.log", extra) as s:  # a restart: a fresh process
        n, hit = _cached(s.post(path, agents.served(resumed), timeout=900))
        if client == "opencode":  # its tools in another order: a miss at the tools, of a rewritten prompt
            s.post(path, agents.served({**resumed, "tools": resumed["tools"][::-1]}), timeout=900)
        log = s.log(1 << 30)
    (tmp_path / "resumed.json").write_text(json.dumps(resumed))
    said, plain = _why(tmp_path / "resumed.json", model, cache, *extra), _why(tmp_path / "resumed.json", model, cache)
    sent = request_tokens(load_tokenizer(model), first)
    as_sent = request_tokens(load_tokenizer(model), resumed)
    changed_at = next(i for i, (x, y) in enumerate(zip(sent, as_sent)) if x != y)
    print(f"{client}: --stable-prefix {hit} of {n} prompt tokens from the cache ({hit / n:.1%}); as sent the store "
          f"serves {plain['serves']} of {plain['request_tokens']} ({plain['serves'] / plain['request_tokens']:.1%}); "
          f"the first request was {n1}")
    assert hit >= 0.95 * n, (hit, n)
    assert "kvstore: --stable-prefix: " in log and 'date "' in log and "kept in place" in log, log[-3000:]
    assert said["stable_prefix"] is not None and said["serves"] >= 0.95 * said["request_tokens"], said
    assert any(s["rule"] == "date" and s["kept"] != s["now"] for s in said["stable_prefix"]["spans"])
    assert "stable_prefix" in plain and plain["stable_prefix"] is None
    if client == "opencode":
        [miss] = [line for line in log.splitlines() if "kvstore: miss (diverged)" in line]
        assert miss.endswith(f'; --stable-prefix: date "{OC_DAY}" kept in place, "{OC_NEXT}" in the update '
                             f'(before message 3)'), miss
    assert plain["request_tokens"] == len(as_sent) and plain["serves"] <= changed_at, (plain, changed_at)
