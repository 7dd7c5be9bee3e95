"""kvstore.model_layout: a model's layout as a frozen ``ModelLayout`` whose JSON record (an
identity's ``layout`` component, hashed into the identity) is exactly what ``layout_of``
has always recorded, for every cache class, so no identity changes."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from kvstore.layout import CLASSES
from kvstore.model_layout import ModelLayout, layout_of, model_layout_of

_rng = np.random.default_rng(0)


def _fed(c, n: int, dim: int = 64):
    for _ in range(n):
        k, v = (mx.array(_rng.standard_normal((1, 2, 1, dim)).astype(np.float32)) for _ in "kv")
        c.update_and_fetch(k, v)
    return c


def _arrays():
    c = ArraysCache(2)
    c[0] = mx.array(_rng.standard_normal((1, 3, 8)).astype(np.float32))
    return c


CACHES = {
    "KVCache": lambda: [_fed(KVCache(), 5)],
    "QuantizedKVCache": lambda: [_fed(QuantizedKVCache(group_size=32, bits=8), 5)],
    "RotatingKVCache": lambda: [_fed(RotatingKVCache(max_size=4, keep=1), 6)],
    "ChunkedKVCache": lambda: [_fed(ChunkedKVCache(8), 5)],
    "ArraysCache": lambda: [_arrays()],
    "CacheList": lambda: [CacheList(_arrays(), _fed(KVCache(), 3))],
    "empty": lambda: [KVCache(), RotatingKVCache(max_size=4), ArraysCache(2)],
}


@pytest.mark.parametrize("kind", list(CACHES))
def test_record_round_trips_to_the_same_json(kind):
    cache = CACHES[kind]()
    record = layout_of(cache)
    value = ModelLayout.from_json(json.loads(json.dumps(record)))
    assert value == model_layout_of(cache)  # what the identity records reads back as what the cache makes
    assert json.dumps(value.to_json()) == json.dumps(record)  # same keys, values and order: same identity bytes
    hash(value)  # frozen all the way down: usable as a key, never changed in place


def test_every_stored_class_says_which_arrays_it_holds():
    """The table names, for every stored class, the arrays a layer holds (``fit`` reads it
    to check shapes; an empty kind would make every array of that class foreign)."""
    assert {name: bool(f.arrays) for name, f in CLASSES.items()} == {name: True for name in CLASSES}
    assert [name for name, f in CLASSES.items() if f.quantized] == ["QuantizedKVCache"]
