"""``kvstore serve``'s OpenAI Responses API (``/v1/responses``) as the official ``openai`` SDK
and a Codex-shaped client meet it.

Real ``kvstore serve`` subprocesses, the real SDK over HTTP:
- tiny-llama: ``client.responses.create`` and ``client.responses.stream`` (same text, the
  second reads the whole prompt from the cache), the same conversation as a chat completion
  from the same cache, stored responses (``retrieve``, ``delete``, OpenAI's 404), tenants
  (another ``cache_salt`` is a 404), refused requests (400s naming the field, nothing stored);
- ``benchmarks.agent_session --api responses``'s Codex-shaped session, the server SIGKILLed
  midway: every turn after the first >= 95% cached; with ``--chain`` the
  ``previous_response_id`` chain continues in the fresh process;
- a scripted tool-calling model (tests/support/scripted_model.py): a streamed request shaped
  like Codex CLI 0.171's (two ``developer`` messages, flat + namespace + ``web_search``
  tools, ``store: false``, ``include``, ``prompt_cache_key``, ``client_metadata``), the
  event sequence Codex parses, then the next turn with its ``function_call`` /
  ``function_call_output`` history read from the cache;
- ``response_store.ResponseStore`` on real files: tests/unit/test_serve_response_store.py.
- stored responses as a client sees them: a clock step never evicts the newest, a response
  is found the moment its answer arrives (or is answered ``store: false`` with
  ``store_error``), planted malformed records are counted JSON 404s.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.servers import Server
from tests.unit.test_serve_response_store import stored

SYSTEM = " ".join(f"Clause {i}: the archive keeps every ledger for {i + 3} years and lists it by shelf {i * 5 % 17}."
                  for i in range(10))
QUESTION = "Which shelf holds the ledgers kept for five years?"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-needed", max_retries=0, timeout=300)


def raw(server: Server, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """(status, JSON body) of one request, whatever its status."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_sdk_create_stream_store_and_errors(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with Server(model_dir, cache, tmp_path / "server.log") as s:
        c = client(s)
        r = c.responses.create(model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=16, temperature=0,
                               metadata={"run": "1"})
        assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
        assert [o.type for o in r.output] == ["message"] and r.output_text
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
        u = r.usage
        assert u.output_tokens == 16 and u.input_tokens > 700 and u.input_tokens_details.cached_tokens == 0, u
        assert u.total_tokens == u.input_tokens + 16 and u.output_tokens_details.reasoning_tokens == 0
        prompt = u.input_tokens

        # streamed, the same request: the event sequence, the same text, the prompt from the cache
        with c.responses.stream(model="tiny", instructions=SYSTEM, input=QUESTION, max_output_tokens=16,
                                temperature=0) as stream:
            events = list(stream)
            final = stream.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"], kinds
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"], kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
        assert final.output_text == r.output_text and final.id.startswith("resp_") and final.id != r.id
        f = final.usage
        assert f.input_tokens == prompt and f.input_tokens_details.cached_tokens >= prompt - 1, f

        # the same conversation as a chat completion: one rendering, one cache, the same text
        chat = c.chat.completions.create(model=str(model_dir), max_tokens=16, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
        assert chat.choices[0].message.content == r.output_text
        assert chat.usage.prompt_tokens == prompt and chat.usage.prompt_tokens_details.cached_tokens >= prompt - 1

        # stored: retrieve, continue, delete; files private
        got = c.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "1"}
        files = stored(cache)
        assert len(files) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files
        assert stat.S_IMODE((cache / "responses").stat().st_mode) == 0o700
        nxt = c.responses.create(model="tiny", previous_response_id=r.id, input="And the next?", max_output_tokens=4,
                                 temperature=0)
        assert nxt.previous_response_id == r.id
        # no instructions carried over (as OpenAI's): the chained prompt is the input, the answer, the new input
        assert nxt.usage.input_tokens < prompt
        c.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.retrieve(r.id)
        assert e.value.body == {"message": f"Response with id '{r.id}' not found.", "type": "invalid_request_error",
                                "param": None, "code": None}
        with pytest.raises(openai.NotFoundError):
            c.responses.delete(r.id)
        assert len(stored(cache)) == 2  # the stream's and nxt's

        # store: false keeps nothing
        c.responses.create(model="tiny", input=QUESTION, max_output_tokens=2, store=False)
        assert len(stored(cache)) == 2

        # refused: OpenAI's error object naming the field; nothing stored, nothing generated
        before = stored(cache)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
            ({"input": QUESTION, "temperature": "hot"}, "temperature"),
            ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
            ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
            ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
            ({"input": QUESTION, "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
            ({"input": QUESTION, "tools": [{"type": "function", "name": "f"}],
              "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name"),
            ({"input": QUESTION, "tools": [{"type": "shell_magic"}]}, "tools[0].type"),
            ({"input": QUESTION, "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
            ({"input": QUESTION, "background": True}, "background"),
            ({}, "input"),
        ]
        for body, param in bad:
            status, err = raw(s, "POST", "/v1/responses", {"model": "tiny", **body})
            assert status == 400 and err["error"]["param"] == param, (body, status, err)
            assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"], err
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model="tiny", previous_response_id="resp_gone", input="hi")
        assert e.value.body["param"] == "previous_response_id"
        assert stored(cache) == before
        assert s.stop(signal.SIGTERM) == 0, s.log()


def test_tenants_do_not_see_each_others_responses(model_dir: Path, tmp_path: Path) -> None:
    """A response stored under one ``cache_salt`` is a 404 under another (or none), for
    ``retrieve``, ``delete`` and ``previous_response_id``; its own tenant still finds it."""
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log") as s:
        c = client(s)
        r = c.responses.create(model="tiny", input=QUESTION, max_output_tokens=2, extra_body={"cache_salt": "alice"})
        for query in ({"cache_salt": "bob"}, {}):
            with pytest.raises(openai.NotFoundError):
                c.responses.retrieve(r.id, extra_query=query)
            with pytest.raises(openai.NotFoundError):
                c.responses.delete(r.id, extra_query=query)
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="tiny", previous_response_id=r.id, input="x", max_output_tokens=2,
                               extra_body={"cache_salt": "bob"})
        assert c.responses.retrieve(r.id, extra_query={"cache_salt": "alice"}).id == r.id
        nxt = c.responses.create(model="tiny", previous_response_id=r.id, input="x", max_output_tokens=2,
                                 extra_body={"cache_salt": "alice"})
        assert nxt.previous_response_id == r.id
        assert s.stop(signal.SIGTERM) == 0, s.log()


THINKING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


def test_reasoning_effort_switches_the_templates_thinking(model_dir: Path, tmp_path: Path) -> None:
    """``reasoning.effort`` reaches the template as ``enable_thinking``: ``none`` renders the
    empty think block a Qwen3-style template adds when thinking is off, ``high`` does not,
    and without ``reasoning.effort`` the prompt is the chat route's (no switch passed)."""
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log", ["--chat-template", THINKING_TEMPLATE]) as s:
        c = client(s)

        def prompt(**extra: Any) -> int:
            return c.responses.create(model="tiny", input=QUESTION, max_output_tokens=1, **extra).usage.input_tokens

        off, on, default = prompt(reasoning={"effort": "none"}), prompt(reasoning={"effort": "high"}), prompt()
        assert off == on + len("<think>\n\n</think>\n\n"), (off, on)
        chat = c.chat.completions.create(model=str(model_dir), max_tokens=1, messages=[{"role": "user", "content": QUESTION}])
        assert default == chat.usage.prompt_tokens, (default, chat.usage)  # the server's own default, untouched
        assert prompt(reasoning={"effort": "minimal", "summary": "auto"}) == off
        assert s.stop(signal.SIGTERM) == 0, s.log()


@pytest.mark.parametrize("chain", [False, True], ids=["resend", "chain"])
def test_codex_session_survives_sigkill(model_dir: Path, tmp_path: Path, chain: bool) -> None:
    """Six turns of ``benchmarks.agent_session --api responses`` (Codex-shaped; ``chain``:
    store + previous_response_id with only the new items), the server SIGKILLed after turn
    3 once its writes are on disk and started again: every turn after the first, the first
    after the restart included, reads >= 95% of its prompt from the cache, and the chain
    continues in the new process."""
    from benchmarks.agent_session import TOOL_TEMPLATE, play, system_prompt, tools
    from benchmarks.responses_trace import ResponsesSession, run_turn

    cache = tmp_path / "cache"
    extra = ["--chat-template", TOOL_TEMPLATE]
    servers = [Server(model_dir, cache, tmp_path / "server1.log", extra).__enter__()]

    def restart() -> None:
        servers[-1].wait_flushed()
        assert servers[-1].stop(signal.SIGKILL) == -signal.SIGKILL
        servers[-1].__exit__()
        servers.append(Server(model_dir, cache, tmp_path / "server2.log", extra).__enter__())

    sent: list[dict[str, Any]] = []

    def run(c: openai.OpenAI, req: dict[str, Any]) -> dict[str, Any]:
        sent.append(req)
        return run_turn(c, req)

    try:
        session = ResponsesSession(system_prompt(8), tools(2), max_tokens=8, result_lines=1, chain=chain)
        rows = play(session, 6, 3, lambda: client(servers[-1]), restart, run=run)
        if chain:  # the restarted server holds every response of the chain, the first one's included
            first = client(servers[-1]).responses.retrieve(sent[1]["previous_response_id"])
            assert first.output and first.usage.input_tokens == rows[0]["prompt_tokens"], first
        else:
            assert not stored(cache)  # store: false
    finally:
        for s in servers:
            s.__exit__()
    assert len(servers) == 2 and [r["error"] for r in rows] == [None] * 6, rows
    assert rows[0]["prompt_tokens"] > 3000 and rows[0]["cache_read_input_tokens"] == 0, rows[0]
    for r in rows[1:]:
        assert r["cache_read_input_tokens"] >= 0.95 * r["prompt_tokens"], (r, rows)
    assert all(r["prompt_tokens"] > p["prompt_tokens"] for r, p in zip(rows[1:], rows)), rows
    if chain:  # only the new items after the first turn; the server held the rest, after the restart too
        assert all(q.get("previous_response_id") and len(q["input"]) <= 3 for q in sent[1:]), sent
    else:
        assert all(q["store"] is False and "previous_response_id" not in q for q in sent)


# -- Codex-shaped ---------------------------------------------------------------------------------


CALL = {"name": "shell", "arguments": {"command": ["ls", "-la"]}}
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "namespace", "name": "mcp__files", "description": "File tools.", "tools": [
        {"type": "function", "name": "read_file", "description": "Reads a file.", "strict": False,
         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]},
    {"type": "web_search"},
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.scripted_model import build

    return build(tmp_path_factory.mktemp("tool-model"), "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>")


def codex_body(history: list[dict[str, Any]], turn: int) -> dict[str, Any]:
    """What Codex CLI 0.171 sends (from its logged requests), reduced."""
    return {"model": "tiny", "stream": True, "store": False, "tools": CODEX_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
            "client_metadata": {"turn_id": f"turn-{turn}-{os.urandom(4).hex()}", "ts": f"2026-11-28T01:0{turn}:00Z"},
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]},
                {"type": "message", "role": "developer", "content": [
                    {"type": "input_text", "text": "<permissions>sandbox: workspace-write</permissions>"}]},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "<environment_context>cwd: /repo</environment_context>"}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
                *history]}


def sse_events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events of one streamed request, read as Codex reads them (``data:`` lines)."""
    req = urllib.request.Request(server.url + "/v1/responses", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = r.read().decode()
    out = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            event = json.loads(lines["data"])
            assert lines.get("event") == event["type"], block
            out.append(event)
    return out


def test_codex_shaped_stream_and_tool_history(tool_model: Path, tmp_path: Path) -> None:
    with Server(tool_model, tmp_path / "cache", tmp_path / "server.log") as s:
        events = sse_events(s, codex_body([], 1))
        kinds = [e["type"] for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.function_call_arguments.delta", "response.function_call_arguments.done",
                         "response.output_item.done", "response.completed"], kinds
        assert isinstance(events[0]["response"]["id"], str) and events[0]["response"]["status"] == "in_progress"
        call = events[-2]["item"]
        assert call["type"] == "function_call" and call["name"] == "shell" and isinstance(call["call_id"], str)
        assert json.loads(call["arguments"]) == CALL["arguments"]
        done = events[-1]["response"]
        assert done["status"] == "completed" and done["output"] == [call]
        u = done["usage"]
        assert set(u) == {"input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details", "total_tokens"}
        assert u["input_tokens_details"]["cached_tokens"] == 0 and u["output_tokens_details"]["reasoning_tokens"] == 0
        first = u["input_tokens"]
        assert first > 900, u  # the system prompt, both developer messages and the two function tools rendered

        # client_metadata (a new turn id and time) never reaches the prompt: the same request is all cached
        again = sse_events(s, codex_body([], 2))[-1]["response"]["usage"]
        assert again["input_tokens"] == first and again["input_tokens_details"]["cached_tokens"] >= first - 1, again

        # the next turn: the call and its output resent as history; the prompt so far from the cache
        history = [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
                   {k: call[k] for k in ("type", "id", "call_id", "name", "arguments")},
                   {"type": "function_call_output", "call_id": call["call_id"], "output": "README.md\nkvstore/\ntests/"}]
        nxt = sse_events(s, codex_body(history, 3))[-1]["response"]
        assert nxt["usage"]["input_tokens"] > first + len("README.md\nkvstore/\ntests/")
        assert nxt["usage"]["input_tokens_details"]["cached_tokens"] >= first - 1, nxt["usage"]
        assert not stored(tmp_path / "cache")  # store: false

        # the same history as a chat completion renders the same prompt, answered from the cache
        chat = s.post("/v1/chat/completions", {"model": str(tool_model), "max_tokens": 4, "messages": [
            {"role": "system", "content": SYSTEM + "\n\n<permissions>sandbox: workspace-write</permissions>"},
            {"role": "user", "content": "<environment_context>cwd: /repo</environment_context>"},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call["call_id"], "type": "function", "function": {
                "name": "shell", "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["call_id"], "content": "README.md\nkvstore/\ntests/"}],
            "tools": [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                      for t in (CODEX_TOOLS[0], CODEX_TOOLS[1]["tools"][0])]})
        assert chat["usage"]["prompt_tokens"] == nxt["usage"]["input_tokens"], (chat["usage"], nxt["usage"])
        assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= nxt["usage"]["input_tokens"] - 1
        assert s.stop(signal.SIGTERM) == 0, s.log()


# -- the store on its own ---------------------------------------------------------------------------
#    tests/unit/test_serve_response_store.py (and test_serve_response_record.py: the
#    record reader on any bytes); below, what a client of a real server sees of it.


def continue_(server: Server, response_id: str) -> tuple[int, Any]:
    """(status, body) of continuing ``response_id`` with one token, storing nothing."""
    return raw(server, "POST", "/v1/responses", {"model": "tiny", "previous_response_id": response_id,
                                                 "input": "Go on.", "max_output_tokens": 1, "store": False})


def test_a_clock_step_never_evicts_the_newest(model_dir: Path, tmp_path: Path) -> None:
    """Issue 52.5: 5 stored responses whose files' mtimes are an hour ahead (the clock was
    stepped back) and a restart; 3 new responses under ``--responses-max-count 5``: each is
    found and continued at once, and the 3 oldest of the first 5 are the ones evicted."""
    cache = tmp_path / "cache"
    extra = ["--responses-max-count", "5"]
    with Server(model_dir, cache, tmp_path / "server1.log", extra) as s:
        old = [raw(s, "POST", "/v1/responses", {"model": "tiny", "input": f"Old {i}.", "max_output_tokens": 1})[1]["id"]
               for i in range(5)]
        assert s.stop(signal.SIGTERM) == 0, s.log()
    ahead = time.time() + 3600
    for p in stored(cache):
        os.utime(p, (ahead, ahead))
    with Server(model_dir, cache, tmp_path / "server2.log", extra) as s:
        new = []
        for i in range(3):
            status, r = raw(s, "POST", "/v1/responses", {"model": "tiny", "input": f"New {i}.", "max_output_tokens": 1})
            assert status == 200 and r["store"] is True and "store_error" not in r, r
            new.append(r["id"])
            assert raw(s, "GET", f"/v1/responses/{r['id']}")[0] == 200, (i, s.log())
            assert continue_(s, r["id"])[0] == 200, (i, s.log())
        found = [raw(s, "GET", f"/v1/responses/{rid}")[0] for rid in old + new]
        assert found == [404, 404, 404, 200, 200, 200, 200, 200], found
        assert len(stored(cache)) == 5
        assert s.stats()["responses"]["evicted"] == 3
        assert s.stop(signal.SIGTERM) == 0, s.log()


def _stream_then_use(server: Server, body: dict[str, Any]) -> tuple[dict[str, Any], int, int]:
    """(the final response, GET status, continue status): GET and continue sent the moment
    ``response.completed`` arrives, as the SDK would, the stream's connection still open."""
    import http.client

    conn = http.client.HTTPConnection(server.url.split("//")[1], timeout=300)
    try:
        conn.request("POST", "/v1/responses", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
        r = conn.getresponse()
        assert r.status == 200
        while True:
            line = r.readline()
            assert line, "the stream ended without response.completed"
            if line.startswith(b"data: ") and b'"type": "response.completed"' in line[:60]:
                final = json.loads(line[6:])["response"]
                return final, raw(server, "GET", f"/v1/responses/{final['id']}")[0], continue_(server, final["id"])[0]
    finally:
        conn.close()


def test_a_response_is_stored_before_it_is_answered(model_dir: Path, tmp_path: Path) -> None:
    """Issue 52.6: a client that GETs or continues a response the moment its answer (or its
    stream's ``response.completed``) arrives finds it: 20 rounds each, a ~1 MB response
    (its metadata) written each time, no 404. A response over ``--responses-max-bytes`` is
    answered with ``store: false`` and ``store_error`` saying why, streamed or not."""
    blob = {"blob": "x" * 1_000_000}
    with Server(model_dir, tmp_path / "cache", tmp_path / "server.log", ["--responses-max-bytes", "4M"]) as s:
        misses = []
        for i in range(20):
            status, r = raw(s, "POST", "/v1/responses", {"model": "tiny", "input": f"Round {i}.",
                                                         "max_output_tokens": 1, "metadata": blob})
            assert status == 200 and r["store"] is True, r
            got, cont = raw(s, "GET", f"/v1/responses/{r['id']}")[0], continue_(s, r["id"])[0]
            final, sgot, scont = _stream_then_use(s, {"model": "tiny", "input": f"Streamed {i}.", "max_output_tokens": 1,
                                                      "metadata": blob})
            assert final["store"] is True and "store_error" not in final, final.get("store_error")
            misses += [(i, what) for what, code in (("get", got), ("continue", cont), ("stream get", sgot),
                                                    ("stream continue", scont)) if code != 200]
        assert misses == [], f"{len(misses)} of 80 lookups right after the answer missed: {misses}"

        huge = {"blob": "y" * 5_000_000}  # over --responses-max-bytes: said in the answer, never a later 404
        status, r = raw(s, "POST", "/v1/responses", {"model": "tiny", "input": "Big.", "max_output_tokens": 1,
                                                     "metadata": huge})
        assert status == 200 and r["status"] in ("completed", "incomplete") and r["store"] is False, r["store"]
        assert r["store_error"]["code"] == "response_not_stored" and "--responses-max-bytes" in r["store_error"]["message"]
        assert raw(s, "GET", f"/v1/responses/{r['id']}")[0] == 404
        final, sgot, _ = _stream_then_use(s, {"model": "tiny", "input": "Big.", "max_output_tokens": 1, "metadata": huge})
        assert final["store"] is False and final["store_error"]["code"] == "response_not_stored" and sgot == 404
        assert s.stats()["responses"]["not_stored"] == 2
        status, r = raw(s, "POST", "/v1/responses", {"model": "tiny", "input": "Small.", "max_output_tokens": 1})
        assert status == 200 and r["store"] is True and raw(s, "GET", f"/v1/responses/{r['id']}")[0] == 200
        assert s.stop(signal.SIGTERM) == 0, s.log()


def test_malformed_stored_records_are_404s(model_dir: Path, tmp_path: Path) -> None:
    """Issue 52.7: records planted under the names of ids (missing keys, wrong types, not
    JSON, over the byte bound, nested 100,000 deep, a symlink to a good record, a FIFO):
    ``GET``, ``previous_response_id`` and ``DELETE`` each answer a JSON 404, counted in
    ``GET /v1/cache/stats`` under ``responses.invalid_records``; the server keeps serving and
    nothing planted outside is touched."""
    from kvstore.serve.response_store import record_name

    cache = tmp_path / "cache"
    with Server(model_dir, cache, tmp_path / "server.log", ["--responses-max-bytes", "2M"]) as s:
        status, good = raw(s, "POST", "/v1/responses", {"model": "tiny", "input": QUESTION, "max_output_tokens": 1})
        assert status == 200
        d = cache / "responses"
        outside = tmp_path / "outside.json"
        outside.write_bytes((d / record_name(None, good["id"])).read_bytes())
        planted: dict[str, bytes | str] = {
            "resp_noresponse": json.dumps({"id": "resp_noresponse", "conversation": []}),
            "resp_noconversation": json.dumps({"id": "resp_noconversation", "response": {"id": "resp_noconversation"}}),
            "resp_stringconv": json.dumps({"id": "resp_stringconv", "response": {"id": "resp_stringconv"},
                                           "conversation": "hello"}),
            "resp_badmessage": json.dumps({"id": "resp_badmessage", "response": {"id": "resp_badmessage"},
                                           "conversation": [{"content": "no role"}]}),
            "resp_notjson": b"\x00\xffnot json{",
            "resp_huge": json.dumps({"id": "resp_huge", "response": {"id": "resp_huge", "x": "z" * 3_000_000},
                                     "conversation": []}),
            "resp_deep": b"[" * 100_000 + b"]" * 100_000,
        }
        for rid, data in planted.items():
            (d / record_name(None, rid)).write_bytes(data.encode() if isinstance(data, str) else data)
        (d / record_name(None, "resp_link")).symlink_to(outside)
        os.mkfifo(d / record_name(None, "resp_fifo"))
        ids = [*planted, "resp_link", "resp_fifo"]
        for rid in ids:
            for method, path, body in (("GET", f"/v1/responses/{rid}", None), ("DELETE", f"/v1/responses/{rid}", None),
                                       ("POST", "/v1/responses", {"model": "tiny", "previous_response_id": rid,
                                                                  "input": "x", "max_output_tokens": 1})):
                status, err = raw(s, method, path, body)  # a dropped connection raises here
                assert status == 404 and rid in err["error"]["message"], (rid, method, status, err, s.log())
        counts = s.stats()["responses"]
        assert counts["invalid_records"] == 3 * len(ids), counts
        assert counts["invalid_by_reason"] == {"bad_field": 12, "not_json": 3, "too_large": 3, "too_deep": 3,
                                               "not_regular": 6}, counts
        assert "Traceback" not in s.log(1 << 30)
        assert outside.exists() and (d / record_name(None, "resp_link")).is_symlink()
        assert stat.S_ISFIFO(os.lstat(d / record_name(None, "resp_fifo")).st_mode)
        assert raw(s, "GET", f"/v1/responses/{good['id']}")[0] == 200 and continue_(s, good["id"])[0] == 200
        long_id = "resp_" + "a" * 60_000  # an id no record has, of the longest a request line holds
        for method, path, body in (("GET", f"/v1/responses/{long_id}", None),
                                   ("POST", "/v1/responses", {"model": "tiny", "previous_response_id": long_id,
                                                              "input": "x", "max_output_tokens": 1})):
            status, err = raw(s, method, path, body)
            message = err["error"]["message"]
            assert status == 404 and len(message) < 200 and "(60,005 characters)" in message, (method, status, err)
        assert s.stop(signal.SIGTERM) == 0, s.log()
