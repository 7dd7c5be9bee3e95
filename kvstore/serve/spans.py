"""The volatile spans of a chat request: rules (RE2 patterns) and where they match.

Shared by ``stable_prefix`` (which moves and records them) and ``learned_spans`` (which
learns new rules from the requests seen). A span is searched only in the conversation's
*opening* (the system, developer and user messages before the first assistant or tool
message), in bounded windows, each search linear in its text (RE2).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Sequence

import re2  # google-re2: every span search runs in linear time

SCAN_CHARS = 64 * 1024  # spans are searched in the first this many characters of each text
SCAN_TOTAL = 512 * 1024  # ... and in at most this many characters of one request
MAX_SPANS = 32  # spans of one request (later matches are plain text)


@dataclass(frozen=True)
class Rule:
    """A kind of volatile span: ``pattern``'s non-empty matches (an RE2 regex: linear in the
    text whatever the pattern)."""

    name: str
    pattern: Any
    group: int = 0  # the match's group whose text is the span (0: the whole match)


def _options() -> Any:
    o = re2.Options()
    o.log_errors = False  # a refused pattern is said once, by us
    return o


def compile_rule(pattern: str) -> Any:
    """``pattern`` compiled by RE2; ValueError saying why when it cannot run in linear time
    (a backreference, lookaround) or is not a regular expression."""
    try:
        return re2.compile(pattern, _options())
    except re2.error as e:
        why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
    except (TypeError, ValueError, UnicodeError) as e:
        why = str(e)
    try:
        re.compile(pattern)
    except (re.error, TypeError, ValueError, RecursionError, OverflowError) as e:
        raise ValueError(f"--volatile {pattern!r} is not a regular expression: {e}") from None
    raise ValueError(f"--volatile {pattern!r} cannot be searched in linear time ({why}): patterns run in "
                     f"RE2, which has no backreferences and no lookaround; write it without them") from None


def user_rules(patterns: Sequence[str]) -> tuple[Rule, ...]:
    """``--volatile`` patterns as rules; ValueError naming a pattern that does not compile
    or cannot run in RE2 (linear time), and why."""
    return tuple(Rule(f"volatile-{i}", compile_rule(p)) for i, p in enumerate(patterns, 1))


@dataclass(frozen=True)
class Span:
    """One match: in ``messages[message]``'s text (``part``: its index in a list content,
    None for a string content), ``start``..``end``."""

    message: int
    part: int | None
    start: int
    end: int
    rule: str
    text: str


def texts_of(message: Any) -> list[tuple[int | None, str]]:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return [(None, content)]
    if isinstance(content, list):
        return [(k, p["text"]) for k, p in enumerate(content)
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)]
    return []


def head_length(messages: Sequence[Any]) -> int:
    """How many leading messages may hold spans: those before the first assistant or tool
    message (or any message that is not a system, developer or user message)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user"):
            return i
    return len(messages)


def matches(rule: Rule, text: str, limit: int) -> list[tuple[int, int]]:
    """``rule``'s first ``MAX_SPANS`` non-empty matches in ``text[:limit]`` (one cut at
    ``limit`` in a longer text is dropped: its value would be a piece); none in a text RE2
    cannot take (a lone surrogate is not UTF-8)."""
    try:
        found = [m.span(rule.group) for m in itertools.islice(rule.pattern.finditer(text[:limit]), MAX_SPANS)]
    except UnicodeError:
        return []
    return [(a, b) for a, b in found if b > a and (b < limit or limit == len(text))]


def find_spans(messages: Sequence[Any], rules: Sequence[Rule]) -> list[Span]:
    """The spans of ``rules`` in the head of ``messages`` (``head_length``), in order; where
    two overlap the earlier (then the longer) wins. Bounded: only the first ``SCAN_CHARS``
    of each text and ``SCAN_TOTAL`` of the request are searched, at most ``MAX_SPANS``
    found, each search linear (RE2)."""
    out: list[Span] = []
    budget = SCAN_TOTAL
    for i in range(head_length(messages)):
        for part, text in texts_of(messages[i]):
            if budget <= 0 or len(out) >= MAX_SPANS:
                return out
            limit = min(len(text), SCAN_CHARS, budget)
            budget -= limit
            found = sorted((a, -b, r.name) for r in rules for a, b in matches(r, text, limit))
            end = 0
            for start, neg_end, name in found:
                if start >= end and len(out) < MAX_SPANS:
                    out.append(Span(i, part, start, -neg_end, name, text[start:-neg_end]))
                    end = -neg_end
    return out


def first_user(messages: Sequence[Any], n: int) -> int | None:
    """The index of the first user message among the ``n`` of the opening (None: none):
    where the moved spans go."""
    return next((i for i in range(n) if messages[i].get("role") == "user"), None)


