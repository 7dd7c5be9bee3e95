"""The fault harness's CI subset: ``python -m tools.harness.faults --ci``, one test per fault kind.

Each kind runs a few trials of what the full harness runs hundreds of (kill -9 mid-write,
damaged segments, pack files and index, a full tmpfs, unusable directories, 4 processes x
4 threads, bad calls, hostile directories: crafted records, planted symlinks and FIFOs,
swapped weights, foreign owners, skewed clocks; two machines on a Redis, or a 3-node
cluster, killed, paused, restarted and damaged under them) and must end with no wrong
restore, no exception reaching a caller, no crashed process, no committed entry lost,
every miss explained by ``verify`` and ``verify --fix`` leaving a clean directory,
nothing outside the cache directory changed and no hang. The figures of a full run are in
``tools/harness/faults/results/``.

Mounting a tmpfs and dropping to ``nobody`` need root; without it those cases are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import pytest

from tools.harness import faults

MUST_BE_ZERO = ("wrong_restores", "escaped_exceptions", "crashes", "entries_lost", "unexplained_misses",
                "verify_unclean", "failed_cases")


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A work directory outside pytest's base temp: the permissions kind opens its parents
    to other uids (``searchable_by_others``), and any pytest session started meanwhile on
    this machine sets ``/tmp/pytest-of-<user>`` back to 0700 under it."""
    d = Path(tempfile.mkdtemp(prefix="kvstore-faults-"))
    try:
        yield d
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(d)], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", faults.KINDS)
def test_faults_ci(kind: str, work_dir: Path) -> None:
    if kind == "full_disk" and os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    out = faults.run("ci", only=(kind,), work=work_dir / kind)
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
    from tests.support.caches import synth_kv_cache

    from kvstore import KVStore
    from kvstore.identity import Identity
    from kvstore.model_layout import layout_of

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


def _damage_free_list(cache_dir: Path) -> None:
    """Flip a bit in the page number of the root page of LMDB's free-page list (the
    tree LMDB keeps in its meta page besides the named databases): what the corruption
    kind's case lmdb-7 hit by chance on the old format."""
    import struct

    from kvstore.index.pages import page_size

    data = cache_dir / "index" / "data.mdb"
    psize = page_size(data)
    raw = data.read_bytes()
    metas = sorted((int.from_bytes(raw[m * psize + 144 : m * psize + 152], "little"),
                    struct.unpack_from("<IHHQQQQQ", raw, m * psize + 40)) for m in (0, 1))
    root = metas[-1][1][7]
    assert root != (1 << 64) - 1, "the free-page list is empty: nothing to damage"
    with open(data, "r+b") as f:
        f.seek(root * psize + 6)
        b = f.read(1)
        f.seek(root * psize + 6)
        f.write(bytes([b[0] ^ 0x10]))


def _store_with_free_list(cache_dir: Path) -> tuple:
    """A store whose evictions left pages on LMDB's free-page list: (identity, prompts)."""
    from tests.support.caches import synth_kv_cache

    from kvstore import KVStore
    from kvstore.identity import Identity
    from kvstore.model_layout import layout_of

    ident = Identity.from_components({"test": "free-list", "layout": layout_of(synth_kv_cache(2, 2, 1, 8))},
                                     name="free-list")
    prompts = [[(7 * i + j) % 200 for j in range(70)] for i in range(40)]
    with KVStore(cache_dir, chunk_tokens=32, max_disk_bytes=200_000) as s:
        for i, toks in enumerate(prompts):
            s.insert(ident, toks, synth_kv_cache(2, 2, 70, 8, seed=i))
            s.flush()
    return ident, prompts


def test_damaged_free_page_list_is_found_and_repaired(tmp_path: Path) -> None:
    """The intermittent "lmdb-7: 17 entries not served after verify --fix" of the old
    format: a damaged page of LMDB's free-page list is read by no lookup and no scan,
    only by the next write, which fails with MDB_CORRUPTED and turns the disk tier off
    for the process. ``verify`` walked the named databases only, so it said the index
    was clean and ``verify --fix`` repaired nothing: after it, every entry missed again
    from the first write on. ``verify`` must report it and ``--fix`` rebuild the index,
    after which a new process serves every entry and keeps writing."""
    import subprocess
    import sys

    from tests.support.caches import synth_kv_cache

    from kvstore import KVStore

    ident, prompts = _store_with_free_list(tmp_path)
    _damage_free_list(tmp_path)
    cli = [sys.executable, "-m", "kvstore.cli", "verify", "--cache-dir", str(tmp_path)]
    found = subprocess.run(cli, capture_output=True, text=True)
    assert found.returncode == 1 and "corrupt_index" in found.stdout, found.stdout + found.stderr
    fixed = subprocess.run(cli + ["--fix"], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    with KVStore(tmp_path, chunk_tokens=32) as s:
        served = sum(s.fetch(ident, t).n == len(t) for t in prompts)
        s.insert(ident, list(range(300, 370)), synth_kv_cache(2, 2, 70, 8))
        s.flush()
        st = s.stats()
    assert served > 0 and "disk_off" not in st and st["write_errors"] == 0, (served, st)
    assert subprocess.run(cli, capture_output=True).returncode == 0


def test_damaged_free_page_list_met_by_a_store_is_reported_and_salvaged(tmp_path: Path) -> None:
    """The same damage met by a running store rather than by verify: the open's write
    probes need not touch the damaged page, and after a few writes it may sit where no
    page walk reaches it while every write still fails. The store that meets it (its
    disk tier goes off, memory keeps serving) marks the index: ``verify`` then reports
    it (as its log message promises), and the next writable open salvages the index,
    so a new process serves the entries and keeps writing."""
    import subprocess
    import sys

    from tests.support.caches import synth_kv_cache

    from kvstore import KVStore

    ident, prompts = _store_with_free_list(tmp_path)
    _damage_free_list(tmp_path)

    def use(writes: int = 1) -> dict:
        """Serve every prompt, then write up to ``writes`` new entries, stopping at the first
        that meets the damage: which commit reads the damaged page is LMDB's choice of pages
        (seen once under load: the first new entry's commit did not read it)."""
        with KVStore(tmp_path, chunk_tokens=32) as s:
            served = sum(s.fetch(ident, t).n == len(t) for t in prompts)
            for i in range(writes):
                s.insert(ident, list(range(300 + 100 * i, 370 + 100 * i)), synth_kv_cache(2, 2, 70, 8, seed=i))
                s.flush()
                if "disk_off" in s.stats():
                    break
            return dict(s.stats(), served=served)

    first = use(writes=20)
    assert first["served"] > 0 and "disk_off" in first, first  # met at a write: memory keeps serving
    cli = [sys.executable, "-m", "kvstore.cli", "verify", "--cache-dir", str(tmp_path)]
    found = subprocess.run(cli, capture_output=True, text=True)
    assert found.returncode == 1 and "corrupt_index" in found.stdout, found.stdout + found.stderr
    second = use()
    assert second["served"] > 0 and "disk_off" not in second and second["write_errors"] == 0, second
    assert subprocess.run(cli, capture_output=True).returncode == 0


def test_crash_damage_excuses_every_entry_it_can_cost(tmp_path: Path) -> None:
    """Found by the crash kind (entries_lost 2 of 240 trials, cli_verify phase): its
    damage step truncated a pack, then picked a segment of the same pack that was now
    past the end of the file and flipped a byte there: IndexError, the worker ended with
    a harness error nobody read, and the excuses of the damage already done were never
    sent, so the entries of the truncated or deleted packs counted as lost. Every step of
    ``damage_segments`` must run, and every entry a real store no longer serves in full
    afterwards must have been excused."""
    import random
    import shutil

    from tests.support.caches import synth_kv_cache

    from kvstore import KVStore
    from kvstore.identity import Identity
    from kvstore.model_layout import layout_of
    from tools.harness.faults.check import raw_entries, segment_users
    from tools.harness.faults.common import decode
    from tools.harness.faults.damage import damage_segments

    ident = Identity.from_components({"test": "crash-damage", "layout": layout_of(synth_kv_cache(2, 2, 1, 8))},
                                     name="crash-damage")
    base = [(5 * j) % 200 for j in range(40)]
    prompts = [base + [(11 * i + j) % 200 for j in range(20 + 13 * i)] for i in range(6)]
    src = tmp_path / "src"
    with KVStore(src, chunk_tokens=32) as s:
        for i, toks in enumerate(prompts):
            s.insert(ident, toks, synth_kv_cache(2, 2, len(toks), 8, seed=i))
            s.flush()
    for seed in range(40):
        d = tmp_path / f"d{seed}"
        shutil.copytree(src, d)
        excused: set[str] = set()
        with KVStore(d, chunk_tokens=32) as s:
            segs = segment_users(s)
            assert len({x["pack"] for x in segs}) == len(prompts)
            damage_segments(d, segs, 5, random.Random(seed), excused.update)
        with KVStore(d, chunk_tokens=32) as s:
            entries = [(k.hex(), decode(toks)) for k, rec, toks in raw_entries(s)]
            lost = [k for k, toks in entries if s.fetch(ident, toks).n != len(toks) and k not in excused]
        assert not lost, f"seed {seed}: {lost} lost, not excused"
        shutil.rmtree(d)
