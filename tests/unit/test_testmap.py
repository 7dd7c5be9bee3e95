"""tools.gates.testmap: docs/design.md's module -> tests table is today's, and it follows a test
file or a module that moves."""

from __future__ import annotations

from pathlib import Path

from tools.gates import testmap


def test_the_design_docs_table_is_todays() -> None:
    assert testmap.documented() == testmap.table(), "run `python -m tools.gates.testmap --write`"


def test_the_table_follows_a_moved_test_file(tmp_path: Path) -> None:
    """Imports are read wherever they are (a lazy one inside a test too); a re-exported name
    counts for the module that defines it; a module no test imports is named below the table."""
    files = {
        "kvstore/__init__.py": '_EXPORTS = {"Thing": "a"}\n',
        "kvstore/a.py": "", "kvstore/b.py": "", "kvstore/lonely.py": "",
        "kvstore/sub/__init__.py": "from .c import C\n", "kvstore/sub/c.py": "",
        "tests/unit/test_a.py": "from kvstore import Thing\n",
        "tests/system/test_b.py": "import kvstore.b\n\n\ndef test_c():\n    from kvstore.sub import C\n",
        "docs/design.md": f"# Design\n\n{testmap.BEGIN}\n{testmap.END}\n\n## After\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert testmap.documented(tmp_path) != testmap.table(tmp_path)
    testmap.write(tmp_path)
    assert testmap.documented(tmp_path) == testmap.table(tmp_path)
    assert testmap.table(tmp_path).splitlines()[2:5] == ["| a | test_a | - |", "| b | - | test_b |",
                                                         "| sub.c | - | test_b |"]
    assert "No test file imports these itself" in testmap.table(tmp_path) and "lonely, sub." in testmap.table(tmp_path)
    doc = (tmp_path / "docs/design.md").read_text()
    assert doc.startswith("# Design\n\n") and doc.endswith(f"{testmap.END}\n\n## After\n")
    (tmp_path / "tests/system/test_a.py").write_bytes((tmp_path / "tests/unit/test_a.py").read_bytes())
    (tmp_path / "tests/unit/test_a.py").unlink()
    assert testmap.documented(tmp_path) != testmap.table(tmp_path)
    assert "| a | - | test_a |" in testmap.table(tmp_path)
