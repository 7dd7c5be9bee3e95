"""Launching child Python processes from tests.

Children do not get pytest's ``pythonpath``: ``child_env`` puts the repo root first on their
``PYTHONPATH`` (so ``kvstore``, ``tools`` and ``tests.support`` import from this checkout) and
turns the Hugging Face hub offline unless the caller's environment says otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

from tests.support import ROOT


def child_env(env: dict[str, str] | None = None, **overrides: str) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with the repo root prepended to
    ``PYTHONPATH``, ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` defaulted to 1, then
    ``overrides`` applied."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [out.get("PYTHONPATH")] if p])
    out.setdefault("HF_HUB_OFFLINE", "1")
    out.setdefault("TRANSFORMERS_OFFLINE", "1")
    out.update(overrides)
    return out


def run_module(module: str, payload: Any = None, *, timeout: float = 600,
               env: dict[str, str] | None = None) -> Any:
    """Run ``python -m module JSON`` in a NEW process (this interpreter, cwd the repo root,
    ``child_env(**env)``) with ``payload`` as JSON in ``sys.argv[1]``; the program prints one
    JSON document as its last stdout line, which is returned. A non-zero exit or no output
    raises AssertionError with the end of stderr."""
    return _run(["-m", module], module, payload, timeout, env)


def run_py(script: str, payload: Any = None, *, timeout: float = 600, env: dict[str, str] | None = None) -> Any:
    """``run_module`` for a short program given as source (``python -c``, dedented)."""
    return _run(["-c", textwrap.dedent(script)], "subprocess", payload, timeout, env)


def _run(args: list[str], name: str, payload: Any, timeout: float, env: dict[str, str] | None) -> Any:
    proc = subprocess.run([sys.executable, *args, json.dumps(payload)], capture_output=True,
                          text=True, timeout=timeout, env=child_env(**(env or {})), cwd=str(ROOT))
    if proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise AssertionError(f"{name} printed nothing; stderr:\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])
