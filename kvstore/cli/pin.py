"""``kvstore pin ENTRY`` / ``kvstore unpin ENTRY``."""

from __future__ import annotations

import argparse
from typing import Any

from . import common


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    for name, what in (("pin", "exempt an entry from age eviction, and evict it last by size (gc --max-age never "
                               "removes a pinned entry; gc --max-bytes and --max-disk-bytes remove pinned entries "
                               "only when nothing unpinned is left to remove)"),
                       ("unpin", "make a pinned entry evictable again")):
        p = subparsers.add_parser(name, help=what.split(" (")[0], description=what[0].upper() + what[1:] + ".")
        p.add_argument("entry", metavar="ENTRY", help="entry id or any unique hex prefix of it (see `kvstore ls`)")
        common.add_cache_dir(p)
    return p


def run(args: argparse.Namespace) -> int:
    from ..records import RecordError

    flag = args.command == "pin"
    disk = common.open_disk(args, write=True)

    def set_pin(t) -> Any:
        try:
            cur = t.entry(key)
        except RecordError:
            return None
        if cur is not None:
            t.set_entry(key, cur.pinned_as(flag))
        return cur

    try:
        key, rec = common.resolve_entry(disk, args.entry)
        new = disk.index.transact(set_pin)
        ident = disk.index.identities().get(rec.identity.hex())
    finally:
        disk.close()
    if new is None:
        raise common.CLIError(f"entry {common.short_id(key)} was removed by another process meanwhile")
    state = ("already " if rec.pinned == flag else "") + ("pinned" if flag else "unpinned")
    print(f"{state} {common.short_id(key)}  ({common.identity_name(rec.identity.hex(), ident)}, {rec.n} tokens)")
    return 0
