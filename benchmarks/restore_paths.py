"""Restore paths side by side (issue 47, item 2): one SmolLM2-shaped entry (float32
``KVCache`` layers, grown over a few turns like a conversation) read back in a fresh
process per read by each path, against mlx-lm's ``load_prompt_cache`` of the same KV,
page cache warm and dropped, in interleaved rounds.

Paths (every kvstore path keeps every check: each segment's header names its record,
identity and token range, and each segment's bytes hash to its xxh3-128 before the
arrays are handed out):

- ``mlx_lm``: ``load_prompt_cache`` + ``mx.eval`` (the baseline of every ratio);
- ``kvstore``: ``KVStore.fetch`` of this checkout (and ``kvstore_base``: of ``--base``);
- ``host_buffers``: as ``kvstore``, but read into numpy buffers of fresh anonymous
  memory (no zero-fill by anyone but the kernel's first touch), then one copy into MLX
  (``mx.array``): the "numpy buffers without zero-fill" path;
- ``one_group``: as ``kvstore``, but every array allocated at once (``alloc.MAX_GROUPS``
  1): each segment is read in ``_SPAN`` reads, not one read per allocation group (fewer,
  larger reads);
- ``segment_files``: every segment as its own plain safetensors file (a format change:
  today they share a pack file), ``mx.load`` of each (MLX's own reader, its own
  threads), its header checked and its loaded buffers hashed, then each layer's chunks
  joined by ``mx.concatenate`` (the final arrays must be whole).

Not measured: ``mx.load`` of a segment through a Python file object (MLX would read
straight into its own memory through ``readinto``): MLX calls ``readinto`` on its own
worker thread holding no GIL, which is the deadlock ``alloc._zeroed_by_kernel`` avoids,
and mlx 0.32 aborted the process at exit ("terminate called without an active
exception") after such a load in a probe here.

``python -m benchmarks.restore_paths --tokens 8192 --reps 3 [--base CHECKOUT]`` writes
``results/restore_paths.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from . import common as C
from .bandwidth import grown, pack_files, child_in

NAME = "restore_paths"
SHAPE = "smollm2"
PATHS = ("mlx_lm", "kvstore", "host_buffers", "one_group", "segment_files")


def _host_alloc(specs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``alloc.alloc`` with numpy buffers of fresh anonymous memory (``fresh_bytes``):
    ``finish`` then copies each into MLX."""
    import math

    import numpy as np

    from kvstore import alloc
    from kvstore.segments import host_dtype

    hosts = {}
    for name, (st, shape) in specs.items():
        dt = host_dtype(st)
        hosts[name] = np.frombuffer(alloc.fresh_bytes(dt.itemsize * math.prod(shape)), dt).reshape(shape)
    return dict(hosts), hosts


def _segment_files_read(seg_dir: str, pieces: list[dict[str, Any]]) -> list[Any]:
    """Every segment file loaded by ``mx.load``, checked (header names its record;
    loaded bytes hash to its checksum) and joined into whole arrays."""
    import mlx.core as mx
    import numpy as np
    import xxhash

    from kvstore import segments
    from kvstore.files import BlobError
    from kvstore.records import Segment

    parts: dict[str, list[Any]] = {}
    loaded = []
    for p in pieces:
        path = os.path.join(seg_dir, p["file"])
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            head = segments.read_header(fd, Segment(b"\0" * 16, 0, size, bytes.fromhex(p["checksum"])))
        finally:
            os.close(fd)
        segments.SegmentMeta(p["identity"], p["kind"], bytes.fromhex(p["key"]), p["lo"], p["hi"]).expect(head.meta)
        arrays = mx.load(path, format="safetensors")
        loaded.append((p, head, arrays))
    mx.eval([a for _, _, arrays in loaded for a in arrays.values()])
    for p, head, arrays in loaded:
        h = xxhash.xxh3_128(head.prefix)
        for name in head.specs:  # file order
            a = arrays[name]
            h.update(memoryview(np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).cast("B"))
        if h.hexdigest() != p["checksum"]:
            raise BlobError(f"segment {p['file']}: checksum mismatch")
        for name in head.specs:
            parts.setdefault(name, []).append(arrays[name])
    whole = {name: xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=-2) for name, xs in parts.items()}
    mx.eval(list(whole.values()))
    return list(whole.values())


def read_child(path: str, kv_dir: str, mlx_file: str, seg_dir: str, pieces: list[dict[str, Any]],
               tokens: list[int], drop: bool, payload: int) -> dict[str, Any]:
    """Child: one read by ``path`` in this fresh process (imports first, then the page
    cache dropped when ``drop``, then the timed read)."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore import KVStore, alloc

    if path == "host_buffers":
        alloc.alloc = _host_alloc  # type: ignore[assignment]  # this process only
    elif path == "one_group":
        alloc.MAX_GROUPS, alloc.GROUP = 1, 1 << 50
    files = {"mlx_lm": [mlx_file], "segment_files": [seg_dir]}.get(path, [kv_dir])
    pc = C.drop_page_cache(files) if drop else {"dropped": False, "method": "prewarmed by the parent"}
    out: dict[str, Any] = {"page_cache": pc, "loadavg1": C.loadavg1()}
    t0 = time.perf_counter()
    if path == "mlx_lm":
        cache = load_prompt_cache(mlx_file)
        mx.eval([a for c in cache for a in (c.keys, c.values)])
        out["ok"] = cache[0].offset == len(tokens)
    elif path == "segment_files":
        arrays = _segment_files_read(seg_dir, pieces)
        out["ok"] = all(a.shape[-2] == len(tokens) for a in arrays)
    else:
        store = KVStore(kv_dir, max_entries=2)
        t0 = time.perf_counter()  # the store's open is not the read
        got = store.fetch(C.bench_identity(f"bandwidth-{SHAPE}"), tokens)
        mx.eval([a for c in got.cache or [] for a in (c.keys, c.values)])
        out["ok"] = got.n == len(tokens) and got.source == "disk"
        out["seconds"] = time.perf_counter() - t0
        store.close()
    out.setdefault("seconds", time.perf_counter() - t0)
    out["gbps"] = C.gb(payload) / out["seconds"]
    return out


def _segment_files(kv_dir: Path, seg_dir: Path) -> list[dict[str, Any]]:
    """The entry's segments copied out of their packs, one plain safetensors file each."""
    from kvstore.cachedir import open_disk
    from kvstore.files import pack_path

    disk = open_disk(kv_dir, readonly=True)
    out = []
    try:
        key = max(disk.index.view(lambda r: r.keys("entries")), key=lambda k: disk.index.entry(k).n)
        rec = disk.index.entry(key)
        lo = 0
        segs = []
        for ck in rec.chunks:
            crec = disk.index.chunk(ck)
            segs.append(("chunk", ck, crec.segment, lo, lo + crec.n))
            lo += crec.n
        if rec.tail is not None:
            segs.append(("tail" if rec.chunked else "snapshot", key, rec.tail, lo, rec.n))
        for i, (kind, k, seg, a, b) in enumerate(segs):
            name = f"{i:05d}.safetensors"
            with open(pack_path(disk.blob_root, seg.pack), "rb") as f:
                f.seek(seg.offset)
                (seg_dir / name).write_bytes(f.read(seg.length))
            out.append({"file": name, "kind": kind, "key": k.hex(), "lo": a, "hi": b,
                        "checksum": seg.checksum.hex(), "identity": rec.identity.hex()})
    finally:
        disk.close()
    return out


def run(ctx: C.Context, n: int, turns: int, reps: int, base: str | None,
        states: tuple[str, ...] = ("warm", "cold"), only: tuple[str, ...] = PATHS) -> dict[str, Any]:
    started = time.perf_counter()
    kv_dir, mlx_file, tokens, payload = grown(ctx, SHAPE, n, turns)
    seg_dir = ctx.scratch("segment-files")
    pieces = _segment_files(kv_dir, seg_dir)
    paths = tuple(dict.fromkeys(("mlx_lm",) + only)) + (("kvstore_base",) if base else ())
    args = {"kv_dir": str(kv_dir), "mlx_file": str(mlx_file), "seg_dir": str(seg_dir), "pieces": pieces,
            "tokens": tokens, "payload": payload}
    warm = {"mlx_lm": [mlx_file], "segment_files": [seg_dir]}
    reads: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in paths} for s in states}
    for rep in range(reps):
        order = paths[rep % len(paths):] + paths[: rep % len(paths)]
        for state in states:
            for m in order:
                drop = state == "cold" and ctx.drop
                if not drop:
                    C.warm_files(warm.get(m, [kv_dir]))
                if m == "kvstore_base":
                    r = child_in(base, "bandwidth:read_child",  # type: ignore[arg-type]  # base has no restore_paths
                                 {"method": "kvstore", "kv_dir": str(kv_dir), "mlx_file": str(mlx_file), "files": [],
                                  "tokens": tokens, "tag": f"bandwidth-{SHAPE}", "drop": drop, "payload": payload})
                else:
                    r = C.run_child(f"{NAME}:read_child", dict(args, path=m, drop=drop))
                assert r["ok"], (m, r)
                reads[state][m].append(r)
                ctx.log(f"    round {rep + 1} {state} {m}: {C.fmt(r['seconds'], 's')} (load {r['loadavg1']})")
    med: dict[str, Any] = {}
    for state, by in reads.items():
        base_s = C.median([r["seconds"] for r in by["mlx_lm"]])
        med[state] = {m: {"seconds": C.median([r["seconds"] for r in rs]),
                          "gbps": C.gb(payload) / C.median([r["seconds"] for r in rs]),
                          "vs_mlx_lm": base_s / C.median([r["seconds"] for r in rs]),
                          "dropped": all(r["page_cache"]["dropped"] for r in rs)} for m, rs in by.items()}
    return C.document(NAME, ctx, {"shape": SHAPE, "tokens": n, "turns": turns, "reps": reps, "payload_bytes": payload,
                                  "pack_files": len(pack_files(kv_dir)), "segments": len(pieces), "base": base,
                                  "read_process": "a new process per read"},
                      reads, med, med, ["vs_mlx_lm: load_prompt_cache's time / the path's time (1.0 = as fast; "
                                        "higher is faster)"], started)


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = []
    for state, by in doc["medians"].items():
        for m, r in by.items():
            rows.append([state + ("" if state == "warm" or r["dropped"] else " (NOT dropped)"), m,
                         C.fmt(r["seconds"], "s"), f"{r['gbps']:.2f}", f"{r['vs_mlx_lm']:.2f}x"])
    return C.table(f"Restore paths, {s['tokens']} tokens of {s['shape']} float32 KV ({C.gb(s['payload_bytes']):.2f} GB, "
                   f"{s['segments']} segments), a fresh process per read, median of {s['reps']}",
                   ["page cache", "path", "time", "GB/s", "speed vs load_prompt_cache"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.restore_paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", default=None, help="another checkout whose kvstore restores too")
    ap.add_argument("--no-drop", action="store_true", help="do not drop the page cache for the cold reads")
    ap.add_argument("--states", default="warm,cold", help="warm, cold or both (a drop empties the whole "
                                                          "machine's page cache: not beside another benchmark)")
    ap.add_argument("--name", default=NAME, help="JSON file name (without .json)")
    ap.add_argument("--paths", default=",".join(PATHS), help="the paths to run (mlx_lm always runs)")
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    return C.run_alone("kvstore-paths-", a.out, a.name, not a.no_drop, report=report, body=lambda ctx: run(
        ctx, a.tokens, a.turns, a.reps, a.base, tuple(a.states.split(",")), tuple(a.paths.split(","))))

if __name__ == "__main__":
    raise SystemExit(main())
