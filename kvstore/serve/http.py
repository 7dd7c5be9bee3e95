"""The one way kvstore's HTTP routes read a request's JSON body and answer with JSON (on
mlx_lm.server's ``APIHandler``).

A POST body is read and parsed once, when the request is admitted (``admit_body``, called
by ``kvstore.serve.tenants`` before any route runs), and that object is what every route
gets: kvstore's own routes through ``body_of``, mlx_lm.server's through its own
``json.loads`` of the same text, which returns the object already parsed (``ParsedOnce``:
the bytes it reads again decode to a text that carries the object, once; nothing is kept
per thread).
So kvstore's checks (``cache_salt``, keys) and the route can never read two different
bodies. A body that cannot be used is refused before any route sees it (``BodyError``):
over ``MAX_BODY_BYTES`` (413, said before a byte of it is read), no Content-Length (411),
not UTF-8 JSON, or nested deeper than ``MAX_DEPTH`` (400; Python's parser would otherwise
hit the interpreter's recursion limit at a depth that depends on the calling thread's stack).
"""

from __future__ import annotations

import io
import json
import re
import types
from typing import Any

import numpy as np

# --max-body-bytes' default: Anthropic's own limit for a Messages request. A body is held
# whole while it is parsed, and tokenizing its text costs ~250x its size in memory
# (count_tokens): this bounds both.
MAX_BODY_BYTES = 32 << 20
MAX_DEPTH = 128  # JSON nesting: far beyond any real tool schema, far below the recursion limit
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_CHUNK = 1 << 20
_BODY = "_kvstore_body"  # APIHandler attribute: the current request's parsed body
_CHAT = "_kvstore_chat"  # APIHandler attribute: the chat body a translated route hands mlx_lm.server
_NONE = object()


class BodyError(ValueError):
    """A request body refused before any route reads it: ``status`` (400, 411, 413) and an
    error ``code`` for the API's error object."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_body",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def nesting(raw: bytes) -> int:
    """How deep ``raw`` (JSON text) nests arrays and objects: brackets inside strings do not
    count. Linear time, no recursion (what decides whether parsing it is safe): about 1.5 s
    for 32 MiB of brackets on a loaded 2-core machine, up to ~14 s for 32 MiB made of
    16 million tiny strings (one regex match each)."""
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    depth = top = 0
    for i in range(0, len(brackets), _CHUNK):
        part = brackets[i : i + _CHUNK]
        run = np.cumsum(np.where((part == ord("[")) | (part == ord("{")), 1, -1), dtype=np.int64) + depth
        top, depth = max(top, int(run.max())), int(run[-1])
    return top


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as JSON (UTF-8, as mlx_lm.server decodes it), or BodyError (400) saying why not."""
    return _parse(raw, max_depth)[1]


def _parse(raw: bytes, max_depth: int = MAX_DEPTH) -> tuple[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"the request body is not UTF-8 text: {e}") from None
    depth = nesting(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0  # fewer: cannot be deeper
    if depth > max_depth:
        raise BodyError(400, f"the request body nests arrays and objects {depth} levels deep; at most "
                             f"{max_depth} are accepted", "too_deeply_nested")
    try:
        return text, json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BodyError(400, f"the request body is not valid JSON: {e}") from None


def admit_body(handler: Any, limit: int | None = None) -> Any:
    """Read and parse the JSON body of the POST ``handler`` is serving, once: kept for the
    route (``body_of``), its bytes put back for mlx_lm.server's handler to read, and its
    text and object handed to mlx_lm.server's ``json.loads`` (``ParsedOnce``). Raises
    BodyError: 411 without a Content-Length, 413 over ``limit`` bytes (default
    ``MAX_BODY_BYTES``), before reading any of it; 400 for a body that is not usable JSON."""
    limit = MAX_BODY_BYTES if limit is None else limit
    setattr(handler, _BODY, _NONE)
    length = handler.headers.get("Content-Length")
    if length is None:
        raise BodyError(411, "a POST needs a Content-Length header (chunked bodies are not read)", "length_required")
    try:
        n = int(length)
        if n < 0:
            raise ValueError
    except ValueError:
        raise BodyError(400, f"invalid Content-Length header {length[:40]!r}") from None
    if n > limit:
        raise BodyError(413, f"the request body is {n:,} bytes, over this server's limit of {limit:,} "
                             "(kvstore serve --max-body-bytes)", "request_too_large")
    raw = handler.rfile.read(n)
    if len(raw) < n:
        raise BodyError(400, f"the request body ended after {len(raw):,} of its {n:,} bytes (Content-Length)")
    replay = handler.rfile = _Replay(raw, handler.rfile)
    text, body = _parse(raw)
    setattr(handler, _BODY, body)
    replay.held = (text, body)
    return body


def hand_over(handler: Any, chat: dict[str, Any] | None) -> None:
    """``chat`` is the body mlx_lm.server's handler reads next on ``handler`` (a translated
    route's ``/v1/chat/completions`` body; None: the request's own again)."""
    setattr(handler, _CHAT, chat)


def route_body(handler: Any) -> Any:
    """The body mlx_lm.server's handler runs on ``handler``: a translated route's chat body
    (``hand_over``), else the request's own (``body_of``)."""
    chat = getattr(handler, _CHAT, None)
    return chat if chat is not None else body_of(handler)


def forget_body(handler: Any) -> None:
    """The request ``handler`` serves now has no admitted body (not a POST)."""
    setattr(handler, _BODY, _NONE)


def body_of(handler: Any) -> Any:
    """The parsed body of the request ``handler`` serves: the one admitted, else read and
    parsed now (``admit_body``; BodyError)."""
    got = getattr(handler, _BODY, _NONE)
    return admit_body(handler) if got is _NONE else got


class ParsedOnce(types.ModuleType):
    """Stands in for ``json`` in mlx_lm.server's module: ``loads`` of an admitted body's text
    (``AdmittedText``: what its bytes, read again from the handler's ``rfile``, decode to)
    returns the object parsed then (once); everything else, and any other text, is
    ``json``'s own."""

    def __init__(self) -> None:
        super().__init__("json")

    def __getattr__(self, name: str) -> Any:
        return getattr(json, name)

    def loads(self, s: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(s, AdmittedText) and not args and not kwargs and s.held:
            return s.held.pop()
        return json.loads(s, *args, **kwargs)


class AdmittedText(str):
    """An admitted body's text with the object parsed from it, handed out once (``ParsedOnce``)."""

    held: list[Any]

    def __new__(cls, text: str, parsed: Any) -> AdmittedText:
        self = super().__new__(cls, text)
        self.held = [parsed]
        return self


class _AdmittedBytes(bytes):
    """An admitted body's bytes, read again whole: ``decode()`` (UTF-8, as mlx_lm.server
    decodes) is its text carrying the parsed object, the first time."""

    held: tuple[str, Any] | None

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        held, self.held = getattr(self, "held", None), None
        if held is not None and encoding.lower().replace("-", "") == "utf8" and errors == "strict":
            return AdmittedText(*held)
        return bytes(self).decode(encoding, errors)


class _Replay(io.RawIOBase):
    """A request's body, already read, served again before the rest of the connection."""

    def __init__(self, head: bytes, rest: Any) -> None:
        super().__init__()
        self._head = io.BytesIO(head)
        self._rest = rest
        self._size = len(head)
        self.held: tuple[str, Any] | None = None  # (its text, the object): for the first whole read

    def readable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        if self.held is not None and self._head.tell() == 0 and n is not None and n == self._size:
            whole = _AdmittedBytes(self._head.read(n))  # mlx_lm.server's read of the body, then its decode
            whole.held, self.held = self.held, None
            return whole
        got = self._head.read(n if n is not None and n >= 0 else -1)
        if got or n == 0:
            return got
        return self._rest.read(n) if n is not None and n >= 0 else b""

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def readline(self, limit: int | None = -1) -> bytes:
        got = self._head.readline(-1 if limit is None else limit)
        return got if got else self._rest.readline(-1 if limit is None else limit)


class Written(io.RawIOBase):
    """Stands in for the handler's ``wfile`` while mlx_lm.server's own handler runs: passes
    every write on and counts the bytes (0: nothing of an answer has left yet)."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self._out, self.count = out, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._out.write(data)
        self.count += len(data)
        return int(n) if n is not None else len(data)

    def flush(self) -> None:
        self._out.flush()


class HeadersOnly(io.RawIOBase):
    """Stands in for the handler's ``wfile`` while a GET route answers a HEAD request:
    the status line and headers go through, the body does not."""

    def __init__(self, out: Any) -> None:
        super().__init__()
        self._out, self._seen, self._done = out, b"", False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        if not self._done:
            self._seen += data
            end = self._seen.find(b"\r\n\r\n")
            if end >= 0:
                self._done = True
                keep = len(data) - (len(self._seen) - end - 4)  # this write's bytes up to the blank line
                self._out.write(data[: max(keep, 0)])
            else:
                self._out.write(data)
        return len(data)

    def flush(self) -> None:
        self._out.flush()


def send_json(handler: Any, status: int, obj: Any, *, headers: dict[str, str] | None = None,
              close: bool = False) -> None:
    """Write ``obj`` as a complete JSON response: status, Content-Type, Content-Length,
    any extra ``headers``, and with ``close`` the connection marked to close after it
    (the body is left out when answering a HEAD request)."""
    body = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    if close:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    if getattr(handler, "command", None) != "HEAD":
        handler.wfile.write(body)
