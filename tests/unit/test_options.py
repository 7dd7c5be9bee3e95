"""kvstore.options: ``StoreOptions`` refuses a name that is no option, and is the one place the
store's defaults are written (no signature of the store, its adapters or the vllm-mlx CLI
restates one)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from kvstore.floors import MIN_DISK_HIT
from kvstore.options import DROP_IN, EXO, NAMES, VLLM_BATCHED, StoreOptions, checked, store_changes

ROOT = Path(__file__).resolve().parents[2]
# what takes the store's settings: the store, the adapters, the CLI that forwards them, the rooms
# the store hands them to
TAKERS = ["kvstore/store.py", "kvstore/adapters/mlx_lm.py", "kvstore/adapters/vllm_mlx.py",
          "kvstore/adapters/vllm_mlx_batched.py", "kvstore/adapters/vllm_mlx_system.py",
          "kvstore/adapters/exo.py", "kvstore/cli/vllm_mlx.py", "kvstore/write_policy.py"]
# not a store setting: the quantisation an engine names later, mlx-lm's --kv-group-size default
ENGINES_OWN = {"set_kv_quant"}


def test_an_unknown_name_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"^unknown store option\(s\): max_disk_byte, pesist \(one of cache_dir, "):
        StoreOptions().but(max_disk_byte=1, pesist="all")
    with pytest.raises(TypeError, match="unknown store option.*: disk "):
        checked({"disk": False})  # the drop-in's word, not an option
    with pytest.raises(TypeError, match="unknown store option.*: nope "):
        store_changes(disk=False, nope=1)
    with pytest.raises(TypeError):
        StoreOptions(nope=1)  # type: ignore[call-arg]
    assert NAMES == {f.name for f in dataclasses.fields(StoreOptions)} and len(NAMES) == 19


def test_but_copies_with_changes_and_the_value_is_frozen() -> None:
    base = StoreOptions()
    got = base.but(max_disk_bytes=5, persist="system")
    assert (got.max_disk_bytes, got.persist, base.max_disk_bytes, base.persist) == (5, "system", None, "all")
    assert got == StoreOptions(max_disk_bytes=5, persist="system") and base.but() == base
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.persist = "all"  # type: ignore[misc]


def test_disk_is_the_drop_ins_word_for_memory_only() -> None:
    assert store_changes(disk=False, chunk_tokens=64) == {"memory_only": True, "chunk_tokens": 64}
    assert store_changes(disk=True) == {"memory_only": False}
    assert store_changes(persist="reused") == {"persist": "reused"}


def test_each_front_end_differs_from_the_store_in_what_it_names_alone() -> None:
    def changed(o: StoreOptions) -> dict[str, object]:
        return {f.name: getattr(o, f.name) for f in dataclasses.fields(o)
                if getattr(o, f.name) != getattr(StoreOptions(), f.name)}

    assert changed(DROP_IN) == {"touch_on_hit": False, "on_disk_error": "memory", "min_disk_hit": MIN_DISK_HIT}
    assert changed(VLLM_BATCHED) == {"max_entries": 0, "on_disk_error": "memory", "shared": False}
    assert changed(EXO) == {"max_entries": 1 << 40, "on_disk_error": "memory"}


def restated(path: Path) -> list[str]:
    """Where ``path`` gives a store option a default of its own: a parameter named like one
    with a default other than None (None: "not given, the options' value"), or
    ``.get("name", default)``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            out += [f"{path.name}:{node.lineno} {node.name}({p.arg}={ast.unparse(d)})" for p, d in pairs
                    if p.arg in NAMES and not (isinstance(d, ast.Constant) and d.value is None)
                    and node.name not in ENGINES_OWN]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in NAMES):
            out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return out


def test_no_taker_restates_a_default(tmp_path: Path) -> None:
    assert [r for f in TAKERS for r in restated(ROOT / f)] == []
    # the check sees a restated default (as the store's signature and the batched adapter had them)
    probe = tmp_path / "probe.py"
    probe.write_text("def f(cache_dir=None, *, chunk_tokens=256, persist=None):\n"
                     "    return opts.get('queue_size', 16), opts.get('other', 1)\n")
    assert [r.split(" ", 1)[1] for r in restated(probe)] == ["f(chunk_tokens=256)", "opts.get('queue_size', 16)"]


def test_the_store_takes_options_or_their_keywords_alone() -> None:
    """``KVStore.__init__``: ``cache_dir``, ``options``, ``**overrides`` (checked by name through
    ``StoreOptions``), no keyword list of its own."""
    tree = ast.parse((ROOT / "kvstore" / "store.py").read_text())
    init = next(n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "KVStore"
                for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    a = init.args
    assert [p.arg for p in a.args + a.kwonlyargs] == ["self", "cache_dir", "options"]
    assert a.kwarg is not None and a.kwarg.arg == "overrides"
