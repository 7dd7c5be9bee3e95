"""The shape of ``kvstore serve`` on mlx_lm.server (issue 53 item 3): kvstore subclasses
mlx-lm's handler and generator and points a few module names of mlx_lm.server at its own
classes; it sets no attribute of mlx-lm's classes, and keeps nothing per request in a
thread-local.

Each check imports a pristine mlx_lm.server in a child process, snapshots its module
namespace and the ``__dict__`` of ``APIHandler`` and ``ResponseGenerator``, makes it kvstore's
server as ``kvstore serve``'s ``main`` does (``server._install``: the flags' config, the warm
start, the signals) or as the upstream gate does (``patch(server_mod, cache_dir=...)``),
and compares.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.children import child_env

ROOT = Path(__file__).resolve().parents[2]
MAX_NAMES = 8

CHILD = r"""
import json, sys
import mlx_lm.server as server_mod

def snapshot():
    return ({k: id(v) for k, v in vars(server_mod).items()},
            {c: {k: id(v) for k, v in vars(getattr(server_mod, c)).items()} for c in ("APIHandler", "ResponseGenerator")})

pristine = {c: getattr(server_mod, c) for c in ("APIHandler", "ResponseGenerator")}
module_before, classes_before = snapshot()
class_dicts = {c: dict(vars(cls)) for c, cls in pristine.items()}
how, cache_dir = sys.argv[1], sys.argv[2]
if how == "main":  # as kvstore serve's main does, with flags that turn every step on
    import argparse
    from kvstore.serve import model_names, server, startup, tenants
    from kvstore.serve.config import ServeConfig
    parser = argparse.ArgumentParser()
    server.setup_arg_parser(parser)
    startup.add_arguments(parser)
    tenants.add_arguments(parser)
    model_names.add_arguments(parser)
    ours = parser.parse_args(["--cache-dir", cache_dir, "--stable-prefix", "--sort-tools", "--api-key", "k" * 20,
                              "--isolate-keys", "--served-model-name", "tiny", "--strict-model-names"])
    config = ServeConfig.from_args(ours, tenants.policy_from(ours, {}))
    server._install(server_mod, config, [], None)
else:  # as the upstream gate does (tools/gates/upstream_mlx_lm.py)
    from kvstore.serve.server import patch
    patch(server_mod, cache_dir=cache_dir)
module_after, _ = snapshot()
changed_classes = {}
for c, cls in pristine.items():
    before, now = class_dicts[c], dict(vars(cls))
    changed_classes[c] = sorted(k for k in set(before) | set(now) if before.get(k, None) is not now.get(k, None))
reassigned = sorted(k for k in module_before if module_after.get(k) != module_before[k])
added = sorted(set(module_after) - set(module_before))
print(json.dumps({"changed_classes": changed_classes, "reassigned": reassigned, "added": added,
                  "subclasses": {c: issubclass(getattr(server_mod, c), pristine[c]) for c in pristine}}))
"""


def _shape(how: str, tmp_path: Path) -> dict[str, object]:
    p = subprocess.run([sys.executable, "-c", CHILD, how, str(tmp_path / "cache")], capture_output=True, text=True,
                       cwd=ROOT, env=child_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["main", "gate"])
def test_kvstore_serve_sets_no_attribute_of_mlx_lms_classes_and_at_most_eight_module_names(
        how: str, tmp_path: Path) -> None:
    from kvstore.serve.server import PATCHED_NAMES

    got = _shape(how, tmp_path)
    print(f"\n{how}: module names reassigned: {got['reassigned']}")
    assert got["changed_classes"] == {"APIHandler": [], "ResponseGenerator": []}, got["changed_classes"]
    assert got["added"] == [], got["added"]
    reassigned = got["reassigned"]
    assert isinstance(reassigned, list) and len(reassigned) <= MAX_NAMES, reassigned
    assert set(reassigned) <= set(PATCHED_NAMES), reassigned
    expected = set(PATCHED_NAMES) if how == "main" else set(PATCHED_NAMES) - {"ModelProvider"}
    assert set(reassigned) == expected, reassigned
    assert got["subclasses"] == {"APIHandler": True, "ResponseGenerator": True}


def test_no_thread_local_in_kvstore_serve() -> None:
    """Per-request facts ride the request's context (``kvstore.serve.context``), not a
    thread-local: none in the source, none held by a module of the package."""
    import kvstore.serve as package

    source = Path(package.__file__).parent
    found = [f.name for f in sorted(source.glob("*.py")) if "threading.local" in f.read_text()]
    assert found == [], found
    for info in pkgutil.iter_modules([str(source)]):
        module = importlib.import_module(f"kvstore.serve.{info.name}")
        held = [k for k, v in vars(module).items() if isinstance(v, threading.local)]
        assert held == [], (info.name, held)
