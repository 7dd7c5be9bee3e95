"""``kvstore stats``: totals by identity and tier, index and blob bytes, hits, free space."""

from __future__ import annotations

import argparse
import shutil
from typing import Any

from . import common

MEMORY_NOTE = ("per process: each server holds its own memory tier; ask the server for its memory "
               "entries and bytes (`GET /v1/cache/stats` on a `kvstore serve`)")


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "stats", help="totals by identity and tier, index and blob bytes, hits, free space",
        description="Totals of a cache directory: disk entries, chunks and bytes by model "
                    "identity, index size, blob bytes (as the index counts them and as found "
                    "on disk), the sum of entries' hit counters and free space on the "
                    "filesystem. The memory tier is per process and not visible here.")
    common.add_cache_dir(p)
    common.add_json(p)
    common.add_shared(p)
    return p


def collect(disk) -> dict[str, Any]:
    from .. import files
    from ..index import scan
    from ..bytes_written import utc_day, written
    from ..index.formats import set_aside_stores
    from ..side_records import usage as record_usage

    snap = scan(disk.index, full=False)
    by: dict[str, dict[str, Any]] = {}

    def row(hx: str) -> dict[str, Any]:
        if hx not in by:
            info = snap.identities.get(hx)
            by[hx] = {"identity": hx, "name": info.name if info else None, "path": info.path if info else None,
                      "model_present": common.model_present(info),
                      "entries": 0, "chunks": 0, "bytes": 0, "tokens": 0, "hits": 0, "pinned": 0}
        return by[hx]

    for rec in snap.entries.values():
        if rec is None:
            continue
        r = row(rec.identity.hex())
        r["entries"] += 1
        r["bytes"] += sum(s.length for s in rec.segments)
        r["tokens"] += rec.n
        r["hits"] += rec.hits
        r["pinned"] += rec.pinned
    for crec in snap.chunks.values():
        if crec is None:
            continue
        r = row(crec.identity.hex())
        r["chunks"] += 1
        r["bytes"] += crec.segment.length
    own, _foreign = files.own_packs(disk.blob_root)
    live = sum(p.live for p in snap.packs.values() if p)
    usage = shutil.disk_usage(disk.root)
    today, total = written(disk.index)
    idents = sorted(by.values(), key=lambda r: (str(r["name"] or ""), r["identity"]))
    return {
        "cache_dir": str(disk.root),
        "chunk_tokens": disk.chunk,
        "disk": {
            "entries": sum(r["entries"] for r in idents),
            "chunks": sum(r["chunks"] for r in idents),
            "identities": len(snap.identities),
            "pinned": sum(r["pinned"] for r in idents),
            "blob_bytes": snap.meta_bytes,
            "live_bytes": live,
            "blob_bytes_on_disk": sum(f.st.st_size for f in own),
            "blob_files": len(own),
            "index_bytes": disk.index.file_bytes(),
            "records": {name: {"count": u.count, "bytes": u.bytes} for name, u in record_usage(disk.root).items()},
        },
        "memory": None,
        "memory_note": MEMORY_NOTE,
        "hits": sum(r["hits"] for r in idents),
        "written": {"day": utc_day(), "today_bytes": today, "total_bytes": total},
        "filesystem": {"free_bytes": usage.free, "total_bytes": usage.total, "used_bytes": usage.used},
        "by_identity": idents,
        "set_aside": [{"path": str(p), "bytes": n} for p, n in set_aside_stores(disk.root)],
    }


def run(args: argparse.Namespace) -> int:
    if args.shared is not None:  # a shared tier, not a cache directory
        from . import shared_tier  # the shared tier's code: only with --shared

        return shared_tier.run_stats(args)
    disk = common.open_disk(args)
    try:
        s = collect(disk)
    finally:
        disk.close()
    if args.json:
        common.print_json(s)
        return 0
    d, fs, hb = s["disk"], s["filesystem"], common.human_bytes
    drift = "" if d["blob_bytes"] == d["blob_bytes_on_disk"] else (
        f"  ({hb(d['blob_bytes_on_disk'])} on disk; `kvstore verify` explains the difference)")
    print(f"cache dir     {s['cache_dir']}  (chunk_tokens={s['chunk_tokens'] or 'not set yet'})")
    P = common.plural
    print(f"disk tier     {P(d['entries'], 'entry', 'entries')}, {P(d['chunks'], 'chunk')}, "
          f"{P(d['identities'], 'identity', 'identities')}, {d['pinned']} pinned")
    dead = d["blob_bytes"] - d["live_bytes"]
    print(f"blob bytes    {hb(d['blob_bytes'])} in {P(d['blob_files'], 'pack file')}{drift}"
          + (f"; {hb(dead)} of it no longer used (freed with the last user of each pack)" if dead > 0 else ""))
    print(f"index bytes   {hb(d['index_bytes'])} (index/data.mdb)")
    for name, r in d["records"].items():  # kvstore.side_records: counted in the disk budget
        print(f"{name + ' ':<14}{P(r['count'], 'record')}, {hb(r['bytes'])} (in the disk budget)")
    print(f"hits          {s['hits']} (sum of entries' hit counters)")
    w = s["written"]
    print(f"written       {hb(w['today_bytes'])} today ({w['day']} UTC), {hb(w['total_bytes'])} in total")
    print(f"free space    {hb(fs['free_bytes'])} of {hb(fs['total_bytes'])} on this filesystem")
    print(f"memory tier   {MEMORY_NOTE}")
    for old in s["set_aside"]:
        print(f"set aside     {old['path']} ({hb(old['bytes'])}: a store of another format; "
              "`kvstore gc --old-formats` removes it)")
    if s["by_identity"]:
        print()
        rows = [[r["identity"][:12], common.identity_name(r["identity"], r) + ("" if r["model_present"] is not False else " (missing)"),
                 r["entries"], r["chunks"], r["tokens"], hb(r["bytes"]), r["hits"], r["pinned"]]
                for r in s["by_identity"]]
        print(common.table(rows, ["IDENTITY", "MODEL", "ENTRIES", "CHUNKS", "TOKENS", "BYTES", "HITS", "PINNED"],
                           right=(2, 3, 4, 5, 6, 7)))
    return 0
