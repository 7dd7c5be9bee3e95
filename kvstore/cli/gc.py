"""``kvstore gc``: budgets, dropped models, orphan pack files and broken records."""

from __future__ import annotations

import argparse
import time
from typing import Any

from . import common


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ..maintenance import ORPHAN_BLOB_SECONDS

    p = subparsers.add_parser(
        "gc", help="enforce size and age budgets, drop models, remove orphans and temp files",
        description="Remove entries, least recently used first: of the identities named with "
                    "--identity or whose model directory is gone (--missing-models; pinned "
                    "entries too), unused for longer than --max-age (never pinned ones), then "
                    "until the blobs fit --max-bytes: first those of superseded identities (another "
                    "identity of the same model directory, e.g. after an mlx-lm upgrade, stored since "
                    "their last use; `kvstore ls` shows them), then the rest (never pinned ones unless "
                    "--include-pinned, and then only when nothing else is left). Orphan pack files and broken records are always "
                    "removed (as `kvstore verify --fix --no-checksums` does). Safe while servers "
                    "use the directory. --dry-run lists what would go and changes nothing.")
    p.add_argument("--max-bytes", type=common.parse_size, metavar="SIZE",
                   help="keep at most this many blob bytes, e.g. 500M, 10G (powers of 1024; a bare number "
                        "under 1 MiB is refused as a likely typo: write 500B for bytes); kvstore serve's "
                        "--stable-prefix records count in it: they are first trimmed, oldest first, to a quarter")
    p.add_argument("--include-pinned", action="store_true",
                   help="let --max-bytes remove pinned entries too (last, when nothing else is left); "
                        "without it pinned entries are kept even if the budget is then not met")
    p.add_argument("--max-age", type=common.parse_duration, metavar="AGE",
                   help="remove unpinned entries not used for this long, e.g. 7d, 12h, 30m")
    p.add_argument("--identity", action="append", default=[], metavar="HEXPREFIX",
                   help="remove every entry of this identity (see `kvstore ls`); repeatable")
    p.add_argument("--missing-models", action="store_true",
                   help="remove entries of identities whose model directory no longer exists")
    p.add_argument("--old-formats", action="store_true",
                   help="also remove the stores of other formats set aside in the cache directory "
                        "(format-N-*/: kept when a kvstore of another format first opened it)")
    p.add_argument("--keep-orphans", action="store_true",
                   help="do not look for orphan blobs, temp files and broken records")
    p.add_argument("--dry-run", "-n", action="store_true",
                   help="list what would be removed and the bytes it would free; change nothing")
    p.add_argument("--blob-age", type=common.seconds, default=ORPHAN_BLOB_SECONDS, metavar="SECONDS",
                   help=f"pack files no record names older than this are orphans (default {ORPHAN_BLOB_SECONDS})")
    common.add_cache_dir(p)
    common.add_json(p)
    common.add_shared(p)
    return p


def run(args: argparse.Namespace) -> int:
    if args.shared is not None:  # a shared tier, not a cache directory
        from . import shared_tier  # the shared tier's code: only with --shared

        return shared_tier.run_gc(args)
    from .. import maintenance
    from .verify import describe

    disk = common.open_disk(args, write=not args.dry_run)  # a dry run opens the index read-only
    try:
        idents = disk.index.identities()
        chosen = [common.resolve_identity(idents, p, disk.root) for p in args.identity]
        res = maintenance.gc(disk, max_bytes=args.max_bytes, max_age=args.max_age, identities=chosen,
                   missing_models=args.missing_models, orphans=not args.keep_orphans,
                   dry_run=args.dry_run, blob_age=args.blob_age,
                   pinned=args.include_pinned)
    finally:
        disk.close()
    old = _old_formats(disk.root, args) if args.old_formats else []
    unfixed = [p for p in res.problems if not p.fixed and p.kind not in maintenance.NOT_OURS] \
        if not args.dry_run else []
    if args.json:
        out = res.to_dict()
        out.update(cache_dir=str(disk.root), blob_bytes_left=res.bytes_left)
        if args.dry_run:
            out["blob_bytes_left_exact"] = res.exact
        if args.old_formats:
            out["old_formats"] = [{"path": str(path), "bytes": n} for path, n in old]
        common.print_json(out)
        return 1 if unfixed else 0
    verb = "would remove" if args.dry_run else "removed"
    now = time.time()
    for r in res.removed:
        why = {"max_age": f"last used {common.ago(r['last_used'], now)}", "max_bytes": "over --max-bytes",
               "identity": "--identity", "missing_model": "model directory is gone",
               "superseded": "superseded: a newer identity of its model directory is in use",
               "whole_copy": "over --max-bytes; the entry stays"}.get(r["reason"], r["reason"])
        what = f"the whole copy of {common.short_id(r['key'])}" if r["reason"] == "whole_copy" else common.short_id(r["key"])
        print(f"{verb} {what}  {r['model'] or common.short_id(r['identity'] or '')}  "
              f"{r['tokens']} tokens  frees {common.human_bytes(r['bytes'])}  ({why}"
              f"{', pinned' if r['pinned'] else ''})")
    for d in sorted({r["directory"] for r in res.records_removed}):
        mine = [r for r in res.records_removed if r["directory"] == d]
        print(f"{verb} {common.plural(len(mine), f'{d} record')}  frees "
              f"{common.human_bytes(sum(r['bytes'] for r in mine))}  (over --max-bytes, oldest first)")
    for p in res.problems:
        print(("would fix " if args.dry_run else "") + describe(p))
    for path, n in old:
        print(f"{verb} the store set aside as {path.name}  frees {common.human_bytes(n)}")
    P = common.plural
    files = sum(1 for p in res.problems if p.record == "file")
    copies = sum(r["reason"] == "whole_copy" for r in res.removed)
    summary = (f"{'would free' if args.dry_run else 'freed'} {common.human_bytes(res.freed)}: "
               f"{P(sum(r['reason'] != 'whole_copy' for r in res.removed), 'entry', 'entries')}, "
               + (f"{P(copies, 'whole copy', 'whole copies')}, " if copies else "")
               + f"{P(len(res.records_removed), 'record') + ', ' if res.records_removed else ''}{P(files, 'stray file')}, "
               f"{P(len(res.problems) - files, 'broken record')}")
    remains = (f"{'' if res.exact else 'at most '}{common.human_bytes(res.bytes_left)} in "
               f"{P(res.entries_left, 'entry', 'entries')}"
               + (f" and {common.human_bytes(res.record_bytes_left)} of records" if res.record_bytes_left else ""))
    if args.dry_run:
        print(f"{summary}; would leave {remains} (dry run: nothing changed)")
    else:
        print(f"{summary}; {remains} left")
    if unfixed:
        print(f"{len(unfixed)} problem(s) could not be fixed now: {common.run_hint('verify --fix', disk.root)}")
        return 1
    return 0


def _old_formats(root: Any, args: argparse.Namespace) -> list:
    """Remove (or, with --dry-run, list) the stores of other formats set aside under ``root``."""
    from ..index.formats import reclaim

    return reclaim(root, dry_run=args.dry_run)
