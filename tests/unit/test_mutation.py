"""tools.gates.mutation's bookkeeping: which mutants count as explained, what the table says."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.gates import mutation

DIFF = """--- kvstore/floors.py
+++ kvstore/floors.py
@@ -1,2 +1,2 @@
-def f(n: int = 0) -> int:
+def f(n: int = 1) -> int:
     return n"""


def test_the_explained_survivors_file_reads_and_names_modules_the_gate_runs() -> None:
    explained = mutation.read_survivors()
    assert explained
    modules = {m.removesuffix(".py").replace("/", ".") for m in mutation.MODULES}
    for name, (digest, why) in explained.items():
        assert name.rsplit(".", 1)[0] in modules and len(digest) == 8 and why.strip(), name
    for tests in mutation.MODULES.values():
        assert all((mutation.TOP / t.split("::")[0]).is_file() for t in tests), tests


def test_a_malformed_line_is_refused_with_its_place(tmp_path: Path) -> None:
    bad = tmp_path / "survivors.txt"
    bad.write_text("# comment\n\nkvstore.floors.x_f__mutmut_1 nothash why\n")
    with pytest.raises(SystemExit, match="survivors.txt:3: expected"):
        mutation.read_survivors(bad)


def test_an_explanation_counts_only_for_the_diff_it_was_written_for() -> None:
    """A survivor explained under its current diff's hash passes; one whose code changed since
    (another hash), one never explained, and a failed run each count against the gate."""
    name = "kvstore.floors.x_f__mutmut_1"
    h = mutation.diff_hash(DIFF)
    assert h == mutation.diff_hash(DIFF.replace("@@ -1,2 +1,2 @@", "@@ -7,2 +7,2 @@"))  # only changed lines count
    assert h != mutation.diff_hash(DIFF.replace("n: int = 1", "n: int = 2"))

    def result() -> mutation.Result:
        return mutation.Result("kvstore/floors.py", {name: "survived", "kvstore.floors.x_f__mutmut_2": "killed",
                                                     "kvstore.floors.x_f__mutmut_3": "timeout"}, {name: DIFF}, 3.0)

    lines: list[str] = []
    assert mutation.report([result()], {name: (h, "equivalent")}, log=lines.append) == 0
    assert lines[1].split() == ["kvstore/floors.py", "3", "2", "1", "1", "1", "66.7%", "3s"]
    lines.clear()
    assert mutation.report([result()], {name: ("0" * 8, "written for other code")}, log=lines.append) == 1
    assert any(line.startswith(f"\nsurvived: {name} {h}") for line in lines) and any(DIFF in line for line in lines)
    assert mutation.report([result()], {}, log=lambda _: None) == 1
    no_test = mutation.Result("kvstore/floors.py", {name: "no tests"}, {name: DIFF})
    assert mutation.report([no_test], {}, log=lambda _: None) == 1  # untested is not killed
    failed = mutation.Result("kvstore/floors.py", error="mutmut run exited 1")
    assert mutation.report([failed], {}, log=lambda _: None) == 1
