"""tests/slow.txt names tests that exist: a line naming a test by an old path (a file moved to
tests/system, a test renamed) would silently leave that test in the fast tier, since
tests/conftest.py marks a test slow by its exact id."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_id_in_slow_txt_is_a_test_function_of_its_file() -> None:
    stale = []
    functions: dict[str, set[str]] = {}
    for line in (TESTS / "slow.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        path, _, name = line.strip().partition("::")
        file = TESTS.parent / path
        if path not in functions:
            tree = ast.parse(file.read_text()) if file.is_file() else ast.Module(body=[], type_ignores=[])
            functions[path] = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if name.split("[")[0] not in functions[path]:
            stale.append(line)
    assert stale == [], "tests/slow.txt names tests that are not there (a moved file? a renamed test?)"
