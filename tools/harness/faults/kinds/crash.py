"""``crash``: kill -9 of a worker at a random moment inside insert+flush, a write-behind
flush, gc and ``verify --fix`` (the API, and the CLI when it is installed), plus mixed
sequences. Directories live for several trials (a lineage), so crash residue accumulates.
An entry whose insert+flush returned before the kill must survive (entries gc chose to
evict and entries the trial damaged on purpose are excused).

Worker half: ``op_crash_run`` (``CrashWork``) reports each step as an event the moment it
happens. Parent half: ``run_crash`` aims the kill inside one step (``KillTrial``) and runs
the check on the directory afterwards."""

from __future__ import annotations

import contextlib
import json
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

from ..check import Tally, entry_key, hit_problem, raw_entries, segment_users
from ..common import CHUNK, ROOT, VOCAB, Emit, decode, guard
from ..damage import damage_segments
from ..synth import SYSTEM_PROMPTS, Zoo, random_prompt
from ..worker import Pool, Worker, signame

if TYPE_CHECKING:
    from ..context import Ctx


def _pick_model(rng: random.Random, weights: tuple = (0.7, 0.22)) -> str:
    """tiny-llama, tiny-gemma3 or tiny-qwen3next, by ``weights``."""
    r = rng.random()
    return "llama" if r < weights[0] else "gemma" if r < weights[0] + weights[1] else "qwen"


def _prompt_for(rng: random.Random, name: str, bases: list[list[int]]) -> list[int]:
    """A prompt for model ``name``, often sharing a prefix with ``bases``."""
    if name == "qwen":  # the recurrent model prefills slowly on CPU: keep it short
        return random_prompt(rng, 6, 40, None)[:48]
    return random_prompt(rng, 8, 160, bases)[:220]


# ======================================================================= worker half


class CrashWork:
    """The store work of one crash trial. Every step is announced to the parent as it
    happens (``begin``/``end`` of an op, ``committed`` and ``excuse`` keys, ``escaped``
    exceptions, ``wrong`` restores), so whatever the kill interrupts, the parent knows
    what had returned before it."""

    def __init__(self, zoo: Zoo, store: Any, msg: dict, rng: random.Random, ev: Any, escaped: list[dict]) -> None:
        self.zoo, self.store, self.msg, self.rng, self.ev, self.escaped = zoo, store, msg, rng, ev, escaped
        self.bases = [list(p) for p in SYSTEM_PROMPTS]
        try:  # earlier turns of this lineage: prompts share prefixes with them
            names = zoo.ident_map(store)
            for k, rec, toks in raw_entries(store)[:40]:
                if rec and toks and names.get(rec.identity.hex()) == "llama":
                    self.bases.append(decode(toks))
        except Exception:
            pass

    def flush_escapes(self) -> None:
        while self.escaped:
            self.ev("escaped", **self.escaped.pop(0))

    def committed(self, k: str) -> bool:
        return self.store.disk.index.entry(bytes.fromhex(k)) is not None

    def prepare(self) -> tuple[str, list[int], list]:
        """A model, a prompt and its prefilled cache."""
        name = _pick_model(self.rng)
        toks = _prompt_for(self.rng, name, self.bases)
        if name == "llama":
            self.bases.append(toks)
        return name, toks, self.zoo.prefill(name, toks)

    def insert(self, i: int, flush: bool, prepared: tuple | None = None) -> str | None:
        """Insert (and flush): ``committed`` is sent only if the entry is on disk with no
        write error or dropped write on the way."""
        store, zoo = self.store, self.zoo
        name, toks, cache = prepared or self.prepare()
        k = entry_key(store, zoo, name, toks)
        we, dropped = self.write_errors(), store.writer.dropped
        self.ev("begin", op="insert", i=i, key=k, model=name, n=len(toks))
        guard("insert()", self.escaped, store.insert, zoo.model_arg(name), toks, cache)
        if flush:
            guard("flush()", self.escaped, store.flush)
            if self.write_errors() == we and store.writer.dropped == dropped and self.committed(k):
                self.ev("committed", key=k)
            else:
                self.ev("not_committed", key=k, write_errors=self.write_errors() - we)
        self.ev("end", op="insert", i=i)
        self.flush_escapes()
        return k

    def write_errors(self) -> int:
        return int(self.store.stats()["write_errors"])

    def flush(self, i: int) -> None:
        self.ev("begin", op="flush", i=i)
        guard("flush()", self.escaped, self.store.flush)
        self.ev("end", op="flush", i=i)

    def gc(self, i: int) -> None:
        """gc to a random budget; its victims (a dry run first) are excused."""
        from kvstore import maintenance as mt
        from kvstore.budget import evict_to
        store = self.store
        # pending writes and hit bookkeeping first: a touch committed between the dry run and
        # gc would change the LRU order, and gc would rightly evict another entry
        guard("flush()", self.escaped, store.flush)
        total = store.disk.index.total_bytes()
        budget = int(total * self.rng.uniform(0.2, 0.9))
        victims = evict_to(store.disk, budget, dry_run=True)
        self.ev("excuse", keys=[r.key.hex() for r in victims], why="gc victims")
        self.ev("begin", op="gc", i=i)
        guard("gc()", self.escaped, mt.gc, store.disk, max_bytes=budget, blob_age=0)
        self.ev("end", op="gc", i=i)
        self.flush_escapes()

    def damage(self, n: int) -> None:
        """Damage up to ``n`` segments or their pack files (something for verify --fix to
        do); the entries using what each step damages are excused before the step."""
        segs = segment_users(self.store)
        if segs:
            damage_segments(self.store.disk.root, segs, n, self.rng,
                            lambda keys: self.ev("excuse", keys=sorted(keys), why="damaged"))

    def verify_fix(self, i: int) -> None:
        """``verify --fix`` through the API, or the CLI when the trial says so."""
        if self.msg.get("cli"):
            self.cli_verify_fix(i)
            return
        from kvstore import maintenance as mt
        self.ev("begin", op="verify", i=i)
        guard("verify(fix=True)", self.escaped, mt.verify, self.store.disk, fix=True, blob_age=0)
        self.ev("end", op="verify", i=i)
        self.flush_escapes()

    def cli_verify_fix(self, i: int) -> None:
        """``kvstore verify --fix`` as a child process (its pid goes to the parent, which
        kills it too); an exit code other than 0 or 1 is an escaped exception."""
        cmd = [sys.executable, "-m", "kvstore.cli", "verify", "--cache-dir", self.msg["dir"], "--fix",
               "--blob-age", "0"]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.ev("begin", op="cli_verify", i=i, pid=p.pid)
        _, err = p.communicate()
        self.ev("end", op="cli_verify", i=i, rc=p.returncode, stderr=err.decode(errors="replace")[-800:])
        if p.returncode not in (0, 1):
            self.ev("escaped", where="kvstore verify --fix", type=f"exit {p.returncode}",
                    msg=err.decode(errors="replace")[-400:], tb="")

    def fetch(self, i: int) -> None:
        """Fetch a prompt sharing a prefix with earlier ones: a hit must pass."""
        rng = self.rng
        _pick_model(rng)  # unused: tiny-llama is fetched; the draw keeps the trial's random stream
        if not self.bases:
            return
        toks = rng.choice(self.bases) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
        self.ev("begin", op="fetch", i=i)
        f = guard("fetch()", self.escaped, self.store.fetch, self.zoo.model_arg("llama"), toks)
        self.ev("end", op="fetch", i=i)
        why = hit_problem(self.zoo, "llama", toks, f)
        if why is not None:
            self.ev("wrong", key=None, n=f.n, detail=why)
        self.flush_escapes()


def _phase_flush(w: CrashWork) -> None:
    """Queue several writes at once, then flush: the writer is busy when the kill comes."""
    ready = [w.prepare() for _ in range(6)]
    keys = [w.insert(i, False, ready[i]) for i in range(6)]
    w.flush(0)
    for k in keys:
        if k and w.committed(k):
            w.ev("committed", key=k)


def _phase_mixed(w: CrashWork) -> None:
    """Ten random steps."""
    for i in range(10):
        op = w.rng.choice(["insert_flush", "insert_flush", "insert", "fetch", "gc", "verify", "flush"])
        if op == "insert_flush":
            w.insert(i, True)
        elif op == "insert":
            w.insert(i, False)
        elif op == "fetch":
            w.fetch(i)
        elif op == "gc":
            w.gc(i)
        elif op == "verify":
            guard("flush()", w.escaped, w.store.flush)
            w.verify_fix(i)
        else:
            w.flush(i)


def _run_phase(w: CrashWork, phase: str) -> None:
    """The steps of ``phase``: insert, flush, gc, verify / cli_verify, or mixed."""
    if phase == "insert":
        for i in range(8):
            w.insert(i, True)
    elif phase == "flush":
        _phase_flush(w)
    elif phase == "gc":
        for i in range(4):
            w.insert(i, True)
        w.gc(0)
    elif phase in ("verify", "cli_verify"):
        for i in range(5):
            w.insert(i, True)
        w.damage(w.rng.randint(2, 5))
        w.verify_fix(0)
    else:
        _phase_mixed(w)


def op_crash_run(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Store work for one crash trial; the parent kills this process at a random moment."""
    from kvstore import KVStore
    rng = random.Random(msg["seed"])
    escaped: list[dict] = []

    def ev(kind: str, **kw: Any) -> None:
        emit(dict(ev=kind, t=time.time(), **kw))

    store = guard("KVStore()", escaped, KVStore, msg["dir"], chunk_tokens=CHUNK, max_entries=4)
    if store is None:
        for e in escaped:
            ev("escaped", **e)
        return {"opened": False}
    ev("opened")
    w = CrashWork(zoo, store, msg, rng, ev, escaped)
    _run_phase(w, msg["phase"])
    w.flush_escapes()
    ev("done")
    guard("close()", escaped, store.close)
    w.flush_escapes()
    return {"opened": True}


# ======================================================================= parent half

# first guesses of how long each op takes, before one was timed
OP_SECONDS = {"insert": 0.08, "flush": 0.3, "gc": 0.05, "verify": 0.05, "cli_verify": 2.5, "fetch": 0.02,
              "mixed": 3.0}


class OpTimes:
    """How long each op took in earlier trials: the kill is aimed inside one."""

    def __init__(self) -> None:
        self.seen: dict[str, list[float]] = defaultdict(list)

    def estimate(self, op: str) -> float:
        """The median of the last 25 timings (the first guess before any)."""
        xs = self.seen[op][-25:]
        return statistics.median(xs) if xs else OP_SECONDS[op]

    def medians(self) -> dict[str, float]:
        return {k: round(statistics.median(v), 4) for k, v in self.seen.items() if v}


class KillTrial:
    """One crash worker running one phase, killed at a random moment: inside the
    ``target`` step ``(op, i)`` (from its begin to just past its usual length), or for
    ``mixed`` (target None) at a uniform moment of the whole run. Keeps every event the
    worker sent before it died."""

    def __init__(self, w: Worker, phase: str, target: tuple[str, int] | None) -> None:
        self.w, self.phase, self.target = w, phase, target
        self.begins: dict[tuple, dict] = {}
        self.ends: set[tuple] = set()
        self.events: list[dict] = []
        self.died_by_itself = False
        self.kill_at: float | None = None
        self.kill_pid: int | None = None   # a CLI child process to kill with the worker

    def watch(self, rng: random.Random, times: OpTimes) -> None:
        """Read events until the kill moment (then kill) or the worker's end."""
        t_start = time.time()
        self.kill_at = t_start + rng.uniform(0.0, times.estimate("mixed")) if self.target is None else None
        while True:
            timeout = 300 if self.kill_at is None else self.kill_at - time.time()
            try:
                ev = self.w.next(timeout)
            except queue.Empty:
                self.kill()
                return
            if ev is None:
                self.died_by_itself = True
                return
            self.events.append(ev)
            self._note(ev, rng, times, t_start)

    def _note(self, ev: dict, rng: random.Random, times: OpTimes, t_start: float) -> None:
        """Time each step; at the target's begin, choose the kill moment."""
        kind = ev.get("ev")
        if kind == "begin":
            self.begins[(ev["op"], ev["i"])] = ev
            if self.target is not None and (ev["op"], ev["i"]) == self.target and self.kill_at is None:
                # the CLI spends most of its life importing: aim at the end of its run
                lo = 0.75 if ev["op"] == "cli_verify" else 0.0
                self.kill_at = time.time() + rng.uniform(lo, 1.05) * times.estimate(ev["op"])
                self.kill_pid = ev.get("pid")
        elif kind == "end":
            self.ends.add((ev["op"], ev["i"]))
            b = self.begins.get((ev["op"], ev["i"]))
            if b:
                times.seen[ev["op"]].append(ev["t"] - b["t"])
        elif kind == "done" and self.target is None:
            times.seen["mixed"].append(ev["t"] - t_start)

    def kill(self) -> None:
        if self.kill_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.kill_pid, signal.SIGKILL)
        self.w.kill()

    def drain(self) -> None:
        """Keep what the worker wrote before it died."""
        while True:
            try:
                ev = self.w.next(5)
            except queue.Empty:
                break
            if ev is None:
                break
            self.events.append(ev)

    def landed(self) -> str:
        """Where the kill landed: ``phase:inside`` / ``phase:after`` the target step,
        ``mixed:random``, or ``phase:completed`` (the worker finished first)."""
        if not self.w.killed:
            return f"{self.phase}:completed"
        if self.target is None:
            return "mixed:random"
        inside = self.target in self.begins and self.target not in self.ends
        return f"{self.phase}:{'inside' if inside else 'after'}"


def cli_verify_available() -> bool:
    """Is there a ``kvstore verify`` CLI to kill too?"""
    return (ROOT / "kvstore" / "cli" / "verify.py").exists()


def _target(phase: str, rng: random.Random) -> tuple[str, int] | None:
    """The step of ``phase`` to kill inside (None: a uniform moment of a mixed run)."""
    if phase == "insert":
        return ("insert", rng.randrange(8))
    if phase == "flush":
        return ("flush", 0) if rng.random() < 0.7 else ("insert", rng.randrange(6))
    if phase in ("gc", "verify", "cli_verify"):
        return (phase, 0)
    return None


def _kill_trial(t: Tally, pool: Pool, times: OpTimes, rng: random.Random, i: int, phase: str, d: Any) -> KillTrial:
    """Run one phase in a fresh worker and kill it; a worker that died by itself is a crash."""
    target = _target(phase, rng)
    kt = KillTrial(pool.take(), phase, target)
    kt.w.send({"op": "crash_run", "dir": str(d), "seed": rng.randrange(1 << 30), "phase": phase,
               "cli": phase == "cli_verify"})
    kt.watch(rng, times)
    kt.drain()
    w = kt.w
    w.p.wait()
    rc = w.p.returncode
    if kt.died_by_itself and rc not in (0, None) and not w.killed:
        t.c["crashes"] += 1
        t.fail("worker died by itself", trial=i, phase=phase, returncode=rc, signal=signame(rc),
               stderr=w.stderr_tail(1200))
    w._err.close()
    return kt


def _tally_events(t: Tally, events: list[dict], committed: set[str], excused: set[str], i: int, phase: str) -> None:
    """What the worker reported: committed and excused keys, escaped exceptions, wrong restores."""
    for ev in events:
        kind = ev.get("ev")
        if kind == "committed":
            committed.add(ev["key"])
        elif kind == "excuse":
            excused.update(ev["keys"])
        elif kind == "escaped":
            t.add_escaped([ev], "escaped exception (worker)", trial=i, phase=phase)
        elif kind == "wrong":
            t.add_wrong([ev], "wrong restore (worker)", trial=i, phase=phase)
        elif kind == "end" and ev.get("op") == "cli_verify" and ev.get("rc") not in (0, 1):
            t.fail("cli verify failed", trial=i, rc=ev.get("rc"), stderr=ev.get("stderr"))
        elif kind == "result" and (ev.get("result") or {}).get("harness_error"):
            # the trial's own code failed (not kvstore): what it did before the failure
            # may have gone unannounced, so this is a failure of the run, never silent
            t.c["failed_cases"] += 1
            t.fail("harness error (crash worker)", trial=i, phase=phase, error=ev["result"]["harness_error"])


def _check_trial(ctx: Ctx, t: Tally, rng: random.Random, i: int, phase: str, d: Any, committed: set[str],
                 excused: set[str]) -> dict:
    """The check after a kill (half the time with verify --fix and a reopen); entries it
    finds lost are not counted again in the next trials of the lineage."""
    fix = rng.random() < 0.5
    res = ctx.checker.call({"op": "check", "dir": str(d), "committed": sorted(committed),
                            "targets": sorted(excused), "fix": fix, "reopen": fix})
    t.add_check(res, trial=i, phase=phase, dir=str(d), seed=ctx.seed)
    if not res.get("crashed"):
        committed -= set(res.get("lost", []))
        t.outcomes[f"verify:{'+'.join(sorted(res.get('verify', {}))) or 'clean'}"] += 1
    t.c["trials"] += 1
    return res


# ----------------------------------------------------------------------- the index check child

_OPEN_INDEX = """
import json, logging, sys
from pathlib import Path
import kvstore.index.checks as checks
checks.CHECK_SECONDS = 2.0  # a stopped check runs into this limit
warned = []
logging.getLogger("kvstore").addHandler(
    type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.WARNING))
from kvstore.cachedir import open_disk
disk = open_disk(Path(sys.argv[1]))
n = disk.index.counts()["entries"]
disk.close()
print(json.dumps({"entries": n, "warned": warned}))
"""


def check_children(parent: int) -> list[int]:
    """Pids of ``parent``'s children running kvstore's index check (``index.checks._WALK``,
    which names its probe key ``kvstore-open-probe``)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"kvstore-open-probe" in cmd:
            out.append(int(d))
    return out


def signal_check_children(parent: int, sig: int, found: list[int], stop: Any) -> None:
    """Send ``sig`` to every index-check child ``parent`` starts until ``stop`` is set."""
    while not stop.is_set():
        for pid in check_children(parent):
            if pid not in found:
                os.kill(pid, sig)
                found.append(pid)
        stop.wait(0.005)


def _check_child_trial(ctx: Ctx, t: Tally, i: int, d: Any, sig: int, committed: set[str], excused: set[str]) -> None:
    """A new process opens ``d`` (its clean stamp removed) while its index check child is
    killed (SIGKILL, as the OOM killer does) or stopped (SIGSTOP): the open must finish,
    say the check did not complete and leave no stamp; then the usual check of ``d``."""
    import threading

    (d / "index" / "clean").unlink(missing_ok=True)
    p = subprocess.Popen([sys.executable, "-c", _OPEN_INDEX, str(d)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    found: list[int] = []
    stop = threading.Event()
    threading.Thread(target=signal_check_children, args=(p.pid, sig, found, stop), daemon=True).start()
    name = signal.Signals(sig).name
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        t.c["failed_cases"] += 1
        t.fail("open hung with its check child " + name, trial=i)
    finally:
        stop.set()
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    try:
        got = json.loads(out.strip().splitlines()[-1]) if p.returncode == 0 else None
    except (ValueError, IndexError):
        got = None
    if p.returncode != 0 or not isinstance(got, dict):
        t.c["crashes"] += 1
        t.fail(f"open with its check child {name} failed", trial=i, returncode=p.returncode, stderr=err[-1200:])
    elif not found or not any("did not complete" in w for w in got["warned"]):
        t.fail(f"check child {name}: not seen or not reported", trial=i, found=found, warned=got["warned"])
    if (d / "index" / "clean").exists():
        t.fail(f"index stamped clean after its check child was {name}", trial=i)
    t.outcomes[f"check child {name}"] += 1
    _check_trial(ctx, t, random.Random(i), i, f"check_{name}", d, committed, excused)


def run_crash(ctx: Ctx) -> dict:
    """``crash`` trials in lineages of ``crash_lineage`` trials sharing a directory."""
    n = ctx.size["crash"]
    lineage = ctx.size["crash_lineage"]
    t = Tally("crash")
    pool = Pool("crash", ctx.logdir, spare=1)
    times = OpTimes()
    committed: set[str] = set()
    excused: set[str] = set()
    base = ctx.work / "crash"
    landed: Counter = Counter()
    d = base
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
            kt = _kill_trial(t, pool, times, rng, i, phase, d)
            landed[kt.landed()] += 1
            _tally_events(t, kt.events, committed, excused, i, phase)
            committed -= excused
            res = _check_trial(ctx, t, rng, i, phase, d, committed, excused)
            ctx.debug(f"crash {i} {phase} killed={kt.w.killed} committed={len(committed)} "
                      f"claimed={res.get('claimed')} verify={res.get('verify')} lost={res.get('lost')}")
            ctx.progress(t, i, n)
        for j, sig in enumerate((signal.SIGKILL, signal.SIGSTOP)):
            if (d / "index" / "data.mdb").is_file():
                _check_child_trial(ctx, t, n + j, d, sig, committed, excused)
    finally:
        pool.close()
        shutil.rmtree(base, ignore_errors=True)
    t.info["kills"] = dict(sorted(landed.items()))
    t.info["median_op_seconds"] = times.medians()
    t.info["cli_verify_trials"] = sum(v for k, v in landed.items() if k.startswith("cli_verify"))
    return t.result()
