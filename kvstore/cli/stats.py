"""``kvstore stats``: totals by identity and tier, index and blob bytes, hits, free space."""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from . import common

MEMORY_NOTE = ("per process: each server holds its own memory tier; ask the server "
               "(KVStore.stats()) for its memory entries and bytes")


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "stats", help="totals by identity and tier, index and blob bytes, hits, free space",
        description="Totals of a cache directory: disk entries, chunks and bytes by model "
                    "identity, index size, blob bytes (as the index counts them and as found "
                    "on disk), the sum of entries' hit counters and free space on the "
                    "filesystem. The memory tier is per process and not visible here.")
    common.add_cache_dir(p)
    common.add_json(p)
    return p


def collect(disk) -> dict[str, Any]:
    from .. import maintenance as M

    snap = M.snapshot(disk, full=False)
    by: dict[str, dict[str, Any]] = {}

    def row(hx: str) -> dict[str, Any]:
        if hx not in by:
            info = snap.identities.get(hx, {})
            by[hx] = {"identity": hx, "name": info.get("name"), "path": info.get("path"),
                      "model_present": common.model_present(info),
                      "entries": 0, "chunks": 0, "bytes": 0, "tokens": 0, "hits": 0, "pinned": 0}
        return by[hx]

    for rec in snap.entries.values():
        if rec is None:
            continue
        r = row(rec.get("identity", "?"))
        r["entries"] += 1
        r["bytes"] += int(rec.get("size") or 0)
        r["tokens"] += int(rec.get("n") or 0)
        r["hits"] += int(rec.get("hits") or 0)
        r["pinned"] += bool(rec.get("pinned"))
    for rec in snap.chunks.values():
        if rec is None:
            continue
        r = row(rec.get("identity", "?"))
        r["chunks"] += 1
        r["bytes"] += int(rec.get("size") or 0)
    files = on_disk = 0
    for dirpath, _dirs, names in os.walk(disk.blob_root):
        for n in names:
            try:
                on_disk += os.stat(os.path.join(dirpath, n)).st_size
                files += 1
            except FileNotFoundError:
                pass
    usage = shutil.disk_usage(disk.root)
    stored = disk.index.meta_setdefault(b"chunk_tokens", b"") if disk.index.readonly else str(disk.chunk).encode()
    chunk = int(stored) if stored else next(
        (int(r["chunk"]) for r in snap.entries.values() if r and r.get("chunk")), None)
    idents = sorted(by.values(), key=lambda r: (str(r["name"] or ""), r["identity"]))
    return {
        "cache_dir": str(disk.root),
        "chunk_tokens": chunk,
        "disk": {
            "entries": sum(r["entries"] for r in idents),
            "chunks": sum(r["chunks"] for r in idents),
            "identities": len(snap.identities),
            "pinned": sum(r["pinned"] for r in idents),
            "blob_bytes": snap.meta_bytes,
            "blob_bytes_on_disk": on_disk,
            "blob_files": files,
            "index_bytes": disk.index.file_bytes(),
        },
        "memory": None,
        "memory_note": MEMORY_NOTE,
        "hits": sum(r["hits"] for r in idents),
        "filesystem": {"free_bytes": usage.free, "total_bytes": usage.total, "used_bytes": usage.used},
        "by_identity": idents,
    }


def run(args: argparse.Namespace) -> int:
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
    print(f"blob bytes    {hb(d['blob_bytes'])} in {P(d['blob_files'], 'file')}{drift}")
    print(f"index bytes   {hb(d['index_bytes'])} (index/data.mdb)")
    print(f"hits          {s['hits']} (sum of entries' hit counters)")
    print(f"free space    {hb(fs['free_bytes'])} of {hb(fs['total_bytes'])} on this filesystem")
    print(f"memory tier   {MEMORY_NOTE}")
    if s["by_identity"]:
        print()
        rows = [[r["identity"][:12], common.identity_name(r["identity"], r) + ("" if r["model_present"] is not False else " (missing)"),
                 r["entries"], r["chunks"], r["tokens"], hb(r["bytes"]), r["hits"], r["pinned"]]
                for r in s["by_identity"]]
        print(common.table(rows, ["IDENTITY", "MODEL", "ENTRIES", "CHUNKS", "TOKENS", "BYTES", "HITS", "PINNED"],
                           right=(2, 3, 4, 5, 6, 7)))
    return 0
