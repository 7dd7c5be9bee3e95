"""Adapter entry points as a user without the engine installed meets them (subprocesses)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "from kvstore.adapters import vllm_mlx; vllm_mlx.install(cache_dir='unused')"


def compat_recipe() -> list[str]:
    """The pins tools/compat_env.sh installs vllm-mlx with."""
    sh = (ROOT / "tools" / "compat_env.sh").read_text()
    pins = re.findall(r'^(?:MLX_LM|VLLM_MLX)="([^"]+)"', sh, re.M)
    deps = re.findall(r'"([^"]+)"', re.search(r"^VLLM_MLX_DEPS=\(([^)]*)\)", sh, re.M).group(1))
    assert len(pins) == 2 and len(deps) == 2, (pins, deps)
    return pins + deps


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(ROOT), env=dict(os.environ, **env))


@pytest.mark.skipif(importlib.util.find_spec("vllm_mlx") is not None,
                    reason="vllm-mlx is installed here (tests/compat runs the adapter)")
def test_vllm_mlx_install_says_how_to_install_vllm_mlx() -> None:
    assert python("import kvstore.adapters.vllm_mlx").returncode == 0  # importing needs no vllm-mlx
    p = python(INSTALL)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith(
        "ModuleNotFoundError: kvstore.adapters.vllm_mlx needs vllm-mlx, which is not installed"), p.stderr
    assert "pip install --no-deps 'vllm-mlx==" in last
    for pin in compat_recipe():
        assert pin in last, (pin, last)
    assert "During handling" not in p.stderr  # one clear error, not a chained traceback
    readme = (ROOT / "README.md").read_text()
    for pin in compat_recipe():
        assert pin in readme, pin


def test_vllm_mlx_install_names_a_missing_dependency(tmp_path: Path) -> None:
    """vllm-mlx present (a stand-in package first on the path) but one of its imports missing."""
    engine = tmp_path / "vllm_mlx" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "vllm_mlx" / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "simple.py").write_text("import jsonschema_not_installed_here\n")
    p = python(INSTALL, PYTHONPATH=str(tmp_path))
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "vllm-mlx is installed but cannot be imported" in last, p.stderr
    assert "'jsonschema_not_installed_here'" in last and "pip install --no-deps 'vllm-mlx==" in last
