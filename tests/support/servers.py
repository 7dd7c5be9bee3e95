"""Helpers for tests that run ``kvstore serve`` as a real subprocess and talk HTTP to it."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.children import child_env
from tools.testing.procs import end_group, start_group

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


ADAPTER_COMMAND = [sys.executable, "-c",
                   "import sys; from kvstore.serve.server import main; sys.exit(main(sys.argv[1:]))"]
CLI_COMMAND = [sys.executable, "-m", "kvstore.cli", "serve"]


def cli_available() -> bool:
    return importlib.util.find_spec("kvstore.cli.__main__") is not None


def serve_command() -> list[str]:
    """``kvstore serve`` as a command line: ``python -m kvstore.cli serve`` when the CLI is
    installed, else the adapter's ``main`` (what the CLI routes to).
    ``KVSTORE_TEST_SERVE=adapter`` forces the latter."""
    if os.environ.get("KVSTORE_TEST_SERVE") != "adapter" and cli_available():
        return CLI_COMMAND
    return ADAPTER_COMMAND


class Server:
    """One ``kvstore serve`` process on 127.0.0.1; use as a context manager (always killed)."""

    def __init__(self, model: Path, cache_dir: Path | None, log_path: Path, extra: list[str] = ()) -> None:
        """``cache_dir`` None: plain ``mlx_lm.server`` (the reference kvstore serve must match)."""
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        args = ["--model", str(model), "--host", HOST, "--port", str(self.port), *extra]
        command = [sys.executable, "-m", "mlx_lm.server"]
        if cache_dir is not None:
            args, command = ["--cache-dir", str(cache_dir), *args], serve_command()
        env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        self._log = open(log_path, "wb")
        # its own process group, dead with the test process even if that is SIGKILLed
        self.proc = start_group(command + args, stdout=self._log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    # -- lifecycle -----------------------------------------------------------------

    def wait_ready(self, timeout: float = 900.0) -> None:
        """Until ``/health`` answers; an exit fails at once, and ``timeout`` bounds only a
        hang (a loaded laptop starts a server in tens of seconds, not minutes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} before it was ready\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready after {timeout}s\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 300.0) -> int:
        """Send ``sig`` and wait for the exit (``timeout`` bounds a hang); the return code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"server did not exit within {timeout}s of signal {sig}\n{self.log()}")
        return self.proc.returncode

    def log(self, tail: int = 6000) -> str:
        self._log.flush()
        try:
            return Path(self.log_path).read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def __enter__(self) -> "Server":
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # as a crash: nothing flushed on the way out
        end_group(self.proc)  # then anything it started
        self._log.close()

    # -- HTTP ------------------------------------------------------------------------

    def get(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            assert r.status == 200, r.status
            return json.loads(r.read())

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                assert r.status == 200, r.status
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path}: HTTP {e.code}: {e.read()[:2000]!r}\n{self.log()}") from None
        except TimeoutError:
            raise AssertionError(f"{path}: no answer in {timeout} s; the server's threads:\n{self.stacks()}") from None

    def stacks(self) -> str:
        """The server's log after SIGUSR1 made it print every thread's stack (a hang's state);
        SIGUSR2 (the dump from inside the signal) if Python did not answer in 2 s."""
        if self.proc.poll() is None:
            before = self.log(1 << 30).count("most recent call first")
            self.proc.send_signal(signal.SIGUSR1)
            for _ in range(20):
                time.sleep(0.1)
                if self.log(1 << 30).count("most recent call first") > before:
                    break
            else:
                if self.proc.poll() is None:
                    self.proc.send_signal(signal.SIGUSR2)
            time.sleep(0.5)
        return self.log(20000)

    def chat(self, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
        body = {"messages": messages, "temperature": 0, "max_tokens": 16,
                "logprobs": True, "top_logprobs": 1, **extra}
        return self.post("/v1/chat/completions", body)

    def stats(self) -> dict[str, Any]:
        return self.get("/v1/cache/stats")

    def wait_flushed(self, timeout: float = 120.0) -> dict[str, Any]:
        """Poll the stats until the writer has nothing queued or running (``pending_writes``,
        the write-behind queue's unfinished jobs, is 0) and something was written; the stats
        of that moment. A stats read settles the memory tier first, waiting for an insert
        another thread has begun (a response's, which mlx_lm.server makes just after the
        response ends), so that insert's write is counted in ``pending_writes`` by then.
        ``timeout`` bounds the whole wait (a hang), not how fast the disk is."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.get("pending_writes") == 0 and s.get("writes", 0) >= 1:
                return s
            if time.monotonic() >= deadline:
                raise AssertionError(f"write-behind did not flush within {timeout}s: {s}")
            time.sleep(0.05)


def reply(resp: dict[str, Any]) -> tuple[str, list[int]]:
    """(text, generated token ids) of a chat completion."""
    choice = resp["choices"][0]
    ids = [t["id"] for t in (choice.get("logprobs") or {}).get("content", [])]
    return choice["message"]["content"], ids


def cached_tokens(resp: dict[str, Any]) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]
