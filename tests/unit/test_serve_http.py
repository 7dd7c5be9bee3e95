"""kvstore.serve.http: a request body's JSON nesting is bounded by its structure, not its text."""

from __future__ import annotations

import json

import pytest

from kvstore.serve.http import BodyError


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    """The depth bound reads the JSON's structure, not its text: a prompt full of brackets
    (code, a quoted bracket after an escaped quote) is accepted; the structure's own depth
    is what is refused."""
    from kvstore.serve.http import MAX_DEPTH, BodyError, nesting, parse_json

    text = "x = [[[[{{{{" * 500 + ' \\" [[[ \\\\'
    body = json.dumps({"messages": [{"role": "user", "content": text}], "deep": json.loads(nested(MAX_DEPTH - 1))})
    assert nesting(body.encode()) == MAX_DEPTH and parse_json(body.encode())["messages"][0]["content"] == text
    assert nesting(b'{"a": "]]]]", "b": [[["}"]]]}') == 4
    with pytest.raises(BodyError, match="levels deep") as e:
        parse_json(nested(MAX_DEPTH + 1).encode())
    assert e.value.status == 400


# -- a real HTTP server in this process (http.server), its handler admitting bodies as kvstore serve's does

import http.client
import io
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvstore.serve import http as kvhttp

LIMIT = 1000
PARSED = kvhttp.ParsedOnce()  # what mlx_lm.server's module gets as ``json``


class Handler(BaseHTTPRequestHandler):
    """Admits a POST's body (tenants._admit's way), then reads it again from rfile and
    ``json.loads`` it, as mlx_lm.server's handler does; GET and HEAD answer with the path.
    HTTP/1.0, as mlx_lm.server's APIHandler: one request per connection."""

    protocol_version = "HTTP/1.0"

    def do_POST(self) -> None:
        try:
            body = kvhttp.admit_body(self, LIMIT if self.path == "/limited" else None)
        except kvhttp.BodyError as e:
            kvhttp.send_json(self, e.status, {"error": str(e), "code": e.code, "loads": PARSED.loads("[1]"),
                                              "body_of": refusal(self)}, close=e.status in (411, 413))
            return
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        then = self.rfile.read(int(self.headers.get("X-Then", "0")))  # what the client sent after the body
        again = PARSED.loads(raw.decode())
        kvhttp.send_json(self, 200, {"body": body, "parsed_once": again is body, "body_of": kvhttp.body_of(self) is body,
                                     "loads_again": PARSED.loads(raw.decode()) is body, "then": then.decode()},
                         headers={"X-Route": "post"})

    def do_PUT(self) -> None:  # a route reading a body nothing admitted: body_of reads it now
        kvhttp.send_json(self, 200, {"body": kvhttp.body_of(self)})

    def do_GET(self) -> None:
        kvhttp.forget_body(self)
        reply = {"path": self.path, "loads": PARSED.loads("[1]")}
        if self.path == "/body":
            reply["body_of"] = refusal(self)
        kvhttp.send_json(self, 200, reply)

    def do_HEAD(self) -> None:  # kvstore.serve.server's do_HEAD
        if self.path == "/direct":  # send_json alone leaves a HEAD's body out too
            kvhttp.send_json(self, 200, {"path": self.path})
            return
        real = self.wfile
        self.wfile = kvhttp.HeadersOnly(real)
        try:
            self.do_GET()
        finally:
            self.wfile = real

    def log_message(self, *args: object) -> None:
        pass


def refusal(handler: Handler) -> object:
    """What a route asking for the body gets where none was admitted: the status of the
    BodyError raised (it is never handed None)."""
    try:
        got = kvhttp.body_of(handler)
    except kvhttp.BodyError as e:
        return e.status
    return f"no error: {got!r}"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def raw_request(port: int, data: bytes, *, close_write: bool = False) -> bytes:
    """Send ``data`` as is and read all the server sends until it closes (30 s per read at most)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while got := s.recv(65536):
            out += got
        return out


def reply_of(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_an_admitted_body_is_parsed_once_and_read_again_by_the_route(port: int) -> None:
    """The route, body_of and mlx_lm.server's json.loads get the one object admitted (its
    loads once: a second is json's own); its bytes are read again from rfile."""
    for n in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            sent = {"messages": [{"role": "user", "content": f"hi {n} ]]"}], "n": n}
            conn.request("POST", "/", body=json.dumps(sent), headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            assert r.status == 200 and r.getheader("Content-Type") == "application/json"
            assert r.getheader("Content-Length") == str(len(data)) and r.getheader("X-Route") == "post"
            assert r.getheader("Connection") is None
            got = json.loads(data)
            assert got == {"body": sent, "parsed_once": True, "body_of": True, "loads_again": False, "then": ""}
        finally:
            conn.close()


def test_a_refused_body_is_never_read_as_a_request(port: int) -> None:
    """A body refused as JSON holding a request of its own gets one answer, the 400: its bytes
    are not served as the next request on the connection."""
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: t\r\n\r\n"
    raw = raw_request(port, b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(smuggled) + smuggled)
    status, _, got = reply_of(raw)
    assert status == 400 and "not valid JSON" in got["error"] and b"/smuggled" not in raw


def test_a_body_exactly_at_the_limit_is_admitted(port: int) -> None:
    body = json.dumps({"pad": "x" * (LIMIT - 11)}).encode()
    assert len(body) == LIMIT
    status, _, got = reply_of(raw_request(port, b"POST /limited HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
                                                b"Connection: close\r\n\r\n" % len(body) + body))
    assert status == 200 and got["body"] == json.loads(body)


@pytest.mark.parametrize("head, body, status, code, words", [
    (b"", b"", 411, "length_required", "a POST needs a Content-Length header (chunked bodies are not read)"),
    (b"Content-Length: -1\r\n", b"", 400, "invalid_request_body", "invalid Content-Length header '-1'"),
    (b"Content-Length: " + b"x" * 60 + b"\r\n", b"", 400, "invalid_request_body",
     "invalid Content-Length header '" + "x" * 40 + "'"),
    (b"Content-Length: 1001\r\n", b"", 413, "request_too_large", "the request body is 1,001 bytes, over this server's limit of 1,000 "
     "(kvstore serve --max-body-bytes)"),
    (b"Content-Length: 0\r\n", b"", 400, "invalid_request_body", "not valid JSON"),
    (b"Content-Length: 4\r\n", b"\"\xff\"\n", 400, "invalid_request_body", "not UTF-8 text"),
    (b"Content-Length: 9\r\n", b"{\"a\": 1,}", 400, "invalid_request_body", "not valid JSON"),
    (b"Content-Length: 260\r\n", b"[" * 130 + b"]" * 130, 400, "too_deeply_nested", "130 levels deep; at most 128"),
    (b"Content-Length: 775\r\n", b'{"a":' * 129 + b"1" + b"}" * 129, 400, "too_deeply_nested", "129 levels deep"),
])
def test_an_unusable_body_is_refused_before_any_route(port: int, head: bytes, body: bytes, status: int, code: str,
                                                      words: str) -> None:
    raw = raw_request(port, b"POST /limited HTTP/1.1\r\nHost: t\r\n" + head + b"\r\n" + body, close_write=not body)
    got_status, headers, got = reply_of(raw)
    assert (got_status, got["code"]) == (status, code) and words in got["error"], got
    if status in (411, 413):
        assert got["error"] == words
    assert got["loads"] == [1] and isinstance(got["body_of"], int)  # asked again: refused again, never None
    assert (headers.get("connection") == "close") == (status in (411, 413))
    assert "x" * 41 not in got["error"]


def test_a_body_shorter_than_its_content_length_is_refused(port: int) -> None:
    raw = raw_request(port, b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n[1, 2, 3]", close_write=True)
    status, _, got = reply_of(raw)
    assert status == 400 and "ended after 9 of its 100 bytes" in got["error"], got
    assert got["body_of"] == 400  # asked again: the rest is gone, refused again


def test_head_sends_the_headers_of_get_and_no_body(port: int) -> None:
    for path, answer in (("/x", {"path": "/x", "loads": [1]}), ("/direct", {"path": "/direct"})):
        head, rest = raw_request(port, b"HEAD %s HTTP/1.1\r\nHost: t\r\n\r\n" % path.encode()).split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.0 200") and b"Content-Length: %d" % len(json.dumps(answer)) in head
        assert rest == b""
    status, _, got = reply_of(raw_request(port, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"))
    assert status == 200 and got == {"path": "/x", "loads": [1]}


def test_a_route_reading_a_body_nothing_admitted_reads_it_then(port: int) -> None:
    """body_of on a request no admission saw (PUT here) reads and parses it now; on a GET,
    whose admission was forgotten, it refuses (411), never hands out None."""
    status, _, got = reply_of(raw_request(port, b'PUT / HTTP/1.1\r\nHost: t\r\nContent-Length: 8\r\n\r\n{"a": 1}'))
    assert status == 200 and got == {"body": {"a": 1}}
    status, _, got = reply_of(raw_request(port, b"GET /body HTTP/1.1\r\nHost: t\r\n\r\n"))
    assert status == 200 and got == {"path": "/body", "loads": [1], "body_of": 411}


def test_what_follows_the_body_is_read_after_it(port: int) -> None:
    raw = raw_request(port, b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nX-Then: 4\r\n\r\n{}tail")
    status, _, got = reply_of(raw)
    assert status == 200 and got["body"] == {} and got["then"] == "tail"


def test_parsed_once_hands_out_the_admitted_object_only_for_its_text() -> None:
    assert kvhttp.ParsedOnce().__name__ == "json" and PARSED.dumps is json.dumps and PARSED.JSONDecodeError is json.JSONDecodeError
    fresh: list[object] = []
    thread = threading.Thread(target=lambda: fresh.append(PARSED.loads('{"a": 1}')))  # nothing admitted there
    thread.start()
    thread.join()
    assert fresh == [{"a": 1}]
    with pytest.raises(TypeError):
        PARSED.loads("1", None)  # json.loads takes no second positional argument
    admitted = kvhttp.AdmittedText('{"a": 1}', held := {"held": True})  # what an admitted body decodes to
    assert PARSED.loads('{"a": 2}') == {"a": 2} and PARSED.loads(b'{"a": 1}') == {"a": 1}
    assert PARSED.loads('{"a": 1}') == {"a": 1} and PARSED.loads('{"a": 1}') is not held  # another text: json's own
    assert PARSED.loads(admitted, parse_int=str) == {"a": "1"}  # arguments: json's own
    assert PARSED.loads(admitted) is held and PARSED.loads(admitted) == {"a": 1}  # once
    assert admitted.held == []


def test_replay_serves_the_read_body_then_the_rest_of_the_connection() -> None:
    r = kvhttp._Replay(b"abc\ndef", io.BytesIO(b"GET /\n rest"))
    assert r.readable() and r.read(0) == b"" and r.read(2) == b"ab" and r.readline() == b"c\n"
    assert r.read(None) == b"def" and r.read(3) == b"GET" and r.readline() == b" /\n"
    assert r.read(1) == b" " and r.read() == b"" and r.read(None) == b""  # all of it: only what was read already, never a block
    r = kvhttp._Replay(b"abcdef", io.BytesIO(b"line one\nline two\n"))
    assert r.readline(4) == b"abcd" and r.readline(None) == b"ef" and r.readline(4) == b"line"
    assert r.readline(None) == b" one\n" and r.read(-1) == b""
    buf = bytearray(4)
    r = kvhttp._Replay(b"xy", io.BytesIO(b"zzz"))
    assert r.readinto(buf) == 2 and bytes(buf) == b"xy\x00\x00" and r.readinto(buf) == 3 and bytes(buf[:3]) == b"zzz"


def test_headers_only_passes_the_head_and_nothing_after_it() -> None:
    out = io.BytesIO()
    h = kvhttp.HeadersOnly(out)
    assert h.writable()
    assert h.write(b"HTTP/1.1 200 OK\r\nA: 1\r") == 22 and h.write(b"\n\r\nbody") == 7 and h.write(b"more") == 4
    h.flush()
    assert out.getvalue() == b"HTTP/1.1 200 OK\r\nA: 1\r\n\r\n"
    out = io.BytesIO()
    h = kvhttp.HeadersOnly(out)
    h.write(memoryview(b"HTTP/1.1 200 OK\r\n\r\n{}\r\n\r\n{}"))
    assert out.getvalue() == b"HTTP/1.1 200 OK\r\n\r\n"  # the first blank line ends the head
    out = io.BytesIO()
    kvhttp.HeadersOnly(out).write(b"\r\n\r\nbody")
    assert out.getvalue() == b"\r\n\r\n"


def test_nesting_is_counted_across_chunks() -> None:
    from kvstore.serve.http import _CHUNK, nesting, parse_json

    deep = _CHUNK + 5
    assert nesting(b"[" * deep + b"]" * deep) == deep
    assert nesting(b"[]" * _CHUNK + b"[[]]") == 2 and nesting(b"") == 0 and nesting(b"{}") == 1
    assert parse_json(b"[[1]]", max_depth=2) == [[1]] and parse_json(b'"x"', max_depth=0) == "x"
    with pytest.raises(BodyError, match="2 levels deep; at most 1"):
        parse_json(b"[[1]]", max_depth=1)
