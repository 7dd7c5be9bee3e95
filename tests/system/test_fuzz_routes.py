"""Schema-driven fuzzing of every route ``kvstore serve`` answers (issue 52.13), against one real
``kvstore serve`` (tiny-llama, ``--max-body-bytes 64K``) on 127.0.0.1.

schemathesis generates each route's requests from ``kvstore.serve.openapi.document()``
(what ``GET /openapi.json`` serves): valid ones with fields the schema does not name
(unknown fields), and, in its negative mode, malformed bodies, wrong types and values out of
range. Hand-written hostile requests add what a schema cannot say: bodies over the limit,
nesting 32,000 levels deep, invalid UTF-8, Content-Length headers that lie. Every answer must
- not be a server error: no 5xx but a 503 with a JSON body (starting, busy), no dropped
  connection, no hang (a generous timeout);
- conform to the description: a declared status, its content type, its body's schema;
- leave the server serving (``/health`` answers 200 after every request, and the module ends
  with one good completion);
- for a refused POST (4xx), store nothing: no prompt-cache lookup made (the cache's lookup
  counters unchanged: a request that never reached the cache cannot have stored a prefix) and
  no new stored response (every file that appears in ``<cache>/responses`` is one a 2xx
  answer named).

The budget is fixed and reproducible: ``POST_EXAMPLES`` cases per POST route and mode,
``EXAMPLES`` per other route and mode, hypothesis derandomized (the same cases on every run),
no deadline, no shrinking (a failure is reported as the requests that failed, as curl): the
module ran in 2.2 min at a load of 3, 5.6 min at 7 (with 40 per POST), on 2 shared cores.
Generated max_tokens-like fields are capped at ``MAX_NEW_TOKENS`` so a valid request
generates a few tokens only. What it found is kept as plain regression
cases (``FOUND``), each a 400 now and the server serving after it.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from kvstore.serve.openapi import document
from tests.support.servers import HOST, Server

LIMIT = 64 << 10  # the server's --max-body-bytes
EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 12}  # per GET/HEAD/DELETE route and mode
POST_EXAMPLES = 30  # per POST route and mode
MAX_NEW_TOKENS = 4
TIMEOUT = 300.0  # a hang, not a slow answer: the machine may be loaded
CAPPED = ("max_tokens", "max_completion_tokens", "max_output_tokens")
LOOKUPS = ("hits_memory", "hits_disk", "hits_shared", "misses")
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
SCHEMA = schemathesis.openapi.from_dict(document(LIMIT))
ROUTES = [(r.ok().method.upper(), r.ok().path) for r in SCHEMA.get_all_operations()]
POSTS = [path for method, path in ROUTES if method == "POST"]
# negative mode needs something to negate: a body or a query parameter (a path's string id has no wrong value)
NEGATABLE = {(m, p) for m, p in ROUTES if m == "POST" or p in ("/v1/cache/stats", "/v1/responses/{id}") and m != "HEAD"}
CASES = [(m, p, mode) for m, p in ROUTES for mode in EXAMPLES if mode == GenerationMode.POSITIVE or (m, p) in NEGATABLE]
GOOD = {  # one valid body per POST route (what the hostile cases are checked against)
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 2},
}


class Watch:
    """What the server has stored and answered so far: the lookups counted, the response
    records on disk, and the response ids 2xx answers named."""

    def __init__(self, server: Server, cache: Path) -> None:
        self.server, self.records = server, cache / "responses"
        self.named: set[str] = set()

    def lookups(self) -> int:
        stats = self.server.get("/v1/cache/stats", timeout=TIMEOUT)
        return sum(int(stats.get(k, 0)) for k in LOOKUPS)

    def files(self) -> set[str]:
        return {p.name for p in self.records.iterdir()} if self.records.is_dir() else set()

    def snapshot(self) -> tuple[int, set[str]]:
        return self.lookups(), self.files()

    def saw(self, status: int, text: str) -> None:
        if 200 <= status < 300:
            self.named.update(RESPONSE_ID.findall(text))

    def problems(self, method: str, status: int, content_type: str, text: str,
                 before: tuple[int, set[str]]) -> list[str]:
        """Every rule the answer (``status``, its body ``text``) broke; [] when none."""
        out = []
        if status >= 500 and not (status == 503 and content_type.startswith("application/json") and _is_json(text)):
            out.append(f"a server error: {status} {text[:400]!r}")
        try:
            with urllib.request.urlopen(self.server.url + "/health", timeout=TIMEOUT) as r:
                if r.status != 200:
                    out.append(f"/health answered {r.status} afterwards")
        except (urllib.error.URLError, OSError) as e:
            out.append(f"/health failed afterwards: {e}")
            return out
        if method == "POST" and 400 <= status < 500:
            lookups, files = self.snapshot()
            if lookups != before[0]:
                out.append(f"a refused request reached the prompt cache ({lookups - before[0]} lookups)")
            for name in sorted(files - before[1]):
                try:
                    rid = json.loads((self.records / name).read_text()).get("id")
                except (OSError, ValueError):
                    continue  # removed meanwhile (the store's bound) or written by nobody we know
                if rid not in self.named:
                    out.append(f"a refused request stored a response ({rid!r} in {name})")
        return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Watch]]:
    from tools.testing.model_builds import model_path

    tmp = tmp_path_factory.mktemp("fuzz")
    with Server(model_path("tiny-llama"), tmp / "cache", tmp / "server.log",
                ["--max-body-bytes", f"{LIMIT}B", "--max-tokens", str(MAX_NEW_TOKENS)]) as s:
        yield s, Watch(s, tmp / "cache")
        good(s)  # still serving after everything the module sent


def good(server: Server) -> None:
    """One valid request on every POST route answers 200."""
    for path, body in GOOD.items():
        assert server.post(path, body, timeout=TIMEOUT), path


def capped(case: Any) -> Any:
    """``case`` with every generated max_tokens-like integer at most MAX_NEW_TOKENS."""
    if isinstance(case.body, dict):
        for key in CAPPED:
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_NEW_TOKENS:
                case.body[key] = MAX_NEW_TOKENS
    return case


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_every_generated_request_is_answered_and_refusals_store_nothing(
        served: tuple[Server, Watch], method: str, path: str, mode: GenerationMode) -> None:
    server, watch = served
    operation = SCHEMA[path][method]
    failures: list[str] = []

    @settings(max_examples=POST_EXAMPLES if method == "POST" else EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode).map(capped))
    def one(case: Any) -> None:
        before = watch.snapshot() if method == "POST" else (0, set())
        try:
            response = case.call(base_url=server.url, timeout=TIMEOUT)
        except requests.RequestException as e:
            failures.append(f"{e!r}: the connection failed\n{case.as_curl_command()}")
            return
        watch.saw(response.status_code, response.text)
        found = watch.problems(method, response.status_code, response.headers.get("Content-Type", ""),
                               response.text, before)
        try:
            case.validate_response(response, checks=[status_code_conformance, content_type_conformance,
                                                     response_schema_conformance])
        except AssertionError as e:  # schemathesis' FailureGroup: every check that failed
            found.append(f"does not conform to the description: {str(e)[:1500]}")
        if found:
            failures.append("; ".join(found) + f"\n{case.as_curl_command()[:3000]}")

    one()
    assert not failures, f"{len(failures)} of the cases failed:\n\n" + "\n\n".join(failures[:5]) + "\n" + server.log(3000)


# -- hostile bodies a schema cannot describe ------------------------------------------------------


def exchange(server: Server, raw: bytes, *, half_close: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` (a whole HTTP request, as bytes) on a fresh connection; (status, headers,
    body) of the answer, read until the server closes or Content-Length is met. A connection
    closed without an answer fails."""
    with socket.create_connection((HOST, server.port), timeout=TIMEOUT) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            assert got, f"the connection closed without an answer ({data!r})\n{server.log(3000)}"
            data += got
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        want = int(headers.get("content-length", -1))
        while want < 0 or len(body) < want:
            got = s.recv(65536)
            if not got:
                break
            body += got
        return int(lines[0].split()[1]), headers, body


def request(path: str, body: bytes, length: int | None = -1, extra: str = "") -> bytes:
    """A POST of ``body`` to ``path`` saying ``Content-Length: length`` (-1: the body's
    true length; None: no such header), with ``extra`` header lines."""
    head = f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\nConnection: close\r\n"
    length = len(body) if length == -1 else length
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + extra + "\r\n").encode() + body


HOSTILE = {  # name: (request for a path, the statuses it may get)
    "oversized": (lambda p: request(p, b"{}", LIMIT + 1), {413}),
    "oversized, sent": (lambda p: request(p, b'{"x": "' + b"a" * LIMIT + b'"}', LIMIT + 10), {413}),
    "32000 levels of arrays": (lambda p: request(p, b"[" * 32000 + b"]" * 32000), {400}),
    "10000 levels of objects": (lambda p: request(p, b'{"a":' * 10000 + b"1" + b"}" * 10000), {400}),
    "deep inside a valid body": (lambda p: request(p, json.dumps({**GOOD[p], "extra": 1}).encode()
                                                   .replace(b"1}", b"[" * 5000 + b"]" * 5000 + b"}")), {400}),
    "invalid UTF-8": (lambda p: request(p, b'{"prompt": "\xff\xfe\xc3", "messages": "\xed\xa0\x80"}'), {400}),
    "not JSON": (lambda p: request(p, b"{'a': 1,}"), {400}),
    "JSON, not an object": (lambda p: request(p, b'["messages"]'), {400}),
    "no Content-Length": (lambda p: request(p, b"{}", None), {411}),
    "chunked": (lambda p: request(p, b"2\r\n{}\r\n0\r\n\r\n", None, extra="Transfer-Encoding: chunked\r\n"), {411}),
    "negative Content-Length": (lambda p: request(p, b"{}", -2), {400}),
    "Content-Length not a number": (lambda p: request(p, b"{}", None, extra="Content-Length: 2x\r\n"), {400}),
    "Content-Length over the bytes sent": (lambda p: request(p, b'{"a": 1}', 500), {400}),
    "Content-Length under the bytes sent": (lambda p: request(p, json.dumps(GOOD[p]).encode(), 10), {400}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_bodies_are_refused_in_the_routes_shape(served: tuple[Server, Watch], name: str) -> None:
    server, watch = served
    make, statuses = HOSTILE[name]
    for path in POSTS:
        before = watch.snapshot()
        status, headers, body = exchange(server, make(path), half_close=name == "Content-Length over the bytes sent")
        text = body.decode(errors="replace")
        assert status in statuses, f"{path} {name}: {status} {text[:400]!r}\n{server.log(3000)}"
        error = json.loads(body)
        message = error["error"]["message"] if isinstance(error.get("error"), dict) else error.get("error")
        assert isinstance(message, str) and message, (path, name, error)
        if path.startswith("/v1/messages"):
            assert error["type"] == "error", (path, name, error)  # Anthropic's shape
        assert watch.problems("POST", status, headers.get("content-type", ""), text, before) == [], (path, name)
    good(server)


def test_a_body_that_never_ends_does_not_stop_the_server(served: tuple[Server, Watch]) -> None:
    """A client that promises more bytes than it sends holds only its own connection."""
    server, _ = served
    with socket.create_connection((HOST, server.port), timeout=TIMEOUT) as s:
        s.sendall(request("/v1/chat/completions", b'{"messages": [', 4000))
        good(server)


# -- what the fuzzing found: each value ended mlx_lm.server's generation thread (every later
# request 404, /health 503), corrupted its heap, or closed the connection with no answer ---------

CHAT = [{"role": "user", "content": "Hi"}]
FOUND = {  # name: (path, body, the field the 400 names)
    "an empty prompt": ("/v1/completions", {"prompt": ""}, "prompt"),
    "a stop that is not text": ("/v1/chat/completions", {"messages": CHAT, "stop": [1]}, "stop"),
    "a logit_bias id past 64 bits": ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"1" + "0" * 20: 1}},
                                     "logit_bias"),
    "a logit_bias id past the vocabulary": ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"100000": 1}},
                                            "logit_bias"),
    "a top_k past the vocabulary": ("/v1/chat/completions", {"messages": CHAT, "temperature": 1.0, "top_k": 100000},
                                    "top_k"),
    "a context size past 32 bits": ("/v1/chat/completions", {"messages": CHAT, "repetition_penalty": 1.5,
                                                             "repetition_context_size": 1 << 40},
                                    "repetition_context_size"),
    "a seed past 64 bits": ("/v1/completions", {"prompt": "Hi", "seed": 1 << 64}, "seed"),
    "a Messages top_k past the vocabulary": ("/v1/messages", {"max_tokens": 2, "messages": CHAT, "temperature": 1.0,
                                                              "top_k": 100000}, None),
    # a list where a name is expected: a set lookup raised TypeError (a dropped connection, or a 500)
    "a list as reasoning.effort": ("/v1/responses", {"input": "Hi", "reasoning": {"effort": ["low"]}},
                                   "reasoning.effort"),
    "a list as a tool's type": ("/v1/responses", {"input": "Hi", "tools": [{"type": ["function"]}]}, "tools[0].type"),
    "a list as tool_choice's type": ("/v1/responses", {"input": "Hi", "tool_choice": {"type": ["web_search"]}},
                                     "tool_choice"),
    "a list as tool_choice's name": ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "f"}],
                                                       "tool_choice": {"type": "function", "name": ["f"]}},
                                     "tool_choice.name"),
    "a list as thinking's type": ("/v1/messages", {"max_tokens": 2, "messages": CHAT, "thinking": {"type": ["enabled"]}},
                                  None),
    "a list as a Messages tool_choice name": ("/v1/messages", {"max_tokens": 2, "messages": CHAT, "tools": [
        {"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": ["f"]}}, None),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_what_the_fuzzing_found_is_a_400_and_the_server_goes_on(served: tuple[Server, Watch], name: str) -> None:
    server, watch = served
    path, body, param = FOUND[name]
    before = watch.snapshot()
    status, headers, raw = exchange(server, request(path, json.dumps(body).encode()))
    assert status == 400, f"{name}: {status} {raw[:400]!r}\n{server.log(3000)}"
    error = json.loads(raw)["error"]
    assert error["message"] and (param is None or error["param"] == param), error
    assert watch.problems("POST", status, headers.get("content-type", ""), raw.decode(), before) == []
    good(server)
