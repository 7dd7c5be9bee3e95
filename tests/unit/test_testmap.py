"""tools.gates.testmap: docs/design.md's module -> tests table is today's, it follows a test
file or a module that moves, and it points a module no test imports to the tests that reach
it (the nearest, by run-time imports, packages, modules and commands run by name)."""

from __future__ import annotations

from pathlib import Path

from tools.gates import testmap


def tree(top: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(text)


def rows(top: Path) -> dict[str, str]:
    """module -> its row of the table at ``top``."""
    return {line.split(" | ")[0].removeprefix("| "): line for line in testmap.table(top).splitlines()
            if line.startswith("| ") and not line.startswith(("| kvstore module", "| ---"))}


def test_the_design_docs_table_is_todays() -> None:
    assert testmap.documented() == testmap.table(), "run `python -m tools.gates.testmap --write`"


def test_every_module_has_a_pointer_or_is_named_as_having_none() -> None:
    from tools.gates.layers import modules

    table = testmap.table()
    unreached = table.split("No test reaches these: ")[1].rstrip(".\n").split(", ") if "No test reaches" in table else []
    named = set(rows(testmap.TOP)) | set(unreached)
    assert named == {m.removeprefix("kvstore.") if m != "kvstore" else m for m in modules() if m.split(".")[0] == "kvstore"}
    assert "writes" in rows(testmap.TOP) and "memory" in rows(testmap.TOP) and "disk.plan" in rows(testmap.TOP)


def test_the_table_follows_a_moved_test_file(tmp_path: Path) -> None:
    """Imports are read wherever they are (a lazy one inside a test too); a re-exported name
    counts for the module that defines it; a module no test reaches is named below the table."""
    tree(tmp_path, {
        "kvstore/__init__.py": '_EXPORTS = {"Thing": "a"}\n',
        "kvstore/a.py": "", "kvstore/b.py": "", "kvstore/lonely.py": "",
        "kvstore/sub/__init__.py": "from .c import C\n", "kvstore/sub/c.py": "",
        "tests/unit/test_a.py": "from kvstore import Thing\n",
        "tests/system/test_b.py": "import kvstore.b\n\n\ndef test_c():\n    from kvstore.sub import C\n",
        "docs/design.md": f"# Design\n\n{testmap.BEGIN}\n{testmap.END}\n\n## After\n",
    })
    assert testmap.documented(tmp_path) != testmap.table(tmp_path)
    testmap.write(tmp_path)
    assert testmap.documented(tmp_path) == testmap.table(tmp_path)
    got = rows(tmp_path)
    assert [got["a"], got["b"], got["sub.c"]] == ["| a | test_a | - |", "| b | - | test_b |", "| sub.c | - | test_b |"]
    assert testmap.table(tmp_path).endswith("No test reaches these: lonely.\n")
    doc = (tmp_path / "docs/design.md").read_text()
    assert doc.startswith("# Design\n\n") and doc.endswith(f"{testmap.END}\n\n## After\n")
    (tmp_path / "tests/system/test_a.py").write_bytes((tmp_path / "tests/unit/test_a.py").read_bytes())
    (tmp_path / "tests/unit/test_a.py").unlink()
    assert testmap.documented(tmp_path) != testmap.table(tmp_path)
    assert "| a | - | test_a |" in testmap.table(tmp_path)


def test_a_module_no_test_imports_points_to_the_nearest_tests_that_reach_it(tmp_path: Path) -> None:
    """Through an import that runs (a lazy one too; one under ``if TYPE_CHECKING:`` never
    runs), a package's ``__init__``, tests/support, a module run with ``-m`` or
    ``run_module``, and a command word handed to the dispatcher; the nearest tests only."""
    tree(tmp_path, {
        "kvstore/__init__.py": "",
        "kvstore/low.py": "", "kvstore/hinted.py": "",
        "kvstore/mid.py": "from typing import TYPE_CHECKING\nfrom . import low\nif TYPE_CHECKING:\n    from . import hinted\n",
        "kvstore/top.py": "def f():\n    from .mid import thing\n",
        "kvstore/pkg/__init__.py": "", "kvstore/pkg/leaf.py": "",
        "kvstore/tool.py": "", "kvstore/cli/__init__.py": "", "kvstore/cli/__main__.py": "from .main import main\n",
        "kvstore/cli/main.py": 'COMMANDS: dict = {"ls": ("ls", "list"), "gc": ("gc", "collect")}\n',
        "kvstore/cli/ls.py": "", "kvstore/cli/gc.py": "",
        "tests/support/__init__.py": "", "tests/support/helpers.py": "from kvstore.pkg import leaf\n",
        "tests/support/programs/__init__.py": "", "tests/support/programs/job.py": "import kvstore.tool\n",
        "tests/unit/test_top.py": "import kvstore.top\n",
        "tests/unit/test_mid.py": "from kvstore import mid\n",
        "tests/system/test_far.py": "from kvstore import top\n",
        "tests/system/test_helped.py": "from tests.support import helpers\n",
        "tests/system/test_job.py": 'def test_job(run_module):\n    run_module("tests.support.programs.job")\n',
        "tests/system/test_cli.py": ('import sys\n\ndef cli(*a):\n    return [sys.executable, "-m", "kvstore.cli", *a]\n\n'
                                    'def test_ls():\n    cli("ls")\n    {}.get("gc")\n'),
    })
    got = rows(tmp_path)
    assert got["low"] == "| low | *via mid*: its row | - |"  # test_top and test_far are further away
    assert got["pkg"] == "| pkg | - | *via tests.support.helpers*: test_helped |"  # leaf's import runs its package
    assert got["pkg.leaf"] == "| pkg.leaf | - | *via tests.support.helpers*: test_helped |"
    assert got["tool"] == "| tool | - | *via tests.support.programs.job*: test_job |"
    assert got["cli.__main__"] == "| cli.__main__ | - | *run by name*: test_cli |"
    assert got["cli.ls"] == "| cli.ls | - | *run by name*: test_cli |"
    table = testmap.table(tmp_path)
    assert "No test reaches these: " in table
    unreached = table.split("No test reaches these: ")[1].rstrip(".\n").split(", ")
    assert "hinted" in unreached and "cli.gc" in unreached and "low" not in unreached
