"""tools.gates.serve_shape's source-read parts (2-5), on a small tree written here: each
finds what it counts and nothing else (parts 1 and 6 run kvstore serve: the closing note's
figures, not a unit test)."""

from __future__ import annotations

from pathlib import Path

from tools.gates import serve_shape

TREE = {
    "kvstore/__init__.py": "",
    "kvstore/options.py": ("from dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass StoreOptions:\n"
                           "    cache_dir: str = ''\n    chunk_tokens: int = 256\n    persist: str = 'all'\n"
                           "    kv_bits: int = 0\n"),
    "kvstore/conf.py": "import threading\n\nFLAG = False\n_LOCAL = threading.local()\n_SEEN: list = []\n_N = 0\n",
    "kvstore/user.py": (
        "from . import conf\n\n"
        "def configure(on):\n    global _N\n    conf.FLAG = on\n    conf._SEEN.append(on)\n\n"
        "def local_only(_CACHE):\n    _CACHE.update(a=1)\n\n"
        "def wide(self, cache_dir, chunk_tokens, persist, kv_bits, *, other=1):\n"
        "    return dict(cache_dir=cache_dir, chunk_tokens=chunk_tokens, persist=persist, kv_bits=kv_bits)\n\n"
        "def note():\n    _STATE.count = 1\n\n_STATE = object()\n"
        "def narrow(x):\n    return {'cache_dir': x, 'persist': x}\n\n_CACHE: dict = {}\n"),
}


def write(top: Path) -> dict:
    for name, text in TREE.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(text)
    return serve_shape.shape(top, run=False)


def test_the_source_parts_count_what_they_say(tmp_path: Path) -> None:
    got = write(tmp_path)
    state = got["run_time_state"]
    assert state["thread_locals"] == ["kvstore/conf.py:4"]
    assert state["global_statements"] == ["kvstore/user.py:3 configure: global _N"]
    assert state["other_modules_names_written"] == ["kvstore/user.py:5 conf.FLAG"]  # conf._SEEN.append: conf's object
    assert state["module_objects_changed_in_functions"] == ["kvstore/user.py:_STATE"]  # local_only's _CACHE is its parameter
    assert got["imports"]["modules"] == 4 and got["imports"]["imports"] == 1 and not got["imports"]["cycles"]
    assert got["widest_signatures"][0] == {"function": "kvstore/user.py:wide", "params": 5}  # self not counted
    opts = got["store_options"]
    assert opts["source"] == "kvstore/options.py:StoreOptions" and opts["options"] == 4
    # the class's field, wide's parameter and dict() keyword; narrow's dict key
    assert opts["per_option"]["cache_dir"] == {"places": 4, "files": 2}
    assert opts["per_option"]["kv_bits"] == {"places": 3, "files": 2}
    assert [(p["where"], p["options"]) for p in opts["option_lists"]] == [
        ("kvstore/options.py:4 StoreOptions", 4), ("kvstore/user.py:11 wide", 4), ("kvstore/user.py:12 keywords", 4)]


def test_the_table_says_each_part_in_a_line(tmp_path: Path) -> None:
    text = serve_shape.table(write(tmp_path))
    assert "1 thread-locals, 1 global statements, 1 other modules' names written" in text
    assert "4 options stated in" in text and "assignments onto mlx_lm.server" not in text  # not run: not claimed
