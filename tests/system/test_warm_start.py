"""``kvstore serve --preload`` end to end: real server processes, real HTTP, a tiny model.

The system prompt is prefilled by ``kvstore warm --system-file`` and pinned by ``kvstore
pin`` (the CLI, as a user does it); a server restarted with ``--preload pinned`` holds it
in memory before its first request, which is then a memory hit answered exactly as a
server that computed everything answers it. Readiness is watched from outside: /health
and /v1/models say 503 until loading, warm-up and a foreground preload are done, and a
request sent before that waits and is never served cold.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

from tests.support.servers import Server, cached_tokens, reply, serve_command
from tests.system.test_server import SYSTEM, USER1, USER2

FILLER = 60  # unpinned entries that make a preload last long enough to be seen from outside


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def kvstore(*args: Any) -> str:
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def warm_and_pin(model_dir: Path, cache_dir: Path, tmp: Path) -> int:
    """The system prompt warmed and pinned through the CLI; returns its token count."""
    (tmp / "system.txt").write_text(SYSTEM)
    out = kvstore("warm", "--model", model_dir, "--system-file", tmp / "system.txt", "--cache-dir", cache_dir)
    n, entry = re.search(r"warmed (\d+) tokens .* entry ([0-9a-f]+)", out).groups()
    assert "pinned" in kvstore("pin", entry, "--cache-dir", cache_dir)
    return int(n)


def fill(model_dir: Path, cache_dir: Path, n_entries: int = FILLER, n_tokens: int = 1500) -> None:
    """``n_entries`` unpinned entries of the model's identity (synthetic KV of its shape)."""
    from tests.support.caches import synth_kv_cache

    from kvstore import KVStore

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    with KVStore(cache_dir, queue_size=n_entries + 1) as s:
        for i in range(n_entries):
            tokens = [rng.randrange(vocab) for _ in range(n_tokens)]
            s.insert(model_dir, tokens, synth_kv_cache(3, 2, n_tokens, 32, seed=i, shared=True))
        assert s.flush(120) and s.stats()["writes"] == n_entries


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def full_log(s: Server) -> str:
    return Path(s.log_path).read_text(errors="replace")


def before(log: str, first: str, then: str) -> bool:
    """Both lines are in the log, ``first`` before ``then``."""
    return -1 < log.find(first) < log.find(then)


def test_ready_time_counts_from_the_process_start() -> None:
    """The "ready ... s after the process started" figure includes what happened before
    kvstore's code ran (here a 1 s sleep standing in for Python's start and the imports)."""
    p = subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0); "
                        "from kvstore.serve.startup import since_process_start; print(since_process_start())"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert float(p.stdout) >= 1.0, p.stdout


def test_help_lists_the_warm_start_flags() -> None:
    out = subprocess.run(serve_command() + ["--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--preload", "--preload-background", "--no-warmup"):
        assert flag in out.stdout, flag
    bad = subprocess.run(serve_command() + ["--preload", "some"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "expected pinned, auto or a number of entries" in bad.stderr, bad.stderr


def system_entry(cache_dir: Path) -> tuple[str, int]:
    """(id, tokens) of the one system-prompt entry `kvstore ls --json` lists."""
    listing = json.loads(kvstore("ls", "--json", "--cache-dir", cache_dir))
    found = [(e["id"], e["tokens"]) for i in listing["identities"] for e in i["entries"] if e["cache_type"] == "system"]
    assert len(found) == 1, listing
    return found[0]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_restart_with_preload_pinned_answers_the_first_request_from_memory(model_dir: Path, tmp_path: Path) -> None:
    """A first cold request stores the system prompt (mlx-lm's system segment); it is
    pinned with `kvstore pin`. Restarted with --preload pinned, the server holds it in
    memory before any request; a new question is then a memory hit of exactly those
    tokens, answered as a server that computed everything answers it."""
    baseline = Server(model_dir, tmp_path / "cold-cache", tmp_path / "cold.log")  # boots meanwhile
    cache_dir = tmp_path / "cache"
    with Server(model_dir, cache_dir, tmp_path / "first.log") as s:
        assert cached_tokens(s.chat(chat(USER1))) == 0
        s.wait_flushed()
        assert s.stop(signal.SIGTERM) == 0
    entry, n_sys = system_entry(cache_dir)
    assert "pinned" in kvstore("pin", entry, "--cache-dir", cache_dir)
    with baseline:
        r_cold = baseline.chat(chat(USER2))
        assert cached_tokens(r_cold) == 0 and baseline.stop(signal.SIGTERM) == 0

    with Server(model_dir, cache_dir, tmp_path / "server.log", ["--preload", "pinned"]) as s:
        st = s.stats()
        assert (st["memory_entries"], st["preloaded_entries"], st["preloaded_tokens"]) == (1, 1, n_sys), st
        assert st["hits_memory"] == st["hits_disk"] == st["restores"] == 0 and not st["preload_running"], st
        assert s.get("/health") == {"status": "ok"}  # mlx_lm.server's body exactly; details in the stats
        health = st["startup"]
        assert health["ready"] and health["preload"]["stopped"] == "done" and health["warmup_seconds"] > 0
        r = s.chat(chat(USER2))
        after = s.stats()
        assert cached_tokens(r) == n_sys, r["usage"]
        assert (after["hits_memory"], after["hits_disk"], after["restores"]) == (1, 0, 0), after
        assert r["usage"]["prompt_tokens"] == r_cold["usage"]["prompt_tokens"]
        assert reply(r) == reply(r_cold), (reply(r), reply(r_cold))
        assert s.stop(signal.SIGTERM) == 0
        log = full_log(s)
    assert before(log, "kvstore: preloaded 1 of 1 entry (", "kvstore: ready: "), log


def watch_start(s: Server, on_starting: Any, timeout: float = 120) -> tuple[set[str], list[int], dict]:
    """Poll /health (and /v1/models) from the moment the process starts until /health
    says 200: (phases seen, /v1/models statuses seen while starting, stats at ready).
    ``on_starting(phase)`` is called on every 503."""
    phases: set[str] = set()
    codes: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert s.proc.poll() is None, s.log()
        try:
            code, body = get(s.url + "/health")
        except OSError:  # not listening yet
            time.sleep(0.01)
            continue
        if code == 200:
            return phases, codes, s.stats()
        assert code == 503 and body == {"status": "starting"}, (code, body)
        phase = s.stats()["startup"]["phase"]
        phases.add(phase)
        on_starting(phase)
        codes.append(get(s.url + "/v1/models")[0])
    raise AssertionError(f"not ready after {timeout} s\n{s.log()}")


def test_not_ready_until_the_preload_is_done_and_early_requests_wait(model_dir: Path, tmp_path: Path) -> None:
    """/health and /v1/models say 503 through loading, warm-up and a foreground preload
    (long enough here to be seen: the pinned system prompt plus FILLER entries); at the
    first 200 every entry is in memory. A chat request sent while the server said
    "starting" is accepted, waits, and is answered from memory once the preload is done."""
    cache_dir = tmp_path / "cache"
    n_sys = warm_and_pin(model_dir, cache_dir, tmp_path)
    fill(model_dir, cache_dir)
    s = Server(model_dir, cache_dir, tmp_path / "server.log",
               ["--preload", "auto", "--prompt-cache-size", str(FILLER + 1)])
    early: dict[str, Any] = {}

    def send_early(phase: str) -> None:
        if "thread" not in early:
            early["phase"] = phase
            early["thread"] = threading.Thread(target=lambda: early.update(r=s.chat(chat(USER2))))
            early["thread"].start()

    try:
        phases, codes, at_ready = watch_start(s, send_early)
        early["thread"].join(120)
        after = s.stats()
        health = after["startup"]
        assert s.stop(signal.SIGTERM) == 0
    finally:
        s.__exit__()
    assert "preloading" in phases and codes.count(503) >= 1 and set(codes) <= {200, 503}, (phases, codes)
    assert (at_ready["preloaded_entries"], at_ready["memory_entries"]) == (FILLER + 1, FILLER + 1), at_ready
    assert not at_ready["preload_running"] and at_ready["hits_disk"] == 0, at_ready
    assert early["phase"] != "ready" and cached_tokens(early["r"]) == n_sys, early
    assert (after["hits_memory"], after["hits_disk"]) == (1, 0), after
    assert health["warmup_seconds"] > 0 and health["preload"]["stopped"] == "done", health
    log = full_log(s)
    assert before(log, f"kvstore: preloaded {FILLER + 1} of {FILLER + 1} entries", "kvstore: ready: "), log


def test_background_preload_reports_ready_first_and_keeps_to_the_budget(model_dir: Path, tmp_path: Path) -> None:
    """--preload-background: ready (and the warm-up skipped with --no-warmup) before the
    preload ends; the preload stops at --prompt-cache-size, beside a live request."""
    cache_dir = tmp_path / "cache"
    warm_and_pin(model_dir, cache_dir, tmp_path)
    fill(model_dir, cache_dir)
    flags = ["--preload", "auto", "--preload-background", "--no-warmup", "--prompt-cache-size", "10"]
    with Server(model_dir, cache_dir, tmp_path / "server.log", flags) as s:
        health = s.stats()["startup"]
        r = s.chat(chat(USER2))
        deadline = time.monotonic() + 60
        while s.stats()["preload_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        st = s.stats()
        done = s.stats()["startup"]["preload"]
        assert s.stop(signal.SIGTERM) == 0
        log = full_log(s)
    assert "warmup_seconds" not in health and "no warm-up" in log, health
    assert r["usage"]["prompt_tokens"] > 0 and not st["preload_running"], st
    assert st["memory_entries"] == 10 and 1 <= st["preloaded_entries"] <= 10, st
    assert done["stopped"] == "budget" and done["preloaded_entries"] == st["preloaded_entries"], done
    assert before(log, "kvstore: ready: ", "kvstore: preloaded "), log
    assert "preload (auto) continues in the background" in log


def test_the_start_resolves_the_identity_and_says_what_it_cost(model_dir: Path, tmp_path: Path) -> None:
    """The model's identity is derived at the start, with the model just loaded (issue 56.3):
    before any request the cache directory's index holds it, with the digest a lazily built
    model gives (``model_identity``: a changed digest would orphan the stored caches), and
    the ready line and ``/v1/cache/stats`` "startup" say what it took."""
    from kvstore import model_identity
    from kvstore.cachedir import open_disk

    cache_dir = tmp_path / "cache"
    with Server(model_dir, cache_dir, tmp_path / "server.log", ["--no-warmup"]) as s:
        startup = s.stats()["startup"]
        disk = open_disk(cache_dir)
        try:
            filed = set(disk.index.identities())
        finally:
            disk.close()
        assert s.stop(signal.SIGTERM) == 0
        log = full_log(s)
    assert startup["ready"] and isinstance(startup["identity_seconds"], float), startup
    assert filed == {model_identity(model_dir).hex}, filed
    ready = next(line for line in log.splitlines() if "kvstore: ready: " in line)
    assert f"identity {startup['identity_seconds']:.2f} s" in ready, ready
