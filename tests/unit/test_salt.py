"""kvstore.salt: what a ``cache_salt`` may be, as property tests (hypothesis; the budget is
tests/conftest.py's profile): a salt is accepted exactly when it is a non-empty string of at
most 256 characters (bytes of at most 1024 from the Python API), anything else is a
SaltError naming the field; accepted salts never collide and never raise downstream."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, strategies as st

from kvstore import salt

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                    max_leaves=5)
SALTS = st.text(st.characters(codec="utf-8") | st.characters(categories=["Cs"]), max_size=300)  # lone surrogates too


@given(st.one_of(SALTS, JSON))
@example("")
@example("x" * 257)
@example("\ud800")  # a JSON body may carry a lone surrogate ("\\ud800")
def test_a_body_salt_is_a_bounded_string_or_a_salt_error(value: Any) -> None:
    ok = isinstance(value, str) and 0 < len(value) <= salt.MAX_SALT_CHARS
    try:
        got = salt.salt_of_body({"cache_salt": value})
    except salt.SaltError as e:
        assert not ok and str(e).startswith("cache_salt must"), (value, str(e))
        return
    assert ok and got == value
    assert len(salt.salt_key(got)) == 32 and salt.combine(b"outer", got) != salt.combine(b"outer", None)
    assert salt.salt_of_body({}) is None


@given(st.one_of(st.binary(max_size=1100), JSON, SALTS), st.text(min_size=1, max_size=20))
def test_check_salt_names_the_field(value: Any, field: str) -> None:
    try:
        got = salt.check_salt(value, field)
    except salt.SaltError as e:
        assert str(e).startswith(f"{field} must"), str(e)
        return
    assert got is None or got == (bytes(value) if isinstance(value, (bytes, bytearray)) else value)


@given(SALTS.filter(bool), SALTS.filter(bool))
def test_distinct_salts_give_distinct_keys(a: str, b: str) -> None:
    """Keys are derived from the salt's exact code points (surrogates kept, never replaced:
    two salts differing in one lone surrogate are two tenants)."""
    assert (salt.salt_key(a) == salt.salt_key(b)) == (a == b)
    assert (salt.combine(a, None) == salt.combine(b, None)) == (a == b)


def test_a_salt_that_is_not_a_string_is_refused_by_type() -> None:
    for value, kind in ((None, "null"), (3, "number"), (True, "boolean"), ([], "array"), ({}, "object")):
        with pytest.raises(salt.SaltError, match=f"must be a string, got {kind}"):
            salt.salt_of_body({"cache_salt": value})
