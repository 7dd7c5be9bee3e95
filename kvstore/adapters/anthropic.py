"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (the Anthropic Messages API) on
``kvstore serve``, by translation through mlx_lm.server's own chat handler.

A Messages request becomes the ``/v1/chat/completions`` body it means (system, messages,
tools, stop, sampling) and runs through ``APIHandler.do_POST`` unchanged: the same chat
template rendering, generation thread, prompt cache (kvstore's tiers), segments, tool parser
and validation as an OpenAI client gets. What that handler writes is caught and written back
as a Messages ``message`` or as Anthropic server-sent events; its errors as Anthropic error
objects with the matching status.

Usage maps Anthropic's way (their sum is the prompt): ``cache_read_input_tokens`` is
``cached_tokens`` (the prompt tokens kvstore restored from any tier), ``input_tokens`` the
prompt tokens computed for this request, ``cache_creation_input_tokens`` 0 (kvstore stores
every prompt; there are no ``cache_control`` breakpoints to bill).

Claude Code's per-request ``x-anthropic-billing-header: ...; cch=...;`` system text changes on
every request and would end every cached prefix at the first system token; it is left out of
the rendered prompt unless ``KEEP_BILLING_HEADER`` (``kvstore serve --keep-billing-header``).
"""

from __future__ import annotations

import io
import json
import logging
import types
import uuid
from typing import Any, Callable

from .http import send_json

log = logging.getLogger("kvstore")
BILLING_PREFIX = "x-anthropic-billing-header:"
KEEP_BILLING_HEADER = False
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error"}


class RequestError(ValueError):
    """A request the Messages API rejects: ``status`` and Anthropic's error type go back."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# -- request: Messages -> chat completions --------------------------------------------------


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise RequestError(message)


def _text(block: Any, where: str) -> str:
    _need(isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str),
          f"{where}: expected a text block ({{'type': 'text', 'text': ...}}), got {str(block)[:80]!r}")
    return str(block["text"])


def system_text(system: Any, keep_billing_header: bool = False) -> str | None:
    """``system`` (a string or text blocks) as one string, blocks joined by a newline, with
    a leading billing-header line dropped unless ``keep_billing_header``; None when empty."""
    if system is None:
        return None
    if isinstance(system, str):
        texts = [system]
    else:
        _need(isinstance(system, list), "system: expected a string or a list of text blocks")
        texts = [_text(b, f"system[{i}]") for i, b in enumerate(system)]
    if not keep_billing_header:
        texts = [t.partition("\n")[2] if t.startswith(BILLING_PREFIX) else t for t in texts]
    kept = "\n".join(t for t in texts if t)
    return kept or None


def _image(block: dict[str, Any], images: bool) -> dict[str, Any]:
    _need(images, "image blocks need a model with an image processor; the model served here has none")
    source = block.get("source") or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise RequestError("image block: source must be {'type': 'base64', 'media_type', 'data'} or {'type': 'url', 'url'}")
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> Any:
    """Chat content of text and image parts: one string when all are text."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _tool_result(block: dict[str, Any], images: bool) -> dict[str, Any]:
    _need(isinstance(block.get("tool_use_id"), str), "tool_result block: tool_use_id (a string) is required")
    body = block.get("content", "")
    if isinstance(body, str):
        content: Any = body
    else:
        _need(isinstance(body, list), "tool_result block: content must be a string or a list of blocks")
        content = _content([_image(b, images) if isinstance(b, dict) and b.get("type") == "image"
                            else {"type": "text", "text": _text(b, "tool_result content")} for b in body])
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _user(blocks: list[Any], images: bool) -> list[dict[str, Any]]:
    """One Messages user turn as chat messages: a ``tool`` message per tool_result and a
    ``user`` message per run of text/image blocks, in their order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            out.append(_tool_result(b, images))
        elif kind == "image":
            parts.append(_image(b, images))
        else:
            parts.append({"type": "text", "text": _text(b, f"user content[{i}]")})
    if parts:
        out.append({"role": "user", "content": _content(parts)})
    return out


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    texts, calls = [], []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use":
            _need(isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict),
                  f"assistant content[{i}]: tool_use needs a name and an input object")
            calls.append({"id": str(b.get("id") or f"toolu_{uuid.uuid4().hex}"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's own earlier reasoning: templates drop it from history too
        else:
            texts.append(_text(b, f"assistant content[{i}]"))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: dict[str, Any], images: bool, keep_billing_header: bool = False) -> list[dict[str, Any]]:
    """The chat ``messages`` of a Messages request (``system`` first)."""
    out: list[dict[str, Any]] = []
    system = system_text(body.get("system"), keep_billing_header)
    if system is not None:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list is required")
    for i, m in enumerate(messages):
        _need(isinstance(m, dict) and m.get("role") in ("user", "assistant"),
              f"messages[{i}]: role must be 'user' or 'assistant'")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        _need(isinstance(blocks, list), f"messages[{i}]: content must be a string or a list of blocks")
        out.extend(_user(blocks, images) if m["role"] == "user" else [_assistant(blocks)])
    return out


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` as chat function tools; None when there are none or ``tool_choice`` is none."""
    tools = body.get("tools") or []
    _need(isinstance(tools, list), "tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        _need(isinstance(t, dict) and t.get("type", "custom") == "custom" and isinstance(t.get("name"), str),
              f"tools[{i}]: only client tools ({{'name', 'description', 'input_schema'}}) are supported, "
              f"got type {t.get('type') if isinstance(t, dict) else t!r}")
        fn = {"name": t["name"], "description": t.get("description", ""),
              "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": fn})
    choice = body.get("tool_choice") or {"type": "auto"}
    _need(isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none"),
          "tool_choice: type must be 'auto', 'any', 'tool' or 'none'")
    if choice["type"] == "tool":
        _need(choice.get("name") in {t["name"] for t in tools}, "tool_choice: name must be one of the tools")
    return out if out and choice["type"] != "none" else None


def chat_request(body: Any, images: bool, keep_billing_header: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that a Messages request means. Raises RequestError."""
    _need(isinstance(body, dict), "the request body must be a JSON object")
    _need(isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool),
          "max_tokens: an integer is required")
    _need(isinstance(body.get("model", ""), str), "model: expected a string")
    stop = body.get("stop_sequences") or []
    _need(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
          "stop_sequences: expected a list of non-empty strings")
    _need(isinstance(body.get("metadata") or {}, dict), "metadata: expected an object")
    chat: dict[str, Any] = {"model": "default_model", "max_tokens": body["max_tokens"],
                            "messages": chat_messages(body, images, keep_billing_header),
                            "stream": body.get("stream", False), "stop": stop}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            chat[key] = body[key]
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    if chat["stream"] is True:
        chat["stream_options"] = {"include_usage": True}
    return chat


# -- response: chat completion -> message ----------------------------------------------------


def usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    cached = max(cached, 0)
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def chat_usage(u: dict[str, Any]) -> dict[str, int]:
    """Messages usage from a chat completion's (``cached_tokens`` -> ``cache_read_input_tokens``)."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage(u["prompt_tokens"], cached, u["completion_tokens"])


def stop_reason(finish: str | None, tokens: list[int], stop_words: list[str], tokenizer: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a generation that ended with ``finish`` after ``tokens``."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if tokens and tokenizer is not None and tokens[-1] not in set(tokenizer.eos_token_ids):
        for w in stop_words:  # the same token sequences mlx-lm's stop matcher matched
            seq = list(tokenizer.encode(w, add_special_tokens=False))
            if seq and tokens[-len(seq):] == seq:
                return "stop_sequence", w
    return "end_turn", None


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = {}
    return {"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
            "name": fn.get("name", ""), "input": args if isinstance(args, dict) else {"value": args}}


def message(chat: dict[str, Any], model: str, reason: tuple[str, str | None]) -> dict[str, Any]:
    """A Messages ``message`` from a non-streamed chat completion."""
    m = chat["choices"][0]["message"]
    content: list[dict[str, Any]] = []
    if m.get("reasoning"):
        content.append({"type": "thinking", "thinking": m["reasoning"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    content.extend(tool_use(c) for c in m.get("tool_calls") or [])
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": chat_usage(chat["usage"])}


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class Events:
    """Anthropic server-sent events from mlx_lm.server's chat chunks, written to ``out``.

    ``prompt()`` gives (prompt tokens, restored tokens) once generation started;
    ``reason()`` the (stop_reason, stop_sequence) once it ended."""

    def __init__(self, out: Callable[[bytes], None], model: str, prompt: Callable[[], tuple[int, int]],
                 reason: Callable[[str | None], tuple[str, str | None]]) -> None:
        self.out, self.model, self.prompt, self.reason = out, model, prompt, reason
        self.started = self.ended = False
        self.index = -1
        self.open: str | None = None  # the type of the content block open
        self.finish: str | None = None

    def _start(self) -> None:
        if not self.started:
            self.started = True
            msg: dict[str, Any] = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                                   "model": self.model, "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": usage(*self.prompt(), 0)}
            self.out(sse("message_start", {"type": "message_start", "message": msg}))

    def _block(self, kind: str | None, start: dict[str, Any] | None = None) -> None:
        """Make a ``kind`` block the open one (None: none): the open block is closed first
        unless it is of that kind and no ``start`` (a new block's header) is given."""
        if self.open is not None and (kind is None or kind != self.open or start is not None):
            self.out(sse("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None
        if kind is not None and self.open is None:
            self.index += 1
            self.open = kind
            self.out(sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": start or {"type": kind, kind: ""}}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self.out(sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))

    def keepalive(self) -> None:
        self._start()
        self.out(sse("ping", {"type": "ping"}))

    def chunk(self, chunk: dict[str, Any]) -> None:
        """One chat completion chunk: content deltas, or (``include_usage``) the usage."""
        self._start()
        for choice in chunk.get("choices") or []:
            d = choice.get("delta") or {}
            if d.get("reasoning"):
                fresh = self.open != "thinking"
                self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""} if fresh else None)
                self._delta({"type": "thinking_delta", "thinking": d["reasoning"]})
            if d.get("content"):
                self._block("text")
                self._delta({"type": "text_delta", "text": d["content"]})
            for call in d.get("tool_calls") or []:
                block = tool_use(call)
                self._block("tool_use", {**block, "input": {}})
                self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
            self.finish = choice.get("finish_reason") or self.finish
        if chunk.get("usage"):
            self.end(chat_usage(chunk["usage"]))

    def end(self, u: dict[str, int]) -> None:
        if self.ended:
            return
        self._start()
        self._block(None)
        self.ended = True
        reason, seq = self.reason(self.finish)
        self.out(sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                       "usage": u}))
        self.out(sse("message_stop", {"type": "message_stop"}))

    def error(self, status: int, text: str) -> None:
        self.ended = True
        self.out(sse("error", error_body(status, text)))


# -- HTTP: run mlx-lm's chat handler on the translated request --------------------------------


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
    also keeps the GenerationContext and the tokens generated (for usage and stop_reason)."""

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
        return (len(self.ctx.prompt), self.ctx.prompt_cache_count) if self.ctx is not None else (0, 0)


def _read_json(handler: Any) -> Any:
    try:
        return json.loads(handler.rfile.read(int(handler.headers.get("Content-Length") or 0)) or b"null")
    except (ValueError, json.JSONDecodeError) as e:
        raise RequestError(f"the request body is not JSON: {e}") from None


def _chat_error(status: int, body: bytes) -> tuple[int, str]:
    """An mlx_lm.server error answer as (status, message) for the Messages API: its 404 is a
    request it could not render or run (the model is always the served one), so 400, unless
    the generation thread died (500)."""
    try:
        text = str(json.loads(body).get("error"))
    except (ValueError, AttributeError):
        text = body.decode(errors="replace")[:500] or f"HTTP {status}"
    if status == 404:
        status = 500 if "generation thread died" in text else 400
    return status, text


def handle(handler: Any, original: Callable[[Any], None], server_mod: Any) -> None:
    """``POST /v1/messages[/count_tokens]`` on an ``APIHandler`` whose own ``do_POST`` is
    ``original``."""
    path = handler.path.split("?")[0]
    try:
        body = _read_json(handler)
        model = (body.get("model") if isinstance(body, dict) else None) or str(handler.response_generator.cli_args.model)
        if path == COUNT and isinstance(body, dict):
            body = {**body, "max_tokens": 1, "stream": False}
        images = getattr(handler.response_generator.model_provider, "processor", None) is not None  # none in mlx-lm 0.31
        chat = chat_request(body, images, KEEP_BILLING_HEADER)
        if path == COUNT:
            send_json(handler, 200, {"input_tokens": count_tokens(handler.response_generator, chat, server_mod)})
            return
    except RequestError as e:
        send_json(handler, e.status, error_body(e.status, str(e)))
        return
    _run(handler, original, chat, model)


def count_tokens(generator: Any, chat: dict[str, Any], server_mod: Any) -> int:
    """The prompt length of ``chat`` rendered and tokenized by mlx_lm.server's own
    ``_tokenize`` (what ``/v1/messages`` would prefill or restore)."""
    tokenizer = generator.model_provider.tokenizer
    if tokenizer is None:
        raise RequestError("the model is still loading", 503)
    request = server_mod.CompletionRequest("chat", "", chat["messages"], chat.get("tools"), None)
    args = types.SimpleNamespace(chat_template_kwargs=chat.get("chat_template_kwargs"))
    try:
        prompt = generator._tokenize(tokenizer, request, args)[0]
    except Exception as e:  # the template's or the processor's own complaint
        raise RequestError(f"the request cannot be rendered by the model's chat template: {e}") from None
    return len(prompt)


def _run(handler: Any, original: Callable[[Any], None], chat: dict[str, Any], model: str) -> None:
    real_out, real_in, real_path, real_gen = handler.wfile, handler.rfile, handler.path, handler.response_generator
    tap = Tap(real_gen)
    tokenizer = getattr(real_gen.model_provider, "tokenizer", None)
    events = Events(real_out.write, model, tap.prompt,
                    lambda finish: stop_reason(finish, tap.tokens, chat["stop"], tokenizer))
    body = io.BytesIO()
    pending = b""

    def head(cap: Capture) -> None:
        if cap.head:  # mlx-lm's own 200 event-stream head (status, CORS), then our events
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
                events.keepalive()
            elif line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.chunk(json.loads(line[5:]))
        real_out.flush()

    cap = Capture(on_body)
    raw = json.dumps(chat).encode()
    del handler.headers["Content-Length"]
    handler.headers["Content-Length"] = str(len(raw))
    handler.wfile, handler.rfile, handler.path, handler.response_generator = cap, io.BytesIO(raw), "/v1/chat/completions", tap
    # mlx-lm's answer is captured, not sent: its access-log line would be a second one for
    # this request (the answer sent below, or the stream's head, logs it once)
    handler.log_request = lambda *args: None
    failure: Exception | None = None
    try:
        original(handler)
    except Exception as e:  # the generation failed after the answer began (mlx-lm lets it escape)
        failure = e
        log.exception("kvstore: /v1/messages failed")
    finally:
        handler.wfile, handler.rfile, handler.path, handler.response_generator = real_out, real_in, real_path, real_gen
        del handler.log_request
    if isinstance(failure, (BrokenPipeError, ConnectionResetError)):
        return  # the client went away (mlx-lm's handler stopped the generation)
    if cap.stream and cap.status == 200:
        head(cap)
    _answer(handler, cap, body.getvalue(), events, tap, chat, model, failure)


def _answer(handler: Any, cap: "Capture", body: bytes, events: "Events", tap: "Tap", chat: dict[str, Any],
            model: str, failure: Exception | None) -> None:
    """What ``/v1/messages`` answers once mlx-lm's handler returned: the stream's last
    events, the message, or the error in Anthropic's shape."""
    tokenizer = getattr(tap.model_provider, "tokenizer", None)
    if cap.stream and cap.status == 200:
        if failure is not None:
            events.error(500, f"generation failed: {failure}")
        else:
            events.end(usage(*tap.prompt(), len(tap.tokens)))
        handler.wfile.flush()
    elif cap.status == 200:
        chat_resp = json.loads(body)
        finish = chat_resp["choices"][0].get("finish_reason")
        send_json(handler, 200, message(chat_resp, model, stop_reason(finish, tap.tokens, chat["stop"], tokenizer)))
    elif cap.status is not None:
        status, text = _chat_error(cap.status, body)
        send_json(handler, status, error_body(status, text))
    else:  # failed before anything was written: drop the status line mlx-lm may have buffered
        handler._headers_buffer = []
        send_json(handler, 500, error_body(500, f"generation failed: {failure}"))


def install(server_mod: Any) -> None:
    """Route ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (any query string, e.g.
    Claude Code's ``?beta=true``) of ``server_mod.APIHandler`` here; other paths unchanged."""
    handler_class = server_mod.APIHandler
    if getattr(handler_class, "_kvstore_messages", False):
        return
    original = handler_class.do_POST

    def do_POST(self: Any) -> None:
        if self.path.split("?")[0] in (MESSAGES, COUNT):
            handle(self, original, server_mod)
        else:
            original(self)

    handler_class.do_POST = do_POST
    handler_class._kvstore_messages = True
