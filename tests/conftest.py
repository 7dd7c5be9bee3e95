"""Shared fixtures: loaded models by name, deterministic prompts.

Models come from tools.testing.model_builds (built once per machine into $KVSTORE_MODELS_DIR or the user
cache dir) and are loaded offline, once per test session.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.support.prompts import text_prompt

# tests/compat runs against the real vllm-mlx, which pins mlx-lm < 0.32: it has its own
# environment (tools/gates/compat_env.sh). Where vllm-mlx is not installed it is not collected.
collect_ignore = [] if importlib.util.find_spec("vllm_mlx") else ["compat"]

# The fast tier: `pytest -m "not slow"`. A test is slow when tests/slow.txt names it (measured)
# or its module starts real servers or child processes at every test (SLOW_MODULES).
SLOW_MODULES = {"test_anthropic", "test_tenants_server", "test_memory_pressure", "test_newcomer", "test_benchmarks",
                "test_demo", "test_faults", "test_upstream_server", "test_families"}


def pytest_collection_modifyitems(config, items):
    from pathlib import Path

    listed = Path(__file__).with_name("slow.txt")
    slow = {line.strip() for line in listed.read_text().splitlines() if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow or item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def load_named():
    """``load_named(name) -> (model, tokenizer)``, each model loaded once per session."""
    from tools.testing.model_builds import load_model

    loaded: dict[str, tuple] = {}

    def load(name: str):
        if name not in loaded:
            loaded[name] = load_model(name)
        return loaded[name]

    return load


@pytest.fixture(scope="session")
def make_prompt():
    """``make_prompt(tokenizer, n_tokens, seed=0) -> list[int]`` (deterministic text)."""
    return text_prompt


@pytest.fixture(scope="session")
def tiny_llama(load_named):
    return load_named("tiny-llama")


@pytest.fixture(scope="session")
def tiny_gemma3(load_named):
    return load_named("tiny-gemma3")


@pytest.fixture(scope="session")
def tiny_qwen3next(load_named):
    return load_named("tiny-qwen3next")


@pytest.fixture(scope="session")
def tiny_cachelist(load_named):
    return load_named("tiny-cachelist")
