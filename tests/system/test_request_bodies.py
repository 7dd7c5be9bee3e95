"""Request bodies and methods as an attacker (or a careless client) sends them, against a real
``kvstore serve`` process (tiny-llama) over real sockets:

- a body is parsed once, before any route, with a bound on its nesting: a body too deep to
  parse safely is a 400 in the route's own error shape, never "no body" (which let a
  ``cache_salt`` of the wrong type through, and stored the prompt unsalted) and never a
  dropped connection (``/v1/messages`` and ``count_tokens`` closed it, a RecursionError in
  the log); nothing refused is stored, and the server goes on serving;
- a body over ``--max-body-bytes`` is a 413 said before any of it is read;
- ``HEAD`` answers every GET route as GET does, without a body; unknown paths 404;
- an API key that can never match is refused at start, and a key file saved with a
  byte-order mark works.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.children import child_env
from tests.support.servers import Server, serve_command
from tests.unit.test_serve_http import nested

KEY = "reliability-key-0001"
FILE_KEY = "key-from-a-file-with-a-bom"
QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tools.testing.model_builds import model_path

    tmp = tmp_path_factory.mktemp("bodies")
    keys = tmp / "keys.txt"
    keys.write_bytes(b"\xef\xbb\xbf" + FILE_KEY.encode() + b"\r\n")  # Notepad's UTF-8: a BOM, CRLF
    with Server(model_path("tiny-llama"), tmp / "cache", tmp / "log",
                ["--api-key", KEY, "--api-key-file", str(keys)]) as s:
        yield s


def post(server: Server, path: str, raw: bytes, key: str = KEY, timeout: float = 120) -> tuple[int, Any]:
    """(status, parsed JSON) of one POST of ``raw`` bytes; a dropped connection raises."""
    req = urllib.request.Request(server.url + path, data=raw, method="POST",
                                 headers={"Content-Type": "application/json", "x-api-key": key})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stats(server: Server) -> dict[str, Any]:
    req = urllib.request.Request(server.url + "/v1/cache/stats", headers={"x-api-key": KEY})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def openai_error(got: Any) -> str:
    assert set(got) == {"error"} and {"message", "type", "param", "code"} <= set(got["error"]), got
    return str(got["error"]["message"])


def anthropic_error(got: Any, kind: str = "invalid_request_error") -> str:
    assert got["type"] == "error" and got["error"]["type"] == kind, got
    return str(got["error"]["message"])


def chat_body(extra: str = "", salt: str = "") -> bytes:
    head = json.dumps({"messages": QUESTION, "max_tokens": 1, "temperature": 0})[:-1]
    return f'{head}{salt}{extra}}}'.encode()


def test_a_deep_body_is_refused_in_the_routes_shape_and_never_read_as_no_body(server: Server) -> None:
    """Issue 41.2: at ~982 levels kvstore's first parse gave up (RecursionError) and took the
    body for "no body" while mlx-lm's own parse succeeded: ``cache_salt: 5`` was served (200)
    and the prompt stored unsalted. Every depth from the bound to far past the recursion
    limit is a 400 now, naming the depth, and nothing is stored."""
    answers: dict[int, tuple[Any, str]] = {}
    for depth in [129, *range(960, 1000), 1040, 5000, 100_000]:
        try:
            status, got = post(server, "/v1/chat/completions", chat_body(f', "x": {nested(depth)}', ', "cache_salt": 5'))
            answers[depth] = (status, openai_error(got) if status != 200 else "served")
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
            answers[depth] = ("no answer", repr(e))
    wrong: dict[str, list[int]] = {}
    for depth, (status, message) in answers.items():
        if status != 400 or "levels deep" not in message:
            wrong.setdefault(f"{status} {message[:80]}", []).append(depth)
    assert not wrong, "; ".join(f"depths {d}: {outcome}" for outcome, d in wrong.items())
    for raw in (b"{", b'{"messages": ', b"\xff\xfe{}", b"", b"[1] [2]"):
        status, got = post(server, "/v1/chat/completions", raw)
        assert status == 400, (raw, status, got)
        openai_error(got)
    got = stats(server)
    assert got["memory_entries"] == 0 and got["misses"] == 0, got  # nothing refused reached the cache
    status, got = post(server, "/v1/chat/completions", chat_body(f', "x": {nested(100)}', ', "cache_salt": 5'))
    assert status == 400 and got["error"]["param"] == "cache_salt", got  # the salt is read, at any legal depth
    status, got = post(server, "/v1/chat/completions", chat_body(f', "x": {nested(100)}', ', "cache_salt": "s1"'))
    assert status == 200 and got["choices"], got  # a body within the bound is served
    assert stats(server)["memory_entries"] >= 1


def test_messages_and_count_tokens_answer_every_broken_body(server: Server) -> None:
    """Issue 41.3: ``/v1/messages`` and ``count_tokens`` with a body nested 1,000 / 5,000 /
    100,000 deep got no HTTP answer at all. Each is an Anthropic 400 now, as is a body that
    is not JSON; the server answers the next request."""
    before = stats(server)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for depth in (1000, 5000, 100_000):
            body = json.dumps({"model": "m", "max_tokens": 1, "messages": QUESTION})[:-1] + f', "metadata": {nested(depth)}}}'
            status, got = post(server, path, body.encode())
            assert status == 400 and "levels deep" in anthropic_error(got), (path, depth, got)
        for raw in (b"{", b"\xff", b"null", b"[]"):
            status, got = post(server, path, raw)
            assert status == 400, (path, raw, got)
            anthropic_error(got)
    after = stats(server)
    assert after["memory_entries"] == before["memory_entries"] and after["misses"] == before["misses"], after
    status, got = post(server, "/v1/messages/count_tokens",
                       json.dumps({"model": "m", "messages": QUESTION}).encode())
    assert status == 200 and got["input_tokens"] > 0, got


def raw_request(server: Server, head: str, timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` (request line and headers, no body) on a fresh socket; read the answer
    until the server closes: (status, headers, every byte after them)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(head.encode() + b"\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def test_a_body_over_the_limit_is_413_before_it_is_read(server: Server) -> None:
    """Issue 41.5: bodies had no bound (a 4 MB count_tokens body took the server to 1.16 GB).
    A Content-Length over --max-body-bytes (32 MiB by default) is answered 413 in the route's
    shape at once: the body is never sent here, so a server that waited to read it would
    never answer."""
    too_big = (32 << 20) + 1
    for path, anthropic in (("/v1/messages/count_tokens", True), ("/v1/messages", True),
                            ("/v1/chat/completions", False)):
        status, _, rest = raw_request(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n"
                                              f"Content-Type: application/json\r\nContent-Length: {too_big}\r\n")
        got = json.loads(rest)
        assert status == 413, (path, status, got)
        message = anthropic_error(got, "request_too_large") if anthropic else openai_error(got)
        assert "--max-body-bytes" in message and f"{too_big:,}" in message, message
    status, _, rest = raw_request(server, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\n")
    assert status == 411 and "Content-Length" in openai_error(json.loads(rest))
    status, got = post(server, "/v1/messages/count_tokens", json.dumps({"model": "m", "messages": QUESTION}).encode())
    assert status == 200 and got["input_tokens"] > 0, got  # still serving


def test_head_answers_every_get_route_without_a_body(server: Server) -> None:
    """Issue 41.6: ``HEAD /`` (Claude Code's first request) answered 501. HEAD of a GET route
    answers as GET does, headers only; an unknown path is 404; without a key, 401."""
    for path, want in (("/health", 200), ("/v1/models", 200), ("/v1/cache/stats", 200), ("/metrics", 200),
                       ("/", 404), ("/nowhere", 404), ("/v1/models/not-served", 404)):
        status, headers, rest = raw_request(server, f"HEAD {path} HTTP/1.0\r\nx-api-key: {KEY}\r\n")
        assert (status, rest) == (want, b""), (path, status, rest[:200])
        get = urllib.request.Request(server.url + path, headers={"x-api-key": KEY})
        try:
            with urllib.request.urlopen(get, timeout=30) as r:
                assert r.status == want and headers.get("content-type") == r.headers["Content-Type"], path
        except urllib.error.HTTPError as e:
            assert e.code == want, (path, e.code)
    status, _, rest = raw_request(server, "HEAD /v1/cache/stats HTTP/1.0\r\n")
    assert (status, rest) == (401, b"")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # keep-alive: HEAD, then GET
    try:
        conn.request("HEAD", "/health")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b""
        conn.request("GET", "/health")
        assert json.loads(conn.getresponse().read()) == {"status": "ok"}
    finally:
        conn.close()


def test_a_key_file_with_a_byte_order_mark_is_read_as_its_key(server: Server) -> None:
    """Issue 41.4: a key file saved with a UTF-8 BOM started fine, then every request was 401
    (the BOM became part of the key). It is read as ``utf-8-sig``."""
    status, got = post(server, "/v1/messages/count_tokens", json.dumps({"model": "m", "messages": QUESTION}).encode(),
                       key=FILE_KEY)
    assert status == 200 and got["input_tokens"] > 0, got
    assert post(server, "/v1/messages/count_tokens", b"{}", key=FILE_KEY[1:])[0] == 401


@pytest.mark.parametrize("key", ["clé-secrète-0001", "ключ-0003", "naïve-key-0002"])
def test_a_key_that_can_never_match_is_refused_at_start(key: str, tmp_path: Path) -> None:
    """Issue 41.4: a non-ASCII --api-key started fine and then refused every request for ever
    (http.server reads header values as Latin-1; clients send UTF-8, or refuse non-ASCII
    headers). The start is refused, saying why, before the model is loaded."""
    p = subprocess.run([*serve_command(), "--model", str(tmp_path / "no-model"), "--api-key", key],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert p.returncode != 0 and "outside printable ASCII" in p.stderr, (p.returncode, p.stderr[-2000:])
    keys = tmp_path / "keys"
    keys.write_text(f"good-key-0001\n{key}\n", encoding="utf-8")
    p = subprocess.run([*serve_command(), "--model", str(tmp_path / "no-model"), "--api-key-file", str(keys)],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert p.returncode != 0 and "API key #2" in p.stderr and "outside printable ASCII" in p.stderr, p.stderr[-2000:]
