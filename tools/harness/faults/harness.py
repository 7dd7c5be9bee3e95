"""Running the fault kinds: the run and its table (the kinds' context: ``context.Ctx``)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .common import KINDS, ROOT, SIZES, exc_info
from .context import Ctx
from .kinds import RUNNERS


TOTAL_FIELDS = ("trials", "wrong_restores", "escaped_exceptions", "crashes", "entries_lost", "unexplained_misses",
                "verify_unclean", "failed_cases")


def environment() -> dict:
    """Python, platform, CPU count, root, versions of mlx, mlx_lm and lmdb, and the kvstore commit."""
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "root": os.geteuid() == 0}
    for mod in ("mlx", "mlx_lm", "lmdb"):
        try:
            from importlib.metadata import version
            env[mod] = version(mod)
        except Exception:
            pass
    try:
        env["kvstore_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kvstore"],
                               capture_output=True, text=True).stdout.strip()
        env["kvstore_dirty"] = bool(dirty)
    except Exception:
        pass
    return env


def run(size_name: str = "full", *, seed: int = 0, only: tuple[str, ...] = KINDS, work: Path | None = None,
        verbose: bool = False, keep: bool = False, sizes: dict | None = None) -> dict:
    size = dict(SIZES[size_name], **(sizes or {}))
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="kvfaults-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(work, seed, size, verbose)
    t0 = time.time()
    out: dict[str, Any] = {"command": "python -m tools.harness.faults" + ("" if size_name == "full" else f" --{size_name}"),
                           "size": size_name, "seed": seed, "environment": environment(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kinds": {}}
    try:
        for kind in only:
            ctx.say(f"== {kind}")
            try:
                out["kinds"][kind] = RUNNERS[kind](ctx)
            except Exception as e:
                out["kinds"][kind] = {"trials": 0, "harness_error": exc_info(kind, e), "failures": []}
                ctx.say(f"  harness error in {kind}: {e!r}")
                traceback.print_exc()
    finally:
        ctx.close()
        if own and not keep:
            subprocess.run(["chmod", "-R", "u+rwX", str(work)], capture_output=True)
            shutil.rmtree(work, ignore_errors=True)
    out["total"] = {f: sum(int(k.get(f, 0) or 0) for k in out["kinds"].values()) for f in TOTAL_FIELDS}
    out["total"]["harness_errors"] = sum(1 for k in out["kinds"].values() if k.get("harness_error"))
    out["seconds"] = round(time.time() - t0, 1)
    out["total"]["seconds"] = out["seconds"]
    return out


def table(out: dict) -> str:
    """The figures of a run, one row per kind and a total, as aligned text."""
    cols = ("trials", "wrong_restores", "escaped_exceptions", "crashes", "entries_lost", "unexplained_misses",
            "verify_unclean", "failed_cases", "seconds")
    short = ("trials", "wrong", "escaped", "crashes", "lost", "unexpl.", "unclean", "failed", "secs")
    rows = [("kind",) + short]
    for kind, k in list(out["kinds"].items()) + [("total", out["total"])]:
        rows.append((kind,) + tuple(str(k.get(c, "")) for c in cols))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths))) for r in rows)
