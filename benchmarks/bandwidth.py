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

``python -m benchmarks.bandwidth --limit`` (issue 25) measures restores against
``load_prompt_cache`` and the device's own limit (parallel ``pread`` of the pack files with
1, 4 and 16 threads) and a warm floor, in interleaved rounds for a loaded machine; it writes
``results/bandwidth_issue25.json`` and ``.md``.
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


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(n)]


def pack_files(kv_dir: str | Path) -> list[Path]:
    from kvstore.files import own_packs

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
            store.insert(ident, random_tokens(n, 1000 + i), C.synth_cache(shape, n, seed=i))
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
    tokens = random_tokens(n, n)
    tag = f"bandwidth-{name}"
    ident = C.bench_identity(tag)
    ctx.log(f"  {name}-shaped KV, {n} tokens, {payload / 1e6:.0f} MB: writes ...")
    writes, kv_dir, mlx_file = _writes(ctx, name, n, cache, tokens, ident, reps)
    probe = KVStore(kv_dir, max_entries=2)
    segments = len(probe.disk.plan(ident, tokens).chunks) + 1
    probe.close()
    files = pack_files(kv_dir)
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
        if "kvstore_base" in reads[state]:
            med[f"{state}_kvstore_vs_base"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_kvstore_base_gbps"])
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


# ----------------------------------------------------------------------------- the device's limit
#
# Issue 25: restores against mlx-lm's loader and against the device's own limit, each read
# in a fresh process, cells interleaved (every method once per round, rotating order), so a
# machine loaded by other work loads every method alike; medians reported.
#   python -m benchmarks.bandwidth --limit [--quick] [--out FILE.json]

LIMIT_SHAPES = [("smollm2", 8192, 1), ("bench-qwen3-0.6b", 2048, 1), ("smollm2", 7680, 20)]  # (shape, tokens, turns)
LIMIT_QUICK = [("tiny-llama", 4096, 1), ("tiny-llama", 4000, 20)]
PREAD_THREADS = (1, 4, 16)
LIMIT_METHODS = ("kvstore", "mlx_lm", "raw") + tuple(f"pread{t}" for t in PREAD_THREADS)


def pread_child(files: list[str], threads: int, drop: bool, block: int = 4 << 20) -> dict[str, Any]:
    """Child: every pack file read with ``threads`` parallel ``pread`` of ``block`` bytes
    into per-thread buffers (no fresh memory: the device and page cache alone)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    pc = C.drop_page_cache(files) if drop else {"dropped": False, "method": "prewarmed by the parent"}
    fds = [os.open(p, os.O_RDONLY) for p in files]
    jobs = [(fd, off, min(block, os.fstat(fd).st_size - off)) for fd in fds for off in range(0, os.fstat(fd).st_size, block)]
    local = threading.local()

    def read(job: tuple[int, int, int]) -> int:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(block)
        return os.preadv(job[0], [memoryview(buf)[: job[2]]], job[1])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, jobs))
    seconds = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return {"seconds": seconds, "bytes": nbytes, "gbps": C.gb(nbytes) / seconds, "page_cache": pc,
            "loadavg1": C.loadavg1(), "ok": nbytes == sum(os.path.getsize(p) for p in files)}


def hash_child(payload: int) -> dict[str, Any]:
    """Child: xxh3-128 of ``payload`` bytes of fresh, already-touched memory on one thread."""
    import numpy as np
    import xxhash

    data = np.ones(payload, np.uint8)
    t0 = time.perf_counter()
    xxhash.xxh3_128(data).digest()
    return {"seconds": time.perf_counter() - t0}


def child_in(tree: str, target: str, args: dict[str, Any]) -> dict[str, Any]:
    """``C.run_child`` with the kvstore (and benchmarks) of another checkout ``tree``: the
    restore path before a change, measured in the same interleaved rounds."""
    cmd = [sys.executable, "-m", "benchmarks", "--child", target, json.dumps(args)]
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(C.CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {target} in {tree} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(C.CHILD_MARK):])


def grown(ctx: C.Context, name: str, n: int, turns: int) -> tuple[Path, Path, list[int], int]:
    """An entry of ``n`` tokens persisted as a conversation grown over ``turns`` turns (one
    pack file per turn), and mlx-lm's file of the same cache."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore import KVStore

    shape, tokens = C.kv_shape(name), random_tokens(n, n)
    ident = C.bench_identity(f"bandwidth-{name}")
    kv_dir, mlx_dir = ctx.scratch(f"limit-{name}-{n}-{turns}-kv"), ctx.scratch(f"limit-{name}-{n}-{turns}-mlx")
    cache = None
    with KVStore(kv_dir, max_entries=1) as store:
        for t in range(turns):
            lo, hi = n * t // turns, n * (t + 1) // turns
            cache = C.extend_cache(cache, shape, hi - lo, seed=n + t)
            store.insert(ident, tokens[:hi], cache)
            store.flush()
    save_prompt_cache(str(mlx_dir / "cache.safetensors"), cache)
    payload = C.cache_bytes(cache)
    del cache
    C.unload()
    return kv_dir, mlx_dir / "cache.safetensors", tokens, payload


def limit_shape(ctx: C.Context, name: str, n: int, turns: int, reps: int, base: str | None = None,
                only: tuple[str, ...] = LIMIT_METHODS) -> dict[str, Any]:
    """Every method of ``only`` (``LIMIT_METHODS``; and ``kvstore_base``, the restore of
    checkout ``base``, if given), cold and warm, ``reps`` interleaved rounds."""
    methods = only + (("kvstore_base",) if base else ())
    kv_dir, mlx_file, tokens, payload = grown(ctx, name, n, turns)
    files = [str(p) for p in pack_files(kv_dir)]
    args = {"kv_dir": str(kv_dir), "mlx_file": str(mlx_file), "files": files, "tokens": tokens,
            "tag": f"bandwidth-{name}", "payload": payload}
    paths = {"kvstore": [kv_dir], "mlx_lm": [mlx_file]}
    reads: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in methods} for s in ("cold", "warm")}
    for rep in range(reps):
        order = methods[rep % len(methods):] + methods[: rep % len(methods)]
        for state in ("cold", "warm"):
            ctx.log(f"    {name} {n} tok x{turns} turns, round {rep + 1}/{reps}, {state} ...")
            for m in order:
                drop = state == "cold" and ctx.drop
                if state == "warm":
                    C.warm_files(paths.get(m, files))
                if m == "kvstore_base":
                    r = child_in(base, "bandwidth:read_child", dict(args, method="kvstore", drop=drop))  # type: ignore[arg-type]
                elif m.startswith("pread"):
                    r = C.run_child("bandwidth:pread_child", {"files": files, "threads": int(m[5:]), "drop": drop})
                else:
                    r = C.run_child("bandwidth:read_child", dict(args, method=m, drop=drop))
                reads[state][m].append(r)
    hashes = [C.run_child("bandwidth:hash_child", {"payload": payload}) for _ in range(reps)]
    return {"shape": name, "tokens": n, "turns": turns, "payload_bytes": payload, "pack_files": len(files),
            "file_bytes": sum(os.path.getsize(p) for p in files), "reads": reads, "hash": hashes,
            "medians": _limit_medians(reads, hashes, payload)}


def _limit_medians(reads: dict, hashes: list[dict], payload: int) -> dict[str, Any]:
    cores = os.cpu_count() or 1
    hash_s = C.median([h["seconds"] for h in hashes])
    med: dict[str, Any] = {"hash_s": hash_s, "cores": cores}
    for state, rs in reads.items():
        for m, runs in rs.items():
            s = C.median([r["seconds"] for r in runs])
            gbps = C.median([r["gbps"] for r in runs])
            med[f"{state}_{m}_s"], med[f"{state}_{m}_gbps"] = s, gbps
        best = max(PREAD_THREADS, key=lambda t: med[f"{state}_pread{t}_gbps"])
        med[f"{state}_device_gbps"] = med[f"{state}_pread{best}_gbps"]
        med[f"{state}_device_threads"] = best
        if "kvstore_base" in reads[state]:
            med[f"{state}_kvstore_vs_base"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_kvstore_base_gbps"])
        med[f"{state}_kvstore_vs_mlx_lm"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_mlx_lm_gbps"])
        med[f"{state}_kvstore_vs_device"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_device_gbps"])
        med[f"{state}_dropped"] = all(r["page_cache"]["dropped"] for runs in rs.values() for r in runs)
        med[f"{state}_loadavg1"] = C.median([r["loadavg1"] for runs in rs.values() for r in runs if r["loadavg1"] is not None])
    floor_s = med["warm_raw_s"] + hash_s / cores
    med["warm_floor_s"], med["warm_floor_gbps"] = floor_s, C.gb(payload) / floor_s
    med["warm_kvstore_vs_floor"] = C.ratio(med["warm_kvstore_gbps"], med["warm_floor_gbps"])
    med["all_reads_ok"] = all(r["ok"] for rs in reads.values() for runs in rs.values() for r in runs)
    return med


def run_limit(ctx: C.Context, reps: int = 3, base: str | None = None, shapes: list | None = None,
              only: tuple[str, ...] = LIMIT_METHODS) -> dict[str, Any]:
    started = time.perf_counter()
    shapes = shapes or (LIMIT_QUICK if ctx.quick else LIMIT_SHAPES)
    C.prefault_memory(True)
    rows = [limit_shape(ctx, name, n, turns, reps, base, only) for name, n, turns in shapes]
    medians = {f"{r['shape']}/{r['tokens']}/x{r['turns']}": r["medians"] for r in rows}
    headline = {k: {x: v[x] for x in ("cold_kvstore_vs_mlx_lm", "cold_kvstore_vs_device", "warm_kvstore_vs_mlx_lm",
                                      "warm_kvstore_vs_floor")} for k, v in medians.items()}
    settings = {"shapes": [{"model_shape": n, "tokens": t, "turns": k} for n, t, k in shapes], "reps": reps,
                "methods": only, "order": "every method once per round, rotating; cold then warm",
                "read_process": "a new process per read", "drop_page_cache": ctx.drop,
                "base": {"tree": base, "commit": _commit_of(base)} if base else None}
    notes = ["pread<N>: every pack file read by N threads with 4 MB pread into per-thread buffers: the device's "
             "(cold) or page cache's (warm) own limit, no fresh memory; GB/s of file bytes. Others: GB/s of KV payload.",
             "floor = plain read of the pack files into fresh memory (raw) + xxh3-128 of the payload on one thread / cores.",
             "x20 turns: an agent conversation grown over 20 turns, one pack file per turn (the restore reads them all).",
             "The machine was shared with other jobs (loadavg in the JSON): absolute GB/s are low and noisy; compare "
             "ratios within a shape, medians of interleaved rounds."]
    return C.document("bandwidth_issue25", ctx, settings, rows, medians, headline, notes, started)


def _commit_of(tree: str) -> str | None:
    f = Path(tree) / "BASE_COMMIT"
    return f.read_text().strip() if f.exists() else None


def limit_report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]:
        m = r["medians"]
        label = f"{r['shape']} {r['tokens']} tok x{r['turns']} ({r['payload_bytes'] / 1e6:.0f} MB, {r['pack_files']} packs)"
        for s in ("cold", "warm"):
            dev = f"{C.fmt(m[f'{s}_device_gbps'], 'GB/s')} ({m[f'{s}_device_threads']} thr)"
            extra = f"floor {C.fmt(m['warm_floor_gbps'], 'GB/s')} (x{m['warm_kvstore_vs_floor']:.2f})" if s == "warm" else ""
            base = f" (before: {C.fmt(m[f'{s}_kvstore_base_gbps'], 'GB/s')})" if f"{s}_kvstore_base_gbps" in m else ""
            rows.append([label, s + ("" if s == "warm" or m["cold_dropped"] else " (NOT dropped)"),
                         C.fmt(m[f"{s}_kvstore_gbps"], "GB/s") + base, C.fmt(m[f"{s}_mlx_lm_gbps"], "GB/s"),
                         f"{m[f'{s}_kvstore_vs_mlx_lm']:.2f}", dev, f"{m[f'{s}_kvstore_vs_device']:.2f}",
                         " / ".join(C.fmt(m[f"{s}_pread{t}_gbps"]) for t in PREAD_THREADS), extra, m[f"{s}_loadavg1"]])
    return C.table("Restore vs mlx-lm and the device (medians, fresh processes, interleaved; 'load': the load average during the row)",
                   ["entry", "page cache", "kvstore", "mlx-lm", "kv/mlx", "device", "kv/device",
                    "pread 1/4/16 thr GB/s", "warm floor", "load"], rows)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bandwidth")
    ap.add_argument("--limit", action="store_true", required=True, help="issue 25: restore vs mlx-lm and the device")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", default=None, help="a checkout whose restore is measured alongside (kvstore_base)")
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results" / "bandwidth_issue25.json"))
    ap.add_argument("--shape", action="append", default=[], metavar="NAME:TOKENS:TURNS",
                    help="measure this shape only (repeatable), e.g. smollm2:8192:1")
    a = ap.parse_args()
    work = C.new_workdir(None)
    shapes = [(sp.split(":")[0], int(sp.split(":")[1]), int(sp.split(":")[2])) for sp in a.shape]
    try:
        doc = run_limit(C.Context(quick=a.quick, work=work, out=Path(a.out).parent), a.reps, a.base, shapes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    C.write_json(Path(a.out).parent, Path(a.out).stem, doc)
    text = limit_report(doc)
    Path(a.out).with_suffix(".md").write_text(text + "\n")
    print(text)
