"""The package's shape (issue 13): imports only point down, no cycle, no module uses
another's private names (``tools/gates/layers.py``), and no function runs past 60 lines outside
the CLI's argument tables."""

from __future__ import annotations

import ast
from pathlib import Path

from tools.gates import layers

PACKAGE = Path(layers.__file__).resolve().parent.parent / "kvstore"


def test_imports_point_down_without_cycles_or_private_names():
    edges, private = layers.graph()
    assert edges["kvstore.store"] and "kvstore.disk" in edges["kvstore.store"]  # the graph is read
    assert "tools.harness.faults.worker" in edges["tools.harness.faults.kinds.crash"]  # tools are read too
    assert "benchmarks.common" in edges["benchmarks.ttft"]  # and benchmarks
    assert layers.check(edges) + private == []


def test_the_checker_sees_an_upward_import_a_cycle_and_a_private_name():
    edges, _ = layers.graph()
    edges = {k: set(v) for k, v in edges.items()}
    edges["kvstore.records"].add("kvstore.store")
    problems = layers.check(edges)
    assert any("upward" in p and p.startswith("kvstore.records") for p in problems)
    assert any(p.startswith("cycle:") for p in problems)


def test_tools_and_benchmarks_keep_the_rules(tmp_path):
    """A private name used across two modules of ``tools`` (either spelling), a cycle in
    ``benchmarks`` and a ``tools`` module reaching into kvstore's private names are found."""
    (tmp_path / "kvstore").mkdir()
    (tmp_path / "kvstore" / "__init__.py").write_text("")
    (tmp_path / "kvstore" / "core.py").write_text("_LIMIT = 1\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "a.py").write_text("_x = 1\n")
    (tmp_path / "tools" / "b.py").write_text("from .a import _x\nfrom . import a\nprint(a._x)\n")
    (tmp_path / "tools" / "c.py").write_text("import kvstore.core as k\nk._LIMIT = 2\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "p.py").write_text("from . import q\n")
    (tmp_path / "benchmarks" / "q.py").write_text("def f():\n    from . import p\n")
    edges, private = layers.graph(tmp_path)
    assert sorted(private) == ["tools.b imports private tools.a._x", "tools.b uses private tools.a._x",
                               "tools.c uses private kvstore.core._LIMIT"]
    assert layers.check(edges) == ["cycle: benchmarks.p -> benchmarks.q -> benchmarks.p"]


def test_no_function_over_60_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "setup_arg_parser":
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_the_design_docs_module_table_names_every_module(tmp_path):
    """docs/design.md's module table is checked against the package: today's is complete,
    and a module missing from it (or a row naming a module that is gone) is reported."""
    assert layers.doc_problems() == []
    (tmp_path / "kvstore" / "sub").mkdir(parents=True)
    for f in ("kvstore/__init__.py", "kvstore/a.py", "kvstore/b.py", "kvstore/sub/__init__.py"):
        (tmp_path / f).write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("| module | idea |\n| --- | --- |\n"
                                                 "| `kvstore/a.py`, `gone.py` | ... |\n| `kvstore/sub/` | ... |\n")
    assert layers.doc_problems(tmp_path) == ["docs/design.md: module table lacks kvstore/b",
                                             "docs/design.md: module table names kvstore/gone, which does not exist"]
