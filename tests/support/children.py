"""Launching child Python processes from tests.

Children do not get pytest's ``pythonpath``: ``child_env`` puts the repo root first on their
``PYTHONPATH`` (so ``kvstore``, ``tools`` and ``tests.support`` import from this checkout) and
turns the Hugging Face hub offline unless the caller's environment says otherwise.
"""

from __future__ import annotations

import os

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

