"""``corruption``: damaged pack files (bit and byte flips and zeroed ranges inside one
segment, a pack truncated inside a segment, emptied, deleted, appended to, swapped with
another or renamed) and stray files next to them (a copy under a new pack name, ``*.tmp``
files, a pack-like file in the wrong place: reported, never touched, still there after
the check); flips, zeroed pages, truncation, deletion and garbage in ``index/data.mdb``
and ``lock.mdb``; damage written through LMDB into one stored value (bit and byte flips
inside a binary entry / chunk / pack / identity record, a truncated or partly zeroed
record, token ids, a trie edge, a counter: what damage LMDB cannot detect looks like);
and ``live`` flips of data.mdb under an open store that must keep serving from memory;
``node``: one node of a leaf page of the entries database damaged beside intact ones (the
salvage must keep every other entry); ``gc``: a gc (its own process) removing most
entries in one transaction, then the read-only CLI and a writable open (the healthy
index LMDB wrote must be read as it is, never called truncated or moved aside).
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
            + [("live", i) for i in range(size["lmdb_live"])]
            + [("node", i) for i in range(max(2, size["lmdb"] // 5))]
            + [("gc", i) for i in range(max(2, size["lmdb"] // 10))])
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
        elif where == "node":
            res = _node_case(ctx, t, cdir, tpl, rng, NODE_MODES[i % len(NODE_MODES)], ctx_info)
        elif where == "gc":
            res = _gc_case(ctx, t, cdir, tpl, rng, ctx_info)
        else:
            res = _live_case(ctx, t, cdir, tpl, rng, ctx_info)
        t.c["trials"] += 1
        ctx.debug(f"{ctx_info.get('case')} {ctx_info.get('mode')} {ctx_info.get('damage')} -> open={res.get('open')} "
                  f"full={res.get('full')} verify={res.get('verify')} wrong={len(res.get('wrong', []))} "
                  f"crashed={res.get('crashed')}")
        shutil.rmtree(cdir, ignore_errors=True)
        ctx.progress(t, k, len(plan))
    t.info["cases"] = {"blob": size["blob"], "lmdb": size["lmdb"], "lmdb_live": size["lmdb_live"],
                       "lmdb_node": sum(w == "node" for w, _ in plan), "gc_most": sum(w == "gc" for w, _ in plan)}
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


# ------------------------------------------------ one damaged node beside intact ones (salvage)

NODE_MODES = ("offset", "key_size")  # a node's pointer leaves its page; its key runs past the page


def _leaves(data: Path, db: str) -> list[tuple[int, list[tuple[int, bytes]]]]:
    """The leaf pages of database ``db`` in ``data`` (an undamaged file): (page number,
    [(node offset, key)]), read with LMDB 0.9's page layout (64-bit)."""
    import struct

    from kvstore.index.pages import db_roots, page_size

    psize = page_size(data)
    raw = data.read_bytes()
    out: list[tuple[int, list[tuple[int, bytes]]]] = []
    todo = [db_roots(data)[db]]
    while todo:
        pgno = todo.pop()
        b = raw[pgno * psize : (pgno + 1) * psize]
        flags, lower = struct.unpack_from("<HH", b, 10)
        nodes = []
        for i in range((lower - 16) // 2):
            off = int.from_bytes(b[16 + 2 * i : 18 + 2 * i], "little")
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", b, off)
            nodes.append((off, lo | (hi << 16) | (nflags << 32), bytes(b[off + 8 : off + 8 + ksize])))
        if flags & 0x02:  # a leaf
            out.append((pgno, [(off, key) for off, _, key in nodes]))
        else:  # a branch: its children
            todo.extend(child for _, child, _ in nodes)
    return out


def damage_node(cdir: Path, rng: random.Random, mode: str) -> tuple[str, bytes] | None:
    """Damage one node (not the first or last) of a leaf page of the entries database
    holding at least 3: its pointer leaves the page (``offset``) or its key runs past it
    (``key_size``). Returns (what was done, the damaged entry's key), None if no page fits."""
    from kvstore.index.pages import page_size

    data = cdir / "index" / "data.mdb"
    psize = page_size(data)
    fit = [(pg, nodes) for pg, nodes in _leaves(data, "entries") if len(nodes) >= 3]
    if not fit:
        return None
    pgno, nodes = rng.choice(fit)
    i = rng.randrange(1, len(nodes) - 1)
    off, key = nodes[i]
    with open(data, "r+b") as f:
        if mode == "offset":
            f.seek(pgno * psize + 16 + 2 * i)
            f.write((psize - 2).to_bytes(2, "little"))
        else:
            f.seek(pgno * psize + off + 6)
            f.write((0xFFFF).to_bytes(2, "little"))
    return f"entries page {pgno} node {i}/{len(nodes)}: {mode}", key


def _node_case(ctx: Ctx, t: Tally, cdir: Path, tpl: dict, rng: random.Random, mode: str, ctx_info: dict) -> dict:
    """One node of a leaf page damaged, its neighbours intact: the salvage (at open, or
    by verify --fix) keeps every other entry, so each one is still served in full
    (``lost`` otherwise); only the damaged entry may miss."""
    got = damage_node(cdir, rng, mode)
    if got is None:
        t.skipped.append("node: no entries leaf page with 3 nodes")
        return {}
    desc, key = got
    ctx_info.update(mode=f"node:{mode}", damage=desc)
    res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"], "targets": [key.hex()],
                            "committed": sorted(tpl["keys"] - {key.hex()}), "fix": True})
    t.add_check(res, **ctx_info)
    t.outcomes[f"node:{mode}:{res.get('open')}:{'kept' if not res.get('lost') else 'lost'}"] += 1
    return res


# ------------------------------------------------ a gc removing most entries, then read-only opens

# Many more entries (one commit each, many chunk, trie and token records) in the copy, so
# that a gc removing most of them needs new pages inside its one transaction.
_FILL = r"""
import random, sys
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from kvstore import KVStore
from kvstore.identity import Identity
from kvstore.model_layout import layout_of
d, n, seed, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
def cache(L):
    c = KVCache()
    c.keys = mx.random.normal((1, 1, L, 4), key=mx.random.key(rng.randrange(1 << 30)))
    c.values, c.offset = c.keys + 1, L
    return [c]
who = Identity.from_components({"test": "gc-most", "layout": layout_of(cache(1))})
with KVStore(d, chunk_tokens=chunk) as s:
    for _ in range(n):
        L = rng.randrange(20, 600)
        s.insert(who, [rng.randrange(1, 50000) for _ in range(L)], cache(L))
        assert s.flush()
"""


def _gc_case(ctx: Ctx, t: Tally, cdir: Path, tpl: dict, rng: random.Random, ctx_info: dict) -> dict:
    """``kvstore gc`` (its own process) down to a few percent of the bytes, in one
    transaction, then the read-only CLI and a writable open: the index LMDB wrote is
    healthy, so `ls`/`stats`/`verify` exit 0 and the open keeps it (``ok``, never moved
    aside); the file is often shorter than ``last_pgno`` says (counted in outcomes)."""
    import os
    import subprocess
    import sys

    import lmdb

    keep = rng.choice([1, 4096, 1 << 16, 1 << 18])
    n = rng.randint(20, 40)
    ctx_info.update(mode="gc_most", damage=f"{n} more entries, then gc --max-bytes {keep}B")
    cli = [sys.executable, "-m", "kvstore.cli"]
    p = subprocess.run([sys.executable, "-c", _FILL, str(cdir), str(n), str(rng.randrange(1 << 30)), str(CHUNK)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        t.fail("harness error", **ctx_info, error=p.stderr[-600:])
        return {}
    p = subprocess.run([*cli, "gc", "--max-bytes", f"{keep}B", "--blob-age", "0", "--cache-dir", str(cdir)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        t.c["failed_cases"] += 1
        t.fail("gc failed", **ctx_info, stderr=p.stderr[-600:])
        return {}
    env = lmdb.open(str(cdir / "index"), readonly=True, lock=False, max_dbs=16)
    try:
        short = os.path.getsize(cdir / "index" / "data.mdb") < (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()
    for cmd in ("ls", "stats", "verify"):
        p = subprocess.run([*cli, cmd, "--cache-dir", str(cdir)], capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            t.c["failed_cases"] += 1
            t.fail(f"`kvstore {cmd}` after a gc of most entries exited {p.returncode}", **ctx_info,
                   short_file=short, stderr=p.stderr[-600:])
    res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"], "targets": sorted(tpl["keys"]),
                            "fix": True})
    t.add_check(res, **ctx_info)
    if res.get("open") != "ok":
        t.c["failed_cases"] += 1
        t.fail("a healthy index after a gc was not opened as it is", **ctx_info, open=res.get("open"),
               short_file=short, logs=res.get("logs"))
    t.outcomes[f"gc_most:{'short_file' if short else 'full_file'}:{res.get('open')}"] += 1
    return res
