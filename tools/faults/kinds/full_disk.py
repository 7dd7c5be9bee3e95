"""The cache directory on a small tmpfs that fills up."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..check import Tally, _entry_key, _progress, cache_digest, raw_entries
from ..common import CHUNK, Emit, LogCapture, _decode, _guard, exc_info
from ..damage import _fill, _mount_tmpfs, _umount
from ..synth import Zoo, random_prompt
from .permissions import _open_modes

if TYPE_CHECKING:
    from ..harness import Ctx


def op_full_disk(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """The cache directory on a small tmpfs (mounted by the parent) that fills up."""
    import kvstore.index as kindex
    from kvstore import KVStore
    from kvstore import maintenance as mt
    rng = random.Random(msg["seed"])
    mnt = Path(msg["mnt"])
    cdir = mnt / "cache"
    filler = mnt / "filler"
    res: dict[str, Any] = dict(escaped=[], wrong=[], inserts=0, persisted=0, failed_writes=0,
                               uncounted_failures=0, memory_misses=0, verify_problems={}, reopen_misses=0,
                               reopen_checked=0, resumed=0, resume_failures=0, writer_failed=0,
                               error_messages=[], map=msg.get("small_map", False))
    saved_map = kindex._INITIAL_MAP
    if msg.get("small_map"):
        kindex._INITIAL_MAP = 64 << 10  # reach MDB_MAP_FULL (and the map growth path) on the small disk
    cap = LogCapture()
    digests: dict[str, str] = {}
    inserted: list[tuple[str, list[int], str]] = []
    import kvstore.blobs as kblobs
    real_write = kblobs.write_blob
    armed = {"on": False}

    def write_then_fill(path: Any, tensors: Any, metadata: Any) -> Any:
        """The disk fills between a blob write and the index commit (the LMDB write fails)."""
        out = real_write(path, tensors, metadata)
        if armed["on"]:
            armed["on"] = False
            _fill(mnt / "filler2", 1 << 30)
        return out

    if msg.get("fill_between"):
        kblobs.write_blob = write_then_fill
    try:
        with cap:
            store = KVStore(cdir, chunk_tokens=CHUNK, max_entries=100_000)

            def insert(toks: list[int], name: str) -> bool | None:
                cache = zoo.make_cache(name, toks)
                dg = cache_digest(cache)
                k = _entry_key(store, zoo, name, toks)
                we, failed, dropped = store._stats["write_errors"], store.writer.failed, store.writer.dropped
                n_esc = len(res["escaped"])
                _guard("insert()", res["escaped"], store.insert, zoo.model_arg(name), toks, cache)
                _guard("flush()", res["escaped"], store.flush)
                if len(res["escaped"]) != n_esc:
                    return None
                inserted.append((name, toks, dg))
                digests[k] = dg
                ok = _guard("index.entry()", res["escaped"], store.disk.index.entry, bytes.fromhex(k)) is not None
                d_we = store._stats["write_errors"] - we
                d_failed = store.writer.failed - failed
                if not ok and d_we == 0:
                    res["uncounted_failures"] += 1  # a failed write that write_errors did not count
                res["writer_failed"] += d_failed
                return ok

            for _ in range(msg.get("pre_entries", 0)):
                insert(random_prompt(rng, 30, 150), "llama")
            st = os.statvfs(mnt)
            free = st.f_bavail * st.f_frsize
            res["filler"] = _fill(filler, max(0, free - msg["leave"]))
            fails = 0
            for i in range(msg.get("max_inserts", 60)):
                armed["on"] = bool(msg.get("fill_between")) and i == 0
                r = rng.random()  # small synthetic entries fill the last bytes (the index's own pages)
                name = "llama" if r < 0.55 else "gemma" if r < 0.7 else "syn-kv"
                ok = insert(random_prompt(rng, 30, 200), name)
                res["inserts"] += 1
                if ok:
                    res["persisted"] += 1
                    fails = 0
                else:
                    res["failed_writes"] += 1
                    fails += 1
                    if fails >= 4:
                        break
            res["write_errors"] = store._stats["write_errors"]
            # serving continues from memory: every insert is still a full, correct hit
            for name, toks, dg in inserted:
                f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
                if f is None or f.n != len(toks) or f.cache is None:
                    res["memory_misses"] += 1
                elif cache_digest(f.cache) != dg:
                    ok, why = zoo.check(name, toks, f.cache, f.n)
                    if not ok:
                        res["wrong"].append({"model": name, "n": f.n, "detail": why})
            _guard("stats()", res["escaped"], store.stats)
            try:  # nothing half-written is indexed (and nothing left behind)
                probs = mt.verify(store.disk, tmp_age=0, blob_age=0)
                res["verify_problems"] = dict(Counter(p.kind for p in probs))
                res["verify_detail"] = [f"{p.kind} {p.path} {p.detail}" for p in probs[:5]]
            except Exception as e:
                res["escaped"].append(exc_info("verify()", e))
            _guard("close()", res["escaped"], store.close)
            # a fresh store serves every indexed entry in full, bit-identical to what was inserted
            store = KVStore(cdir, chunk_tokens=CHUNK, max_entries=100_000)
            names = zoo.ident_map(store)
            for k, rec, toks in raw_entries(store):
                tokens = _decode(toks)
                name = names.get(rec.get("identity"))
                f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), tokens)
                res["reopen_checked"] += 1
                if f is None or f.n != len(tokens) or f.source != "disk":
                    res["reopen_misses"] += 1
                elif cache_digest(f.cache) != digests.get(k.hex()):
                    res["wrong"].append({"key": k.hex(), "detail": "disk entry differs from what was inserted"})
            # space comes back: writing resumes
            filler.unlink()
            with contextlib.suppress(FileNotFoundError):
                (mnt / "filler2").unlink()
            for i in range(msg.get("resume_inserts", 4)):
                ok = insert(random_prompt(rng, 30, 120), "llama")
                res["resumed" if ok else "resume_failures"] += 1
            res["stats"] = {k: v for k, v in (_guard("stats()", res["escaped"], store.stats) or {}).items()
                            if k in ("write_errors", "writes", "dropped_writes", "disk_entries", "disk_bytes")}
            _guard("close()", res["escaped"], store.close)
            res["error_messages"] = sorted({r for r in cap.records if "WARNING" in r or "ERROR" in r})[:8]
            res["map_grown"] = sum("map full" in r for r in cap.records)
            res["index_enospc"] = sum("mdb_txn_commit" in r for r in cap.records)
    finally:
        kindex._INITIAL_MAP = saved_map
        kblobs.write_blob = real_write
    return res


def op_open_full(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Open a store on a filesystem that is already full."""
    return _open_modes(msg["dir"])


def run_full_disk(ctx: Ctx) -> dict:
    t = Tally("full_disk")
    base = ctx.work / "fulldisk"
    n = ctx.size["full_disk"]
    leaves = [0, 60 << 10, 200 << 10, 500 << 10, 1000 << 10, 1800 << 10, 2800 << 10]
    for i in range(n + 1):
        mnt = base / f"m{i}"
        err = _mount_tmpfs(mnt)
        if err:
            t.skipped.append(err)
            break
        rng = random.Random(f"{ctx.seed}-full-{i}")
        try:
            if i == n:  # open on a disk that is already full
                _fill(mnt / "filler", 8 << 20)
                res = ctx.misc.call({"op": "open_full", "dir": str(mnt / "cache")})
                if res.get("crashed") or res.get("harness_error"):
                    t.add_check(res, trial="open on a full disk")
                    t.c["trials"] += 1
                    continue
                t.info["open_on_full_disk"] = {m: {k: v for k, v in r.items() if k != "escaped"} for m, r in res.items()}
                for m, r in res.items():
                    for e in r.get("escaped", []):
                        t.c["escaped_exceptions"] += 1
                        t.fail("escaped exception (open on a full disk)", mode=m, exception=e)
                    if m != "raise" and not r.get("served"):
                        t.c["failed_cases"] += 1
                        t.fail("open on a full disk: memory tier did not serve", mode=m, res=r)
                t.c["trials"] += 1
                continue
            msg = {"op": "full_disk", "mnt": str(mnt), "seed": rng.randrange(1 << 30),
                   "leave": leaves[i % len(leaves)] + rng.randrange(40 << 10), "pre_entries": rng.randint(0, 3),
                   "small_map": i % 3 == 2, "fill_between": i % 3 == 1, "max_inserts": 120}
            res = ctx.misc.call(msg, timeout=1200)
        finally:
            _umount(mnt)
        ctx_info = {"trial": i, "leave": msg["leave"], "small_map": msg["small_map"]}
        if res.get("crashed") or res.get("harness_error"):
            t.add_check(res, **ctx_info)
            t.c["trials"] += 1
            continue
        for w in res["wrong"]:
            t.c["wrong_restores"] += 1
            t.fail("wrong restore", **ctx_info, detail=w)
        for e in res["escaped"]:
            t.c["escaped_exceptions"] += 1
            t.fail("escaped exception", **ctx_info, exception=e)
        bad = []
        if res["failed_writes"] == 0:
            bad.append("the disk never filled")
        if res["uncounted_failures"]:
            bad.append(f"{res['uncounted_failures']} failed writes not counted in write_errors")
        if res["memory_misses"]:
            bad.append(f"{res['memory_misses']} inserts not served from memory")
        if res["verify_problems"]:
            bad.append(f"verify after the failures: {res['verify_problems']}")
        if res["reopen_misses"]:
            bad.append(f"{res['reopen_misses']} indexed entries not served after reopening")
        if res["resume_failures"]:
            bad.append(f"{res['resume_failures']} writes failed after space was freed")
        if bad:
            t.c["failed_cases"] += 1
            t.fail("full disk: " + "; ".join(bad), **ctx_info,
                   res={k: res.get(k) for k in ("inserts", "persisted", "failed_writes", "write_errors",
                                                "writer_failed", "uncounted_failures", "verify_detail",
                                                "error_messages", "stats")})
        t.outcomes["served_from_memory" if not res["memory_misses"] else "memory_misses"] += 1
        t.outcomes["writes_resumed" if res["resumed"] and not res["resume_failures"] else "writes_not_resumed"] += 1
        t.outcomes["failures_counted" if not res["uncounted_failures"] else "failures_uncounted"] += 1
        t.info.setdefault("runs", []).append({
            "leave_bytes": msg["leave"], "small_map": msg["small_map"], "fill_between": msg["fill_between"],
            "map_grown": res.get("map_grown"), "index_enospc": res.get("index_enospc"), "inserts": res["inserts"],
            "persisted": res["persisted"], "failed_writes": res["failed_writes"],
            "write_errors": res.get("write_errors"), "writer_failed": res["writer_failed"],
            "reopen_checked": res["reopen_checked"], "resumed": res["resumed"],
            "errors": res["error_messages"][:4]})
        t.c["trials"] += 1
        _progress(ctx, t, i, n + 1)
    shutil.rmtree(base, ignore_errors=True)
    return t.result()
