"""``corruption``: damaged pack files (bit and byte flips and zeroed ranges inside one
segment, a pack truncated inside a segment, emptied, deleted, appended to, swapped with
another or renamed) and stray files next to them (a copy under a new pack name, ``*.tmp``
files, a pack-like file in the wrong place: reported, never touched, still there after
the check); flips, zeroed pages, truncation, deletion and garbage in ``index/data.mdb``
and ``lock.mdb``; damage written through LMDB into one stored value (bit and byte flips
inside a binary entry / chunk / pack / identity record, a truncated or partly zeroed
record, token ids, a trie edge, a counter: what damage LMDB cannot detect looks like);
and ``live`` flips of data.mdb under an open store that must keep serving from memory.
An entry none of whose segments was damaged must survive a pack fault. A damaged index
may give a clear error (StoreOpenError), be moved aside at open (the documented
recovery, which must be logged) or degrade to misses, never a crash or a wrong hit.

Worker half: ``op_build_template`` (a populated directory to copy for each case) and
``op_live``; the offline cases are judged by the check. Parent half: ``run_corruption``
damages a copy per case (``damage.py``) and tallies the outcomes."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..check import Tally, entry_key, hit_problem, segment_users
from ..common import CHUNK, Emit, LogCapture, exc_info, guard
from ..damage import BLOB_MODES, LMDB_MODES, damage_lmdb_case, damage_open_file, damage_pack_case
from ..synth import SYSTEM_PROMPTS, Zoo, random_prompt

if TYPE_CHECKING:
    from ..context import Ctx


TEMPLATE_MIX = (("llama", 9), ("gemma", 3), ("qwen", 1), ("syn-kv", 3), ("syn-snap", 2))


def op_build_template(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """A populated cache directory for corruption cases: chunked entries sharing prefixes and
    chunks, snapshots (RotatingKVCache, ArraysCache) and synthetic entries."""
    from kvstore import KVStore
    rng = random.Random(msg["seed"])
    store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=100)
    entries = []
    bases = [list(p) for p in SYSTEM_PROMPTS[:2]]
    for name, count in TEMPLATE_MIX:
        for _ in range(count):
            if name == "qwen":
                toks = random_prompt(rng, 20, 30)
            elif name == "gemma" and not any(e["model"] == "gemma" for e in entries):
                toks = random_prompt(rng, 12, 28)  # <= the window: a trimmable snapshot
            elif name == "gemma":
                toks = random_prompt(rng, 40, 120)
            else:
                toks = random_prompt(rng, 20, 150, bases if name != "syn-snap" else None)
                if name == "llama":
                    bases.append(toks)
            store.insert(zoo.model_arg(name), toks, zoo.make_cache(name, toks))
            store.flush()
            entries.append({"model": name, "tokens": toks, "key": entry_key(store, zoo, name, toks)})
    segments = segment_users(store)
    stats = store.stats()
    store.close()
    data = Path(msg["dir"]) / "index" / "data.mdb"
    return {"entries": entries, "segments": segments, "data_mdb": data.stat().st_size,
            "write_errors": stats["write_errors"], "disk_entries": stats.get("disk_entries")}


def op_live(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Damage index/data.mdb under an open store: it must keep serving from memory."""
    from kvstore import KVStore
    from kvstore import maintenance as mt
    rng = random.Random(msg["seed"])
    res: dict[str, Any] = dict(escaped=[], wrong=[], memory_served=0, known=0, verify_errors=[],
                               inserts_after=0, write_errors=0, writer_failed=0)
    cap = LogCapture()
    with cap:
        store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=1000)
        known = [tuple(x) for x in msg["known"]]
        baseline = _warm_memory(zoo, store, known, res)
        res["damage"] = damage_open_file(Path(msg["dir"]) / "index" / "data.mdb", rng)
        _serve_after_damage(zoo, store, known, baseline, res)
        _insert_after_damage(zoo, store, rng, res)
        guard("flush()", res["escaped"], store.flush, 30)
        res["write_errors"] = (guard("stats()", res["escaped"], store.stats) or {}).get("write_errors")
        res["writer_failed"] = sum("background write failed" in r for r in cap.records)
        try:
            mt.verify(store.disk, blob_age=0)
        except Exception as e:
            res["verify_errors"].append(exc_info("verify()", e))
        guard("close()", res["escaped"], store.close)
    res["logs"] = cap.records[-6:]
    return res


def _fetch_checked(zoo: Zoo, store: Any, name: str, toks: list[int], res: dict, phase: str) -> Any:
    """Fetch (an exception goes to ``res["escaped"]``, and None is returned); a wrong hit
    goes to ``res["wrong"]``."""
    f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
    why = hit_problem(zoo, name, toks, f)
    if why is not None:
        res["wrong"].append({"model": name, "n": f.n, "detail": why, "phase": phase})
    return f


def _warm_memory(zoo: Zoo, store: Any, known: list[tuple], res: dict) -> dict[tuple, int]:
    """Fetch every known prompt from disk (a hit must pass) into the memory tier; returns
    what a second pass serves from memory: (model, tokens) -> tokens served."""
    for name, toks in known:
        _fetch_checked(zoo, store, name, toks, res, "before")
    store.flush()
    baseline = {}
    for name, toks in known:
        f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
        if f is not None and f.source == "memory":
            baseline[(name, tuple(toks))] = f.n
    store.flush()
    return baseline


def _serve_after_damage(zoo: Zoo, store: Any, known: list[tuple], baseline: dict[tuple, int], res: dict) -> None:
    """After the damage every known prompt is still served as far as memory served it
    (``memory_served``), and correctly."""
    for name, toks in known:
        res["known"] += 1
        f = _fetch_checked(zoo, store, name, toks, res, "after")
        if f is not None and f.n >= baseline.get((name, tuple(toks)), 0):
            res["memory_served"] += 1


def _insert_after_damage(zoo: Zoo, store: Any, rng: random.Random, res: dict) -> None:
    """Two inserts after the damage: each must be served back in full (``inserts_after``)."""
    for i in range(2):
        toks = random_prompt(rng, 20, 90)
        n_esc = len(res["escaped"])
        guard("insert()", res["escaped"], store.insert, zoo.model_arg("llama"), toks, zoo.prefill("llama", toks))
        if len(res["escaped"]) == n_esc:
            f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg("llama"), toks)
            if f is not None and f.n == len(toks):
                res["inserts_after"] += 1


def run_corruption(ctx: Ctx) -> dict:
    """Blob, index and live-index damage cases on copies of a few template directories."""
    size = ctx.size
    t = Tally("corruption")
    base = ctx.work / "corruption"
    shutil.rmtree(base, ignore_errors=True)
    (base / "cases").mkdir(parents=True)
    templates = [_template(ctx, t, base, j) for j in range(size["templates"])]
    t.info["template"] = {"entries": len(templates[0]["entries"]), "segments": len(templates[0]["segments"]),
                          "packs": len({s["pack"] for s in templates[0]["segments"]}),
                          "data_mdb_bytes": templates[0]["data_mdb"],
                          "models": dict(Counter(e["model"] for e in templates[0]["entries"]))}
    plan = ([("blob", i) for i in range(size["blob"])] + [("lmdb", i) for i in range(size["lmdb"])]
            + [("live", i) for i in range(size["lmdb_live"])])
    random.Random(ctx.seed).shuffle(plan)
    per_mode: Counter = Counter()
    for k, (where, i) in enumerate(plan):
        rng = random.Random(f"{ctx.seed}-{where}-{i}")
        tpl = templates[i % len(templates)]
        cdir = base / "cases" / f"{where}-{i}"
        shutil.copytree(tpl["dir"], cdir)
        ctx_info: dict[str, Any] = {"case": f"{where}-{i}", "seed": ctx.seed}
        if where == "blob":
            res = _blob_case(ctx, t, cdir, tpl, rng, BLOB_MODES[i % len(BLOB_MODES)], ctx_info)
        elif where == "lmdb":
            res = _lmdb_case(ctx, t, cdir, tpl, rng, LMDB_MODES[i % len(LMDB_MODES)], ctx_info, per_mode)
        else:
            res = _live_case(ctx, t, cdir, tpl, rng, ctx_info)
        t.c["trials"] += 1
        ctx.debug(f"{ctx_info.get('case')} {ctx_info.get('mode')} {ctx_info.get('damage')} -> open={res.get('open')} "
                  f"full={res.get('full')} verify={res.get('verify')} wrong={len(res.get('wrong', []))} "
                  f"crashed={res.get('crashed')}")
        shutil.rmtree(cdir, ignore_errors=True)
        ctx.progress(t, k, len(plan))
    t.info["cases"] = {"blob": size["blob"], "lmdb": size["lmdb"], "lmdb_live": size["lmdb_live"]}
    t.info["lmdb_outcomes_by_mode"] = dict(sorted(per_mode.items()))
    shutil.rmtree(base, ignore_errors=True)
    return t.result()


def _template(ctx: Ctx, t: Tally, base: Path, j: int) -> dict:
    """Build template ``j`` and check an undamaged copy (the control): it must be served in full."""
    d = base / f"template-{j}"
    info = ctx.checker.call({"op": "build_template", "dir": str(d), "seed": ctx.seed * 31 + j}, timeout=900)
    if "entries" not in info:
        raise RuntimeError(f"template build failed: {info}")
    info["dir"] = d
    info["known"] = [[e["model"], e["tokens"]] for e in info["entries"]]
    info["keys"] = {e["key"] for e in info["entries"]}
    c = base / "cases" / "control"
    shutil.copytree(d, c)
    res = ctx.checker.call({"op": "check", "dir": str(c), "known": info["known"],
                            "committed": sorted(info["keys"]), "fix": True})
    shutil.rmtree(c, ignore_errors=True)
    t.add_check(res, case=f"control-{j}")
    if res.get("full") != len(info["entries"]):
        t.fail("control: undamaged template not served in full", template=j, full=res.get("full"),
               claimed=res.get("claimed"))
    return info


def _blob_case(ctx: Ctx, t: Tally, cdir: Path, tpl: dict, rng: random.Random, mode: str, ctx_info: dict) -> dict:
    """Damage a segment or a pack file: every entry none of whose segments was damaged
    must still be served in full, and stray files must be left as they are."""
    desc, targets, keep = damage_pack_case(cdir, tpl["segments"], rng, mode)
    ctx_info.update(mode=mode, damage=desc)
    res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"],
                            "targets": sorted(targets), "committed": sorted(tpl["keys"] - targets),
                            "fix": True, "keep": keep})
    t.add_check(res, **ctx_info)
    t.outcomes[f"blob:{mode}:{'full' if res.get('full') == len(tpl['keys']) else 'degraded'}"] += 1
    return res


def _lmdb_case(ctx: Ctx, t: Tally, cdir: Path, tpl: dict, rng: random.Random, mode: str, ctx_info: dict,
               per_mode: Counter) -> dict:
    """Damage the index: a clear error, a logged recovery or misses; never a wrong hit."""
    desc = damage_lmdb_case(cdir, rng, mode)
    ctx_info.update(mode=mode, damage=desc)
    res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"],
                            "targets": sorted(tpl["keys"]), "fix": True})
    t.add_check(res, **ctx_info)
    if res.get("crashed"):
        outcome = f"crash:{res.get('signal')}"
    elif res.get("open") != "ok":
        outcome = res.get("open")
    elif res.get("known_hits") == len(tpl["keys"]) and not res.get("verify"):
        outcome = "undetected_harmless"
    else:
        outcome = "degraded_to_misses"
    t.outcomes[f"lmdb:{outcome}"] += 1
    per_mode[f"lmdb:{mode}:{outcome}"] += 1
    if res.get("open") == "open_error" and len(t.info.setdefault("open_errors", [])) < 10:
        t.info["open_errors"].append({**ctx_info, "message": res.get("open_error")})
    return res


def _live_case(ctx: Ctx, t: Tally, cdir: Path, tpl: dict, rng: random.Random, ctx_info: dict) -> dict:
    """Damage the index under an open store (``op_live``): the memory tier keeps serving."""
    res = ctx.checker.call({"op": "live", "dir": str(cdir), "known": tpl["known"], "seed": rng.randrange(1 << 30)})
    ctx_info["mode"] = "live"
    t.add_check(res, **ctx_info)
    if res.get("crashed"):
        t.outcomes[f"live:crash:{res.get('signal')}"] += 1
        return res
    ctx_info["damage"] = res.get("damage")
    served = res.get("memory_served", 0) == res.get("known")
    t.outcomes[f"live:{'memory_served' if served else 'not_served'}"] += 1
    if not served:
        t.fail("live damage: memory tier stopped serving", **ctx_info, res={
            k: res.get(k) for k in ("memory_served", "known", "logs")})
    return res
