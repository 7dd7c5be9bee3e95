"""Restore paths side by side (issues 47 and 56): one SmolLM2-shaped entry (float32
``KVCache`` layers, grown over a few turns like a conversation) read back in a fresh
process per read by each path, against mlx-lm's ``load_prompt_cache`` of the same KV and
against a plain read of the same bytes, page cache warm and dropped, in interleaved
rounds, at each size of ``--tokens`` (one size built, measured and removed at a time).

Paths (every kvstore path keeps every check: each segment's header names its record,
identity and token range, and each segment's bytes hash to its xxh3-128 before the
arrays are handed out):

- ``mlx_lm``: ``load_prompt_cache`` + ``mx.eval`` (the baseline of every ratio);
- ``kvstore``: ``KVStore.fetch`` of this checkout (and ``kvstore_base``: of ``--base``),
  from the segments: the restore of an entry not served before (whole copies are switched
  off in every path but ``kvstore_whole``, or the second read of a round would leave one
  for the third);
- ``host_buffers``: as ``kvstore``, but read into numpy buffers of fresh anonymous
  memory, then one copy into MLX (``mx.array``);
- ``one_group``: as ``kvstore``, but every array allocated at once (``alloc.MAX_GROUPS``
  1): each segment read in ``_SPAN`` reads, not one read per allocation group;
- ``eight_groups``: as ``kvstore``, with the allocation groups of before issue 56
  (``alloc.MAX_GROUPS`` groups whatever the number of segments: today's path until then);
- ``segment_files``: every segment as its own plain safetensors file (a format change),
  ``mx.load`` of each (MLX's own reader, lazy arrays), its header checked and its loaded
  buffers hashed, then each layer's chunks joined by one ``mx.concatenate``;
- ``per_layer``: the longest entry stored as one contiguous run per tensor (a format
  change; mlx-lm's own file is laid out so and is what is read): one contiguous read per
  tensor straight into the final arrays (``alloc.alloc`` in groups, as a restore
  allocates), on ``READ_THREADS`` reader threads, each tensor hashed (xxh3-128) as its
  spans land and checked against the parent's sums;
- ``larger_chunks``: ``KVStore.fetch`` from a second store made with ``chunk_tokens``
  ``BIG_CHUNK`` (default 256), the same turns inserted;
- ``kvstore_whole``: ``KVStore.fetch`` of this checkout from a copy of the store in which
  the entry was restored twice first (each time in a fresh process), so it has a whole
  copy (``kvstore.disk.whole``): ``mx.load`` of that one file, its header checked and its
  loaded bytes hashed. What a long entry served again costs; only the copy is warmed or
  dropped, and the child checks the restore read the copy;
- ``plain_read`` / ``plain_read_mt``: the floor, not a restore: kvstore's pack files read
  into fresh anonymous memory (``alloc.fresh_bytes``) in 8 MB reads by one thread / by
  ``READ_THREADS`` threads (as many as a restore reads with), no hashing, no arrays. The
  floor of a size and state is the fastest of the two and of ``mlx_lm`` (itself a plain
  read into fresh memory, then arrays over it).

Each child counts, over its timed read only: bytes read by system calls
(``/proc/self/io`` rchar, Linux), pages first touched (``getrusage`` minor faults) and
major faults, CPU seconds of all its threads, and its peak resident growth
(``VmHWM`` less ``VmRSS`` before): ``C.proc_counters``; the table gives them per KV byte.

Not measured: ``mx.load`` of a segment through a Python file object (MLX reads through
``readinto`` on its own worker thread holding no GIL: the deadlock
``alloc._zeroed_by_kernel`` avoids; mlx 0.32 aborted at exit after such a load here).

``python -m benchmarks.restore_paths --tokens 8192,32768,131072 --reps 3 [--base CHECKOUT]``
writes ``results/restore_paths.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from . import common as C
from .bandwidth import child_in, random_tokens

NAME = "restore_paths"
SHAPE = "smollm2"
BIG_CHUNK = 4096
PATHS = ("mlx_lm", "kvstore", "eight_groups", "host_buffers", "one_group", "segment_files", "per_layer",
         "larger_chunks", "kvstore_whole", "plain_read", "plain_read_mt")
FLOORS = ("plain_read", "plain_read_mt")  # not restores: what the machine allows
_SPAN = 8 << 20


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


def per_layer_read(mlx_file: str, sums: dict[str, str]) -> list[Any]:
    """Every tensor of a safetensors file (one contiguous run each) read by one read task
    per tensor into the final arrays (allocated in groups as a restore allocates), hashed
    as each span lands; ValueError if a tensor's hash is not the parent's."""
    import json
    import struct
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from kvstore import alloc, segments
    from kvstore.disk.restore import READ_THREADS

    fd = os.open(mlx_file, os.O_RDONLY)
    try:
        (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = json.loads(os.pread(fd, hlen, 8))
        header.pop("__metadata__", None)
        base = 8 + hlen
        specs = {name: (h["dtype"], tuple(h["shape"])) for name, h in header.items()}

        def read_one(name: str, host: Any) -> tuple[str, str]:
            lo, hi = header[name]["data_offsets"]
            view, h, pos = segments.byte_view(host), xxhash.xxh3_128(), 0
            while pos < hi - lo:
                span = view[pos : pos + _SPAN]
                got = os.preadv(fd, [span], base + lo + pos)
                if got <= 0:
                    raise OSError(f"{name}: short read")
                h.update(span[:got])
                pos += got
            return name, h.hexdigest()

        arrays: dict[str, Any] = {}
        with ThreadPoolExecutor(READ_THREADS) as pool:
            futures = []
            for group in alloc.groups(specs):
                got, hosts = alloc.alloc(group)
                arrays.update(got)
                futures += [pool.submit(read_one, name, hosts[name]) for name in group]
            for f in futures:
                name, digest = f.result()
                if digest != sums[name]:
                    raise ValueError(f"{name}: checksum mismatch")
    finally:
        os.close(fd)
    return [alloc.finish(specs[n][0], arrays[n]) for n in specs]


def tensor_sums(mlx_file: str) -> dict[str, str]:
    """The xxh3-128 of each tensor's bytes in a safetensors file (the parent's, for
    ``per_layer``'s check)."""
    import json
    import struct

    import xxhash

    out = {}
    with open(mlx_file, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        header.pop("__metadata__", None)
        for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            lo, hi = h["data_offsets"]
            f.seek(8 + hlen + lo)
            x = xxhash.xxh3_128()
            left = hi - lo
            while left:
                piece = f.read(min(left, _SPAN))
                x.update(piece)
                left -= len(piece)
            out[name] = x.hexdigest()
    return out


def _plain_read(files: list[str], threads: int) -> int:
    """The files' bytes read into fresh anonymous memory (``alloc.fresh_bytes``), in
    ``_SPAN`` reads on ``threads`` threads; the bytes read."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore import alloc

    fds = [os.open(p, os.O_RDONLY) for p in files]
    try:
        bufs = [alloc.fresh_bytes(os.fstat(fd).st_size) for fd in fds]
        tasks = [(fd, buf[a : a + _SPAN], a) for fd, buf in zip(fds, bufs) for a in range(0, len(buf), _SPAN)]
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(lambda t: os.preadv(t[0], [t[1]], t[2]), tasks))
    finally:
        for fd in fds:
            os.close(fd)


def _counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a read did, from two ``C.proc_counters``."""
    return {"bytes_read": after["rchar"] - before["rchar"], "read_calls": after["syscr"] - before["syscr"],
            "pages_touched": after["minflt"] - before["minflt"],
            "major_faults": after["majflt"] - before["majflt"], "cpu_s": after["cpu_s"] - before["cpu_s"],
            "peak_growth_bytes": (after["hwm_kb"] - before["rss_kb"]) * 1024}


def _files_of(path: str, kv_dir: str, big_dir: str, mlx_file: str, seg_dir: str, copy: str = "") -> list[str]:
    """What a path reads (to warm or drop)."""
    return {"mlx_lm": [mlx_file], "per_layer": [mlx_file], "segment_files": [seg_dir],
            "larger_chunks": [big_dir], "kvstore_whole": [copy]}.get(path, [kv_dir])


def whole_child(whole_dir: str, n: int) -> dict[str, Any]:
    """Child: restore the entry of ``n`` tokens in ``whole_dir`` twice, each by a store of
    its own (the first use credits a hit; the second restore writes the whole copy on the
    writer thread). Returns the copy's file."""
    from kvstore import KVStore
    from kvstore.files import pack_path

    tokens = random_tokens(n, n)
    written = 0
    for _ in range(2):
        with KVStore(whole_dir, max_entries=1) as store:
            got = store.fetch(C.bench_identity(f"bandwidth-{SHAPE}"), tokens)
            assert got.n == n and got.source == "disk", (got.n, got.source)
            assert store.flush(600)
            written += store.stats()["whole_copies_written"]
    with KVStore(whole_dir) as store:
        disk = store.disk
        assert disk is not None
        rec = max((disk.index.entry(k) for k in disk.index.view(lambda r: r.keys("entries"))), key=lambda r: r.n)
    assert written == 1 and rec.whole is not None, (written, rec)
    return {"copy": str(pack_path(disk.blob_root, rec.whole.pack))}


def read_child(path: str, spec: str, drop: bool) -> dict[str, Any]:
    """Child: one read by ``path`` of the entry ``spec`` (a JSON file: ``_build``'s paths,
    segments, sums; too long for a command line) in this fresh process (imports first, then
    the page cache dropped when ``drop``, then the timed, counted read)."""
    import json

    with open(spec) as f:
        b = json.load(f)
    kv_dir, big_dir, mlx_file, seg_dir = b["kv_dir"], b["big_dir"], b["mlx_file"], b["seg_dir"]
    whole_dir, copy = b.get("whole_dir", ""), b.get("copy", "")
    pieces, packs, sums, payload = b["pieces"], b["packs"], b["sums"], b["payload"]
    tokens = random_tokens(b["n"], b["n"])
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvstore import KVStore, alloc

    if path == "host_buffers":
        alloc.alloc = _host_alloc  # type: ignore[assignment]  # this process only
    elif path == "one_group":
        alloc.MAX_GROUPS, alloc.GROUP = 1, 1 << 50
    elif path == "eight_groups":  # the policy before issue 56: MAX_GROUPS whatever the segments
        every = alloc.groups
        alloc.groups = lambda specs, nbytes=None, segments=1: every(specs, nbytes)  # type: ignore[assignment]
    pc = C.drop_page_cache(_files_of(path, kv_dir, big_dir, mlx_file, seg_dir, copy)) if drop else {
        "dropped": False, "method": "prewarmed by the parent"}
    out: dict[str, Any] = {"page_cache": pc, "loadavg1": C.loadavg1()}
    where = {"larger_chunks": big_dir, "kvstore_whole": whole_dir}.get(path, kv_dir)
    # every path but kvstore_whole reads segments: no read may leave a whole copy for the next
    store = KVStore(where, max_entries=2, whole_copy_min_bytes=None) if path in (
        "kvstore", "host_buffers", "one_group", "eight_groups", "larger_chunks", "kvstore_whole") else None  # the store's open is not the read
    u0, t0 = C.proc_counters(), time.perf_counter()
    if path == "mlx_lm":
        cache = load_prompt_cache(mlx_file)
        mx.eval([a for c in cache for a in (c.keys, c.values)])
        out["ok"] = cache[0].offset == len(tokens)
    elif path in ("segment_files", "per_layer"):
        arrays = _segment_files_read(seg_dir, pieces) if path == "segment_files" else per_layer_read(mlx_file, sums)
        out["ok"] = all(a.shape[-2] == len(tokens) for a in arrays if a.ndim == 4)
    elif path in FLOORS:
        from kvstore.disk.restore import READ_THREADS

        out["ok"] = _plain_read(packs, 1 if path == "plain_read" else READ_THREADS) == _file_bytes(packs)
    else:
        assert store is not None
        got = store.fetch(C.bench_identity(f"bandwidth-{SHAPE}"), tokens)
        mx.eval([a for c in got.cache or [] for a in (c.keys, c.values)])
        out["ok"] = got.n == len(tokens) and got.source == "disk"
    out["seconds"] = time.perf_counter() - t0
    if path == "kvstore_whole":  # the copy was what it read
        out["ok"] = out["ok"] and store is not None and store.stats()["restores_one_pass"] == 1
    out.update(_counts(u0, C.proc_counters()))
    if store is not None:
        store.close()
    out["gbps"] = C.gb(payload) / out["seconds"]
    return out


def _file_bytes(files: list[str]) -> int:
    return sum(os.path.getsize(p) for p in files)


def _segment_files(kv_dir: str | Path, seg_dir: Path | None) -> list[dict[str, Any]]:
    """The longest entry's segments, each copied out of its pack as one plain safetensors
    file into ``seg_dir`` (only listed when None)."""
    from kvstore.cachedir import open_disk
    from kvstore.files import pack_path

    disk = open_disk(Path(kv_dir), readonly=True)
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
            if seg_dir is not None:
                with open(pack_path(disk.blob_root, seg.pack), "rb") as f:
                    f.seek(seg.offset)
                    (seg_dir / name).write_bytes(f.read(seg.length))
            out.append({"file": name, "kind": kind, "key": k.hex(), "lo": a, "hi": b,
                        "checksum": seg.checksum.hex(), "identity": rec.identity.hex()})
    finally:
        disk.close()
    return out


def _build(ctx: C.Context, n: int, turns: int) -> dict[str, Any]:
    """The entry of ``n`` tokens grown over ``turns`` turns, persisted each turn into two
    stores (chunks of 256 and of ``BIG_CHUNK`` tokens), mlx-lm's file of the final cache,
    its segments as plain files, and the per-tensor sums of mlx-lm's file."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore import KVStore

    from .bandwidth import pack_files

    shape, tokens = C.kv_shape(SHAPE), random_tokens(n, n)
    ident = C.bench_identity(f"bandwidth-{SHAPE}")
    kv_dir, big_dir = ctx.scratch(f"paths-{n}-kv"), ctx.scratch(f"paths-{n}-kv{BIG_CHUNK}")
    mlx_dir, seg_dir = ctx.scratch(f"paths-{n}-mlx"), ctx.scratch(f"paths-{n}-segments")
    cache = None
    with KVStore(kv_dir, max_entries=1) as a, KVStore(big_dir, max_entries=1, chunk_tokens=BIG_CHUNK) as b:
        for t in range(turns):
            lo, hi = n * t // turns, n * (t + 1) // turns
            cache = C.extend_cache(cache, shape, hi - lo, seed=n + t, drop_old=True)
            for store in (a, b):
                store.insert(ident, tokens[:hi], cache)
                store.flush()
                store.memory.clear()  # else the memory tier holds the previous turn: 2x the KV at 128k
    assert cache is not None
    mlx_file = mlx_dir / "cache.safetensors"
    save_prompt_cache(str(mlx_file), cache)
    payload = C.cache_bytes(cache)
    del cache
    C.unload()
    packs = [str(p) for p in pack_files(kv_dir)]
    return {"kv_dir": str(kv_dir), "big_dir": str(big_dir), "mlx_file": str(mlx_file), "seg_dir": str(seg_dir),
            "pieces": _segment_files(kv_dir, seg_dir), "packs": packs, "sums": tensor_sums(str(mlx_file)),
            "n": n, "tokens": tokens, "payload": payload,
            "scratch": [str(kv_dir), str(big_dir), str(mlx_dir), str(seg_dir)],
            "big_segments": len(_segment_files(big_dir, None))}


def one_size(ctx: C.Context, n: int, turns: int, reps: int, base: str | None, states: tuple[str, ...],
             paths: tuple[str, ...]) -> dict[str, Any]:
    """Every path of ``paths`` at ``n`` tokens, ``reps`` interleaved rounds per state; the
    size's files are removed afterwards."""
    import json

    built = _build(ctx, n, turns)
    if "kvstore_whole" in paths:  # a copy of the store, in which the entry got its whole copy
        whole_dir = ctx.scratch(f"paths-{n}-whole")
        shutil.rmtree(whole_dir)
        shutil.copytree(built["kv_dir"], whole_dir)
        built.update(whole_dir=str(whole_dir), scratch=built["scratch"] + [str(whole_dir)],
                     **C.run_child(f"{NAME}:whole_child", {"whole_dir": str(whole_dir), "n": n}))
    spec = Path(built["mlx_file"]).parent / "spec.json"
    spec.write_text(json.dumps({k: v for k, v in built.items() if k != "tokens"}))
    args = {"spec": str(spec)}
    reads: dict[str, dict[str, list[dict]]] = {s: {m: [] for m in paths} for s in states}
    try:
        for rep in range(reps):
            order = paths[rep % len(paths):] + paths[: rep % len(paths)]
            for state in states:
                for m in order:
                    drop = state == "cold" and ctx.drop
                    files = _files_of(m.replace("kvstore_base", "kvstore"), built["kv_dir"], built["big_dir"],
                                      built["mlx_file"], built["seg_dir"], built.get("copy", ""))
                    # only the files this path reads may be cached: at 128k the four copies (24 GB) do not
                    # fit this machine's memory, and reclaiming another copy's pages during a read's page
                    # faults slowed whichever read came after a different path (2-4x, seen here)
                    C.drop_page_cache([d for d in built["scratch"]
                                       if not any(Path(d) == Path(f) or Path(d) in Path(f).parents for f in files)])
                    if not drop:
                        C.warm_files(files)
                    if m == "kvstore_base":
                        r = child_in(base, "bandwidth:read_child",  # type: ignore[arg-type]  # base: no restore_paths
                                     {"method": "kvstore", "kv_dir": built["kv_dir"], "mlx_file": built["mlx_file"],
                                      "files": [], "tokens": built["tokens"], "tag": f"bandwidth-{SHAPE}",
                                      "drop": drop, "payload": built["payload"]})
                    else:
                        r = C.run_child(f"{NAME}:read_child", dict(args, path=m, drop=drop))
                    assert r["ok"], (m, r)
                    reads[state][m].append(r)
                    ctx.log(f"    {n} tok, round {rep + 1} {state} {m}: {C.fmt(r['seconds'], 's')} "
                            f"(load {r['loadavg1']})")
        file_bytes = _file_bytes(built["packs"])
    finally:
        for d in built["scratch"]:
            shutil.rmtree(d, ignore_errors=True)
    return {"tokens": n, "payload_bytes": built["payload"], "pack_files": len(built["packs"]),
            "file_bytes": file_bytes, "segments": len(built["pieces"]),
            "segments_larger_chunks": built["big_segments"], "reads": reads,
            "medians": _medians(reads, built["payload"])}


def _medians(reads: dict[str, dict[str, list[dict]]], payload: int) -> dict[str, Any]:
    """Per state and path: median time, GB/s, speed against ``load_prompt_cache``, and the
    counts per KV byte (bytes read, bytes of pages first touched, peak growth) and CPU."""
    def per_kv(rs: list[dict], k: str, scale: int = 1) -> float | None:
        xs = [r[k] for r in rs if r.get(k) is not None]
        return None if not xs else C.median(xs) * scale / payload  # type: ignore[operator]

    med: dict[str, Any] = {}
    for state, by in reads.items():
        base_s = C.median([r["seconds"] for r in by["mlx_lm"]])
        floor_s = min(C.median([r["seconds"] for r in by[f]]) or 0.0 for f in FLOORS + ("mlx_lm",) if by.get(f))
        med[state] = {}
        for m, rs in by.items():
            t = C.median([r["seconds"] for r in rs])
            med[state][m] = {"seconds": t, "gbps": C.gb(payload) / t, "vs_mlx_lm": C.ratio(base_s, t),
                             "vs_floor": C.ratio(floor_s, t), "read_per_kv": per_kv(rs, "bytes_read"),
                             "touched_per_kv": per_kv(rs, "pages_touched", os.sysconf("SC_PAGE_SIZE")),
                             "peak_per_kv": per_kv(rs, "peak_growth_bytes"),
                             "cpu_s": C.median([r["cpu_s"] for r in rs]),
                             "read_calls": C.median([r.get("read_calls") or 0 for r in rs]),
                             "loadavg1": C.median([r["loadavg1"] for r in rs if r["loadavg1"] is not None] or [0.0]),
                             "dropped": all(r["page_cache"]["dropped"] for r in rs)}
        med[state]["floor_allows_vs_mlx_lm"] = C.ratio(base_s, floor_s)
    return med


def run(ctx: C.Context, sizes: tuple[int, ...], turns: int, reps: int, base: str | None,
        states: tuple[str, ...] = ("warm", "cold"), only: tuple[str, ...] = PATHS) -> dict[str, Any]:
    started = time.perf_counter()
    paths = tuple(dict.fromkeys(("mlx_lm",) + only)) + (("kvstore_base",) if base else ())
    by_size = [one_size(ctx, n, turns, reps, base, states, paths) for n in sizes]
    head = {str(r["tokens"]): r["medians"] for r in by_size}
    return C.document(NAME, ctx, {"shape": SHAPE, "tokens": list(sizes), "turns": turns, "reps": reps,
                                  "big_chunk": BIG_CHUNK, "base": base, "read_process": "a new process per read"},
                      by_size, head, head,
                      ["vs_mlx_lm: load_prompt_cache's time / the path's time (1.0 = as fast; higher is faster)",
                       "vs_floor: the fastest plain read's time (plain_read, plain_read_mt or mlx_lm) / the "
                       "path's time (1.0 = the machine's limit)",
                       "floor_allows_vs_mlx_lm: the highest vs_mlx_lm any restore could reach here",
                       "read_per_kv: bytes read by system calls per KV byte (rchar); touched_per_kv: bytes of "
                       "pages first touched (minor faults x page size) per KV byte; peak_per_kv: peak resident "
                       "growth per KV byte; cpu_s: CPU seconds of all the reader's threads"], started)


def report(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    rows = []
    for size in doc["raw"]:
        for state, by in size["medians"].items():
            for m, r in by.items():
                if not isinstance(r, dict):
                    continue
                f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
                rows.append([size["tokens"], state + ("" if state == "warm" or r["dropped"] else " (NOT dropped)"), m,
                             C.fmt(r["seconds"], "s"), f"{r['gbps']:.2f}", f(r["vs_mlx_lm"]) + "x",
                             f(r["vs_floor"]) + "x", f(r["read_per_kv"]), r.get("read_calls", "-"),
                             f(r["touched_per_kv"]), f(r["peak_per_kv"]), f(r["cpu_s"]), f(r["loadavg1"])])
            rows.append([size["tokens"], state, "(floor allows)", "", "", f"{by['floor_allows_vs_mlx_lm'] or 0:.2f}x",
                         "", "", "", "", "", "", ""])
    return C.table(f"Restore paths, {s['shape']} float32 KV grown over {s['turns']} turns (chunks of 256 tokens; "
                   f"larger_chunks: {s['big_chunk']}), a fresh process per read, median of {s['reps']}",
                   ["tokens", "page cache", "path", "time", "GB/s", "vs load_prompt_cache", "vs plain read",
                    "read/KV", "read calls", "touched/KV", "peak/KV", "CPU s", "load"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.restore_paths", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192", help="comma-separated sizes, e.g. 8192,32768,131072")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", default=None, help="another checkout whose kvstore restores too")
    ap.add_argument("--no-drop", action="store_true", help="do not drop the page cache for the cold reads")
    ap.add_argument("--states", default="warm,cold", help="warm, cold or both (a drop empties the whole "
                                                          "machine's page cache: not beside another benchmark)")
    ap.add_argument("--name", default=NAME, help="JSON file name (without .json)")
    ap.add_argument("--paths", default=",".join(PATHS), help="the paths to run (mlx_lm always runs)")
    ap.add_argument("--out", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--report", default=None, metavar="JSON",
                    help="only print the table of a results file (its medians computed again from its reads)")
    a = ap.parse_args(argv)
    if a.report:
        import json

        doc = json.loads(Path(a.report).read_text())
        for size in doc["raw"]:
            size["medians"] = _medians(size["reads"], size["payload_bytes"])
        print(report(doc))
        return 0
    sizes = tuple(int(x) for x in a.tokens.split(","))
    states, paths = tuple(a.states.split(",")), tuple(a.paths.split(","))
    wrong = [x for x in states if x not in ("warm", "cold")] + [x for x in paths if x not in PATHS]
    if wrong:  # a misspelt state or path would run the wrong measurement under its name
        ap.error(f"unknown --states or --paths: {', '.join(wrong)} (states: warm, cold; paths: {', '.join(PATHS)})")
    return C.run_alone("kvstore-paths-", a.out, a.name, not a.no_drop, report=report, body=lambda ctx: run(
        ctx, sizes, a.turns, a.reps, a.base, states, paths))


if __name__ == "__main__":
    raise SystemExit(main())
