"""Where a restore's time goes (issue 56): the parts of reading one SmolLM2-shaped entry
back, each timed alone in a fresh process, page cache warm, in interleaved rounds, against
``mx.load`` of the same bytes (what ``load_prompt_cache`` does):

- ``mx_load``: ``mx.load`` of one safetensors file holding the KV + ``mx.eval``;
- ``alloc``: only the allocation a restore makes (``alloc.alloc`` over ``alloc.groups``:
  MLX reads a scratch file's hole, so every page is faulted in and zeroed by the kernel);
- ``read_contiguous``: the file's bytes read into private memory already faulted in, in
  8 MB reads on ``READ_THREADS`` threads (the copy alone);
- ``read_chunked``: the same bytes into the same memory in the pattern a chunked restore
  writes: 256-token chunks, one 64 KB run per head, spread over every tensor (a copy pattern:
  the file is read in order, as a pack of chunk segments is);
- ``hash``: xxh3-128 of every tensor's bytes on ``READ_THREADS`` threads (the checksums);
- ``per_layer``: ``restore_paths``' one contiguous read per tensor into allocated arrays,
  hashed as it lands (alloc + read + hash in one);
- ``kvstore``: ``KVStore.fetch`` of the same KV, stored by one insert (256-token chunks).

A restore that allocates and then reads cannot be faster than ``alloc`` + a read here.
``python -m benchmarks.restore_parts --tokens 32768`` writes ``results/restore_parts.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from . import common as C

NAME = "restore_parts"
PARTS = ("mx_load", "alloc", "read_contiguous", "read_chunked", "hash", "per_layer", "kvstore")
CHUNK, SPAN = 256, 8 << 20


def _specs(n: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    s = C.kv_shape("smollm2")
    return {f"{i}.{kv}": ("F32", (1, s["kv_heads"], n, s["head_dim"]))
            for i in range(s["layers"]) for kv in ("keys", "values")}


def _data_region(path: str) -> tuple[int, int]:
    """(offset, length) of a safetensors file's tensor bytes."""
    import struct

    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
    return 8 + hlen, os.path.getsize(path) - 8 - hlen


def _faulted(nbytes: int) -> memoryview:
    """``alloc.fresh_bytes`` with every page touched (as an allocation leaves it)."""
    import mmap

    from kvstore.alloc import fresh_bytes

    view = fresh_bytes(nbytes)
    for i in range(0, nbytes, mmap.PAGESIZE):
        view[i] = 0
    return view


def part_child(part: str, path: str, n: int, sums: dict[str, str], store: str) -> dict[str, Any]:
    """Child: one ``part`` on the file ``path`` of ``n`` tokens; the timed block's seconds and CPU."""
    from concurrent.futures import ThreadPoolExecutor

    import mlx.core as mx
    import xxhash

    from kvstore import KVStore, alloc
    from kvstore.disk.restore import READ_THREADS

    from .bandwidth import random_tokens

    from .restore_paths import per_layer_read

    specs = _specs(n)
    alloc.alloc({"w": ("F32", (1, 8))})  # the scratch directory found before the clock
    base, length = _data_region(path)
    fd = os.open(path, os.O_RDONLY)
    view = _faulted(length) if part.startswith("read_") else None
    tasks: list[tuple[int, list[memoryview]]] = []
    if part == "read_contiguous":
        assert view is not None
        tasks = [(base + a, [view[a : a + SPAN]]) for a in range(0, length, SPAN)]
    elif part == "read_chunked":
        assert view is not None
        _, heads, _, dim = next(iter(specs.values()))[1]
        per_tensor, run, pos = heads * n * dim * 4, CHUNK * dim * 4, base
        for c in range(n // CHUNK):
            runs = [view[t * per_tensor + h * n * dim * 4 + c * run:][:run]
                    for t in range(len(specs)) for h in range(heads)]
            for k in range(0, len(runs), 64):  # ~4 MB a read, as a restore's spans
                tasks.append((pos, runs[k : k + 64]))
                pos += sum(len(v) for v in runs[k : k + 64])
    kv = KVStore(store, max_entries=2) if part == "kvstore" else None  # its open is not the read
    hashed = None
    if part == "hash":
        hashed = bytearray(length)
        os.preadv(fd, [hashed], base)
    u0, t0 = C.proc_counters(), time.perf_counter()
    if part == "mx_load":
        got = mx.load(path)
        mx.eval(list(got.values()))
    elif part == "alloc":
        got = {}
        for group in alloc.groups(specs):
            got.update(alloc.alloc(group)[0])
    elif part.startswith("read_"):
        with ThreadPoolExecutor(READ_THREADS) as pool:
            assert sum(pool.map(lambda t: os.preadv(fd, t[1], t[0]), tasks)) == length
    elif part == "hash":
        assert hashed is not None
        mv, per = memoryview(hashed), length // len(specs)
        with ThreadPoolExecutor(READ_THREADS) as pool:
            list(pool.map(lambda i: xxhash.xxh3_128(mv[i * per : (i + 1) * per]).digest(), range(len(specs))))
    elif part == "per_layer":
        per_layer_read(path, sums)
    elif part == "kvstore":
        assert kv is not None
        got = kv.fetch(C.bench_identity(NAME), random_tokens(n, n))
        mx.eval([a for c in got.cache or [] for a in (c.keys, c.values)])
        assert (got.n, got.source) == (n, "disk"), (got.n, got.source)
    seconds = time.perf_counter() - t0
    u1 = C.proc_counters()
    os.close(fd)
    if kv is not None:
        kv.close()
    return {"seconds": seconds, "cpu_s": u1["cpu_s"] - u0["cpu_s"], "pages_touched": u1["minflt"] - u0["minflt"],
            "loadavg1": C.loadavg1()}


def run(ctx: C.Context, n: int, reps: int, parts: tuple[str, ...]) -> dict[str, Any]:
    import mlx.core as mx

    from .restore_paths import tensor_sums

    started = time.perf_counter()
    work = ctx.scratch("parts")
    path = str(work / "kv.safetensors")
    mx.save_safetensors(path, {name: mx.random.normal(shape, key=mx.random.key(1000 * n + i))
                               for i, (name, (_, shape)) in enumerate(_specs(n).items())})
    sums = tensor_sums(path)
    store = str(work / "store")
    if "kvstore" in parts:  # the same KV, as a one-insert entry
        from mlx_lm.models.cache import KVCache

        from kvstore import KVStore

        from .bandwidth import random_tokens

        arrays, cache = mx.load(path), []
        for i in range(C.kv_shape("smollm2")["layers"]):
            c = KVCache()
            c.update_and_fetch(arrays[f"{i}.keys"], arrays[f"{i}.values"])
            cache.append(c)
        with KVStore(store, max_entries=1) as kv:
            kv.insert(C.bench_identity(NAME), random_tokens(n, n), cache)
            assert kv.flush()
        del arrays, cache
    reads: dict[str, list[dict[str, Any]]] = {p: [] for p in parts}
    for rep in range(reps):
        for part in parts[rep % len(parts):] + parts[: rep % len(parts)]:
            C.warm_files([path, store] if "kvstore" in parts else [path])
            r = C.run_child(f"{NAME}:part_child", {"part": part, "path": path, "n": n, "sums": sums, "store": store})
            reads[part].append(r)
            ctx.log(f"    {n} tok, round {rep + 1} {part}: {C.fmt(r['seconds'], 's')} (load {r['loadavg1']})")
    med = {p: {"seconds": statistics.median(r["seconds"] for r in rs), "cpu_s": statistics.median(r["cpu_s"] for r in rs),
               "loads": [r["loadavg1"] for r in rs]} for p, rs in reads.items()}
    ref = med.get("mx_load", {}).get("seconds")
    doc = C.document(NAME, ctx, {"tokens": n, "reps": reps, "shape": "smollm2", "page_cache": "warm"}, reads, med,
                     {p: round(ref / m["seconds"], 3) for p, m in med.items()} if ref else {},
                     ["headline: mx_load's time / the part's time (higher is faster)",
                      "an allocate-then-read restore takes at least alloc + read_chunked here"], started)
    doc["payload_bytes"] = _data_region(path)[1]
    return doc


def report(doc: dict[str, Any]) -> str:
    med = doc["medians"]
    ref = med.get("mx_load", {}).get("seconds")
    rows = [[p, C.fmt(m["seconds"], "s"), f"{m['cpu_s']:.2f}",
             C.fmt(ref / m["seconds"], "x") if ref else "-", f"{min(m['loads'])}-{max(m['loads'])}"]
            for p, m in med.items()]
    n, gb = doc["settings"]["tokens"], doc["payload_bytes"] / 1e9
    return C.table(f"Restore parts, {n} SmolLM2 tokens ({gb:.2f} GB float32 KV), warm, a fresh process each, median",
                   ["part", "time", "CPU s", "mx_load's time / this", "load"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.restore_parts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    parts = tuple(a.parts.split(","))
    if any(p not in PARTS for p in parts) or a.tokens % CHUNK or a.tokens <= 0:
        ap.error(f"--parts from {', '.join(PARTS)}; --tokens a positive multiple of {CHUNK}")
    return C.run_alone("kvstore-parts-", a.out, NAME, False, report=report,
                       body=lambda ctx: run(ctx, a.tokens, a.reps, parts))


if __name__ == "__main__":
    raise SystemExit(main())
