"""``concurrency``: 4 processes x 4 threads inserting, fetching, gc-ing and verifying one
directory (synthetic caches checked bit for bit on every hit, tiny-llama caches through
the oracle), then the check.

Worker half: ``op_conc`` (``ConcProcess``, one per process). Parent half:
``run_concurrency`` starts the processes together, sums what they saw and checks the
directory once they have all exited."""

from __future__ import annotations

import queue
import random
import shutil
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..check import Tally
from ..common import CHUNK, VOCAB, Emit, LogCapture, exc_info
from ..synth import Zoo, random_prompt, syn_cache, syn_check
from ..worker import Worker, signame

if TYPE_CHECKING:
    from ..context import Ctx


# ======================================================================= worker half


class ConcProcess:
    """One process's threads on the shared directory. Thread ``t`` plays role
    ``(user, user, real, maint)[t % 4]`` until the deadline; the counters in ``res`` are
    shared by the threads (under ``stats_lock``), the models by ``model_lock``."""

    def __init__(self, zoo: Zoo, store: Any, msg: dict) -> None:
        self.zoo, self.store = zoo, store
        self.seed, self.proc = msg["seed"], msg["proc"]
        self.deadline = time.time() + msg["seconds"]
        self.model_lock = threading.Lock()
        self.stats_lock = threading.Lock()
        self.res: dict[str, Any] = dict(escaped=[], wrong=[], ops=Counter(), hits=Counter(), oracle_checks=0,
                                        syn_checks=0, verify_kinds=Counter())
        self.shared = [random_prompt(random.Random(1000 + i), 30, 90) for i in range(6)]  # same in every process

    def count(self, key: str, n: int = 1, field: str = "ops") -> None:
        with self.stats_lock:
            self.res[field][key] += n

    def user(self, rng: random.Random) -> None:
        """Fetch and insert synthetic caches (checked bit for bit on every hit), quickly."""
        store, zoo, res = self.store, self.zoo, self.res
        kind = "kv" if rng.random() < 0.75 else "snap"
        name = f"syn-{kind}"
        toks = random_prompt(rng, 10, 150, self.shared)
        q = toks + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        f = store.fetch(zoo.model_arg(name), q)
        self.count("fetch")
        if f.cache is not None and f.n:
            self.count(f.source or "?", field="hits")
            ok, why = syn_check(kind, q, f.cache, f.n)
            with self.stats_lock:
                res["syn_checks"] += 1
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why})
        if rng.random() < 0.5:
            store.insert(zoo.model_arg(name), toks, syn_cache(kind, toks))
            self.count("insert")
        time.sleep(rng.uniform(0, 0.01))  # let the writer keep up now and then (more disk traffic)

    def real(self, rng: random.Random) -> None:
        """Fetch (through the oracle) and insert tiny-llama caches."""
        store, zoo, res = self.store, self.zoo, self.res
        toks = random_prompt(rng, 20, 120, self.shared)
        f = store.fetch(zoo.model_arg("llama"), toks)
        self.count("fetch_real")
        if f.cache is not None and f.n:
            self.count("real", field="hits")
            with self.model_lock:
                ok, why = zoo.check("llama", toks, f.cache, f.n)
            with self.stats_lock:
                res["oracle_checks"] += 1
                if not ok:
                    res["wrong"].append({"model": "llama", "n": f.n, "detail": why})
        with self.model_lock:
            cache = zoo.prefill("llama", toks)
        store.insert(zoo.model_arg("llama"), toks, cache)
        self.count("insert_real")
        time.sleep(rng.uniform(0, 0.2))

    def maint(self, rng: random.Random) -> None:
        """gc, verify, verify --fix, evict, or stats and flush."""
        from kvstore import maintenance as mt
        from kvstore.budget import evict_to
        store = self.store
        r = rng.random()
        if r < 0.3:
            mt.gc(store.disk, max_bytes=rng.randint(200_000, 2_000_000))
            self.count("gc")
        elif r < 0.55:
            probs = mt.verify(store.disk)
            self.count("verify")
            with self.stats_lock:
                self.res["verify_kinds"].update(p.kind for p in probs)
        elif r < 0.7:
            mt.verify(store.disk, fix=True)
            self.count("verify_fix")
        elif r < 0.85:
            evict_to(store.disk, rng.randint(300_000, 3_000_000))
            self.count("evict")
        else:
            store.stats()
            store.flush(10)
            self.count("stats_flush")
        time.sleep(rng.uniform(0.02, 0.25))

    def loop(self, t: int) -> None:
        """Thread ``t``: its role until the deadline; an exception is recorded (after 20 the thread stops)."""
        rng = random.Random(self.seed * 1000 + self.proc * 10 + t)
        role = (self.user, self.user, self.real, self.maint)[t % 4]
        while time.time() < self.deadline:
            try:
                role(rng)
            except Exception as e:
                with self.stats_lock:
                    self.res["escaped"].append(exc_info(f"{role.__name__} thread", e))
                    if len(self.res["escaped"]) > 20:
                        return


def op_conc(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """One of the concurrency processes: ``threads`` threads for ``seconds`` on one directory."""
    from kvstore import KVStore
    with LogCapture() as cap:
        store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=6, max_disk_bytes=msg.get("max_disk_bytes"))
        proc = ConcProcess(zoo, store, msg)
        res = proc.res
        threads = [threading.Thread(target=proc.loop, args=(t,)) for t in range(msg["threads"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush(60)
    res["writer_failed"] = sum("background write failed" in r for r in cap.records)
    try:
        st = store.stats()
        res["stats"] = {k: st.get(k) for k in ("write_errors", "writes", "dropped_writes", "corrupt", "races",
                                                 "warnings_suppressed", "hits_memory", "hits_disk", "misses")}
        store.close()
    except Exception as e:
        res["escaped"].append(exc_info("stats/close", e))
    res["ops"], res["hits"], res["verify_kinds"] = dict(res["ops"]), dict(res["hits"]), dict(res["verify_kinds"])
    return res


# ======================================================================= parent half


def run_concurrency(ctx: Ctx) -> dict:
    """The processes on one directory at once, then the check of the directory."""
    t = Tally("concurrency")
    size = ctx.size
    d = ctx.work / "conc"
    shutil.rmtree(d, ignore_errors=True)
    results = _run_processes(ctx, t, d)
    ops, hits, vk = _add_results(t, results)
    # the directory afterwards: every claimed entry correct, verify clean
    res = ctx.checker.call({"op": "check", "dir": str(d), "fix": True})
    t.add_check(res, phase="final check")
    t.info["final_check"] = {k: res.get(k) for k in ("claimed", "full", "partial", "miss", "verify", "verify_after_fix")}
    if res.get("verify"):
        t.fail("verify after the run (all processes exited) is not clean", verify=res.get("verify"))
        t.c["verify_unclean"] += 1
    t.c["trials"] = sum(ops.values())
    t.info.update({"processes": size["conc_procs"], "threads_per_process": size["conc_threads"],
                   "run_seconds": size["conc_seconds"], "ops": dict(ops), "hits": dict(hits),
                   "verify_kinds_seen_during_run": dict(vk)})
    shutil.rmtree(d, ignore_errors=True)
    return t.result()


def _run_processes(ctx: Ctx, t: Tally, d: Any) -> list[dict]:
    """Start ``conc_procs`` workers, let them go at once, and collect their results; a
    process that dies or hangs is a crash."""
    size = ctx.size
    ws = [Worker("conc", ctx.logdir) for _ in range(size["conc_procs"])]
    results = []
    try:
        for w in ws:
            w.wait_ready()
        for p, w in enumerate(ws):
            w.send({"op": "conc", "dir": str(d), "seconds": size["conc_seconds"], "threads": size["conc_threads"],
                    "seed": ctx.seed, "proc": p, "max_disk_bytes": 4 << 20})
        for p, w in enumerate(ws):
            try:
                res = w.wait_result(size["conc_seconds"] + 300)
            except queue.Empty:
                res = None
            if res is None:
                w.p.poll()
                t.c["crashes"] += 1
                t.fail("concurrency process died or hung", proc=p, returncode=w.p.returncode,
                       signal=signame(w.p.returncode), stderr=w.stderr_tail(1500))
                continue
            results.append(res)
    finally:
        for w in ws:
            w.close()
    return results


def _add_results(t: Tally, results: list[dict]) -> tuple[Counter, Counter, Counter]:
    """Tally each process's wrong restores and escaped exceptions; sum its ops, hits and
    the verify problems it saw during the run."""
    ops: Counter = Counter()
    hits: Counter = Counter()
    vk: Counter = Counter()
    for p, res in enumerate(results):
        if res.get("harness_error"):
            t.fail("harness error", proc=p, error=res["harness_error"])
            continue
        ops.update(res["ops"])
        hits.update(res["hits"])
        vk.update(res["verify_kinds"])
        t.add_wrong(res["wrong"], proc=p)
        t.add_escaped(res["escaped"], proc=p)
        t.info.setdefault("oracle_checks", 0)
        t.info["oracle_checks"] += res["oracle_checks"]
        t.info.setdefault("synthetic_checks", 0)
        t.info["synthetic_checks"] += res["syn_checks"]
        t.info.setdefault("process_stats", []).append(res.get("stats"))
    return ops, hits, vk
