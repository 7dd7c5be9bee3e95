"""``kvstore verify [--fix]``: fsck for a cache directory."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from . import common


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    from ..maintenance import ORPHAN_BLOB_SECONDS

    p = subparsers.add_parser(
        "verify", help="check every record against its blobs and every blob against the index",
        description="Check that every index record has its blob files with the right size and "
                    "xxh3-128 checksum, that every blob file has a record, and that chunk "
                    "refcounts, trie edges and byte counters agree. Each problem is reported "
                    "with a kind: corrupt_index, bad_record, missing_chunk, missing_pack, missing_blob, "
                    "truncated, bad_checksum, orphan_chunk, orphan_pack, dangling_bound, missing_bound, "
                    "orphan_tokens, bytes_drift, orphan_blob, foreign_file (a file kvstore did not "
                    "write: reported, never touched). Safe while servers use the directory. Exit 0: "
                    "clean (or, with --fix, every problem repaired); 1: problems remain.")
    p.add_argument("--fix", action="store_true",
                   help="repair: remove broken entries (refcounts kept right), orphan pack files, "
                        "unused chunks and dangling records; fix refcount drift")
    p.add_argument("--no-checksums", action="store_true",
                   help="check blob sizes only (fast: does not read the blobs)")
    p.add_argument("--blob-age", type=common.seconds, default=ORPHAN_BLOB_SECONDS, metavar="SECONDS",
                   help=f"pack files no record names older than this are orphans (default "
                        f"{ORPHAN_BLOB_SECONDS}); a live writer's uncommitted pack is never removed")
    common.add_cache_dir(p)
    common.add_json(p)
    return p


def describe(p) -> str:
    what = {"entry": "entry", "chunk": "chunk", "bound": "edge", "tokens": "tokens",
            "meta": "index", "file": "file", "pack": "pack"}.get(p.record, p.record)
    where = p.path if p.record == "file" else (common.short_id(p.key) if p.key else "")
    if p.record != "file" and p.path:
        where += f" ({p.path})"
    return f"{p.kind:<15} {what:<6} {where}: {p.detail}" + (" [fixed]" if p.fixed else "")


def run(args: argparse.Namespace) -> int:
    from .. import maintenance

    disk = common.open_disk(args, write=args.fix)
    try:
        problems = maintenance.verify(disk, fix=args.fix, checksums=not args.no_checksums, blob_age=args.blob_age)
        n_entries, n_chunks = disk.index.counts()["entries"], disk.index.counts()["chunks"]
    finally:
        disk.close()
    left = [p for p in problems if not (args.fix and p.fixed) and p.kind not in maintenance.NOT_OURS]
    if args.json:
        common.print_json({"cache_dir": str(disk.root), "fix": args.fix, "ok": not left,
                           "counts": dict(Counter(p.kind for p in problems)),
                           "problems": [p.to_dict() for p in problems],
                           "entries": n_entries, "chunks": n_chunks})
        return 1 if left else 0
    P = common.plural
    foreign = [p for p in problems if p.kind in maintenance.NOT_OURS]
    if not left and not args.fix:
        print(f"ok: {P(n_entries, 'entry', 'entries')} and {P(n_chunks, 'chunk')} verified in {disk.root}")
    for p in problems:
        print(describe(p))
    if foreign:
        print(f"note: {P(len(foreign), 'file')} kvstore did not write, left alone (remove by hand if unwanted)")
    if not args.fix:
        if left:
            counts = ", ".join(f"{n} {k}" for k, n in Counter(p.kind for p in left).items())
            print(f"{P(len(left), 'problem')} found ({counts}): {common.run_hint('verify --fix', disk.root)} to repair")
            return 1
        return 0
    ours = [p for p in problems if p.kind not in maintenance.NOT_OURS]
    counts = ", ".join(f"{n} {k}" for k, n in Counter(p.kind for p in ours).items()) or "none"
    print(f"{P(len(ours), 'problem')} found ({counts}), {len(ours) - len(left)} fixed; "
          f"{P(n_entries, 'entry', 'entries')} and {P(n_chunks, 'chunk')} remain")
    if left:
        print(f"{len(left)} could not be fixed now (a writer may be using them): {common.run_hint('verify --fix', disk.root)} again")
        return 1
    return 0
