"""``kvstore ls``: entries grouped by model identity."""

from __future__ import annotations

import argparse
import time
from typing import Any

from . import common


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "ls", help="list cached entries, grouped by model identity",
        description="List the entries of a cache directory grouped by model identity (model "
                    "name, path, KV dtype), with their tokens, size (own blob + chunks), last "
                    "use, hits and pin. ENTRY ids are the first 12 hex digits of the entry key; "
                    "other commands accept any unique prefix.")
    common.add_cache_dir(p)
    common.add_json(p)
    return p


def collect(disk) -> dict[str, Any]:
    """The listing as plain data (what --json prints)."""
    from .. import maintenance as M

    snap = M.snapshot(disk, full=False)
    groups: dict[str, list[tuple[bytes, dict]]] = {}
    for key, rec in snap.entries.items():
        if rec is not None:
            groups.setdefault(rec.get("identity", "?"), []).append((key, rec))
    out = []
    for hx, items in groups.items():
        info = snap.identities.get(hx, {})
        items.sort(key=lambda kr: kr[1].get("last_used", 0), reverse=True)
        entries = []
        for key, rec in items:
            entries.append({
                "id": common.short_id(key), "key": key.hex(), "tokens": rec.get("n"),
                "bytes": M.entry_bytes(rec, snap.chunks), "own_bytes": int(rec.get("size") or 0),
                "chunks": len(rec.get("chunks", [])), "kind": rec.get("kind"),
                "cache_type": rec.get("cache_type"), "created": rec.get("created"),
                "last_used": rec.get("last_used"), "hits": rec.get("hits", 0),
                "pinned": bool(rec.get("pinned")),
            })
        out.append({
            "identity": hx, "name": info.get("name"), "path": info.get("path"),
            "model_type": info.get("model_type"), "model_present": common.model_present(info),
            "kv_dtype": _dtype(disk, items, info),
            "entries": entries,
        })
    out.sort(key=lambda g: (str(g["name"] or ""), g["identity"]))
    return {"cache_dir": str(disk.root), "total_bytes": snap.meta_bytes,
            "n_entries": sum(len(g["entries"]) for g in out), "identities": out}


def _dtype(disk, items: list[tuple[bytes, dict]], info: dict) -> str | None:
    """KV dtype of an identity: quantisation from the layout, else the dtype of a key
    tensor in the header of its most recent entry's blob (or first chunk)."""
    from .. import maintenance as M

    if info.get("kv_bits"):
        return f"{info['kv_bits']}-bit"
    for _key, rec in items[:3]:
        rel = rec.get("blob")
        if not rel and rec.get("chunks"):
            c = disk.index.chunk(bytes.fromhex(rec["chunks"][0]))
            rel = c.get("blob") if c else None
        header = None
        if rel:
            try:
                header = M.blob_header(disk.blob_root / rel)
            except Exception:
                header = None
        got = M.kv_dtype(rec.get("layout"), header)
        if got:
            return got
    return None


def run(args: argparse.Namespace) -> int:
    disk = common.open_disk(args)
    try:
        data = collect(disk)
    finally:
        disk.close()
    if args.json:
        common.print_json(data)
        return 0
    if not data["identities"]:
        print(f"no entries in {data['cache_dir']}")
        return 0
    now = time.time()
    for i, g in enumerate(data["identities"]):
        if i:
            print()
        bits = ", ".join(str(b) for b in (g["model_type"], g["kv_dtype"]) if b)
        print(f"{common.identity_name(g['identity'], g)}{f'  ({bits})' if bits else ''}  identity {g['identity'][:12]}")
        if g["path"]:
            print(f"  model: {g['path']}{'' if g['model_present'] else '  (missing)'}")
        rows = [[e["id"], e["tokens"], common.human_bytes(e["bytes"]), e["cache_type"] or "-",
                 common.ago(e["last_used"], now), e["hits"], "yes" if e["pinned"] else ""]
                for e in g["entries"]]
        print(common.table(rows, ["ENTRY", "TOKENS", "SIZE", "TYPE", "LAST USED", "HITS", "PINNED"],
                           right=(1, 2, 5), indent="  "))
    n_id = len(data["identities"])
    print(f"\n{common.plural(data['n_entries'], 'entry', 'entries')}, "
          f"{common.plural(n_id, 'identity', 'identities')}, {common.human_bytes(data['total_bytes'])} "
          "of blobs (shared chunks counted once)")
    return 0
