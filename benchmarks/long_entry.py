"""One long entry restored, for every way an entry is made (issue 56): the table behind
``tests/system/test_restore_linearity.py`` (which counts the work; this times it).

At each of ``--tokens`` lengths (one at a time; its scratch removed after its rows), one
entry of that many tokens of SmolLM2-shaped synthetic KV (float32 ``KVCache`` layers, no
prefill; the model directory's identity) is made four ways, each in its own directory:

- ``one_insert``: one ``KVStore.insert`` of the whole cache (that store is machine A of
  the shared tier too: it publishes the entry);
- ``many_turns``: a conversation grown over ``TURNS`` turns, persisted each turn
  (``long_session.build``: each turn's new chunks in a pack of their own);
- ``import``: ``kvstore import`` of mlx-lm's ``save_prompt_cache`` file of the cache,
  carrying its token ids (``kvstore.cli.transfer.TOKENS_KEY``);
- ``shared``: a shared hit, restored by machine B (a new, empty directory per read) from
  a local redis-server on loopback (the tests' binary: ``tests.support.redis_servers``);

and restored by ``KVStore.fetch`` + ``mx.eval`` of every array, each read in a NEW
process, page cache warm (the files read just before) and dropped (``C.drop_page_cache``;
not for ``shared``, whose bytes Redis holds in RAM), in interleaved rounds (every method
once per round, rotating order), median of ``--reps``. Beside them ``mlx_lm``: mlx-lm's
``load_prompt_cache`` + ``mx.eval`` of the import's file (the same cache). Per read: its
time per token, the bytes its read system calls returned (``rchar``) against the KV bytes,
its minor page faults (pages first touched) against the KV's pages, its peak resident
growth against the KV bytes. Linear: t(N) / t(first) against N / first, a ratio of
ratios ~1 at every length.

``python -m benchmarks.long_entry`` writes ``results/long_entry.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common as C
from . import long_session as LS

NAME = "long_entry"
DEFAULT_TOKENS = (16384, 65536, 131072)
QUICK_TOKENS = (2048, 8192)
SHAPES = {"smollm2": "smollm2", "tiny-llama": "tiny-llama"}  # model_builds name -> C.kv_shape name
TURNS = 20
WAYS = ("one_insert", "many_turns", "import", "shared")
METHODS = (*WAYS, "mlx_lm")
PAGE = 4096
# a restore of GBs over loopback must not be cut by the tier's production deadlines
SHARED_QUERY = "fetch_deadline=600&publish_deadline=600&flush_deadline=600&command_timeout=60"


def _tokens(n: int, vocab: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(1, vocab) for _ in range(n)]


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


# ----------------------------------------------------------------------------- the read


def read_child(method: str, cache_dir: str, model_dir: str, n: int, mlx_file: str, url: str,
               drop: bool, payload: int) -> dict[str, Any]:
    """Child: one restore of the ``n``-token entry by ``method`` in this fresh process
    (imports and the store's open first, then the page cache dropped when ``drop``, then
    the counted, timed read: fetch or ``load_prompt_cache``, and ``mx.eval`` of every
    array)."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore import KVStore

    tokens = _tokens(n, _vocab(Path(model_dir)))
    out: dict[str, Any] = {"loadavg1": C.loadavg1()}
    store = None
    if method != "mlx_lm":
        store, out["open_s"] = C.timed(KVStore, cache_dir, max_entries=2,
                                       shared=url if method == "shared" else False)
        store.identity(model_dir)  # derived (config files read) before the timed fetch
    paths = [mlx_file] if method == "mlx_lm" else [cache_dir]
    out["page_cache"] = (C.drop_page_cache(paths) if drop
                         else {"dropped": False, "method": "prewarmed by the parent"})
    before = C.proc_counters()
    t0 = time.perf_counter()
    if store is not None:
        got = store.fetch(model_dir, tokens)
        arrays = [a for c in got.cache or [] for a in (c.keys, c.values)]
        mx.eval(arrays)
        out.update(n=got.n, source=str(got.source))
    else:
        cache = load_prompt_cache(mlx_file)
        arrays = [a for c in cache for a in (c.keys, c.values)]
        mx.eval(arrays)
        out.update(n=cache[0].offset, source="file")
    out["seconds"] = time.perf_counter() - t0
    after = C.proc_counters()
    out.update(rchar=after["rchar"] - before["rchar"], minflt=after["minflt"] - before["minflt"],
               peak_growth_bytes=(after["hwm_kb"] - before["rss_kb"]) * 1024,
               restored_bytes=sum(int(a.nbytes) for a in arrays))
    out["ok"] = out["n"] == n and out["restored_bytes"] >= payload
    if store is not None:
        store.close()
    return out


# ----------------------------------------------------------------------------- the ways


def _import(mlx_file: Path, model_dir: Path, d: Path) -> None:
    subprocess.run([sys.executable, "-m", "kvstore.cli", "import", str(mlx_file), "--model", str(model_dir),
                    "--cache-dir", str(d)], check=True, capture_output=True, cwd=C.REPO_ROOT)


def make(ctx: C.Context, model_dir: Path, shape_name: str, n: int, url: str) -> dict[str, Any]:
    """The four entries of ``n`` tokens and mlx-lm's file; their directories and how long
    each took to make."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore import KVStore
    from kvstore.cli.transfer import TOKENS_KEY

    shape = C.kv_shape(SHAPES[shape_name])
    tokens = _tokens(n, _vocab(model_dir))
    dirs = {w: ctx.scratch(f"le-{n}-{w}") for w in ("one_insert", "many_turns", "import", "mlx_lm")}
    mlx_file = dirs["mlx_lm"] / "cache.safetensors"
    took: dict[str, float] = {}
    cache = C.synth_cache(shape, n, seed=n)
    payload = C.cache_bytes(cache)
    t0 = time.perf_counter()
    with KVStore(dirs["one_insert"], max_entries=1, shared=url) as store:  # machine A of the shared tier
        store.insert(model_dir, tokens, cache)
        assert store.writer is not None and store.shared is not None
        assert store.writer.flush(600), "the write did not finish"
        took["one_insert"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert store.shared.flush(600), "the publish did not finish"  # the writer's commit queued it
        took["shared_publish"] = time.perf_counter() - t0
        assert store.flush(600)
        published = store.stats()["shared_published"]
        store.memory.clear()
    assert published >= 1, f"nothing published ({published})"
    save_prompt_cache(str(mlx_file), cache, {"model": str(model_dir), TOKENS_KEY: json.dumps(tokens)})
    del cache
    C.unload()
    t0 = time.perf_counter()
    _import(mlx_file, model_dir, dirs["import"])
    took["import"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    turns = LS.build(dirs["many_turns"], n, lambda s: None, model=model_dir, tokens=tokens,
                     shape_name=SHAPES[shape_name], n_turns=TURNS)
    took["many_turns"] = time.perf_counter() - t0
    return {"dirs": dirs, "mlx_file": mlx_file, "payload": payload, "make_s": took,
            "many_turns_written_vs_kv": turns["written_vs_kv"],
            "files": {w: C.du(d) for w, d in dirs.items()}}


def _read(ctx: C.Context, m: str, made: dict[str, Any], model_dir: Path, n: int, url: str, state: str) -> dict:
    dirs, mlx_file = made["dirs"], made["mlx_file"]
    b = ctx.scratch(f"le-{n}-machine-b") if m == "shared" else None  # empty: every read a shared hit
    cache_dir = b if b is not None else dirs["import" if m == "mlx_lm" else m]
    if state == "warm" and m != "shared":
        C.warm_files([mlx_file] if m == "mlx_lm" else [cache_dir])
    args = {"method": m, "cache_dir": str(cache_dir), "model_dir": str(model_dir), "n": n,
            "mlx_file": str(mlx_file), "url": url, "drop": state == "cold" and ctx.drop,
            "payload": made["payload"]}
    try:
        r = C.run_child(f"{NAME}:read_child", args)
    finally:
        if b is not None:
            shutil.rmtree(b, ignore_errors=True)
    want = {"shared": "shared", "mlx_lm": "file"}.get(m, "disk")
    assert r["ok"] and r["source"] == want, (m, n, r)
    return r


def one_length(ctx: C.Context, server: Any, model_dir: Path, shape_name: str, n: int, reps: int,
               states: tuple[str, ...]) -> dict[str, Any]:
    """Every method's reads of the ``n``-token entries, interleaved; then its scratch and
    Redis emptied."""
    url = f"redis://127.0.0.1:{server.port}/0?{SHARED_QUERY}"
    ctx.log(f"  {n} tokens: making the entries ...")
    made = make(ctx, model_dir, shape_name, n, url)
    ctx.log(f"    made in {', '.join(f'{k} {v:.1f} s' for k, v in made['make_s'].items())}")
    reads: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in METHODS if s == "warm" or m != "shared"}
                                               for s in states}
    try:
        for rep in range(reps):
            for state in states:
                methods = list(reads[state])
                for m in methods[rep % len(methods):] + methods[: rep % len(methods)]:
                    r = _read(ctx, m, made, model_dir, n, url, state)
                    reads[state][m].append(r)
                    ctx.log(f"    {n} tok round {rep + 1}/{reps} {state} {m}: {C.fmt(r['seconds'], 's')}, "
                            f"read {r['rchar'] / made['payload']:.2f}x KV, "
                            f"faults {r['minflt'] * PAGE / made['payload']:.2f}x KV pages, "
                            f"peak +{r['peak_growth_bytes'] / made['payload']:.2f}x KV, load {r['loadavg1']}")
    finally:
        for d in made["dirs"].values():
            shutil.rmtree(d, ignore_errors=True)
        with server.client() as c:
            c.flushall()
    return {"tokens": n, "payload_bytes": made["payload"], "make_s": made["make_s"], "files": made["files"],
            "many_turns_written_vs_kv": made["many_turns_written_vs_kv"], "reads": reads,
            "page_cache_dropped": all(r["page_cache"]["dropped"] for r in
                                      [x for rs in reads.get("cold", {}).values() for x in rs]) if "cold" in reads else None}


# ----------------------------------------------------------------------------- medians


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """``{state: {method: {tokens: {...}}}}``: median time, per-token figures and the
    linearity ratio against the first length."""
    out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    first = rows[0]
    for row in rows:
        n, kv = row["tokens"], row["payload_bytes"]
        for state, per in row["reads"].items():
            for m, rs in per.items():
                s = C.median([r["seconds"] for r in rs]) or 0.0  # rs holds reps >= 1 reads
                cell = {"seconds": s, "us_per_token": s / n * 1e6,
                        "read_vs_kv": (C.median([r["rchar"] for r in rs]) or 0) / kv,
                        "faults_vs_kv_pages": (C.median([r["minflt"] for r in rs]) or 0) * PAGE / kv,
                        "peak_vs_kv": max(r["peak_growth_bytes"] for r in rs) / kv,
                        "gbps": C.gb(kv) / s if s else None, "loadavg1": C.median(
                            [r["loadavg1"] for r in rs if r["loadavg1"] is not None])}
                base = out.get(state, {}).get(m, {}).get(str(first["tokens"]))
                cell["time_ratio"] = C.ratio(s, base["seconds"]) if base else 1.0
                cell["length_ratio"] = n / first["tokens"]
                cell["linearity"] = C.ratio(cell["time_ratio"], cell["length_ratio"])
                out.setdefault(state, {}).setdefault(m, {})[str(n)] = cell
    return out


def run_lengths(ctx: C.Context, model: str, lengths: list[int], reps: int) -> dict[str, Any]:
    from tests.support.redis_servers import RedisServer
    from tools.testing.model_builds import model_path

    started = time.perf_counter()
    model_dir = model_path(model)
    states = ("warm", "cold") if ctx.drop else ("warm",)
    prefault = C.prefault_memory(ctx.quick)
    server = RedisServer().start()
    ctx.log(f"  {model}-shaped float32 KV at {lengths} tokens; redis-server on 127.0.0.1:{server.port}")
    try:
        rows = [one_length(ctx, server, model_dir, model, n, reps, states) for n in sorted(lengths)]
    finally:
        server.cleanup()
    med = medians(rows)
    last = str(rows[-1]["tokens"])
    headline = {f"{s}_{m}": {"linearity": v[last]["linearity"], "us_per_token": v[last]["us_per_token"]}
                for s, per in med.items() for m, v in per.items()}
    settings = {"model_shape": model, "kv_dtype": "float32", "tokens": sorted(lengths), "reps": reps,
                "turns": TURNS, "states": states, "drop_page_cache": ctx.drop, "prefault_memory": prefault,
                "order": "every method once per round, rotating; warm then cold",
                "read_process": "a new process per read", "shared_transport": "loopback, one local redis-server"}
    notes = ["warm: the parent read the entry's files just before the child starts; cold: the child drops them "
             "after its imports and the store's open (drop_caches as root, else fadvise per file).",
             "shared: machine B, a new empty directory per read, restores from Redis (RAM) over loopback: no "
             "cold row; its read bytes are the socket's.",
             "read / KV: bytes the read system calls returned (rchar) during fetch + eval, over the KV bytes "
             "(~2 for a disk restore: MLX allocates the arrays by reading a sparse file's hole, kvstore.alloc, "
             "then the pack's segments are read into them; ~1 for the shared hit's socket and mlx-lm's file); "
             "faults / KV pages: minor page faults (first touches) over the KV's 4 KiB pages; peak: the highest "
             "resident growth of the reps over the KV bytes.",
             "linear: t(N) / t(first length) over N / first length, ~1 at every length."]
    return C.document(NAME, ctx, settings, rows, med, headline, notes, started)


def run(ctx: C.Context) -> dict[str, Any]:
    """The suite's entry (``python -m benchmarks``): tiny-llama at small lengths with
    --quick, else SmolLM2 at ``--long-entry-tokens`` (16k, 64k, 128k by default)."""
    if ctx.quick:
        return run_lengths(ctx, "tiny-llama", list(QUICK_TOKENS), 1)
    return run_lengths(ctx, "smollm2", list(ctx.options.get("long_entry_tokens") or DEFAULT_TOKENS), 3)


# ----------------------------------------------------------------------------- output


def report(doc: dict[str, Any]) -> str:
    med = doc["medians"]
    dropped = {str(r["tokens"]): r["page_cache_dropped"] for r in doc["raw"]}
    rows = []
    for state, per in med.items():
        for m, cells in per.items():
            for n, c in cells.items():
                label = state if state == "warm" or dropped[n] else f"{state} (NOT dropped)"
                rows.append([m, label, n, C.fmt(c["seconds"], "s"), f"{c['us_per_token']:.1f}",
                             f"{c['read_vs_kv']:.2f}x", f"{c['faults_vs_kv_pages']:.2f}x", f"{c['peak_vs_kv']:.2f}x",
                             f"{c['time_ratio']:.2f} / {c['length_ratio']:.0f} = {c['linearity']:.2f}",
                             C.fmt(c["loadavg1"])])
    s = doc["settings"]
    made = [[r["tokens"], f"{C.gb(r['payload_bytes']):.2f}"] + [C.fmt(r["make_s"].get(k), "s") for k in
            ("one_insert", "shared_publish", "import", "many_turns")] + [f"{r['many_turns_written_vs_kv']:.3f}x"]
            for r in doc["raw"]]
    return (C.table(f"One long entry ({s['model_shape']}-shaped float32 KV): how long each way took to make it",
                    ["tokens", "KV GB", "one insert", "publish", "import", f"{s['turns']} turns",
                     "turns wrote / KV"], made)
            + "\n\n" + C.table(f"Restore in a new process (fetch + eval; mlx_lm: load_prompt_cache + eval), "
                               f"median of {s['reps']}; linear: t(N)/t({s['tokens'][0]}) / (N/{s['tokens'][0]})",
                               ["made by", "page cache", "tokens", "time", "us / token", "read / KV",
                                "faults / KV pages", "peak / KV", "linear", "load"], rows))


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    med, s = doc["medians"], doc["settings"]
    lo, hi = str(s["tokens"][0]), str(s["tokens"][-1])
    out = []
    for m in WAYS:
        c = med["warm"][m][hi]
        base = med["warm"]["mlx_lm"][hi]
        out.append((f"restore of one {hi}-token entry made by {m}, fresh process, page cache warm",
                    f"{C.fmt(c['seconds'], 's')} ({c['us_per_token']:.1f} us/token; "
                    f"x{c['linearity']:.2f} linear from {lo})",
                    f"load_prompt_cache {C.fmt(base['seconds'], 's')} (x{base['linearity']:.2f} linear)"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_entry", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="comma-separated lengths")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="smollm2", choices=sorted(SHAPES), help="the model whose KV shape and identity")
    ap.add_argument("--no-drop", action="store_true", help="warm reads only (no page-cache drop)")
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=NAME, help="JSON / markdown file name (without extension)")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.tokens.split(",") if x.strip()]

    def report_md(doc: dict[str, Any]) -> str:
        text = report(doc)
        (Path(a.out) / f"{a.name}.md").write_text(text.lstrip("\n") + "\n")
        return text

    return C.run_alone("kvstore-long-entry-", a.out, a.name, not a.no_drop, report=report_md,
                       body=lambda ctx: run_lengths(ctx, a.model, lengths, a.reps))


if __name__ == "__main__":
    raise SystemExit(main())
