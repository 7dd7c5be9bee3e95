"""kvstore.codec, kvstore.segments and kvstore.keys with MLX arrays: every cache class round-trips exactly.

Caches here are built directly through mlx-lm's own ``update_and_fetch`` with random arrays
(no model), so buffers are over-allocated, rotated and front-trimmed the way real runs leave
them. "Equal" means: same class, same attributes (offset, rotation index, window, group
size, ...), bit-identical logical contents, and the same outputs when both copies are
extended with the same new keys / values.
"""

from __future__ import annotations

import copy
import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from kvstore import alloc, codec, files, keys, segments
from kvstore.layout import Layout
from tests.unit.test_keys import PINNED_TOKENS, W

H, D = 2, 64  # kv heads, head dim (64: divisible by the quantisation group size 32)
_rng = np.random.default_rng(0)


def rand(n: int, *, dim: int = D, dtype=mx.float32) -> mx.array:
    return mx.array(_rng.standard_normal((1, H, n, dim)).astype(np.float32)).astype(dtype)


def feed(c, n: int, *, one_at_a_time: bool = False, dtype=mx.float32):
    """Extend a KV-style cache by ``n`` random positions (in one call or one by one)."""
    steps = [1] * n if one_at_a_time else [n]
    out = None
    for s in steps:
        out = c.update_and_fetch(rand(s, dtype=dtype), rand(s, dtype=dtype))
    mx.eval(out)
    return out


def make_kv(n=40, dtype=mx.float32):
    c = KVCache()
    feed(c, n, dtype=dtype)
    assert c.keys.shape[2] == 256 > n  # over-allocated buffer: encode must cut it
    return c


def make_quant(n=40):
    c = QuantizedKVCache(group_size=32, bits=8)
    feed(c, n)
    return c


def make_rotating(wrapped: bool, concat: bool = False):
    c = RotatingKVCache(max_size=16, keep=4)
    if concat:  # multi-token prefill path: buffer longer than max_size, then in-place steps
        feed(c, 24)
        feed(c, 3, one_at_a_time=True)
    elif wrapped:
        feed(c, 40, one_at_a_time=True)
    else:
        feed(c, 10, one_at_a_time=True)
    assert (c.offset > c.max_size) == (wrapped or concat)
    return c


def make_arrays():
    c = ArraysCache(3)
    c[0] = mx.array(_rng.standard_normal((1, 3, 8)).astype(np.float32))
    c[2] = mx.array(_rng.standard_normal((1, 2, 4, 4)).astype(np.float32))  # [1] stays None
    return c


def make_chunked():
    c = ChunkedKVCache(8)
    feed(c, 20)
    c.maybe_trim_front()
    feed(c, 3)
    assert c.start_position > 0
    return c


def make_cachelist():
    return CacheList(make_arrays(), make_rotating(wrapped=True), make_kv(30))


FACTORIES = {
    "KVCache": make_kv,
    "QuantizedKVCache": make_quant,
    "RotatingKVCache-before-wrap": lambda: make_rotating(False),
    "RotatingKVCache-wrapped": lambda: make_rotating(True),
    "RotatingKVCache-concat": lambda: make_rotating(True, concat=True),
    "ArraysCache": make_arrays,
    "ChunkedKVCache": make_chunked,
    "CacheList": make_cachelist,
}

_ATTRS = {
    KVCache: ("offset",),
    QuantizedKVCache: ("offset", "group_size", "bits"),
    RotatingKVCache: ("offset", "keep", "max_size", "_idx"),
    ChunkedKVCache: ("offset", "chunk_size", "start_position"),
}


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def _eq(a: mx.array, b: mx.array, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert np.array_equal(_np(a), _np(b)), f"{what}: values differ"


def logical(c) -> list[mx.array]:
    """The arrays a cache's state really holds (buffers cut to their filled length)."""
    if isinstance(c, (KVCache, QuantizedKVCache)):
        if c.keys is None:
            return []
        ks = c.keys if isinstance(c.keys, tuple) else (c.keys,)
        vs = c.values if isinstance(c.values, tuple) else (c.values,)
        return [x[..., : c.offset, :] for x in (*ks, *vs)]
    if isinstance(c, ChunkedKVCache):
        n = c.offset - c.start_position
        return [c.keys[..., :n, :], c.values[..., :n, :]]
    if isinstance(c, RotatingKVCache):  # the ring buffer as it is: rotation is state
        return [c.keys, c.values]
    if isinstance(c, ArraysCache):
        return [x for x in c.cache if x is not None]
    raise AssertionError(type(c))


def assert_same(a, b, what="cache") -> None:
    assert type(a) is type(b), f"{what}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, CacheList):
        assert len(a.caches) == len(b.caches)
        for i, (x, y) in enumerate(zip(a.caches, b.caches)):
            assert_same(x, y, f"{what}.caches[{i}]")
        return
    if isinstance(a, ArraysCache):
        assert len(a.cache) == len(b.cache)
        assert [x is None for x in a.cache] == [x is None for x in b.cache]
    for attr in _ATTRS.get(type(a), ()):
        assert getattr(a, attr) == getattr(b, attr), f"{what}.{attr}: {getattr(a, attr)} != {getattr(b, attr)}"
    la, lb = logical(a), logical(b)
    assert len(la) == len(lb)
    for i, (x, y) in enumerate(zip(la, lb)):
        _eq(x, y, f"{what} array {i}")


def assert_same_when_extended(a, b) -> None:
    """Feeding the same new positions into both gives the same keys / values."""
    subs = list(zip(a.caches, b.caches)) if isinstance(a, CacheList) else [(a, b)]
    for x, y in subs:
        if isinstance(x, ArraysCache):
            continue
        for n in (1, 3, 1):
            k, v = rand(n), rand(n)
            ox, oy = x.update_and_fetch(k, v), y.update_and_fetch(k, v)
            for p, q in zip(ox, oy):
                for s, t in zip(p if isinstance(p, tuple) else (p,), q if isinstance(q, tuple) else (q,)):
                    _eq(s, t, f"{type(x).__name__} extended by {n}")


def through_json(layout):
    """Layouts are stored as JSON in the index: decode from what JSON gives back."""
    return Layout.from_json(json.loads(json.dumps(layout.to_json())))


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_codec_round_trip(kind):
    c = FACTORIES[kind]()
    tensors, layout = codec.encode_cache([c])
    restored = codec.decode_cache(tensors, through_json(layout))
    assert len(restored) == 1
    assert_same(c, restored[0])
    assert_same_when_extended(copy.deepcopy(c), restored[0])


@pytest.mark.parametrize("kind", list(FACTORIES))
def test_blob_round_trip(kind, tmp_path):
    """codec -> a pack of one segment -> alloc.read_segment -> codec gives the same cache,
    and the segment is a plain safetensors file (safetensors.safe_open and mx.load read it)."""
    from safetensors import safe_open

    cache = [FACTORIES[kind](), make_kv(7)]  # two layers: names are layer-prefixed
    tensors, layout = codec.encode_cache(cache)
    path, seg = _write(tmp_path, tensors, {"kvstore.kind": "test"})
    assert path.stat().st_size == seg.length and seg.offset == 0
    got, meta = alloc.read_segment(path, seg)
    assert meta == {"kvstore.kind": "test"}
    assert set(got) == set(tensors)
    for name in tensors:
        _eq(got[name], tensors[name], name)
    restored = codec.decode_cache(got, through_json(layout))
    for a, b in zip(cache, restored):
        assert_same(a, b)
    assert_same_when_extended(copy.deepcopy(cache[0]), restored[0])

    with safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata() == {"kvstore.kind": "test"}
        for name in tensors:
            assert np.array_equal(f.get_tensor(name), _np(tensors[name])), name
    loaded = mx.load(str(path), format="safetensors")
    assert set(loaded) == set(tensors)
    for name in tensors:
        _eq(loaded[name], tensors[name], f"mx.load {name}")


def test_encode_does_not_copy_or_keep_padding():
    c = make_kv(40)
    tensors, layout = codec.encode_cache([c])
    assert tensors["0.k"].shape == (1, H, 40, D)  # cut to the filled length, not 256
    assert layout.to_json() == [{"offset": 40, "class": "KVCache"}]
    assert layout.chunkable(40) and not layout.chunkable(41)
    rot = codec.encode_cache([make_rotating(True)])[1]
    assert not rot.chunkable(40)


def test_bfloat16_round_trip(tmp_path):
    cache = [make_kv(33, dtype=mx.bfloat16), make_kv(33, dtype=mx.bfloat16)]
    assert cache[0].keys.dtype == mx.bfloat16
    tensors, layout = codec.encode_cache(cache)
    path, seg = _write(tmp_path, tensors, {})
    got, _ = alloc.read_segment(path, seg)
    assert all(v.dtype == mx.bfloat16 for v in got.values())
    restored = codec.decode_cache(got, through_json(layout))
    for a, b in zip(cache, restored):
        assert_same(a, b)
    loaded = mx.load(str(path), format="safetensors")
    for name in tensors:
        _eq(loaded[name], tensors[name], f"mx.load {name}")
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:  # the header says BF16
        assert set(f.keys()) == set(tensors)
    header = segments.parse_header(path.read_bytes(), seg.length)
    assert {header.specs[n][0] for n in tensors} == {"BF16"}


@pytest.mark.parametrize("kind", ["KVCache", "QuantizedKVCache", "RotatingKVCache-wrapped",
                                  "RotatingKVCache-before-wrap", "ChunkedKVCache", "CacheList"])
def test_handed_out_twice_extends_independently(kind):
    """Two caches decoded from the same stored tensors: extending one (also in place, after
    a trim, where mlx-lm writes into the existing buffer) changes neither the other nor
    the stored tensors."""
    c = FACTORIES[kind]()
    tensors, layout = codec.encode_cache([c])
    before = {k: _np(v).copy() for k, v in tensors.items()}
    a = codec.decode_cache(tensors, layout)[0]
    b = codec.decode_cache(tensors, layout)[0]
    ref = codec.decode_cache(tensors, layout)[0]
    subs = a.caches if isinstance(a, CacheList) else (a,)
    for x in subs:
        if isinstance(x, ArraysCache):
            x[0] = x[0] + 1  # recurrent state replaced, as a model step does
            continue
        if x.is_trimmable():
            x.trim(3)  # then the update writes into the existing buffer in place
        feed(x, 2)
        feed(x, 1, one_at_a_time=True)
    mx.eval([arr for x in subs for arr in logical(x)])
    assert_same(b, ref)
    for k, v in tensors.items():
        assert np.array_equal(_np(v), before[k]), f"stored tensor {k} changed"


def test_layout_helpers():
    cache = [make_kv(10), CacheList(make_kv(10), make_quant(10))]
    _, layout = codec.encode_cache(cache)
    assert layout.chunkable(10)
    relabelled = layout.with_offset(4)
    assert [m["offset"] for m in relabelled.flat] == [4, 4, 4]
    assert [m["offset"] for m in layout.flat] == [10, 10, 10]  # not mutated
    sig = codec.encode_cache([make_rotating(True)])[1].signature()
    assert sig == [{"keep": 4, "max_size": 16, "class": "RotatingKVCache"}]


class _MyKV(KVCache):
    pass


@pytest.mark.parametrize("bad", [
    [object()],
    [],
    "not a cache",
    [_MyKV()],  # a subclass is not the class its codec knows
    [ConcatenateKVCache()],
    [BatchKVCache([0, 1])],
    [make_kv(3), 5],
])
def test_unsupported_raises(bad):
    with pytest.raises(codec.Unsupported):
        codec.encode_cache(bad)


def test_unsupported_batched_arrays_cache_and_unknown_class():
    c = ArraysCache(2, left_padding=[1, 0])
    with pytest.raises(codec.Unsupported):
        codec.encode_cache([c])
    with pytest.raises(codec.Unsupported):
        codec.decode_cache({}, Layout.of([{"class": "NoSuchCache"}]))


# --------------------------------------------------------------------------- blobs


def _write(d, tensors, meta):
    """A new pack file holding one segment of ``tensors``: (its path, the segment)."""
    w = segments.PackWriter(d)
    try:
        seg = w.add(segments.host_views(tensors), meta)
        w.seal()
    finally:
        w.close()
    return w.path, seg


def test_blob_errors(tmp_path):
    from dataclasses import replace

    tensors, _ = codec.encode_cache([make_kv(5)])
    path, seg = _write(tmp_path, tensors, {})
    with pytest.raises(files.BlobError):
        alloc.read_segment(path, replace(seg, length=seg.length + 1))
    with pytest.raises(files.BlobError):
        alloc.read_segment(path, replace(seg, checksum=b"\0" * 16))
    with pytest.raises(files.BlobError):
        alloc.read_segment(tmp_path / "missing.kvpack", seg)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(files.BlobError, match="checksum"):
        alloc.read_segment(path, seg)
    with pytest.raises(files.BlobError):
        segments.parse_header(b"\xff" * 16, 16)


def _span_read(path, seg, order, groups, span=1):
    """Read ``seg`` with a SegmentRead in spans of ``span`` bytes or one view, its tensors given in
    ``groups`` (file order), the spans read in ``order`` (a permutation function) on 8
    threads at once; (numpy destinations, the SegmentRead)."""
    from concurrent.futures import ThreadPoolExecutor

    fd = files.open_own(path)
    try:
        header = segments.read_header(fd, seg)
        dests = {n: np.zeros(shape, segments.host_dtype(st)) for n, (st, shape) in header.specs.items()}
        r = segments.SegmentRead(fd, seg, header, span=span)
        names = list(header.specs)
        spans = []
        for lo, hi in zip([0] + groups, groups + [len(names)]):
            spans += list(r.add({n: dests[n] for n in names[lo:hi]}))
        assert len(spans) >= 16
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(r.read, order(spans)))
    finally:
        os.close(fd)
    return dests, r


def test_segment_read_in_spans_any_order_is_the_segment(tmp_path):
    """A segment read in many small spans, its tensors added in groups, the spans read
    by 8 threads in reverse or shuffled order, gives exactly the stored bytes and
    verifies (the hash follows the file order whatever order the spans land in); a
    damaged byte in any span, or a span never read, fails verify."""
    import random
    from dataclasses import replace

    tensors, _ = codec.encode_cache([make_kv(200) for _ in range(8)])
    path, seg = _write(tmp_path, tensors, {})
    shuffled = lambda xs: random.Random(7).sample(xs, len(xs))  # noqa: E731
    for order, groups in ((lambda xs: xs[::-1], [1]), (shuffled, [1, 2]), (list, [])):
        dests, r = _span_read(path, seg, order, groups)
        r.verify()
        for name, (st, a) in segments.host_views(tensors).items():
            assert np.array_equal(dests[name], np.asarray(a)), name
    _, r = _span_read(path, seg, lambda xs: xs[1:], [1])  # span 0 never read
    with pytest.raises(files.BlobError, match="not every"):
        r.verify()
    _, r = _span_read(path, replace(seg, checksum=b"\0" * 16), shuffled, [1])
    with pytest.raises(files.BlobError, match="checksum"):
        r.verify()
    data = bytearray(path.read_bytes())
    data[seg.end - 5000] ^= 0x01
    path.write_bytes(bytes(data))
    _, r = _span_read(path, seg, shuffled, [1])
    with pytest.raises(files.BlobError, match="checksum"):
        r.verify()


def test_token_runs_read_segments_into_their_token_slices(tmp_path):
    """Segments holding token ranges of whole arrays, read with ``add_tokens`` into
    ``TokenRuns`` (views made once per array), give exactly the stored tokens in their
    slices and verify; a range of the wrong length, or arrays of another dtype, is a
    BlobError before anything is read; a sliced (non-contiguous) array is refused."""
    kv = make_kv(20)
    whole = codec.encode_cache([kv])[0]
    cuts = [(0, 5), (5, 12), (12, 20)]
    parts = [codec.slice_tokens(whole, lo, hi) for lo, hi in cuts]
    w = segments.PackWriter(tmp_path)
    segs = [w.add(segments.host_views(t), {}) for t in parts]
    w.seal()
    w.close()
    host = segments.host_views(whole)
    dests = {n: np.full(np.asarray(a).shape, -1, np.asarray(a).dtype) for n, (_, a) in host.items()}
    runs = {n: segments.TokenRuns(a) for n, a in dests.items()}
    fd = files.open_own(w.path)
    try:
        for seg, (lo, hi) in zip(segs, cuts):
            r = segments.SegmentRead(fd, seg, segments.read_header(fd, seg), span=1 << 10)
            for i in r.add_tokens(runs, lo, hi):
                r.read(i)
            r.verify()
        for name, (_, a) in host.items():
            assert np.array_equal(dests[name], np.asarray(a)), name
        wrong = segments.SegmentRead(fd, segs[1], segments.read_header(fd, segs[1]))
        with pytest.raises(files.BlobError, match="expected"):
            wrong.add_tokens(runs, 5, 13)  # the segment holds 7 tokens, not 8
        halves = {n: segments.TokenRuns(a.view(np.float16)[..., : a.shape[-1]].copy()) for n, a in dests.items()}
        with pytest.raises(files.BlobError, match="expected"):
            segments.SegmentRead(fd, segs[1], segments.read_header(fd, segs[1])).add_tokens(halves, 5, 12)
    finally:
        os.close(fd)
    with pytest.raises(RuntimeError, match="contiguous"):
        segments.TokenRuns(next(iter(dests.values()))[..., 2:9, :])


def test_pack_holds_segments_back_to_back(tmp_path):
    """Several segments in one pack file: each is found at its offset, verified on its
    own, and is a complete safetensors buffer once cut out."""
    from safetensors.numpy import load

    parts = [codec.encode_cache([make_kv(n)])[0] for n in (3, 9, 17)]
    w = segments.PackWriter(tmp_path)
    segs = [w.add(segments.host_views(t), {"i": str(i)}) for i, t in enumerate(parts)]
    w.seal()
    w.close()
    assert [s.offset for s in segs] == [0, segs[0].length, segs[0].length + segs[1].length]
    assert w.path.stat().st_size == sum(s.length for s in segs)
    raw = w.path.read_bytes()
    for i, (t, seg) in enumerate(zip(parts, segs)):
        got, meta = alloc.read_segment(w.path, seg)
        assert meta == {"i": str(i)}
        for name in t:
            _eq(got[name], t[name], name)
        cut = load(raw[seg.offset : seg.end])
        assert set(cut) == set(t)


def test_blob_header_must_tile_its_data(tmp_path):
    """A header is parsed before the checksum can be checked: shapes that do not exactly
    cover the data section are a BlobError before anything is allocated for them."""
    import struct

    import xxhash

    from kvstore.records import Segment

    tensors, _ = codec.encode_cache([make_kv(5)])
    path, seg = _write(tmp_path, tensors, {})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for change in ({"shape": [1, 1 << 40, 5, D]}, {"data_offsets": [8, 1 << 40]}, {"dtype": "F64"}):
        header = json.loads(data[8 : 8 + n])
        header["0.k"].update(change)
        hb = json.dumps(header).encode()
        bad = struct.pack("<Q", len(hb)) + hb + data[8 + n :]
        path.write_bytes(bad)
        with pytest.raises(files.BlobError, match="fit|cover"):
            alloc.read_segment(path, Segment(seg.pack, 0, len(bad), xxhash.xxh3_128_digest(bad)))


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("st", sorted(segments._FROM_ST))
def test_empty_arrays_are_written_through_numpy(st, shared, monkeypatch):
    """Restores read blob bytes straight into MLX arrays through numpy views of their
    memory: a write through the view is what MLX then sees, for every stored dtype. Where
    MLX would hand numpy a copy (``SHARED_MEMORY`` off), numpy buffers stand in and
    ``finish`` copies them into MLX: the same result."""
    monkeypatch.setattr(alloc, "SHARED_MEMORY", shared)
    arrays, hosts = alloc.alloc({"x": (st, (2, 3, 4))})
    assert isinstance(arrays["x"], mx.array if shared else np.ndarray)
    pattern = np.arange(hosts["x"].nbytes, dtype=np.uint8) % (2 if st == "BOOL" else 251)
    hosts["x"].reshape(-1).view(np.uint8)[:] = pattern
    got = alloc.finish(st, arrays["x"])
    raw = got.view(mx.uint16) if st == "BF16" else got
    assert np.array_equal(np.array(raw).reshape(-1).view(np.uint8), pattern)


# --------------------------------------------------------------------------- keys


def test_token_encoding_is_little_endian_int64():
    enc = keys.encode_tokens(PINNED_TOKENS)
    assert W == 8 and enc == b"".join(t.to_bytes(8, "little", signed=True) for t in PINNED_TOKENS)
    assert keys.decode_tokens(enc) == PINNED_TOKENS
    assert keys.encode_tokens(np.array(PINNED_TOKENS[:10], dtype=np.uint32)) == enc[: 10 * W]
    assert keys.encode_tokens(np.array(PINNED_TOKENS, dtype=np.int64)) == enc
    assert keys.encode_tokens(mx.array(PINNED_TOKENS[:8])) == enc[: 8 * W]
    assert keys.encode_tokens([]) == b""


# -- cut points: a chunked-attention cache is only cut where a cold prefill would agree --------

_CHUNK_QUERIES = {"in_chunk_after_start": 58, "at_chunk_start": 56, "in_chunk_of_start": 53,
                  "before_start": 49}  # the entry is filed at boundary 48 (chunk_tokens 16)
_CHUNK_CHILD = """
import json, sys
from kvstore import KVStore
from tools.testing.model_builds import load_model, model_path
from tools.testing.oracle import check_restore
job = json.loads(sys.argv[1])
model, _ = load_model("tiny-llama4")
out = {}
for name, q in job["queries"].items():
    with KVStore(job["dir"], chunk_tokens=16) as s:  # a fresh store: the hit comes from disk
        f = s.fetch(str(model_path("tiny-llama4")), q)
        res = {"n": f.n, "source": f.source}
        if f.cache is not None:
            res["ok"] = check_restore(model, q, f.cache, f.n, n_gen=8).ok
        st = s.stats()
        res.update(corrupt=st["corrupt"], entries=st["disk_entries"])
    out[name] = res
print(json.dumps(out))
"""


def _llama4_entry():
    """tiny-llama4's cache of a 60-token prompt fed as 57 tokens then one at a time, as
    generation leaves it: its ChunkedKVCache layers keep keys 51..59 (start_position 51;
    chunks of 8: 48..55, 56..63). Returns (model, path, prompt, cache, queries diverging
    at each of _CHUNK_QUERIES)."""
    from tools.testing.model_builds import load_model, model_path
    from tools.testing.oracle import make_cache, prefill

    model, _ = load_model("tiny-llama4")
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(3, 256, 60)]
    cache = make_cache(model)
    prefill(model, prompt[:57], cache)
    for t in prompt[57:]:
        prefill(model, [t], cache)
    assert [getattr(c, "start_position", 51) for c in cache] == [51] * 4
    queries = {k: prompt[:d] + [(t + 1) % 256 for t in prompt[d : d + 10]] for k, d in _CHUNK_QUERIES.items()}
    return model, str(model_path("tiny-llama4")), prompt, cache, queries


def test_chunked_cut_only_where_a_cold_prefill_agrees_from_disk(tmp_path):
    """Regression (issue 26): an entry of a ChunkedKVCache model was cut back into the
    attention chunk of its start_position (keys of that chunk gone: wrong generation), and a
    cut before start_position was taken for damage and deleted the valid entry. A new
    process restores for queries diverging at and after a chunk start (identical to a cold
    prefill), inside the start's chunk and before the start (a miss); the entry is kept."""
    from tests.support.children import run_py

    _model, path, prompt, cache, queries = _llama4_entry()
    from kvstore import KVStore

    with KVStore(tmp_path, chunk_tokens=16) as s:
        s.insert(path, prompt, cache)
        assert s.flush(60)
    got = run_py(_CHUNK_CHILD, {"dir": str(tmp_path), "queries": queries}, timeout=600)
    assert got["in_chunk_after_start"] == {"n": 58, "source": "disk", "ok": True, "corrupt": 0, "entries": 1}, got
    assert got["at_chunk_start"] == {"n": 56, "source": "disk", "ok": True, "corrupt": 0, "entries": 1}, got
    for name in ("in_chunk_of_start", "before_start"):
        assert got[name] == {"n": 0, "source": None, "corrupt": 0, "entries": 1}, got


def test_chunked_cut_only_where_a_cold_prefill_agrees_in_memory():
    """The memory tier refuses the same cuts (mlx-lm's own LRU hands them out) and serves
    the allowed ones identically to a cold prefill."""
    from kvstore import KVStore
    from tools.testing.oracle import check_restore

    model, path, prompt, cache, queries = _llama4_entry()
    with KVStore(memory_only=True) as s:
        s.insert(path, prompt, cache)
        for name, q in queries.items():
            f = s.fetch(path, q)
            if _CHUNK_QUERIES[name] >= 56:
                assert f.n == _CHUNK_QUERIES[name] and f.source == "memory", (name, f.n)
                assert check_restore(model, q, f.cache, f.n, n_gen=8).ok, name
            else:
                assert f.cache is None and f.n == 0, (name, f.n)


def test_generic_state_codec_round_trips_protocol_classes():
    """A cache class without a codec of its own that follows mlx-lm's protocol
    (``_BaseCache``, ``state`` of arrays and scalars, ``from_state``) is stored as one
    snapshot by the generic codec: same class, same contents, extended alike; it is
    never cut, and a stored layout naming anything but an imported mlx-lm cache class is
    refused before anything is built."""
    c = ConcatenateKVCache()
    feed(c, 12)
    tensors, layout = codec.encode_cache([c])
    assert layout.to_json() == [{"class": "State", "type": "mlx_lm.models.cache:ConcatenateKVCache", "items": [["a"], ["a"]]}]
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    (back,) = codec.decode_cache(tensors, layout)
    assert type(back) is ConcatenateKVCache and back.offset == 12
    assert np.array_equal(np.array(back.keys), np.array(c.keys))
    k, v = rand(1), rand(1)
    a, b = c.update_and_fetch(k, v), back.update_and_fetch(k, v)
    assert np.array_equal(np.array(a[0]), np.array(b[0])) and back.offset == 13 == c.offset
    assert not layout.can_cut(11) and not layout.trimmable
    for bad in ({"type": "os:system", "items": []}, {"type": "mlx_lm.models.cache:X", "items": [["q"]]},
                {"type": "mlx_lm.models.cache:X", "items": [["i", "1"]]}):
        with pytest.raises(ValueError):
            Layout.from_json([{"class": "State", **bad}])
    for name in ("mlx_lm.models.cache:KVCache", "mlx_lm.models.nosuch:Cache", "mlx_lm.models.cache:make_prompt_cache"):
        with pytest.raises(codec.Unsupported):  # a class with a codec of its own, none, not a class
            codec.decode_cache({}, Layout.of([{"class": "State", "type": name, "items": []}]))


def test_chunked_refused_cut_falls_back_to_a_shorter_entry(tmp_path):
    """A cut the stored layout refuses passes that entry over: the next plan serves a
    shorter stored prefix (here a snapshot of 48 tokens) instead of missing."""
    from kvstore import KVStore
    from tools.testing.oracle import check_restore, prefill

    model, path, prompt, cache, queries = _llama4_entry()
    with KVStore(tmp_path, chunk_tokens=16) as s:
        s.insert(path, prompt, cache)
        s.insert(path, prompt[:48], prefill(model, prompt[:48], chunk=7), cache_type="user")
        assert s.flush(60)
    with KVStore(tmp_path, chunk_tokens=16) as s:
        q = queries["in_chunk_of_start"]
        f = s.fetch(path, q)
        assert (f.n, f.source) == (48, "disk") and s.stats()["refused_cuts"] == 1
        assert check_restore(model, q, f.cache, f.n, n_gen=8).ok
        assert s.stats()["corrupt"] == 0 and s.stats()["disk_entries"] == 2
