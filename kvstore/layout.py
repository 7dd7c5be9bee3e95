"""What is true of each stored cache class (``CLASSES``) and a stored cache layout as one
frozen value (``Layout``), without MLX.

A layout is what ``codec.encode_cache`` writes beside a cache's tensors (a segment's
``kvstore.layout``): per layer, its stored class name and fields (lengths, ring and chunk
parameters, quantisation, CacheList members, a ``State`` class's items). ``Layout`` holds
it read-only and answers every question asked of it without building a cache: its length,
where it may be cut, whether it can be cut into token chunks, its signature (what an
identity records). What is true of each stored class is data, ``CLASSES``: its family, its
cut rule, whether it is chunkable, which arrays a layer holds and what their axes are, how
its KV is stored. It is the one home of those facts: ``codec`` encodes and decodes by it,
``fit`` checks shapes by it, the CLI describes entries by it; no other module tests a class
name.

Guarantees:
- ``Layout.from_json`` accepts only what ``codec`` writes (known classes, bounded integer
  fields, CacheList nesting at most two deep) and raises ValueError naming what is wrong:
  nothing else about a stored layout is trusted before it passed this and the identity's
  layout check (``fit.layout_problem``).
- ``to_json`` gives back exactly the JSON it was built from (fields in their stored order),
  so the bytes written are those ``codec`` always wrote.
- A cut is allowed only where the cut cache is, in everything the model reads, what a cold
  prefill of that many tokens leaves: trimmability is a property of the cut point.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

ATTENTION = "attention KV"  # the family of the attention-KV classes: a model may hold any of them

# Where a layer holding ``offset`` positions may be cut back to ``n`` (below its length).
CUT_NEVER = "never"                # valid only at exactly its own length (recurrent state, a State snapshot)
CUT_WITHIN = "within its offset"   # anywhere: 0 <= n <= offset
CUT_UNWRAPPED = "until it wraps"   # a ring buffer that has not wrapped (mlx-lm's is_trimmable)
CUT_CHUNK_KEPT = "chunk kept"      # where the kept keys cover the attention chunk of position n
CUT_MEMBERS = "members"            # where every member allows it


# Which arrays a layer of a class holds, by name, and what their axes are.
KV = "keys and values"          # k, v: (batch 1, KV heads, tokens, head_dim)
QUANT_KV = "quantised KV"       # k0..k2, v0..v2: mx.quantize's packed words (head_dim * bits / 32 uint32),
                                # scales and biases (head_dim / group_size), each (1, KV heads, tokens, .)
STATE_ARRAYS = "state arrays"   # a0..a{size-1}: recurrent state, shapes as the identity records them
STATE_ITEMS = "state items"     # t{i}: a ``State`` class's array items, shapes its own
MEMBERS = "members"             # none of its own: its members' (s{j}.<name>)


@dataclass(frozen=True)
class ClassFacts:
    """What is true of a stored class whatever its layer holds. ``family``: ATTENTION for
    every attention-KV class, else its own (layers of one family may stand for each other
    in a model's layout); ``cut``: its cut rule (``CUT_*``); ``chunkable``: a prefix can be
    cut into token chunks and glued back (plain and quantised KV); ``arrays``: which arrays
    a layer holds (``KV``...); ``dense``: its arrays hold every position its offset claims
    (no ring buffer, no dropped window)."""

    family: str
    cut: str = CUT_NEVER
    chunkable: bool = False
    arrays: str = ""
    dense: bool = False

    @property
    def quantized(self) -> bool:
        """Its KV is stored quantised (the layer's ``bits`` and ``group_size`` say how)."""
        return self.arrays == QUANT_KV

    @property
    def nested(self) -> bool:
        """It holds other cache layers (a CacheList), not arrays of its own."""
        return self.arrays == MEMBERS


STATE = "State"  # the stored name of any class following mlx-lm's state / from_state protocol

# Every class name a stored layout may hold ("State": any class following mlx-lm's
# ``state`` / ``from_state`` protocol, see ``codec``).
CLASSES: dict[str, ClassFacts] = {
    "KVCache": ClassFacts(ATTENTION, CUT_WITHIN, chunkable=True, arrays=KV, dense=True),
    "QuantizedKVCache": ClassFacts(ATTENTION, CUT_WITHIN, chunkable=True, arrays=QUANT_KV, dense=True),
    "RotatingKVCache": ClassFacts(ATTENTION, CUT_UNWRAPPED, arrays=KV),
    "ChunkedKVCache": ClassFacts(ATTENTION, CUT_CHUNK_KEPT, arrays=KV),
    "ArraysCache": ClassFacts("ArraysCache", arrays=STATE_ARRAYS),
    "CacheList": ClassFacts("CacheList", CUT_MEMBERS, arrays=MEMBERS),
    STATE: ClassFacts(STATE, arrays=STATE_ITEMS),
}

INT_FIELDS = ("offset", "keep", "max_size", "idx", "chunk_size", "start", "group_size", "bits", "size")
LENGTH_FIELDS = ("offset", "idx", "start")  # what a signature leaves out
ITEM_KINDS = {bool: "b", int: "i", float: "f", str: "s"}  # a State item's scalar kinds
MAX_LAYERS = 4096
MAX_ARRAYS = 1024  # an ArraysCache's size


def facts(cls_name: Any) -> ClassFacts:
    """The facts of a stored class name; an unknown one (a record not checked against
    ``CLASSES``) is its own family, never cut, and holds no arrays kvstore knows."""
    known = CLASSES.get(cls_name) if isinstance(cls_name, str) else None
    return known if known is not None else ClassFacts(str(cls_name), arrays="")


def family(cls_name: Any) -> str:
    """The family of a stored class name (see ``ClassFacts``); an unknown name is its own."""
    return facts(cls_name).family


@dataclass(frozen=True)
class Layer(Mapping[str, Any]):
    """One layer's stored meta, read-only: ``fields`` in stored order, "class" among them;
    a CacheList's ``sub`` is a ``Layout``, a State layer's ``items`` tuples."""

    fields: tuple[tuple[str, Any], ...]

    def __getitem__(self, key: str) -> Any:
        for k, v in self.fields:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    @property
    def cls(self) -> str:
        """The stored class name."""
        return str(self.get("class"))

    @property
    def facts(self) -> ClassFacts:
        """What is true of its class (``CLASSES``)."""
        return facts(self.cls)

    def replaced(self, key: str, value: Any) -> Layer:
        """This layer with ``key`` set to ``value`` (in its place, else last)."""
        if key in self:
            return Layer(tuple((k, value if k == key else v) for k, v in self.fields))
        return Layer((*self.fields, (key, value)))

    def can_cut(self, n: int) -> bool:
        """Whether this layer may be cut back to ``n`` positions (its class's cut rule)."""
        rule = self.facts.cut
        if rule == CUT_WITHIN:
            return 0 <= n <= self["offset"]
        if rule == CUT_UNWRAPPED:
            return 0 <= n <= self["offset"] < self["max_size"]
        if rule == CUT_CHUNK_KEPT:
            # llama4 builds its chunk mask from ``start_position``: position n attends to keys
            # n // size * size .. n, which a cut inside the chunk of ``start`` no longer holds
            # (mlx-lm's is_trimmable says True there: its own LRU hands out such a cache).
            size = self["chunk_size"]
            return size > 0 and 0 <= n <= self["offset"] and self["start"] <= n // size * size
        if rule == CUT_MEMBERS:
            return all(m.can_cut(n) for m in self["sub"])
        return False

    def signature(self) -> dict[str, Any]:
        """The layer without lengths: its class and parameters."""
        if self.facts.nested:
            return {"class": self.cls, "sub": self["sub"].signature()}
        if self.facts.arrays == STATE_ITEMS:
            return {"class": self.cls, "type": self["type"], "items": [x[0] for x in self["items"]]}
        return {k: _thaw(v) for k, v in self.fields if k not in LENGTH_FIELDS}


@dataclass(frozen=True)
class Layout:
    """A cache's stored layout, one ``Layer`` per cache layer (see the module doc)."""

    layers: tuple[Layer, ...] = ()

    @classmethod
    def of(cls, metas: list[dict[str, Any]]) -> Layout:
        """The layout of metas ``codec`` just encoded (trusted: not checked)."""
        return cls(tuple(Layer(tuple((k, _freeze(k, v)) for k, v in m.items())) for m in metas))

    @classmethod
    def from_json(cls, obj: Any) -> Layout:
        """The layout of stored JSON ``obj`` if it is one ``codec`` writes, else ValueError."""
        _check(obj, 0)
        return cls.of(obj)

    def to_json(self) -> list[dict[str, Any]]:
        return [{k: _thaw(v) for k, v in m.fields} for m in self.layers]

    def __iter__(self) -> Iterator[Layer]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def flat(self) -> tuple[Layer, ...]:
        """Layers with CacheList members in their place."""
        out: list[Layer] = []
        for m in self.layers:
            out.extend(m["sub"].flat if m.facts.nested else [m])
        return tuple(out)

    @property
    def length(self) -> int | None:
        """Positions the layout holds: its smallest ``offset`` (None for recurrent state
        alone, which records no length)."""
        offs = [m["offset"] for m in self.flat if "offset" in m]
        return min(offs) if offs else None

    def chunkable(self, n_tokens: int) -> bool:
        """Every layer is of a chunkable class and holds exactly ``n_tokens`` positions: the
        cache can be cut into token chunks and glued back (prefix reuse at any length)."""
        return all(m.facts.chunkable and m["offset"] == n_tokens for m in self.flat)

    def with_offset(self, n: int) -> Layout:
        """A chunkable layout re-labelled to hold ``n`` tokens."""
        return Layout(tuple(m.replaced("sub", m["sub"].with_offset(n)) if m.facts.nested
                            else m.replaced("offset", n) for m in self.layers))

    def can_cut(self, n: int) -> bool:
        """Whether a cache of this layout cut back to ``n`` positions is, in everything the
        model reads, the cache a cold prefill of those ``n`` tokens leaves: at its own
        length always; below it only where every layer's class allows that cut point."""
        held = self.length
        if held is None or not 0 <= n <= held:
            return False
        return n == held or all(m.can_cut(n) for m in self.layers)

    @property
    def trimmable(self) -> bool:
        """Some cut below its length is allowed (cut points are upward-closed: the last one
        is allowed if any is). What an entry record's ``trimmable`` flag says."""
        held = self.length
        return held is not None and held > 0 and self.can_cut(held - 1)

    @property
    def covers_prefixes(self) -> bool:
        """Every prefix can be cut from it (so it stands in for the stored snapshots of its
        prefixes, mlx-lm's rule for trimmable entries)."""
        return self.can_cut(0)

    def signature(self) -> list[dict[str, Any]]:
        """The layout without lengths: classes and their parameters (JSON), for identity checks."""
        return [m.signature() for m in self.layers]


def _freeze(key: str, v: Any) -> Any:
    if key == "sub" and isinstance(v, list):
        return Layout.of(v)
    return tuple(_freeze("", x) for x in v) if isinstance(v, list) else v


def _thaw(v: Any) -> Any:
    if isinstance(v, Layout):
        return v.to_json()
    return [_thaw(x) for x in v] if isinstance(v, tuple) else v


def _check(obj: Any, depth: int) -> None:
    """ValueError unless ``obj`` is a list of layer metas of known classes whose fields are
    bounded integers or their class's own, CacheList nesting at most two deep."""
    if not isinstance(obj, list) or not 0 < len(obj) <= MAX_LAYERS or depth > 2:
        raise ValueError("a layout is a non-empty list of layer metas")
    for m in obj:
        if not isinstance(m, dict) or m.get("class") not in CLASSES:
            raise ValueError(f"unknown cache class in a stored layout: {str(m)[:80]!r}")
        for k, v in m.items():
            if k == "class":
                continue
            if k in INT_FIELDS:
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 31:
                    raise ValueError(f"layout field {k}={v!r} out of range")
            elif k == "sub" and CLASSES[m["class"]].nested:
                _check(v, depth + 1)
            elif CLASSES[m["class"]].arrays == STATE_ITEMS:
                if not (k == "type" and isinstance(v, str) and len(v) <= 200 and v.startswith("mlx_lm.models.")
                        or k == "items" and isinstance(v, list) and len(v) <= 64 and all(map(_item_ok, v))):
                    raise ValueError(f"layout field {k}={str(v)[:80]!r} is not a state description")
            else:
                raise ValueError(f"unexpected layout field {k!r}")
        if CLASSES[m["class"]].arrays == STATE_ARRAYS and not 0 < m.get("size", 0) <= MAX_ARRAYS:
            raise ValueError(f"ArraysCache size {m.get('size')!r} out of range")


def _item_ok(x: Any) -> bool:
    """A State item as ``codec`` writes it: ["a"] (an array), ["n"] (None) or [kind, scalar]."""
    if not isinstance(x, list) or not x or x[0] not in ("a", "n", *ITEM_KINDS.values()):
        return False
    if x[0] in ("a", "n"):
        return len(x) == 1
    kind = {v: k for k, v in ITEM_KINDS.items()}[x[0]]
    return len(x) == 2 and type(x[1]) is kind and (not isinstance(x[1], str) or len(x[1]) <= 256)
