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
                "test_request_bodies",
                "test_fuzz_routes"}




def say(config, line: str) -> None:
    """``line`` on the terminal now, on a line of its own, even under -q and inside a test's
    captured output (pytest's own terminal writer, capture suspended; in an xdist worker,
    which has no terminal, the real stderr it kept at start)."""
    if config.pluginmanager.get_plugin("terminalreporter") is None:  # an xdist worker, -p no:terminal
        if _worker_stderr:
            os.write(_worker_stderr[0], f"\n{line}\n".encode())
        return
    writer = config.get_terminal_writer()
    capture = config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if writer.width_of_current_line:  # after the dots of -q
            writer.line()
        writer.line(line)
        writer.flush()


_worker_stderr: list[int] = []  # an xdist worker's real stderr (its stdout carries xdist's channel)


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


class _RunningOnWorkers:
    """Under pytest-xdist (``-n``), the tests run in workers that have no terminal: the
    controller hears each test start and finish (xdist forwards both hooks) and says which
    is still running, as a serial run does."""

    def __init__(self, config) -> None:
        self.config, self.running, self.lock, self.width_then = config, {}, threading.Lock(), 0
        threading.Thread(target=self._watch, daemon=True).start()

    def pytest_runtest_logstart(self, nodeid, location) -> None:
        with self.lock:
            self.running[nodeid] = [time.monotonic(), STILL_RUNNING_S]

    def pytest_runtest_logfinish(self, nodeid, location) -> None:
        with self.lock:
            self.running.pop(nodeid, None)

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            lines = []
            with self.lock:
                for nodeid, r in self.running.items():  # r: [started, say at this many seconds]
                    if time.monotonic() - r[0] >= r[1]:
                        lines.append(f"kvstore: still running {nodeid} after {r[1]:.0f} s (a few tests take minutes)")
                        r[1] += min(r[1], 120.0)
            writer = self.config.get_terminal_writer()
            for line in lines:
                if writer.width_of_current_line != self.width_then:  # pytest wrote since: end its line first
                    line = "\n" + line
                if _terminal_fd:
                    os.write(_terminal_fd[0], f"{line}\n".encode())
                self.width_then = writer.width_of_current_line


def pytest_cmdline_main(config):
    """Under ``-n`` (pytest-xdist), each test file's tests run in one worker (``--dist
    loadfile``): a module's fixtures (a benchmark run, a server) are made once, not once per
    worker. An explicit ``--dist`` other than xdist's default is kept."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadfile"


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    from tools.testing import model_builds

    capture = config.pluginmanager.get_plugin("capturemanager")
    if _xdist_worker(config) and capture is not None:
        with capture.global_and_fixture_disabled():
            _worker_stderr.append(os.dup(2))
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None) \
            and not _xdist_worker(config):
        config.pluginmanager.register(_RunningOnWorkers(config), "kvstore-running-on-workers")

    known = set(model_builds.MODELS)  # not the specs a test of model_builds adds for itself

    def notice(name: str) -> None:
        if name in known:
            say(config, f"kvstore: building test model {name} (once per machine) ...")

    model_builds.build_notice = notice


def pytest_unconfigure(config):
    from tools.testing import model_builds

    model_builds.build_notice = None
    for fds in (_terminal_fd, _worker_stderr):
        while fds:
            os.close(fds.pop())


def _first_line(config, nodeids: list[str]) -> None:
    """The first line a run prints: how many tests, about how long, and what a first run
    adds; then the terminal is kept for the still-running lines."""
    from tools.measured import pytest_estimate  # README's measured runs: one source of figures
    from tools.testing import model_builds

    slow = sum(1 for n in nodeids if _is_slow(n))
    line = (f"kvstore: {len(nodeids)} test{'s' if len(nodeids) > 1 else ''}{f' ({slow} slow)' if slow else ''}, "
            f"{pytest_estimate(len(nodeids) - slow, slow, workers=_workers(config))}")
    missing = len(_missing_models())
    if missing:
        line += (f"; {missing} test models to build on first use, seconds each, once per machine,"
                 f" into {model_builds.models_dir()}")
    say(config, line)
    capture = config.pluginmanager.get_plugin("capturemanager")
    if config.pluginmanager.get_plugin("terminalreporter") is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            _terminal_fd.append(os.dup(1))


def _missing_models() -> list[str]:
    """The test models this machine has not built yet (one name per build)."""
    from tools.testing import model_builds

    builds = {s.dir_name: name for name, s in model_builds.MODELS.items() if not s.on_demand}
    return [name for name in builds.values() if not model_builds.is_built(name)]


def _workers(config) -> int:
    """How many xdist workers run the tests (1: none, the tests run in this process)."""
    n = getattr(config.option, "numprocesses", None) if config.pluginmanager.hasplugin("xdist") else None
    return int(n) if isinstance(n, int) and n > 1 else 1


def pytest_collection_finish(session):
    if session.items and not session.config.option.collectonly and not _xdist_worker(session.config):
        _first_line(session.config, [item.nodeid for item in session.items])


_collected_on_workers: list[bool] = []


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist, never called
def pytest_xdist_node_collection_finished(node, ids):
    """Under xdist the controller collects nothing: the first worker's collection gives the count."""
    if not _collected_on_workers and ids and not node.config.option.collectonly:
        _collected_on_workers.append(True)
        _first_line(node.config, list(ids))
        # A worker has no terminal to say it builds a model: for a run beyond the unit tier
        # the controller builds them first, saying so (the workers wait meanwhile).
        from tools.testing import model_builds

        for name in _missing_models() if any(not i.startswith("tests/unit/") for i in ids) else []:
            try:
                model_builds.model_path(name)
            except Exception as e:  # the tests that need it fail with the reason
                say(node.config, f"kvstore: test model {name} did not build here: {e}")


def _slow_ids() -> set[str]:
    from pathlib import Path

    listed = Path(__file__).with_name("slow.txt")
    return {line.strip() for line in listed.read_text().splitlines() if line.strip() and not line.startswith("#")}


def _is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` is in the slow tier (tests/slow.txt, or its module's)."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return nodeid in _SLOW_IDS or module in SLOW_MODULES


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)


_SLOW_IDS = _slow_ids()


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Property tests (hypothesis) of the parsers of outside text: a budget CI can afford (the
# whole set runs in seconds), no deadline (a loaded machine is not a failure), no example
# database written into the work tree. KVSTORE_HYPOTHESIS=thorough explores ten times more.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("kvstore", max_examples=200, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("kvstore"), max_examples=2000)
settings.load_profile("thorough" if os.environ.get("KVSTORE_HYPOTHESIS") == "thorough" else "kvstore")


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
