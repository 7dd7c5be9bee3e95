"""Mutation testing (mutmut) of kvstore's core modules, each against its own fast tests.

    python -m tools.gates.mutation                      # every module in MODULES
    python -m tools.gates.mutation floors callers       # some of them
    python -m tools.gates.mutation --max-children 2 --keep /tmp/mut floors

For each module: a scratch copy of the repo (``COPIED``) in a temporary directory, its
``pyproject.toml``'s ``[tool.mutmut]`` (the settings every run shares) extended with
``only_mutate`` = the module and the test selection = its tests (``MODULES``), then ``mutmut
run`` there. mutmut's ``mutants/`` directory is made in that copy and removed with it, so
the work tree never holds one, and runs of different modules cannot mix their results.

A mutant counts as killed when a test failed on it or it timed out (counted apart: a module
whose mutants all time out has tests that hang, not tests that kill); every other outcome
(survived, no test reached it, suspicious, ...) must be explained in ``SURVIVORS``
(``tools/gates/mutation_survivors.txt``: ``<mutant> <diff hash> <why>`` a line). The hash
is of the mutant's diff, so an explanation stops counting when the code under it changes
(mutmut numbers a function's mutants in order: an edit renumbers them). Prints per module
its mutants, killed, not killed and explained, then each unexplained mutant's diff; exits 1
if any is unexplained or a run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]
SURVIVORS = Path(__file__).with_name("mutation_survivors.txt")
COPIED = ("kvstore", "tests", "tools", "benchmarks", "pyproject.toml")
KILLED = {"killed", "timeout"}

# module -> its tests (files or node ids, relative to the repo root): the fast ones that
# exercise it in this process (mutmut maps a test to the functions it calls by running it;
# a server or child process that runs the code is invisible to it)
MODULES: dict[str, tuple[str, ...]] = {
    "kvstore/floors.py": ("tests/unit/test_floors.py",),
    "kvstore/callers.py": ("tests/unit/test_callers.py",),
    "kvstore/units.py": ("tests/unit/test_units.py",),
    "kvstore/serve/http.py": ("tests/unit/test_serve_http.py",),
    "kvstore/serve/response_store.py": ("tests/unit/test_serve_response_store.py",),
    "kvstore/serve/stable_prefix.py": ("tests/unit/test_serve_stable_prefix.py",),
    "kvstore/serve/learned_spans.py": ("tests/unit/test_learned_spans.py",),
    "kvstore/index/checks.py": ("tests/system/test_index_checks.py",),
    "kvstore/memory/snapshot.py": ("tests/system/test_memory_snapshot.py",),
}


# [tool.mutmut] settings of one module's run beside pyproject's. MLX does not survive a fork of a
# process that has used it (a forked test's first evaluation never returns: every mutant "timed
# out"), so a module whose tests run MLX is tested in workers forked from a server that has not.
SETTINGS: dict[str, dict[str, str]] = {
    "kvstore/memory/snapshot.py": {"process_isolation": "forkserver", "forkserver_warmup": "collect"},
    "kvstore/index/checks.py": {"process_isolation": "forkserver", "forkserver_warmup": "collect"},
}


@dataclass
class Result:
    module: str
    status: dict[str, str] = field(default_factory=dict)  # mutant -> mutmut's status
    diffs: dict[str, str] = field(default_factory=dict)  # the not-killed mutants' diffs
    seconds: float = 0.0
    error: str | None = None

    def not_killed(self) -> list[str]:
        return sorted(k for k, s in self.status.items() if s not in KILLED)


def diff_hash(diff: str) -> str:
    """A short hash of a mutant's change: its removed and added lines, nothing else."""
    lines = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:8]


def read_survivors(path: Path = SURVIVORS) -> dict[str, tuple[str, str]]:
    """mutant -> (diff hash, why): the explained survivors (``#`` lines are comments)."""
    out: dict[str, tuple[str, str]] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or not re.fullmatch(r"[0-9a-f]{8}", parts[1]):
            raise SystemExit(f"{path}:{n}: expected '<mutant> <8-hex diff hash> <why>', got {line!r}")
        out[parts[0]] = (parts[1], parts[2])
    return out


def _scratch(dest: Path, module: str, tests: tuple[str, ...]) -> None:
    """A copy of the repo in ``dest`` whose [tool.mutmut] mutates ``module`` against ``tests``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "mutants", ".pytest_cache")
    for name in COPIED:
        src = TOP / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=skip)
        else:
            shutil.copy2(src, dest / name)
    text = (dest / "pyproject.toml").read_text()
    if "[tool.mutmut]" not in text:
        raise SystemExit("pyproject.toml has no [tool.mutmut] section")
    extra = (f"only_mutate = {json.dumps([module])}\n"
             f"pytest_add_cli_args_test_selection = {json.dumps(list(tests))}\n"
             + "".join(f"{k} = {json.dumps(v)}\n" for k, v in SETTINGS.get(module, {}).items()))
    (dest / "pyproject.toml").write_text(text.replace("[tool.mutmut]\n", "[tool.mutmut]\n" + extra, 1))
    try:  # still TOML (tomllib: Python 3.11+)
        import tomllib
    except ImportError:
        return
    tomllib.loads((dest / "pyproject.toml").read_text())


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _diff(work: Path, mutant: str, module: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    with _cwd(work):
        try:
            return get_diff_for_mutant(mutant, path=module)
        except Exception as e:  # an index mutmut could not read back: still reported, unhashed
            return f"(no diff: {e})"


def run_module(module: str, *, max_children: int, keep: Path | None = None, log=print) -> Result:
    """mutmut over ``module`` (a key of ``MODULES``) in a scratch copy: every mutant's status."""
    res = Result(module)
    base = Path(tempfile.mkdtemp(prefix="kvstore-mutation-")) if keep is None else keep
    work = base / module.replace("/", "_").removesuffix(".py")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    start = time.monotonic()
    try:
        _scratch(work, module, MODULES[module])
        # no PYTHONPATH: mutmut puts mutants/ first on sys.path itself (a PYTHONPATH naming it
        # before it exists is cached by the import system as a directory with nothing in it)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}
        mutmut = Path(sys.executable).with_name("mutmut")
        cmd = [str(mutmut) if mutmut.exists() else "mutmut", "run", "--max-children", str(max_children)]
        with open(work / "mutmut.log", "wb") as out:
            p = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT)
        meta = work / "mutants" / (module + ".meta")
        if p.returncode != 0 or not meta.exists():
            tail = (work / "mutmut.log").read_bytes()[-3000:].decode(errors="replace")
            res.error = f"mutmut run exited {p.returncode}:\n{tail}"
            return res
        from mutmut.stats import status_by_exit_code

        codes = json.loads(meta.read_text())["exit_code_by_key"]
        res.status = {k: status_by_exit_code[v] for k, v in codes.items()}
        res.diffs = {k: _diff(work, k, module) for k in res.not_killed()}
    finally:
        res.seconds = time.monotonic() - start
        if keep is None:
            shutil.rmtree(base, ignore_errors=True)
    return res


def report(results: list[Result], explained: dict[str, tuple[str, str]], log=print) -> int:
    """Prints the table and each unexplained mutant; the number unexplained (failed runs count)."""
    bad = 0
    log(f"{'module':40} {'mutants':>7} {'killed':>6} {'(timeout)':>9} {'not killed':>10} {'explained':>9} {'score':>6} "
        f"{'time':>6}")
    unexplained: list[tuple[str, str, str]] = []
    for r in results:
        if r.error:
            log(f"{r.module:40} run failed: {r.error}")
            bad += 1
            continue
        ok = [k for k in r.not_killed() if k in explained and explained[k][0] == diff_hash(r.diffs[k])]
        for k in r.not_killed():
            if k not in ok:
                unexplained.append((k, r.status[k], r.diffs[k]))
        n, killed = len(r.status), len(r.status) - len(r.not_killed())
        score = f"{100 * killed / n:.1f}%" if n else "-"
        timeouts = sum(s == "timeout" for s in r.status.values())
        log(f"{r.module:40} {n:>7} {killed:>6} {timeouts:>9} {len(r.not_killed()):>10} {len(ok):>9} {score:>6} "
            f"{r.seconds:>5.0f}s")
    for k, status, diff in unexplained:
        log(f"\n{status}: {k} {diff_hash(diff)}\n{diff}")
    return bad + len(unexplained)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gates.mutation", description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help="short names (floors, http, memory/snapshot) or paths; default all")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument("--keep", type=Path, help="make the scratch copies under this directory and keep them")
    args = ap.parse_args(argv)
    chosen = []
    for name in args.modules or MODULES:
        hits = [m for m in MODULES if m == name or m.removeprefix("kvstore/").removesuffix(".py") in
                (name, f"adapters/{name}", f"serve/{name}")]
        if len(hits) != 1:
            ap.error(f"unknown module {name!r}: one of {', '.join(MODULES)}")
        chosen.append(hits[0])
    explained = read_survivors()
    results = [run_module(m, max_children=args.max_children, keep=args.keep) for m in chosen]
    bad = report(results, explained)
    print(f"\n{bad} unexplained" if bad else "\nevery mutant killed or explained")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
