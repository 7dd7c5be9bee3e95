"""Shared fixtures: loaded models by name, deterministic prompts.

Models come from tools.testing.model_builds (built once per machine into $KVSTORE_MODELS_DIR or the user
cache dir) and are loaded offline, once per test session. Even under -q the run says what it
does: a first line (how many tests, about how long, models still to build), a line per model
it builds, and lines while one test runs over a minute.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time

import pytest

from tests.support.prompts import text_prompt

# tests/compat runs against the real vllm-mlx, which pins mlx-lm < 0.32: it has its own
# environment (tools/gates/compat_env.sh). Where vllm-mlx is not installed it is not collected.
collect_ignore = [] if importlib.util.find_spec("vllm_mlx") else ["compat"]

# The fast tier: `pytest -m "not slow"`. A test is slow when tests/slow.txt names it (measured)
# or its module starts real servers or child processes at every test (SLOW_MODULES).
SLOW_MODULES = {"test_anthropic", "test_responses", "test_tenants_server", "test_memory_pressure", "test_newcomer",
                "test_benchmarks", "test_demo", "test_faults", "test_upstream_server", "test_families",
                "test_request_bodies"}




def say(config, line: str) -> None:
    """``line`` on the terminal now, on a line of its own, even under -q and inside a test's
    captured output (pytest's own terminal writer, capture suspended)."""
    if config.pluginmanager.get_plugin("terminalreporter") is None:  # an xdist worker, -p no:terminal
        return
    writer = config.get_terminal_writer()
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if writer.width_of_current_line:  # after the dots of -q
            writer.line()
        writer.line(line)
        writer.flush()


# A test running this long says so (a timer thread writes straight to the terminal), again at
# twice as long, then every 2 min at most: under -q a long test is otherwise silent for minutes
# (the quick benchmark suite behind tests/system/test_benchmarks.py ran 7.3 min on a busy machine).
STILL_RUNNING_S = float(os.environ.get("KVSTORE_TEST_STILL_RUNNING_S", "60"))
_terminal_fd: list[int] = []  # a dup of the real terminal, taken while pytest's capture is off


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _terminal_fd:
        return (yield)
    writer, done, started = item.config.get_terminal_writer(), threading.Event(), time.monotonic()

    def still_running() -> None:
        after, width_then = STILL_RUNNING_S, 0  # pytest's writer, unaware of these lines, keeps its width
        while not done.wait(started + after - time.monotonic()):
            line = f"kvstore: still running {item.nodeid} after {after:.0f} s (a few tests take minutes)\n"
            if writer.width_of_current_line != width_then:  # pytest wrote since: end its line first
                line = "\n" + line
            os.write(_terminal_fd[0], line.encode())
            after, width_then = after + min(after, 120.0), writer.width_of_current_line

    threading.Thread(target=still_running, daemon=True).start()
    try:
        return (yield)
    finally:
        done.set()


def pytest_configure(config):
    from tools.testing import model_builds

    known = set(model_builds.MODELS)  # not the specs a test of model_builds adds for itself

    def notice(name: str) -> None:
        if name in known:
            say(config, f"kvstore: building test model {name} (once per machine) ...")

    model_builds.build_notice = notice


def pytest_unconfigure(config):
    from tools.testing import model_builds

    model_builds.build_notice = None
    while _terminal_fd:
        os.close(_terminal_fd.pop())


def pytest_collection_finish(session):
    """The first line a run prints: how many tests, about how long, and what a first run adds."""
    from tools.testing import model_builds

    items = session.items
    if not items or session.config.option.collectonly:
        return
    from tools.measured import pytest_estimate  # README's measured runs: one source of figures

    slow = sum(1 for item in items if item.get_closest_marker("slow"))
    line = (f"kvstore: {len(items)} test{'s' if len(items) > 1 else ''}{f' ({slow} slow)' if slow else ''}, "
            f"{pytest_estimate(len(items) - slow, slow)}")
    builds = {s.dir_name: name for name, s in model_builds.MODELS.items() if not s.on_demand}  # one per build
    missing = sum(not model_builds.is_built(name) for name in builds.values())
    if missing:
        line += (f"; {missing} test models to build on first use, seconds each, once per machine,"
                 f" into {model_builds.models_dir()}")
    say(session.config, line)
    capture = session.config.pluginmanager.get_plugin("capturemanager")
    if session.config.pluginmanager.get_plugin("terminalreporter") is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            _terminal_fd.append(os.dup(1))


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
