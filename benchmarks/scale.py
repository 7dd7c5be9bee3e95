"""Scale: 100,000 small entries in one store.

Entries are one-layer float16 ``KVCache`` snapshots of 16-64 tokens (2 KV heads x 16 dims:
128 bytes per token), token ids random, with sharing: each prompt starts with one of 2,000
"system prompts" of 8-24 tokens. Measured:

- insert throughput: ``insert`` calls on the request thread (p50/p99) and entries
  persisted per second (the writer thread; fsynced blob + index commit per entry), with a
  queue large enough that nothing is dropped (the dropped count is reported);
- lookup latency at 1k, 10k and 100k entries: ``fetch`` of a stored prompt (disk: the
  memory tier is emptied first), of a new continuation of a stored system prompt
  (partial), and of a prompt sharing nothing (absent), p50 / p99;
- a new process opening the store after a clean close, as after a reboot: with the page
  cache dropped at every checkpoint (1k, 10k, 100k entries: open + first lookup, which
  must not grow with the index), and with a warm page cache (import, open, first lookup,
  then lookups as above);
- gc to 90% of the blob bytes (the ``kvstore gc`` CLI when installed, else
  ``kvstore.budget.evict_to`` in a fresh process);
- the index size on disk.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
import time
from typing import Any

from . import common as C

NAME = "scale"
FAMILIES = 2000
HEADS, DIM = 2, 16
LOOKUP_BUDGET_S = 30.0


def scale_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    fam = [[rng.randrange(1, 50000) for _ in range(rng.randint(8, 24))] for _ in range(FAMILIES)]
    out = []
    for _ in range(n):
        p = list(rng.choice(fam))
        p += [rng.randrange(1, 50000) for _ in range(max(rng.randint(16, 64) - len(p), 8))]
        out.append(p)
    return out


def _partial(prompts: list[list[int]], k: int, seed: int) -> list[list[int]]:
    """New continuations of stored system prompts (shares 8-24 tokens with stored entries)."""
    rng = random.Random(seed)
    fam = [[r.randrange(1, 50000) for _ in range(r.randint(8, 24))]
           for r in [random.Random(0)] for _ in range(FAMILIES)]
    out = []
    for _ in range(k):
        p = list(rng.choice(fam))
        out.append(p + [rng.randrange(50001, 60000) for _ in range(max(rng.randint(16, 64) - len(p), 8))])
    return out


def _absent(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(60001, 90000) for _ in range(rng.randint(16, 64))] for _ in range(k)]


def _lookups(store: Any, ident: Any, present: list[list[int]], partial: list[list[int]],
             absent: list[list[int]], budget_s: float = LOOKUP_BUDGET_S) -> dict[str, Any]:
    """Time fetches of each kind; a kind stops early (after at least 3) once it has used
    ``budget_s`` seconds, so a slow index cannot stall the run (``n`` says how many ran)."""
    out: dict[str, Any] = {}
    for label, qs in (("present", present), ("partial", partial), ("absent", absent)):
        ts, ok = [], 0
        t_kind = time.perf_counter()
        for q in qs:
            if len(ts) >= 3 and time.perf_counter() - t_kind > budget_s:
                break
            store.trim_to(0)  # empty the memory tier: every lookup goes to the index
            got, dt = C.timed(store.fetch, ident, q)
            ts.append(dt)
            if label == "present":
                ok += got.n == len(q) and got.source == "disk"
            elif label == "absent":
                ok += got.source is None
            else:
                ok += got.n > 0
        out[label] = {"seconds": ts, **{k: v for k, v in C.summary(ts).items() if k != "n"}, "n": len(ts),
                      "as_expected": ok}
    return out


def open_child(cache_dir: str, n_entries: int, samples: int, drop: bool, budget_s: float = 10.0) -> dict[str, Any]:
    """Child: a new process opens the store, looks one stored prompt up, then ``samples``
    more of each kind (none: only the first lookup)."""
    pc = C.drop_page_cache([cache_dir], enabled=drop)
    t0 = time.perf_counter()
    from kvstore import KVStore
    import_s = time.perf_counter() - t0
    store, open_s = C.timed(KVStore, cache_dir, max_entries=10)
    ident = C.bench_identity("scale")
    prompts = scale_prompts(n_entries)
    rng = random.Random(7)
    present = [prompts[rng.randrange(n_entries)] for _ in range(samples + 1)]
    got, first_s = C.timed(store.fetch, ident, present[0])
    look = _lookups(store, ident, present[1:], _partial(prompts, samples, 8), _absent(samples, 9),
                    budget_s) if samples else None
    store.close()
    return {"page_cache": pc, "import_s": import_s, "open_s": open_s, "first_lookup_s": first_s,
            "first_lookup_source": got.source, "lookups": look}


def gc_child(cache_dir: str, max_bytes: int) -> dict[str, Any]:
    """Child: ``kvstore.budget.evict_to`` in a fresh process (when there is no CLI)."""
    from kvstore.budget import evict_to
    from kvstore.disk import DiskTier

    t0 = time.perf_counter()
    disk = DiskTier(C.Path(cache_dir))
    open_s = time.perf_counter() - t0
    gone, evict_s = C.timed(evict_to, disk, max_bytes)
    disk.close()
    return {"open_s": open_s, "evict_s": evict_s, "removed": len(gone), "seconds": time.perf_counter() - t0}


def _gc(cache_dir: str, max_bytes: int) -> dict[str, Any]:
    if importlib.util.find_spec("kvstore.cli.gc") is not None:
        cmd = [sys.executable, "-m", "kvstore.cli", "gc", "--cache-dir", cache_dir, "--max-bytes", f"{max_bytes}B"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=C.REPO_ROOT)
        dt = time.perf_counter() - t0
        if proc.returncode == 0:
            return {"method": "cli: " + " ".join(cmd[1:]), "seconds": dt, "stdout_tail": proc.stdout[-600:]}
        cli_err = f"exit {proc.returncode}: {proc.stderr[-600:]}"
    else:
        cli_err = "kvstore.cli.gc not installed"
    r = C.run_child("scale:gc_child", {"cache_dir": cache_dir, "max_bytes": max_bytes})
    r.update(method="kvstore.budget.evict_to (fresh process)", cli=cli_err)
    return r


def run(ctx: C.Context) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from kvstore import KVStore

    started = time.perf_counter()
    if ctx.quick:
        N = ctx.options.get("scale_entries") or 600
        checkpoints, open_samples = {N // 4: 10, N: 10}, 5
    else:
        N = ctx.options.get("scale_entries") or 100_000
        checkpoints = {c: 30 for c in (1000, 10_000) if c < N}
        checkpoints[N] = 30
        open_samples = 10
    d = ctx.scratch("scale")
    ident = C.bench_identity("scale")
    prompts = scale_prompts(N)
    ctx.log(f"  filling {N} entries ...")
    store = KVStore(d, max_entries=10, queue_size=N + 1024)
    base_k = mx.random.normal((1, HEADS, 4096, DIM), key=mx.random.key(1)).astype(mx.float16)
    base_v = mx.random.normal((1, HEADS, 4096, DIM), key=mx.random.key(2)).astype(mx.float16)
    mx.eval(base_k, base_v)
    rng = random.Random(3)
    ins: list[float] = []
    phases = []
    t_phase = time.perf_counter()
    done = 0
    for i, p in enumerate(prompts):
        n = len(p)
        off = rng.randrange(4096 - n)
        c = KVCache()
        c.keys, c.values, c.offset = base_k[..., off: off + n, :], base_v[..., off: off + n, :], n
        t0 = time.perf_counter()
        store.insert(ident, p, [c])
        ins.append(time.perf_counter() - t0)
        if i + 1 in checkpoints:
            t_calls = time.perf_counter() - t_phase
            _, flush_s = C.timed(store.flush)
            dt = time.perf_counter() - t_phase
            st = store.stats()
            phase = {"entries": i + 1, "inserted": i + 1 - done, "seconds": dt, "calls_seconds": t_calls,
                     "flush_wait_s": flush_s, "persisted_per_s": (i + 1 - done) / dt,
                     "writer_seconds_total": st["write_seconds"], "dropped_writes": st.get("dropped_writes"),
                     "disk_entries": st.get("disk_entries")}
            ctx.log(f"    {i + 1} entries: {phase['persisted_per_s']:.0f} persisted/s; lookups ...")
            k = checkpoints[i + 1]
            rs = random.Random(i)
            present = [prompts[rs.randrange(i + 1)] for _ in range(k)]
            phase["lookups"] = _lookups(store, ident, present, _partial(prompts, k, i), _absent(k, i + 1))
            lk = phase["lookups"]
            ctx.log(f"      fetch p50 present {C.fmt(lk['present']['p50'], 's')}, partial "
                    f"{C.fmt(lk['partial']['p50'], 's')}, absent {C.fmt(lk['absent']['p50'], 's')}")
            if ctx.drop:  # a restart after a reboot: clean close, page cache dropped, new process
                store.close()
                cold = C.run_child("scale:open_child", {"cache_dir": str(d), "n_entries": i + 1, "samples": 0,
                                                        "drop": True})
                phase["open_cold"] = cold
                ctx.log(f"      new process, page cache dropped: open {C.fmt(cold['open_s'], 's')}, "
                        f"first lookup {C.fmt(cold['first_lookup_s'], 's')}")
                store = KVStore(d, max_entries=10, queue_size=N + 1024)
            phases.append(phase)
            done = i + 1
            t_phase = time.perf_counter()
    st = store.stats()
    store.close()
    idx = C.du(d / "index")
    blobs = C.du(d / "blobs")
    total_fill = sum(ph["seconds"] for ph in phases)
    fill = {"entries": N, "seconds": total_fill, "persisted_per_s": N / total_fill,
            "insert_call": {k: v for k, v in C.summary(ins).items()},
            "dropped_writes": st.get("dropped_writes"), "write_errors": st["write_errors"],
            "disk_entries": st.get("disk_entries"), "blob_bytes": st["disk_bytes"]}
    ctx.log(f"  {N} entries in {total_fill:.0f} s ({fill['persisted_per_s']:.0f}/s); new process, warm ...")
    warm = C.run_child("scale:open_child", {"cache_dir": str(d), "n_entries": N, "samples": open_samples,
                                             "drop": False})
    cold = phases[-1].get("open_cold")
    target = int(st["disk_bytes"] * 0.9)
    ctx.log(f"  gc to {target / 1e6:.0f} MB ...")
    gc = _gc(str(d), target)
    after = KVStore(d, max_entries=2)
    st2 = after.stats()
    after.close()
    gc.update(target_bytes=target, entries_before=st.get("disk_entries"), entries_after=st2.get("disk_entries"),
              bytes_before=st["disk_bytes"], bytes_after=st2["disk_bytes"])
    last = phases[-1]["lookups"]
    medians = {
        "insert_call_p50_s": fill["insert_call"]["p50"], "insert_call_p99_s": fill["insert_call"]["p99"],
        "persisted_per_s": fill["persisted_per_s"],
        "lookup_by_entries": {str(ph["entries"]): {k: {"p50": v["p50"], "p99": v["p99"]} for k, v in ph["lookups"].items()}
                              for ph in phases},
        "lookup_present_p50_s": last["present"]["p50"], "lookup_present_p99_s": last["present"]["p99"],
        "lookup_absent_p50_s": last["absent"]["p50"], "lookup_absent_p99_s": last["absent"]["p99"],
        "lookup_partial_p50_s": last["partial"]["p50"],
        "open_warm_s": warm["open_s"], "first_lookup_warm_s": warm["first_lookup_s"],
        "open_cold_s": cold["open_s"] if cold else None, "first_lookup_cold_s": cold["first_lookup_s"] if cold else None,
        "open_plus_first_lookup_cold_by_entries": {str(ph["entries"]): ph["open_cold"]["open_s"] + ph["open_cold"]["first_lookup_s"]
                                                   for ph in phases if ph.get("open_cold")},
        "gc_s": gc["seconds"], "gc_removed": (gc["entries_before"] or 0) - (gc["entries_after"] or 0),
        "index_bytes": idx["apparent_bytes"], "index_allocated_bytes": idx["allocated_bytes"],
        "blob_bytes": blobs["apparent_bytes"], "blob_allocated_bytes": blobs["allocated_bytes"],
        "blob_files": blobs["files"], "dropped_writes": fill["dropped_writes"],
    }
    headline = {k: medians[k] for k in ("persisted_per_s", "insert_call_p50_s", "lookup_present_p50_s",
                                        "lookup_present_p99_s", "lookup_absent_p50_s", "lookup_absent_p99_s",
                                        "open_warm_s", "open_plus_first_lookup_cold_by_entries", "gc_s",
                                        "index_bytes")}
    settings = {"entries": N, "checkpoints": checkpoints, "lookup_budget_s_per_kind": LOOKUP_BUDGET_S, "tokens_per_entry": [16, 64], "families": FAMILIES,
                "family_prefix_tokens": [8, 24], "layers": 1, "kv_heads": HEADS, "head_dim": DIM,
                "kv_dtype": "float16", "chunk_tokens": 256, "queue_size": N + 1024,
                "open_samples": open_samples, "gc_target": "90% of blob bytes"}
    notes = ["Every entry is shorter than chunk_tokens (256), so every entry is one segment (one pack "
             "file) hanging off the root of the key trie.",
             "Cold opens follow a clean close (the store's clean stamp then vouches for the index, so the "
             "open reads no records); after a crash the first open checks every record in a child process.",
             "Lookups empty the memory tier first (store.trim_to(0)), so each one walks the disk index."]
    raw = {"fill": fill, "phases": phases, "open_warm": warm, "open_cold": cold, "gc": gc,
           "index": idx, "blobs": blobs}
    return C.document(NAME, ctx, settings, raw, medians, headline, notes, started)


def report(doc: dict[str, Any]) -> str:
    m, raw = doc["medians"], doc["raw"]
    rows = []
    for ph in raw["phases"]:
        lk, oc = ph["lookups"], ph.get("open_cold")
        rows.append([ph["entries"], f"{ph['persisted_per_s']:.0f}/s",
                     *[f"{C.fmt(lk[k]['p50'], 's')} / {C.fmt(lk[k]['p99'], 's')}" for k in ("present", "partial", "absent")],
                     C.fmt(oc["open_s"] + oc["first_lookup_s"], "s") if oc else "not dropped"])
    out = C.table("Scale: throughput and fetch latency (p50 / p99) as the store grows",
                  ["entries", "persisted", "fetch present", "fetch partial", "fetch absent",
                   "restart after reboot: open + first lookup"], rows)
    w, c = raw["open_warm"], raw["open_cold"]
    out += "\n" + C.table("Scale: new process, gc, sizes", ["metric", "value"], [
        ["insert() call p50 / p99", f"{C.fmt(m['insert_call_p50_s'], 's')} / {C.fmt(m['insert_call_p99_s'], 's')}"],
        ["dropped writes", m["dropped_writes"]],
        ["new process (warm): import / open / first lookup",
         f"{C.fmt(w['import_s'], 's')} / {C.fmt(w['open_s'], 's')} / {C.fmt(w['first_lookup_s'], 's')}"],
        ["new process (page cache dropped): open / first lookup",
         f"{C.fmt(c['open_s'], 's')} / {C.fmt(c['first_lookup_s'], 's')}" if c else "not dropped"],
        ["gc to 90% of bytes", f"{C.fmt(raw['gc']['seconds'], 's')}, {m['gc_removed']} entries removed "
                               f"({raw['gc']['method'].split(':')[0]})"],
        ["index on disk", f"{m['index_bytes'] / 1e6:.1f} MB ({m['index_allocated_bytes'] / 1e6:.1f} MB allocated)"],
        ["blobs", f"{m['blob_files']} files, {m['blob_bytes'] / 1e6:.1f} MB "
                  f"({m['blob_allocated_bytes'] / 1e6:.1f} MB allocated)"],
    ])
    return out


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    m, raw = doc["medians"], doc["raw"]
    n = doc["settings"]["entries"]
    return [
        (f"insert throughput, {n} entries of 16-64 tok", f"{m['persisted_per_s']:.0f} entries/s persisted",
         f"insert() call p50 {C.fmt(m['insert_call_p50_s'], 's')}, p99 {C.fmt(m['insert_call_p99_s'], 's')}; "
         f"{m['dropped_writes']} dropped"),
        (f"fetch latency at {n} entries, present (p50 / p99)",
         f"{C.fmt(m['lookup_present_p50_s'], 's')} / {C.fmt(m['lookup_present_p99_s'], 's')}",
         "at 1k entries: " + C.fmt(m["lookup_by_entries"][min(m["lookup_by_entries"], key=int)]["present"]["p50"], "s")),
        (f"fetch latency at {n} entries, absent (p50 / p99)",
         f"{C.fmt(m['lookup_absent_p50_s'], 's')} / {C.fmt(m['lookup_absent_p99_s'], 's')}",
         "at 1k entries: " + C.fmt(m["lookup_by_entries"][min(m["lookup_by_entries"], key=int)]["absent"]["p50"], "s")),
        (f"new process open + first lookup, page cache dropped, {n} entries",
         C.fmt((m["open_cold_s"] or 0) + (m["first_lookup_cold_s"] or 0), "s") if m["open_cold_s"] is not None else "not dropped",
         "by entries: " + ", ".join(f"{k}: {C.fmt(v, 's')}" for k, v in m["open_plus_first_lookup_cold_by_entries"].items())
         + f"; warm open {C.fmt(m['open_warm_s'], 's')}"),
        (f"gc to 90% of bytes, {n} entries", C.fmt(m["gc_s"], "s"),
         f"{m['gc_removed']} entries removed; {raw['gc']['method'].split(':')[0]}"),
        (f"index size, {n} entries", f"{m['index_bytes'] / 1e6:.1f} MB",
         f"blobs {m['blob_bytes'] / 1e6:.0f} MB in {m['blob_files']} files"),
    ]
