"""Why a lookup served less than the store held: a small fixed set of reasons.

A ``Miss`` is made on the request path from what the lookup already computed (the memory
trie's search, the disk plan's walk, the write and eviction records of this process): no
extra pass over the disk, no change to what is served. It names the one reason the prompt
was not served further, where it parted from the nearest stored prefix, and how many tokens
that cost. Token ids only: nothing here holds prompt text (an adapter with a tokenizer may
decode the ids around ``at`` for its log; the HTTP endpoints never carry them).

MLX-free: ``kvstore why`` and the stats readers import it without loading a model.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .counters import Durations
from .floors import MIN_DISK_GAIN
from .keys import TOKEN_BYTES, common_tokens, decode_tokens
from .escape import visible

# The reasons, most specific first (``Miss.reason`` is one of them):
DIVERGED = "diverged"                # the prompt parts from the nearest stored prefix at token ``at``
CUT_REFUSED = "cut_refused"          # an entry reaching further exists, but its cache cannot be cut there
EVICTED_UNWRITTEN = "evicted_unwritten"  # it left memory and was never written (``detail``: why not)
EVICTED_DISK = "evicted_disk"        # it was on disk and was evicted (``detail``: budget / gc)
OTHER_IDENTITY = "other_identity"    # another identity of the same model holds it (``detail``: what changed)
SHARED_SKIPPED = "shared_skipped"    # the shared tier skipped or failed it (``detail``: cost / deadline / breaker / error)
REASONS = (DIVERGED, CUT_REFUSED, EVICTED_UNWRITTEN, EVICTED_DISK, OTHER_IDENTITY, SHARED_SKIPPED)
# the part of the request a miss starts in (``parts.Part.kind``; the Prometheus ``part`` label)
PARTS = ("system", "tools", "messages", "model", "previous_turn", "template", "unknown")
SAID = {  # each reason said plainly, for a person reading a log line or `kvstore why`
    DIVERGED: "the prompt parts from the nearest stored prefix",
    CUT_REFUSED: "a stored entry reaches further, but its cache cannot be cut where the prompt parts from it",
    EVICTED_UNWRITTEN: "the prefix left memory and was never written to disk",
    EVICTED_DISK: "the prefix was evicted from disk",
    OTHER_IDENTITY: "another identity of this model holds the prefix",
    SHARED_SKIPPED: "the shared tier skipped or failed the lookup",
}


def rank(common: int, stored: int, n_q: int) -> tuple[int, int, int]:
    """The order of stored prefixes by nearness to a query of ``n_q`` tokens, nearest
    greatest: the one sharing most tokens with it; of those, the one holding most of the
    query's length (what a miss there cost: ``held_past``); then the shorter. The one rule
    the lookup's searches (``Near.saw``) and ``kvstore why`` pick "the nearest" by."""
    return common, min(stored, n_q), -stored


def held_past(stored: int, prompt: int, served: int) -> int:
    """Tokens of a ``prompt``-token request a ``stored``-token prefix held that the lookup
    did not serve (``served``): what a miss cost, in the log, the stats and ``kvstore why``."""
    return max(0, min(stored, prompt) - served)


@dataclass(frozen=True)
class Miss:
    """One lookup that served ``served`` of ``prompt`` tokens while a stored prefix
    (``stored`` tokens long, in ``tier``) shared ``at`` tokens with the prompt or reached
    further. ``after``: up to 32 stored token ids from ``at`` on (what the store holds where
    the prompt parts from it; empty when unknown), for a log line; never sent over HTTP."""

    reason: str
    prompt: int
    served: int
    at: int
    stored: int
    tier: str | None = None
    detail: str = ""
    after: tuple[int, ...] = field(default=(), compare=False)
    part: Any = field(default=None, compare=False)  # where in the request: a ``parts.Part`` (``parts.locate``)

    @property
    def lost(self) -> int:
        """Tokens recomputed that the stored prefix held: what the miss cost (``held_past``)."""
        return held_past(self.stored, self.prompt, self.served)

    def as_stats(self) -> dict[str, object]:
        """Reason, positions and counts only (no token ids): what ``stats()`` may show."""
        out: dict[str, object] = {
            "reason": self.reason, "detail": self.detail, "tier": self.tier, "prompt_tokens": self.prompt,
            "served_tokens": self.served, "diverged_at": self.at, "stored_tokens": self.stored, "lost_tokens": self.lost}
        if self.part is not None:
            out.update(self.part.as_stats())
        return out


# -- what a process keeps of its misses: counts, a histogram, the last few --------------------

LOG_THRESHOLD = 256  # tokens a miss must cost (``Miss.lost``) to get a log line
RECENT = 32          # misses ``stats()`` shows
# tokens recomputed span a few hundred (a changed date near the end of a system prompt) to
# the whole context (a per-request header in the first block)
LOST_BUCKETS: tuple[float, ...] = (64, 256, 1024, 4096, 16384, 65536, 262144)
STATS_PREFIX = "miss_"  # flat stats keys: ``miss_<reason>`` counts, ``miss_lost_tokens``...


class Misses:
    """A process's record of its misses (``record``), safe to use from any thread: a count
    per reason, the tokens they cost (a sum and a histogram), and the last ``recent`` of
    those worth a log line as ``Miss.as_stats`` (no token ids). ``threshold``: the fewest
    lost tokens a miss must cost for ``worth_logging`` (what an adapter with a tokenizer
    logs: ``log_line``; smaller misses are counted, not listed)."""

    def __init__(self, threshold: int = LOG_THRESHOLD, recent: int = RECENT) -> None:
        self.threshold = threshold
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(REASONS, 0)
        self._parts = dict.fromkeys(PARTS, 0)
        self._lost = 0
        self._hist = Durations(LOST_BUCKETS)  # a cumulative histogram; here of tokens, not seconds
        self._recent: deque[dict[str, object]] = deque(maxlen=recent)
        self._unnamed: list[tuple[Miss, Callable[[Miss], Any]]] = []  # recorded, part to name
        self._naming = threading.Lock()  # one naming at a time: a read waits for the one under way

    def record(self, miss: Miss, *, listed: bool = True, name: Callable[[Miss], Any] | None = None) -> bool:
        """Count ``miss``; True when it is worth a log line (``worth_logging``).
        ``listed=False`` (a tenant's salted lookup): counted, never in ``recent_misses``,
        which every key holder may read: its positions would tell one tenant the size and
        shape of another's prompts. ``name``: names the part of an unnamed miss later
        (``name_pending``: at the next read of the counts, or when the caller asks), where
        its part is counted."""
        worth = self.worth_logging(miss)
        with self._lock:
            self._counts[miss.reason] = self._counts.get(miss.reason, 0) + 1
            if miss.part is not None:
                self._parts[miss.part.kind] = self._parts.get(miss.part.kind, 0) + 1
            elif name is not None:
                self._unnamed.append((miss, name))
            self._lost += miss.lost
            if worth and listed:
                self._recent.append({"time": round(time.time(), 3), **miss.as_stats()})
        self._hist.observe(miss.lost)
        return worth

    @property
    def unnamed(self) -> int:
        """Misses recorded with a ``name`` and not named yet."""
        return len(self._unnamed)

    def name_pending(self) -> None:
        """Name and count the parts of the misses ``record`` took with a ``name`` (any
        thread; ``stats`` runs it first, so a read of the counts holds every recorded miss's
        part). A name that fails leaves its miss counted without a part."""
        with self._naming:
            with self._lock:
                pending, self._unnamed = self._unnamed, []
            for miss, name in pending:
                try:
                    part = name(miss)
                except Exception:  # naming is a diagnosis: the miss stays counted
                    continue
                if part is not None:
                    with self._lock:
                        self._parts[part.kind] = self._parts.get(part.kind, 0) + 1

    def worth_logging(self, miss: Miss) -> bool:
        return miss.lost >= self.threshold

    def stats(self) -> dict[str, object]:
        """Flat keys for ``KVStore.stats()``: ``miss_<reason>`` for every reason (0 when
        none), ``miss_part_<part>`` for every ``PARTS`` (the misses a route named the part of:
        ``parts``), ``miss_lost_tokens`` (their sum), ``miss_lost_tokens_histogram``
        (``counters.Durations.snapshot``'s shape, ``le`` in tokens), ``miss_log_threshold``
        and ``recent_misses`` (those worth a log line, oldest first)."""
        self.name_pending()
        with self._lock:
            out: dict[str, object] = {f"{STATS_PREFIX}{r}": n for r, n in self._counts.items()}
            out.update({f"{STATS_PREFIX}part_{p}": n for p, n in self._parts.items()})
            out[f"{STATS_PREFIX}lost_tokens"] = self._lost
            recent = list(self._recent)
        out[f"{STATS_PREFIX}lost_tokens_histogram"] = self._hist.snapshot()
        out[f"{STATS_PREFIX}log_threshold"] = self.threshold
        out["recent_misses"] = recent
        return out


# -- the log line: the text either side of where the prompt parted from the store -------------

BELOW = 32  # chunks as near as each other a lookup keeps to name the entry below (``Near.below``)
AROUND = 8  # tokens shown either side of the divergence
AFTER = 32  # stored token ids a search reports past a divergence (``Near.after``: ``parts`` reads a tool's name in it)


def around(tokens: Sequence[int], at: int, decode: Callable[[list[int]], str],
           n: int = AROUND) -> tuple[str, str]:
    """(text of the ``n`` tokens before ``at``, text of the ``n`` from ``at``) of ``tokens``,
    escaped (``visible``, newlines too: one line)."""
    before, after = list(tokens[max(0, at - n):at]), list(tokens[at:at + n])
    return (visible(decode(before), newlines=False) if before else "",
            visible(decode(after), newlines=False) if after else "")


def log_line(miss: Miss, prompt: Sequence[int], decode: Callable[[list[int]], str] | None) -> str:
    """One line saying why ``prompt`` was served only ``miss.served`` tokens: the reason,
    the positions and counts and, where the prompt parts from a stored prefix (``DIVERGED``,
    ``CUT_REFUSED``) and ``decode`` (the model's tokenizer) is given, the text either side
    of ``miss.at`` in the prompt and what the store holds there (``miss.after``). Every
    decoded piece is escaped: the line is one line and carries no control characters."""
    part = f" in {visible(miss.part.said(), newlines=False)}" if miss.part is not None else ""
    head = (f"kvstore: miss ({miss.reason}{f': {visible(miss.detail, newlines=False)}' if miss.detail else ''}){part}: "
            f"recomputed {miss.lost:,} tokens a stored prefix held; served {miss.served:,} of {miss.prompt:,}")
    if miss.reason not in (DIVERGED, CUT_REFUSED):
        return f"{head}; {SAID.get(miss.reason, miss.reason)} ({miss.at:,} tokens of this prompt)"
    head += (f", the prompt parts from the stored {miss.stored:,}-token prefix"
             f"{f' ({miss.tier})' if miss.tier else ''} at token {miss.at:,}")
    if decode is None:
        return head
    try:
        before, now = around(prompt, miss.at, decode)
        held = visible(decode(list(miss.after[:AROUND])), newlines=False) if miss.after else ""
    except Exception as e:  # the decode is the adapter's; a bad id costs the text, not the line
        return f"{head} (text not decoded: {type(e).__name__})"
    text = f'{head}: "{before}" then the prompt has "{now}"'
    return text + (f', the store "{held}"' if miss.after else "")


SALTED = "salted"  # the component named when a salt (a request's cache_salt, a key) tells two identities apart


def differing(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The identity components that differ between two identities' ``info``, sorted;
    ``SALTED`` when either is a salted one (``salt.salted``: the salt is never stored,
    so two salted identities of one model differ by it)."""
    a, b = old.get("components") or {}, new.get("components") or {}
    salt = [SALTED] if old.get("salted") or new.get("salted") else []
    return sorted([k for k in set(a) | set(b) if a.get(k) != b.get(k)] + salt)


def changed_components(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Which identity components differ between two identities' ``info`` (e.g.
    "chat_template, kv_bits"), for ``OTHER_IDENTITY``'s detail."""
    return ", ".join(differing(old, new)) or "unknown"


class Near:
    """What a lookup's searches saw of the stored prefixes nearest its query (each tier's
    search reports as it goes, no extra pass): the one sharing most tokens with the query,
    and the furthest point a stored prefix could not be cut at."""

    def __init__(self, n_q: int) -> None:
        self.n_q = n_q
        self.common = 0      # tokens the nearest stored prefix shares with the query
        self.stored = 0      # its length; ``bounded``: at least that (the end of a chunk others go on from)
        self.bounded = False
        self.below: tuple[bytes, ...] = ()  # the keys of such chunks as near: the entries going on are filed under them
        self.tier: str | None = None
        self.after: bytes | tuple[int, ...] = ()
        self.cut_at = 0      # the furthest a refused cut would have served
        self.shared: tuple[str, int] | None = None  # why the shared tier skipped a candidate, its length

    def saw(self, tier: str, common: int, stored: int, after: bytes | Sequence[int] = (), *,
            below: bytes | None = None) -> None:
        """A stored prefix ``stored`` tokens long sharing ``common`` with the query, kept
        when it is nearer than the one kept (``rank``). ``below``: it is a chunk others go
        on from (``stored``: the tokens up to its end, a lower bound), filed under that key;
        chunks as near as the one kept are kept too (up to ``BELOW``: conversations parting
        from each other inside the chunk the query parts in), and ``resolved`` names the
        nearest entry under them once a miss needs its length."""
        new, old = rank(common, stored, self.n_q), rank(self.common, self.stored, self.n_q)
        if new > old:
            self.common, self.stored, self.tier, self.bounded = common, stored, tier, below is not None
            self.below = (below,) if below is not None else ()
            self.after = after if isinstance(after, bytes) else tuple(after[:AFTER])
        elif new == old and below is not None and len(self.below) < BELOW:
            self.below += (below,)

    def resolved(self, stored: int, after: bytes | Sequence[int]) -> None:
        """The nearest entry filed under the chunks in ``below`` is ``stored`` tokens long and
        holds ``after`` from the divergence on: it is the nearest stored prefix when the one
        kept was a chunk's end (``bounded``) or it is nearer (``rank``)."""
        if self.bounded or rank(self.common, stored, self.n_q) > rank(self.common, self.stored, self.n_q):
            self.stored, self.bounded = stored, False
            self.after = after if isinstance(after, bytes) else tuple(after[:AFTER])
        self.below = ()

    def refused(self, at: int) -> None:
        self.cut_at = max(self.cut_at, at)

    def skipped(self, why: str, n: int) -> None:
        self.shared = (why, n)


class Ghosts:
    """Prefixes this process held and lost (left memory never written; evicted from disk),
    the last ``keep`` of them: a miss they would have served is explained by them. An
    entry is known by its tokens, or by the chunk boundary it was filed under (``k`` full
    chunks in, ``boundary`` the key there) when only its record is left."""

    def __init__(self, keep: int = 64) -> None:
        self._lost: deque[tuple[Hashable, bytes | None, bytes | None, int, int, str, str]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, owner: Hashable, reason: str, detail: str, n: int, *, enc: bytes | None = None,
            boundary: bytes | None = None, k: int = 0) -> None:
        with self._lock:
            self._lost.append((owner, enc, boundary, k, n, reason, detail))

    def best(self, owner: Hashable, enc: bytes, bounds: list[bytes] | None, chunk: int,
             beyond: int) -> tuple[str, str, int, int] | None:
        """(reason, detail, tokens shared with ``enc``, stored length) of the lost prefix
        sharing most of ``enc``, if it shares more than ``beyond`` tokens."""
        w, found = TOKEN_BYTES, None
        with self._lock:
            lost = list(self._lost)
        for who, gone, boundary, k, n, reason, detail in reversed(lost):
            if who != owner:
                continue
            if gone is not None:
                if gone[: (beyond + 1) * w] != enc[: (beyond + 1) * w]:
                    continue
                common = common_tokens(gone, enc)
            elif bounds is not None and 0 < k < len(bounds) and bounds[k] == boundary:
                common = k * chunk
            else:
                continue
            if common > beyond:
                found, beyond = (reason, detail, common, n), common
        return found


def explain(near: Near, served: int, lost: tuple[str, str, int, int] | None = None) -> Miss | None:
    """The reason ``served`` tokens were all a lookup gave, from what its searches saw
    (``near``) and what this process lost (``lost``: ``Ghosts.best``, or another identity's
    hit), or None when nothing stored reached past what was served."""
    n_q = near.n_q
    after = tuple(decode_tokens(near.after)) if isinstance(near.after, bytes) else near.after  # whole ids: the
    # searches slice stored token records, whose length is a multiple of keys.TOKEN_BYTES
    if lost is not None and lost[2] > max(served, near.common):
        reason, detail, at, stored = lost
        return Miss(reason, n_q, served, min(at, n_q), stored, None, detail)
    if near.shared is not None and near.shared[1] > max(served, near.common):
        return Miss(SHARED_SKIPPED, n_q, served, near.common, near.shared[1], "shared", near.shared[0])
    if near.cut_at > served:
        return Miss(CUT_REFUSED, n_q, served, near.common, near.stored, near.tier, "", after)
    stored = near.stored  # an entry's own length (below a chunk: ``Near.resolved``; else the chunk's end)
    if near.common < MIN_DISK_GAIN:  # parts within a chat template's role header: a new prompt, not a changed one
        return None
    if near.common < min(stored, n_q) and min(stored, n_q) > served:
        return Miss(DIVERGED, n_q, served, near.common, stored, near.tier, "", after)
    return None

