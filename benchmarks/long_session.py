"""Long conversations (issue 47, item 3): a conversation growing over ``TURNS`` turns to
``--tokens`` tokens of SmolLM2-shaped synthetic KV (float32 ``KVCache`` layers, no
prefill), persisted at every turn, then restored in fresh processes.

- writes: pack bytes each turn's persist wrote (``bytes_written``) against the KV bytes
  of the tokens that turn added; in all, against the final conversation's KV bytes
  (goal <= 1.1x: a turn writes its new chunks and one tail, never the history again);
- restore: the conversation at 1/8, 1/4, 1/2 and all of its length, each read by
  ``KVStore.fetch`` + ``mx.eval`` of every array in a new process (page cache warm:
  the files were just written; median of ``--reps``), its time and its peak growth of
  resident memory (``VmHWM`` minus ``VmRSS`` before the fetch) against the KV bytes
  (goal <= 1.05x); linear means the full length within 10% of 8x the 1/8 length;
- ``kvstore ls`` / ``inspect`` / ``gc --dry-run`` on the store, each a new process.

``--base DIR`` restores with the kvstore of another checkout too, in the same rounds
(before/after a change). ``python -m benchmarks.long_session --tokens 65536`` writes
``results/long_session.json``; the size is what fits the machine's memory and time.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common as C
from .bandwidth import child_in

NAME = "long_session"
SHAPE = "smollm2"
TURNS = 40
FRACTIONS = (5, 10, 20, 40)  # restored after these turns: 1/8, 1/4, 1/2, all of the length


def _tokens(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(1, 30000) for _ in range(n)]


def restore_child(cache_dir: str, n_final: int, n: int) -> dict[str, Any]:
    """Child: a new process restores the first ``n`` tokens of the conversation and
    evaluates every array; time and peak resident growth."""
    import mlx.core as mx

    from kvstore import KVStore

    tokens = _tokens(n_final)[:n]
    store, open_s = C.timed(KVStore, cache_dir, max_entries=2)
    rss0 = C.status_kb("VmRSS")
    t0 = time.perf_counter()
    got = store.fetch(C.bench_identity(NAME), tokens)
    mx.eval([a for c in got.cache or [] for a in (c.keys, c.values)])
    seconds = time.perf_counter() - t0
    peak = C.status_kb("VmHWM")
    out = {"n": got.n, "source": got.source, "seconds": seconds, "open_s": open_s,
           "peak_growth_bytes": (peak - rss0) * 1024, "loadavg1": C.loadavg1()}
    store.close()
    return out


def build(d: Path, n_final: int, log: Any, *, model: Any = None, tokens: list[int] | None = None,
          shape_name: str = SHAPE, n_turns: int = TURNS) -> dict[str, Any]:
    """The conversation persisted turn by turn in ``d`` (``n_turns`` turns to ``n_final``
    tokens, each a longer prefix of ``tokens``, stored for ``model``: a model directory
    or an identity, this benchmark's by default); what each persist wrote."""
    from kvstore import KVStore

    shape = C.kv_shape(shape_name)
    tokens = tokens if tokens is not None else _tokens(n_final)
    ident = model if model is not None else C.bench_identity(NAME)
    cache, turns = None, []
    with KVStore(d, max_entries=1, queue_size=4) as store:
        for t in range(n_turns):
            lo, hi = n_final * t // n_turns, n_final * (t + 1) // n_turns
            cache = C.extend_cache(cache, shape, hi - lo, seed=t, drop_old=True)
            w0 = store.stats()["bytes_written"]
            t0 = time.perf_counter()
            store.insert(ident, tokens[:hi], cache)
            store.flush()
            took = time.perf_counter() - t0
            wrote = store.stats()["bytes_written"] - w0
            store.memory.clear()  # the memory tier would hold the previous turn's arrays: 2x the KV at 128k
            turns.append({"turn": t + 1, "tokens": hi, "new_kv_bytes": (hi - lo) * shape["bytes_per_token"],
                          "bytes_written": wrote, "seconds": took})
            log(f"    turn {t + 1}: {hi} tokens, wrote {wrote / turns[-1]['new_kv_bytes']:.3f}x its new KV in {took:.1f} s")
        store.memory.clear()
    del cache
    C.unload()
    total = sum(t["bytes_written"] for t in turns)
    final = n_final * shape["bytes_per_token"]
    log(f"  {n_turns} turns to {n_final} tokens: wrote {C.gb(total):.2f} GB for {C.gb(final):.2f} GB of KV "
        f"({total / final:.3f}x)")
    return {"turns": turns, "total_written": total, "final_kv_bytes": final, "written_vs_kv": total / final,
            "max_turn_written_vs_new": max(t["bytes_written"] / t["new_kv_bytes"] for t in turns)}


def _cli(d: Path, *args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--cache-dir", str(d)], check=True,
                   capture_output=True, cwd=C.REPO_ROOT)
    return time.perf_counter() - t0


def _entry_id(d: Path) -> str:
    import json

    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "ls", "--json", "--cache-dir", str(d)], check=True,
                       capture_output=True, text=True, cwd=C.REPO_ROOT)
    doc = json.loads(p.stdout)
    groups = doc["identities"] if isinstance(doc, dict) and "identities" in doc else doc
    entries = [e for g in groups for e in g["entries"]]
    return max(entries, key=lambda e: e["tokens"])["id"]


def run(ctx: C.Context, n_final: int, reps: int, base: str | None) -> dict[str, Any]:
    started = time.perf_counter()
    d = ctx.scratch("long-session")
    writes = build(d, n_final, ctx.log)
    trees = {"this": None} | ({"base": base} if base else {})
    sizes = [n_final * f // TURNS for f in FRACTIONS]
    kv = C.kv_shape(SHAPE)["bytes_per_token"]
    reads: dict[str, dict[str, list[dict]]] = {t: {str(n): [] for n in sizes} for t in trees}
    for rep in range(reps):
        for n in sizes:
            for tree, path in (trees.items() if rep % 2 == 0 else reversed(trees.items())):
                args = {"cache_dir": str(d), "n_final": n_final, "n": n}
                r = (C.run_child(f"{NAME}:restore_child", args) if path is None
                     else child_in(path, f"{NAME}:restore_child", args))
                assert r["n"] == n and r["source"] == "disk", r
                reads[tree][str(n)].append(r)
                ctx.log(f"    {tree} {n} tok: {C.fmt(r['seconds'], 's')}, peak +{r['peak_growth_bytes'] / (n * kv):.3f}x KV, "
                        f"load {r['loadavg1']}")
    restore = {}
    for tree in trees:
        med = {n: C.median([r["seconds"] for r in rs]) for n, rs in reads[tree].items()}
        peak = {n: max(r["peak_growth_bytes"] for r in rs) / (int(n) * kv) for n, rs in reads[tree].items()}
        first, last = str(sizes[0]), str(sizes[-1])
        restore[tree] = {"seconds": med, "peak_vs_kv": peak,
                         "last_vs_8x_first": med[last] / (8 * med[first]),
                         "gbps": {n: C.gb(int(n) * kv) / s for n, s in med.items()}}
    ident = _entry_id(d)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    cli = {"python_c_pass": time.perf_counter() - t0, "ls": _cli(d, "ls"), "inspect": _cli(d, "inspect", ident),
           "gc_dry_run": _cli(d, "gc", "--dry-run")}
    ctx.log(f"  cli: {cli} (load {C.loadavg1()})")
    medians = {"writes": {k: v for k, v in writes.items() if k != "turns"}, "restore": restore, "cli_s": cli}
    doc = C.document(NAME, ctx, {"shape": SHAPE, "tokens": n_final, "turns": TURNS, "reps": reps,
                                 "restored_sizes": sizes, "base": base},
                     {"writes": writes, "reads": reads}, medians, medians,
                     ["page cache warm: the restores read files just written (each in a new process)"], started)
    return doc


def report(doc: dict[str, Any]) -> str:
    m = doc["medians"]
    w = m["writes"]
    out = C.table(f"Long conversation: {doc['settings']['turns']} turns to {doc['settings']['tokens']} tokens "
                  f"({doc['settings']['shape']} float32 KV)",
                  ["written / final KV", "worst turn written / its new KV", "python -c pass", "ls", "inspect",
                   "gc --dry-run"],
                  [[f"{w['written_vs_kv']:.3f}x", f"{w['max_turn_written_vs_new']:.2f}x",
                    C.fmt(m["cli_s"].get("python_c_pass"), "s"), C.fmt(m["cli_s"]["ls"], "s"),
                    C.fmt(m["cli_s"]["inspect"], "s"), C.fmt(m["cli_s"]["gc_dry_run"], "s")]])
    rows = []
    for tree, r in m["restore"].items():
        for n, s in r["seconds"].items():
            rows.append([tree, n, C.fmt(s, "s"), f"{r['gbps'][n]:.2f}", f"{r['peak_vs_kv'][n]:.3f}x"])
        rows.append([tree, "all / 8x first", f"{r['last_vs_8x_first']:.2f}", "", ""])
    return out + "\n\n" + C.table("Restore in a new process (fetch + eval, median)",
                                  ["kvstore", "tokens", "time", "GB/s", "peak growth / KV"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_session", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", default=None, help="another checkout whose kvstore restores too")
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=NAME, help="JSON file name (without .json)")
    a = ap.parse_args(argv)
    return C.run_alone("kvstore-long-", a.out, a.name, False, report=report,
                       body=lambda ctx: run(ctx, a.tokens, a.reps, a.base))

if __name__ == "__main__":
    raise SystemExit(main())
