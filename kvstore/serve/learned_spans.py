"""Volatile spans ``--stable-prefix`` learns from the requests it sees, per salt.

A rule per client version is a treadmill: each release can move a line. So the texts of a
conversation's *opening* (its system, developer and user messages before the first
assistant or tool message) are kept, a few per salt, and each new opening is compared with them.
Where the two differ only in a short run of whole lines and agree again after it (the same
instructions and tools follow), that run is volatile: a rule is made from the lines around
it and used like a built-in rule from then on, the teaching request included (it costs that
request nothing: its render misses where the span was, as it would have without the rule).

Guarantees:
- A rule is learned only from a run of at most ``MAX_LINES`` lines and ``MAX_CHARS``
  characters on either side, with at least ``MIN_AGREE`` characters of equal text after
  it (the rest of that text, the later leading texts and the tools), between anchor lines
  that occur once in both texts, and only when every other leading text of the two
  openings is equal or learnable too (a user who changed their instructions teaches
  nothing; the opening's last user text, the question, may differ and teaches nothing).
  In a user message a run is learned only inside a tagged block (``<tag>`` ... ``</tag>``,
  as agents wrap what they inject): never the user's own words.
  Every rule is checked on both texts before it is kept: it must find exactly the run.
- Bounded: ``MAX_OPENINGS`` openings and ``MAX_RULES`` rules per salt, each text cut to
  ``stable_prefix.SCAN_CHARS``; rules run in RE2 like every other (linear time).
- Per salt: a record keyed by the salt (``side_records.RecordDir``, beside the sessions'
  records, in their bounds); one tenant's openings never teach another's rules, and
  ``rules_for`` / ``GET /v1/cache/stats`` show a caller only its own salt's rules.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .. import side_records
from ..escape import logger, visible
from . import spans as sp

log = logger("kvstore")

MAX_OPENINGS = 6  # leading texts kept per salt, the oldest dropped
MAX_RULES = 16  # learned rules per salt, the oldest dropped
MAX_LINES = 40  # lines of a learnable run
MAX_CHARS = 4096  # characters of a learnable run
MIN_AGREE = 1024  # characters of equal text that must follow it
MAX_TEXTS = 64  # leading texts compared per request
MAX_SALTS = 64  # salts whose openings and rules are held in memory (the least recent read again from disk)
_NAME = re.compile(r"learned-[0-9]{1,4}")  # the names this module gives
PERSON = b"kvstore-learned"
MASK = "\x00"  # a known span, in a text compared
_ANY_TAG = re.compile(r"<(/?)([A-Za-z_][\w-]{0,63})>")  # an opening or closing tag


@dataclass(frozen=True)
class Learned:
    """A learned span: the run of lines between ``before`` (text ending with a newline; ""
    at the start of a text) and ``after`` (text starting with a newline; "" at its end)."""

    name: str
    before: str
    after: str

    def rule(self) -> sp.Rule:
        """The span as a rule (its group 1), compiled once per process."""
        return _compiled(self.name, self.before, self.after)

    def as_json(self) -> dict[str, str]:
        return {"name": self.name, "before": self.before, "after": self.after}


@functools.lru_cache(maxsize=1024)
def _compiled(name: str, before: str, after: str) -> sp.Rule:
    head = _escape(before) if before else r"\A"
    tail = _escape(after) if after else r"\z"
    return sp.Rule(name, sp.compile_rule(f"{head}((?:[^\\n]*\\n){{0,{MAX_LINES}}}?[^\\n]*){tail}"), 1)


def _escape(text: str) -> str:
    """``text`` as an RE2 literal: ASCII punctuation escaped, newlines and tabs spelled."""
    out = []
    for c in text:
        if c == "\n":
            out.append(r"\n")
        elif c == "\t":
            out.append(r"\t")
        elif c.isascii() and not c.isalnum() and c != " ":
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)


# -- the openings a request brings ----------------------------------------------------------


def leading(messages: Sequence[Any]) -> list[tuple[str, str]]:
    """The opening's texts as (role, text): each text of its system, developer and user
    messages (those before the first assistant or tool message), each cut to
    ``SCAN_CHARS``, at most ``SCAN_TOTAL`` characters and ``MAX_TEXTS`` texts in all; []
    when the opening has no user message."""
    n = sp.head_length(messages)
    if sp.first_user(messages, n) is None:
        return []
    out: list[tuple[str, str]] = []
    budget = sp.SCAN_TOTAL
    for i in range(n):
        for _, text in sp.texts_of(messages[i]):
            if budget <= 0 or len(out) >= MAX_TEXTS:
                return out
            out.append((str(messages[i]["role"]), text[:min(sp.SCAN_CHARS, budget)]))
            budget -= len(out[-1][1])
    return out


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the longest equal prefix, by halving (each comparison runs in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _line_start(text: str, at: int) -> int:
    return text.rfind("\n", 0, at) + 1


def _line_end(text: str, at: int) -> int:
    end = text.find("\n", at)
    return len(text) if end < 0 else end


def _anchor_before(text: str, start: int) -> str | None:
    """The text from the nearest non-blank line before ``start`` (a line start) to it; ""
    at the text's start; None when only blank lines precede."""
    if start == 0:
        return ""
    at = start - 1  # the newline ending the line before
    while at >= 0:
        ls = _line_start(text, at)
        if text[ls:at].strip():
            return text[ls:start]
        at = ls - 1
    return None


def _anchor_after(text: str, end: int) -> str | None:
    """The text from ``end`` (a line end) through the nearest non-blank line after it; ""
    at the text's end; None when only blank lines follow."""
    if end == len(text):
        return ""
    at = end + 1
    while at <= len(text):
        le = _line_end(text, at)
        if text[at:le].strip():
            return text[end:le]
        if le == len(text):
            return None
        at = le + 1
    return None


def _in_tagged_block(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` lies inside ``<tag>`` ... ``</tag>``: the innermost tag
    still open at ``start`` is closed after ``end``. One pass over the tags before
    ``start`` (a stack) and one search after ``end``: linear, however many tags a client
    sends."""
    stack: list[str] = []
    for m in _ANY_TAG.finditer(text, 0, start):
        name = m.group(2)
        if not m.group(1):
            stack.append(name)
        elif name in stack:
            while stack.pop() != name:
                pass
    return bool(stack) and f"</{stack[-1]}>" in text[end:]


def _region(a: str, b: str) -> tuple[int, int, int, int, int] | None:
    """The run of whole lines where ``b`` differs from ``a``: (start, end in b, start, end
    in a, equal characters after it), None when it is not short."""
    p = _common_prefix(a, b)
    s = _common_suffix(a, b, min(len(a), len(b)) - p)
    start = _line_start(b, p)
    end_b, end_a = _line_end(b, len(b) - s), _line_end(a, len(a) - s)
    start_a = _line_start(a, p)
    if start != start_a:
        return None
    for x, lo, hi in ((b, start, end_b), (a, start_a, end_a)):
        if hi - lo > MAX_CHARS or x.count("\n", lo, hi) >= MAX_LINES:
            return None
    return start, end_b, start_a, end_a, len(b) - end_b


def _learn_one(a: str, b: str, raw_a: str, raw_b: str, user: bool, agree_later: int,
               name: str) -> Learned | None:
    """The rule for the one run where ``b`` differs from ``a`` (both with the known spans
    masked; ``raw_*`` as sent), or None (see the module)."""
    got = _region(a, b)
    if got is None:
        return None
    start, end, start_a, end_a, after = got
    if after + agree_later < MIN_AGREE:
        return None
    before_text, after_text = _anchor_before(b, start), _anchor_after(b, end)
    if before_text is None or after_text is None or (not before_text and not after_text):
        return None
    if MASK in before_text + after_text + b[start:end] + a[start_a:end_a]:
        return None  # next to or over a known span: that span already covers it
    if user and (not after_text or not _in_tagged_block(b, start, end)):
        return None  # a user message: only what an agent injected, never the user's words
    if before_text and (b.count(before_text) != 1 or a.count(before_text) != 1):
        return None
    learned = Learned(name, before_text, after_text)
    try:
        rule = learned.rule()
    except ValueError:
        return None
    if _find(rule, b) != [(start, end)] or _find(rule, a) != [(start_a, end_a)]:
        return None  # it must find exactly the run, in both texts ...
    if len(_find(rule, raw_b)) != 1 or len(_find(rule, raw_a)) != 1:
        return None  # ... and one span in each as sent
    return learned


def _find(rule: sp.Rule, text: str) -> list[tuple[int, int]]:
    return sp.matches(rule, text, min(len(text), sp.SCAN_CHARS))


def learn(old: Sequence[tuple[str, str]], new: Sequence[tuple[str, str]], tools: int, known: Sequence[sp.Rule],
          names: Sequence[str]) -> list[Learned]:
    """The rules ``new`` teaches against ``old`` (two openings' ``leading`` texts, compared
    with the spans of ``known`` rules masked; ``tools``: characters of equal tools after
    them; ``names`` for the new rules, in order): [] unless every differing text is
    learnable."""
    if len(old) != len(new) or [r for r, _ in old] != [r for r, _ in new]:
        return []
    old_m = [_masked(t, known) for _, t in old]
    new_m = [_masked(t, known) for _, t in new]
    differ = [k for k in range(len(new)) if old_m[k] != new_m[k]]
    if not differ or len(differ) > 4 or len(differ) > len(names):  # (another question is one text)
        return []
    out: list[Learned] = []
    question = max((k for k, (role, _) in enumerate(new) if role == "user"), default=None)  # the last user text
    for k in differ:
        later = sum(len(t) for j, t in enumerate(new_m) if j > k and old_m[j] == t) + tools
        got = _learn_one(old_m[k], new_m[k], old[k][1], new[k][1], new[k][0] == "user", later, names[len(out)])
        if got is None and k != question:
            return []  # a text that differs in more than a short span: nothing is learned
        if got is not None:
            out.append(got)
    return out


def _masked(text: str, rules: Sequence[sp.Rule]) -> str:
    """``text`` with each span of ``rules`` replaced by ``MASK``."""
    found = sorted((a, b) for r in rules for a, b in _find(r, text))
    out, at = [], 0
    for a, b in found:
        if a >= at:
            out.append(text[at:a] + MASK)
            at = b
    return "".join(out) + text[at:]


# -- kept per salt --------------------------------------------------------------------------


def record_name(salt_key: bytes | None) -> str:
    """The salt's record in the sessions' record directory (a name of the same shape)."""
    return hashlib.blake2b(salt_key or b"", digest_size=16, person=PERSON).hexdigest() + ".json"


def _digest(texts: Sequence[tuple[str, str]], tools: str) -> str:
    h = hashlib.blake2b(digest_size=16, person=PERSON)
    for role, text in texts:
        h.update(f"{role}\x00{len(text)}\x00".encode())
        h.update(text.encode("utf-8", "surrogatepass"))
    h.update(tools.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class Learner:
    """The learned rules and recent openings of each salt, in ``records`` (the sessions'
    record directory (``{"openings": [...], "rules": [...]}``). ``rules`` reads them; ``observe``
    compares a request's opening with the kept ones, keeps it, and returns the salt's rules
    (new ones included). A record that cannot be read is none; one that cannot be written
    costs only the learning."""

    def __init__(self, records: side_records.RecordDir, write: bool = True,
                 warn: Callable[[str], None] | None = None) -> None:
        self.records, self.write, self.warn = records, write, warn
        self.lock = threading.Lock()
        self._cache: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

    def _load(self, name: str) -> dict[str, Any]:
        if name in self._cache:
            self._cache.move_to_end(name)
        else:
            rec = self.records.read(name)
            ok = isinstance(rec, dict) and isinstance(rec.get("openings"), list) and isinstance(rec.get("rules"), list)
            self._cache[name] = ({"openings": rec["openings"], "rules": rec["rules"]}
                                 if ok and rec is not None else {"openings": [], "rules": []})
            while len(self._cache) > MAX_SALTS:  # bounded: many tenants cost a re-read, never memory
                self._cache.popitem(last=False)
        return self._cache[name]

    def learned(self, salt_key: bytes | None) -> list[Learned]:
        """The salt's learned spans, oldest first."""
        with self.lock:
            return _rules_of(self._load(record_name(salt_key)))

    def rules(self, salt_key: bytes | None) -> tuple[sp.Rule, ...]:
        return tuple(r.rule() for r in self.learned(salt_key))

    def observe(self, messages: Sequence[Any], tools: str, known: Sequence[sp.Rule],
                salt_key: bytes | None) -> tuple[sp.Rule, ...]:
        """The salt's learned rules after ``messages`` (its opening compared with the kept
        ones, then kept; ``tools``: the request's tools as rendered to JSON)."""
        texts = leading(messages)
        name = record_name(salt_key)
        with self.lock:
            rec = self._load(name)
            if not texts:
                return tuple(r.rule() for r in _rules_of(rec))
            digest = _digest(texts, tools)
            if any(o.get("digest") == digest for o in rec["openings"] if isinstance(o, dict)):
                return tuple(r.rule() for r in _rules_of(rec))
            have = _rules_of(rec)
            rules = [*known, *(r.rule() for r in have)]
            tools_hash = hashlib.blake2b(tools.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
            fresh: list[Learned] = []
            for o in reversed(rec["openings"]):
                old = _texts_of(o)
                if old is None:
                    continue
                same_tools = o.get("tools") == tools_hash
                taken = {r.name for r in have}
                names = [f"learned-{k}" for k in range(1, 10 * MAX_RULES) if f"learned-{k}" not in taken]
                fresh = learn(old, texts, len(tools) if same_tools else 0, rules, names)
                if fresh:
                    break
            rec["rules"] = [r.as_json() for r in (have + fresh)[-MAX_RULES:]]
            rec["openings"] = [*rec["openings"], {
                "digest": digest, "texts": [list(t) for t in texts],
                "tools": tools_hash},
            ][-MAX_OPENINGS:]
            if self.write:
                self._save(name, rec)
            for r in fresh:
                log.info("kvstore: --stable-prefix learned a volatile span, %s: the lines between %r and %r",
                            r.name, visible(r.before[-60:], newlines=False), visible(r.after[:60], newlines=False))
            return tuple(r.rule() for r in _rules_of(rec))

    def _save(self, name: str, rec: dict[str, Any]) -> None:
        """Keep ``rec``, its oldest openings dropped until it takes at most a quarter of the
        record directory's bytes (the sessions' records keep the rest)."""
        limit = min(self.records.max_record, self.records.max_bytes // 4)
        out = {"openings": list(rec["openings"]), "rules": rec["rules"]}
        while out["openings"] and len(json.dumps(out, separators=(",", ":"))) + 32 > limit:
            out["openings"] = out["openings"][1:]
        try:
            self.records.write(name, out)
        except Exception as e:  # ValueError (over the bound), OSError, BlobError: kept in this process only
            if self.warn is not None:
                self.warn(f"{self.records.path}: {e}")


def _rules_of(rec: dict[str, Any]) -> list[Learned]:
    out = []
    for r in rec["rules"]:
        if (isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("name", "before", "after"))
                and _NAME.fullmatch(r["name"]) and len(r["before"]) <= MAX_CHARS and len(r["after"]) <= MAX_CHARS):
            learned = Learned(r["name"], r["before"], r["after"])
            try:
                learned.rule()
            except ValueError:
                continue
            out.append(learned)
    return out


def _texts_of(opening: Any) -> list[tuple[str, str]] | None:
    texts = opening.get("texts") if isinstance(opening, dict) else None
    if not isinstance(texts, list) or not all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t)
                                              for t in texts):
        return None
    return [(t[0], t[1]) for t in texts]
