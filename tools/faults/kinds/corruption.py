"""Damaged blobs and index, offline and under an open store."""

from __future__ import annotations

import os
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..check import Tally, _entry_key, _progress, blob_users
from ..common import CHUNK, Emit, LogCapture, _guard, exc_info
from ..damage import BLOB_MODES, LMDB_MODES, damage_blob_case, damage_lmdb_case
from ..synth import SYSTEM_PROMPTS, Zoo, random_prompt

if TYPE_CHECKING:
    from ..harness import Ctx


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
            entries.append({"model": name, "tokens": toks, "key": _entry_key(store, zoo, name, toks)})
    users = {b: sorted(u) for b, u in blob_users(store).items()}
    stats = store.stats()
    store.close()
    data = Path(msg["dir"]) / "index" / "data.mdb"
    return {"entries": entries, "blob_users": users, "data_mdb": data.stat().st_size,
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
        for name, toks in known:  # warm the memory tier from disk
            f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is not None and f.cache is not None and f.n:
                ok, why = zoo.check(name, toks, f.cache, f.n)
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why, "phase": "before"})
        store.flush()
        baseline = {}  # what the memory tier serves before the damage (second pass: memory only)
        for name, toks in known:
            f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is not None and f.source == "memory":
                baseline[(name, tuple(toks))] = f.n
        store.flush()
        data = Path(msg["dir"]) / "index" / "data.mdb"
        size = data.stat().st_size
        fd = os.open(data, os.O_RDWR)
        descs = []
        try:
            for _ in range(rng.randint(1, 6)):
                if rng.random() < 0.3:
                    page = rng.randrange(2, max(3, size // 4096))
                    a, b = page * 4096 + rng.randrange(4096), 0
                    b = min(size, a + rng.randint(16, 1024))
                    os.pwrite(fd, bytes(b - a), a)
                    descs.append(f"zero [{a},{b})")
                else:
                    off = rng.randrange(size)
                    cur = os.pread(fd, 1, off)
                    os.pwrite(fd, bytes([cur[0] ^ (1 << rng.randrange(8))]), off)
                    descs.append(f"flip {off}")
        finally:
            os.close(fd)
        res["damage"] = descs
        for name, toks in known:
            res["known"] += 1
            f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is None:
                continue
            want = baseline.get((name, tuple(toks)), 0)
            if f.n >= want:
                res["memory_served"] += 1
            if f.cache is not None and f.n:
                ok, why = zoo.check(name, toks, f.cache, f.n)
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why, "phase": "after"})
        for i in range(2):
            toks = random_prompt(rng, 20, 90)
            n_esc = len(res["escaped"])
            _guard("insert()", res["escaped"], store.insert, zoo.model_arg("llama"), toks, zoo.prefill("llama", toks))
            if len(res["escaped"]) == n_esc:
                f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg("llama"), toks)
                if f is not None and f.n == len(toks):
                    res["inserts_after"] += 1
        _guard("flush()", res["escaped"], store.flush, 30)
        _guard("stats()", res["escaped"], store.stats)
        res["write_errors"] = store._stats["write_errors"]
        res["writer_failed"] = store.writer.failed if store.writer else 0
        try:
            mt.verify(store.disk, tmp_age=0, blob_age=0)
        except Exception as e:
            res["verify_errors"].append(exc_info("verify()", e))
        _guard("close()", res["escaped"], store.close)
    res["logs"] = cap.records[-6:]
    return res


def run_corruption(ctx: Ctx) -> dict:
    size = ctx.size
    t = Tally("corruption")
    base = ctx.work / "corruption"
    shutil.rmtree(base, ignore_errors=True)
    (base / "cases").mkdir(parents=True)
    templates = []
    for j in range(size["templates"]):
        d = base / f"template-{j}"
        info = ctx.checker.call({"op": "build_template", "dir": str(d), "seed": ctx.seed * 31 + j}, timeout=900)
        if "entries" not in info:
            raise RuntimeError(f"template build failed: {info}")
        info["dir"] = d
        info["known"] = [[e["model"], e["tokens"]] for e in info["entries"]]
        info["keys"] = {e["key"] for e in info["entries"]}
        templates.append(info)
        # control: an undamaged copy must pass completely
        c = base / "cases" / "control"
        shutil.copytree(d, c)
        res = ctx.checker.call({"op": "check", "dir": str(c), "known": info["known"],
                                "committed": sorted(info["keys"]), "fix": True})
        shutil.rmtree(c, ignore_errors=True)
        t.add_check(res, case=f"control-{j}")
        if res.get("full") != len(info["entries"]):
            t.fail("control: undamaged template not served in full", template=j, full=res.get("full"),
                   claimed=res.get("claimed"))
    t.info["template"] = {"entries": len(templates[0]["entries"]), "blobs": len(templates[0]["blob_users"]),
                          "data_mdb_bytes": templates[0]["data_mdb"],
                          "models": dict(Counter(e["model"] for e in templates[0]["entries"]))}
    plan = ([("blob", i) for i in range(size["blob"])] + [("lmdb", i) for i in range(size["lmdb"])]
            + [("live", i) for i in range(size["lmdb_live"])])
    random.Random(ctx.seed).shuffle(plan)
    per_kind = Counter()
    for k, (where, i) in enumerate(plan):
        rng = random.Random(f"{ctx.seed}-{where}-{i}")
        tpl = templates[i % len(templates)]
        cdir = base / "cases" / f"{where}-{i}"
        shutil.copytree(tpl["dir"], cdir)
        ctx_info: dict[str, Any] = {"case": f"{where}-{i}", "seed": ctx.seed}
        if where == "blob":
            mode = BLOB_MODES[i % len(BLOB_MODES)]
            desc, targets = damage_blob_case(cdir, tpl, rng, mode)
            ctx_info.update(mode=mode, damage=desc)
            res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"],
                                    "targets": sorted(targets), "committed": sorted(tpl["keys"] - targets),
                                    "fix": True})
            t.add_check(res, **ctx_info)
            t.outcomes[f"blob:{mode}:{'full' if res.get('full') == len(tpl['keys']) else 'degraded'}"] += 1
        elif where == "lmdb":
            mode = LMDB_MODES[i % len(LMDB_MODES)]
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
            per_kind[f"lmdb:{mode}:{outcome}"] += 1
            if res.get("open") == "open_error" and len(t.info.setdefault("open_errors", [])) < 10:
                t.info["open_errors"].append({**ctx_info, "message": res.get("open_error")})
        else:
            res = ctx.checker.call({"op": "live", "dir": str(cdir), "known": tpl["known"],
                                    "seed": rng.randrange(1 << 30)})
            ctx_info["mode"] = "live"
            t.add_check(res, **ctx_info)
            if not res.get("crashed"):
                ctx_info["damage"] = res.get("damage")
                served = res.get("memory_served", 0) == res.get("known")
                t.outcomes[f"live:{'memory_served' if served else 'not_served'}"] += 1
                if not served:
                    t.fail("live damage: memory tier stopped serving", **ctx_info, res={
                        k: res.get(k) for k in ("memory_served", "known", "logs")})
            else:
                t.outcomes[f"live:crash:{res.get('signal')}"] += 1
        t.c["trials"] += 1
        ctx.debug(f"{ctx_info.get('case')} {ctx_info.get('mode')} {ctx_info.get('damage')} -> open={res.get('open')} "
                  f"full={res.get('full')} verify={res.get('verify')} wrong={len(res.get('wrong', []))} "
                  f"crashed={res.get('crashed')}")
        shutil.rmtree(cdir, ignore_errors=True)
        _progress(ctx, t, k, len(plan))
    t.info["cases"] = {"blob": size["blob"], "lmdb": size["lmdb"], "lmdb_live": size["lmdb_live"]}
    t.info["lmdb_outcomes_by_mode"] = dict(sorted(per_kind.items()))
    shutil.rmtree(base, ignore_errors=True)
    return t.result()
