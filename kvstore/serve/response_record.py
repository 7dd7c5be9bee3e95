"""The format of one stored response (``response_store``): one writer, one validating reader.

A record is a JSON object ``{"seq", "id", "response", "conversation"}`` written by
``Record.to_bytes`` and read back only through ``Record.from_bytes``, which checks every
field by type (and the conversation's messages as ``responses.input_messages`` makes
them) and raises ``RecordError`` naming the field and a short ``reason`` otherwise. So a
handler never meets a missing key or a wrong type: a record that is not one kvstore wrote
(torn, foreign, planted, too large, nested too deep) is a miss, never a traceback.

``seq`` orders records for eviction (``response_store``): a number kvstore hands out,
never a clock. Records written before it existed have none (``seq`` None) and rank as
older than any record that has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .http import MAX_DEPTH as BODY_DEPTH, nesting

# The response echoes the request's tools, text and metadata, each nested at most
# BODY_DEPTH inside the request body; a record puts them two levels deeper.
MAX_DEPTH = BODY_DEPTH + 4
MAX_SEQ = (1 << 63) - 1
ROLES = frozenset({"system", "user", "assistant", "tool"})
_MESSAGE_KEYS = {"system": {"role", "content"}, "user": {"role", "content"},
                 "assistant": {"role", "content", "tool_calls"}, "tool": {"role", "content", "tool_call_id"}}
_RECORD_KEYS = frozenset({"seq", "id", "response", "conversation"})


class RecordError(ValueError):
    """A stored response record kvstore did not write (torn, foreign, planted or damaged):
    ``reason`` is a short code for the stats (``not_json``, ``too_deep``, ``bad_field``,
    ``too_large``, ``not_regular``, ``other_id``), the message says which field."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise RecordError("bad_field", what)


def _text(value: Any, where: str) -> None:
    _need(isinstance(value, str), f"{where} must be a string, got {type(value).__name__}")


def _call(call: Any, where: str) -> None:
    _need(isinstance(call, dict) and set(call) == {"id", "type", "function"}, f"{where} must be an object "
          "with id, type and function")
    _text(call["id"], f"{where}.id")
    _need(call["type"] == "function", f"{where}.type must be 'function'")
    fn = call["function"]
    _need(isinstance(fn, dict) and set(fn) == {"name", "arguments"}, f"{where}.function must be an object with "
          "name and arguments")
    _text(fn["name"], f"{where}.function.name")
    _text(fn["arguments"], f"{where}.function.arguments")


def check_message(m: Any, where: str) -> None:
    """``m`` is a chat message as ``responses.input_messages`` makes one; RecordError if not."""
    _need(isinstance(m, dict), f"{where} must be an object")
    role = m.get("role")
    _need(isinstance(role, str) and role in ROLES, f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
    _need(set(m) <= _MESSAGE_KEYS[role] and "content" in m, f"{where}: a {role} message has "
          f"{sorted(_MESSAGE_KEYS[role])} (content required), got {sorted(map(str, m))}")
    _text(m["content"], f"{where}.content")
    if role == "tool":
        _need("tool_call_id" in m, f"{where}.tool_call_id is required")
        _text(m["tool_call_id"], f"{where}.tool_call_id")
    if "tool_calls" in m:
        _need(isinstance(m["tool_calls"], list), f"{where}.tool_calls must be a list")
        for j, call in enumerate(m["tool_calls"]):
            _call(call, f"{where}.tool_calls[{j}]")


@dataclass(frozen=True)
class Record:
    """One stored response: its ``id``, the ``response`` object ``GET`` answers, the chat
    ``conversation`` that led to it and its answer (what ``previous_response_id``
    continues), and ``seq`` (None: written before records had one)."""

    id: str
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    seq: int | None = None

    def to_bytes(self) -> bytes:
        head = {"seq": self.seq} if self.seq is not None else {}
        return json.dumps({**head, "id": self.id, "response": self.response, "conversation": self.conversation},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Record":
        """The record ``data`` holds; RecordError (only) when it is not one kvstore wrote."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError("not_json", f"not UTF-8 text: {e}") from None
        if data.count(b"[") + data.count(b"{") > MAX_DEPTH and nesting(data) > MAX_DEPTH:
            raise RecordError("too_deep", f"nests arrays and objects more than {MAX_DEPTH} levels deep")
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise RecordError("not_json", f"not JSON: {e}") from None
        _need(isinstance(obj, dict), f"a record is a JSON object, got {type(obj).__name__}")
        _need(set(obj) <= _RECORD_KEYS and {"id", "response", "conversation"} <= set(obj),
              f"a record has id, response, conversation (and seq), got {sorted(obj)[:8]}")
        rid, seq, response, conversation = obj["id"], obj.get("seq"), obj["response"], obj["conversation"]
        _need(isinstance(rid, str) and bool(rid), "id must be a non-empty string")
        _need(seq is None or (type(seq) is int and 0 <= seq <= MAX_SEQ), f"seq must be an integer from 0 to "
              f"{MAX_SEQ}, got {seq!r:.40}")
        _need(isinstance(response, dict) and response.get("id") == rid, "response must be an object whose id is "
              "the record's")
        _need(isinstance(conversation, list), "conversation must be a list of messages")
        for i, m in enumerate(conversation):
            check_message(m, f"conversation[{i}]")
        return cls(rid, response, conversation, seq)
