"""TTFT: cold prefill vs memory hit vs disk hit in a fresh process.

For each model and prompt length L, the prompt is a shared (L - 32)-token prefix plus a
32-token question; every request uses a different question, so a hit restores the prefix
and prefills the question (as a new question under a long system prompt does).

- cold: a fresh store (miss), prefill all L tokens, first token. In the process that
  writes the store; ``kvstore.generate.stream_generate`` does fetch -> prefill -> insert ->
  first token, and TTFT is its own measure (Step.ttft).
- memory hit: the same process, a new question: the prefix comes from the memory tier.
- disk hit: a new process (subprocess) that drops the page cache first (when allowed; the
  JSON says whether it did), loads the model, opens the store, and runs the same
  request: TTFT = fetch (index lookup + blob reads + checksums + rebuild) + prefill of the
  question + insert + first token. One more disk-hit process runs without the drop
  (the blobs still in the page cache: a restart of a server on a machine that kept them).

Every process runs one short warm-up forward pass first; model loading, store opening and
identity resolution happen before the timed request and are reported separately.
Writes queued by one request are flushed before the next is timed.
"""

from __future__ import annotations

import time
from typing import Any

from . import common as C

NAME = "ttft"
SUFFIX = 32
PREFILL_STEP = 512  # stream_generate's default

DEFAULT = [("smollm2", [1024, 2048, 4096, 8192]), ("bench-qwen3-0.6b", [1024, 2048])]
SKIPPED = ["bench-qwen3-0.6b at 4096 tokens (cold prefill ~2-3 min here) and 8192 tokens (~7 min): "
           "they do not fit the 30-minute budget next to the 100k-entry scale fill"]
QUICK = [("tiny-llama", [256, 512])]


def request(store: Any, model: Any, tok: Any, path: Any, prompt: list[int]) -> dict[str, Any]:
    """One request through kvstore.generate.stream_generate, with its parts timed."""
    from kvstore.generate import stream_generate

    before = store.stats()
    load = C.loadavg1()
    ft, it = C.Timer(store, "fetch"), C.Timer(store, "insert")
    c0 = time.process_time()
    t0 = time.perf_counter()
    try:
        gen = stream_generate(store, model, tok, prompt, model_key=path, max_tokens=1,
                              prefill_step=PREFILL_STEP)
        first = next(gen)
        gen.close()
    finally:
        ft.restore()
        it.restore()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    after = store.stats()
    fetch_s, insert_s = sum(ft.calls), sum(it.calls)
    return {
        "ttft": first.ttft,
        "wall": wall,
        "cpu_s": cpu,          # CPU time of this process (all threads) during the request
        "loadavg1": load,      # 1-minute load average when it started (other processes)
        "prompt_tokens": len(prompt),
        "cached_tokens": first.cached_tokens,
        "source": first.cache_source,
        "fetch_s": fetch_s,
        "fetch_calls": len(ft.calls),
        "insert_s": insert_s,
        "prefill_and_first_token_s": first.ttft - fetch_s - insert_s,
        "restore_s": after["restore_seconds"] - before["restore_seconds"],
        "bytes_read": after["bytes_read"] - before["bytes_read"],
    }


def disk_hit(model: str, cache_dir: str, prompt: list[int], drop: bool) -> dict[str, Any]:
    """Child process: drop the page cache, load, open the store, one timed request."""
    from kvstore import KVStore

    drop_info = C.drop_page_cache([cache_dir], enabled=drop)
    t0 = time.perf_counter()
    m, tok, path = C.load_model(model)
    load_s = time.perf_counter() - t0
    C.warm_up(m)
    store, open_s = C.timed(KVStore, cache_dir, max_entries=10)
    _, ident_s = C.timed(store.identity, path)
    r = request(store, m, tok, path, prompt)
    stats = store.stats()
    _, close_s = C.timed(store.close)
    r.update(page_cache=drop_info, load_model_s=load_s, open_store_s=open_s, identity_s=ident_s,
             close_flush_s=close_s, errors={k: stats[k] for k in ("corrupt", "write_errors")},
             dropped_writes=stats.get("dropped_writes"))
    return r


def run_model(ctx: C.Context, name: str, lengths: list[int], hits: int) -> list[dict[str, Any]]:
    from kvstore import KVStore

    model, tok, path = C.load_model(name)
    C.warm_up(model)
    out = []
    for L in lengths:
        ctx.log(f"  {name} {L} tokens: cold ...")
        d = ctx.scratch(f"ttft-{name}-{L}")
        store = KVStore(d, max_entries=10)
        _, ident_s = C.timed(store.identity, path)  # first time: hashes the weights
        prefix = C.text_tokens(tok, L - SUFFIX, seed=L)
        qs = [C.question_tokens(tok, SUFFIX, k) for k in range(2 + 2 * hits)]
        cold = request(store, model, tok, path, prefix + qs[0])
        _, flush_s = C.timed(store.flush)
        st = store.stats()
        write = {"flush_wait_s": flush_s, "write_seconds": st["write_seconds"],
                 "bytes_written": st["bytes_written"], "writes": st["writes"]}
        ctx.log(f"    cold ttft {cold['ttft']:.2f} s; background write {st['write_seconds']:.2f} s "
                f"for {st['bytes_written'] / 1e6:.0f} MB; memory hits ...")
        mem = []
        for i in range(hits):
            mem.append(request(store, model, tok, path, prefix + qs[1 + i]))
            store.flush()
        store.close()
        disk = []
        for i in range(hits):
            ctx.log(f"    disk hit {i + 1}/{hits} (fresh process, page cache dropped) ...")
            disk.append(C.run_child("ttft:disk_hit", {"model": name, "cache_dir": str(d),
                                                       "prompt": prefix + qs[1 + hits + i], "drop": ctx.drop}))
        ctx.log("    disk hit (fresh process, page cache warm) ...")
        C.warm_files([d])
        warm = C.run_child("ttft:disk_hit", {"model": name, "cache_dir": str(d),
                                              "prompt": prefix + qs[1 + 2 * hits], "drop": False})
        row = {"model": name, "tokens": L, "prefix_tokens": L - SUFFIX, "identity_first_s": ident_s,
               "cold": cold, "write": write, "memory_hits": mem, "disk_hits": disk, "disk_hit_warm": warm}
        row["medians"] = {
            "cold_ttft": cold["ttft"],
            "cold_cpu_s": cold["cpu_s"],
            "memory_ttft": C.median([r["ttft"] for r in mem]),
            "disk_ttft": C.median([r["ttft"] for r in disk]),
            "disk_warm_ttft": warm["ttft"],
            "disk_fetch_s": C.median([r["fetch_s"] for r in disk]),
            "disk_restore_s": C.median([r["restore_s"] for r in disk]),
            "disk_restored_tokens": C.median([r["cached_tokens"] for r in disk]),
            "memory_fetch_s": C.median([r["fetch_s"] for r in mem]),
            "kv_bytes_restored": C.median([r["bytes_read"] for r in disk]),
        }
        m = row["medians"]
        m["speedup_disk"] = C.ratio(m["cold_ttft"], m["disk_ttft"])
        m["speedup_disk_warm"] = C.ratio(m["cold_ttft"], m["disk_warm_ttft"])
        m["speedup_memory"] = C.ratio(m["cold_ttft"], m["memory_ttft"])
        m["page_cache_dropped"] = all(r["page_cache"]["dropped"] for r in disk)
        m["all_disk_hits_from_disk"] = all(r["source"] == "disk" for r in disk + [warm])
        ctx.log(f"    memory {C.fmt(m['memory_ttft'], 's')}, disk {C.fmt(m['disk_ttft'], 's')} "
                f"(warm {C.fmt(m['disk_warm_ttft'], 's')}): {C.fmt(m['speedup_disk'], 'x')} faster than cold")
        out.append(row)
    del model
    C.unload()
    return out


def run(ctx: C.Context) -> dict[str, Any]:
    started = time.perf_counter()
    models = QUICK if ctx.quick else DEFAULT
    override = ctx.options.get("ttft_lengths") or {}
    if override:  # --ttft-lengths MODEL=L1,L2 (an empty list drops the model)
        models = [(n, override.get(n, ls)) for n, ls in models] + [
            (n, ls) for n, ls in override.items() if n not in dict(models)]
        models = [(n, ls) for n, ls in models if ls]
    hits = 1 if ctx.quick else 3
    rows = []
    for name, lengths in models:
        rows.extend(run_model(ctx, name, lengths, hits))
    medians = {f"{r['model']}/{r['tokens']}": r["medians"] for r in rows}
    headline = {k: {"cold_s": v["cold_ttft"], "memory_s": v["memory_ttft"], "disk_s": v["disk_ttft"],
                    "disk_warm_s": v["disk_warm_ttft"], "speedup_disk": v["speedup_disk"]}
                for k, v in medians.items()}
    settings = {"models": [{"model": n, "lengths": ls} for n, ls in models], "question_tokens": SUFFIX,
                "hits_per_length": hits, "cold_runs_per_length": 1, "prefill_step": PREFILL_STEP,
                "skipped": [] if ctx.quick or override else SKIPPED, "drop_page_cache": ctx.drop,
                "kv_dtype": "float32"}
    notes = [
        "cpu_s (process CPU time, all threads) and loadavg1 are recorded per request: this machine is "
        "shared, and a wall time inflated by other processes shows as loadavg1 > cores and cpu_s / ttft "
        "well below the threads the BLAS uses.",
        "Cold is one run per length (a cold 8k prefill takes minutes on this CPU); hits are medians.",
        "TTFT excludes model load, store open and identity resolution (reported per process).",
        "Disk-hit processes drop the page cache before loading the model, so model and libraries "
        "are warm again by the time the request runs while the store's blobs and index are cold.",
    ]
    return C.document(NAME, ctx, settings, rows, medians, headline, notes, started)


def report(doc: dict[str, Any]) -> str:
    rows = []
    for r in doc["raw"]:
        m = r["medians"]
        rows.append([r["model"], r["tokens"], C.fmt(m["cold_ttft"], "s"), C.fmt(m["memory_ttft"], "s"),
                     C.fmt(m["disk_ttft"], "s"), C.fmt(m["disk_warm_ttft"], "s"),
                     m["disk_restored_tokens"], C.fmt(m["disk_fetch_s"], "s"),
                     C.fmt(m["speedup_disk"], "x"), "yes" if m["page_cache_dropped"] else "NO",
                     f"{r['cold'].get('cpu_s', 0):.0f} / {r['cold'].get('loadavg1')}"])
    return C.table("TTFT (median): cold prefill vs memory hit vs disk hit in a fresh process",
                   ["model", "tokens", "cold", "memory hit", "disk hit", "disk hit (warm pc)",
                    "restored", "disk fetch", "cold/disk", "pc dropped", "cold: CPU-s / load"], rows)


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = []
    for r in doc["raw"]:
        m = r["medians"]
        out.append((f"TTFT disk hit, fresh process, {r['model']} {r['tokens']} tok",
                    f"{C.fmt(m['disk_ttft'], 's')} ({C.fmt(m['speedup_disk'], 'x')} faster)",
                    f"cold prefill {C.fmt(m['cold_ttft'], 's')}; memory hit {C.fmt(m['memory_ttft'], 's')}"))
    return out
