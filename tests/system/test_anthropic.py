"""``kvstore serve``'s Anthropic Messages API as the official ``anthropic`` SDK meets it.

Real ``kvstore serve`` subprocesses, the real SDK over HTTP:
- tiny-llama: a message, the same one streamed (text assembled from the events), the
  equivalent OpenAI chat completion answered from the same cache with the same text,
  ``count_tokens``, a stop sequence, bad requests as ``anthropic.BadRequestError``, the
  billing header left out (and kept with ``--keep-billing-header``);
- a scripted tool-calling model (tests/support/scripted_model.py: a real mlx-lm llama whose
  weights answer every chat prompt with one tool call): tool_use parsed by mlx-lm's tool
  parser, non-streamed and streamed, answered by a tool_result;
- a reduced coding-agent session (benchmarks/agent_session.py's trace) with the server
  killed (SIGKILL) and started again midway: every turn after the first reads >= 95% of its
  prompt from the cache.

The SDK (2.x) has no ``temperature`` argument; the tests pass it in ``extra_body`` (the
server's default is greedy anyway).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from benchmarks.agent_session import TOOL_TEMPLATE, Session, kvstore_command, play, report, system_prompt, tools
from tests.support.servers import Server

SYSTEM = " ".join(f"Clause {i}: the archive keeps every ledger for {i + 3} years and lists it by shelf {i * 5 % 17}."
                  for i in range(10))
QUESTION = [{"role": "user", "content": "Which shelf holds the ledgers kept for five years?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def client(server: Server) -> anthropic.Anthropic:
    """What README tells a user: base_url is the server's root (the SDK adds /v1/messages)."""
    return anthropic.Anthropic(base_url=server.url, api_key="not-needed", max_retries=0, timeout=300)


def billing(cch: str) -> dict[str, str]:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.1; cc_entrypoint=cli; cch={cch};"}


def prompt_tokens(u: Any) -> int:
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def test_message_stream_count_tokens_and_errors(model_dir: Path, tmp_path: Path) -> None:
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        c = client(s)
        system = [billing("a1b2c"), {"type": "text", "text": SYSTEM}]
        counted = c.messages.count_tokens(model="local", system=system, messages=QUESTION).input_tokens
        msg = c.messages.create(model="claude-test", max_tokens=24, system=system, messages=QUESTION, extra_body=GREEDY)
        assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-test"
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 24, msg
        u = msg.usage
        assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens == 0, u
        assert u.input_tokens == counted > 700, (u, counted)
        text = msg.content[0].text

        # streamed, another billing header (left out of the prompt): the whole prompt restored
        with c.messages.stream(model="claude-test", max_tokens=24, system=[billing("ffff0"), {"type": "text", "text": SYSTEM}],
                               messages=QUESTION, extra_body=GREEDY) as stream:
            events = list(stream)
            final = stream.get_final_message()
        kinds = [e.type for e in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
        streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
        assert streamed == text == final.content[0].text
        assert final.stop_reason == "max_tokens"
        f = final.usage
        assert prompt_tokens(f) == counted and f.cache_read_input_tokens >= counted - 1, f
        # one access-log line per request, streamed or not (mlx-lm's own answer is captured, not logged)
        logged = [ln for ln in s.log(1 << 20).splitlines() if '"POST /v1/messages ' in ln]
        assert len(logged) == 2 and all('" 200 ' in ln for ln in logged), logged

        # the same conversation as an OpenAI chat completion: one cache, one rendering, same text
        o = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=300)
        chat = o.chat.completions.create(model=str(model_dir), max_tokens=24, temperature=0,
                                         messages=[{"role": "system", "content": SYSTEM}, *QUESTION])
        assert chat.choices[0].message.content == text
        assert chat.usage.prompt_tokens == counted and chat.usage.prompt_tokens_details.cached_tokens >= counted - 1

        # a stop sequence from the known greedy text: the text up to it, and which one it was
        stop = next(ch for ch in text[3:] if ch.isascii() and ch.isprintable() and ch not in text[:3])
        cut = c.messages.create(model="claude-test", max_tokens=24, system=SYSTEM, messages=QUESTION,
                                stop_sequences=["\u2603never", stop], extra_body=GREEDY)
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop, cut
        # (the byte-level model's text before it may end in a held-back partial UTF-8 character)
        assert text.startswith(cut.content[0].text) and cut.usage.output_tokens < 24, cut
        assert len(text[:text.index(stop)]) - len(cut.content[0].text) <= 1

        # bad requests: the SDK's own exception, Anthropic's error object, in and out of a stream
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="m", max_tokens=8, messages=[])
        assert e.value.body["error"]["type"] == "invalid_request_error" and "messages" in e.value.message
        with pytest.raises(anthropic.BadRequestError, match="image processor"):
            c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        with pytest.raises(anthropic.BadRequestError, match="max_tokens must be at least 1"):  # mlx-lm's validation
            with c.messages.stream(model="m", max_tokens=-3, messages=QUESTION) as stream:
                list(stream)
        with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
            c.messages.count_tokens(model="m", messages=QUESTION, tool_choice={"type": "tool", "name": "nope"})
        assert s.stop(signal.SIGTERM) == 0, s.log()


def test_keep_billing_header_flag(model_dir: Path, tmp_path: Path) -> None:
    """With ``--keep-billing-header`` the header is rendered: longer prompt, and a new
    ``cch`` ends the reused prefix where the header is (the first system tokens)."""
    system = [billing("00001"), {"type": "text", "text": SYSTEM}]
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log", ["--keep-billing-header"]) as s:
        c = client(s)
        kept = c.messages.count_tokens(model="m", system=system, messages=QUESTION).input_tokens
        no_header = c.messages.count_tokens(model="m", system=SYSTEM, messages=QUESTION).input_tokens
        assert kept == no_header + len(system[0]["text"]) + 1  # byte-level tokenizer; "\n" joins blocks
        c.messages.create(model="m", max_tokens=4, system=system, messages=QUESTION)
        again = c.messages.create(model="m", max_tokens=4, system=[billing("00002"), system[1]], messages=QUESTION)
        assert again.usage.cache_read_input_tokens < 100, again.usage
        assert s.stop(signal.SIGTERM) == 0, s.log()


CALL = {"name": "Read", "arguments": {"path": "src/kvstore/store.py"}}
READ_TOOL = [{"name": "Read", "description": "Read a file of the repository.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.scripted_model import build

    return build(tmp_path_factory.mktemp("tool-model"), "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>")


def test_tool_round_trip(tool_model: Path, tmp_path: Path) -> None:
    """The model calls Read (mlx-lm's json_tools parser reads it), non-streamed and
    streamed; the call answered by a tool_result renders through the template (the
    tool_result's and the tool_use's bytes are in the prompt) and reuses the cached prefix."""
    question = [{"role": "user", "content": "Show me the store."}]
    with Server(tool_model, tmp_path / "cache", tmp_path / "server.log") as s:
        c = client(s)
        msg = c.messages.create(model="m", max_tokens=16, system=SYSTEM, tools=READ_TOOL, messages=question)
        assert msg.stop_reason == "tool_use", msg
        assert [b.type for b in msg.content] == ["tool_use"], msg.content
        call = msg.content[0]
        assert call.name == "Read" and call.input == CALL["arguments"] and call.id

        with c.messages.stream(model="m", max_tokens=16, system=SYSTEM, tools=READ_TOOL, messages=question) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.delta for e in events if e.type == "content_block_delta"]
        assert [d.type for d in deltas] == ["input_json_delta"] and json.loads(deltas[0].partial_json) == CALL["arguments"]
        assert final.stop_reason == "tool_use" and final.content[0].input == CALL["arguments"]

        def conversation(result: str, path: str = CALL["arguments"]["path"]) -> list[dict[str, Any]]:
            return [*question,
                    {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": "Read", "input": {"path": path}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result},
                                                 {"type": "text", "text": "Now fix it."}]}]

        def count(convo: list[dict[str, Any]]) -> int:
            return c.messages.count_tokens(model="m", system=SYSTEM, tools=READ_TOOL, messages=convo).input_tokens

        base = count(conversation("class KVStore: ..."))
        assert count(conversation("class KVStore: ... # twelve more")) == base + len(" # twelve more")  # tool_result content rendered
        # tool_use input rendered (the exact call the model made is its one token; other paths are bytes)
        assert count(conversation("class KVStore: ...", path="src/abc.py")) == count(conversation("class KVStore: ...", path="src/a.py")) + 2
        assert base > msg.usage.input_tokens + len("class KVStore: ...")

        answer = c.messages.create(model="m", max_tokens=16, system=SYSTEM, tools=READ_TOOL,
                                   messages=conversation("class KVStore: ..."))
        u = answer.usage
        assert prompt_tokens(u) == base
        # the first request's prompt is reused: the conversation so far is its prefix
        assert u.cache_read_input_tokens >= msg.usage.input_tokens - 1, u
        assert answer.stop_reason == "tool_use"  # this model always calls Read
        assert s.stop(signal.SIGTERM) == 0, s.log()


def test_agent_session_survives_sigkill(model_dir: Path, tmp_path: Path) -> None:
    """Six turns of a coding-agent session (system prompt with tools, a billing header that
    changes every request, text / tool_use / tool_result turns), the server SIGKILLed after
    turn 3 once its writes are on disk, and started again: every turn after the first,
    including the first after the restart, reads >= 95% of its prompt from the cache."""
    cache = tmp_path / "cache"
    extra = ["--chat-template", TOOL_TEMPLATE]
    servers = [Server(model_dir, cache, tmp_path / "server1.log", extra).__enter__()]
    stats: list[dict[str, Any]] = []

    def restart() -> None:
        servers[-1].wait_flushed()
        assert servers[-1].stop(signal.SIGKILL) == -signal.SIGKILL
        servers[-1].__exit__()
        servers.append(Server(model_dir, cache, tmp_path / "server2.log", extra).__enter__())

    try:
        session = Session(system_prompt(8), tools(2), max_tokens=8, result_lines=1)
        rows = play(session, 6, 3, lambda: client(servers[-1]), restart)
        stats.append(servers[-1].stats())
    finally:
        for s in servers:
            s.__exit__()
    assert len(servers) == 2
    assert rows[0]["prompt_tokens"] > 3000 and rows[0]["cache_read_input_tokens"] == 0, rows[0]
    assert rows[1]["stop_reason"] and any(r["turn"] == 4 and r["after_restart"] for r in rows)
    for r in rows[1:]:
        assert r["cache_read_input_tokens"] >= 0.95 * r["prompt_tokens"], (r, rows)
    assert stats[0]["hits_disk"] >= 1, stats  # turn 4 came from disk
    print("\n" + "\n".join(f"turn {r['turn']}: prompt {r['prompt_tokens']} read {r['cache_read_input_tokens']} "
                           f"ttft {r['ttft_s']:.2f} s" for r in rows))


def test_agent_session_passes_and_reports_kvstore_flags(tmp_path: Path) -> None:
    """``--kvstore-args`` reaches the ``kvstore serve`` command line, and the report names
    the flags each server ran with (the results say how each side was configured)."""
    cmd = kvstore_command(tmp_path / "model", tmp_path / "cache", ["--preload", "auto"])(8123)
    assert cmd[cmd.index("serve") + 1:][-2:] == ["--preload", "auto"] and "8123" in cmd
    row = {"turn": 1, "after_restart": False, "prompt_tokens": 10, "read_share": 0.0, "ttft_s": 1.0}
    srv = {"rows": [row], "min_read_share_after_turn_1": None, "ttft_after_restart_s": 1.0, "restart_ready_s": 1.0}
    doc = {"settings": {"model": "m", "turns": 1, "restart_after": 0, "stop": "term", "tools": 2,
                        "kvstore_args": ["--preload", "auto"], "others": ["cb=vllm-mlx serve {model} --continuous-batching"]},
           "servers": [{**srv, "name": "kvstore"}, {**srv, "name": "cb"}]}
    text = report(doc)
    assert "with extra flags: --preload auto" in text
    assert "- cb ran `vllm-mlx serve {model} --continuous-batching`" in text


def test_claude_codes_remaining_fields(model_dir: Path, tmp_path: Path) -> None:
    """Documents with a text source (title and context included), ``tool_result.is_error``,
    ``thinking`` ``adaptive`` and system messages inside ``messages``: rendered as the chat
    template renders their chat equivalent (counted by the server against the model's own
    tokenizer and template); other document sources and unknown block types are a 400
    naming the block type and what is supported."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def rendered(chat: list[dict[str, Any]]) -> int:
        return len(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])

    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a.txt"}}
    doc = {"type": "document", "title": "Shelf list", "context": "from the archive",
           "source": {"type": "text", "media_type": "text/plain", "data": "Shelf 5 holds the ledgers."}}
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        c = client(s)

        def count(messages: list[dict[str, Any]], **kw: Any) -> int:
            return c.messages.count_tokens(model="m", system=SYSTEM, messages=messages, **kw).input_tokens

        asked = [{"role": "user", "content": [doc, {"type": "text", "text": "Which shelf?"}]}]
        assert count(asked) == rendered([{"role": "system", "content": SYSTEM}, {"role": "user", "content":
                                         "Shelf list\nfrom the archive\nShelf 5 holds the ledgers.\nWhich shelf?"}])
        as_content = {**doc, "source": {"type": "content", "content": [{"type": "text", "text": "Shelf 5 holds the ledgers."}]}}
        assert count([{"role": "user", "content": [as_content, {"type": "text", "text": "Which shelf?"}]}]) == count(asked)

        failed = [{"role": "user", "content": "Read a.txt"}, {"role": "assistant", "content": [call]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                                "content": "no such file"}]}]
        assert count(failed) == rendered([
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Read a.txt"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "Read", "arguments": json.dumps({"path": "a.txt"})}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such file"}])

        reminded = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "system", "content": [{"type": "text", "text": "The user changed a.txt."}]},
                    {"role": "user", "content": "And now?"}]
        assert count(reminded) == rendered([{"role": "system", "content": SYSTEM}, *[
            {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
            for m in reminded]])
        msg = c.messages.create(model="m", max_tokens=4, system=SYSTEM, messages=reminded,
                                thinking={"type": "adaptive"}, extra_body=GREEDY)  # type: ignore[arg-type]
        assert msg.stop_reason in ("end_turn", "max_tokens")

        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}])
        assert "document" in e.value.message and "'base64'" in e.value.message and "text source" in e.value.message
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.count_tokens(model="m", messages=[{"role": "user", "content": [
                {"type": "search_result", "source": "x", "title": "t", "content": []}]}])
        assert "'search_result'" in e.value.message and "supported: text, image, document" in e.value.message
        with pytest.raises(anthropic.BadRequestError, match="thinking: type must be one of"):
            c.messages.count_tokens(model="m", messages=QUESTION, thinking={"type": "sometimes"})  # type: ignore[arg-type,typeddict-item]
