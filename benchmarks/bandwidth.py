"""Restore bandwidth: kvstore's disk restore vs a plain read of the same bytes vs mlx-lm.

A synthetic KV cache (random float32 ``KVCache`` layers shaped like a real model's, exactly
sized) is stored two ways, in the same run:

- kvstore: ``KVStore.insert`` + ``flush`` (chunked blobs, fsynced, indexed in LMDB);
- mlx-lm: ``save_prompt_cache`` (one safetensors file), timed with and without an fsync
  (kvstore always fsyncs; mlx-lm never does).

and read back three ways, each with the page cache dropped before every read (cold) and
with the files read once beforehand (warm), in rotating order:

- kvstore: ``KVStore.fetch`` from a freshly opened store (memory tier empty): index lookup,
  blob reads, checksums, arrays, glue -> live caches;
- raw: the same blob files read sequentially into bytearrays (the physical limit for
  kvstore's files; no parsing, no checksum);
- mlx-lm: ``load_prompt_cache`` + ``mx.eval`` of every array.

GB/s is KV payload bytes (the same for all three) per second. A warm-cache breakdown of
kvstore's restore (the whole restore next to plan, array allocation, a plain read and
xxh3 timed alone) says where its time goes.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from . import common as C

NAME = "bandwidth"
DEFAULT = [("smollm2", 8192), ("bench-qwen3-0.6b", 4096)]
QUICK = [("tiny-llama", 4096)]
METHODS = ("kvstore", "raw", "mlx_lm")


def _entry_files(store: Any, ident: Any, tokens: list[int]) -> list[Path]:
    """The blob files kvstore reads for this prompt, in the order it reads them."""
    disk = store.disk
    plan = disk.plan(ident, tokens)
    recs = [disk.index.chunk(ck) for ck in plan.chunks]
    kind, key = plan.last
    recs.append(disk.index.entry(key) if kind == "entry" else disk.index.chunk(key))
    return [disk.blob_root / r["blob"] for r in recs if r and r.get("blob")]


def _read_raw(files: list[Path]) -> int:
    n = 0
    for p in files:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            n += f.readinto(buf)
    return n


def _eval_cache(cache: list[Any]) -> None:
    import mlx.core as mx
    mx.eval([a for c in cache for a in (c.keys, c.values)])


def _breakdown(store: Any, ident: Any, tokens: list[int]) -> dict[str, float]:
    """Where kvstore's restore time goes (warm page cache): the whole ``DiskTier.restore``
    next to its ingredients timed alone: the index lookup, allocating the final arrays
    (MLX zero-fills them), a plain single-threaded read of the same files, and xxh3-128
    over those bytes. The restore reads each blob straight into its token slice on
    ``RESTORE_THREADS`` reader threads, hashing as it reads, so its total can be less than
    the sum."""
    import xxhash

    from kvstore import blobs
    from kvstore.keys import encode_tokens

    disk = store.disk
    t = {}
    t0 = time.perf_counter()
    plan = disk.plan(ident, encode_tokens(tokens))
    t["plan_s"] = time.perf_counter() - t0
    recs = [disk.index.chunk(ck) for ck in plan.chunks]
    kind, key = plan.last
    recs.append(disk.index.entry(key) if kind == "entry" else disk.index.chunk(key))
    recs = [r for r in recs if r and r.get("blob")]
    first = blobs.Blob(disk.blob_root / recs[0]["blob"], recs[0]["size"], recs[0]["checksum"])
    specs = {nm: (st, (*shape[:-2], plan.stored_n, shape[-1])) for nm, (st, shape) in first.specs.items()}
    first.close()
    t0 = time.perf_counter()
    arrays, _ = blobs.empty(specs)
    t["alloc_s"] = time.perf_counter() - t0
    del arrays
    t0 = time.perf_counter()
    bufs = []
    for r in recs:
        with open(disk.blob_root / r["blob"], "rb") as f:
            b = bytearray(r["size"])
            f.readinto(b)
            bufs.append(b)
    t["read_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ok = all(xxhash.xxh3_128_hexdigest(b) == r["checksum"] for b, r in zip(bufs, recs))
    t["checksum_s"] = time.perf_counter() - t0
    del bufs
    t0 = time.perf_counter()
    cache, _ = disk.restore(plan)
    _eval_cache(cache)
    t["restore_s"] = time.perf_counter() - t0
    t["checksums_ok"] = ok
    t["blobs"] = len(recs)
    return t


def run_shape(ctx: C.Context, name: str, n: int, reps: int) -> dict[str, Any]:
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from kvstore import KVStore

    shape = C.kv_shape(name)
    cache = C.synth_cache(shape, n, seed=n)
    payload = C.cache_bytes(cache)
    tokens = [random.Random(n).randrange(1, 30000) for _ in range(n)]
    ident = C.bench_identity(f"bandwidth-{name}")
    ctx.log(f"  {name}-shaped KV, {n} tokens, {payload / 1e6:.0f} MB: writes ...")

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
        fd = ctx.scratch(f"bw-{name}-mlx{rep}")
        f = fd / "cache.safetensors"
        t0 = time.perf_counter()
        save_prompt_cache(str(f), cache)
        t_save = time.perf_counter() - t0
        h = os.open(f, os.O_RDONLY)
        os.fsync(h)
        os.close(h)
        t_sync = time.perf_counter() - t0
        writes["mlx_lm"].append({"seconds": t_save, "seconds_with_fsync": t_sync, "bytes": f.stat().st_size})
        if kv_dir is not None:  # keep one copy of each for the reads
            import shutil
            shutil.rmtree(kv_dir)
            shutil.rmtree(mlx_file.parent)
        kv_dir, mlx_file = d, f

    probe = KVStore(kv_dir, max_entries=2)
    files = _entry_files(probe, ident, tokens)
    probe.close()
    file_bytes = {"kvstore": sum(p.stat().st_size for p in files), "raw": sum(p.stat().st_size for p in files),
                  "mlx_lm": mlx_file.stat().st_size}
    paths = {"kvstore": [kv_dir], "raw": files, "mlx_lm": [mlx_file]}

    def once(method: str) -> dict[str, Any]:
        if method == "kvstore":
            store, open_s = C.timed(KVStore, kv_dir, max_entries=2)
            t0 = time.perf_counter()
            got = store.fetch(ident, tokens)
            dt = time.perf_counter() - t0
            ok = got.n == n and got.source == "disk"
            st = store.stats()
            store.close()
            return {"seconds": dt, "open_s": open_s, "ok": ok, "restore_s": st["restore_seconds"]}
        if method == "raw":
            nbytes, dt = C.timed(_read_raw, files)
            return {"seconds": dt, "ok": nbytes == file_bytes["raw"]}
        t0 = time.perf_counter()
        c2 = load_prompt_cache(str(mlx_file))
        _eval_cache(c2)
        dt = time.perf_counter() - t0
        ok = c2[0].offset == n
        del c2
        return {"seconds": dt, "ok": ok}

    reads: dict[str, dict[str, list[dict]]] = {"cold": {m: [] for m in METHODS}, "warm": {m: [] for m in METHODS}}
    for state in ("cold", "warm"):
        ctx.log(f"    reads, page cache {state} ...")
        for rep in range(reps):
            order = METHODS[rep % 3:] + METHODS[: rep % 3]
            for m in order:
                if state == "cold":
                    pc = C.drop_page_cache(paths[m], enabled=ctx.drop)
                else:
                    C.warm_files(paths[m])
                    pc = {"dropped": False, "method": "prewarmed"}
                load = C.loadavg1()
                r = once(m)
                r["page_cache"] = pc
                r["loadavg1"] = load
                r["gbps"] = C.gb(payload) / r["seconds"]
                reads[state][m].append(r)
                C.unload()

    ctx.log("    restore breakdown (warm) ...")
    C.warm_files([kv_dir])
    probe = KVStore(kv_dir, max_entries=2)
    breakdown = [_breakdown(probe, ident, tokens) for _ in range(reps)]
    probe.close()
    del cache
    C.unload()

    med: dict[str, Any] = {"payload_bytes": payload, "file_bytes": file_bytes, "tokens": n,
                           "bytes_per_token": shape["bytes_per_token"], "blobs": len(files)}
    for state in ("cold", "warm"):
        for m in METHODS:
            s = C.median([r["seconds"] for r in reads[state][m]])
            med[f"{state}_{m}_s"] = s
            med[f"{state}_{m}_gbps"] = C.gb(payload) / s if s else None
        med[f"{state}_kvstore_vs_raw"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_raw_gbps"])
        med[f"{state}_kvstore_vs_mlx_lm"] = C.ratio(med[f"{state}_kvstore_gbps"], med[f"{state}_mlx_lm_gbps"])
        med[f"{state}_page_cache_dropped"] = all(r["page_cache"]["dropped"] for m in METHODS
                                                 for r in reads[state][m]) if state == "cold" else False
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
    med["breakdown_warm"] = {k: C.median([b[k] for b in breakdown])
                             for k in ("plan_s", "alloc_s", "read_s", "checksum_s", "restore_s")}
    return {"shape": shape, "tokens": n, "writes": writes, "reads": reads, "breakdown": breakdown,
            "medians": med}


def run(ctx: C.Context) -> dict[str, Any]:
    started = time.perf_counter()
    shapes = QUICK if ctx.quick else DEFAULT
    reps = 2 if ctx.quick else 3
    rows = [run_shape(ctx, name, n, reps) for name, n in shapes]
    medians = {f"{r['shape']['name']}/{r['tokens']}": r["medians"] for r in rows}
    headline = {k: {f"{s}_{m}_gbps": v[f"{s}_{m}_gbps"] for s in ("cold", "warm") for m in METHODS}
                for k, v in medians.items()}
    for k, v in medians.items():
        headline[k].update(write_kvstore_gbps=v["write_kvstore_gbps"], write_mlx_lm_gbps=v["write_mlx_lm_gbps"],
                           write_mlx_lm_fsync_gbps=v["write_mlx_lm_fsync_gbps"])
    settings = {"shapes": [{"model_shape": n, "tokens": t} for n, t in shapes], "reps": reps,
                "kv_dtype": "float32", "chunk_tokens": 256, "drop_page_cache": ctx.drop,
                "order": "rotating per rep: kvstore, raw, mlx_lm"}
    notes = ["GB/s = KV payload bytes / seconds (file headers are a few KB).",
             "kvstore reads verify an xxh3-128 checksum of every blob; raw and mlx-lm verify nothing.",
             "mlx-lm's save_prompt_cache does not fsync; kvstore fsyncs every blob, its directory "
             "and the index commit: compare with 'mlx-lm + fsync' for equal durability."]
    return C.document(NAME, ctx, settings, rows, medians, headline, notes, started)


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]:
        m = r["medians"]
        label = f"{r['shape']['name']} {r['tokens']} tok ({m['payload_bytes'] / 1e6:.0f} MB)"
        for s in ("cold", "warm"):
            rows.append([label, f"read, page cache {s}" + ("" if s == "warm" or m["cold_page_cache_dropped"]
                                                          else " (NOT dropped)"),
                         C.fmt(m[f"{s}_kvstore_gbps"], "GB/s"), C.fmt(m[f"{s}_raw_gbps"], "GB/s"),
                         C.fmt(m[f"{s}_mlx_lm_gbps"], "GB/s"),
                         f"{m[f'{s}_kvstore_vs_raw']:.2f} / {m[f'{s}_kvstore_vs_mlx_lm']:.2f}"])
        rows.append([label, "write (kvstore fsyncs)", C.fmt(m["write_kvstore_gbps"], "GB/s"), "-",
                     f"{C.fmt(m['write_mlx_lm_gbps'], 'GB/s')} ({C.fmt(m['write_mlx_lm_fsync_gbps'], 'GB/s')} +fsync)",
                     f"- / {m['write_kvstore_vs_mlx_lm']:.2f} ({m['write_kvstore_vs_mlx_lm_fsync']:.2f} +fsync)"])
    out = C.table("Restore / write bandwidth (median GB/s of KV payload)",
                  ["cache", "operation", "kvstore", "raw read", "mlx-lm", "kvstore/raw / kvstore/mlx-lm"], rows)
    rows = []
    for r in doc["raw"]:
        b = r["medians"]["breakdown_warm"]
        rows.append([f"{r['shape']['name']} {r['tokens']} tok"] + [C.fmt(b[k], "s") for k in
                                                                   ("plan_s", "alloc_s", "read_s", "checksum_s", "restore_s")])
    out += "\n" + C.table("kvstore restore breakdown (warm page cache, median; ingredients timed alone)",
                          ["cache", "plan (index)", "allocate (zero-fill)", "plain read", "xxh3", "restore total"], rows)
    return out


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for r in doc["raw"]:
        m = r["medians"]
        lab = f"{r['shape']['name']}-shaped {r['tokens']} tok, {m['payload_bytes'] / 1e6:.0f} MB"
        for s in ("cold", "warm"):
            out.append((f"restore GB/s, page cache {s}, {lab}", C.fmt(m[f"{s}_kvstore_gbps"], "GB/s"),
                        f"raw read {C.fmt(m[f'{s}_raw_gbps'], 'GB/s')} (x{m[f'{s}_kvstore_vs_raw']:.2f}); "
                        f"load_prompt_cache {C.fmt(m[f'{s}_mlx_lm_gbps'], 'GB/s')} (x{m[f'{s}_kvstore_vs_mlx_lm']:.2f})"))
        out.append((f"write GB/s (fsynced), {lab}", C.fmt(m["write_kvstore_gbps"], "GB/s"),
                    f"save_prompt_cache {C.fmt(m['write_mlx_lm_gbps'], 'GB/s')}, "
                    f"+fsync {C.fmt(m['write_mlx_lm_fsync_gbps'], 'GB/s')}"))
    return out
