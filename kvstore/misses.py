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
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

# The reasons, most specific first (``Miss.reason`` is one of them):
DIVERGED = "diverged"                # the prompt parts from the nearest stored prefix at token ``at``
CUT_REFUSED = "cut_refused"          # an entry reaching further exists, but its cache cannot be cut there
EVICTED_UNWRITTEN = "evicted_unwritten"  # it left memory and was never written (``detail``: why not)
EVICTED_DISK = "evicted_disk"        # it was on disk and was evicted (``detail``: budget / gc)
OTHER_IDENTITY = "other_identity"    # another identity of the same model holds it (``detail``: what changed)
SHARED_SKIPPED = "shared_skipped"    # the shared tier skipped or failed it (``detail``: cost / deadline / breaker / error)
REASONS = (DIVERGED, CUT_REFUSED, EVICTED_UNWRITTEN, EVICTED_DISK, OTHER_IDENTITY, SHARED_SKIPPED)


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


def changed_components(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Which identity components differ between two identities' ``info`` (e.g.
    "chat_template, kv_bits"), for ``OTHER_IDENTITY``'s detail."""
    a, b = old.get("components") or {}, new.get("components") or {}
    return ", ".join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))) or "unknown"


class Near:
    """What a lookup's searches saw of the stored prefixes nearest its query (each tier's
    search reports as it goes, no extra pass): the one sharing most tokens with the query,
    and the furthest point a stored prefix could not be cut at."""

    def __init__(self, n_q: int) -> None:
        self.n_q = n_q
        self.common = 0      # tokens the nearest stored prefix shares with the query
        self.stored = 0      # its length; ``continues``: at least that (a chunk others go on from)
        self.continues = False
        self.tier: str | None = None
        self.after: bytes | tuple[int, ...] = ()
        self.cut_at = 0      # the furthest a refused cut would have served
        self.shared: tuple[str, int] | None = None  # why the shared tier skipped a candidate, its length

    def saw(self, tier: str, common: int, stored: int, after: bytes | Sequence[int] = (), *,
            continues: bool = False) -> None:
        if (common, stored) > (self.common, self.stored):
            self.common, self.stored, self.continues, self.tier = common, stored, continues, tier
            self.after = after if isinstance(after, bytes) else tuple(after[:8])

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
        from .keys import TOKEN_BYTES, common_tokens

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
    after = tuple(decode_ids(near.after)) if isinstance(near.after, bytes) else near.after
    if lost is not None and lost[2] > max(served, near.common):
        reason, detail, at, stored = lost
        return Miss(reason, n_q, served, min(at, n_q), stored, None, detail)
    if near.shared is not None and near.shared[1] > max(served, near.common):
        return Miss(SHARED_SKIPPED, n_q, served, near.common, near.shared[1], "shared", near.shared[0])
    if near.cut_at > served:
        return Miss(CUT_REFUSED, n_q, served, near.common, near.stored, near.tier, "", after)
    stored = max(near.stored, n_q) if near.continues else near.stored
    if near.common < min(stored, n_q) and min(stored, n_q) > served:
        return Miss(DIVERGED, n_q, served, near.common, stored, near.tier, "", after)
    return None


def decode_ids(enc: bytes) -> list[int]:
    from .keys import decode_tokens

    return decode_tokens(enc[: len(enc) // 8 * 8])
