"""kvstore.memory.snapshot: what the memory tier keeps of a prompt cache, how it is taken, cut
and handed out, on real mlx-lm cache objects (in this process: no model, no server)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from kvstore import codec
from kvstore.memory.snapshot import ORDERING, Snapshot, check, check_cache, take
from tests.support.caches import synth


class Foreign:
    """A cache class kvstore does not know: kept as given (opaque), mlx-lm's rules."""

    def __init__(self, trimmable: bool, nbytes: int = 100) -> None:
        self.keys = mx.arange(6, dtype=mx.float32)
        self.nbytes, self._trimmable = nbytes, trimmable

    @property
    def state(self) -> list:
        return [self.keys]

    def is_trimmable(self) -> bool:
        return self._trimmable


def values(cache: list) -> list[list]:
    return [np.array(a).tolist() for c in cache for a in codec.layer_arrays(c)]


def test_take_encodes_the_cache_and_schedules_its_arrays() -> None:
    cache = synth(list(range(10)))
    snap, covered, why = take(cache, 10, "user")
    assert (covered, why, snap.cache_type, snap.opaque, snap.persisted, snap.disk_key) == (10, None, "user", None,
                                                                                          False, None)
    assert snap.layout is not None and snap.layout.length == 10 and snap.trimmable
    assert snap.tensors is not None and len(snap.scheduled) == len(snap.tensors) == 4
    assert snap.nbytes == sum(c.nbytes for c in cache) == codec.cache_nbytes(snap.tensors)
    snap.ready()
    assert snap.scheduled == []
    snap.ready()  # again: nothing to wait for
    assert snap.scheduled == []


def test_nbytes_counts_the_buffers_the_views_keep_alive() -> None:
    """A cache grown by mlx-lm's update_and_fetch holds a buffer of 256 positions for 3
    tokens: the snapshot's views pin all of it, and that is what it counts."""
    c = KVCache()
    k = mx.ones((1, 1, 3, 4))
    c.update_and_fetch(k, k)
    snap, covered, _ = take([c], 3, "assistant")
    assert covered == 3 and snap.nbytes == c.nbytes == 2 * 256 * 4 * 4 > codec.cache_nbytes(snap.tensors or {})


def test_a_cache_of_recurrent_state_alone_covers_the_tokens_given() -> None:
    a = ArraysCache(1)
    a[0] = mx.array([[1.0, 2.0]])
    snap, covered, why = take([a], 7, "system")
    assert covered == 7 and why is None and snap.layout is not None and snap.layout.length is None
    assert not snap.trimmable and snap.cut_to(7, 7) and snap.cut_to(7, 9) and not snap.cut_to(7, 6)


def test_a_cache_with_fewer_positions_than_tokens_covers_what_it_holds() -> None:
    snap, covered, _ = take(synth(list(range(10))), 12, "assistant")
    assert covered == 10
    assert snap.cut_to(12, 12) and snap.cut_to(12, 5) and snap.cut_to(12, 2)  # cut by 10 at most: down to 0
    assert not snap.cut_to(12, 1)  # a cut past its first position


def test_a_cache_only_valid_at_its_length_is_never_cut() -> None:
    snap, _, _ = take(synth(list(range(10)), snapshot=True), 10, "assistant")
    assert not snap.trimmable and snap.cut_to(10, 10) and snap.cut_to(10, 11) and not snap.cut_to(10, 9)


def test_take_refuses_a_cache_longer_than_its_tokens_or_whose_layers_disagree() -> None:
    with pytest.raises(ValueError, match="cache holds 10 positions but only 9 tokens were given"):
        take(synth(list(range(10))), 9, "assistant")
    mixed = synth(list(range(10)))[:1] + synth(list(range(8)))[:1]
    with pytest.raises(ValueError, match=r"cache layers disagree on their length: \[8, 10\]"):
        take(mixed, 10, "assistant")


@pytest.mark.parametrize("trimmable", [True, False])
def test_a_cache_kvstore_cannot_encode_is_kept_as_given_and_copied_on_hit(trimmable: bool) -> None:
    cache = [Foreign(trimmable), Foreign(True, nbytes=50)]
    snap, covered, why = take(cache, 6, "user")
    assert snap.opaque is cache and snap.tensors is None and snap.layout is None and covered == 0
    assert why is not None and "Foreign" in why and snap.nbytes == 150 and snap.cache_type == "user"
    assert snap.trimmable is trimmable and snap.cut_to(6, 3) is trimmable and snap.cut_to(6, 6) is trimmable
    # waited on through arrays of its own (the host's arrays are the host's: device tier, hazard c)
    assert len(snap.scheduled) == 2 and all(a is not h for a in snap.scheduled for h in (c.keys for c in cache))
    got = snap.materialize()
    assert snap.scheduled == [] and len(got) == 2 and got[0] is not cache[0] and got[0].keys is not cache[0].keys
    assert values(got) == values(cache)
    got[0].keys = mx.zeros(6)
    assert np.array(snap.materialize()[0].keys).tolist() == list(range(6))


def test_materialize_hands_out_fresh_caches_that_never_change_the_snapshot() -> None:
    cache = synth(list(range(10)))
    before = values(cache)
    snap, _, _ = take(cache, 10, "assistant")
    got = snap.materialize()
    assert [type(c) for c in got] == [KVCache, KVCache] and [c.offset for c in got] == [10, 10]
    assert values(got) == before
    for c in got:
        c.update_and_fetch(mx.full((1, 1, 2, 4), 7.0), mx.full((1, 1, 2, 4), 7.0))
        c.keys[..., :3, :] = -1.0
    again = snap.materialize()
    assert [c.offset for c in again] == [10, 10] and values(again) == before


def test_kept_wraps_a_restore_as_on_disk_already() -> None:
    tensors, layout = codec.encode_cache(synth(list(range(6))))
    snap = Snapshot.kept(tensors, layout, "system", b"key")
    assert (snap.persisted, snap.disk_key, snap.cache_type, snap.opaque, snap.scheduled) == (True, b"key", "system",
                                                                                             None, [])
    assert snap.tensors is tensors and snap.layout is layout and snap.trimmable and snap.nbytes == codec.cache_nbytes(tensors)
    assert Snapshot.kept(tensors, layout, "tool", None).cache_type == "assistant"  # unknown: files as assistant
    assert [Snapshot.kept(tensors, layout, t, None).cache_type for t in ORDERING] == list(ORDERING)
    kept_never = Snapshot.kept(*codec.encode_cache(synth(list(range(6)), snapshot=True)), "user", None)
    assert not kept_never.trimmable
    a, b = mx.ones(2), mx.zeros(2)
    snap.schedule([a])
    snap.schedule([b])
    assert len(snap.scheduled) == 2 and snap.scheduled[0] is a and snap.scheduled[1] is b
    snap.ready()
    assert snap.scheduled == [] and len(snap.materialize()) == 2


def test_check_names_what_is_wrong_with_a_cache_or_its_type() -> None:
    good = synth(list(range(4)))
    for t in ORDERING:
        check(good, t)
    with pytest.raises(ValueError, match=r"cache_type must be one of \['assistant', 'user', 'system'\], got 'tool'"):
        check(good, "tool")
    with pytest.raises(ValueError, match=r"got list \(empty\)"):
        check_cache([])
    with pytest.raises(ValueError, match=r"one per layer\), got dict$"):
        check_cache({"a": 1})
    with pytest.raises(ValueError, match=r"got tuple \(empty\)"):
        check_cache(())
    for bad, name in ((3, "int"), ("kv", "str"), (b"kv", "bytes"), (object(), "object")):
        with pytest.raises(ValueError, match=f"cache layer 1 is a {name}, not a cache object"):
            check_cache([good[0], bad])
    check_cache((good[0], Foreign(True)))  # a tuple, and a class of its own with a state: accepted
    short = KVCache()
    short.keys, short.values, short.offset = good[0].keys, good[0].values, 9
    with pytest.raises(ValueError, match="cache layer 0 .*claims 9 positions but its arrays hold 4"):
        check([short], "user")


class StateOnly:
    """A foreign layer with a class-level ``state`` and nothing else: no nbytes, no is_trimmable."""

    state = property(lambda self: [])


class BytesOnly:
    """A foreign layer with ``nbytes`` alone."""

    nbytes = 8


def test_a_foreign_layer_without_sizes_or_trim_rules_counts_nothing_and_is_not_trimmable() -> None:
    check_cache([StateOnly()])  # either mark of a cache object is enough
    check_cache([BytesOnly()])
    snap, covered, why = take([StateOnly(), Foreign(True)], 4, "user")
    assert snap.opaque is not None and snap.nbytes == 100 and not snap.trimmable and covered == 0 and why
    snap, _, _ = take([Foreign(True), BytesOnly()], 4, "user")
    assert snap.nbytes == 108 and not snap.trimmable  # BytesOnly has no is_trimmable: mlx-lm's rule says no
    odd = {Foreign(True)}  # not a list at all: nothing counted
    snap, _, _ = take(odd, 4, "user")  # type: ignore[arg-type]
    assert snap.opaque is odd and snap.nbytes == 0
