"""Restore bandwidth as a restart meets it: every read in a fresh process.

A synthetic KV cache (random float32 ``KVCache`` layers shaped like a real model's, exactly
sized) is written two ways in the same run:

- kvstore: ``KVStore.insert`` + ``flush`` (one pack file of 256-token chunk segments,
  synced, then one LMDB commit);
- mlx-lm: ``save_prompt_cache`` (one safetensors file), timed without and with an fsync;

and read back three ways. A restart is a new process (cold allocator, fresh memory) and,
after a reboot, a cold page cache, so each read runs in its **own new process**, under the
same conditions for every method, with the page cache dropped inside the child after its
imports (cold) or pre-read by the parent (warm), in rotating order:

- kvstore: ``KVStore(dir)`` + ``fetch`` (index lookup, segment reads straight into the
  final arrays, every byte checksummed, every token id compared) -> live caches;
- raw: the same pack file(s) read with one ``read()`` each into fresh memory (the physical
  limit for kvstore's files: no parsing, no checksum);
- mlx-lm: ``load_prompt_cache`` + ``mx.eval`` of every array.

GB/s is KV payload bytes (the same for all three) per second of the read alone (imports,
model-free store open and page-cache drop excluded; the store's open time is reported).
The same three reads repeated inside one long-running process are reported as a separate,
labelled "server already running" row: a warm allocator, not a restart.

Sync calls per persisted entry (fsync, fdatasync, sync_file_range, msync) are counted with
strace on Linux: a process persisting three entries minus one persisting one, halved.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common as C

NAME = "bandwidth"
DEFAULT = [("smollm2", 8192), ("bench-qwen3-0.6b", 4096)]
QUICK = [("tiny-llama", 4096)]
METHODS = ("kvstore", "raw", "mlx_lm")
SYNC_CALLS = ("fsync", "fdatasync", "sync_file_range", "msync")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def _pack_files(kv_dir: str | Path) -> list[Path]:
    from kvstore.blobs import own_packs

    return sorted(f.path for f in own_packs(Path(kv_dir) / "blobs")[0])


# ----------------------------------------------------------------------------- children


def read_child(method: str, kv_dir: str, mlx_file: str, files: list[str], tokens: list[int], tag: str,
               drop: bool, payload: int) -> dict[str, Any]:
    """Child: one read by ``method`` in this fresh process (imports first, then the page
    cache dropped when ``drop``, then the timed read)."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore import KVStore

    ident = C.bench_identity(tag)
    paths = {"kvstore": [kv_dir], "raw": files, "mlx_lm": [mlx_file]}[method]
    pc = C.drop_page_cache(paths) if drop else {"dropped": False, "method": "prewarmed by the parent"}
    out: dict[str, Any] = {"page_cache": pc, "loadavg1": C.loadavg1()}
    if method == "kvstore":
        store, out["open_s"] = C.timed(KVStore, kv_dir, max_entries=2)
        got, out["seconds"] = C.timed(store.fetch, ident, tokens)
        out["ok"] = got.n == len(tokens) and got.source == "disk"
        store.close()
    elif method == "raw":
        def read_all() -> int:
            n = 0
            for p in files:
                with open(p, "rb", buffering=0) as f:
                    n += len(f.read())
            return n
        nbytes, out["seconds"] = C.timed(read_all)
        out["ok"] = nbytes == sum(os.path.getsize(p) for p in files)
    else:
        t0 = time.perf_counter()
        cache = load_prompt_cache(mlx_file)
        mx.eval([a for c in cache for a in (c.keys, c.values)])
        out["seconds"] = time.perf_counter() - t0
        out["ok"] = cache[0].offset == len(tokens)
    out["gbps"] = C.gb(payload) / out["seconds"]
    return out


def persist_child(cache_dir: str, shape_name: str, n: int, entries: int) -> dict[str, Any]:
    """Child (run under strace): open a new store, persist ``entries`` unrelated entries of
    ``n`` tokens, close."""
    from kvstore import KVStore

    shape = C.kv_shape(shape_name)
    ident = C.bench_identity("bandwidth-syncs")
    with KVStore(cache_dir, max_entries=1) as store:
        for i in range(entries):
            store.insert(ident, _tokens(n, 1000 + i), C.synth_cache(shape, n, seed=i))
            store.flush()
        st = store.stats()
    return {"writes": st["writes"], "write_errors": st["write_errors"]}


def _count_syncs(ctx: C.Context, shape_name: str, n: int, entries: int) -> dict[str, int] | None:
    """Sync system calls of a process persisting ``entries`` entries (strace -f -c)."""
    if not sys.platform.startswith("linux") or not shutil.which("strace"):
        return None
    d = ctx.scratch(f"bw-syncs-{shape_name}-{entries}")
    out = Path(tempfile.mkstemp(prefix="kvstore-strace-")[1])
    cmd = ["strace", "-f", "-c", "-o", str(out), "-e", "trace=" + ",".join(SYNC_CALLS),
           sys.executable, "-m", "benchmarks", "--child", "bandwidth:persist_child",
           json.dumps({"cache_dir": str(d), "shape_name": shape_name, "n": n, "entries": entries})]
    proc = subprocess.run(cmd, cwd=C.REPO_ROOT, capture_output=True, text=True, timeout=1800)
    text = out.read_text() if out.exists() else ""
    out.unlink(missing_ok=True)
    shutil.rmtree(d, ignore_errors=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-500:]}  # type: ignore[dict-item]
    counts = {c: 0 for c in SYNC_CALLS}
    for line in text.splitlines():  # "% time seconds usecs/call calls [errors] syscall"
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if m and m.group(2) in counts:
            counts[m.group(2)] = int(m.group(1))
    counts["total"] = sum(counts[c] for c in SYNC_CALLS)
    return counts


# ----------------------------------------------------------------------------- one shape


def _writes(ctx: C.Context, name: str, n: int, cache: Any, tokens: list[int], ident: Any,
            reps: int) -> tuple[dict[str, list[dict]], Path, Path]:
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore import KVStore

    writes: dict[str, list[dict]] = {"kvstore": [], "mlx_lm": []}
    kv_dir = mlx_file = None
    for rep in range(reps):
        d = ctx.scratch(f"bw-{name}-kv{rep}")
        store = KVStore(d, max_entries=2)
        t0 = time.perf_counter()
        store.insert(ident, tokens, cache)
        t_ins = time.perf_counter() - t0
        store.flush()
        t_all = time.perf_counter() - t0
        st = store.stats()
        store.close()
        writes["kvstore"].append({"seconds": t_all, "insert_call_s": t_ins, "writer_s": st["write_seconds"],
                                  "bytes_written": st["bytes_written"], "dropped": st.get("dropped_writes")})
        f = ctx.scratch(f"bw-{name}-mlx{rep}") / "cache.safetensors"
        t0 = time.perf_counter()
        save_prompt_cache(str(f), cache)
        t_save = time.perf_counter() - t0
        h = os.open(f, os.O_RDONLY)
        os.fsync(h)
        os.close(h)
        writes["mlx_lm"].append({"seconds": t_save, "seconds_with_fsync": time.perf_counter() - t0,
                                 "bytes": f.stat().st_size})
        if kv_dir is not None:  # keep one copy of each for the reads
            shutil.rmtree(kv_dir)
            shutil.rmtree(mlx_file.parent)
        kv_dir, mlx_file = d, f
    return writes, kv_dir, mlx_file  # type: ignore[return-value]


def _in_process(kv_dir: Path, mlx_file: Path, files: list[Path], tokens: list[int], ident: Any,
                payload: int, reps: int) -> dict[str, list[dict]]:
    """The three reads repeated in this long-running process (warm page cache, warm
    allocator): what a server that is already running sees, not a restart."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore import KVStore

    out: dict[str, list[dict]] = {m: [] for m in METHODS}
    store = KVStore(kv_dir, max_entries=0)  # no memory tier: every fetch reads the disk
    for _ in range(reps + 1):  # the first round only warms the allocator
        got, t_kv = C.timed(store.fetch, ident, tokens)
        del got
        t0 = time.perf_counter()
        bufs = [p.read_bytes() for p in files]
        t_raw = time.perf_counter() - t0
        del bufs
        t0 = time.perf_counter()
        c = load_prompt_cache(str(mlx_file))
        mx.eval([a for x in c for a in (x.keys, x.values)])
        t_mlx = time.perf_counter() - t0
        del c
        for m, t in zip(METHODS, (t_kv, t_raw, t_mlx)):
            out[m].append({"seconds": t, "gbps": C.gb(payload) / t})
    store.close()
    return {m: v[1:] for m, v in out.items()}


def run_shape(ctx: C.Context, name: str, n: int, reps: int) -> dict[str, Any]:
    from kvstore import KVStore

    shape = C.kv_shape(name)
    cache = C.synth_cache(shape, n, seed=n)
    payload = C.cache_bytes(cache)
    tokens = _tokens(n, n)
    tag = f"bandwidth-{name}"
    ident = C.bench_identity(tag)
    ctx.log(f"  {name}-shaped KV, {n} tokens, {payload / 1e6:.0f} MB: writes ...")
    writes, kv_dir, mlx_file = _writes(ctx, name, n, cache, tokens, ident, reps)
    probe = KVStore(kv_dir, max_entries=2)
    segments = len(probe.disk.plan(ident, tokens).chunks) + 1
    probe.close()
    files = _pack_files(kv_dir)
    file_bytes = {"kvstore": sum(p.stat().st_size for p in files), "raw": sum(p.stat().st_size for p in files),
                  "mlx_lm": mlx_file.stat().st_size}
    paths = {"kvstore": [kv_dir], "raw": files, "mlx_lm": [mlx_file]}
    del cache
    C.unload()

    ctx.log("    sync calls per persisted entry (strace) ...")
    one, three = _count_syncs(ctx, name, n, 1), _count_syncs(ctx, name, n, 3)
    syncs = {"one_entry": one, "three_entries": three,
             "per_entry": (three["total"] - one["total"]) / 2 if one and three and "total" in one and "total" in three
             else None}

    args = {"kv_dir": str(kv_dir), "mlx_file": str(mlx_file), "files": [str(p) for p in files],
            "tokens": tokens, "tag": tag, "payload": payload}
    reads: dict[str, dict[str, list[dict]]] = {"cold": {m: [] for m in METHODS}, "warm": {m: [] for m in METHODS}}
    for state in ("cold", "warm"):
        ctx.log(f"    reads in fresh processes, page cache {state} ...")
        for rep in range(reps):
            for m in METHODS[rep % 3:] + METHODS[: rep % 3]:
                if state == "warm":
                    C.warm_files(paths[m])
                r = C.run_child("bandwidth:read_child", dict(args, method=m, drop=state == "cold" and ctx.drop))
                reads[state][m].append(r)
    ctx.log("    the same reads inside one running process ...")
    C.warm_files([kv_dir, mlx_file])
    running = _in_process(kv_dir, mlx_file, files, tokens, ident, payload, reps)
    C.unload()
    med = _medians(reads, running, writes, payload, file_bytes)
    med.update(tokens=n, bytes_per_token=shape["bytes_per_token"], segments=segments, pack_files=len(files),
               syncs_per_entry=syncs["per_entry"])
    return {"shape": shape, "tokens": n, "writes": writes, "reads": reads, "in_process": running,
            "syncs": syncs, "medians": med}


def _medians(reads: dict, running: dict, writes: dict, payload: int, file_bytes: dict) -> dict[str, Any]:
    med: dict[str, Any] = {"payload_bytes": payload, "file_bytes": file_bytes}
    for state in ("cold", "warm"):
        for m in METHODS:
            s = C.median([r["seconds"] for r in reads[state][m]])
            med[f"{state}_{m}_s"] = s
            med[f"{state}_{m}_gbps"] = C.gb(payload) / s if s else None
        med[f"{state}_kvstore_vs_raw"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_raw_gbps"])
        med[f"{state}_kvstore_vs_mlx_lm"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_mlx_lm_gbps"])
    med["cold_page_cache_dropped"] = all(r["page_cache"]["dropped"] for rs in reads["cold"].values() for r in rs)
    med["kvstore_open_s"] = C.median([r["open_s"] for s in reads.values() for r in s["kvstore"]])
    for m in METHODS:
        s = C.median([r["seconds"] for r in running[m]])
        med[f"running_{m}_gbps"] = C.gb(payload) / s if s else None
    med["running_kvstore_vs_raw"] = C.ratio(med["running_kvstore_gbps"], med["running_raw_gbps"])
    med["running_kvstore_vs_mlx_lm"] = C.ratio(med["running_kvstore_gbps"], med["running_mlx_lm_gbps"])
    med["all_reads_ok"] = all(r["ok"] for s in reads.values() for rs in s.values() for r in rs)
    kvw = C.median([w["seconds"] for w in writes["kvstore"]])
    mlw = C.median([w["seconds"] for w in writes["mlx_lm"]])
    mlws = C.median([w["seconds_with_fsync"] for w in writes["mlx_lm"]])
    med.update({
        "write_kvstore_s": kvw, "write_kvstore_gbps": C.gb(payload) / kvw,
        "write_kvstore_insert_call_s": C.median([w["insert_call_s"] for w in writes["kvstore"]]),
        "write_mlx_lm_s": mlw, "write_mlx_lm_gbps": C.gb(payload) / mlw,
        "write_mlx_lm_fsync_s": mlws, "write_mlx_lm_fsync_gbps": C.gb(payload) / mlws,
        "write_kvstore_vs_mlx_lm": C.ratio(mlw, kvw), "write_kvstore_vs_mlx_lm_fsync": C.ratio(mlws, kvw),
    })
    return med


def run(ctx: C.Context) -> dict[str, Any]:
    started = time.perf_counter()
    shapes = QUICK if ctx.quick else DEFAULT
    reps = 2 if ctx.quick else 3
    prefault = C.prefault_memory(ctx.quick)
    rows = [run_shape(ctx, name, n, reps) for name, n in shapes]
    medians = {f"{r['shape']['name']}/{r['tokens']}": r["medians"] for r in rows}
    keys = [f"{s}_{m}_gbps" for s in ("cold", "warm", "running") for m in METHODS]
    headline = {k: {x: v[x] for x in keys + ["write_kvstore_gbps", "write_mlx_lm_gbps", "write_mlx_lm_fsync_gbps",
                                             "syncs_per_entry"]}
                for k, v in medians.items()}
    settings = {"shapes": [{"model_shape": n, "tokens": t} for n, t in shapes], "reps": reps,
                "kv_dtype": "float32", "chunk_tokens": 256, "drop_page_cache": ctx.drop,
                "order": "rotating per rep: kvstore, raw, mlx_lm", "read_process": "a new process per read",
                "prefault_memory": prefault}
    notes = ["GB/s = KV payload bytes / seconds of the read alone, each read in a new process (a restart).",
             "kvstore reads verify an xxh3-128 checksum of every byte and compare every token id; raw and "
             "mlx-lm verify nothing.",
             "mlx-lm's save_prompt_cache does not fsync; kvstore syncs its pack file and directory and the "
             "index commit: compare with 'mlx-lm + fsync' for equal durability.",
             "'running' rows repeat the reads inside one long-running process (warm allocator): a server "
             "that is already up, not a restart.",
             "This VM backs guest memory lazily: the first touch of never-used guest memory costs a host "
             "fault, whichever method pays it first. The run touches and frees guest memory once before "
             "the reads (prefault_memory) so every method meets the same, already-backed memory."]
    return C.document(NAME, ctx, settings, rows, medians, headline, notes, started)


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]:
        m = r["medians"]
        label = f"{r['shape']['name']} {r['tokens']} tok ({m['payload_bytes'] / 1e6:.0f} MB)"
        for s, what in (("cold", "restart, page cache dropped"), ("warm", "restart, page cache warm"),
                        ("running", "server already running")):
            if s == "cold" and not m["cold_page_cache_dropped"]:
                what += " (NOT dropped)"
            rows.append([label, what, C.fmt(m[f"{s}_kvstore_gbps"], "GB/s"), C.fmt(m[f"{s}_raw_gbps"], "GB/s"),
                         C.fmt(m[f"{s}_mlx_lm_gbps"], "GB/s"),
                         f"{m[f'{s}_kvstore_vs_raw']:.2f} / {m[f'{s}_kvstore_vs_mlx_lm']:.2f}"])
        rows.append([label, f"write ({m['syncs_per_entry']} sync calls / entry)", C.fmt(m["write_kvstore_gbps"], "GB/s"),
                     "-", f"{C.fmt(m['write_mlx_lm_gbps'], 'GB/s')} ({C.fmt(m['write_mlx_lm_fsync_gbps'], 'GB/s')} +fsync)",
                     f"- / {m['write_kvstore_vs_mlx_lm']:.2f} ({m['write_kvstore_vs_mlx_lm_fsync']:.2f} +fsync)"])
    return C.table("Restore / write bandwidth (median GB/s of KV payload; reads in fresh processes)",
                   ["cache", "read", "kvstore", "raw read", "mlx-lm", "kvstore/raw / kvstore/mlx-lm"], rows)


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for r in doc["raw"]:
        m = r["medians"]
        lab = f"{r['shape']['name']}-shaped {r['tokens']} tok, {m['payload_bytes'] / 1e6:.0f} MB"
        for s, what in (("cold", "fresh process, page cache dropped"), ("warm", "fresh process, page cache warm"),
                        ("running", "server already running")):
            out.append((f"restore GB/s, {what}, {lab}", C.fmt(m[f"{s}_kvstore_gbps"], "GB/s"),
                        f"raw read {C.fmt(m[f'{s}_raw_gbps'], 'GB/s')} (x{m[f'{s}_kvstore_vs_raw']:.2f}); "
                        f"load_prompt_cache {C.fmt(m[f'{s}_mlx_lm_gbps'], 'GB/s')} (x{m[f'{s}_kvstore_vs_mlx_lm']:.2f})"))
        out.append((f"write GB/s (synced), {lab}", C.fmt(m["write_kvstore_gbps"], "GB/s"),
                    f"save_prompt_cache {C.fmt(m['write_mlx_lm_gbps'], 'GB/s')}, "
                    f"+fsync {C.fmt(m['write_mlx_lm_fsync_gbps'], 'GB/s')}; "
                    f"{m['syncs_per_entry']} sync calls per entry"))
    return out
