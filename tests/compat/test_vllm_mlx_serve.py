"""``kvstore vllm-mlx serve``: vllm-mlx's real server over HTTP, once per engine.

Needs vllm-mlx with its server dependencies (tools/gates/compat_env.sh builds that venv; elsewhere
tests/compat is not collected). Per engine (SimpleEngine default, SimpleEngine
``--prefix-trie-cache``, ``--continuous-batching``): a plain ``vllm-mlx serve`` gives the
reference greedy replies; ``kvstore vllm-mlx serve`` answers one request with a long system
prompt and is SIGKILLed once the entry is on disk; a restarted server's first request (a
different question after the same system prompt, through /v1/chat/completions, and after
another SIGKILL and restart through /v1/messages) is served from disk (the entry's hit
count in ``kvstore ls --json`` grows) and replies exactly what the plain server replied.
Every server runs with its own HOME, so vllm-mlx's own prefix-cache files
(~/.cache/vllm-mlx) cannot carry anything across a restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.children import child_env
from tools.testing.procs import end_group, start_group

SYSTEM = "You are a careful assistant who answers briefly and exactly. " * 30
MAX_TOKENS = 12
ENGINES = {"simple": [], "prefix-trie": ["--prefix-trie-cache"], "batched": ["--continuous-batching"]}


@pytest.fixture(scope="module")
def model() -> str:
    from tools.testing.model_builds import model_path

    return str(model_path("tiny-llama"))


class Server:
    """One vllm-mlx server process (plain, or through ``kvstore vllm-mlx serve``)."""

    def __init__(self, cmd: list[str], port: int, home: Path, log: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.port, self.log_path = port, log
        self.log_file = open(log, "w")
        env = child_env(HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.proc = start_group(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900  # a hang, not a slow start on a busy machine
        try:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log()}"
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                    return
                except OSError:
                    time.sleep(0.5)
            raise AssertionError(f"server not ready:\n{self.log()}")
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    def log(self) -> str:
        return self.log_path.read_text()[-6000:]

    def stream(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        """POST with ``stream: true``; the server-sent events' JSON payloads."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(dict(body, stream=True)).encode(),
                                     headers={"content-type": "application/json", "x-api-key": "x"})
        events = []
        with urllib.request.urlopen(req, timeout=300) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                    events.append(json.loads(line[5:]))
        return events

    def ask(self, endpoint: str, model: str, question: str) -> str:
        """The greedy reply, streamed (SimpleEngine's caches serve streaming requests only:
        its non-streaming chat calls the model without them)."""
        if endpoint == "chat":
            events = self.stream("/v1/chat/completions", {
                "model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
            return "".join((e["choices"][0].get("delta") or {}).get("content") or ""
                           for e in events if e.get("choices"))
        events = self.stream("/v1/messages", {
            "model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0, "system": SYSTEM,
            "messages": [{"role": "user", "content": question}]})
        return "".join(e["delta"].get("text", "") for e in events if e.get("type") == "content_block_delta")

    def stop(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(300)
            except subprocess.TimeoutExpired:
                pass
        end_group(self.proc, grace=0)  # the server, or anything it left running
        self.log_file.close()


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(tmp: Path, name: str, model: str, flags: list[str], cache_dir: Path | None) -> Server:
    port = _port()
    if cache_dir is None:
        cmd = [sys.executable, "-m", "vllm_mlx.cli", "serve", model]
    else:
        cmd = [sys.executable, "-m", "kvstore.cli", "vllm-mlx", "serve", model, "--cache-dir", str(cache_dir)]
    return Server([*cmd, *flags, "--port", str(port)], port, tmp / f"home-{name}", tmp / f"{name}.log")


def _entries(cache_dir: Path) -> list[dict[str, Any]]:
    if not cache_dir.exists():  # created by the first cache the server builds
        return []
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "ls", "--cache-dir", str(cache_dir), "--json"],
                         capture_output=True, text=True, env=child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    return [e for ident in json.loads(out.stdout)["identities"] for e in ident["entries"]]


def _wait(cond: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_restart_after_sigkill_restores_the_system_prompt_from_disk(engine: str, model: str, tmp_path: Path) -> None:
    flags = ENGINES[engine]
    questions = {"chat": "What is two plus two?", "messages": "Name one primary colour."}

    cold = _serve(tmp_path, "plain", model, flags, None)
    try:
        expected = {ep: cold.ask(ep, model, q) for ep, q in questions.items()}
    finally:
        cold.stop(signal.SIGTERM)

    cache_dir = tmp_path / "kv"
    first = _serve(tmp_path, "kv-1", model, flags, cache_dir)
    try:
        assert f"kvstore vllm-mlx: disk tier on: entries in {cache_dir} " in first.log(), first.log()
        first.ask("chat", model, "Say hello.")  # the system prompt's KV, written to disk
        _wait(lambda: _entries(cache_dir), "an entry on disk")
    finally:
        first.stop(signal.SIGKILL)

    for i, endpoint in enumerate(questions, start=2):
        hits_before = sum(e["hits"] for e in _entries(cache_dir))
        server = _serve(tmp_path, f"kv-{i}", model, flags, cache_dir)
        try:
            got = server.ask(endpoint, model, questions[endpoint])
            assert got == expected[endpoint], (engine, endpoint, server.log())
            _wait(lambda: sum(e["hits"] for e in _entries(cache_dir)) > hits_before,
                  f"a disk hit ({engine}, {endpoint})\n{server.log()}")
        finally:
            server.stop(signal.SIGKILL)


def test_paged_cache_is_refused_with_the_flag_to_drop(model: str, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "vllm-mlx", "serve", model, "--continuous-batching",
                          "--use-paged-cache", "--cache-dir", str(tmp_path)],
                         capture_output=True, text=True, env=child_env(HOME=str(tmp_path)), timeout=120)
    assert out.returncode == 2, out
    assert "drop --use-paged-cache" in out.stderr


def test_kvstore_flags_are_taken_out_and_checked() -> None:
    from kvstore.cli.vllm_mlx import split_args

    options, rest = split_args(["m", "--port", "1", "--cache-dir=/x", "--max-disk-bytes", "5G", "--persist", "reused"])
    assert options == {"cache_dir": "/x", "max_disk_bytes": 5 << 30, "persist": "reused"}
    assert rest == ["m", "--port", "1"]
    with pytest.raises(ValueError, match="--persist"):
        split_args(["m", "--persist", "some"])
    with pytest.raises(ValueError, match="--max-disk-bytes needs a value"):
        split_args(["m", "--max-disk-bytes"])
    with pytest.raises(ValueError, match="no unit"):  # the one size parser: `5` is a typo for 5G, not 5 bytes
        split_args(["m", "--max-disk-bytes", "5"])


def test_entries_from_another_kv_bound_are_refused_once_then_not_read(model: str, tmp_path: Path) -> None:
    """Entries written without ``--max-kv-size`` and a server restarted with it: vllm-mlx's
    scheduler refuses the restored cache (another topology) and prefills; kvstore then stops
    reading the disk for that server, and the replies are the plain server's."""
    bound = ["--continuous-batching", "--max-kv-size", "4096"]
    cold = _serve(tmp_path, "plain", model, bound, None)
    try:
        expected = [cold.ask("chat", model, q) for q in ("What is two plus two?", "Name a colour.")]
    finally:
        cold.stop(signal.SIGTERM)
    cache_dir = tmp_path / "kv"
    first = _serve(tmp_path, "kv-1", model, ["--continuous-batching"], cache_dir)
    try:
        first.ask("chat", model, "Say hello.")
        _wait(lambda: _entries(cache_dir), "an entry on disk")
    finally:
        first.stop(signal.SIGKILL)
    server = _serve(tmp_path, "kv-2", model, bound, cache_dir)
    try:
        got = [server.ask("chat", model, q) for q in ("What is two plus two?", "Name a colour.")]
        assert got == expected, server.log()
        log = server.log_path.read_text()
        assert log.count("disk lookups off for this server") == 1, log[-3000:]
    finally:
        server.stop(signal.SIGKILL)
