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
    common.add_shared(p)
    return p


def collect(disk) -> dict[str, Any]:
    """The listing as plain data (what --json prints)."""
    from ..index import scan

    snap = scan(disk.index, full=False)
    groups: dict[str, list[tuple[bytes, Any]]] = {}
    for key, rec in snap.entries.items():
        if rec is not None:
            groups.setdefault(rec.identity.hex(), []).append((key, rec))
    out: list[dict[str, Any]] = []
    for hx, items in groups.items():
        info = snap.identities.get(hx)
        items.sort(key=lambda kr: kr[1].last_used, reverse=True)
        entries = [{
            "id": common.short_id(key), "key": key.hex(), "tokens": rec.n,
            "bytes": common.entry_bytes(rec, snap.chunks), "own_bytes": sum(s.length for s in rec.segments),
            "chunks": len(rec.chunks), "kind": "chunked" if rec.chunked else "snapshot",
            "cache_type": rec.cache_type, "created": rec.created, "last_used": rec.last_used,
            "hits": rec.hits, "pinned": rec.pinned,
            "whole_copy_bytes": rec.whole.length if rec.whole is not None else 0,  # part of own_bytes
        } for key, rec in items]
        out.append({
            "identity": hx, "name": info.name if info else None, "path": info.path if info else None,
            "model_type": info.get("model_type") if info else None, "model_present": common.model_present(info),
            "kv_dtype": _dtype(disk, items, info),
            "entries": entries,
        })
    _siblings(snap, out)
    out.sort(key=lambda g: (str(g["name"] or ""), g["identity"]))
    from ..side_records import usage

    records = {name: {"count": u.count, "bytes": u.bytes} for name, u in usage(disk.root).items()}
    return {"cache_dir": str(disk.root), "total_bytes": snap.meta_bytes,
            "n_entries": sum(len(g["entries"]) for g in out), "identities": out, "records": records}


def _siblings(snap: Any, groups: list[dict[str, Any]]) -> None:
    """Each group's ``others``: the other identities of its model directory that hold
    entries, what differs (older -> newer), and ``superseded_by`` (``gc`` removes it first)."""
    if not groups:  # no identity holds an entry: nothing to compare (nor its code to import)
        return
    from ..superseded import siblings, superseded, usage, what_differs

    used = usage(snap.entries.items())
    old = superseded(snap.identities, used)
    for g in groups:
        g["others"], g["superseded_by"] = [], old.get(g["identity"])
        for hx in siblings(snap.identities, g["identity"]):
            if hx in used:
                a, b = sorted((g["identity"], hx), key=lambda h: used[h].first_created)
                g["others"].append({"identity": hx, "differs": what_differs(snap.identities[a], snap.identities[b])})


def _dtype(disk, items: list[tuple[bytes, Any]], info: Any) -> str | None:
    """KV dtype of an identity: its KV quantisation, else the dtype of a key tensor in the
    header of one of its most recent entries' segments."""
    if info is not None and info.get("kv_bits"):
        return f"{info.get('kv_bits')}-bit"
    for _key, rec in items[:3]:
        seg = common.first_segment(disk, rec)
        got = common.kv_dtype(common.segment_header(disk, seg)) if seg is not None else None
        if got:
            return got
    return None


def run(args: argparse.Namespace) -> int:
    if args.shared is not None:  # a shared tier, not a cache directory
        from . import shared_tier  # the shared tier's code: only with --shared

        return shared_tier.run_ls(args)
    disk = common.open_disk(args, index_only=True)
    try:
        data = collect(disk)
    finally:
        disk.close()
    if args.json:
        common.print_json(data)
        return 0
    records = "".join(f"; {common.plural(r['count'], f'{name} record')}, {common.human_bytes(r['bytes'])}"
                      for name, r in data["records"].items() if r["count"])  # kvstore.side_records
    if not data["identities"]:
        print(f"no entries in {data['cache_dir']}{records}")
        return 0
    now = time.time()
    for i, g in enumerate(data["identities"]):
        if i:
            print()
        bits = ", ".join(str(b) for b in (g["model_type"], g["kv_dtype"]) if b)
        print(f"{common.identity_name(g['identity'], g)}{f'  ({bits})' if bits else ''}  identity {g['identity'][:12]}")
        if g["path"]:
            print(f"  model: {g['path']}{'' if g['model_present'] else '  (missing)'}")
        for o in g["others"]:
            print(f"  another identity of this model directory, {o['identity'][:12]}: {o['differs']} differs"
                  f"{'; this one is superseded (`kvstore gc` removes it first)' if g['superseded_by'] == o['identity'] else ''}")
        rows = [[e["id"], e["tokens"], common.human_bytes(e["bytes"]), e["cache_type"] or "-",
                 common.ago(e["last_used"], now), e["hits"], "yes" if e["pinned"] else ""]
                for e in g["entries"]]
        print(common.table(rows, ["ENTRY", "TOKENS", "SIZE", "TYPE", "LAST USED", "HITS", "PINNED"],
                           right=(1, 2, 5), indent="  "))
    n_id = len(data["identities"])
    print(f"\n{common.plural(data['n_entries'], 'entry', 'entries')}, "
          f"{common.plural(n_id, 'identity', 'identities')}, {common.human_bytes(data['total_bytes'])} "
          f"of blobs (shared chunks counted once){records}")
    return 0
