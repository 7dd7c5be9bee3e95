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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .counters import Durations
from .visible import visible

# The reasons, most specific first (``Miss.reason`` is one of them):
DIVERGED = "diverged"                # the prompt parts from the nearest stored prefix at token ``at``
CUT_REFUSED = "cut_refused"          # an entry reaching further exists, but its cache cannot be cut there
EVICTED_UNWRITTEN = "evicted_unwritten"  # it left memory and was never written (``detail``: why not)
EVICTED_DISK = "evicted_disk"        # it was on disk and was evicted (``detail``: budget / gc)
OTHER_IDENTITY = "other_identity"    # another identity of the same model holds it (``detail``: what changed)
SHARED_SKIPPED = "shared_skipped"    # the shared tier skipped or failed it (``detail``: cost / deadline / breaker / error)
REASONS = (DIVERGED, CUT_REFUSED, EVICTED_UNWRITTEN, EVICTED_DISK, OTHER_IDENTITY, SHARED_SKIPPED)
SAID = {  # each reason said plainly, for a person reading a log line or `kvstore why`
    DIVERGED: "the prompt parts from the nearest stored prefix",
    CUT_REFUSED: "a stored entry reaches further, but its cache cannot be cut where the prompt parts from it",
    EVICTED_UNWRITTEN: "the prefix left memory and was never written to disk",
    EVICTED_DISK: "the prefix was evicted from disk",
    OTHER_IDENTITY: "another identity of this model holds the prefix",
    SHARED_SKIPPED: "the shared tier skipped or failed the lookup",
}


@dataclass(frozen=True)
class Miss:
    """One lookup that served ``served`` of ``prompt`` tokens while a stored prefix
    (``stored`` tokens long, in ``tier``) shared ``at`` tokens with the prompt or reached
    further. ``after``: up to 8 stored token ids from ``at`` on (what the store holds where
    the prompt parts from it; empty when unknown), for a log line; never sent over HTTP."""

    reason: str
    prompt: int
    served: int
    at: int
    stored: int
    tier: str | None = None
    detail: str = ""
    after: tuple[int, ...] = field(default=(), compare=False)

    @property
    def lost(self) -> int:
        """Tokens recomputed that the stored prefix held: what the miss cost."""
        return max(0, min(self.stored, self.prompt) - self.served)

    def as_stats(self) -> dict[str, object]:
        """Reason, positions and counts only (no token ids): what ``stats()`` may show."""
        return {"reason": self.reason, "detail": self.detail, "tier": self.tier, "prompt_tokens": self.prompt,
                "served_tokens": self.served, "diverged_at": self.at, "stored_tokens": self.stored,
                "lost_tokens": self.lost}


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
        self._lost = 0
        self._hist = Durations(LOST_BUCKETS)  # a cumulative histogram; here of tokens, not seconds
        self._recent: deque[dict[str, object]] = deque(maxlen=recent)

    def record(self, miss: Miss) -> bool:
        """Count ``miss``; True when it is worth a log line (``worth_logging``)."""
        worth = self.worth_logging(miss)
        with self._lock:
            self._counts[miss.reason] = self._counts.get(miss.reason, 0) + 1
            self._lost += miss.lost
            if worth:
                self._recent.append({"time": round(time.time(), 3), **miss.as_stats()})
        self._hist.observe(miss.lost)
        return worth

    def worth_logging(self, miss: Miss) -> bool:
        return miss.lost >= self.threshold

    def stats(self) -> dict[str, object]:
        """Flat keys for ``KVStore.stats()``: ``miss_<reason>`` for every reason (0 when
        none), ``miss_lost_tokens`` (their sum), ``miss_lost_tokens_histogram``
        (``counters.Durations.snapshot``'s shape, ``le`` in tokens), ``miss_log_threshold``
        and ``recent_misses`` (those worth a log line, oldest first)."""
        with self._lock:
            out: dict[str, object] = {f"{STATS_PREFIX}{r}": n for r, n in self._counts.items()}
            out[f"{STATS_PREFIX}lost_tokens"] = self._lost
            recent = list(self._recent)
        out[f"{STATS_PREFIX}lost_tokens_histogram"] = self._hist.snapshot()
        out[f"{STATS_PREFIX}log_threshold"] = self.threshold
        out["recent_misses"] = recent
        return out


# -- the log line: the text either side of where the prompt parted from the store -------------

AROUND = 8  # tokens shown either side of the divergence


def around(tokens: Sequence[int], at: int, decode: Callable[[list[int]], str],
           n: int = AROUND) -> tuple[str, str]:
    """(text of the ``n`` tokens before ``at``, text of the ``n`` from ``at``) of ``tokens``,
    escaped (``visible``, newlines too: one line)."""
    before, after = list(tokens[max(0, at - n):at]), list(tokens[at:at + n])
    return (visible(decode(before), newlines=False) if before else "",
            visible(decode(after), newlines=False) if after else "")


def log_line(miss: Miss, prompt: Sequence[int], decode: Callable[[list[int]], str] | None) -> str:
    """One line saying why ``prompt`` was served only ``miss.served`` tokens: the reason,
    the positions and counts and, with ``decode`` (the model's tokenizer), the text either
    side of ``miss.at`` in the prompt and what the store holds there (``miss.after``).
    Every decoded piece is escaped: the line is one line and carries no control characters."""
    head = (f"kvstore: miss ({miss.reason}{f': {visible(miss.detail, newlines=False)}' if miss.detail else ''}): "
            f"recomputed {miss.lost:,} tokens a stored prefix held; served {miss.served:,} of {miss.prompt:,}, "
            f"the prompt parts from the stored {miss.stored:,}-token prefix"
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
