"""Agent-loop trace: a long system prompt, then 20 turns that each extend the prompt, with
the process restarted after turn 10.

Two tracks, each through a real ``KVStore`` writing real files:

- storage (synthetic KV): the full trace — an 8192-token system prompt, then 20 turns each
  adding 200-2000 tokens (seeded) — with SmolLM2-shaped float32 KV (45 KB per token).
  Prefilling ~30k tokens 20 times on SmolLM2 does not fit the budget on a CPU, so the
  "prefill" of each turn appends random KV of the right shape to the restored cache; the
  store sees exactly what it would see from a model. Per turn: fetch (memory, or disk
  after the restart) -> extend -> insert -> flush, recording bytes written against the KV
  bytes of the turn's new tokens (write amplification), hits, fetch time and the disk
  footprint, which ends up compared with a whole-snapshot-per-turn design (the sum of every
  turn's full KV).
- ttft (real model): SmolLM2 float32 on the same trace scaled by 1/8 (1024-token system
  prompt, turns of 25-250 tokens), requests through ``stream_generate``: TTFT per turn,
  and one cold prefill of the last turn's whole prompt as the baseline.
- policy (real model): the ttft track's session once per write policy (``--persist``
  all / system / reused), the system prompt first stored as a system segment as
  mlx_lm.server and ``kvstore warm`` do: bytes written per session next to the TTFT of
  the turn after the restart, which is what each policy's writes buy.

The page cache is dropped at the restart when allowed (recorded).
"""

from __future__ import annotations

import random
import time
from typing import Any

from . import common as C

NAME = "agent_loop"
TURNS = 20
RESTART_AFTER = 10
SEED = 0


def trace(system: int, lo: int, hi: int, seed: int = SEED) -> dict[str, Any]:
    rng = random.Random(seed)
    adds = [rng.randint(lo, hi) for _ in range(TURNS)]
    lengths = []
    n = system
    for a in adds:
        n += a
        lengths.append(n)
    return {"system": system, "adds": adds, "lengths": lengths, "seed": seed, "range": [lo, hi]}


def _tokens(total: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(total)]


def synth_half(shape: str, cache_dir: str, lengths: list[int], first_turn: int, drop: bool) -> dict[str, Any]:
    """Child: turns ``first_turn..`` of the storage track in one fresh process."""
    from kvstore import KVStore

    pc = C.drop_page_cache([cache_dir], enabled=drop)
    sh = C.kv_shape(shape)
    tokens = _tokens(lengths[-1], SEED)
    ident = C.bench_identity(f"agent-{shape}")
    store, open_s = C.timed(KVStore, cache_dir, max_entries=4)
    rows = []
    for i, n in enumerate(lengths):
        turn = first_turn + i
        prompt = tokens[:n]
        before = store.stats()
        err = None
        try:
            got, fetch_s = C.timed(store.fetch, ident, prompt)
            cache, restored, source = got.cache, got.n, got.source
        except Exception as e:  # a kvstore bug must show in the results, not end the run
            err, cache, restored, source, fetch_s = f"{type(e).__name__}: {e}", None, 0, None, None
        new = n - restored
        cache, synth_s = C.timed(C.extend_cache, cache, sh, new, 1000 + turn)
        _, insert_s = C.timed(store.insert, ident, prompt, cache)
        _, flush_s = C.timed(store.flush)
        after = store.stats()
        written = after["bytes_written"] - before["bytes_written"]
        kv_new = new * sh["bytes_per_token"]
        rows.append({"turn": turn, "prompt_tokens": n, "restored_tokens": restored, "new_tokens": new,
                     "source": source, "fetch_s": fetch_s, "synth_prefill_s": synth_s, "insert_s": insert_s,
                     "flush_s": flush_s, "bytes_written": written, "kv_bytes_new": kv_new,
                     "write_amp": written / kv_new if kv_new else None,
                     "restore_s": after["restore_seconds"] - before["restore_seconds"],
                     "disk_bytes": after["disk_bytes"], "error": err})
        del cache
    st = store.stats()
    store.close()
    return {"rows": rows, "page_cache": pc, "open_store_s": open_s,
            "dropped_writes": st.get("dropped_writes"), "write_errors": st["write_errors"], "corrupt": st["corrupt"]}


def real_half(model: str, cache_dir: str, spec: dict[str, Any], first_turn: int, n_turns: int,
              drop: bool, cold_at_end: bool, persist: str = "all", system_segment: bool = False) -> dict[str, Any]:
    """Child: turns of the TTFT track with a real model in one fresh process, the store
    writing under ``persist``; ``system_segment``: first store the system prompt alone as
    a "system" segment (what mlx_lm.server and ``kvstore warm`` do)."""
    from kvstore import KVStore
    from kvstore.generate import stream_generate

    from .ttft import request

    pc = C.drop_page_cache([cache_dir], enabled=drop)
    m, tok, path = C.load_model(model)
    C.warm_up(m)
    tokens = C.text_tokens(tok, spec["system"], seed=7)
    for t, a in enumerate(spec["adds"]):
        tokens += C.text_tokens(tok, a, seed=100 + t)
    store, open_s = C.timed(KVStore, cache_dir, max_entries=10, persist=persist)
    _, ident_s = C.timed(store.identity, path)
    rows = []
    if system_segment:
        next(stream_generate(store, m, tok, tokens[: spec["system"]], model_key=path, max_tokens=1,
                             cache_type="system"))
        store.flush()
    for i in range(n_turns):
        turn = first_turn + i
        n = spec["lengths"][turn - 1]
        before = store.stats()
        try:
            r = request(store, m, tok, path, tokens[:n])
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}", "ttft": None, "cached_tokens": 0, "source": None}
        _, flush_s = C.timed(store.flush)
        after = store.stats()
        r.update(turn=turn, flush_s=flush_s, bytes_written=after["bytes_written"] - before["bytes_written"])
        rows.append(r)
    st = store.stats()
    store.close()
    cold = None
    if cold_at_end:
        mem = KVStore(memory_only=True)
        mem.identity(path)  # resolved before timing, as for the store (a memory-only store hashes the weights)
        cold = request(mem, m, tok, path, tokens[: spec["lengths"][first_turn + n_turns - 2]])
        mem.close()
    return {"rows": rows, "page_cache": pc, "open_store_s": open_s, "identity_s": ident_s, "cold_last_turn": cold,
            "dropped_writes": st.get("dropped_writes"), "write_errors": st["write_errors"],
            "bytes_written": st["bytes_written"], "writes": st["writes"],
            "writes_skipped": st["writes_skipped_policy"] + st["writes_skipped_budget"]}


POLICIES = ("all", "system", "reused")


def policy_spec(quick: bool) -> tuple[str, dict[str, Any]]:
    """The policy track's model and trace: the ttft track's (SmolLM2, 1/8 trace), or with
    ``quick`` tiny-llama on a 1/16 trace (long enough that a chunk boundary matters)."""
    return ("tiny-llama", trace(512, 12, 125)) if quick else ("smollm2", trace(1024, 25, 250))


def policy_track(ctx: C.Context, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The real-model session once per write policy, restarted after RESTART_AFTER: bytes
    written per session (system segment included) and the TTFT each policy keeps."""
    out = {}
    for persist in POLICIES:
        d = ctx.scratch(f"agent-policy-{persist}")
        halves = [C.run_child("agent_loop:real_half", {
            "model": model, "cache_dir": str(d), "spec": spec, "first_turn": first, "n_turns": last - first + 1,
            "drop": ctx.drop and first > 1, "cold_at_end": False, "persist": persist, "system_segment": first == 1})
            for first, last in ((1, RESTART_AFTER), (RESTART_AFTER + 1, TURNS))]
        rows = halves[0]["rows"] + halves[1]["rows"]
        after = rows[RESTART_AFTER]
        out[persist] = {
            "bytes_written_session": sum(h["bytes_written"] for h in halves),
            "writes": sum(h["writes"] for h in halves), "writes_skipped": sum(h["writes_skipped"] for h in halves),
            "ttft_restart_turn_s": after.get("ttft"), "restart_turn_cached_tokens": after.get("cached_tokens"),
            "restart_turn_prompt_tokens": after.get("prompt_tokens"), "restart_turn_source": after.get("source"),
            "ttft_median_after_restart_s": C.median([r["ttft"] for r in rows[RESTART_AFTER:] if r.get("ttft")]),
            "footprint_bytes": C.du(d)["apparent_bytes"], "rows": rows,
            "errors": [r["error"] for r in rows if r.get("error")],
        }
        p = out[persist]
        ctx.log(f"    persist={persist}: {p['bytes_written_session'] / 1e6:.1f} MB written per session, "
                f"turn {RESTART_AFTER + 1} after restart {C.fmt(p['ttft_restart_turn_s'], 's')} "
                f"({p['restart_turn_cached_tokens']}/{p['restart_turn_prompt_tokens']} tokens restored)")
    return out


def run(ctx: C.Context) -> dict[str, Any]:
    started = time.perf_counter()
    if ctx.quick:
        shape, s_spec = "tiny-llama", trace(1024, 25, 250)
        model, r_spec = "tiny-llama", trace(128, 3, 31)
    else:
        shape, s_spec = "smollm2", trace(8192, 200, 2000)
        model, r_spec = "smollm2", trace(1024, 25, 250)
    sh = C.kv_shape(shape)

    ctx.log(f"  storage track: {shape}-shaped synthetic KV, system {s_spec['system']}, "
            f"{TURNS} turns of {s_spec['range'][0]}-{s_spec['range'][1]} tokens ...")
    d = ctx.scratch("agent-storage")
    halves = []
    for first, last in ((1, RESTART_AFTER), (RESTART_AFTER + 1, TURNS)):
        halves.append(C.run_child("agent_loop:synth_half", {
            "shape": shape, "cache_dir": str(d), "lengths": s_spec["lengths"][first - 1: last],
            "first_turn": first, "drop": ctx.drop and first > 1}))
    s_rows = halves[0]["rows"] + halves[1]["rows"]
    footprint = C.du(d)
    whole = sum(n * sh["bytes_per_token"] for n in s_spec["lengths"])
    written = sum(r["bytes_written"] for r in s_rows)
    kv_new = sum(r["kv_bytes_new"] for r in s_rows)
    amps = [r["write_amp"] for r in s_rows[1:] if r["write_amp"] is not None]
    hits = [r for r in s_rows if r["source"]]
    final_kv = s_spec["lengths"][-1] * sh["bytes_per_token"]
    storage = {
        "spec": s_spec, "shape": sh, "rows": s_rows, "processes": [{k: v for k, v in h.items() if k != "rows"}
                                                                    for h in halves],
        "footprint": footprint, "index_bytes": footprint["apparent_bytes"] - s_rows[-1]["disk_bytes"],
        "summary": {
            "write_amp_median_turns_2_20": C.median(amps), "write_amp_max_turns_2_20": max(amps) if amps else None,
            "write_amp_overall": written / kv_new if kv_new else None,
            "bytes_written_total": written, "kv_bytes_new_total": kv_new,
            "hit_rate": len(hits) / len(s_rows), "hits": len(hits), "turns": len(s_rows),
            "token_hit_rate": sum(r["restored_tokens"] for r in s_rows) / sum(r["prompt_tokens"] for r in s_rows),
            "restart_turn_source": s_rows[RESTART_AFTER]["source"],
            "restart_turn_fetch_s": s_rows[RESTART_AFTER]["fetch_s"],
            "fetch_s_median": C.median([r["fetch_s"] for r in s_rows if r["fetch_s"] is not None]),
            "footprint_bytes": footprint["apparent_bytes"], "blob_bytes": s_rows[-1]["disk_bytes"],
            "whole_snapshot_bytes": whole, "footprint_vs_whole_snapshot": footprint["apparent_bytes"] / whole,
            "final_prompt_kv_bytes": final_kv, "footprint_vs_final_kv": footprint["apparent_bytes"] / final_kv,
            "errors": [r["error"] for r in s_rows if r["error"]],
        },
    }
    ss = storage["summary"]
    ctx.log(f"    write amp median {ss['write_amp_median_turns_2_20']:.2f}, footprint "
            f"{ss['footprint_bytes'] / 1e9:.2f} GB vs whole-snapshot {whole / 1e9:.2f} GB, hit rate {ss['hit_rate']:.2f}")

    ctx.log(f"  ttft track: {model}, system {r_spec['system']}, {TURNS} turns of "
            f"{r_spec['range'][0]}-{r_spec['range'][1]} tokens ...")
    d2 = ctx.scratch("agent-ttft")
    rh = []
    for first, last in ((1, RESTART_AFTER), (RESTART_AFTER + 1, TURNS)):
        rh.append(C.run_child("agent_loop:real_half", {
            "model": model, "cache_dir": str(d2), "spec": r_spec, "first_turn": first,
            "n_turns": last - first + 1, "drop": ctx.drop and first > 1, "cold_at_end": last == TURNS}))
    r_rows = rh[0]["rows"] + rh[1]["rows"]
    cold = rh[1]["cold_last_turn"]
    ttfts = [r["ttft"] for r in r_rows[1:] if r.get("ttft") is not None]
    real = {
        "spec": r_spec, "model": model, "rows": r_rows,
        "processes": [{k: v for k, v in h.items() if k != "rows"} for h in rh],
        "summary": {
            "ttft_turn1_cold_s": r_rows[0]["ttft"], "ttft_median_turns_2_20_s": C.median(ttfts),
            "ttft_max_turns_2_20_s": max(ttfts) if ttfts else None,
            "ttft_restart_turn_s": r_rows[RESTART_AFTER]["ttft"], "restart_turn_source": r_rows[RESTART_AFTER]["source"],
            "ttft_last_turn_s": r_rows[-1]["ttft"], "cold_last_turn_s": cold["ttft"] if cold else None,
            "last_turn_prompt_tokens": r_spec["lengths"][-1],
            "speedup_last_turn": C.ratio(cold["ttft"], r_rows[-1]["ttft"]) if cold else None,
            "hit_rate": sum(1 for r in r_rows if r.get("source")) / len(r_rows),
            "errors": [r["error"] for r in r_rows if r.get("error")],
        },
    }
    rs = real["summary"]
    ctx.log(f"    TTFT median {C.fmt(rs['ttft_median_turns_2_20_s'], 's')} per turn; last turn "
            f"{C.fmt(rs['ttft_last_turn_s'], 's')} vs cold {C.fmt(rs['cold_last_turn_s'], 's')}")

    p_model, p_spec = policy_spec(ctx.quick)
    ctx.log(f"  policy track: {p_model}, system {p_spec['system']}, one session per policy {POLICIES} ...")
    policies = policy_track(ctx, p_model, p_spec)

    medians = {"storage": storage["summary"], "ttft": real["summary"],
               "policy": {k: {x: y for x, y in v.items() if x != "rows"} for k, v in policies.items()}}
    headline = {
        "write_amp_median": ss["write_amp_median_turns_2_20"], "write_amp_overall": ss["write_amp_overall"],
        "hit_rate": ss["hit_rate"], "footprint_vs_whole_snapshot": ss["footprint_vs_whole_snapshot"],
        "ttft_median_s": rs["ttft_median_turns_2_20_s"], "cold_last_turn_s": rs["cold_last_turn_s"],
    }
    settings = {"turns": TURNS, "restart_after": RESTART_AFTER, "seed": SEED,
                "storage_track": {"shape": shape, "system": s_spec["system"], "adds": s_spec["range"],
                                  "kv": "synthetic float32"},
                "ttft_track": {"model": model, "system": r_spec["system"], "adds": r_spec["range"],
                               "kv": "real prefill, float32"},
                "policy_track": {"model": p_model, "system": p_spec["system"], "adds": p_spec["range"],
                                 "policies": list(POLICIES), "system_segment": True},
                "chunk_tokens": 256, "drop_page_cache_at_restart": ctx.drop}
    notes = ["Write amplification = bytes written for the turn / KV bytes of the tokens the turn had to "
             "prefill (prompt tokens minus restored tokens). Turn 1 (all new) is excluded from the median.",
             "Whole-snapshot design = the sum over turns of each turn's full prompt KV, one file per turn.",
             "Footprint = every file in the cache directory (blobs + LMDB index).",
             "The ttft track's trace is the storage trace scaled by 1/8 so SmolLM2 can prefill it on a CPU."]
    notes.append("Policy track: bytes written per session = every byte the store wrote in the 20-turn session "
                 "(both processes, the system segment included); the restart turn's TTFT is what the policy's "
                 "writes buy after a restart.")
    return C.document(NAME, ctx, settings, {"storage": storage, "ttft": real, "policy": policies}, medians,
                      headline, notes, started)


def report(doc: dict[str, Any]) -> str:
    s, r = doc["raw"]["storage"], doc["raw"]["ttft"]
    rows = []
    for a, b in zip(s["rows"], r["rows"]):
        rows.append([a["turn"], a["prompt_tokens"], a["new_tokens"], a["source"] or "miss",
                     f"{a['bytes_written'] / 1e6:.1f} MB", f"{a['write_amp']:.2f}" if a["write_amp"] else "-",
                     C.fmt(a["fetch_s"], "s"), b["prompt_tokens"] if "prompt_tokens" in b else "-",
                     b.get("source") or "miss", C.fmt(b.get("ttft"), "s")])
    out = C.table("Agent loop per turn (restart after turn 10)",
                  ["turn", "prompt", "new", "storage: hit", "written", "write amp", "fetch",
                   "ttft track: prompt", "hit", "TTFT"], rows)
    ss, rs = s["summary"], r["summary"]
    out += "\n" + C.table("Agent loop summary", ["metric", "value"], [
        ["write amplification, median turns 2-20 (max)",
         f"{ss['write_amp_median_turns_2_20']:.2f} ({ss['write_amp_max_turns_2_20']:.2f})"],
        ["bytes written / KV of new tokens, all turns", f"{ss['write_amp_overall']:.2f}"],
        ["hit rate (turns) / token hit rate", f"{ss['hit_rate']:.2f} / {ss['token_hit_rate']:.2f}"],
        ["disk footprint after 20 turns", f"{ss['footprint_bytes'] / 1e9:.2f} GB"],
        ["whole snapshot per turn", f"{ss['whole_snapshot_bytes'] / 1e9:.2f} GB "
                                    f"({ss['footprint_vs_whole_snapshot']:.3f} of it)"],
        ["turn 11 (after restart): source, fetch", f"{ss['restart_turn_source']}, {C.fmt(ss['restart_turn_fetch_s'], 's')}"],
        [f"TTFT track ({r['model']}): median turns 2-20", C.fmt(rs["ttft_median_turns_2_20_s"], "s")],
        ["TTFT track: turn 1 (cold) / turn 11 (restart)",
         f"{C.fmt(rs['ttft_turn1_cold_s'], 's')} / {C.fmt(rs['ttft_restart_turn_s'], 's')}"],
        [f"TTFT track: turn 20 ({rs['last_turn_prompt_tokens']} tok) vs cold",
         f"{C.fmt(rs['ttft_last_turn_s'], 's')} vs {C.fmt(rs['cold_last_turn_s'], 's')}"],
    ])
    if "policy" in doc["raw"]:
        out += "\n" + policy_table(doc)
    return out


def policy_table(doc: dict[str, Any]) -> str:
    """Bytes written per session and the TTFT after the restart, per write policy."""
    rows = [[k, f"{p['bytes_written_session'] / 1e6:.2f} MB", p["writes"], p["writes_skipped"],
             f"{p['restart_turn_cached_tokens']}/{p['restart_turn_prompt_tokens']}", p["restart_turn_source"] or "miss",
             C.fmt(p["ttft_restart_turn_s"], "s"), C.fmt(p["ttft_median_after_restart_s"], "s")]
            for k, p in doc["raw"]["policy"].items()]
    return C.table(f"Write policy ({doc['settings']['policy_track']['model']}, restart after turn {RESTART_AFTER})",
                   ["persist", "written / session", "writes", "skipped", f"turn {RESTART_AFTER + 1} restored",
                    "from", f"turn {RESTART_AFTER + 1} TTFT", "median TTFT 11-20"], rows)


def headline_rows(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    ss, rs = doc["medians"]["storage"], doc["medians"]["ttft"]
    sp = doc["raw"]["storage"]["spec"]
    return [
        (f"write amplification per turn (median turns 2-20; {sp['system']}-tok system + {TURNS} turns)",
         f"{ss['write_amp_median_turns_2_20']:.2f} (max {ss['write_amp_max_turns_2_20']:.2f})",
         "1.00 = only the new tokens' KV written"),
        ("disk footprint after 20 turns", f"{ss['footprint_bytes'] / 1e9:.2f} GB",
         f"whole snapshot per turn {ss['whole_snapshot_bytes'] / 1e9:.2f} GB "
         f"({1 / ss['footprint_vs_whole_snapshot']:.1f}x more)"),
        ("agent-loop hit rate (restart after turn 10)", f"{ss['hit_rate']:.2f}",
         f"token hit rate {ss['token_hit_rate']:.2f}; turn 11 from {ss['restart_turn_source']}"),
        (f"agent-loop TTFT per turn ({doc['raw']['ttft']['model']}, 1/8 trace)",
         f"{C.fmt(rs['ttft_median_turns_2_20_s'], 's')} median",
         f"cold prefill of turn 20 ({rs['last_turn_prompt_tokens']} tok) {C.fmt(rs['cold_last_turn_s'], 's')}"),
    ]


def policy_main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.agent_loop [--quick] [--out DIR]``: the policy track alone,
    written as ``<out>/agent_loop_policy.json`` and ``.md`` (default benchmarks/results)."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m benchmarks.agent_loop", description=policy_main.__doc__)
    p.add_argument("--quick", action="store_true", help="tiny-llama on a 1/16 trace")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--no-drop", action="store_true", help="never drop the page cache")
    args = p.parse_args(argv)
    from kvstore import blas

    blas.preload_openblas()
    started = time.perf_counter()
    ctx = C.Context(quick=args.quick, work=C.new_workdir(None), out=args.out, drop=not args.no_drop)
    model, spec = policy_spec(args.quick)
    try:
        policies = policy_track(ctx, model, spec)
    finally:
        import shutil

        shutil.rmtree(ctx.work, ignore_errors=True)
    settings = {"turns": TURNS, "restart_after": RESTART_AFTER, "seed": SEED, "chunk_tokens": 256,
                "policy_track": {"model": model, "system": spec["system"], "adds": spec["range"],
                                 "policies": list(POLICIES), "system_segment": True},
                "drop_page_cache_at_restart": ctx.drop}
    medians = {k: {x: y for x, y in v.items() if x != "rows"} for k, v in policies.items()}
    doc = C.document("agent_loop_policy", ctx, settings, {"policy": policies}, medians, medians, [
        "One agent session (system segment, then 20 turns, restarted after turn 10) per --persist policy; "
        "bytes written per session next to the TTFT of turn 11, the first after the restart."], started)
    C.write_json(args.out, "agent_loop_policy", doc)
    table = policy_table(doc)
    (args.out / "agent_loop_policy.md").write_text(table.lstrip("\n") + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(policy_main())
