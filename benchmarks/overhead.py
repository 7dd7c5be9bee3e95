"""Request-path overhead: what kvstore costs on the request thread, against the prefill.

For SmolLM2 float32 at 1k and 2k prompt tokens (tiny-llama with --quick):

- prefill: a cold prefill of the prompt (steps of 512, as stream_generate) + first token;
- insert: ``KVStore.insert`` of the prefilled cache (snapshot views, checksumless host
  views, key, memory-tier insert, queueing); the write itself runs on the writer thread and
  is reported separately (``flush`` waits for it) as background seconds;
- memory fetch, exact: ``fetch`` of a stored prompt (memory tier, fresh cache objects);
- memory fetch, prefix: ``fetch`` of a stored prefix + a new question: memory hit after
  the disk index is consulted for a longer prefix;
- miss: ``fetch`` of a prompt nobody stored (memory trie + disk index lookup).

Each store call is repeated (median reported); the prefill runs once per length.

Plus two start-up rows (issue 31.11), so a regression shows:

- ``kvstore ls`` on an empty cache directory, each run a fresh process (median of
  ``CLI_RUNS``), against ``python -c pass`` in the same run: the maintenance commands start
  without importing MLX, mlx-lm or the disk tier's lookup code (issue 21). Run as this
  environment runs Python (``PYTHONDONTWRITEBYTECODE`` compiles every module each time) and
  as an installed package runs (its bytecode cached: ``PYTHONPYCACHEPREFIX``, one warm-up).
- a new process's ``KVStore`` open + first lookup on a store of ``OPEN_ENTRIES`` entries
  (2,000 with --quick) after a page-cache drop (median of ``OPEN_RUNS`` fresh processes;
  the ``scale`` benchmark's child): what a server restart costs before its first hit.
"""

from __future__ import annotations

import random
import time
from typing import Any

from . import common as C

NAME = "overhead"
REPS = 5
CLI_RUNS = 10
OPEN_ENTRIES = 20_000
OPEN_RUNS = 5
PREFILL_STEP = 512


def _prefill(model: Any, tokens: list[int]) -> tuple[list[Any], float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    logits = None
    for i in range(0, len(tokens), PREFILL_STEP):
        logits = model(mx.array([tokens[i: i + PREFILL_STEP]]), cache=cache)
        mx.eval(logits)
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
    return cache, time.perf_counter() - t0


def cli_startup(ctx: C.Context) -> dict[str, Any]:
    """Median wall time of ``kvstore ls`` on an empty directory and of ``python -c pass``,
    each a fresh process (``CLI_RUNS`` of each, interleaved), compiling every module as
    this environment does and with the bytecode cached as an installed package has it."""
    import os
    import subprocess
    import sys

    d = ctx.scratch("cli-empty")
    from kvstore.cachedir import open_disk

    open_disk(d).close()  # an empty store: an index, no entries
    cached = dict(os.environ, PYTHONPYCACHEPREFIX=str(ctx.scratch("pycache")))
    cached.pop("PYTHONDONTWRITEBYTECODE", None)
    ls = [sys.executable, "-m", "kvstore.cli", "ls", "--cache-dir", str(d)]
    cmds = {"ls": (ls, None), "ls_bytecode": (ls, cached), "python": ([sys.executable, "-c", "pass"], None)}
    subprocess.run(ls, check=True, capture_output=True, env=cached)  # writes the bytecode cache
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(CLI_RUNS):
        for k, (cmd, env) in cmds.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, env=env)
            times[k].append(time.perf_counter() - t0)
    out = {"ls_empty_s": C.median(times["ls"]), "ls_empty_bytecode_s": C.median(times["ls_bytecode"]),
           "python_s": C.median(times["python"]), "runs": times,
           "dont_write_bytecode": bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))}
    out["ls_minus_python_s"] = out["ls_empty_s"] - out["python_s"]
    ctx.log(f"  kvstore ls (empty dir): {C.fmt(out['ls_empty_s'], 's')} (bytecode cached "
            f"{C.fmt(out['ls_empty_bytecode_s'], 's')}), python -c pass {C.fmt(out['python_s'], 's')}")
    return out


def crash_child(cache_dir: str, seed: int) -> dict[str, Any]:
    """Child: a writer opens the store, commits one new entry and is SIGKILLed before any
    clean close (the state a crash, the OOM killer or a power loss leaves). Never returns."""
    import os
    import signal

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore import KVStore

    from .scale import DIM, HEADS

    store = KVStore(cache_dir, max_entries=10)
    rng = random.Random(seed)
    p = [rng.randrange(1, 50000) for _ in range(48)]
    c = KVCache()
    base = mx.zeros((1, HEADS, len(p) + 1, DIM), dtype=mx.float16)
    c.keys, c.values, c.offset = base[..., : len(p), :], base[..., 1:, :], len(p)
    store.insert(C.bench_identity("scale"), p, [c])
    store.flush()
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def _crash(cache_dir: str, seed: int, tree: str | None = None) -> None:
    """``crash_child`` in a new process (with the kvstore of checkout ``tree`` if given)."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "benchmarks", "--child", "overhead:crash_child",
           C.json.dumps({"cache_dir": cache_dir, "seed": seed})]
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    proc = subprocess.run(cmd, cwd=tree or C.REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != -9:
        raise RuntimeError(f"crash child ended with {proc.returncode}, not SIGKILL:\n{proc.stderr[-2000:]}")


def open_startup(ctx: C.Context, n: int | None = None, base_tree: str | None = None) -> dict[str, Any]:
    """A new process's open + first lookup on a store of ``OPEN_ENTRIES`` entries after a
    page-cache drop (``scale.open_child``; median of ``OPEN_RUNS``), after a clean close
    and, as its own row, after an unclean stop (a writer SIGKILLed after a commit before
    each run: the open finds no matching clean stamp). ``base_tree``: the same runs, interleaved,
    with the kvstore of that checkout too (rows ``clean_base``, ``unclean_base``)."""
    from .bandwidth import child_in

    n = n or (2_000 if ctx.quick else OPEN_ENTRIES)
    d = ctx.scratch("open-startup")
    out: dict[str, Any] = {"entries": n}
    out["build"] = _build(ctx, d, n)
    out["index_bytes"] = (d / "index" / "data.mdb").stat().st_size
    args = {"cache_dir": str(d), "n_entries": n, "samples": 0, "drop": ctx.drop}
    trees: dict[str, str | None] = {"": None} | ({"_base": base_tree} if base_tree else {})
    for case in ("clean", "unclean"):
        got: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
        for k in range(3 if ctx.quick else OPEN_RUNS):  # --quick: the suite has a time limit
            for suffix, tree in trees.items():
                if case == "unclean":
                    _crash(str(d), seed=2 * k + bool(suffix), tree=tree)
                got[suffix].append(C.run_child("scale:open_child", args) if tree is None
                                   else child_in(tree, "scale:open_child", args))
        for suffix, runs in got.items():
            _open_row(ctx, out, case + suffix, runs, n)
    out["unclean_vs_clean"] = out["unclean"]["open_plus_first_lookup_s"] / out["clean"]["open_plus_first_lookup_s"]
    return out


def build_child(cache_dir: str, n: int) -> dict[str, Any]:
    """Child: ``n`` entries of ``scale_prompts`` inserted through ``KVStore.insert`` and a
    clean close (the next open matches the stamp, as a restart does)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore import KVStore

    from .scale import DIM, HEADS, scale_prompts

    ident = C.bench_identity("scale")
    base = mx.random.normal((1, HEADS, 1024, DIM), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(base)
    t0 = time.perf_counter()
    store = KVStore(cache_dir, max_entries=10, queue_size=4096)
    for i, p in enumerate(scale_prompts(n)):
        c = KVCache()
        c.keys, c.values, c.offset = base[..., : len(p), :], base[..., 1: len(p) + 1, :], len(p)
        store.insert(ident, p, [c])
        if i % 2048 == 2047:
            store.flush()  # bounded memory: a 200k build holds no more than a queue of snapshots
    store.close()
    return {"seconds": time.perf_counter() - t0}


def _build(ctx: C.Context, d: Any, n: int) -> dict[str, Any]:
    """Build the store in a child. Under Debian's ``eatmydata`` when the machine has it
    (fsync becomes a no-op for the builder only: 200k entries in minutes instead of
    ~45 min of syncs here; the files and records are the same, and every open measured
    after it runs without it)."""
    import shutil

    wrap = shutil.which("eatmydata")
    got = C.run_child("overhead:build_child", {"cache_dir": str(d), "n": n}, timeout=4 * 3600,
                      prefix=(wrap,) if wrap else ())
    ctx.log(f"  built {n} entries in {C.fmt(got['seconds'], 's')}" + (" (under eatmydata)" if wrap else ""))
    return {"seconds": got["seconds"], "fsync": "eatmydata (off)" if wrap else "on"}


def _open_row(ctx: C.Context, out: dict[str, Any], case: str, runs: list[dict[str, Any]], n: int) -> None:
    """The median row of ``runs`` as ``out[case]`` (``clean`` also at the top level, as before)."""
    total = [r["open_s"] + r["first_lookup_s"] for r in runs]
    row = {"open_plus_first_lookup_s": C.median(total), "runs": total,
           "open_s": C.median([r["open_s"] for r in runs]),
           "first_lookup_s": C.median([r["first_lookup_s"] for r in runs]),
           "page_cache_dropped": all(r["page_cache"].get("dropped") for r in runs),
           "page_cache_method": runs[0]["page_cache"].get("method"),
           "sources": [r["first_lookup_source"] for r in runs]}
    if case == "clean":
        out.update(row)  # the row earlier runs reported, under the same keys
    out[case] = row
    ctx.log(f"  open + first lookup, {case} stop, {n} entries, page cache "
            f"{'dropped' if row['page_cache_dropped'] else 'NOT dropped'}: {C.fmt(row['open_plus_first_lookup_s'], 's')}")


def run(ctx: C.Context) -> dict[str, Any]:
    from kvstore import KVStore

    started = time.perf_counter()
    name, lengths = ("tiny-llama", [256, 512]) if ctx.quick else ("smollm2", [1024, 2048])
    model, tok, path = C.load_model(name)
    C.warm_up(model)
    rows = []
    for L in lengths:
        ctx.log(f"  {name} {L} tokens ...")
        d = ctx.scratch(f"overhead-{L}")
        store = KVStore(d, max_entries=64, queue_size=64)
        store.identity(path)
        prompt = C.text_tokens(tok, L, seed=L + 1)
        cache, prefill_s = _prefill(model, prompt)
        variants = [prompt[:-1] + [int(prompt[-1]) + 1 + k] for k in range(REPS)]
        ins, bg = [], []
        for k, toks in enumerate(variants):
            _, dt = C.timed(store.insert, path, toks, cache)
            ins.append(dt)
            w0 = store.stats()["write_seconds"]
            store.flush()
            bg.append(store.stats()["write_seconds"] - w0)
        exact, prefix, miss = [], [], []
        rng = random.Random(L)
        for k in range(REPS):
            got, dt = C.timed(store.fetch, path, variants[k])
            assert got.source == "memory" and got.n == L, (got.source, got.n)
            exact.append(dt)
            q = prompt[: L - 16] + C.question_tokens(tok, 16, k)
            got, dt = C.timed(store.fetch, path, q)
            prefix.append(dt)
            absent = [rng.randrange(1, 30000) for _ in range(L)]
            got, dt = C.timed(store.fetch, path, absent)
            assert got.source is None
            miss.append(dt)
        st = store.stats()
        store.close()
        med = {"prefill_s": prefill_s, "insert_s": C.median(ins), "insert_max_s": max(ins),
               "memory_fetch_exact_s": C.median(exact), "memory_fetch_prefix_s": C.median(prefix),
               "miss_fetch_s": C.median(miss), "background_write_first_s": bg[0],
               "background_write_tail_s": C.median(bg[1:]),
               "kv_bytes": C.cache_bytes(cache)}
        med["insert_vs_prefill"] = med["insert_s"] / prefill_s
        med["memory_fetch_exact_vs_prefill"] = med["memory_fetch_exact_s"] / prefill_s
        med["memory_fetch_prefix_vs_prefill"] = med["memory_fetch_prefix_s"] / prefill_s
        med["miss_vs_prefill"] = med["miss_fetch_s"] / prefill_s
        med["background_write_vs_prefill"] = bg[0] / prefill_s
        rows.append({"tokens": L, "insert_s": ins, "background_write_s": bg, "memory_fetch_exact_s": exact,
                     "memory_fetch_prefix_s": prefix, "miss_fetch_s": miss, "prefill_s": prefill_s,
                     "dropped_writes": st.get("dropped_writes"), "medians": med})
        ctx.log(f"    prefill {C.fmt(prefill_s, 's')}, insert {C.fmt(med['insert_s'], 's')} "
                f"({med['insert_vs_prefill'] * 100:.2f}% of prefill), memory fetch {C.fmt(med['memory_fetch_exact_s'], 's')}")
        del cache
    del model
    C.unload()
    medians = {str(r["tokens"]): r["medians"] for r in rows}
    headline = {k: {"insert_s": v["insert_s"], "insert_vs_prefill": v["insert_vs_prefill"],
                    "memory_fetch_exact_s": v["memory_fetch_exact_s"], "prefill_s": v["prefill_s"]}
                for k, v in medians.items()}
    settings = {"model": name, "lengths": lengths, "reps": REPS, "prefill_step": PREFILL_STEP,
                "prefill_runs": 1, "kv_dtype": "float32"}
    notes = ["insert returns before the write; the write (fsynced blobs + index commit) runs on the "
             "writer thread: 'background write' is its duration, first insert (all chunks) and later "
             "inserts of the same prefix (tail only).",
             "On a machine with few cores the background write competes with the next request for CPU."]
    doc = C.document(NAME, ctx, settings, rows, medians, headline, notes, started)
    doc["cli_startup"] = cli_startup(ctx)
    doc["open_startup"] = open_startup(ctx)
    return doc


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]:
        m = r["medians"]
        rows.append([r["tokens"], C.fmt(m["prefill_s"], "s"), C.fmt(m["insert_s"], "s"),
                     f"{m['insert_vs_prefill'] * 100:.2f}%", C.fmt(m["memory_fetch_exact_s"], "s"),
                     C.fmt(m["memory_fetch_prefix_s"], "s"), C.fmt(m["miss_fetch_s"], "s"),
                     f"{C.fmt(m['background_write_first_s'], 's')} / {C.fmt(m['background_write_tail_s'], 's')}"])
    out = C.table(f"Request-path overhead ({doc['settings']['model']}, median of {doc['settings']['reps']})",
                  ["tokens", "prefill", "insert()", "insert/prefill", "memory fetch (exact)",
                   "memory fetch (prefix)", "miss fetch", "bg write first / tail"], rows)
    cli = doc.get("cli_startup")
    if cli:
        out += "\n\n" + C.table(f"CLI start-up (median of {len(cli['runs']['ls'])} fresh processes)",
                                ["command", "wall time"],
                                [["kvstore ls (empty directory)", C.fmt(cli["ls_empty_s"], "s")],
                                 ["kvstore ls, bytecode cached", C.fmt(cli.get("ls_empty_bytecode_s"), "s")],
                                 ["python -c pass (baseline)", C.fmt(cli["python_s"], "s")]])
    op = doc.get("open_startup")
    if op:
        out += "\n\n" + open_table(op)
    return out


def open_table(op: dict[str, Any]) -> str:
    """The open + first lookup rows: after a clean close and after an unclean stop."""
    rows = [[case, C.fmt(op[case]["open_s"], "s"), C.fmt(op[case]["first_lookup_s"], "s"),
             C.fmt(op[case]["open_plus_first_lookup_s"], "s")] for case in ("clean", "unclean", "clean_base", "unclean_base") if case in op]
    if not rows:  # a result from before the unclean row
        rows = [["clean", C.fmt(op["open_s"], "s"), C.fmt(op["first_lookup_s"], "s"),
                 C.fmt(op["open_plus_first_lookup_s"], "s")]]
    return C.table(f"New process: open + first lookup, {op['entries']} entries "
                   f"(page cache {'dropped' if op['page_cache_dropped'] else 'not dropped'})",
                   ["last stop", "open", "first lookup", "open + first lookup"], rows)


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    model = doc["settings"]["model"]
    for r in doc["raw"]:
        m = r["medians"]
        out.append((f"insert() on the request thread, {model} {r['tokens']} tok",
                    f"{C.fmt(m['insert_s'], 's')} ({m['insert_vs_prefill'] * 100:.2f}% of prefill)",
                    f"prefill {C.fmt(m['prefill_s'], 's')}; memory fetch {C.fmt(m['memory_fetch_exact_s'], 's')}; "
                    f"miss {C.fmt(m['miss_fetch_s'], 's')}; background write {C.fmt(m['background_write_first_s'], 's')}"))
    cli = doc.get("cli_startup")
    if cli:
        out.append(("kvstore ls on an empty directory", C.fmt(cli["ls_empty_s"], "s"),
                    f"python -c pass {C.fmt(cli['python_s'], 's')} (fresh processes, median)"))
    op = doc.get("open_startup")
    if op:
        out.append((f"new process: open + first lookup, {op['entries']} entries",
                    C.fmt(op["open_plus_first_lookup_s"], "s"),
                    f"page cache {'dropped' if op['page_cache_dropped'] else 'not dropped'} (median of {len(op['runs'])})"))
        if "unclean" in op:
            out.append((f"new process after an unclean stop: open + first lookup, {op['entries']} entries",
                        C.fmt(op["unclean"]["open_plus_first_lookup_s"], "s"),
                        f"{op['unclean_vs_clean']:.2f}x the clean open (median of {len(op['unclean']['runs'])})"))
    return out


def startup_main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.overhead [--entries N] [--out DIR]``: the start-up rows only
    (CLI start-up, open after a clean and an unclean stop), without the model prefills;
    JSON to ``<out>/overhead_startup.json``."""
    import argparse
    import shutil
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m benchmarks.overhead")
    ap.add_argument("--entries", type=int, default=OPEN_ENTRIES)
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-drop", action="store_true")
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--base", default=None, help="another checkout whose open is measured alongside")
    a = ap.parse_args(argv)
    work = C.Path(tempfile.mkdtemp(prefix="kvstore-overhead-"))
    started = time.perf_counter()
    try:
        ctx = C.Context(quick=False, work=work, out=C.Path(a.out), drop=not a.no_drop)
        doc = C.document("overhead_startup", ctx, {"entries": a.entries, "open_runs": OPEN_RUNS,
                                                   "cli_runs": CLI_RUNS}, [], {}, {}, [], started)
        if not a.skip_cli:
            doc["cli_startup"] = cli_startup(ctx)
        doc["open_startup"] = open_startup(ctx, a.entries, a.base)
        C.write_json(ctx.out, "overhead_startup", doc)
        print(open_table(doc["open_startup"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(startup_main())
