"""Where kvstore states the store's options (issue 53: "one option list, copied").

    python -m tools.option_lists                     # per option: files, places, defaults given
    python -m tools.option_lists kvstore/adapters    # only in these files / folders

A place is a function parameter, a call's keyword, a dataclass field or a string constant
(a dict key, ``opts.get("name")``, a flag table's entry) named like one of ``StoreOptions``'
fields, in ``kvstore/`` (docstrings and comments are not places). "defaults": places that give
the option a value when the caller did not: a parameter's or field's default, and
``.get(name, default)``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import fields
from pathlib import Path

TOP = Path(__file__).resolve().parents[1]


def places(tree: ast.AST, names: frozenset[str]) -> list[tuple[str, bool]]:
    """(option name, gives a default) for every place in ``tree`` that states an option."""
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            positional = a.posonlyargs + a.args
            with_default = {p.arg for p in positional[len(positional) - len(a.defaults):]}
            with_default |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
            out += [(p.arg, p.arg in with_default) for p in positional + a.kwonlyargs if p.arg in names]
        elif isinstance(node, ast.keyword) and node.arg in names:
            out.append((node.arg, False))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names:
            out.append((node.target.id, node.value is not None))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in names:
            out.append((str(node.args[0].value), True))
            node.args[0].value = None  # counted here, not again as a string constant
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            out.append((node.value, False))
    return out


def count(top: Path = TOP, only: tuple[str, ...] = ()) -> dict[str, tuple[set[str], int, int]]:
    """Per option: (files stating it, places, defaults given), in the files under ``only``
    (paths relative to ``top``; none: all of ``kvstore/``)."""
    sys.path.insert(0, str(top))
    from kvstore.options import StoreOptions

    names = frozenset(f.name for f in fields(StoreOptions))
    got: dict[str, tuple[set[str], int, int]] = {n: (set(), 0, 0) for n in sorted(names)}
    for path in sorted((top / "kvstore").rglob("*.py")):
        rel = str(path.relative_to(top))
        if only and not any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in only):
            continue
        for name, default in places(ast.parse(path.read_text()), names):
            files, n, d = got[name]
            files.add(rel)
            got[name] = (files, n + 1, d + default)
    return got


def main(argv: list[str]) -> int:
    got = count(only=tuple(argv))
    print(f"{'option':26} {'files':>5} {'places':>6} {'defaults':>8}")
    for name, (files, n, d) in got.items():
        print(f"{name:26} {len(files):5} {n:6} {d:8}")
    print(f"{'all':26} {len(set().union(*(f for f, _, _ in got.values()))):5} "
          f"{sum(n for _, n, _ in got.values()):6} {sum(d for _, _, d in got.values()):8}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
