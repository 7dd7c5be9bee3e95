"""``kvstore ls`` start-up, two checkouts side by side (issue 47, item 5).

    python -m benchmarks.ls_startup BASE_CHECKOUT THIS_CHECKOUT RUNS CACHE_DIR [--instructions]

Fresh processes, interleaved in every round: ``kvstore ls --cache-dir CACHE_DIR`` (an empty
store) with each checkout's kvstore, compiled every time (``PYTHONDONTWRITEBYTECODE=1``) and
with a bytecode cache (``PYTHONPYCACHEPREFIX``, written by a warm-up run), and ``python -c
pass``. Prints JSON: median seconds, each against ``python -c pass``, the load average, and
what each import of this checkout's ``kvstore ls`` costs in both bytecode states
(``python -X importtime``; a table of the compiled state on stderr). ``--instructions``
adds the instructions each command executes (valgrind's callgrind, one run each): unlike
wall time, that count does not move with the load of a shared machine.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _env(tree: str, cache_root: str, bytecode: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=tree)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(cache_root, os.path.basename(tree))
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def main(argv: list[str]) -> int:
    base, this, runs, cache_dir = argv[0], argv[1], int(argv[2]), argv[3]
    pycache = tempfile.mkdtemp(prefix="kvstore-ls-pyc-")
    try:
        return _run(base, this, runs, cache_dir, pycache, "--instructions" in argv[4:])
    finally:
        shutil.rmtree(pycache, ignore_errors=True)


def _run(base: str, this: str, runs: int, cache_dir: str, pycache: str, count: bool) -> int:
    ls = [sys.executable, "-m", "kvstore.cli", "ls", "--cache-dir", cache_dir]
    cmds: dict[str, tuple[list[str], dict[str, str], str | None]] = {}
    for label, tree in (("main", base), ("branch", this)):
        for bytecode in (False, True):
            cmds[label + ("_bytecode" if bytecode else "")] = (ls, _env(tree, pycache, bytecode), tree)
    cmds["python"] = ([sys.executable, "-c", "pass"], dict(os.environ), None)
    for cmd, env, cwd in cmds.values():  # warm-up: writes the bytecode caches
        subprocess.run(cmd, env=env, cwd=cwd, check=True, capture_output=True)
    times: dict[str, list[float]] = {label: [] for label in cmds}
    for _ in range(runs):
        for label, (cmd, env, cwd) in cmds.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, cwd=cwd, check=True, capture_output=True)
            times[label].append(time.perf_counter() - t0)
    med = {label: statistics.median(ts) for label, ts in times.items()}
    imports = {label: import_costs(ls, cmds[label][1], this, runs) for label in ("branch", "branch_bytecode")}
    out = {"median_s": med, "vs_python": {k: v / med["python"] for k, v in med.items()},
           "loadavg": os.getloadavg(), "runs": times, "imports": imports}
    if count:
        ins = {label: instructions(cmd, env, cwd) for label, (cmd, env, cwd) in cmds.items()}
        out["instructions"] = ins
        out["instructions_vs_python"] = {k: v / ins["python"] for k, v in ins.items()}
    print(json.dumps(out, indent=1))
    print(import_table(imports["branch"]), file=sys.stderr)
    return 0


def instructions(cmd: list[str], env: dict[str, str], cwd: str | None) -> int:
    """Instructions ``cmd`` executes (``valgrind --tool=callgrind``; its children not counted)."""
    p = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd], env=env,
                       cwd=cwd, check=True, capture_output=True, text=True)
    return next(int(line.split()[-1]) for line in p.stderr.splitlines() if "Collected :" in line)


def import_costs(cmd: list[str], env: dict[str, str], cwd: str, runs: int) -> list[dict[str, object]]:
    """What ``cmd``'s imports cost (``python -X importtime``, the least of ``runs`` runs per
    module: the load only adds): each module that takes 0.5 ms or more with what it imports,
    in import order, its own ms, its ms with what it imports, and its depth."""
    own: dict[str, list[int]] = {}
    total: dict[str, list[int]] = {}
    depth: dict[str, int] = {}
    for _ in range(runs):
        p = subprocess.run([cmd[0], "-X", "importtime", *cmd[1:]], env=env, cwd=cwd, check=True,
                           capture_output=True, text=True)
        for line in p.stderr.splitlines():
            if not line.startswith("import time:") or line.endswith("imported package"):
                continue
            a, b, name = line[len("import time:"):].split("|")
            if not a.strip().isdigit():
                continue
            depth.setdefault(name.strip(), (len(name) - len(name.lstrip()) - 1) // 2)
            own.setdefault(name.strip(), []).append(int(a))
            total.setdefault(name.strip(), []).append(int(b))
    return [{"module": m, "depth": d, "own_ms": min(own[m]) / 1000, "with_imports_ms": min(total[m]) / 1000}
            for m, d in depth.items() if min(total[m]) >= 500]


def import_table(rows: list[dict[str, object]]) -> str:
    """``import_costs`` as a markdown table (modules indented by depth)."""
    lines = ["| module | own ms | with its imports, ms |", "|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {'. ' * int(str(r['depth']))}{r['module']} | {r['own_ms']:.1f} | {r['with_imports_ms']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
