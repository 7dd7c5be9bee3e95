"""``kvstore serve --stable-prefix`` (kvstore.adapters.stable_prefix): the rewrite
through a real tokenizer, five template families, and real servers replaying a resumed Claude
Code and OpenCode session after a restart (each built-in rule and the rewrite's guarantees
without a model: tests/unit/test_adapters_stable_prefix.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore.adapters import stable_prefix as sp
from tests.support import agent_requests as agents
from tests.support.agent_requests import CC_DAY, CC_NEXT, CHANGED_STATUS, OC_DAY, OC_NEXT


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
