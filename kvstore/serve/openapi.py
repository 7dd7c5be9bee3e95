"""The OpenAPI 3.1 description of every route ``kvstore serve`` answers (``document``), also
served at ``GET /openapi.json``.

It says what the routes accept as the code accepts it (kvstore's own checks in
``anthropic``, ``responses``, ``tenants``, ``http`` and mlx_lm.server's ``validate_model_parameters``):
required fields, types, ranges, and the error statuses each route answers, each with a JSON
error body. Fields the servers ignore are allowed (OpenAI and Anthropic clients send many):
objects are open unless a route refuses what is not listed. A body over ``--max-body-bytes``
is a 413 (``x-max-body-bytes`` gives the limit this server runs with); one nested deeper than
``http.MAX_DEPTH`` is a 400. What the schema-driven fuzz test (tests/system/test_fuzz_routes.py)
generates its requests from, and what its responses are checked against.
"""

from __future__ import annotations

from typing import Any

from ..salt import MAX_SALT_CHARS
from . import http
from .gen_args import INT32

JSON = "application/json"
Schema = dict[str, Any]


def _obj(props: Schema, required: tuple[str, ...] = ()) -> Schema:
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    return out


def _number(low: float | None = None, high: float | None = None) -> Schema:
    out: Schema = {"type": "number"}
    if low is not None:
        out["minimum"] = low
    if high is not None:
        out["maximum"] = high
    return out


def _int(low: int | None = None, high: int | None = None) -> Schema:
    return {**_number(low, high), "type": "integer"}


STRING: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
SALT: Schema = {"type": "string", "minLength": 1, "maxLength": MAX_SALT_CHARS,
                "description": "the tenant's cache namespace (kvstore): another salt shares no cached prefix"}
OPENAI_ERROR = _obj({"error": {"oneOf": [STRING, _obj({"message": STRING, "type": STRING}, ("message",))]}}, ("error",))
ANTHROPIC_ERROR = _obj({"type": {"const": "error"}, "error": _obj({"type": STRING, "message": STRING},
                                                                   ("type", "message"))}, ("type", "error"))
SAMPLING: Schema = {  # mlx_lm.server's validate_model_parameters, as /v1/chat/completions and /v1/completions take them
    "model": STRING, "max_tokens": _int(1), "max_completion_tokens": _int(1), "stream": BOOL,
    "stream_options": _obj({"include_usage": BOOL}), "temperature": _number(0), "top_p": _number(0, 1),
    "top_k": {**_int(0, INT32 - 1), "description": "below the model's vocabulary size"}, "min_p": _number(0, 1), "repetition_penalty": _number(0), "presence_penalty": _number(),
    "frequency_penalty": _number(), "seed": _int(0, (1 << 64) - 1), "logprobs": BOOL, "top_logprobs": _int(0, 11),
    "repetition_context_size": _int(0, INT32 - 1), "presence_context_size": _int(0, INT32 - 1),
    "frequency_context_size": _int(0, INT32 - 1),
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"}, "additionalProperties": _number(),
                   "description": "token id (below the model's vocabulary size) -> bias"},
    "stop": {"oneOf": [STRING, {"type": "array", "items": STRING}]}, "cache_salt": SALT,
}
TEXT_PART = _obj({"type": {"const": "text"}, "text": STRING}, ("type", "text"))
CHAT_MESSAGE = _obj({"role": {"enum": ["system", "user", "assistant", "developer"]},
                     "content": {"oneOf": [STRING, {"type": "array", "items": TEXT_PART}]}}, ("role", "content"))
CHAT_TOOL = _obj({"type": {"const": "function"}, "function": _obj(
    {"name": STRING, "description": STRING, "parameters": {"type": "object"}}, ("name",))}, ("type", "function"))
CHAT_REQUEST = _obj({**SAMPLING, "messages": {"type": "array", "items": CHAT_MESSAGE, "minItems": 1},
                     "tools": {"type": "array", "items": CHAT_TOOL}}, ("messages",))
COMPLETION_REQUEST = _obj({**SAMPLING, "prompt": STRING}, ("prompt",))
USAGE = _obj({"prompt_tokens": _int(0), "completion_tokens": _int(0), "total_tokens": _int(0)},
             ("prompt_tokens", "completion_tokens"))
CHAT_COMPLETION = _obj({"id": STRING, "object": STRING, "model": STRING, "created": _int(),
                        "choices": {"type": "array", "items": {"type": "object"}}, "usage": USAGE},
                       ("id", "object", "choices", "usage"))

BLOCK = {"oneOf": [  # Anthropic content blocks kvstore translates (anthropic._user / _assistant)
    TEXT_PART,
    _obj({"type": {"const": "tool_use"}, "id": STRING, "name": STRING, "input": {"type": "object"}},
         ("type", "name", "input")),
    _obj({"type": {"const": "tool_result"}, "tool_use_id": STRING, "is_error": BOOL,
          "content": {"oneOf": [STRING, {"type": "array", "items": TEXT_PART}]}}, ("type", "tool_use_id")),
]}
ANTHROPIC_MESSAGE = _obj({"role": {"enum": ["user", "assistant"]},
                          "content": {"oneOf": [STRING, {"type": "array", "items": BLOCK}]}}, ("role", "content"))
MESSAGES_FIELDS: Schema = {
    "model": STRING, "max_tokens": _int(1), "messages": {"type": "array", "items": ANTHROPIC_MESSAGE, "minItems": 1},
    "system": {"oneOf": [STRING, {"type": "array", "items": TEXT_PART}]}, "stream": BOOL,
    "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "temperature": _number(0, 1), "top_p": _number(0, 1), "top_k": _int(0), "metadata": {"type": "object"},
    "tools": {"type": "array", "items": _obj({"name": STRING, "description": STRING,
                                               "input_schema": {"type": "object"}}, ("name",))},
    "tool_choice": _obj({"type": {"enum": ["auto", "any", "none"]}}, ("type",)),
    "thinking": _obj({"type": {"enum": ["enabled", "adaptive", "disabled"]}, "budget_tokens": _int(0)}, ("type",)),
    "cache_salt": SALT,
}
MESSAGES_REQUEST = _obj(MESSAGES_FIELDS, ("max_tokens", "messages"))
COUNT_REQUEST = _obj({k: v for k, v in MESSAGES_FIELDS.items() if k not in ("max_tokens", "stream")}, ("messages",))
MESSAGE = _obj({"id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": STRING,
                "content": {"type": "array", "items": {"type": "object"}}, "stop_reason": STRING,
                "usage": _obj({"input_tokens": _int(0), "output_tokens": _int(0)}, ("input_tokens", "output_tokens"))},
               ("id", "type", "role", "content", "stop_reason", "usage"))

INPUT_ITEM = {"oneOf": [  # responses.input_messages
    _obj({"type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
          "content": {"oneOf": [STRING, {"type": "array", "items": _obj(
              {"type": {"enum": ["input_text", "output_text"]}, "text": STRING}, ("type", "text"))}]}},
         ("type", "role", "content")),
    _obj({"type": {"const": "function_call"}, "call_id": STRING, "name": STRING, "arguments": STRING},
         ("type", "call_id", "name")),
    _obj({"type": {"const": "function_call_output"}, "call_id": STRING, "output": STRING}, ("type", "call_id")),
]}
RESPONSES_REQUEST = _obj({
    "model": STRING, "input": {"oneOf": [STRING, {"type": "array", "items": INPUT_ITEM, "minItems": 1}]},
    "instructions": STRING, "max_output_tokens": _int(1), "temperature": _number(0, 2), "top_p": _number(0, 1),
    "stream": BOOL, "store": BOOL, "parallel_tool_calls": BOOL,
    "tools": {"type": "array", "items": _obj({"type": {"enum": ["function", "custom"]}, "name": {
        "type": "string", "minLength": 1}, "description": STRING, "parameters": {"type": "object"}}, ("type", "name"))},
    "tool_choice": {"enum": ["auto", "none", "required"]},
    "reasoning": _obj({"effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}}),
    "text": {"type": "object"}, "metadata": {"type": "object"}, "include": {"type": "array", "items": STRING},
    "previous_response_id": {"type": "string", "minLength": 1}, "cache_salt": SALT,
}, ("input",))
RESPONSE = _obj({"id": STRING, "object": {"const": "response"}, "status": STRING, "model": STRING,
                 "output": {"type": "array", "items": {"type": "object"}}}, ("id", "object", "status", "output"))
DELETED = _obj({"id": STRING, "object": {"const": "response"}, "deleted": {"const": True}}, ("id", "object", "deleted"))
MODEL = _obj({"id": STRING, "object": {"const": "model"}, "owned_by": STRING}, ("id", "object"))
MODELS = _obj({"object": {"const": "list"}, "data": {"type": "array", "items": MODEL}}, ("object", "data"))
HEALTH = _obj({"status": STRING}, ("status",))
SSE_EVENT = _obj({"event": STRING, "data": STRING}, ("data",))  # one server-sent event, as with stream: true
STATS = {"type": "object", "description": "the prompt cache's counters (KVStore.stats) and the start's progress"}


def _json(description: str, schema: Schema) -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _post(summary: str, request: Schema, answer: Schema, error: Schema, *, stream: bool = True) -> Schema:
    """A POST route: its JSON body, its answer (or an event stream with ``stream: true``) and
    its errors, each with ``error``'s body."""
    ok = _json("the answer", answer)
    if stream:
        ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    errors = {"400": "a body that is not usable: not JSON, not UTF-8, too deep, a field of the wrong type or range",
              "401": "a missing or wrong API key (--api-key)", "404": "a response id or model not found",
              "411": "no Content-Length", "413": "a body over --max-body-bytes",
              "503": "the server is still starting, or busy"}
    return {"summary": summary, "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
            "responses": {"200": ok, **{code: _json(why, error) for code, why in errors.items()}}}


def _get(summary: str, answer: Schema, *, content: str = JSON, query_salt: bool = False,
         errors: tuple[str, ...] = ("401",)) -> Schema:
    ok = {"description": "the answer", "content": {content: {"schema": answer}}}
    op: Schema = {"summary": summary, "responses": {"200": ok, **{c: _json("refused", OPENAI_ERROR) for c in errors}}}
    if query_salt:
        op["parameters"] = [{"name": "cache_salt", "in": "query", "required": False, "schema": SALT}]
    return op


def _head(summary: str) -> Schema:
    return {"summary": summary + " (headers only)", "responses": {"200": {"description": "as GET, no body"},
                                                                 "401": {"description": "a missing or wrong API key"}}}


def document(max_body_bytes: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 description of ``kvstore serve``'s routes; ``max_body_bytes``: the
    server's ``--max-body-bytes`` (default: the one this process runs with)."""
    limit = http.MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes
    response_id = [{"name": "id", "in": "path", "required": True, "schema": STRING},
                   {"name": "cache_salt", "in": "query", "required": False, "schema": SALT}]
    stored: Schema = {"parameters": response_id, "responses": {"200": _json("the stored response", RESPONSE),
                                                       "400": _json("a bad cache_salt", OPENAI_ERROR),
                                                       "401": _json("a missing or wrong API key", OPENAI_ERROR),
                                                       "404": _json("no such response (for this tenant)", OPENAI_ERROR)}}
    paths: dict[str, Any] = {
        "/v1/chat/completions": {"post": _post("OpenAI chat completions (mlx_lm.server's)", CHAT_REQUEST,
                                               CHAT_COMPLETION, OPENAI_ERROR)},
        "/v1/completions": {"post": _post("OpenAI text completions (mlx_lm.server's)", COMPLETION_REQUEST,
                                          CHAT_COMPLETION, OPENAI_ERROR)},
        "/v1/messages": {"post": _post("Anthropic Messages", MESSAGES_REQUEST, MESSAGE, ANTHROPIC_ERROR)},
        "/v1/messages/count_tokens": {"post": _post("Anthropic token count", COUNT_REQUEST,
                                                    _obj({"input_tokens": _int(0)}, ("input_tokens",)),
                                                    ANTHROPIC_ERROR, stream=False)},
        "/v1/responses": {"post": _post("OpenAI Responses", RESPONSES_REQUEST, RESPONSE, OPENAI_ERROR)},
        "/v1/responses/{id}": {"get": {"summary": "a stored response", **stored},
                               "delete": {"summary": "remove a stored response", **{
                                   **stored, "responses": {**stored["responses"], "200": _json("removed", DELETED)}}}},
        "/v1/cache/stats": {"get": {**_get("the prompt cache's counters", STATS, query_salt=True, errors=("400", "401"))},
                            "head": _head("the prompt cache's counters")},
        "/metrics": {"get": _get("Prometheus metrics", STRING, content="text/plain"), "head": _head("metrics")},
        "/health": {"get": {"summary": "200 once ready, 503 while starting; never needs a key", "responses": {
                        "200": _json("ready", HEALTH), "503": _json("starting", HEALTH)}},
                    "head": {"summary": "as GET, headers only", "responses": {
                        "200": {"description": "ready"}, "503": {"description": "starting"}}}},
        "/v1/models": {"get": _get("the served model ids", MODELS), "head": _head("the served model ids")},
        "/v1/models/{model}": {"get": {"summary": "one served model", "parameters": [
            {"name": "model", "in": "path", "required": True, "schema": STRING}], "responses": {
                "200": _json("the model", MODEL), "401": _json("a missing or wrong API key", OPENAI_ERROR),
                "404": _json("not served here", OPENAI_ERROR)}}},
        "/openapi.json": {"get": _get("this description", {"type": "object"})},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvstore serve", "version": "1",
                 "description": "mlx_lm.server with kvstore's prompt cache, the Anthropic Messages and OpenAI "
                                "Responses routes. Every POST body is JSON, at most x-max-body-bytes bytes "
                                f"(413 over it) and nested at most {http.MAX_DEPTH} levels (400 deeper)."},
        "x-max-body-bytes": limit,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{}, {"bearer": []}, {"apiKey": []}],  # keys only under --api-key (not /health)
        "paths": paths,
    }
