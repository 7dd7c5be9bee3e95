"""``POST /v1/responses`` (the OpenAI Responses API, what Codex CLI speaks), ``GET`` and
``DELETE /v1/responses/{id}`` on ``kvstore serve``, by translation through mlx_lm.server's
own chat handler (``chat_route.run_chat``): the same model, generation thread, template
rendering and prompt cache as ``/v1/chat/completions`` and ``/v1/messages``, so one
conversation through any of them hits the same cached prefix.

The request (``chat_request``) becomes the chat body it means: ``instructions`` and
``developer`` / ``system`` messages as the template's system role (a leading run of them
merged into one system message: templates that take only the first would drop the rest),
``input_text`` / ``output_text`` parts as text, ``function_call`` / ``custom_tool_call``
items as the assistant's tool calls, their outputs as ``tool`` messages, ``reasoning`` items
left out (templates drop earlier reasoning too). Function tools come flat
(``{type: "function", name, parameters}``), grouped (``{type: "namespace", tools: [...]}``,
flattened) or free-form (``{type: "custom"}``: a function with one string ``input``).
Hosted tools (``web_search``, ``file_search``, ...) are run by OpenAI's servers, not here:
they are left out of the prompt (Codex sends ``web_search`` on every request), and a
``tool_choice`` that forces one is a 400 naming it. ``reasoning.effort`` switches the
template's ``enable_thinking`` (``none`` / ``minimal``: off, else on; templates without the
switch ignore it). Accepted and not enforced: ``text.format``, ``parallel_tool_calls``,
``tool_choice`` ``required`` / a named function (the model is asked through the template
only), ``prompt_cache_key`` (kvstore finds a cached prefix by the prompt's tokens),
``include`` (reasoning comes back as text; no ``encrypted_content`` is made), ``metadata``,
``client_metadata`` (never rendered into the prompt), ``user``, ``service_tier``,
``truncation``, ``safety_identifier``.

The answer is a ``response`` object, or with ``stream`` the server-sent events Codex and the
official ``openai`` SDK consume (``Events``). A generation that stops at the token limit is
``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``, still ended
by ``response.completed`` (a stream without it is retried by Codex). Usage:
``input_tokens`` (the whole prompt), ``input_tokens_details.cached_tokens`` (the prompt
tokens kvstore restored from any tier), ``output_tokens``,
``output_tokens_details.reasoning_tokens``, ``total_tokens``.

Errors are OpenAI error objects naming the field (``param``); a refused request stores
nothing. With ``store`` (default true) a completed response is kept with the conversation
that led to it (``response_store``), salted like every cache key, so ``previous_response_id``
continues it, also after a restart; a response of another tenant is a 404. It is stored
before the answer is sent (streamed: before ``response.completed``), so a client that
continues it at once finds it; one that cannot be stored is answered with ``store`` false
and ``store_error`` saying why (``keep``). A stored record is read only through
``response_record.Record.from_bytes``: one kvstore did not write is a 404, never a traceback.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, unquote

from .. import files
from . import tenants
from .chat_route import Tap, chat_error, drop_buffered_head, read_json, run_chat
from .http import BodyError, send_json
from .response_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_COUNT, NotStored, ResponseStore
from ..escape import logger, shortened

log = logger("kvstore")
PATH = "/v1/responses"
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                          "code_interpreter", "image_generation", "computer_use_preview", "mcp", "local_shell",
                          "tool_search"})
THINKING_OFF = frozenset({"none", "minimal"})
EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh"})


class Stored:
    """A server's stored responses: kept beside its store's disk tier (``disk()``: the
    ``DiskTier``, or None when the cache directory could not be used; asked on first use,
    after the start made it), bounded by ``max_count`` records and ``max_bytes``, opened
    once (``store``)."""

    def __init__(self, disk: Callable[[], Any] = lambda: None, max_count: int = DEFAULT_MAX_COUNT,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._disk, self.max_count, self.max_bytes = disk, max_count, max_bytes
        self._store: ResponseStore | None = None
        self._lock = threading.Lock()

    def store(self) -> ResponseStore:
        """The stored responses of the served cache directory (opened once, on first use)."""
        with self._lock:
            if self._store is None:
                disk = self._disk()
                root = Path(disk.root) if disk is not None else None
                modes = disk.modes if disk is not None else files.PRIVATE
                self._store = ResponseStore(root, modes, max_count=self.max_count, max_bytes=self.max_bytes)
            return self._store

    def stats(self) -> dict[str, Any]:
        """What ``GET /v1/cache/stats`` says of stored responses under ``"responses"``
        (``ResponseStore.stats``; zeros before the store was first used)."""
        return self._store.stats() if self._store is not None else ResponseStore(None).stats()


class RequestError(ValueError):
    """A request the Responses API refuses: status, message and the field it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _need(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise RequestError(message, param)


def _number(body: dict[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is not None:
        _need(isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high,
              f"{key} must be a number from {low:g} to {high:g}, got {value!r}", key)


# -- request: input items -> chat messages ----------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    """Message content (a string or text parts) as one string, parts joined by a newline."""
    if isinstance(content, str):
        return content
    _need(isinstance(content, list), f"{where}.content must be a string or a list of content parts", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise RequestError(f"{where}.content[{j}]: type {kind!r} is not supported here (text parts only: "
                               f"input_text, output_text)", f"{where}.content[{j}]")
    return "\n".join(texts)


def _output_text(output: Any, where: str) -> str:
    return output if isinstance(output, str) else _text_of(output, where)


class _Messages:
    """Chat messages built item by item: tool calls join the assistant message before them."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []

    def add(self, message: dict[str, Any]) -> None:
        self.out.append(message)

    def call(self, call_id: str, name: str, arguments: str) -> None:
        last = self.out[-1] if self.out else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.out.append(last)
        last.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The chat messages of ``input`` (a string or a list of items); RequestError naming
    the item that cannot be rendered."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    _need(isinstance(items, list), "input must be a string or a list of items", "input")
    msgs = _Messages()
    for i, item in enumerate(items):
        where = f"input[{i}]"
        _need(isinstance(item, dict), f"{where} must be an object", where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            _need(role in ("user", "assistant", "system", "developer"),
                  f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}", f"{where}.role")
            msgs.add({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"), where)})
        elif kind in ("function_call", "custom_tool_call"):
            _need(isinstance(item.get("call_id"), str) and isinstance(item.get("name"), str),
                  f"{where}: a {kind} needs call_id and name (strings)", where)
            if kind == "function_call":
                args = item.get("arguments", "{}")
                _need(isinstance(args, str), f"{where}.arguments must be a string (JSON)", f"{where}.arguments")
            else:
                _need(isinstance(item.get("input", ""), str), f"{where}.input must be a string", f"{where}.input")
                args = json.dumps({"input": item.get("input", "")})
            msgs.call(item["call_id"], item["name"], args)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            _need(isinstance(item.get("call_id"), str), f"{where}.call_id (a string) is required", f"{where}.call_id")
            msgs.add({"role": "tool", "tool_call_id": item["call_id"],
                      "content": _output_text(item.get("output", ""), where)})
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: templates leave it out of history too
        else:
            raise RequestError(f"{where}: item type {kind!r} is not supported (message, function_call, "
                               f"function_call_output, custom_tool_call, custom_tool_call_output, reasoning)",
                               f"{where}.type")
    return msgs.out


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading run of system messages as one (joined by a blank line): Codex sends its
    prompt as two ``developer`` messages, and many templates render only a first system."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    joined = "\n\n".join(str(m["content"]) for m in messages[:n] if m["content"])
    return [{"role": "system", "content": joined}, *messages[n:]]


# -- request: tools ---------------------------------------------------------------------------


def chat_tools(tools: Any, custom: set[str]) -> list[dict[str, Any]]:
    """Function tools as chat tools (namespaces flattened, custom tools as one-string
    functions, their names added to ``custom``); hosted tools left out."""
    if tools is None:
        return []
    _need(isinstance(tools, list), "tools must be a list", "tools")
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace":
            _need(isinstance(t.get("tools"), list), f"{where}.tools must be a list", f"{where}.tools")
            try:
                out.extend(chat_tools(t["tools"], custom))
            except RequestError as e:
                raise RequestError(f"{where}: {e}", f"{where}.{e.param}") from None
        elif kind in ("function", "custom"):
            _need(isinstance(t.get("name"), str) and bool(t["name"]), f"{where}.name (a string) is required", f"{where}.name")
            if kind == "function":
                params = t.get("parameters") or {"type": "object", "properties": {}}
                _need(isinstance(params, dict), f"{where}.parameters must be an object", f"{where}.parameters")
            else:
                custom.add(t["name"])
                params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
            out.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "", "parameters": params}})
        elif isinstance(kind, str) and kind in HOSTED_TOOLS:
            continue  # run by OpenAI's servers; Codex lists web_search on every request
        else:
            raise RequestError(f"{where}: tool type {kind!r} is not supported (function, namespace, custom; "
                               f"hosted tools such as web_search are left out)", f"{where}.type")
    return out


def _tool_choice(choice: Any, names: set[str]) -> bool:
    """Check ``tool_choice``; False when it is ``none`` (no tools rendered)."""
    if choice is None or choice in ("auto", "required"):
        return True
    if choice == "none":
        return False
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str) and kind in HOSTED_TOOLS:
        raise RequestError(f"tool_choice forces the hosted tool {kind!r}, which this server does not run", "tool_choice")
    if kind in ("function", "custom"):
        _need(isinstance(choice.get("name"), str) and choice["name"] in names, f"tool_choice.name must be one of the tools, got {choice.get('name')!r}",
              "tool_choice.name")
        return True
    if kind == "allowed_tools":
        return True
    raise RequestError(f"tool_choice must be 'auto', 'none', 'required' or a function, got {choice!r}", "tool_choice")


# -- request: the whole body ------------------------------------------------------------------


def check_body(body: Any) -> dict[str, Any]:
    """``body`` if it is a Responses request this server can run; RequestError otherwise."""
    _need(isinstance(body, dict), "the request body must be a JSON object", "body")
    _need(isinstance(body.get("model", ""), str), "model must be a string", "model")
    _need("input" in body or bool(body.get("previous_response_id")), "input is required", "input")
    _need(body.get("instructions") is None or isinstance(body["instructions"], str),
          "instructions must be a string", "instructions")
    limit = body.get("max_output_tokens")
    _need(limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1),
          f"max_output_tokens must be an integer >= 1, got {limit!r}", "max_output_tokens")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    for key in ("stream", "store", "parallel_tool_calls", "background"):
        _need(body.get(key) is None or isinstance(body[key], bool), f"{key} must be a boolean", key)
    _need(not body.get("background"), "background responses are not supported here", "background")
    _need(body.get("conversation") is None, "conversation objects are not supported here; use previous_response_id "
          "or send the history as input", "conversation")
    for key in ("reasoning", "text", "metadata", "client_metadata", "stream_options"):
        _need(body.get(key) is None or isinstance(body[key], dict), f"{key} must be an object", key)
    effort = (body.get("reasoning") or {}).get("effort")
    _need(effort is None or (isinstance(effort, str) and effort in EFFORTS), f"reasoning.effort must be one of {sorted(EFFORTS)}, got {effort!r}",
          "reasoning.effort")
    include = body.get("include")
    _need(include is None or (isinstance(include, list) and all(isinstance(x, str) for x in include)),
          "include must be a list of strings", "include")
    previous = body.get("previous_response_id")
    _need(previous is None or (isinstance(previous, str) and bool(previous)),
          "previous_response_id must be a non-empty string", "previous_response_id")
    return body


def chat_request(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]], set[str]]:
    """(the ``/v1/chat/completions`` body ``body`` means after ``history`` (the stored
    conversation of ``previous_response_id``), the conversation to store with its answer
    (without ``instructions``, which OpenAI does not carry over), the custom tools' names)."""
    custom: set[str] = set()
    tools = chat_tools(body.get("tools"), custom)
    use_tools = _tool_choice(body.get("tool_choice"), {t["function"]["name"] for t in tools})
    conversation = [*history, *input_messages(body.get("input", []))]
    _need(bool(conversation), "input must hold at least one item", "input")
    system = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat: dict[str, Any] = {"model": "default_model", "messages": merge_leading_system([*system, *conversation]),
                            "stream": bool(body.get("stream"))}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if tools and use_tools:
        chat["tools"] = tools
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": effort not in THINKING_OFF}
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat, conversation, custom


# -- response: output items -------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []}


def reasoning_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict[str, Any], custom: set[str], item_id: str) -> dict[str, Any]:
    """A chat tool call as a ``function_call`` item (``custom_tool_call`` for a custom tool)."""
    fn = call.get("function") or {}
    name, args = str(fn.get("name", "")), str(fn.get("arguments") or "{}")
    call_id = str(call.get("id") or _id("call"))
    if name in custom:
        try:
            value = json.loads(args).get("input", "")
        except (ValueError, AttributeError):
            value = args
        return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                "input": value if isinstance(value, str) else json.dumps(value), "status": "completed"}
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": args,
            "status": "completed"}


def history_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a response's output, as a client resending it would send them."""
    return input_messages([item for item in output if item["type"] != "reasoning"])


def usage(prompt: int, cached: int, output: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": max(cached, 0)},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": min(reasoning, output)},
            "total_tokens": prompt + output}


class Reply:
    """One response object as it is built: the request's echoed fields, then its output."""

    def __init__(self, body: dict[str, Any], model: str, custom: set[str]) -> None:
        self.custom = custom
        self.obj: dict[str, Any] = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"), "model": model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": body.get("reasoning") or {},
            "store": body.get("store", True), "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": body.get("truncation", "disabled"),
            "usage": None, "user": body.get("user"), "metadata": body.get("metadata") or {}}

    @property
    def id(self) -> str:
        return str(self.obj["id"])

    def finish(self, finish_reason: str | None, u: dict[str, Any]) -> dict[str, Any]:
        self.obj["usage"] = u
        if finish_reason == "length":
            self.obj["status"], self.obj["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.obj["status"] = "completed"
        return self.obj


def output_items(message: dict[str, Any], custom: set[str]) -> list[dict[str, Any]]:
    """The output items of a non-streamed chat completion's message."""
    out = []
    if message.get("reasoning"):
        out.append(reasoning_item(message["reasoning"], _id("rs")))
    if message.get("content"):
        out.append(message_item(message["content"], _id("msg")))
    out.extend(call_item(c, custom, _id("fc")) for c in message.get("tool_calls") or [])
    return out


def sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


class Events:
    """The Responses API's server-sent events from mlx_lm.server's chat chunks: created,
    in_progress, then per output item added / deltas / done, then completed or failed."""

    def __init__(self, out: Callable[[bytes], None], reply: Reply) -> None:
        self.out, self.reply = out, reply
        self.seq = 0
        self.started = False
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""
        self.finish_reason: str | None = None

    def _send(self, kind: str, **fields: Any) -> None:
        self.out(sse({"type": kind, "sequence_number": self.seq, **fields}))
        self.seq += 1

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._send("response.created", response=dict(self.reply.obj))
            self._send("response.in_progress", response=dict(self.reply.obj))

    @property
    def _index(self) -> int:
        return len(self.reply.obj["output"])

    def _open(self, item: dict[str, Any]) -> None:
        self._close()
        self.open, self.text = item, ""
        self._send("response.output_item.added", output_index=self._index, item=item)
        if item["type"] == "message":
            self._send("response.content_part.added", item_id=item["id"], output_index=self._index, content_index=0,
                       part={"type": "output_text", "text": "", "annotations": []})

    def _close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self._index}
        if item["type"] == "message":
            done = message_item(self.text, item["id"])
            self._send("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[])
            self._send("response.content_part.done", **where, content_index=0, part=done["content"][0])
        else:
            done = reasoning_item(self.text, item["id"])
            self._send("response.reasoning_text.done", **where, content_index=0, text=self.text)
        self._send("response.output_item.done", output_index=self._index, item=done)
        self.reply.obj["output"].append(done)

    def _call(self, call: dict[str, Any]) -> None:
        self._close()
        done = call_item(call, self.reply.custom, _id("fc"))
        where = {"item_id": done["id"], "output_index": self._index}
        if done["type"] == "function_call":
            self._send("response.output_item.added", output_index=self._index, item={**done, "arguments": "", "status": "in_progress"})
            self._send("response.function_call_arguments.delta", **where, delta=done["arguments"])
            self._send("response.function_call_arguments.done", **where, name=done["name"], arguments=done["arguments"])
        else:
            self._send("response.output_item.added", output_index=self._index, item={**done, "input": "", "status": "in_progress"})
            self._send("response.custom_tool_call_input.delta", **where, delta=done["input"])
            self._send("response.custom_tool_call_input.done", **where, input=done["input"])
        self._send("response.output_item.done", output_index=self._index, item=done)
        self.reply.obj["output"].append(done)

    def chunk(self, chunk: dict[str, Any] | None) -> None:
        """One chat completion chunk (None: a keepalive, which only starts the stream)."""
        self.start()
        for choice in (chunk or {}).get("choices") or []:
            d = choice.get("delta") or {}
            if d.get("reasoning"):
                if self.open is None or self.open["type"] != "reasoning":
                    self._open({"type": "reasoning", "id": _id("rs"), "summary": [], "content": []})
                assert self.open is not None
                self.text += d["reasoning"]
                self._send("response.reasoning_text.delta", item_id=self.open["id"], output_index=self._index,
                           content_index=0, delta=d["reasoning"])
            if d.get("content"):
                if self.open is None or self.open["type"] != "message":
                    self._open(message_item("", _id("msg"), "in_progress"))
                assert self.open is not None
                self.text += d["content"]
                self._send("response.output_text.delta", item_id=self.open["id"], output_index=self._index,
                           content_index=0, delta=d["content"], logprobs=[])
            for call in d.get("tool_calls") or []:
                self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def finish(self, u: dict[str, Any]) -> dict[str, Any]:
        """Close the last item and finish the response (``completed`` sends it)."""
        self.start()
        self._close()
        return self.reply.finish(self.finish_reason, u)

    def completed(self, obj: dict[str, Any]) -> None:
        self._send("response.completed", response=obj)

    def fail(self, message: str) -> None:
        self.start()
        self._close()
        self.reply.obj.update(status="failed", error={"code": "server_error", "message": message})
        self._send("response.failed", response=self.reply.obj)


# -- HTTP ---------------------------------------------------------------------------------------


def _reasoning_tokens(tokenizer: Any, output: list[dict[str, Any]]) -> int:
    text = "".join(c.get("text", "") for item in output if item["type"] == "reasoning" for c in item["content"])
    return len(tokenizer.encode(text, add_special_tokens=False)) if text and tokenizer is not None else 0


def _send_error(handler: Any, e: RequestError) -> None:
    send_json(handler, e.status, error_body(str(e), e.param, e.code))


def _param(text: str) -> str | None:
    """The Responses field an mlx_lm.server validation message is about."""
    field = text.split(" ", 1)[0]
    return {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}.get(field)


def handle_post(handler: Any, original: Callable[[Any], None], stored: Stored, salt: Any) -> None:
    """``POST /v1/responses`` on an ``APIHandler`` whose own ``do_POST`` is ``original``:
    ``stored`` the server's responses, ``salt`` the request's (``RequestContext.salt``)."""
    try:
        try:
            body = check_body(read_json(handler))
        except BodyError as e:
            raise RequestError(str(e), "body", e.status) from None
        except ValueError as e:
            if isinstance(e, RequestError):
                raise
            raise RequestError(str(e), "body") from None
        history: list[dict[str, Any]] = []
        if body.get("previous_response_id"):
            record = stored.store().get(salt, body["previous_response_id"])
            if record is None:
                raise RequestError(f"Previous response with id '{shortened(str(body['previous_response_id']))}' not found.",
                                   "previous_response_id", 404)
            history = record.conversation
        chat, conversation, custom = chat_request(body, history)
    except RequestError as e:
        _send_error(handler, e)
        return
    except Exception as e:  # never a dropped connection: a 500 with the error, the trace in the log
        log.exception("kvstore: %s failed before generation", PATH)
        send_json(handler, 500, error_body(f"internal error before generation: {type(e).__name__}: {e}", kind="server_error"))
        return
    model = body.get("model") or str(handler.response_generator.cli_args.model)
    reply = Reply(body, model, custom)
    tap = Tap(handler.response_generator)
    tokenizer = getattr(tap.model_provider, "tokenizer", None)
    events = Events(handler.wfile.write, reply)
    outcome = run_chat(handler, original, chat, tap, events.chunk, PATH)
    if outcome is None:
        return  # the client went away (mlx-lm's handler stopped the generation)
    if outcome.streamed:
        if outcome.failure is not None:
            events.fail(f"generation failed: {outcome.failure}")
            handler.wfile.flush()
            return
        prompt, cached = tap.prompt()
        obj = events.finish(usage(prompt, cached, len(tap.tokens), _reasoning_tokens(tokenizer, reply.obj["output"])))
        keep(stored, salt, body, obj, conversation)  # stored before the client hears it is done
        events.completed(obj)
        handler.wfile.flush()
    elif outcome.cap.status == 200:
        chat_resp = json.loads(outcome.body)
        choice = chat_resp["choices"][0]
        reply.obj["output"] = output_items(choice["message"], custom)
        u = chat_resp["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        obj = reply.finish(choice.get("finish_reason"), usage(
            u["prompt_tokens"], cached, u["completion_tokens"], _reasoning_tokens(tokenizer, reply.obj["output"])))
        keep(stored, salt, body, obj, conversation)  # stored before the answer is sent
        send_json(handler, 200, obj)
    elif outcome.cap.status is not None:
        status, text = chat_error(outcome.cap.status, outcome.body)
        send_json(handler, status, error_body(text, _param(text), kind="invalid_request_error" if status < 500 else "server_error"))
    else:  # failed before anything was written
        drop_buffered_head(handler)
        send_json(handler, 500, error_body(f"generation failed: {outcome.failure}", kind="server_error"))


def keep(stored: Stored, salt: Any, body: dict[str, Any], obj: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
    """Store the finished response ``obj`` (unless the request said ``store: false``), so
    that ``GET`` and ``previous_response_id`` find it as soon as the client has the answer;
    one that cannot be stored says so in ``obj``: ``store`` false and ``store_error``
    (``code`` ``response_not_stored``, ``message`` why)."""
    if not body.get("store", True):
        return
    try:
        stored.store().put(salt, str(obj["id"]), obj, [*conversation, *history_of(obj["output"])])
    except NotStored as e:
        obj["store"] = False
        obj["store_error"] = {"code": "response_not_stored",
                              "message": f"this response was not stored ({e}): GET and previous_response_id "
                                         "will not find it"}


def _target(handler: Any, policy: Any) -> tuple[str, Any]:
    """(the response id of a ``/v1/responses/{id}`` path, the tenant's salt: the key's
    under ``--isolate-keys`` with the ``cache_salt`` query parameter, as a POST's body)."""
    path, _, query = handler.path.partition("?")
    response_id = unquote(path[len(PATH) + 1:])
    salt_param = parse_qs(query).get("cache_salt")
    try:
        salt = tenants.request_salt({"cache_salt": salt_param[0]} if salt_param else {},
                                    tenants.presented_key(handler.headers), policy)
    except ValueError as e:
        raise RequestError(str(e), "cache_salt") from None
    return response_id, salt


def handle_get_or_delete(handler: Any, stored: Stored, policy: Any) -> None:
    """``GET`` / ``DELETE /v1/responses/{id}``: the stored response, or OpenAI's 404
    (``policy``: the server's ``tenants.Policy``, whose ``--isolate-keys`` salts the lookup)."""
    try:
        response_id, salt = _target(handler, policy)
    except RequestError as e:
        _send_error(handler, e)
        return
    if handler.command == "GET":
        record = stored.store().get(salt, response_id)
        if record is not None:
            send_json(handler, 200, record.response)
            return
    elif stored.store().delete(salt, response_id):
        send_json(handler, 200, {"id": response_id, "object": "response", "deleted": True})
        return
    send_json(handler, 404, error_body(f"Response with id '{shortened(response_id)}' not found.", code=None))
