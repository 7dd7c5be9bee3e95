"""kvstore.adapters.http: a request body's JSON nesting is bounded by its structure, not its text."""

from __future__ import annotations

import json

import pytest


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    """The depth bound reads the JSON's structure, not its text: a prompt full of brackets
    (code, a quoted bracket after an escaped quote) is accepted; the structure's own depth
    is what is refused."""
    from kvstore.adapters.http import MAX_DEPTH, BodyError, nesting, parse_json

    text = "x = [[[[{{{{" * 500 + ' \\" [[[ \\\\'
    body = json.dumps({"messages": [{"role": "user", "content": text}], "deep": json.loads(nested(MAX_DEPTH - 1))})
    assert nesting(body.encode()) == MAX_DEPTH and parse_json(body.encode())["messages"][0]["content"] == text
    assert nesting(b'{"a": "]]]]", "b": [[["}"]]]}') == 4
    with pytest.raises(BodyError, match="levels deep") as e:
        parse_json(nested(MAX_DEPTH + 1).encode())
    assert e.value.status == 400
