"""The fault harness's CI subset: ``python -m tools.faults --ci``, one test per fault kind.

Each kind runs a few trials of what the full harness runs hundreds of (kill -9 mid-write,
damaged segments, pack files and index, a full tmpfs, unusable directories, 4 processes x
4 threads, bad calls, hostile directories: crafted records, planted symlinks and FIFOs,
swapped weights, foreign owners, skewed clocks) and must end with no wrong restore, no
exception reaching a caller, no crashed process, no committed entry lost, every miss
explained by ``verify`` and ``verify --fix`` leaving a clean directory, nothing outside
the cache directory changed and no hang. The figures of a full run are in
``tools/faults_results/``.

Mounting a tmpfs and dropping to ``nobody`` need root; without it those cases are skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest

from tools import faults

MUST_BE_ZERO = ("wrong_restores", "escaped_exceptions", "crashes", "entries_lost", "unexplained_misses",
                "verify_unclean", "failed_cases")


@pytest.mark.parametrize("kind", faults.KINDS)
def test_faults_ci(kind: str, tmp_path) -> None:
    if kind == "full_disk" and os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    out = faults.run("ci", only=(kind,), work=tmp_path / kind)
    k = out["kinds"][kind]
    assert not k.get("harness_error"), k["harness_error"]
    assert k["trials"] > 0, f"{kind}: no trial ran ({k.get('skipped')})"
    bad = {f: k[f] for f in MUST_BE_ZERO if k.get(f)}
    assert not bad, f"{kind}: {bad}\n" + json.dumps(k["failures"][:6], indent=1, default=str)[:6000]


def test_synthetic_caches_are_a_function_of_the_prefix() -> None:
    """The concurrency check's premise: a synthetic cache for a prefix equals the first
    positions of the cache of any longer prompt, bit for bit."""
    toks = list(range(40)) + [7] * 30
    long, short = faults.syn_cache("kv", toks), faults.syn_cache("kv", toks[:33])
    assert faults.syn_check("kv", toks, short, 33)[0]
    for a, b in zip(long, short):
        assert (a.keys[..., :33, :] == b.keys).all().item()
    other = faults.syn_cache("kv", toks[:32] + [8])
    assert not faults.syn_check("kv", toks, other, 33)[0]


def test_disk_hit_is_usable_from_another_thread(tmp_path: Path) -> None:
    """Found by the concurrency kind ("There is no Stream(cpu, N) in current thread"): a
    disk hit trimmed to a shorter prefix came back as unevaluated MLX ops bound to the
    fetching thread's stream, so the same cache handed to another thread, or its memory
    copy hit from another thread (a server's request threads), could not be evaluated."""
    import threading

    import numpy as np
    from store_util import synth_kv_cache

    from kvstore import KVStore
    from kvstore.identity import Identity, layout_of

    ident = Identity.from_components({"test": "threads", "layout": layout_of(synth_kv_cache(2, 2, 1, 8))},
                                     name="threads")
    toks = list(range(100))
    with KVStore(tmp_path, chunk_tokens=32) as s:
        s.insert(ident, toks, synth_kv_cache(2, 2, 100, 8, seed=3))
    query = toks[:70] + [300, 301]  # a prefix of the stored entry: its chunks, trimmed
    want = np.array(synth_kv_cache(2, 2, 100, 8, seed=3)[0].keys)[..., :70, :]
    got: dict = {}

    def in_thread(name: str, fn: Callable[[], object]) -> None:
        def run() -> None:
            try:
                got[name] = fn()
            except Exception as e:  # what the other thread's caller would have seen
                got[name] = repr(e)
        t = threading.Thread(target=run)
        t.start()
        t.join()

    with KVStore(tmp_path, chunk_tokens=32) as s:
        in_thread("disk", lambda: s.fetch(ident, query))
        assert got["disk"].source == "disk" and got["disk"].n == 70
        in_thread("handed_off", lambda: np.array(got["disk"].cache[0].keys))
        in_thread("memory", lambda: (s.fetch(ident, query).source, np.array(s.fetch(ident, query).cache[0].keys)))
    assert isinstance(got["handed_off"], np.ndarray), got["handed_off"]
    np.testing.assert_array_equal(got["handed_off"], want)
    assert not isinstance(got["memory"], str), got["memory"]
    assert got["memory"][0] == "memory"
    np.testing.assert_array_equal(got["memory"][1], want)
