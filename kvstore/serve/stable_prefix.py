"""``kvstore serve``'s stable prefix (on by default): volatile spans move out of the prompt's head.

Agents put text that changes between days or work trees at the head of every request:
Claude Code's date and git-status snapshot, OpenCode's date line in its system prompt,
Codex's ``<current_date>``. Rendered before the tools and the whole history, a new value
there ends the cached prefix where it starts: a session resumed the next day, or a new
one on a changed tree, is prefilled from scratch. Here every span of the conversation's
*opening* leaves its place and the values it began with are appended, as one block, to
the opening's last message: the system prompt, the tools and the rest of the opening
render the same for every conversation and every day, so all of them share one cached
prefix. Today's values follow as an update just before the user turn where they were
first seen: the model still reads every current value, last.

Guarantees (``stabilize``):
- Spans are matches of ``Rule`` patterns (``BUILTIN``, ``--volatile REGEX``, and those
  learned per salt: ``learned_spans``) in the system, developer and user messages before
  the first assistant or tool message (the *opening*, ``spans.find_spans``). Nothing after
  an assistant turn or a tool result is read or changed. A request with no span renders
  byte for byte as without the option (the same list object is returned).
- Bounded: every pattern runs in RE2 (linear in the text; a pattern it cannot run, a
  backreference or lookaround, is refused when the server starts), only the first
  ``SCAN_CHARS`` characters of each text and ``SCAN_TOTAL`` of a request are searched, at
  most ``MAX_SPANS`` spans are kept, and a request with a span longer than ``MAX_VALUE``
  renders as sent: one client's huge message costs milliseconds, not every client's turn.
- Moving needs no record: a first request, a shared record and a lost one all render
  moved, with the request's own values; an opening with no user message keeps its spans
  in place (with the values the conversation began with).
- A conversation is its opening with the spans masked: its record is keyed by a digest of
  it (keyed with the request's salt: tenants never share a record), so conversations with
  another first question never share one. A conversation's first request starts its
  record; when another first request with the same opening brings other values, the
  record is marked shared and each request of either is rendered with its own values
  (only the cache is lost, never another conversation's value). A record is only ever made
  from a first request, so today's values of one conversation never become another's
  first ones.
- An update's place never moves from one turn to the next: it is recorded under a digest
  of the conversation up to and including the user turn it precedes (spans masked), and
  put back before that turn in every later request of the conversation. A new value adds
  one update before the latest user turn after the opening; with none, the request is
  rendered with its own values.
- Records are kept across restarts in the cache directory (``Memory``:
  ``stable-prefix/<digest>.json``, ``side_records.RecordDir``): at most
  ``--stable-prefix-max-count`` records and ``--stable-prefix-max-bytes`` bytes (and a
  quarter of ``--max-disk-bytes``, in which they are counted), the oldest by kvstore's own
  sequence removed first, each at most ``MAX_RECORD`` bytes; ``kvstore ls``, ``stats`` and
  ``gc --max-bytes`` see them. A record lost, unreadable or not written only costs the
  cache, never a stale value last.
- The update is a system message where the chat template renders one mid-conversation
  (``Placement``, probed once per template), else the head of that user turn's text.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence


from .. import side_records
from .learned_spans import Learner
from .spans import (MAX_SPANS, SCAN_CHARS, SCAN_TOTAL, Rule, Span, compile_rule, find_spans, first_user,
                    head_length, matches, texts_of, user_rules)
from ..escape import logger, visible

log = logger("kvstore")
DIRECTORY = "stable-prefix"
MAX_UPDATES = 64  # updates kept per record, oldest dropped (a dropped one costs a resumed session's cache only)
MAX_VALUE = 32 * 1024  # characters of one span: a request with a longer one renders as sent
MAX_RECORD = 1 << 20  # bytes of one record (its oldest updates dropped to fit)
DEFAULT_MAX_COUNT = 1000  # records kept (--stable-prefix-max-count)
DEFAULT_MAX_BYTES = 64 << 20  # bytes of records kept (--stable-prefix-max-bytes)
UPDATE_HEAD = ("The environment changed since the start of this conversation; "
               "these current values replace the ones given above:")
PERSON = b"kvstore-stable"


BUILTIN: tuple[Rule, ...] = (
    # Claude Code's environment message ("Today's date is 2026-11-28."), OpenCode's <env>
    # block ("  Today's date: Sat Nov 28 2026"): the rest of the line
    Rule("date", compile_rule(r"Today's date(?: is|:) [^\n]*")),
    # Codex CLI's <environment_context> (its first user message): <current_date>2026-11-28</current_date>
    Rule("codex-date", compile_rule(r"<current_date>[^<\n]*</current_date>")),
    # Claude Code's git-status snapshot, from its header through the last line of the commit
    # list: 2.1.332 sends "# gitStatus\n..." in a reminder of the session's first user turn,
    # 2.1.197 "gitStatus: ..." (fields between blank lines) at the end of its system text
    Rule("git-status", compile_rule(r"(?:# gitStatus\n|gitStatus: )This is the git status at the start of the "
                                    r"conversation\.[^\n]*\n(?:[^\n]*\n)*?Recent commits:\n(?:[^\n]+\n?)*")),
)


def _with_values(message: dict[str, Any], spans: list[Span], values: Sequence[str],
                 mark: Callable[[Span], str] | None = None) -> dict[str, Any]:
    """``message`` with each of its ``spans`` replaced by its value (``mark(span)`` instead
    when given), content copied, the rest shared."""
    by_part: dict[int | None, list[tuple[Span, str]]] = {}
    for s, v in zip(spans, [mark(s) for s in spans] if mark else values):
        by_part.setdefault(s.part, []).append((s, v))
    out = dict(message)
    content = out["content"]
    if isinstance(content, list):
        content = list(content)
    for part, items in by_part.items():
        text = content if part is None else content[part]["text"]
        for s, v in sorted(items, key=lambda sv: -sv[0].start):
            text = text[:s.start] + v + text[s.end:]
        if part is None:
            content = text
        else:
            content[part] = {**content[part], "text": text}
    out["content"] = content
    return out


def _canonical(message: Any) -> bytes:
    return json.dumps(message, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")


def _spans_of(spans: list[Span], i: int) -> list[Span]:
    return [s for s in spans if s.message == i]


def masked(messages: Sequence[Any], spans: list[Span]) -> list[Any]:
    """``messages`` with every span replaced by a mark naming its rule: what a session's
    record and its updates are keyed by (the same whatever the values)."""
    held = {s.message for s in spans}
    return [_with_values(m, _spans_of(spans, i), [], lambda s: f"\x00{s.rule}\x00") if i in held else m
            for i, m in enumerate(messages)]


def _digest(salt_key: bytes | None) -> Any:
    return hashlib.blake2b(digest_size=16, key=salt_key or b"", person=PERSON)


def session_key(head: Sequence[Any], salt_key: bytes | None) -> str:
    """The record's name: a digest of the conversation's opening (its masked ``head``: every
    message before the first assistant or tool message, which every request of the
    conversation repeats), keyed with the request's salt (``salt.salt_key``; None:
    unsalted). Two conversations share a record only when their openings are the same but
    for the spans' values."""
    h = _digest(salt_key)
    for m in head:
        h.update(_canonical(m))
    return str(h.hexdigest())


def anchors(plain: Sequence[Any], key: str, salt_key: bytes | None) -> dict[int, str]:
    """For each user message of ``plain`` (masked): a digest of the conversation up to and
    including it (what an update before it is recorded under)."""
    h = _digest(salt_key)
    h.update(key.encode())
    out = {}
    for i, m in enumerate(plain):
        h.update(_canonical(m))
        if isinstance(m, dict) and m.get("role") == "user":
            out[i] = str(h.copy().hexdigest())
    return out


# -- what a session began with, kept in the cache directory ---------------------------------


class Memory:
    """Records ``{"began": [values] | None, "updates": {anchor: [values]}}`` by session key,
    in ``root/stable-prefix/<key>.json`` (``root`` None: in this process only), through
    ``side_records.RecordDir``: made with the cache directory's ``modes`` (never through a
    symlink, replaced whole), at most ``max_count`` records and ``max_bytes`` bytes (the
    oldest by kvstore's own sequence go first), each at most ``MAX_RECORD`` bytes, counted
    in the disk budget. ``began`` None: two conversations began with this opening and other
    values, so neither is given one. One that cannot be read is no record. ``write``
    False: records are read, never written (``kvstore why``)."""

    def __init__(self, root: Path | None, modes: Any = None, *, write: bool = True, learn: bool = True,
                 max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        from .. import files

        self.dir = root / DIRECTORY if root is not None else None
        self.records = side_records.RecordDir(self.dir, modes or files.PRIVATE, max_count=max_count,
                                              max_bytes=max_bytes, max_record=MAX_RECORD)
        self.write = write
        self.lock = threading.Lock()  # held over a request's read, rewrite and write
        self._warned = False
        self.learner = (Learner(self.records, write, self._warn) if learn else None)  # spans learned per salt

    def load(self, key: str) -> dict[str, Any] | None:
        rec = self.records.read(f"{key}.json")
        ok = (isinstance(rec, dict) and "began" in rec and (rec["began"] is None or _values(rec["began"]))
              and isinstance(rec.get("updates"), dict)
              and all(_values(v) for v in rec["updates"].values()))
        return {"began": rec["began"], "updates": dict(rec["updates"])} if ok and rec is not None else None

    def save(self, key: str, rec: dict[str, Any]) -> None:
        if not self.write:
            return
        rec = {"began": rec["began"], "updates": dict(rec["updates"])}
        while True:
            try:
                self.records.write(f"{key}.json", rec)
                return
            except ValueError as e:  # over MAX_RECORD: the oldest updates go first, then nothing is kept
                if not rec["updates"]:
                    self._warn(f"a record of {e}")
                    return
                rec["updates"] = dict(list(rec["updates"].items())[len(rec["updates"]) // 2 + 1:])
            except Exception as e:  # an OSError, or BlobError: a symlink or a file where the directory goes
                self._warn(f"{self.dir}: {e}")
                return

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvstore: --stable-prefix cannot keep what a session began with (%s): a resumed "
                        "session whose volatile lines changed is prefilled again", why)


def _values(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# -- the rewrite -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Moved:
    """What ``stabilize`` did to a request: the spans (rule, value kept in place, value now
    in force) whose place kept the session's first value, and where the updates went
    (message indexes of the rewritten list; ``inline``: inside that user turn)."""

    spans: tuple[tuple[str, str, str], ...]
    updates: tuple[int, ...]
    inline: bool
    recorded: bool = field(default=False, compare=False)  # this request added an update
    home: int | None = None  # the message the spans moved to, at its end: the opening's last (None: kept in place)

    def describe(self, width: int = 48) -> str:
        """One line: the spans' rules and where they went, each changed span's kept and
        current value (escaped, cut to ``width``) and where the update is."""
        def cut(s: str) -> str:
            s = visible(s, newlines=False)
            return s if len(s) <= width else s[:width - 3] + "..."

        names = ", ".join(dict.fromkeys(rule for rule, _, _ in self.spans))
        place = f"moved to the end of message {self.home}" if self.home is not None else "kept in place"
        changed = [f'{rule} "{cut(kept)}" kept, "{cut(now)}" in the update'
                   for rule, kept, now in (_first_change(*span) for span in self.spans) if kept != now]
        changed = changed or ["values as the session began"]
        where = (f"{'inside' if self.inline else 'before'} message{'s' if len(self.updates) > 1 else ''} "
                 f"{', '.join(map(str, self.updates))}") if self.updates else "no update"
        return f"--stable-prefix: {names} {place}; {'; '.join(changed)} ({where})"

    def as_json(self) -> dict[str, Any]:
        return {"spans": [{"rule": r, "kept": k, "now": n} for r, k, n in self.spans],
                "moved_to": self.home, "updates_at": list(self.updates), "inline": self.inline}


def _first_change(rule: str, kept: str, now: str) -> tuple[str, str, str]:
    """(rule, kept, now) from the first line in which a multi-line value changed."""
    a, b = kept.splitlines(), now.splitlines()
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return (rule, x, y) if k else (rule, kept, now)
    k = min(len(a), len(b))
    return (rule, "\n".join(a[k:k + 1]), "\n".join(b[k:k + 1])) if k else (rule, kept, now)


def update_text(spans: list[Span], before: Sequence[str], now: Sequence[str]) -> str:
    """The update saying ``now``'s values of the spans that differ from ``before``."""
    lines = [n for s, b, n in zip(spans, before, now) if b != n]
    return UPDATE_HEAD + "\n\n" + "\n\n".join(x.rstrip("\n") for x in lines)


def _insert(message: dict[str, Any], text: str, inline: bool) -> list[dict[str, Any]]:
    if not inline:
        return [{"role": "system", "content": text}, message]
    content = message.get("content")
    if isinstance(content, list):
        return [{**message, "content": [{"type": "text", "text": text}, *content]}]
    return [{**message, "content": f"{text}\n\n{content or ''}"}]


def _tools_text(tools: Any) -> str:
    try:
        return json.dumps(tools, sort_keys=True, ensure_ascii=False, default=str) if tools else ""
    except (RecursionError, ValueError, TypeError):
        return ""


def block_text(values: Sequence[str]) -> str:
    """The moved spans' values as one block: each without trailing newlines, a blank line
    between them."""
    return "\n\n".join(v.strip("\n") for v in values)


def _append(message: dict[str, Any], text: str) -> dict[str, Any]:
    """``message`` with ``text`` after its content, a blank line between (a text part of
    its own in a list content: mlx-lm joins parts without a separator, so it starts with
    one)."""
    content = message.get("content")
    if isinstance(content, list):
        return {**message, "content": [*content, {"type": "text", "text": "\n\n" + text}]}
    return {**message, "content": f"{content}\n\n{text}" if content else text}


def stabilize(messages: list[Any], rules: Sequence[Rule], memory: Memory, *, salt_key: bytes | None = None,
              inline: bool = False, tools: Any = None) -> tuple[list[Any], Moved | None]:
    """``messages`` (a chat-completions list) as ``--stable-prefix`` renders them, and what
    moved (None: ``messages`` itself, unchanged). ``tools``: the request's (what follows
    the leading texts, for learning). See the module docstring."""
    if memory.learner is not None:
        rules = (*rules, *memory.learner.observe(messages, _tools_text(tools), rules, salt_key))
    spans = find_spans(messages, rules)
    if not spans or any(len(s.text) > MAX_VALUE for s in spans):
        return messages, None  # nothing to keep, or a value too long to record: as sent
    n = head_length(messages)
    try:
        plain = masked(messages, spans)
        key = session_key(plain[:n], salt_key)
        at = anchors(plain, key, salt_key)
    except (RecursionError, ValueError, TypeError):  # content json cannot write (too deep): as sent
        return messages, None
    values = [s.text for s in spans]
    users = [i for i in at if i >= n]  # the user turns after the opening: where updates go
    began, inserts, recorded = values, [], False
    with memory.lock:
        rec = memory.load(key)
        if n == len(messages):  # a conversation's first request: its own values
            if rec is None:
                memory.save(key, {"began": values, "updates": {}})
            elif rec["began"] is not None and rec["began"] != values:
                memory.save(key, {"began": None, "updates": {}})  # two conversations: neither is given one
        elif rec is not None and rec["began"] is not None and len(rec["began"]) == len(spans):
            began = rec["began"]
            inserts = [(i, list(rec["updates"][at[i]])) for i in users if at[i] in rec["updates"]
                       and len(rec["updates"][at[i]]) == len(spans)]
            current = inserts[-1][1] if inserts else began
            if current != values and not users:
                began, inserts = values, []  # no user turn after the opening to carry today's values
            elif current != values:
                if inserts and inserts[-1][0] == users[-1]:
                    inserts[-1] = (users[-1], values)
                else:
                    inserts.append((users[-1], values))
                rec["updates"][at[users[-1]]] = values
                rec["updates"] = dict(list(rec["updates"].items())[-MAX_UPDATES:])
                memory.save(key, rec)
                recorded = True
        # else: no first values known (not seen, lost or shared): this request's own, moved;
        # today's values are never recorded as another conversation's first ones
    home = n - 1 if first_user(messages, n) is not None else None  # the opening's end, after everything stable
    out: list[Any] = []
    shown, before, where = dict(inserts), began, []
    for i, m in enumerate(messages):
        mine = _spans_of(spans, i)
        if mine:
            kept = [began[spans.index(s)] for s in mine]
            m = _with_values(m, mine, [""] * len(mine) if home is not None else kept)
        if i == home:
            m = _append(m, block_text(began))
        if i in shown and shown[i] != before:
            where.append(len(out))
            out.extend(_insert(m, update_text(spans, before, shown[i]), inline))
            before = shown[i]
        else:
            out.append(m)
    return out, Moved(tuple((s.rule, b, n) for s, b, n in zip(spans, began, before)), tuple(where), inline,
                      recorded, home)


# -- kvstore serve: the switch, the template probe, the hook ----------------------------------


@dataclass(frozen=True)
class Config:
    """``kvstore serve``'s choice (on by default, as for ``server.patch``'s default config;
    ``--no-stable-prefix`` off): the built-in rules, each
    ``--volatile REGEX`` adds one, spans learned per salt unless ``--no-learned-spans``
    (``learned_spans``); the records' bounds (``--stable-prefix-max-count`` / ``-max-bytes``)."""

    enabled: bool = True
    rules: tuple[Rule, ...] = BUILTIN
    max_count: int = DEFAULT_MAX_COUNT
    max_bytes: int = DEFAULT_MAX_BYTES
    learn: bool = True

    @classmethod
    def from_flags(cls, enabled: bool, patterns: Sequence[str] = (), *, max_count: int = DEFAULT_MAX_COUNT,
                   max_bytes: int = DEFAULT_MAX_BYTES, rules: tuple[Rule, ...] | None = None,
                   learn: bool = True) -> "Config":
        """The config of the flags; ValueError naming a bad ``--volatile`` pattern. ``rules``:
        the rules of these flags, already made by this function (not compiled again)."""
        if rules is None:
            rules = BUILTIN + user_rules(patterns)
        return cls(enabled, rules, max_count, max_bytes, learn)

    def said(self) -> str:
        """What the ready line says of it."""
        if not self.enabled:
            return "stable prefix off"
        rules = ", ".join(r.name for r in self.rules)
        return f"stable prefix on ({rules}{'; learned spans' if self.learn else ''})"


PROBE_MARK = "kvstore-probe-7f3a"
_INLINE: dict[str, bool] = {}


def inline_for(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s chat template needs the update inside the user turn: it
    refuses a system message after the first turn, or renders it without its text (probed
    once per template on a five-message conversation)."""
    template = str(getattr(tokenizer, "chat_template", None))
    if template not in _INLINE:
        probe = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                 {"role": "assistant", "content": "c"}, {"role": "system", "content": PROBE_MARK},
                 {"role": "user", "content": "d"}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
            _INLINE[template] = not (isinstance(text, str) and PROBE_MARK in text)
        except Exception:  # the template's own refusal (raise_exception)
            _INLINE[template] = True
    return _INLINE[template]


def memory_of(prompt_cache: Any, config: Config) -> Memory:
    """The ``Memory`` of a server's prompt cache: in its store's cache directory when it
    has a disk tier (else this process only), bounded by ``config`` and by a share of the
    store's disk budget (``side_records.bound``). Made once per server (by its generator)."""
    store = getattr(prompt_cache, "store", None)
    disk = getattr(store, "disk", None)
    budget = getattr(store, "max_disk_bytes", None)
    return Memory(store.cache_dir if store is not None and disk is not None else None, getattr(disk, "modes", None),
                  learn=config.learn, max_count=config.max_count,
                  max_bytes=side_records.bound(config.max_bytes, budget if isinstance(budget, int) else None))


def rewrite(request: Any, tokenizer: Any, config: Config, memory: Callable[[], Memory],
            salt: Any) -> tuple[Any, Moved | None]:
    """``request`` (mlx_lm.server's CompletionRequest) as ``--stable-prefix`` renders it
    (a copy with its messages stabilized; the same object when nothing moved or the
    option is off) and what moved. ``salt``: the request's (records are kept per salt)."""
    if not (config.enabled and getattr(request, "request_type", None) == "chat" and request.messages):
        return request, None
    from ..salt import salt_key

    messages, moved = stabilize(request.messages, config.rules, memory(),
                                salt_key=salt_key(salt) if salt is not None else None, inline=inline_for(tokenizer),
                                tools=getattr(request, "tools", None))
    if moved is None:
        return request, None
    request = copy.copy(request)
    request.messages = messages
    if moved.recorded:
        log.info("kvstore: %s", moved.describe())
    return request, moved


@dataclass
class Render:
    """``--stable-prefix`` for ``prompts.request_tokens`` (``kvstore why``): the rules, the
    records read (``Memory(write=False)``) and the salt; ``moved`` is filled in."""

    rules: tuple[Rule, ...]
    memory: Memory
    salt_key: bytes | None = None
    moved: Moved | None = None
