"""Run a translated request through mlx_lm.server's own chat handler and catch what it writes.

The routes kvstore adds for other APIs (``/v1/messages``: ``anthropic``, ``/v1/responses``:
``responses``) turn their request into the ``/v1/chat/completions`` body it means and hand
it to ``APIHandler.do_POST`` unchanged (``run_chat``): the same chat template rendering,
generation thread, prompt cache (kvstore's tiers, salted per tenant), segments, tool parser
and validation as an OpenAI chat client gets, so one conversation through any route hits
the same cache. What that handler writes is caught (``Capture``): a stream's chunks go to
the route's ``on_chunk`` as they come, anything else is kept for the route to translate.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Callable

from .http import body_of, hand_over
from ..escape import logger

log = logger("kvstore")


class Capture(io.RawIOBase):
    """Stands in for the handler's ``wfile`` while mlx_lm.server's chat handler runs: keeps
    the status line and headers it writes, then passes body bytes to ``on_body``."""

    def __init__(self, on_body: Callable[[bytes, "Capture"], None]) -> None:
        super().__init__()
        self.head = b""
        self.status: int | None = None
        self.stream = False
        self.on_body = on_body

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        data = bytes(data)
        if self.status is None:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return len(data)
            self.head, _, data = self.head.partition(b"\r\n\r\n")
            self.head += b"\r\n\r\n"
            self.status = int(self.head.split(b" ", 2)[1])
            self.stream = b"text/event-stream" in self.head.lower()
        if data:
            self.on_body(data, self)
        return len(data)


class Tap:
    """The handler's ``response_generator`` for one request: mlx-lm's own, whose ``generate``
    also keeps the GenerationContext and the tokens generated (for usage and stop reasons)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.ctx: Any = None
        self.tokens: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def generate(self, request: Any, args: Any, progress_callback: Any = None) -> Any:
        ctx, responses = self._inner.generate(request, args, progress_callback=progress_callback)
        self.ctx = ctx

        def watched() -> Any:
            for r in responses:
                self.tokens.append(r.token)
                yield r

        return ctx, watched()

    def prompt(self) -> tuple[int, int]:
        """(prompt tokens, tokens restored from the prompt cache, any tier)."""
        return (len(self.ctx.prompt), self.ctx.prompt_cache_count) if self.ctx is not None else (0, 0)


@dataclass
class Outcome:
    """What mlx_lm.server's chat handler did with one translated request."""

    cap: Capture
    body: bytes  # the answer's body when it was not a 200 stream
    tap: Tap
    failure: Exception | None  # raised after the answer began (mlx-lm lets it escape)

    @property
    def streamed(self) -> bool:
        """The handler answered 200 with an event stream (its head is already sent)."""
        return self.cap.stream and self.cap.status == 200


def read_json(handler: Any) -> Any:
    """The request's JSON body, parsed once when the request was admitted (``http.body_of``);
    ``http.BodyError`` (a ValueError with the status to answer) when it cannot be used."""
    return body_of(handler)


def chat_error(status: int, body: bytes) -> tuple[int, str]:
    """An mlx_lm.server error answer as (status, message) for a translated route: its 404
    is a request it could not render or run (the model is always the served one), so 400,
    unless the generation thread died (500)."""
    try:
        error = json.loads(body).get("error")
        text = str(error.get("message") if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        text = body.decode(errors="replace")[:500] or f"HTTP {status}"
    if status == 404:
        status = 500 if "generation thread died" in text else 400
    return status, text


def run_chat(handler: Any, original: Callable[[Any], None], chat: dict[str, Any], tap: Tap,
             on_chunk: Callable[[dict[str, Any] | None], None], route: str) -> Outcome | None:
    """Run ``chat`` (a ``/v1/chat/completions`` body) through ``original`` (mlx_lm.server's
    ``do_POST``) on ``handler``, generating through ``tap`` (a ``Tap`` of the handler's
    ``response_generator``). A 200 stream's head goes to the client as mlx-lm wrote it
    (status, CORS), then each chunk to ``on_chunk`` (None for a keepalive comment); the
    route writes its own events. None when the client went away (mlx-lm stopped the
    generation); else the Outcome, the handler's own wfile/rfile/path put back."""
    real_out, real_in, real_path, real_gen = handler.wfile, handler.rfile, handler.path, handler.response_generator
    body = io.BytesIO()
    pending = b""

    def head(cap: Capture) -> None:
        if cap.head:  # mlx-lm's own 200 event-stream head (status, CORS), then the route's events
            type(handler).log_request(handler, cap.status)  # the request's one access-log line
            real_out.write(cap.head)
            cap.head = b""

    def on_body(data: bytes, cap: Capture) -> None:
        nonlocal pending
        if not (cap.stream and cap.status == 200):
            body.write(data)
            return
        head(cap)
        pending += data
        while b"\n\n" in pending:
            event, _, pending = pending.partition(b"\n\n")
            line = event.decode(errors="replace").strip()
            if line.startswith(":"):
                on_chunk(None)
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                on_chunk(json.loads(line[5:]))
        real_out.flush()

    cap = Capture(on_body)
    raw = json.dumps(chat).encode()
    del handler.headers["Content-Length"]
    handler.headers["Content-Length"] = str(len(raw))
    handler.wfile, handler.rfile, handler.path, handler.response_generator = cap, io.BytesIO(raw), "/v1/chat/completions", tap
    # mlx-lm's answer is captured, not sent: its access-log line would be a second one for
    # this request (the route's answer, or the stream's head, logs it once)
    handler.log_request = lambda *args: None
    failure: Exception | None = None
    hand_over(handler, chat)  # what kvstore.serve.gen_args checks before mlx-lm runs it
    try:
        original(handler)
    except Exception as e:
        failure = e
        log.exception("kvstore: %s failed", route)
    finally:
        hand_over(handler, None)
        handler.wfile, handler.rfile, handler.path, handler.response_generator = real_out, real_in, real_path, real_gen
        del handler.log_request
    if isinstance(failure, (BrokenPipeError, ConnectionResetError)):
        return None
    if cap.stream and cap.status == 200:
        head(cap)
    return Outcome(cap, body.getvalue(), tap, failure)


def drop_buffered_head(handler: Any) -> None:
    """Forget a status line mlx-lm buffered but never sent (it failed before writing)."""
    handler._headers_buffer = []
