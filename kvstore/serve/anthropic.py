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
the rendered prompt unless ``kvstore serve --keep-billing-header`` (``ServeConfig.keep_billing_header``).
"""

from __future__ import annotations

import json
import threading
import types
import uuid
from typing import Any, Callable

from .chat_route import Capture, Tap, chat_error, drop_buffered_head, read_json, run_chat
from .http import BodyError, send_json
from ..escape import logger

log = logger("kvstore")
BILLING_PREFIX = "x-anthropic-billing-header:"
# thinking.type -> the template's enable_thinking: "adaptive" (the model decides) needs the
# thinking switch on, as "enabled" does; the model then thinks or not as it was trained to
THINKING = {"enabled": True, "adaptive": True, "disabled": False}
ERROR_PREFIX = "Error: "  # how a tool_result with is_error: true reaches the model
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 411: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}
# count_tokens renders and tokenizes on the HTTP thread, beside generation: one at a time (a
# tokenizer holds ~250x the text's size while it works; --max-body-bytes bounds the text).
TOKENIZING = threading.BoundedSemaphore(1)
TOKENIZE_WAIT_S = 120.0


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


def _document(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``document`` block with a text source (``{'type': 'text', 'data'}``, or ``content``
    of text blocks) as one text part: its ``title``, its ``context``, then the text, each on
    a line of its own. PDF, URL and file sources need what mlx-lm does not have: a 400."""
    given = block.get("source")
    source: dict[str, Any] = given if isinstance(given, dict) else {}
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        text = str(source["data"])
    elif kind == "content" and isinstance(source.get("content"), (str, list)):
        body = source["content"]
        text = body if isinstance(body, str) else "\n".join(_text(b, f"{where} source content") for b in body)
    else:
        raise RequestError(f"{where}: a document block with a {kind!r} source is not supported; supported: "
                           f"a text source ({{'type': 'text', 'media_type': 'text/plain', 'data': ...}}) or a "
                           f"content source of text blocks ({{'type': 'content', 'content': [...]}})")
    extra = [block.get(k) for k in ("title", "context")]
    _need(all(v is None or isinstance(v, str) for v in extra), f"{where}: title and context must be strings")
    return {"type": "text", "text": "\n".join(str(v) for v in (*extra, text) if v)}


def _part(block: Any, where: str, images: bool, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A text, image or document block as a chat content part; another type is a 400
    naming it and the types ``where`` takes."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "image" and "image" in allowed:
        return _image(block, images)
    if kind == "document" and "document" in allowed:
        return _document(block, where)
    _need(kind in (None, "text"), f"{where}: block type {kind!r} is not supported here; supported: {', '.join(allowed)}")
    return {"type": "text", "text": _text(block, where)}


def _tool_result(block: dict[str, Any], images: bool) -> dict[str, Any]:
    """A ``tool_result`` as a chat ``tool`` message; ``is_error: true`` puts ``ERROR_PREFIX``
    before its content (templates have no field for it; the model reads it in the text)."""
    _need(isinstance(block.get("tool_use_id"), str), "tool_result block: tool_use_id (a string) is required")
    _need(isinstance(block.get("is_error", False), bool), "tool_result block: is_error must be a boolean")
    body = block.get("content", "")
    if isinstance(body, str):
        parts = [{"type": "text", "text": body}]
    else:
        _need(isinstance(body, list), "tool_result block: content must be a string or a list of blocks")
        parts = [_part(b, "tool_result content", images, ("text", "image", "document")) for b in body]
    if block.get("is_error"):
        if parts and parts[0]["type"] == "text":
            parts[0] = {"type": "text", "text": ERROR_PREFIX + parts[0]["text"]}
        else:
            parts.insert(0, {"type": "text", "text": ERROR_PREFIX.rstrip()})
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": _content(parts)}


def _user(blocks: list[Any], images: bool) -> list[dict[str, Any]]:
    """One Messages user turn as chat messages: a ``tool`` message per tool_result and a
    ``user`` message per run of text/image/document blocks, in their order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": _content(parts)})
                parts = []
            out.append(_tool_result(b, images))
        else:
            parts.append(_part(b, f"user content[{i}]", images, ("text", "image", "document", "tool_result")))
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
            _need(kind in (None, "text"), f"assistant content[{i}]: block type {kind!r} is not supported here; "
                                          f"supported: text, tool_use, thinking, redacted_thinking")
            texts.append(_text(b, f"assistant content[{i}]"))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(body: dict[str, Any], images: bool, keep_billing_header: bool = False) -> list[dict[str, Any]]:
    """The chat ``messages`` of a Messages request (``system`` first). A ``system`` message
    inside ``messages`` (Claude Code inserts some mid-conversation) stays where it is, a
    chat system message there: hoisting it into the top system text would change the
    prompt's first tokens, and every cached prefix with them."""
    out: list[dict[str, Any]] = []
    system = system_text(body.get("system"), keep_billing_header)
    if system is not None:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: a non-empty list is required")
    for i, m in enumerate(messages):
        _need(isinstance(m, dict) and m.get("role") in ("user", "assistant", "system"),
              f"messages[{i}]: role must be 'user', 'assistant' or 'system'")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        _need(isinstance(blocks, list), f"messages[{i}]: content must be a string or a list of blocks")
        if m["role"] == "system":
            text = system_text(blocks, keep_billing_header)
            out.extend([{"role": "system", "content": text}] if text is not None else [])
        else:
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
        _need(isinstance(choice.get("name"), str) and choice["name"] in {t["name"] for t in tools},
              "tool_choice: name must be one of the tools")
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
    if thinking is not None:
        # budget_tokens cannot be enforced (mlx-lm cannot end a thinking block by count): accepted, unused
        _need(isinstance(thinking, dict) and isinstance(thinking.get("type"), str) and thinking["type"] in THINKING,
              f"thinking: type must be one of {', '.join(repr(t) for t in THINKING)}")
        chat["chat_template_kwargs"] = {"enable_thinking": THINKING[thinking["type"]]}
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


def handle(handler: Any, original: Callable[[Any], None], keep_billing_header: bool = False) -> None:
    """``POST /v1/messages[/count_tokens]`` on an ``APIHandler`` whose own ``do_POST`` is
    ``original`` (``keep_billing_header``: ``--keep-billing-header``)."""
    path = handler.path.split("?")[0]
    try:
        try:
            body = read_json(handler)
        except BodyError as e:
            raise RequestError(str(e), e.status) from None
        except ValueError as e:
            raise RequestError(str(e)) from None
        model = (body.get("model") if isinstance(body, dict) else None) or str(handler.response_generator.cli_args.model)
        if path == COUNT and isinstance(body, dict):
            body = {**body, "max_tokens": 1, "stream": False}
        images = getattr(handler.response_generator.model_provider, "processor", None) is not None  # none in mlx-lm 0.31
        chat = chat_request(body, images, keep_billing_header)
        if path == COUNT:
            send_json(handler, 200, {"input_tokens": count_tokens(handler.response_generator, chat)})
            return
    except RequestError as e:
        send_json(handler, e.status, error_body(e.status, str(e)))
        return
    except Exception as e:  # never a dropped connection: an Anthropic 500, the trace in the log
        log.exception("kvstore: %s failed before generation", path)
        send_json(handler, 500, error_body(500, f"internal error before generation: {type(e).__name__}: {e}"))
        return
    _run(handler, original, chat, model)


def count_tokens(generator: Any, chat: dict[str, Any]) -> int:
    """The prompt length of ``chat`` rendered and tokenized by the server's ``_tokenize``
    (what ``/v1/messages`` would prefill or restore), under the request's context (its salt)
    when ``generator`` is a request's view (``context.RequestView``)."""
    from mlx_lm.server import CompletionRequest

    from .context import RequestContext, attach

    tokenizer = generator.model_provider.tokenizer
    if tokenizer is None:
        raise RequestError("the model is still loading", 503)
    request = CompletionRequest("chat", "", chat["messages"], chat.get("tools"), None)
    context = getattr(generator, "context", None)
    if isinstance(context, RequestContext):
        attach(request, context)
    args = types.SimpleNamespace(chat_template_kwargs=chat.get("chat_template_kwargs"))
    if not TOKENIZING.acquire(timeout=TOKENIZE_WAIT_S):
        raise RequestError("too many count_tokens requests at once; retry shortly", 503)
    try:
        prompt = generator._tokenize(tokenizer, request, args)[0]
    except Exception as e:  # the template's or the processor's own complaint
        raise RequestError(f"the request cannot be rendered by the model's chat template: {e}") from None
    finally:
        TOKENIZING.release()
    return len(prompt)


def _run(handler: Any, original: Callable[[Any], None], chat: dict[str, Any], model: str) -> None:
    tap = Tap(handler.response_generator)
    tokenizer = getattr(tap.model_provider, "tokenizer", None)
    events = Events(handler.wfile.write, model, tap.prompt,
                    lambda finish: stop_reason(finish, tap.tokens, chat["stop"], tokenizer))

    def on_chunk(chunk: dict[str, Any] | None) -> None:
        if chunk is None:
            events.keepalive()
        else:
            events.chunk(chunk)

    outcome = run_chat(handler, original, chat, tap, on_chunk, MESSAGES)
    if outcome is not None:  # None: the client went away (mlx-lm's handler stopped the generation)
        _answer(handler, outcome.cap, outcome.body, events, tap, chat, model, outcome.failure)


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
        status, text = chat_error(cap.status, body)
        send_json(handler, status, error_body(status, text))
    else:  # failed before anything was written: drop the status line mlx-lm may have buffered
        drop_buffered_head(handler)
        send_json(handler, 500, error_body(500, f"generation failed: {failure}"))
