"""The fault harness's CI subset: ``python -m tools.faults --ci``, one test per fault kind.

Each kind runs a few trials of what the full harness runs hundreds of (kill -9 mid-write,
damaged blobs and index, a full tmpfs, unusable directories, 4 processes x 4 threads, bad
calls) and must end with no wrong restore, no exception reaching a caller, no crashed
process, no committed entry lost, every miss explained by ``verify`` and ``verify --fix``
leaving a clean directory. The figures of a full run are in ``tools/faults_results/``.

Mounting a tmpfs and dropping to ``nobody`` need root; without it those cases are skipped.
"""

from __future__ import annotations

import json
import os

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
