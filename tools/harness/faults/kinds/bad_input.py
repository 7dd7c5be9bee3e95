"""``bad_input``: empty, non-integer, negative, out-of-range and out-of-vocabulary token
lists, enormous token lists, caches of the wrong length or classes, caches from another
model (other layer classes, or the same classes with other KV heads, head_dim or dtype),
the model's own caches with arrays of batch 2 or a fifth axis:
a ValueError/TokenError naming the problem, a documented miss, or (a cache that does not
fit the model) a documented refusal: counted in ``stats()["unpersistable"]``, warned,
kept in memory only. The store (index records, blob files; the memory tier too for
errors and misses) is unchanged.

Worker half: ``op_bad_input`` makes the calls of ``BadInputs`` one by one
(``_run_case``). Parent half: ``run_bad_input`` tallies the verdicts."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..check import Tally, logical_dump
from ..common import CHUNK, VOCAB, Emit, LogCapture, exc_info
from ..synth import Zoo, random_prompt, syn_cache

if TYPE_CHECKING:
    from ..context import Ctx


# Bad inputs kvstore cannot detect with what it knows; reported, not counted as failures.
# (Empty since the identity records each attention layer's KV heads, head_dim and dtype: a
# cache of another model with the same layer classes is now refused like other mismatches.)
LIMITATIONS: dict[str, str] = {}

F, I = "fetch", "insert"
# (name, kind, call, expectation, tokens a hit must hold)
# expectation: "error" (ValueError/TokenError, store unchanged), "miss" (store unchanged),
# "error_or_miss", "prefix" (a correct hit of a stored prefix), "error_or_prefix",
# "not_persisted" (an error, or kept in memory only: index and blob files unchanged)
# "The store" is the index and the blob files (the definition); a change of the
# memory tier is reported too and must not happen for errors and misses.
Case = tuple[str, str, Callable[[], Any], str, list[int] | None]


# ======================================================================= worker half


def _memory_keys(store: Any) -> list:
    """The snapshots the memory tier holds, by identity (an added, dropped or replaced
    snapshot is a change), and its counts by cache type."""
    return [sorted(id(s) for s in store.memory.snapshots()), store.memory.stats_by_type()]


class BadInputs:
    """A populated store (three tiny-llama entries and a tiny-gemma3 one, on disk and in
    memory), the inputs of the bad calls, and the calls (``cases``). Inputs drawn while
    the cases run come from ``rng`` or, for the other-model cases, from ``orng``, their
    own stream, so adding such a case leaves the other cases' inputs as they were."""

    def __init__(self, zoo: Zoo, store: Any, msg: dict) -> None:
        self.zoo, self.store, self.msg = zoo, store, msg
        rng = self.rng = random.Random(msg["seed"])
        self.llama, self.gemma = zoo.model_arg("llama"), zoo.model_arg("gemma")
        self.base = [random_prompt(rng, 40, 120) for _ in range(3)]
        for t in self.base:
            store.insert(self.llama, t, zoo.prefill("llama", t))
        self.gt = random_prompt(rng, 40, 80)
        store.insert(self.gemma, self.gt, zoo.prefill("gemma", self.gt))
        store.flush()
        self.t60 = random_prompt(rng, 60, 60)
        self.c60 = zoo.prefill("llama", self.t60)
        self.orng = random.Random(msg["seed"] + 7)
        self.t_other = [self.orng.randrange(VOCAB) for _ in range(60)]
        self.g60 = zoo.prefill("gemma", self.t_other)
        self.huge = [rng.randrange(VOCAB) for _ in range(msg.get("huge_fetch", 2_000_000))]
        self.c_huge = zoo.prefill("llama", self.huge[:60])

    def fresh(self, n: int = 60) -> list[int]:
        """Tokens nothing is stored under yet."""
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def ofresh(self) -> list[int]:
        """Fresh tokens for the other-model cases."""
        return [self.orng.randrange(VOCAB) for _ in range(60)]

    def odd_cache(self) -> list:
        """The right classes and layer count, the wrong shapes (another model)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache
        out = []
        for _ in range(len(self.c60)):
            c = KVCache()
            c.keys = mx.zeros((1, 4, 60, 16))
            c.values = mx.zeros((1, 4, 60, 16))
            c.offset = 60
            out.append(c)
        return out

    def other_kv(self, like: list, heads: int, dim: int, dtype: Any = None) -> list:
        """A real mlx-lm cache with the layer classes of ``like`` (same count, same
        RotatingKVCache parameters) holding 60 positions of other KV shapes / dtype
        (float32 unless given), filled by update_and_fetch as a model's attention would."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, RotatingKVCache
        dtype = mx.float32 if dtype is None else dtype
        out = []
        for c in like:
            o = RotatingKVCache(max_size=c.max_size, keep=c.keep) if isinstance(c, RotatingKVCache) else KVCache()
            k = mx.random.normal((1, heads, 60, dim), key=mx.random.key(self.orng.randrange(1 << 30))).astype(dtype)
            o.update_and_fetch(k, k * 0.5)
            out.append(o)
        mx.eval([a for c in out for a in (c.keys, c.values)])
        return out

    def reshaped(self, like: list, batch: bool) -> list:
        """``like``'s layers (this model's own cache, classes and KV geometry) with every
        array of batch 2 or given a fifth axis: no cache the model makes (a batch of 2
        killed mlx_lm.server's generation thread once restored; issue 31.2)."""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, RotatingKVCache
        out = []
        for c in like:
            o = RotatingKVCache(max_size=c.max_size, keep=c.keep) if isinstance(c, RotatingKVCache) else KVCache()
            k, v = (mx.concatenate([a, a], axis=0) if batch else a[None] for a in (c.keys, c.values))
            o.keys, o.values, o.offset = k, v, c.offset
            if isinstance(o, RotatingKVCache):
                o._idx = c._idx
            out.append(o)
        mx.eval([a for c in out for a in (c.keys, c.values)])
        return out

    def llama_variant(self, **changes: int) -> list:
        """A real prefill of another model: tiny-llama's layers, other KV."""
        from mlx_lm.models import llama as llama_arch
        from tools.testing import oracle
        cfg = json.loads((Path(self.zoo.paths["llama"]) / "config.json").read_text())
        return oracle.prefill(llama_arch.Model(llama_arch.ModelArgs.from_dict({**cfg, **changes})), self.t_other)

    def short_arrays(self) -> list:
        """The offset claims more positions than the arrays hold."""
        out = []
        for c in self.zoo.prefill("llama", self.t60[:40]):
            c.keys, c.values = c.keys[..., :40, :], c.values[..., :40, :]
            c.offset = 60
            out.append(c)
        return out

    def ragged(self) -> list:
        """Layers that disagree on their length."""
        c = self.zoo.prefill("llama", self.t60)
        c[1].offset = 50
        return c

    def insert_huge(self) -> Any:
        """Documented: the store keeps the prefix the cache covers."""
        store, huge = self.store, self.huge
        store.insert(self.llama, huge[: self.msg.get("huge_insert", 100_000)], self.c_huge)
        store.flush()
        return store.fetch(self.llama, huge[:60] + [7])

    def cases(self) -> list[Case]:
        return self.fetch_cases() + self.insert_cases() + self.other_model_cases() + self.bad_cache_cases()

    def fetch_cases(self) -> list[Case]:
        import numpy as np
        store, llama, base, huge = self.store, self.llama, self.base, self.huge
        return [
            ("fetch: empty token list", F, lambda: store.fetch(llama, []), "miss", None),
            ("fetch: float tokens", F, lambda: store.fetch(llama, [1.5, 2.0, 3.0]), "error", None),
            ("fetch: numpy float array", F, lambda: store.fetch(llama, np.array([1.0, 2.0])), "error", None),
            ("fetch: string tokens", F, lambda: store.fetch(llama, ["a", "b"]), "error", None),
            ("fetch: a str", F, lambda: store.fetch(llama, "hello"), "error", None),
            ("fetch: None token", F, lambda: store.fetch(llama, [1, None, 3]), "error", None),
            ("fetch: nested lists", F, lambda: store.fetch(llama, [[1, 2], [3, 4]]), "error", None),
            ("fetch: bool tokens", F, lambda: store.fetch(llama, [True, False]), "error", None),
            ("fetch: token -2**63 - 1", F, lambda: store.fetch(llama, base[0][:10] + [-2**63 - 1]), "error", None),
            ("fetch: token 2**64", F, lambda: store.fetch(llama, [5, 2**64]), "error", None),
            ("fetch: token 2**70", F, lambda: store.fetch(llama, [5, 2**70]), "error", None),
            ("fetch: tokens=None", F, lambda: store.fetch(llama, None), "error", None),
            ("fetch: out-of-vocabulary tokens", F, lambda: store.fetch(llama, [300, 5000, 70000]), "error_or_miss",
             None),
            ("fetch: stored prompt + out-of-vocabulary token", F,
             lambda: store.fetch(llama, base[0] + [100000]), "error_or_prefix", base[0] + [100000]),
            (f"fetch: {len(huge)} tokens", F, lambda: store.fetch(llama, huge), "miss", None),
            (f"fetch: stored prompt + {len(huge)} tokens", F, lambda: store.fetch(llama, base[1] + huge), "prefix",
             base[1] + huge),
        ]

    def insert_cases(self) -> list[Case]:
        store, llama, t60, c60 = self.store, self.llama, self.t60, self.c60
        return [
            ("insert: empty tokens, 60-token cache", I, lambda: store.insert(llama, [], c60), "error", None),
            ("insert: float tokens", I, lambda: store.insert(llama, [float(t) for t in t60], c60), "error", None),
            ("insert: token -2**63 - 1", I, lambda: store.insert(llama, t60[:-1] + [-2**63 - 1], c60), "error", None),
            ("insert: token 2**64", I, lambda: store.insert(llama, t60[:-1] + [2**64], c60), "error", None),
            ("insert: out-of-vocabulary token", I, lambda: store.insert(llama, t60[:-1] + [5000], c60), "error",
             None),
            ("insert: cache longer than its tokens", I, lambda: store.insert(llama, t60[:50], c60), "error", None),
            ("insert: layers of different lengths", I, lambda: store.insert(llama, t60, self.ragged()), "error",
             None),
            ("insert: offset beyond the arrays", I, lambda: store.insert(llama, self.fresh(), self.short_arrays()),
             "error", None),
        ]

    def other_model_cases(self) -> list[Case]:
        import mlx.core as mx
        store, zoo, llama, gemma, gt = self.store, self.zoo, self.llama, self.gemma, self.gt
        t60, c60, t_other = self.t60, self.c60, self.t_other
        return [
            ("insert: gemma3 cache under tiny-llama", I,
             lambda: store.insert(llama, gt, zoo.prefill("gemma", gt)), "not_persisted", None),
            ("insert: tiny-llama cache under tiny-gemma3", I, lambda: store.insert(gemma, t60, c60), "not_persisted",
             None),
            ("insert: synthetic 2-layer cache under tiny-llama", I,
             lambda: store.insert(llama, (t := self.fresh()), syn_cache("kv", t)), "not_persisted", None),
            ("insert: same classes, other shapes (another model)", I,
             lambda: store.insert(llama, self.fresh(), self.odd_cache()), "not_persisted", None),
            ("insert: same classes, other KV head count (4 x 32, another model)", I,
             lambda: store.insert(llama, self.ofresh(), self.other_kv(c60, 4, 32)), "not_persisted", None),
            ("insert: same classes, other head_dim (2 x 16, another model)", I,
             lambda: store.insert(llama, self.ofresh(), self.other_kv(c60, 2, 16)), "not_persisted", None),
            ("insert: same classes and shapes, bfloat16 KV", I,
             lambda: store.insert(llama, self.ofresh(), self.other_kv(c60, 2, 32, mx.bfloat16)), "not_persisted",
             None),
            ("insert: prefill of tiny-llama with 4 KV heads under tiny-llama", I,
             lambda: store.insert(llama, t_other, self.llama_variant(num_key_value_heads=4)), "not_persisted",
             None),
            ("insert: prefill of tiny-llama with head_dim 16 under tiny-llama", I,
             lambda: store.insert(llama, t_other, self.llama_variant(head_dim=16)), "not_persisted", None),
            ("insert: tiny-gemma3 classes, other head_dim (2 x 64) under tiny-gemma3", I,
             lambda: store.insert(gemma, self.ofresh(), self.other_kv(self.g60, 2, 64)), "not_persisted", None),
            ("insert: tiny-llama's own cache, arrays of batch 2", I,
             lambda: store.insert(llama, self.ofresh(), self.reshaped(c60, True)), "not_persisted", None),
            ("insert: tiny-llama's own cache, arrays given a fifth axis", I,
             lambda: store.insert(llama, self.ofresh(), self.reshaped(c60, False)), "not_persisted", None),
            ("insert: tiny-gemma3's own cache, arrays of batch 2", I,
             lambda: store.insert(gemma, self.ofresh(), self.reshaped(self.g60, True)), "not_persisted", None),
        ]

    def bad_cache_cases(self) -> list[Case]:
        store, llama, t60, c60 = self.store, self.llama, self.t60, self.c60
        return [
            ("insert: cache=[]", I, lambda: store.insert(llama, t60, []), "error", None),
            ("insert: cache=None", I, lambda: store.insert(llama, t60, None), "error", None),
            ("insert: cache of ints", I, lambda: store.insert(llama, t60, [1, 2, 3]), "error", None),
            ("insert: cache_type='bogus'", I, lambda: store.insert(llama, t60, c60, cache_type="bogus"), "error",
             None),
            ("insert: tokens=None", I, lambda: store.insert(llama, None, c60), "error", None),
            (f"insert: {self.msg.get('huge_insert', 100_000)} tokens, cache of the first 60", F, self.insert_huge,
             "prefix", self.huge[:60] + [7]),
        ]


def op_bad_input(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Bad calls: each must raise ValueError (TokenError) naming the problem or be a
    documented miss, and leave the store (index, blobs, memory tier) unchanged."""
    from kvstore import KVStore
    store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=50)
    out = [_run_case(zoo, store, *case) for case in BadInputs(zoo, store, msg).cases()]
    store.close()
    return {"cases": out}


def _run_case(zoo: Zoo, store: Any, name: str, kind: str, call: Callable[[], Any], expect: str,
              hit_tokens: list[int] | None) -> dict:
    """Make one call and judge it: what it did, whether the store (and the memory tier)
    changed, and ``ok``."""
    store.flush()
    before = (logical_dump(store), _memory_keys(store))
    refused_before = store.stats()["unpersistable"]
    t0 = time.perf_counter()
    r: dict[str, Any] = {"case": name, "expect": expect}
    _call_case(zoo, store, r, kind, call, hit_tokens, refused_before)
    r["seconds"] = round(time.perf_counter() - t0, 3)
    store.flush()
    after = (logical_dump(store), _memory_keys(store))
    r["unchanged"] = before[0] == after[0]
    r["memory_unchanged"] = before[1] == after[1]
    if before != after:
        r["changed"] = [k for k in ("index", "files") if before[0][k] != after[0][k]] + (
            ["memory"] if before[1] != after[1] else [])
    _judge_case(r, kind, expect)
    return r


def _call_case(zoo: Zoo, store: Any, r: dict, kind: str, call: Callable[[], Any], hit_tokens: list[int] | None,
               refused_before: int) -> None:
    """The call's outcome in ``r``: returned (with n, source, and whether a hit restores
    correctly), ValueError/TokenError with its message, or escaped."""
    try:
        with LogCapture() as logs:
            got = call()
            store.flush()  # an insert's disk half (its layout check included) runs on the writer thread
        r["refused"] = store.stats()["unpersistable"] > refused_before
        if logs.records:
            r["warning"] = logs.records[0][:300]
        r["outcome"] = "returned"
        if kind == F:
            r["n"] = got.n
            r["source"] = got.source
            if got.cache is not None and got.n:
                ok, why = zoo.check("llama", hit_tokens or [], got.cache, got.n) if hit_tokens else (False, "unexpected hit")
                r["restore_ok"] = ok
                if not ok:
                    r["wrong"] = why
    except ValueError as e:
        r["outcome"] = type(e).__name__
        r["message"] = str(e)[:300]
    except Exception as e:
        r["outcome"] = "escaped"
        r["exception"] = exc_info(r["case"], e)
        r["message"] = f"{type(e).__name__}: {e}"[:300]


def _judge_case(r: dict, kind: str, expect: str) -> None:
    """``r["ok"]``: the outcome is what ``expect`` allows, the store is unchanged (a hit
    may touch its entry and promote it to memory), no wrong hit, under a minute."""
    raised = r["outcome"] in ("ValueError", "TokenError")
    miss = r["outcome"] == "returned" and kind == F and r.get("n") == 0
    prefix = r["outcome"] == "returned" and kind == F and r.get("n", 0) > 0 and bool(r.get("restore_ok"))
    ok = {"error": raised, "miss": miss, "error_or_miss": raised or miss, "prefix": prefix,
          "error_or_prefix": raised or prefix,
          "not_persisted": raised or (r["outcome"] == "returned" and r.get("refused"))}[expect]
    if expect == "not_persisted":
        same = r["unchanged"]
    else:  # a hit updates last_used / hits and promotes to memory; nothing else may change
        same = prefix or (r["unchanged"] and r["memory_unchanged"])
    r["ok"] = bool(ok and same and "wrong" not in r and r["seconds"] < 60)
    if r["seconds"] > 5:
        r["slow"] = True
    if not r["ok"] and r["case"] in LIMITATIONS:
        r["limitation"] = LIMITATIONS[r["case"]]


# ======================================================================= parent half


def run_bad_input(ctx: Ctx) -> dict:
    """All the bad calls in one worker; each case is a trial."""
    t = Tally("bad_input")
    d = ctx.work / "badinput"
    shutil.rmtree(d, ignore_errors=True)
    res = ctx.misc.call({"op": "bad_input", "dir": str(d), "seed": ctx.seed,
                         "huge_fetch": ctx.size["huge_fetch"], "huge_insert": ctx.size["huge_insert"]}, timeout=1800)
    if res.get("crashed") or res.get("harness_error"):
        t.add_check(res, phase="bad input")
        return t.result()
    for r in res["cases"]:
        t.c["trials"] += 1
        if r["outcome"] == "escaped":
            t.c["escaped_exceptions"] += 1
        if r.get("wrong"):
            t.c["wrong_restores"] += 1
        if not r["ok"] and r.get("limitation"):
            t.info.setdefault("known_limitations", []).append({"case": r["case"], "why": r["limitation"]})
        elif not r["ok"]:
            t.c["failed_cases"] += 1
            t.fail(f"bad input: {r['case']}", **{k: v for k, v in r.items() if k not in ("case", "exception")},
                   tb=(r.get("exception") or {}).get("tb", "")[-600:])
        t.outcomes[r["outcome"]] += 1
    t.info["cases"] = [{k: v for k, v in r.items() if k != "exception"} for r in res["cases"]]
    shutil.rmtree(d, ignore_errors=True)
    return t.result()
