"""Record the requests a real agent CLI sends, for fixtures under tests/data/agent_requests/.

    python -m tools.testing.capture_agent_requests OUT_DIR [--port N]
    python -m tools.testing.capture_agent_requests OUT_DIR --drive CLI --fixture NAME

A tiny HTTP server on 127.0.0.1 that saves every POST body it receives as
``OUT_DIR/NNN-<path>.json`` and answers as a model that says "ok": an Anthropic Messages
reply (streamed or not) on ``/v1/messages``, ``{"input_tokens": 10}`` on
``count_tokens``, an OpenAI chat completion (streamed or not) elsewhere; with ``--read FILE``
a user's turn on ``/v1/messages`` is answered with a ``Read`` tool call of FILE first (the
client runs it and sends the result: a history with tool calls). Point Claude Code
(``ANTHROPIC_BASE_URL``) or OpenCode (an ``@ai-sdk/openai-compatible`` provider) at it.

``--drive CLI`` (a pin of tools/gates/agent_clis.py, installed) runs that CLI against it
itself, as the ``*_stable_*`` fixtures were made: ``NAME_first`` (a first turn in a fresh git
repo, clean tree), then app.py edited and TODO.md added, ``NAME_continue`` (``--continue``,
a new client process) and ``NAME_changed_tree`` (a new session on the changed tree), each the
step's conversation request (its largest body) written to tests/data/agent_requests/.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_COUNT = itertools.count(1)
_LOCK = threading.Lock()


def _sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


def anthropic_events(model: str) -> bytes:
    msg = {"id": "msg_rec", "type": "message", "role": "assistant", "model": model, "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
    return b"".join([
        _sse("message_start", {"type": "message_start", "message": msg}),
        _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "ok"}}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
        _sse("message_stop", {"type": "message_stop"})])


def chat_events(model: str) -> bytes:
    base = {"id": "chatcmpl-rec", "object": "chat.completion.chunk", "created": 0, "model": model}
    return b"".join([
        _sse(None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"},
                                         "finish_reason": None}]}),
        _sse(None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}),
        _sse(None, "[DONE]")])


READ_FILE = ""  # --read FILE: answer a user's text turn (on /v1/messages) with a Read tool call of FILE


def _asks(body: Any) -> bool:
    """The last message is the user's text (not a tool result): the model may call a tool."""
    last = (body.get("messages") or [{}])[-1] if isinstance(body, dict) else {}
    blocks = last.get("content") if isinstance(last.get("content"), list) else []
    return last.get("role") == "user" and not any(b.get("type") == "tool_result" for b in blocks)


def anthropic_tool_use(model: str, file: str) -> bytes:
    msg = {"id": "msg_rec", "type": "message", "role": "assistant", "model": model, "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
    call = {"type": "tool_use", "id": f"toolu_rec{next(_COUNT)}", "name": "Read", "input": {}}
    return b"".join([
        _sse("message_start", {"type": "message_start", "message": msg}),
        _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": call}),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps({"file_path": file})}}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
        _sse("message_stop", {"type": "message_stop"})])


class Recorder(BaseHTTPRequestHandler):
    out: Path

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._send(200, b"{}")

    def do_GET(self) -> None:
        self._send(200, json.dumps({"object": "list", "data": [{"id": "local", "object": "model"}]}).encode())

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        with _LOCK:
            n = next(_COUNT)
        name = path.strip("/").replace("/", "_") or "root"
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = raw.decode(errors="replace")
        (self.out / f"{n:03d}-{name}.json").write_text(json.dumps(
            {"path": self.path, "headers": {k: v for k, v in self.headers.items() if "key" not in k.lower()
                                            and "auth" not in k.lower()}, "body": body}, indent=1))
        model = body.get("model", "m") if isinstance(body, dict) else "m"
        stream = isinstance(body, dict) and bool(body.get("stream"))
        if path.endswith("/count_tokens"):
            self._send(200, b'{"input_tokens": 10}')
        elif path.endswith("/messages") and READ_FILE and _asks(body):
            self._send(200, anthropic_tool_use(model, READ_FILE), "text/event-stream")
        elif path.endswith("/messages"):
            if stream:
                self._send(200, anthropic_events(model), "text/event-stream")
            else:
                self._send(200, json.dumps({
                    "id": "msg_rec", "type": "message", "role": "assistant", "model": model,
                    "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 1}}).encode())
        elif stream:
            self._send(200, chat_events(model), "text/event-stream")
        else:
            self._send(200, json.dumps({
                "id": "chatcmpl-rec", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}).encode())

    def log_message(self, *args: Any) -> None:
        pass


def drive(cli: str, out: Path, fixture: str, data: Path) -> list[Path]:
    """Capture ``cli``'s first, continue and changed-tree requests as ``data/<fixture>_<step>.json``
    (the module's docstring); ``out`` holds every request and the CLI's home and project."""
    import datetime
    import subprocess

    from tools.gates import agent_clis

    if why := agent_clis.missing(cli):
        raise SystemExit(why)
    Recorder.out = out / "requests"
    Recorder.out.mkdir(parents=True, exist_ok=True)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    project = out / "project"
    agent_clis.git_project(project)
    env = agent_clis.cli_env(cli, out / "home", f"http://127.0.0.1:{httpd.server_address[1]}")
    package, version, _ = agent_clis.PINS[cli]
    whats = {"first": f"`{cli}` first turn in a fresh git repo (clean tree): the session's first request",
             "continue": "`--continue` after app.py was edited and TODO.md added (a new client process, same day)",
             "changed_tree": "a new session on the changed tree: its git status shows the edit"}
    written = []
    for step, cont in (("first", 0), ("continue", 1), ("changed_tree", 0)):
        if step == "continue":
            agent_clis.change_tree(project)
        before = set(Recorder.out.iterdir())
        subprocess.run(agent_clis.turn_command(cli, cont, agent_clis.PROMPTS[cont]), cwd=project, env=env,
                       capture_output=True, timeout=600, stdin=subprocess.DEVNULL, start_new_session=True)
        mine = sorted(set(Recorder.out.iterdir()) - before)
        if not mine:
            raise SystemExit(f"{cli} sent no request in step {step}")
        biggest = json.loads(max(mine, key=lambda f: f.stat().st_size).read_text())
        target = data / f"{fixture}_{step}.json"
        target.write_text(json.dumps({
            "client": f"{package.rsplit('/', 1)[-1]} {version}",
            "captured": f"{datetime.date.today()}, tools/testing/capture_agent_requests.py --drive {cli}",
            "what": whats[step], "path": biggest["path"], "user_agent": biggest["headers"].get("User-Agent", ""),
            "body": biggest["body"]}, indent=1) + "\n")
        written.append(target)
    httpd.shutdown()
    return written


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--read", default="", metavar="FILE",
                   help="answer each user turn on /v1/messages with a Read tool call of FILE (a session whose "
                        "history holds tool calls and results)")
    p.add_argument("--drive", metavar="CLI", help="run this pinned CLI against the recorder (see the module)")
    p.add_argument("--fixture", metavar="NAME", help="with --drive: the fixtures' name (NAME_first.json, ...)")
    p.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2] / "tests" / "data" / "agent_requests")
    a = p.parse_args()
    if a.drive:
        if not a.fixture:
            p.error("--drive needs --fixture NAME")
        for f in drive(a.drive, a.out, a.fixture, a.data):
            print(f)
        return
    global READ_FILE
    READ_FILE = a.read
    a.out.mkdir(parents=True, exist_ok=True)
    Recorder.out = a.out
    httpd = ThreadingHTTPServer(("127.0.0.1", a.port), Recorder)
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
