"""What a segment says about itself: the ``__metadata__`` of its safetensors header.

Every segment kvstore writes carries a ``SegmentMeta`` (written by ``to_meta`` here) naming
the format version, the identity, what it is (``snapshot``, ``chunk`` or ``tail``), the key
of the record it belongs to, the token range it holds and its cache layout. A restore reads
it back through ``expect`` here before allocating anything: a segment whose metadata is
not exactly what its record says is refused, so a pack file moved, copied or crafted under
another record's name is never read as that record's KV. Nothing else in kvstore builds or
parses these fields, so a maintainer who changes them changes this file.

The layout is returned parsed but unchecked: what a layout may hold is
``cachelayout.Layout.from_json``'s to say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from .keys import FORMAT_VERSION

FORMAT_TAG = str(FORMAT_VERSION)  # "kvstore.format" of every segment this version writes
KINDS = ("snapshot", "chunk", "tail")


class SegmentMismatch(ValueError):
    """A segment whose metadata is not its record's (``fields``: the ones that differ,
    ``foreign``: it names another key, i.e. it is some other record's segment)."""

    def __init__(self, fields: list[str], foreign: bool) -> None:
        super().__init__(f"the segment is not what its record says ({', '.join(fields) or 'format'})")
        self.fields = fields
        self.foreign = foreign


@dataclass(frozen=True)
class SegmentMeta:
    """One segment's own description: ``tokens [lo, hi)`` of the entry or chunk ``key``
    of identity ``identity`` (hex digest), in cache layout ``layout`` (JSON-able)."""

    identity: str
    kind: str
    key: bytes
    lo: int
    hi: int
    layout: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"segment kind {self.kind!r}")

    def fields(self) -> dict[str, str]:
        """The header fields that name the segment (all but format and layout)."""
        return {"kvstore.key": self.key.hex(), "kvstore.kind": self.kind, "kvstore.identity": self.identity,
                "kvstore.tokens": f"{self.lo}-{self.hi}"}

    def to_meta(self) -> dict[str, str]:
        """The header ``__metadata__`` to write (the one writer of segment metadata)."""
        return {"kvstore.format": FORMAT_TAG, "kvstore.identity": self.identity, "kvstore.kind": self.kind,
                "kvstore.key": self.key.hex(), "kvstore.tokens": f"{self.lo}-{self.hi}",
                "kvstore.layout": json.dumps(self.layout)}

    def expect(self, meta: Mapping[str, Any]) -> Any:
        """The stored layout (parsed JSON) of a segment whose header ``meta`` must name
        this segment (the one reader). Raises ``SegmentMismatch`` if a naming field or the
        format differs, ValueError / RecursionError if the layout is not JSON."""
        bad = [k for k, v in self.fields().items() if meta.get(k) != v]
        if bad or meta.get("kvstore.format") != FORMAT_TAG:
            raise SegmentMismatch(bad, "kvstore.key" in bad and isinstance(meta.get("kvstore.key"), str))
        return json.loads(meta.get("kvstore.layout", ""))
