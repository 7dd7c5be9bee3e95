"""The device tier (issue 55): kvstore's MLX paths on every MLX device present.

``pytest -m device``. Every test runs once per device MLX has here: the CPU backend always,
the GPU where ``mx.is_available(mx.gpu)`` (Metal, or CUDA with ``mlx-cuda-13``), with that
device as this thread's default for the test and the previous default restored after.
Tiny seeded models of each cache family (``tests.support.models.TINY_FAMILIES``: KVCache,
QuantizedKVCache, RotatingKVCache + KVCache, ArraysCache + KVCache, CacheList).

What is checked, bit for bit against a cold prefill (``tools.testing.oracle`` in exact mode:
the same greedy tokens and bit-identical log-probs, and the same KV arrays,
``tests.support.stores.cache_digest``):
- a restore from memory and from disk onto the default device;
- a host that keeps generating with the cache it inserted (mlx-lm's server does) changes
  neither what is stored nor what a hit hands out (hazard c), also for a host that writes
  its recurrent state in place; and no array kvstore keeps, schedules or waits on is one of
  the host's own arrays (a full slice returns the array itself), though it shares its memory;
- a snapshot taken by a generation thread whose stream still computes, on a stream of its
  own, read by the writer thread, while the host goes on generating on it; a memory hit
  used beside the writer's reads of the same snapshot (hazard a: the CUDA mechanism, a
  numpy view migrating the buffer, cannot happen on the CPU backend, the use pattern does);
- eviction and restore under the store's own memory budget (``max_bytes``) and under a
  device's memory reading (``pressure.Gauge``, hazard b);
- memory and disk hits are handed out evaluated: usable on a thread that never ran them,
  after the fetching thread released its streams;
- ``stats()`` on a thread that never releases its streams runs no MLX work there (hazard d);
- kvstore leaves the default device, default stream and MLX's limits as it found them.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

import tests.support.stores as U
from tests.support.caches import ident
from tests.support.models import TINY_FAMILIES
from tests.support.prompts import text_prompt
from kvstore import KVStore, codec, pressure, segments
from kvstore.hoststate import changes, snapshot
from kvstore.memory import MemoryTier, take
from tools.testing.model_builds import MODELS, model_path
from tools.testing.oracle import check_restore, cold_run, prefill

pytestmark = pytest.mark.device

DEVICES = [mx.Device(mx.cpu)] + ([mx.Device(mx.gpu)] if mx.is_available(mx.gpu) else [])
L, S, N_GEN = 100, 80, 6  # the prompt, the prefix stored, the tokens generated after it
C = U.CHUNK


@pytest.fixture(params=DEVICES, ids=lambda d: str(d.type).split(".")[-1])
def device(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The test's device, this thread's default while it runs; the previous one after."""
    prev = mx.default_device()
    mx.set_default_device(request.param)
    try:
        yield request.param
    finally:
        mx.set_default_device(prev)


_refs: dict[tuple[str, str], dict[str, Any]] = {}


def family_ref(load_named: Callable, family: str, device: Any, s: int = S) -> dict[str, Any]:
    """The family's model, prompt ``P`` (``s + 20`` tokens), a cold prefill of ``P[:s]`` (its
    digest) and the cold reference run split at ``s`` (exact mode), once per family, device
    and ``s``."""
    key = (family, str(device), s)
    if key not in _refs:
        model, tok = load_named(family)
        kv = MODELS[family].cache_kwargs
        P = text_prompt(tok, s + L - S, seed=sorted(MODELS).index(family))
        cold = prefill(model, P[:s], **kv)
        _refs[key] = dict(model=model, P=P, S=s, kv=kv, path=str(model_path(family)), digest=U.cache_digest(cold),
                          ref=cold_run(model, P, n_gen=N_GEN, split=s, **kv))
    return _refs[key]


def assert_parity(r: dict[str, Any], fetched: Any, tier: str) -> None:
    """``fetched`` holds ``P[:S]`` from ``tier``: its arrays are the cold prefill's bit for
    bit, and continuing from it gives the cold run's tokens and log-probs bit for bit."""
    assert (fetched.n, fetched.source) == (r["S"], tier), (fetched.n, fetched.source)
    assert U.cache_digest(fetched.cache) == r["digest"], f"{tier}: the KV arrays differ from a cold prefill"
    res = check_restore(r["model"], r["P"], fetched.cache, r["S"], n_gen=N_GEN, exact=True, reference=r["ref"],
                        **r["kv"])
    assert res.ok, f"{tier}: {res.detail}"


def generate_on(model: Any, cache: list[Any], n: int, first: int = 7) -> None:
    """What a host does after it inserted ``cache``: ``n`` greedy steps on it, each evaluated."""
    tok = first
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=cache)
        tok = int(mx.argmax(logits[0, -1]).item())


# -- restore onto the default device ----------------------------------------------------


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_restore_from_memory_and_disk_equals_a_cold_prefill(device: Any, family: str, load_named: Callable,
                                                            tmp_path: Path) -> None:
    r = family_ref(load_named, family, device)
    model, P = r["model"], r["P"]
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        store.insert(r["path"], P[:S], prefill(model, P[:S], **r["kv"]))
        assert_parity(r, store.fetch(r["path"], P), "memory")
        assert_parity(r, store.fetch(r["path"], P), "memory")  # the first hit's extension changed nothing
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        assert_parity(r, store.fetch(r["path"], P), "disk")
        assert_parity(r, store.fetch(r["path"], P), "memory")  # the disk hit, kept hot


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_restore_read_in_one_pass_equals_a_cold_prefill(device: Any, family: str, load_named: Callable,
                                                           tmp_path: Path) -> None:
    """What MLX's loader reads (``disk.whole``: an entry's whole copy, written at its second
    restore; a snapshot alone in its pack, at every restore) lands on the default device
    with the cold prefill's bits. The copy's size floor is lowered to this test's entry."""
    r = family_ref(load_named, family, device)
    model, P = r["model"], r["P"]
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        store.insert(r["path"], P[:S], prefill(model, P[:S], **r["kv"]))
    one_pass = []
    copy = {"whole_copy_min_bytes": 0}
    for _ in range(3):  # a restart each: the first use, the restore that writes the copy, the copy's
        with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"], **copy) as store:
            assert_parity(r, store.fetch(r["path"], P), "disk")
            assert store.flush(120)
            one_pass.append(store.stats()["restores_one_pass"])
    assert one_pass[-1] == 1, one_pass


# -- hazard c: the host keeps computing with the cache it inserted ------------------------


@pytest.mark.parametrize("own_copies", [False, True], ids=["views", "own-copies"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_host_generating_on_after_insert_changes_nothing_stored(device: Any, family: str, own_copies: bool,
                                                                  load_named: Callable, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm's server inserts the cache it generated with, and a host may go on with it:
    a snapshot's tensors are often the host's own arrays (a full slice is the same array;
    rotating and recurrent state are stored whole), and a KV write is a slice assignment
    into them. Neither the memory hit nor the disk entry may see what came after, whether
    the writer reads the shared buffers or copies of its own (``segments.own_copies``)."""
    monkeypatch.setattr(segments, "OWN_COPIES", own_copies)
    r = family_ref(load_named, family, device)
    model, P = r["model"], r["P"]
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        cache = prefill(model, P[:S], **r["kv"])
        store.insert(r["path"], P[:S], cache)
        generate_on(model, cache, 12)  # beside the writer's wait on, and write of, the same arrays
        assert_parity(r, store.fetch(r["path"], P), "memory")
        assert store.flush(60)
        generate_on(model, cache, 4)
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        assert_parity(r, store.fetch(r["path"], P), "disk")


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-llama-q"])
def test_a_host_generating_on_an_exactly_sized_cache_changes_nothing_stored(device: Any, family: str,
                                                                            load_named: Callable,
                                                                            tmp_path: Path) -> None:
    """A KVCache holding exactly what it allocated (256 positions, mlx-lm's step): the
    snapshot's slice is the whole array, the host's own, and the host's next step grows it.
    The memory hit, the disk entry and the restore kept hot (whose hit the oracle extends:
    exactly sized too) all stay a cold prefill's."""
    r = family_ref(load_named, family, device, s=256)
    model, P = r["model"], r["P"]
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        cache = prefill(model, P[:256], **r["kv"])
        keys = cache[0].keys if not isinstance(cache[0].keys, tuple) else cache[0].keys[0]
        assert keys.shape[-2] == cache[0].offset == 256
        store.insert(r["path"], P[:256], cache)
        generate_on(model, cache, 6)
        assert_parity(r, store.fetch(r["path"], P), "memory")
    with KVStore(tmp_path / "c", chunk_tokens=C, **r["kv"]) as store:
        assert_parity(r, store.fetch(r["path"], P), "disk")
        assert_parity(r, store.fetch(r["path"], P), "memory")


def _one_array(a: Any, b: Any) -> bool:
    """Whether two evaluated MLX arrays are one array (one C++ array: one event, one
    status), not two arrays on a buffer: MLX's graph export names each array once."""
    import io
    out = io.StringIO()
    mx.export_to_dot(out, a, b)
    return out.getvalue().count("rank=source") == 1


def test_every_array_kvstore_waits_on_is_its_own_not_the_hosts() -> None:
    """Hazard c, the mechanism: a full slice is the host's own array, and waiting on an
    array clears its event and status, which MLX does not synchronise, while the host's
    thread uses the same array in its next step. So no array a snapshot keeps, schedules
    or hands the writer is one of the host's (an exactly-sized KVCache, a rotating cache,
    recurrent state, a CacheList, an object kvstore cannot encode), though they share its
    memory (no copy is made)."""
    import numpy as np
    from mlx_lm.models.cache import CacheList, KVCache, RotatingKVCache

    def kv(n: int, seed: int) -> tuple[Any, Any]:
        k = mx.random.normal((1, 2, n, 8), key=mx.random.key(seed))
        return k, k + 1

    full, rot, rec = KVCache(), RotatingKVCache(max_size=32), ArraysCache(2)
    full.update_and_fetch(*kv(256, 1))  # mlx-lm's step is 256: the slice is the whole array
    rot.update_and_fetch(*kv(32, 2))
    rec[0], rec[1] = mx.ones((1, 8)), mx.zeros((1, 2, 4))

    class Opaque:  # no codec for it: kept as given
        def __init__(self) -> None:
            self.keys, self.values = kv(8, 3)
            self.nbytes = self.keys.nbytes * 2

    for cache, n in (([full], 256), ([rot], 32), ([rec], 5), ([CacheList(KVCache(), rec)], 5), ([Opaque()], 8)):
        if isinstance(cache[0], CacheList):
            cache[0].caches[0].update_and_fetch(*kv(5, 4))
        host = [a for c in cache for a in codec.layer_arrays(c)]
        mx.eval(host)
        snap, _, _ = take(cache, n, "assistant")
        waited = list(snap.scheduled)
        snap.ready()
        mine = waited + list((snap.tensors or {}).values())
        mine += [a for _, a in segments.host_views(snap.tensors).values()] if snap.tensors else []
        assert mine
        assert all(_one_array(h, h[...]) for h in host)  # the check tells one array from two (a control)
        for a in mine:
            for h in host:
                assert not _one_array(a, h), f"{type(cache[0]).__name__}: a snapshot array is the host's own"
        if snap.tensors is not None:  # and still the host's memory: nothing was copied
            assert any(np.shares_memory(np.asarray(a), np.asarray(h)) for a in snap.tensors.values() for h in host)


def test_a_host_writing_recurrent_state_in_place_changes_nothing_stored(device: Any, tmp_path: Path) -> None:
    """An ArraysCache's state arrays written in place after the insert (``state[...] = x``
    replaces what the Python array object is): the memory hit and the disk entry keep the
    state as inserted."""
    a, b = mx.arange(8, dtype=mx.float32).reshape(1, 8), mx.ones((1, 2, 4), dtype=mx.float32)
    layer = ArraysCache(2)
    layer[0], layer[1] = a + 0, b + 0
    model = ident("in-place")
    with KVStore(tmp_path / "c", chunk_tokens=C) as store:
        store.register("m", model)
        store.insert("m", [1, 2, 3], [layer])
        layer.cache[0][..., :] = -1.0  # in place, on the host's own objects
        layer.cache[1][0, 1] = 5.0
        mx.eval(layer.cache)
        got = store.fetch("m", [1, 2, 3, 4])
        assert got.n == 3 and got.source == "memory"
        assert mx.array_equal(got.cache[0].cache[0], a).item(), got.cache[0].cache[0]
        assert mx.array_equal(got.cache[0].cache[1], b).item(), got.cache[0].cache[1]
    with KVStore(tmp_path / "c", chunk_tokens=C) as store:
        store.register("m", model)
        got = store.fetch("m", [1, 2, 3, 4])
        assert got.n == 3 and got.source == "disk"
        assert mx.array_equal(got.cache[0].cache[0], a).item(), got.cache[0].cache[0]
        assert mx.array_equal(got.cache[0].cache[1], b).item(), got.cache[0].cache[1]


# -- threads: a snapshot of a stream still computing, read by the writer ----------------


def test_a_snapshot_of_a_computing_stream_is_read_by_the_writer_on_its_own(device: Any, load_named: Callable,
                                                                           tmp_path: Path) -> None:
    """A generation thread on a stream of its own (``mx.new_stream``) prefills without waiting
    (``mx.async_eval``), inserts the cache while that work may still run, and goes on
    generating on it; the writer thread waits for and writes the snapshot on its own
    stream; the generation thread ends releasing its streams. Then the disk entry and a
    memory hit fetched on a third thread equal a cold prefill bit for bit."""
    r = family_ref(load_named, "tiny-llama", device)
    model, P = r["model"], r["P"]
    errors: list[BaseException] = []
    store = KVStore(tmp_path / "c", chunk_tokens=C)

    def generation() -> None:
        try:
            mx.set_default_stream(mx.new_stream(device))
            cache = prefill(model, [], **r["kv"])  # a fresh cache
            logits = model(mx.array([P[:S]]), cache=cache)
            mx.async_eval(logits)  # the stream still computes: nothing waited for
            store.insert(r["path"], P[:S], cache)
            for _ in range(8):  # the next steps, queued behind, each scheduled only
                logits = model(mx.array([[int(P[S])]]), cache=cache)
                mx.async_eval(logits)
            mx.eval(logits)
        except BaseException as e:  # handed to the test's thread
            errors.append(e)
        finally:
            mx.clear_streams()

    t = threading.Thread(target=generation)
    t.start()
    t.join(120)
    assert not t.is_alive() and not errors, errors
    assert store.flush(60)
    got: dict[str, Any] = {}

    def reader() -> None:
        try:
            mx.set_default_stream(mx.new_stream(device))
            got["memory"] = store.fetch(r["path"], P)
        except BaseException as e:
            errors.append(e)
        finally:
            mx.clear_streams()

    t = threading.Thread(target=reader)
    t.start()
    t.join(120)
    assert not errors, errors
    store.close()
    assert_parity(r, got["memory"], "memory")  # used here, on a thread that never evaluated it
    with KVStore(tmp_path / "c", chunk_tokens=C) as again:
        assert_parity(r, again.fetch(r["path"], P), "disk")


def test_the_writers_host_views_are_copies_of_their_own_where_a_view_moves_the_buffer(device: Any) -> None:
    """Hazard a, what can be shown here: the writer's host (numpy) views of a snapshot are
    the very memory the memory hits and the host's cache use (``copy=False``, the CPU and
    Metal, where a view is free); with ``copy=True`` (``segments.own_copies``: a GPU with
    memory of its own, where the first view moves the buffer) they share nothing with it
    and hold the same bits, every stored dtype included."""
    import numpy as np

    base = mx.random.normal((1, 2, 16, 8), key=mx.random.key(3))
    tensors = {"f32": base[..., :10, :], "bf16": base.astype(mx.bfloat16)[..., :10, :],
               "f16": base.astype(mx.float16), "i8": (base * 20).astype(mx.int8), "b": base > 0}
    mx.eval(tensors)

    def host(a: Any) -> Any:
        return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)

    shared = segments.host_views(tensors)
    own = segments.host_views(tensors, copy=True)
    for name, a in tensors.items():
        assert np.shares_memory(host(shared[name][1]), host(a)), name
        assert not np.shares_memory(host(own[name][1]), host(a)), name
        assert own[name][0] == shared[name][0]
        assert host(own[name][1]).tobytes() == host(a).tobytes(), name
    assert segments.own_copies() == (mx.is_available(mx.gpu) and "free_memory" in mx.device_info(mx.gpu))


@pytest.mark.parametrize("own_copies", [False, True], ids=["views", "own-copies"])
def test_a_memory_hit_used_while_the_writer_reads_the_same_snapshot(device: Any, own_copies: bool,
                                                                    load_named: Callable, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard a: the writer's host (numpy) views of a snapshot are read while a memory hit on
    the same snapshot is extended by the host. On CUDA the first numpy view migrates the
    buffer to managed memory (MLX's ``raw_ptr``); that mechanism does not exist on the CPU
    backend, so here the test shows the use pattern is right with the writer reading the
    shared buffers and with the copies a CUDA machine makes (``segments.own_copies``)."""
    monkeypatch.setattr(segments, "OWN_COPIES", own_copies)
    r = family_ref(load_named, "tiny-llama", device)
    model, P = r["model"], r["P"]
    with KVStore(tmp_path / "c", chunk_tokens=C) as store:
        for n in (S, S - 5, S - 10, S - 15):  # each insert's write runs while its hit is extended
            store.insert(r["path"], P[:n], prefill(model, P[:n]))
            hit = store.fetch(r["path"], P[: n + 1])
            assert (hit.n, hit.source) == (n, "memory")
            generate_on(model, hit.cache, 3)
        assert store.flush(60)
    with KVStore(tmp_path / "c", chunk_tokens=C) as again:
        assert_parity(r, again.fetch(r["path"], P), "disk")


# -- eviction and restore under a memory limit ------------------------------------------


def test_eviction_and_restore_under_the_stores_memory_budget(device: Any, load_named: Callable,
                                                             tmp_path: Path) -> None:
    """``max_bytes`` holds one entry: each insert evicts the one before (written first), and
    each fetch restores from disk, evicting the other; every restore is a cold prefill's."""
    refs = {f: family_ref(load_named, f, device) for f in ("tiny-llama", "tiny-gemma3")}
    caches = {f: prefill(r["model"], r["P"][:S]) for f, r in refs.items()}
    kept = sorted(codec.cache_nbytes(codec.encode_cache(c)[0]) for c in caches.values())  # a restored entry's size
    budget = kept[1] + kept[0] // 2  # holds one restored entry, never both
    with KVStore(tmp_path / "c", chunk_tokens=C, max_bytes=budget, memory_floor=None) as store:
        for f, r in refs.items():
            store.insert(r["path"], r["P"][:S], caches[f])
        assert store.flush(60)
        assert len(store.memory) <= 1
        for _ in range(2):
            for f, r in refs.items():
                got = store.fetch(r["path"], r["P"])
                assert got.source == "disk"
                assert_parity(r, got, "disk")
                assert len(store.memory) == 1
        s = store.stats()
        assert s["hits_disk"] == 4 and s["evictions_memory"] >= 4, s


def test_eviction_under_a_devices_own_memory(device: Any, load_named: Callable, tmp_path: Path) -> None:
    """Hazard b: on a GPU with memory of its own, the tier's byte budget follows the
    device's room too (``pressure.Gauge``): a device whose free memory holds one snapshot
    over its floor keeps one in memory, the others on disk, each restored bit for bit. The
    device here is a reading of one (this machine's host RAM is plenty)."""
    r = family_ref(load_named, "tiny-llama", device)
    model, P = r["model"], r["P"]
    caches = [prefill(model, P[: S - 10 * i]) for i in range(3)]
    one = int(sum(c.nbytes for c in caches[0]))
    floor = 1 << 20
    room = one + one // 2 + floor  # the device's memory for snapshots: one and a half of them

    def gpu() -> pressure.Reading:  # a device whose free memory is what the tier's snapshots leave
        return pressure.Reading(max(0, room - super(MemoryTier, tier).nbytes), 1 << 30)

    gauge = pressure.Gauge(floor, interval=0.0, device=gpu)
    written: list[Any] = []
    tier = MemoryTier(100, gauge=gauge, on_evict=written.extend)
    for i, cache in enumerate(caches):
        snap, _, _ = take(cache, S - 10 * i, "assistant")
        tier.put("m", P[: S - 10 * i], snap)
        tier.settle()
    assert len(tier) == 1 and len(written) == 2, (len(tier), len(written))
    assert tier.max_bytes < one * 2
    assert [len(tokens) for _, tokens, _ in written] == [S, S - 10]  # least recently used first
    with KVStore(tmp_path / "c", chunk_tokens=C, memory_floor=None) as store:  # where eviction writes them
        for _, tokens, snap in written:
            store.insert(r["path"], tokens, snap.materialize())
        assert store.flush(60)
    with KVStore(tmp_path / "c", chunk_tokens=C, memory_floor=None) as store:
        assert_parity(r, store.fetch(r["path"], P), "disk")


# -- hits are handed out evaluated ------------------------------------------------------


def test_hits_are_handed_out_evaluated(device: Any, load_named: Callable, tmp_path: Path) -> None:
    """Fetches on a thread that then releases its streams (``mx.clear_streams``, as kvstore's
    own threads do): anything left unevaluated on that thread's stream could not be
    evaluated anywhere else ("There is no Stream(cpu, N) in current thread"). A disk hit cut
    back from a longer entry (its tensors are fresh slices, made on the fetching thread) is
    used here, and so is the memory hit on the copy that restore keeps hot; both equal a
    cold prefill. (A memory hit's arrays are views of evaluated arrays: evaluated already.)"""
    r = family_ref(load_named, "tiny-llama", device)
    model, P = r["model"], r["P"]
    other = [t for t in P[:40] if t != P[S]][:10]
    longer = P[:S] + other  # leaves P at S, inside its last chunk

    def fetch_on_a_thread(store: KVStore) -> Any:
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                mx.set_default_stream(mx.new_stream(device))
                out["got"] = store.fetch(r["path"], P)
            except BaseException as e:
                out["error"] = e
            finally:
                mx.clear_streams()

        t = threading.Thread(target=run)
        t.start()
        t.join(120)
        assert "error" not in out, out
        return out["got"]

    with KVStore(tmp_path / "c", chunk_tokens=C) as store:
        store.insert(r["path"], longer, prefill(model, other, cache=prefill(model, P[:S])))
        assert_parity(r, fetch_on_a_thread(store), "memory")
    with KVStore(tmp_path / "c", chunk_tokens=C) as store:
        assert_parity(r, fetch_on_a_thread(store), "disk")
        assert_parity(r, store.fetch(r["path"], P), "memory")  # the restore kept hot, used here


# -- hazard d: stats() on threads that keep their streams ---------------------------------


def _next_stream_index(device: Any) -> int:
    """MLX numbers streams globally: the index a new stream gets now (it makes one)."""
    return int(re.findall(r"[0-9]+", str(mx.new_stream(device)))[-1])  # Stream(Device(cpu, 0), 7)


def test_stats_on_a_thread_that_keeps_its_streams_runs_no_mlx_work_there(device: Any, load_named: Callable,
                                                                         tmp_path: Path) -> None:
    """An HTTP thread of a server calls ``stats()`` and never releases MLX streams. With an
    insert pending (the writer held busy, so ``stats()`` is what files it) and an eviction
    due (``max_entries=1``), ``stats()`` files it and hands the evicted entry to the writer,
    but makes no MLX stream on its thread: it evaluated nothing there."""
    r = family_ref(load_named, "tiny-llama", device)
    model, P = r["model"], r["P"]
    with KVStore(tmp_path / "c", chunk_tokens=C, max_entries=1, memory_floor=None) as store:
        store.insert(r["path"], P[: S - 40], prefill(model, P[: S - 40]))
        assert store.flush(60)  # the writer's own stream made (its first MLX work) before counting
        assert store.writer is not None
        go = threading.Event()
        assert store.writer.submit(lambda: go.wait(60))  # the writer busy: the next inserts stay pending
        store.insert(r["path"], P[:S], prefill(model, P[:S]))  # drops P[:S-40] (it covers it); then
        # evicted by the next insert before it is written: stats() hands it to the writer
        store.insert(r["path"], P[: S - 20], prefill(model, P[: S - 20]))
        before = _next_stream_index(device)
        out: dict[str, Any] = {}
        try:
            t = threading.Thread(target=lambda: out.update(store.stats()))
            t.start()
            t.join(60)
            assert not t.is_alive()
            after = _next_stream_index(device)
        finally:
            go.set()
        assert store.flush(60)
        assert out["memory_entries"] == 1 and out["evictions_memory"] == 1, out  # P[:S], before its write
        assert after == before + 1, f"stats() made {after - before - 1} MLX stream(s) on its thread"
    with KVStore(tmp_path / "c", chunk_tokens=C) as again:
        assert_parity(r, again.fetch(r["path"], P), "disk")


# -- the host's state -------------------------------------------------------------------


def test_kvstore_leaves_the_default_device_stream_and_limits_as_it_found_them(device: Any, load_named: Callable,
                                                                              tmp_path: Path) -> None:
    r = family_ref(load_named, "tiny-llama", device)
    model, P = r["model"], r["P"]
    prev_stream = mx.default_stream(device)
    mine = mx.new_stream(device)
    mx.set_default_stream(mine)
    limits = (mx.get_memory_limit(), mx.set_cache_limit(1 << 30))
    try:
        before = snapshot()
        with KVStore(tmp_path / "c", chunk_tokens=C, max_bytes=1) as store:  # every insert evicted: writes
            store.insert(r["path"], P[:S], prefill(model, P[:S]))
            store.fetch(r["path"], P)
            store.stats()
            store.relieve_memory()
            store.flush(60)
        with KVStore(tmp_path / "c", chunk_tokens=C) as store:
            assert store.fetch(r["path"], P).source == "disk"
            store.preload(r["path"])
        diff = changes(before, snapshot())
        assert not diff, diff
        assert mx.default_device() == device and mx.default_stream(device) == mine
        assert mx.get_memory_limit() == limits[0]
    finally:
        mx.set_cache_limit(limits[1])
        mx.set_default_stream(prev_stream)
