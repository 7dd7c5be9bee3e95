"""kvstore.serve.response_record: the one reader of stored response records returns a
valid record or raises RecordError, on any bytes and any JSON (property tests), and reads
back what its writer wrote."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from kvstore.serve.response_record import MAX_DEPTH, ROLES, Record, RecordError, check_message

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=30)
KEYS = st.sampled_from(["seq", "id", "response", "conversation", "role", "content", "tool_calls", "tool_call_id",
                        "type", "function", "name", "arguments", "other"])
# JSON shaped like records: the keys a record has, so the checks past the first are reached
NEAR = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**64) | st.text(max_size=4)
                    | st.sampled_from(list(ROLES) + ["function", "r"]),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=5),
                    max_leaves=25)


def valid(record: Any) -> None:
    """What a handler relies on: every field of the type it uses."""
    assert isinstance(record, Record)
    assert isinstance(record.id, str) and record.id and record.response["id"] == record.id
    assert record.seq is None or (type(record.seq) is int and record.seq >= 0)
    for m in record.conversation:
        check_message(m, "m")
        assert isinstance(m["role"], str) and isinstance(m["content"], str)


def read(data: bytes) -> Record | None:
    try:
        record = Record.from_bytes(data)
    except RecordError as e:
        assert e.reason in ("not_json", "too_deep", "bad_field") and str(e)
        return None
    valid(record)
    return record


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_record_or_a_record_error(data: bytes) -> None:
    read(data)


@settings(max_examples=300, deadline=None)
@given(JSON | NEAR)
def test_any_json_is_a_record_or_a_record_error(value: Any) -> None:
    read(json.dumps(value).encode())


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, NEAR, max_size=4), NEAR)
def test_near_records_are_a_record_or_a_record_error(extra: dict[str, Any], conversation: Any) -> None:
    base: dict[str, Any] = {"id": "r", "response": {"id": "r"}, "conversation": conversation}
    read(json.dumps({**base, **extra}).encode())


MESSAGE = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["system", "user", "assistant"]), st.text()),
    st.builds(lambda c, i: {"role": "tool", "content": c, "tool_call_id": i}, st.text(), st.text()),
    st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls}, st.text(), st.lists(
        st.builds(lambda i, n, a: {"id": i, "type": "function", "function": {"name": n, "arguments": a}},
                  st.text(), st.text(), st.text()), max_size=3)))


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1), st.none() | st.integers(0, (1 << 63) - 1), st.dictionaries(st.text(), JSON, max_size=3),
       st.lists(MESSAGE, max_size=4))
def test_what_the_writer_writes_reads_back(rid: str, seq: int | None, extra: dict[str, Any],
                                           conversation: list[dict[str, Any]]) -> None:
    record = Record(rid, {**extra, "id": rid}, conversation, seq)
    assert Record.from_bytes(record.to_bytes()) == record


@pytest.mark.parametrize("data, field", [
    (b'{"id": "r", "conversation": []}', "id, response, conversation"),
    (b'{"id": "r", "response": {"id": "r"}, "conversation": "hi"}', "conversation must be a list"),
    (b'{"id": "r", "response": {"id": "s"}, "conversation": []}', "response must be an object whose id"),
    (b'{"id": "r", "response": {"id": "r"}, "conversation": [{"role": "tool", "content": "x"}]}', "tool_call_id"),
    (b'{"seq": true, "id": "r", "response": {"id": "r"}, "conversation": []}', "seq must be an integer"),
    (b'{"seq": -1, "id": "r", "response": {"id": "r"}, "conversation": []}', "seq must be an integer"),
])
def test_each_refusal_names_the_field(data: bytes, field: str) -> None:
    with pytest.raises(RecordError, match=field) as e:
        Record.from_bytes(data)
    assert e.value.reason == "bad_field"


def test_depth_is_checked_before_parsing() -> None:
    ok = b'{"id": "r", "response": {"id": "r", "m": ' + b"[" * (MAX_DEPTH - 2) + b"]" * (MAX_DEPTH - 2) + b'}, "conversation": []}'
    assert Record.from_bytes(ok).id == "r"
    deep = b'{"id": "r", "response": {"id": "r", "m": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b'}, "conversation": []}'
    with pytest.raises(RecordError) as e:
        Record.from_bytes(deep)
    assert e.value.reason == "too_deep"
    with pytest.raises(RecordError):
        Record.from_bytes(b"[" * 10_000_000)
