"""The import graph of kvstore (and of its tools and benchmarks), and the rules it must keep.

    python -m tools.gates.layers            # print the graph (module -> what it imports), then problems
    python -m tools.gates.layers --check    # exit 1 if a rule is broken

Rules (issue 13: "layers that only look down"), for kvstore and, since issue 21, for the
``tools`` and ``benchmarks`` built on it (which sit above it):
- every import of one kvstore module by another points down the layer order below (or
  stays inside one package and makes no cycle); imports under ``if TYPE_CHECKING:`` are
  type hints only and count as well, except where a rank says otherwise;
- no import cycle, lazy imports inside functions included;
- no module uses another module's underscore names (``from x import _y``, ``x._y``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]
# The packages checked: kvstore itself, and the tools and benchmarks built on it (issue 21.7:
# they keep the same rules, no cycle and no private names across modules).
PACKAGES = ("kvstore", "tools", "benchmarks")

# Lower ranks are lower layers: bytes and names, then storage, then the store, then users.
RANKS: dict[str, int] = {
    "kvstore.keys": 0, "kvstore.records": 0, "kvstore.files": 0, "kvstore.bytes_written": 0,
    "kvstore.escape": 0, "kvstore.hoststate": 0, "kvstore.units": 0, "kvstore.floors": 0, "kvstore.layout": 0,
    "kvstore.side_records": 1,
    "kvstore.codec": 1, "kvstore.segments": 1, "kvstore.blas": 1, "kvstore.alloc": 1, "kvstore.pressure": 1,
    "kvstore.identity": 2, "kvstore.model_layout": 2, "kvstore.fit": 2, "kvstore.index": 2,
    "kvstore.disk": 3,
    "kvstore.budget": 4, "kvstore.write_policy": 4, "kvstore.memory": 4, "kvstore.writer": 4,
    "kvstore.cachedir": 4,
    "kvstore.shared": 5, "kvstore.counters": 0, "kvstore.disk_errors": 5, "kvstore.preload": 5,
    "kvstore.metrics": 5, "kvstore.options": 5,
    "kvstore.store": 6,
    "kvstore.maintenance": 7, "kvstore.generate": 7, "kvstore.adapters": 7,
    "kvstore.serve": 8,
    "kvstore.cli": 9,
    "tools": 10, "benchmarks": 10,
}
# Inside a package, the order its modules may import each other in (others: no cycle only).
INNER: dict[str, list[str]] = {
    "kvstore.index": ["errors", "pages", "trie", "txn", "checks", "core", "scan"],
    "kvstore.disk": ["tier", "plan", "pieces", "restore", "persist", "transfer"],
    "kvstore.memory": ["snapshot", "entries"],
    "kvstore.adapters": ["mlx_lm", "vllm_mlx", "exo"],
}


def modules(top: Path = TOP) -> dict[str, Path]:
    """Every module of ``PACKAGES`` under ``top``, by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((top / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(top).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def _targets(cur: str, path: Path, node: ast.AST, mods: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for one import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    pkg = cur.split(".") if path.name == "__init__.py" else cur.split(".")[:-1]
    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) if node.level \
        else (node.module or "")
    out: list[tuple[str, list[str]]] = []
    plain = []
    for a in node.names:
        if f"{base}.{a.name}" in mods:
            out.append((f"{base}.{a.name}", []))  # a submodule, not the package
        else:
            plain.append(a.name)
    if plain:
        out.append((base, plain))
    return out


def graph(top: Path = TOP) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> checked modules it imports, private-name problems) of the tree at ``top``."""
    mods = modules(top)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    problems = []
    for cur, path in mods.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target, names in _targets(cur, path, node, mods):
                if target not in mods or target == cur:
                    continue
                edges[cur].add(target)
                for n in names:
                    if n.startswith("_") and not n.startswith("__"):
                        problems.append(f"{cur} imports private {target}.{n}")
                if not names:
                    for a in node.names:
                        aliases[a.asname or a.name.split(".")[-1]] = target
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                problems.append(f"{cur} uses private {aliases[node.value.id]}.{node.attr}")
    return edges, problems


def rank(mod: str) -> tuple[int, int] | None:
    for prefix in sorted(RANKS, key=len, reverse=True):
        if mod == prefix or mod.startswith(prefix + "."):
            inner = INNER.get(prefix, [])
            leaf = mod[len(prefix) + 1 :].split(".")[0] if mod != prefix else ""
            return RANKS[prefix], (inner.index(leaf) if leaf in inner else len(inner) if leaf == "" else -1)
    return None


def check(edges: dict[str, set[str]]) -> list[str]:
    """Upward imports and cycles."""
    out = []
    for a, targets in edges.items():
        for b in targets:
            ra, rb = rank(a), rank(b)
            if a in PACKAGES or b in PACKAGES or ra is None or rb is None:
                continue
            if rb[0] > ra[0]:
                out.append(f"{a} (layer {ra[0]}) imports {b} (layer {rb[0]}): upward")
            elif rb[0] == ra[0] and ra[1] >= 0 and rb[1] >= 0 and rb[1] > ra[1] and a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]:
                out.append(f"{a} imports {b}: upward inside its package")
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if n in PACKAGES:
                continue
            if state.get(n) == 1:
                out.append("cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return out


DESIGN_DOC = Path("docs") / "design.md"


def doc_problems(top: Path = TOP) -> list[str]:
    """The module table of ``docs/design.md`` against the package: every module and
    subpackage of kvstore is named in its first column (``kvstore/x.py``, ``x.py`` after
    another name in the same cell, or ``kvstore/x/``), and every name there exists."""
    doc = top / DESIGN_DOC
    if not doc.exists():
        return [f"{DESIGN_DOC} is missing"]
    named: set[str] = set()
    for line in doc.read_text().splitlines():
        if line.startswith("| `"):
            cell = line.split("|")[1]
            named.update(w.strip("`").removeprefix("kvstore/").rstrip("/") for w in cell.replace(",", " ").split()
                         if w.startswith("`"))
    pkg = top / "kvstore"
    have = {p.stem for p in pkg.glob("*.py") if p.stem not in ("__init__", "__main__")}
    have |= {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    named = {n.removesuffix(".py") for n in named}
    return ([f"{DESIGN_DOC}: module table lacks kvstore/{m}" for m in sorted(have - named)]
            + [f"{DESIGN_DOC}: module table names kvstore/{m}, which does not exist" for m in sorted(named - have)])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    edges, private = graph()
    problems = check(edges) + private + doc_problems()
    if "--check" not in argv:
        for m in sorted(edges):
            if edges[m]:
                print(f"{m} -> {', '.join(sorted(edges[m]))}")
    for p in problems:
        print(f"problem: {p}")
    if not problems:
        print(f"ok: {len(edges)} modules, {sum(map(len, edges.values()))} imports, no cycle, none upward, "
              "no private names across modules")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
