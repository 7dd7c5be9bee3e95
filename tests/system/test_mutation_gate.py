"""tools.gates.mutation, for real: mutmut mutates two core modules in a scratch copy of the repo
and runs their unit tests against every mutant; each is killed or explained in
tools/gates/mutation_survivors.txt (the CI share of issue 52's mutation testing: the whole
gate, `python -m tools.gates.mutation`, takes ~30 min on 2 cores)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.children import child_env
from tools.gates.mutation import TOP


def test_floors_and_callers_leave_no_unexplained_mutant() -> None:
    p = subprocess.run([sys.executable, "-m", "tools.gates.mutation", "--max-children", "2", "floors", "callers"],
                       cwd=TOP, env=child_env(), capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in p.stdout.splitlines() if line.startswith("kvstore/")}
    assert set(rows) == {"kvstore/floors.py", "kvstore/callers.py"}, p.stdout
    for row in rows.values():  # module, mutants, killed, (timeout), not killed, explained
        assert int(row[1]) > 20 and int(row[2]) + int(row[5]) == int(row[1]) and row[4] == row[5], row
    assert "every mutant killed or explained" in p.stdout
    assert not (TOP / "mutants").exists()  # the work tree never gets mutmut's directory
