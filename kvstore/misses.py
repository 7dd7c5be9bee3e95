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

from dataclasses import dataclass, field

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
