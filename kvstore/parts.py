"""Which part of a request a miss's first differing token belongs to, in the request's terms.

The vocabulary hosted APIs use for their cache diagnostics: ``system`` (and the character
in it), ``tools`` (the tool, or "order changed"), ``messages[i]`` (its role, its content
block, the character in it), ``model`` (the identity component that changed), the previous
turn not in the store, and the chat template's own text (the generation prompt).

How (the cost): nothing per request. A request's chat ``messages`` and ``tools`` are kept
as the route rendered them (``serve.rendered``), and only a lookup that made a miss asks
``locate``: it decodes the prompt's tokens up to the divergence once (their text's length
is the character offset in the rendered prompt) and renders the chat template, text only,
over prefixes of the message list (a binary search: about log2(messages) + 2 renders), so a
message's span is where the rendering of the messages before it ends. No tokenization: the
request's tokens are the ones the server already has; a miss costs a prefill of at least
what it recomputed, beside which a few template renders are small. MLX-free: the render and
the decode are the caller's (the model's tokenizer), and any route (chat completions,
Messages, Responses) that renders chat messages calls ``locate`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .misses import CUT_REFUSED, DIVERGED, OTHER_IDENTITY, PARTS, Miss

SYSTEM, TOOLS, MESSAGES, MODEL, PREVIOUS_TURN, TEMPLATE, UNKNOWN = PARTS  # the Prometheus ``part`` label

# render(messages, tools) -> the chat template's text for them, no generation prompt
Render = Callable[[list[Any], "list[Any] | None"], str]


@dataclass(frozen=True)
class Part:
    """Where in a request a miss starts. ``kind``: one of ``KINDS``; ``index``: of the tool
    or message; ``role`` and ``block`` of a message; ``char``: the character offset in the
    system text, or in the message's content (block); ``name``: the tool's (prompt text:
    for the log line and ``kvstore why``, never over HTTP); ``note``: "order changed",
    "its header", the identity components..."""

    kind: str
    index: int | None = None
    role: str = ""
    block: int | None = None
    char: int | None = None
    name: str = ""
    note: str = ""

    def said(self, names: bool = True) -> str:
        """One phrase: ``system, char 1,234``, ``tools[3] "Read" (order changed)``,
        ``messages[2] (user), block 1, char 10``... ``names=False`` leaves tool names out."""
        if self.kind == SYSTEM:
            text = "system" + (f", block {self.block}" if self.block is not None else "")
        elif self.kind == TOOLS:
            text = "tools" + (f"[{self.index}]" if self.index is not None else "")
            text += f' "{self.name}"' if names and self.name else ""
        elif self.kind == MESSAGES:
            text = f"messages[{self.index}]" + (f" ({self.role})" if self.role else "")
            text += f", block {self.block}" if self.block is not None else ""
        elif self.kind == MODEL:
            text = "model identity"
        elif self.kind == PREVIOUS_TURN:
            text = "previous turn not in the store"
        elif self.kind == TEMPLATE:
            text = "the chat template's generation prompt"
        else:
            text = "unknown"
        text += f", char {self.char:,}" if self.char is not None else ""
        return text + (f" ({self.note})" if self.note else "")

    def as_stats(self) -> dict[str, object]:
        """What ``recent_misses`` shows: kind, positions, no text."""
        return {"part": self.kind, "where": self.said(names=False)}


def tool_name(tool: Any) -> str:
    """A tool definition's name: OpenAI's ``function.name``, else a top-level ``name``."""
    if isinstance(tool, dict):
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
        if isinstance(name, str):
            return name
    return ""


def of_reason(miss: Miss) -> Part | None:
    """The part a miss names by its reason alone (no position to locate), else None."""
    if miss.reason == OTHER_IDENTITY:
        return Part(MODEL, note=miss.detail or "unknown")
    if miss.reason not in (DIVERGED, CUT_REFUSED):  # the stored prefix is gone (evicted, skipped)
        return Part(PREVIOUS_TURN, note=miss.reason)
    return None


def locate(miss: Miss, prompt: Sequence[int], messages: list[Any], tools: list[Any] | None,
           render: Render, decode: Callable[[list[int]], str], blocks: dict[int, list[int]] | None = None) -> Part:
    """The part of the request (its chat ``messages`` and ``tools``, as rendered into
    ``prompt``) that ``miss`` names: by its reason, or where token ``miss.at`` falls.
    ``blocks``: the text length of each content block of the messages whose blocks were
    joined into one string before rendering (mlx_lm.server joins them with nothing).
    ``UNKNOWN`` when the template renders no usable prefixes. Never raises for a template's
    quirks (a render that fails is ``UNKNOWN``)."""
    known = of_reason(miss)
    if known is not None:
        return known
    try:
        part = _at(len(decode(list(prompt[: miss.at]))), messages, tools, render, _held(miss, decode))
        return _in_block(part, (blocks or {}).get(part.index or 0))
    except Exception:  # the template's or the tokenizer's own complaint: the part is unknown, the miss stays
        return Part(UNKNOWN)


def _in_block(part: Part, lengths: list[int] | None) -> Part:
    """``part`` with the content block its character falls in, from the blocks' lengths."""
    if not lengths or part.char is None or part.block is not None or part.kind not in (SYSTEM, MESSAGES):
        return part
    k, char = 0, part.char
    while k < len(lengths) - 1 and char >= lengths[k]:
        char -= lengths[k]
        k += 1
    return replace(part, block=k, char=char)


def _held(miss: Miss, decode: Callable[[list[int]], str]) -> str:
    return decode(list(miss.after)) if miss.after else ""


def _at(c: int, messages: list[Any], tools: list[Any] | None, render: Render, held: str) -> Part:
    """The part holding character ``c`` of the rendered request."""
    m = len(messages)
    ends = {0: ""}

    def upto(i: int) -> str:  # the rendering of messages[:i]
        if i not in ends:
            ends[i] = render(messages[:i], tools) if i else ""
        return ends[i]

    lo, hi = 1, m  # the first i whose rendering reaches past c: c is in messages[i - 1]
    if len(upto(m)) <= c:
        return Part(TEMPLATE)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(upto(mid)) > c:
            hi = mid
        else:
            lo = mid + 1
    i = lo - 1
    start, text = len(upto(i)), upto(i + 1)
    if not text.startswith(upto(i)):
        return Part(UNKNOWN)
    if tools:
        bare = render(messages[: i + 1], None)
        p = _common(text, bare)
        if p <= c < p + len(text) - len(bare):
            return _tool(c, text, p, tools, held)
        if c >= p + len(text) - len(bare):  # after the tools: positions in the rendering without them
            c -= len(text) - len(bare)
            text, start = bare, min(start, p)
    return _message(c, i, messages[i], text, start)


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def _tool(c: int, text: str, start: int, tools: list[Any], held: str) -> Part:
    """tools[j]: the one whose rendering holds character ``c``; "order changed" when what
    the store holds there names another of this request's tools."""
    names = [tool_name(t) for t in tools]
    at, pos = start, []
    for n in names:
        k = text.find(f'"{n}"', at) if n else -1
        pos.append(k)
        at = k + 1 if k >= 0 else at
    # a tool's rendering before its name is the same for every tool: a change there is rare,
    # a reorder or a rename parts inside the name, a changed description or schema after it
    j: int | None = max((k for k, p in enumerate(pos) if 0 <= p <= c), default=0) if pos and pos[0] >= 0 else None
    here = names[j] if j is not None else ""
    moved = j is not None and here in _stored_name(c, pos[j], here, held, names)
    return Part(TOOLS, j, name=here, note="order changed" if moved else "")


def _stored_name(c: int, quote: int, here: str, held: str, names: list[str]) -> set[str]:
    """The request's other tools the store holds where this one's name is, when the
    request parts from it inside the name (``quote``: where the quoted name starts): a tool
    of this request that the stored prompt listed here instead. Empty otherwise."""
    if not quote - 1 <= c <= quote + 1 + len(here):
        return set()
    prefix = here[: max(0, c - quote - 1)]
    stored = prefix + held.lstrip(' "').split('"')[0]
    return {here} if stored != here and stored in names else set()


def _message(c: int, i: int, message: Any, text: str, start: int) -> Part:
    """messages[i] (``system`` for a leading system message), the content block and the
    character of it at ``c``; "its header" before its content (the role header)."""
    role = message.get("role", "") if isinstance(message, dict) else ""
    content = message.get("content") if isinstance(message, dict) else None
    blocks = [content] if isinstance(content, str) else [
        b.get("text") if isinstance(b, dict) else None for b in content] if isinstance(content, list) else []
    at, found = start, None
    for k, block in enumerate(blocks):
        if not isinstance(block, str) or not block:
            continue
        p = text.find(block, at)
        if p < 0:
            continue
        if p <= c < p + len(block):
            found = (k if isinstance(content, list) else None, c - p)
            break
        at = p + len(block)
    kind = SYSTEM if role in ("system", "developer") and i == 0 else MESSAGES
    if found is None:
        first = next((text.find(b, start) for b in blocks if isinstance(b, str) and b), -1)
        note = "its header" if first < 0 or c < first else "between its blocks"
        return Part(kind, None if kind == SYSTEM else i, "" if kind == SYSTEM else role, note=note)
    return Part(kind, None if kind == SYSTEM else i, "" if kind == SYSTEM else role, found[0], found[1])
