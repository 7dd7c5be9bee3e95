"""``full_disk``: the cache directory on a 4 MiB tmpfs mounted by the harness, filled by a
filler file of random size and then by the store itself: serving continues from memory,
every failed write is counted in ``stats()["write_errors"]``, nothing half-written is
indexed, and writes resume once the filler is removed. Also: opening a store on a disk
that is already full, and where ``posix_fallocate`` is missing (macOS: the lock file's
fallback). And restores under a lowered RLIMIT_AS or RLIMIT_NOFILE (``_resource_trials``,
each in a process of its own): a hit or a miss that keeps the entry, never a drop.

Worker half: ``op_full_disk`` (``FullDiskTrial``) and ``op_open_full``. Parent half:
``run_full_disk`` mounts the tmpfs for each trial and judges what the worker reports."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..check import Tally, entry_key, raw_entries
from ..common import CHUNK, Emit, LogCapture, decode, exc_info, guard
from ..damage import fill, mount_tmpfs, umount
from ..synth import Zoo, cache_digest, random_prompt
from .permissions import open_modes

if TYPE_CHECKING:
    from ..context import Ctx


# ======================================================================= worker half


@contextlib.contextmanager
def _patched_kvstore(msg: dict, mnt: Path) -> Iterator[dict]:
    """kvstore as the trial needs it, restored afterwards: with ``small_map`` a 64 KiB
    first LMDB map (to reach MDB_MAP_FULL and the map growth path on the small disk);
    with ``fill_between`` the disk fills right after a pack file is sealed, before the
    index commit that names it, whenever the yielded ``armed["on"]`` is set (it disarms
    itself). These are fault injections at real points of kvstore's write path."""
    import kvstore.segments as ksegments
    import kvstore.index.core as kcore
    saved_map = kcore.INITIAL_MAP
    if msg.get("small_map"):
        kcore.INITIAL_MAP = 64 << 10
    real_seal = ksegments.PackWriter.seal
    armed = {"on": False}

    def seal_then_fill(self: Any) -> None:
        """The disk fills between the pack write and the index commit (the LMDB write fails)."""
        real_seal(self)
        if armed["on"]:
            armed["on"] = False
            fill(mnt / "filler2", 1 << 30)

    if msg.get("fill_between"):
        ksegments.PackWriter.seal = seal_then_fill  # type: ignore[method-assign]
    try:
        yield armed
    finally:
        kcore.INITIAL_MAP = saved_map
        ksegments.PackWriter.seal = real_seal  # type: ignore[method-assign]


class FullDiskTrial:
    """One store on the small disk and what was inserted into it (with the digest of
    each cache, to compare what comes back bit for bit)."""

    def __init__(self, zoo: Zoo, store: Any, rng: random.Random, res: dict, cap: LogCapture) -> None:
        self.zoo, self.store, self.rng, self.res, self.cap = zoo, store, rng, res, cap
        self.digests: dict[str, str] = {}   # entry key -> cache digest
        self.inserted: list[tuple[str, list[int], str]] = []

    def insert(self, toks: list[int], name: str) -> bool | None:
        """Insert and flush: True if the entry is on disk, False if not, None if an
        exception escaped. A failed write that ``write_errors`` did not count is counted
        in ``uncounted_failures``."""
        zoo, store, res = self.zoo, self.store, self.res
        cache = zoo.make_cache(name, toks)
        dg = cache_digest(cache)
        k = entry_key(store, zoo, name, toks)
        we, failed = store.stats()["write_errors"], self.writer_failed()
        n_esc = len(res["escaped"])
        guard("insert()", res["escaped"], store.insert, zoo.model_arg(name), toks, cache)
        guard("flush()", res["escaped"], store.flush)
        if len(res["escaped"]) != n_esc:
            return None
        self.inserted.append((name, toks, dg))
        self.digests[k] = dg
        ok = guard("index.entry()", res["escaped"], store.disk.index.entry, bytes.fromhex(k)) is not None
        if not ok and store.stats()["write_errors"] == we:
            res["uncounted_failures"] += 1
        res["writer_failed"] += self.writer_failed() - failed
        return ok

    def writer_failed(self) -> int:
        """Write jobs that raised inside the writer thread (it logs each one)."""
        return sum("background write failed" in r for r in self.cap.records)

    def fill_up(self, msg: dict, mnt: Path, armed: dict) -> None:
        """A few entries, then a filler leaving ``leave`` bytes, then inserts until four
        in a row fail (or ``max_inserts``)."""
        rng, res = self.rng, self.res
        for _ in range(msg.get("pre_entries", 0)):
            self.insert(random_prompt(rng, 30, 150), "llama")
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        res["filler"] = fill(mnt / "filler", max(0, free - msg["leave"]))
        fails = 0
        for i in range(msg.get("max_inserts", 60)):
            armed["on"] = bool(msg.get("fill_between")) and i == 0
            r = rng.random()  # small synthetic entries fill the last bytes (the index's own pages)
            name = "llama" if r < 0.55 else "gemma" if r < 0.7 else "syn-kv"
            ok = self.insert(random_prompt(rng, 30, 200), name)
            res["inserts"] += 1
            if ok:
                res["persisted"] += 1
                fails = 0
            else:
                res["failed_writes"] += 1
                fails += 1
                if fails >= 4:
                    break
        res["write_errors"] = self.store.stats()["write_errors"]

    def serve_from_memory(self) -> None:
        """Every insert is still a full, correct hit (``memory_misses`` otherwise)."""
        zoo, store, res = self.zoo, self.store, self.res
        for name, toks, dg in self.inserted:
            f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is None or f.n != len(toks) or f.cache is None:
                res["memory_misses"] += 1
            elif cache_digest(f.cache) != dg:
                ok, why = zoo.check(name, toks, f.cache, f.n)
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why})

    def verify_and_close(self) -> None:
        """Nothing half-written is indexed, and nothing is left behind (``verify_problems``)."""
        from kvstore import maintenance as mt
        store, res = self.store, self.res
        guard("stats()", res["escaped"], store.stats)
        try:
            probs = [p for p in mt.verify(store.disk, blob_age=0) if p.kind not in mt.NOT_OURS]
            res["verify_problems"] = dict(Counter(p.kind for p in probs))
            res["verify_detail"] = [f"{p.kind} {p.path} {p.detail}" for p in probs[:5]]
        except Exception as e:
            res["escaped"].append(exc_info("verify()", e))
        guard("close()", res["escaped"], store.close)

    def reopen(self, cdir: Path) -> None:
        """A fresh store serves every indexed entry in full from disk, bit-identical to
        what was inserted (``reopen_misses`` otherwise)."""
        from kvstore import KVStore
        zoo, res = self.zoo, self.res
        store = self.store = KVStore(cdir, chunk_tokens=CHUNK, max_entries=100_000)
        names = zoo.ident_map(store)
        for k, rec, toks in raw_entries(store):
            name = names.get(rec.identity.hex()) if rec is not None else None
            if name is None or toks is None:
                res["reopen_misses"] += 1  # a record the trial did not write
                continue
            tokens = decode(toks)
            f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), tokens)
            res["reopen_checked"] += 1
            if f is None or f.n != len(tokens) or f.source != "disk":
                res["reopen_misses"] += 1
            elif cache_digest(f.cache) != self.digests.get(k.hex()):
                res["wrong"].append({"key": k.hex(), "detail": "disk entry differs from what was inserted"})

    def resume(self, msg: dict, mnt: Path) -> None:
        """Space comes back (the fillers go): writing resumes (``resumed``)."""
        (mnt / "filler").unlink()
        with contextlib.suppress(FileNotFoundError):
            (mnt / "filler2").unlink()
        for i in range(msg.get("resume_inserts", 4)):
            ok = self.insert(random_prompt(self.rng, 30, 120), "llama")
            self.res["resumed" if ok else "resume_failures"] += 1


def op_full_disk(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """The cache directory on a small tmpfs (mounted by the parent) that fills up."""
    from kvstore import KVStore
    mnt = Path(msg["mnt"])
    res: dict[str, Any] = dict(escaped=[], wrong=[], inserts=0, persisted=0, failed_writes=0,
                               uncounted_failures=0, memory_misses=0, verify_problems={}, reopen_misses=0,
                               reopen_checked=0, resumed=0, resume_failures=0, writer_failed=0,
                               error_messages=[], map=msg.get("small_map", False))
    cap = LogCapture()
    with _patched_kvstore(msg, mnt) as armed, cap:
        trial = FullDiskTrial(zoo, KVStore(mnt / "cache", chunk_tokens=CHUNK, max_entries=100_000),
                              random.Random(msg["seed"]), res, cap)
        trial.fill_up(msg, mnt, armed)
        trial.serve_from_memory()
        trial.verify_and_close()
        trial.reopen(mnt / "cache")
        trial.resume(msg, mnt)
        store = trial.store
        res["stats"] = {k: v for k, v in (guard("stats()", res["escaped"], store.stats) or {}).items()
                        if k in ("write_errors", "writes", "dropped_writes", "disk_entries", "disk_bytes")}
        guard("close()", res["escaped"], store.close)
        res["error_messages"] = sorted({r for r in cap.records if "WARNING" in r or "ERROR" in r})[:8]
        res["map_grown"] = sum("map full" in r for r in cap.records)
        res["index_enospc"] = sum("mdb_txn_commit" in r for r in cap.records)
    return res


def op_open_full(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Open a store on a filesystem that is already full."""
    return open_modes(msg["dir"])


# ======================================================================= parent half

LEAVES = [0, 60 << 10, 200 << 10, 500 << 10, 1000 << 10, 1800 << 10, 2800 << 10]   # bytes the filler leaves


def run_full_disk(ctx: Ctx) -> dict:
    """``full_disk`` trials, each on its own tmpfs, then one open on a full disk."""
    t = Tally("full_disk")
    base = ctx.work / "fulldisk"
    n = ctx.size["full_disk"]
    for i in range(n + 1):
        mnt = base / f"m{i}"
        err = mount_tmpfs(mnt)
        if err:
            t.skipped.append(err)
            break
        rng = random.Random(f"{ctx.seed}-full-{i}")
        try:
            if i == n:
                _open_on_full_disk(ctx, t, mnt)
                continue
            msg = {"op": "full_disk", "mnt": str(mnt), "seed": rng.randrange(1 << 30),
                   "leave": LEAVES[i % len(LEAVES)] + rng.randrange(40 << 10), "pre_entries": rng.randint(0, 3),
                   "small_map": i % 3 == 2, "fill_between": i % 3 == 1, "max_inserts": 120}
            res = ctx.misc.call(msg, timeout=1200)
        finally:
            umount(mnt)
        _judge_full_disk(t, res, msg, {"trial": i, "leave": msg["leave"], "small_map": msg["small_map"]})
        t.c["trials"] += 1
        if not (res.get("crashed") or res.get("harness_error")):
            ctx.progress(t, i, n + 1)
    _lock_file_fallback_on_full_disk(t, base / "nofalloc")
    _resource_trials(ctx, t, base / "resources", max(len(RESOURCE_CASES), n))
    shutil.rmtree(base, ignore_errors=True)
    return t.result()


def _open_on_full_disk(ctx: Ctx, t: Tally, mnt: Path) -> None:
    """Open a store on a disk that is already full, the three ways: the memory tier serves."""
    fill(mnt / "filler", 8 << 20)
    res = ctx.misc.call({"op": "open_full", "dir": str(mnt / "cache")})
    t.c["trials"] += 1
    if res.get("crashed") or res.get("harness_error"):
        t.add_check(res, trial="open on a full disk")
        return
    t.info["open_on_full_disk"] = {m: {k: v for k, v in r.items() if k != "escaped"} for m, r in res.items()}
    for m, r in res.items():
        t.add_escaped(r.get("escaped", []), "escaped exception (open on a full disk)", mode=m)
        if m != "raise" and not r.get("served"):
            t.c["failed_cases"] += 1
            t.fail("open on a full disk: memory tier did not serve", mode=m, res=r)


def _full_disk_problems(res: dict) -> list[str]:
    """What went wrong in one trial, in words (empty: the trial passed)."""
    bad = []
    if res["failed_writes"] == 0:
        bad.append("the disk never filled")
    if res["uncounted_failures"]:
        bad.append(f"{res['uncounted_failures']} failed writes not counted in write_errors")
    if res["memory_misses"]:
        bad.append(f"{res['memory_misses']} inserts not served from memory")
    if res["verify_problems"]:
        bad.append(f"verify after the failures: {res['verify_problems']}")
    if res["reopen_misses"]:
        bad.append(f"{res['reopen_misses']} indexed entries not served after reopening")
    if res["resume_failures"]:
        bad.append(f"{res['resume_failures']} writes failed after space was freed")
    return bad


def _judge_full_disk(t: Tally, res: dict, msg: dict, ctx_info: dict) -> None:
    """Tally one trial: wrong restores, escaped exceptions, problems, outcomes, and a
    summary of the run in ``info["runs"]``."""
    if res.get("crashed") or res.get("harness_error"):
        t.add_check(res, **ctx_info)
        return
    t.add_wrong(res["wrong"], **ctx_info)
    t.add_escaped(res["escaped"], **ctx_info)
    bad = _full_disk_problems(res)
    if bad:
        t.c["failed_cases"] += 1
        t.fail("full disk: " + "; ".join(bad), **ctx_info,
               res={k: res.get(k) for k in ("inserts", "persisted", "failed_writes", "write_errors",
                                            "writer_failed", "uncounted_failures", "verify_detail",
                                            "error_messages", "stats")})
    t.outcomes["served_from_memory" if not res["memory_misses"] else "memory_misses"] += 1
    t.outcomes["writes_resumed" if res["resumed"] and not res["resume_failures"] else "writes_not_resumed"] += 1
    t.outcomes["failures_counted" if not res["uncounted_failures"] else "failures_uncounted"] += 1
    t.info.setdefault("runs", []).append({
        "leave_bytes": msg["leave"], "small_map": msg["small_map"], "fill_between": msg["fill_between"],
        "map_grown": res.get("map_grown"), "index_enospc": res.get("index_enospc"), "inserts": res["inserts"],
        "persisted": res["persisted"], "failed_writes": res["failed_writes"],
        "write_errors": res.get("write_errors"), "writer_failed": res["writer_failed"],
        "reopen_checked": res["reopen_checked"], "resumed": res["resumed"],
        "errors": res["error_messages"][:4]})


# ======================================================================= resource limits
#
# A restore that fails for the process's reasons (address space, threads, open files) is a
# miss that keeps the entry; with the limit lifted the same process serves it, exactly.
# Each trial is a child process (the limit is lowered there, with resource.setrlimit).

_RES_BUILD = r"""
import json, random, sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from kvstore import KVStore
from kvstore.identity import Identity
d, kind = sys.argv[1], sys.argv[2]
def cache(toks, heads, dim):  # keys hold each position's token id, values id + 0.5
    k = mx.broadcast_to(mx.array(toks, dtype=mx.float32)[None, None, :, None], (1, heads, len(toks), dim))
    c = KVCache()
    c.keys, c.values, c.offset = k + 0, k + 0.5, len(toks)
    return c
rng = random.Random(7)
who = Identity.from_components({"test": "resources", "kind": kind})
if kind == "big":  # 4 layers x 8 heads x 128 dims x 4096 tokens, float32: 128 MiB
    toks = [rng.randrange(1, 50000) for _ in range(4096)]
    with KVStore(d, chunk_tokens=1024) as s:
        s.insert(who, toks, [cache(toks, 8, 128) for _ in range(4)])
        assert s.flush()
else:  # a conversation of 300 turns: its last entry reads 300 pack files
    toks = [rng.randrange(1, 50000) for _ in range(300 * 16 + 5)]
    with KVStore(d, chunk_tokens=16) as s:
        for k in range(1, 301):
            s.insert(who, toks[: 16 * k + 5], [cache(toks[: 16 * k + 5], 1, 4)])
            assert s.flush()
print(json.dumps({"tokens": toks}))
"""

_RES_TRIAL = r"""
import json, logging, os, resource, sys
import mlx.core as mx
from kvstore import KVStore
from kvstore.identity import Identity
a = json.loads(sys.argv[1])
toks, who = a["tokens"], Identity.from_components({"test": "resources", "kind": a["kind"]})
logs = []
class Keep(logging.Handler):
    def emit(self, r):
        logs.append(r.getMessage()[:200])
logging.getLogger("kvstore").addHandler(Keep())
def exact(f):
    if f.cache is None:
        return True
    return all(mx.array_equal(c.keys[0, 0, : f.n, 0], mx.array(toks[: f.n], dtype=mx.float32)).item()
               and mx.array_equal(c.values[0, 0, : f.n, 0], mx.array(toks[: f.n], dtype=mx.float32) + 0.5).item()
               for c in f.cache)
with KVStore(a["dir"]) as s:
    assert s.disk.plan(who, toks) is not None
    from kvstore import alloc
    alloc.alloc({"x": ("F32", (4, 4))})  # MLX's loader pool started (MLX aborts if it cannot start it)
    if a["limit"] == "as":
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
        lim, at = resource.RLIMIT_AS, vm + (a["spare"] << 20)
    else:
        lim, at = resource.RLIMIT_NOFILE, len(os.listdir("/proc/self/fd")) + a["spare"]
    soft, hard = resource.getrlimit(lim)
    resource.setrlimit(lim, (at, hard))
    try:
        low = s.fetch(who, toks)
        low_exact = exact(low)
    finally:
        resource.setrlimit(lim, (soft, hard))
    st = s.stats()
    s.memory.clear()
    again = s.fetch(who, toks)
    print(json.dumps({"low": [low.n, low.source], "low_exact": low_exact, "again": [again.n, again.source],
                      "again_exact": exact(again), "corrupt": st["corrupt"], "io_errors": st["io_errors"],
                      "entries": st["disk_entries"], "logs": logs[:4]}))
"""

# (limit, spare MiB or descriptors, entry): each one fails the restore a different way, or not at all
RESOURCE_CASES = (("as", 16, "big"), ("as", 48, "big"), ("as", 100, "big"), ("as", 1024, "big"),
                  ("nofile", 100, "turns"), ("nofile", 40, "turns"), ("nofile", 3, "turns"))


def _resource_trials(ctx: Ctx, t: Tally, base: Path, n: int) -> None:
    """A restore under a lowered RLIMIT_AS (a 128 MiB entry) or RLIMIT_NOFILE (an entry
    spanning 300 packs), each in its own process: served in full and exactly, or a miss
    that drops nothing (``corrupt`` 0, the entry still indexed) and is served in full
    once the limit is lifted. A signal kills the trial: a crash."""
    import json
    import subprocess
    import sys

    built: dict[str, list[int]] = {}
    for kind in ("big", "turns"):
        d = base / kind
        p = subprocess.run([sys.executable, "-c", _RES_BUILD, str(d), kind], capture_output=True, text=True, timeout=1200)
        if p.returncode != 0:
            t.fail("harness error", trial=f"resources build {kind}", error=p.stderr[-600:])
            return
        built[kind] = json.loads(p.stdout.strip().splitlines()[-1])["tokens"]
    for i in range(n):
        limit, spare, kind = RESOURCE_CASES[i % len(RESOURCE_CASES)]
        info = {"trial": f"resources-{i}", "limit": limit, "spare": spare}
        case = base / f"case-{i}"  # a copy each: what one trial does to the entry stays there
        shutil.copytree(base / kind, case)
        arg = json.dumps({"dir": str(case), "kind": kind, "tokens": built[kind], "limit": limit, "spare": spare})
        try:
            p = subprocess.run([sys.executable, "-c", _RES_TRIAL, arg], capture_output=True, text=True, timeout=1200)
        finally:
            shutil.rmtree(case, ignore_errors=True)
        t.c["trials"] += 1
        if p.returncode != 0:
            t.c["crashes" if p.returncode < 0 else "failed_cases"] += 1
            t.fail("restore under a resource limit: the process died" if p.returncode < 0 else "harness error",
                   **info, returncode=p.returncode, stderr=p.stderr[-800:])
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        whole = len(built[kind])
        if not (r["low_exact"] and r["again_exact"]):
            t.c["wrong_restores"] += 1
            t.fail("restore under a resource limit: wrong content", **info, res=r)
        if r["corrupt"] or r["entries"] < 1:
            t.c["entries_lost"] += 1
            t.fail("restore under a resource limit dropped the entry", **info, res=r)
        if r["again"] != [whole, "disk"]:
            t.c["unexplained_misses"] += 1
            t.fail("entry not served once the limit was lifted", **info, res=r)
        low = "hit" if r["low"][0] == whole else ("miss_kept" if r["low"][0] == 0 and r["io_errors"] else "other")
        if low == "other":
            t.c["unexplained_misses"] += 1
            t.fail("restore under a resource limit: neither a hit nor a counted miss", **info, res=r)
        t.outcomes[f"resources:{limit}:{spare}:{low}"] += 1


def _lock_file_fallback_on_full_disk(t: Tally, mnt: Path) -> None:
    """Open a store on a full disk where ``posix_fallocate`` is missing (macOS; taken away
    here): the lock file's fallback must fail the open cleanly (ENOSPC) or have real
    blocks, never leave LMDB a sparse lock file to SIGBUS on. In its own process."""
    import subprocess
    import sys

    err = mount_tmpfs(mnt)
    if err:
        t.skipped.append(err)
        return
    try:
        fill(mnt / "filler", 8 << 20)
        script = ("import os, sys\ndel os.posix_fallocate\nfrom kvstore import KVStore\n"
                  "try:\n    s = KVStore(sys.argv[1], on_disk_error='raise')\nexcept Exception as e:\n"
                  "    print('refused', type(e).__name__)\nelse:\n    print('opened', s.disk is not None)\n    s.close()\n")
        p = subprocess.run([sys.executable, "-c", script, str(mnt / "cache")], capture_output=True, text=True,
                           timeout=300)
    finally:
        umount(mnt)
    t.c["trials"] += 1
    if p.returncode < 0:
        t.c["crashes"] += 1
        t.fail("open on a full disk without posix_fallocate: the process died", signal=-p.returncode,
               stderr=p.stderr[-600:])
    t.outcomes[f"nofalloc_full_disk:{(p.stdout.split() or ['exit'])[0]}:{p.returncode}"] += 1
