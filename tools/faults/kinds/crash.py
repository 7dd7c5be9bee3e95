"""kill -9 at random moments inside insert+flush, flush, gc and verify --fix."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from ..check import Tally, _entry_key, _progress, blob_users, raw_entries
from ..common import CHUNK, ROOT, VOCAB, Emit, _decode, _guard
from ..damage import damage_file
from ..synth import SYSTEM_PROMPTS, Zoo, random_prompt
from ..worker import Pool, _signame

if TYPE_CHECKING:
    from ..harness import Ctx


def _pick_model(rng: random.Random, weights: tuple = (0.7, 0.22)) -> str:
    r = rng.random()
    return "llama" if r < weights[0] else "gemma" if r < weights[0] + weights[1] else "qwen"


def _prompt_for(rng: random.Random, name: str, bases: list[list[int]]) -> list[int]:
    if name == "qwen":  # the recurrent model prefills slowly on CPU: keep it short
        return random_prompt(rng, 6, 40, None)[:48]
    return random_prompt(rng, 8, 160, bases)[:220]


def op_crash_run(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Store work for one crash trial; the parent kills this process at a random moment."""
    from kvstore import KVStore
    from kvstore import maintenance as mt

    rng = random.Random(msg["seed"])
    phase = msg["phase"]
    escaped: list[dict] = []

    def ev(kind: str, **kw: Any) -> None:
        emit(dict(ev=kind, t=time.time(), **kw))

    def flush_escapes() -> None:
        while escaped:
            ev("escaped", **escaped.pop(0))

    store = _guard("KVStore()", escaped, KVStore, msg["dir"], chunk_tokens=CHUNK, max_entries=4)
    if store is None:
        flush_escapes()
        return {"opened": False}
    ev("opened")
    bases = [list(p) for p in SYSTEM_PROMPTS]
    try:
        names = zoo.ident_map(store)
        for k, rec, toks in raw_entries(store)[:40]:
            if rec and toks and names.get(rec.get("identity")) == "llama":
                bases.append(_decode(toks))
    except Exception:
        pass

    def committed(k: str) -> bool:
        return store.disk.index.entry(bytes.fromhex(k)) is not None

    def prepare() -> tuple[str, list[int], list]:
        name = _pick_model(rng)
        toks = _prompt_for(rng, name, bases)
        if name == "llama":
            bases.append(toks)
        return name, toks, zoo.prefill(name, toks)

    def insert(i: int, flush: bool, prepared: tuple | None = None) -> str | None:
        name, toks, cache = prepared or prepare()
        k = _entry_key(store, zoo, name, toks)
        we, dropped = store._stats["write_errors"], store.writer.dropped
        ev("begin", op="insert", i=i, key=k, model=name, n=len(toks))
        _guard("insert()", escaped, store.insert, zoo.model_arg(name), toks, cache)
        if flush:
            _guard("flush()", escaped, store.flush)
            if store._stats["write_errors"] == we and store.writer.dropped == dropped and committed(k):
                ev("committed", key=k)
            else:
                ev("not_committed", key=k, write_errors=store._stats["write_errors"] - we)
        ev("end", op="insert", i=i)
        flush_escapes()
        return k

    def gc(i: int) -> None:
        # pending writes and hit bookkeeping first: a touch committed between the dry run and
        # gc would change the LRU order, and gc would rightly evict another entry
        _guard("flush()", escaped, store.flush)
        total = store.disk.index.total_bytes()
        budget = int(total * rng.uniform(0.2, 0.9))
        victims = mt.evict_to(store.disk, budget, dry_run=True)
        ev("excuse", keys=[k.hex() for k, _ in victims], why="gc victims")
        ev("begin", op="gc", i=i)
        _guard("gc()", escaped, mt.gc, store.disk, max_bytes=budget, tmp_age=0, blob_age=0)
        ev("end", op="gc", i=i)
        flush_escapes()

    def damage(n: int) -> None:
        users = blob_users(store)
        if not users:
            return
        hit: set[str] = set()
        for blob in rng.sample(sorted(users), min(n, len(users))):
            mode = rng.choice(["flip", "truncate", "delete", "zero"])
            damage_file(store.disk.blob_root / blob, mode, rng)
            hit |= users[blob]
        ev("excuse", keys=sorted(hit), why="damaged")

    def verify_fix(i: int) -> None:
        if msg.get("cli"):
            cmd = [sys.executable, "-m", "kvstore.cli", "verify", "--cache-dir", msg["dir"], "--fix",
                   "--tmp-age", "0", "--blob-age", "0"]
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            ev("begin", op="cli_verify", i=i, pid=p.pid)
            _, err = p.communicate()
            ev("end", op="cli_verify", i=i, rc=p.returncode, stderr=err.decode(errors="replace")[-800:])
            if p.returncode not in (0, 1):
                ev("escaped", where="kvstore verify --fix", type=f"exit {p.returncode}",
                   msg=err.decode(errors="replace")[-400:], tb="")
            return
        ev("begin", op="verify", i=i)
        _guard("verify(fix=True)", escaped, mt.verify, store.disk, fix=True, tmp_age=0, blob_age=0)
        ev("end", op="verify", i=i)
        flush_escapes()

    def fetch(i: int) -> None:
        name = _pick_model(rng)
        if not bases:
            return
        toks = rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
        ev("begin", op="fetch", i=i)
        f = _guard("fetch()", escaped, store.fetch, zoo.model_arg("llama"), toks)
        ev("end", op="fetch", i=i)
        if f is not None and f.cache is not None and f.n > 0:
            ok, why = zoo.check("llama", toks, f.cache, f.n)
            if not ok:
                ev("wrong", key=None, n=f.n, detail=why)
        flush_escapes()

    if phase == "insert":
        for i in range(8):
            insert(i, True)
    elif phase == "flush":  # queue several writes at once, then flush: the writer is busy
        ready = [prepare() for _ in range(6)]
        keys = [insert(i, False, ready[i]) for i in range(6)]
        ev("begin", op="flush", i=0)
        _guard("flush()", escaped, store.flush)
        ev("end", op="flush", i=0)
        for k in keys:
            if k and committed(k):
                ev("committed", key=k)
    elif phase == "gc":
        for i in range(4):
            insert(i, True)
        gc(0)
    elif phase in ("verify", "cli_verify"):
        for i in range(5):
            insert(i, True)
        damage(rng.randint(2, 5))
        verify_fix(0)
    else:  # mixed
        for i in range(10):
            op = rng.choice(["insert_flush", "insert_flush", "insert", "fetch", "gc", "verify", "flush"])
            if op == "insert_flush":
                insert(i, True)
            elif op == "insert":
                insert(i, False)
            elif op == "fetch":
                fetch(i)
            elif op == "gc":
                gc(i)
            elif op == "verify":
                _guard("flush()", escaped, store.flush)
                verify_fix(i)
            else:
                ev("begin", op="flush", i=i)
                _guard("flush()", escaped, store.flush)
                ev("end", op="flush", i=i)
    flush_escapes()
    ev("done")
    _guard("close()", escaped, store.close)
    flush_escapes()
    return {"opened": True}


def cli_verify_available() -> bool:
    return (ROOT / "kvstore" / "cli" / "verify.py").exists()


def run_crash(ctx: Ctx) -> dict:
    n = ctx.size["crash"]
    lineage = ctx.size["crash_lineage"]
    t = Tally("crash")
    pool = Pool("crash", ctx.logdir, spare=1)
    est: dict[str, list[float]] = defaultdict(list)
    defaults = {"insert": 0.08, "flush": 0.3, "gc": 0.05, "verify": 0.05, "cli_verify": 2.5, "fetch": 0.02,
                "mixed": 3.0}
    committed: set[str] = set()
    excused: set[str] = set()
    base = ctx.work / "crash"
    landed = Counter()
    d = base

    def estimate(op: str) -> float:
        xs = est[op][-25:]
        return statistics.median(xs) if xs else defaults[op]

    try:
        for i in range(n):
            rng = random.Random(ctx.seed * 7919 + i)
            if i % lineage == 0:
                if d.exists() and d != base:
                    shutil.rmtree(d, ignore_errors=True)
                d = base / f"lineage-{i // lineage}"
                committed, excused = set(), set()
            phases = ["insert", "flush", "gc", "verify", "mixed"] + (["cli_verify"] if cli_verify_available() else [])
            phase = phases[i % len(phases)]
            if phase == "insert":
                target: tuple[str, int] | None = ("insert", rng.randrange(8))
            elif phase == "flush":
                target = ("flush", 0) if rng.random() < 0.7 else ("insert", rng.randrange(6))
            elif phase in ("gc", "verify", "cli_verify"):
                target = (phase, 0)
            else:
                target = None  # mixed: a uniform moment
            w = pool.take()
            w.send({"op": "crash_run", "dir": str(d), "seed": rng.randrange(1 << 30), "phase": phase,
                    "cli": phase == "cli_verify"})
            t_start = time.time()
            kill_at = t_start + rng.uniform(0.0, estimate("mixed")) if target is None else None
            begins: dict[tuple, dict] = {}
            ends: set[tuple] = set()
            events: list[dict] = []
            died_by_itself = False
            kill_pid = None
            while True:
                timeout = 300 if kill_at is None else kill_at - time.time()
                try:
                    ev = w.next(timeout)
                except queue.Empty:
                    if kill_pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(kill_pid, signal.SIGKILL)
                    w.kill()
                    break
                if ev is None:
                    died_by_itself = True
                    break
                events.append(ev)
                kind = ev.get("ev")
                if kind == "begin":
                    begins[(ev["op"], ev["i"])] = ev
                    if target is not None and (ev["op"], ev["i"]) == target and kill_at is None:
                        # the CLI spends most of its life importing: aim at the end of its run
                        lo = 0.75 if ev["op"] == "cli_verify" else 0.0
                        kill_at = time.time() + rng.uniform(lo, 1.05) * estimate(ev["op"])
                        kill_pid = ev.get("pid")
                elif kind == "end":
                    ends.add((ev["op"], ev["i"]))
                    b = begins.get((ev["op"], ev["i"]))
                    if b:
                        est[ev["op"]].append(ev["t"] - b["t"])
                elif kind == "done" and target is None:
                    est["mixed"].append(ev["t"] - t_start)
            # drain what the worker wrote before it died
            while True:
                try:
                    ev = w.next(5)
                except queue.Empty:
                    break
                if ev is None:
                    break
                events.append(ev)
            w.p.wait()
            rc = w.p.returncode
            if died_by_itself and rc not in (0, None) and not w.killed:
                t.c["crashes"] += 1
                t.fail("worker died by itself", trial=i, phase=phase, returncode=rc, signal=_signame(rc),
                       stderr=w.stderr_tail(1200))
            w._err.close()
            if w.killed:
                where = "inside" if target is None or (target in begins and target not in ends) else "after"
                landed[f"{phase}:{where}" if target is not None else "mixed:random"] += 1
            else:
                landed[f"{phase}:completed"] += 1
            for ev in events:
                kind = ev.get("ev")
                if kind == "committed":
                    committed.add(ev["key"])
                elif kind == "excuse":
                    excused.update(ev["keys"])
                elif kind == "escaped":
                    t.c["escaped_exceptions"] += 1
                    t.fail("escaped exception (worker)", trial=i, phase=phase, exception=ev)
                elif kind == "wrong":
                    t.c["wrong_restores"] += 1
                    t.fail("wrong restore (worker)", trial=i, phase=phase, detail=ev)
                elif kind == "end" and ev.get("op") == "cli_verify" and ev.get("rc") not in (0, 1):
                    t.fail("cli verify failed", trial=i, rc=ev.get("rc"), stderr=ev.get("stderr"))
            committed -= excused
            fix = rng.random() < 0.5
            res = ctx.checker.call({"op": "check", "dir": str(d), "committed": sorted(committed),
                                    "targets": sorted(excused), "fix": fix, "reopen": fix})
            t.add_check(res, trial=i, phase=phase, dir=str(d), seed=ctx.seed)
            if not res.get("crashed"):
                committed -= set(res.get("lost", []))
                t.outcomes[f"verify:{'+'.join(sorted(res.get('verify', {}))) or 'clean'}"] += 1
            t.c["trials"] += 1
            ctx.debug(f"crash {i} {phase} killed={w.killed} committed={len(committed)} claimed={res.get('claimed')} "
                      f"verify={res.get('verify')} lost={res.get('lost')}")
            _progress(ctx, t, i, n)
    finally:
        pool.close()
        shutil.rmtree(base, ignore_errors=True)
    t.info["kills"] = dict(sorted(landed.items()))
    t.info["median_op_seconds"] = {k: round(statistics.median(v), 4) for k, v in est.items() if v}
    t.info["cli_verify_trials"] = sum(v for k, v in landed.items() if k.startswith("cli_verify"))
    return t.result()
