"""Fault harness: a crash, a damaged file, a full disk or a bad call costs kvstore at most a miss.

Usage::

    python -m tools.harness.faults                    # full size (the figures in tools/harness/faults/results/)
    python -m tools.harness.faults --quick            # a small run (a few minutes)
    python -m tools.harness.faults --json FILE        # also write the figures as JSON
    python -m tools.harness.faults --only crash,bad_input --seed 3 -v
    python -m tools.harness.faults --worker ROLE      # (internal) one worker process, see serve.py

What each fault kind does and what is checked: see ``tools/harness/faults/__init__.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import KINDS, SIZES
from .harness import run, table
from .serve import worker_main


def main(argv: list[str] | None = None) -> int:
    """The command line (``--help``); exits 1 if any wrong restore, escaped exception, crash or lost entry, or a harness error."""
    ap = argparse.ArgumentParser(prog="python -m tools.harness.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (minutes)")
    ap.add_argument("--ci", action="store_true", help="the CI subset (what tests/system/test_faults.py runs)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help=f"comma-separated fault kinds ({','.join(KINDS)})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=N",
                    help=f"override a size (keys: {', '.join(SIZES['full'])})")
    ap.add_argument("--workdir", type=Path, help="work directory (default: a temp dir, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    size_name = "ci" if args.ci else "quick" if args.quick else "full"
    only = tuple(k.strip() for k in args.only.split(",")) if args.only else KINDS
    for k in only:
        if k not in KINDS:
            ap.error(f"unknown fault kind {k!r}; known: {', '.join(KINDS)}")
    sizes = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        sizes[k] = int(v)
    out = run(size_name, seed=args.seed, only=only, work=args.workdir, verbose=args.verbose, keep=args.keep,
              sizes=sizes)
    print()
    print(table(out))
    print(f"\n{out['seconds']:.0f}s")
    for kind, k in out["kinds"].items():
        for f in k.get("failures", [])[:8]:
            print(f"  [{kind}] {f['what']}: " + json.dumps({x: y for x, y in f.items() if x != "what"}, default=str)[:400])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    bad = sum(out["total"][f] for f in ("wrong_restores", "escaped_exceptions", "crashes", "entries_lost"))
    return 1 if bad or out["total"]["harness_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
