"""The JSON-lines worker processes: the parent's handles on them (their loop: ``serve.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from .common import ROOT, Emit
from .synth import Zoo


Op = Callable[[Zoo, dict, Emit], dict]
ROLE_MODELS = {"crash": ("llama", "gemma", "qwen"), "check": ("llama", "gemma", "qwen"), "perm": (),
               "conc": ("llama",), "misc": ("llama", "gemma"), "cli": (), "shared": ()}


class WorkerDied(Exception):
    """A worker process ended (or stopped reading) before answering; carries its exit code and log tail."""
    def __init__(self, worker: "Worker") -> None:
        self.returncode = worker.p.poll()
        self.stderr_tail = worker.stderr_tail()
        super().__init__(f"{worker.role} worker died (returncode {self.returncode}): {self.stderr_tail[-600:]}")


def _drop_to_nobody() -> None:
    """preexec_fn: run the worker as nobody (where setpriv is missing)."""
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


class Worker:
    """A worker process speaking JSON lines (see ``serve.worker_main``)."""

    _count = 0

    def __init__(self, role: str, logdir: Path, *, nobody: bool = False) -> None:
        Worker._count += 1
        self.role = role
        self.log_path = Path(logdir) / f"{role}-{Worker._count}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"  # a worker killed by SIGSEGV/SIGBUS/SIGABRT prints where
        if nobody:
            env["HOME"] = "/tmp"
        self._err = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "tools.harness.faults", "--worker", role]  # tools/ found through PYTHONPATH
        preexec = None
        if nobody:  # setpriv execs the interpreter even where nobody cannot search its path
            if shutil.which("setpriv"):
                cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + cmd
            else:
                preexec = _drop_to_nobody
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, cwd="/",
                                  env=env, preexec_fn=preexec, start_new_session=True)
        self.q: queue.Queue = queue.Queue()
        self.ready = False
        self.killed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.q.put(json.loads(line))
            except ValueError:
                self.q.put({"ev": "garbage", "line": line[:200].decode(errors="replace")})
        self.q.put(None)

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode(errors="replace")

    def next(self, timeout: float) -> dict | None:
        """The next event (None at EOF); raises queue.Empty on timeout."""
        return self.q.get(timeout=max(0.0, timeout))

    def _wait_for(self, kind: str, timeout: float) -> dict | None:
        """The next event of ``kind`` (the events before it are dropped); None if the
        worker's output ends first. Raises queue.Empty after ``timeout`` seconds."""
        end = time.time() + timeout
        while True:
            ev = self.next(end - time.time())
            if ev is None or ev.get("ev") == kind:
                return ev

    def wait_ready(self, timeout: float = 600) -> None:
        """Wait until the worker has loaded its models; WorkerDied if it dies first."""
        if self.ready:
            return
        if self._wait_for("ready", timeout) is None:
            raise WorkerDied(self)
        self.ready = True

    def send(self, msg: dict) -> None:
        try:
            assert self.p.stdin is not None
            self.p.stdin.write((json.dumps(msg) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(self) from None

    def wait_result(self, timeout: float) -> dict | None:
        """The result of the command sent last; None if the worker's output ends first.
        Raises queue.Empty after ``timeout`` seconds."""
        ev = self._wait_for("result", timeout)
        return None if ev is None else ev["result"]

    def call(self, msg: dict, timeout: float = 900) -> dict:
        """Send a command and wait for its result; a worker that takes longer than
        ``timeout`` is killed (TimeoutError), one that dies raises WorkerDied."""
        self.wait_ready()
        self.send(msg)
        try:
            res = self.wait_result(timeout)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"{self.role} worker: {msg.get('op')} took longer than {timeout}s") from None
        if res is None:
            self.p.wait()
            raise WorkerDied(self)
        return res

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def close(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(WorkerDied):
                self.send({"op": "exit"})
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._err.close()


class Checker:
    """The checker process, respawned when a fault kills it (counted as a crash)."""

    def __init__(self, logdir: Path, role: str = "check") -> None:
        self.logdir, self.role = logdir, role
        self.w = Worker(role, logdir)

    def call(self, msg: dict, timeout: float = 900) -> dict:
        try:
            return self.w.call(msg, timeout)
        except (WorkerDied, TimeoutError) as e:
            rc = self.w.p.poll()
            tail = self.w.stderr_tail(1500)
            self.w.close()
            self.w = Worker(self.role, self.logdir)
            return {"crashed": True, "returncode": rc, "signal": signame(rc), "error": str(e)[:300],
                    "stderr": tail[-1200:], "hang": isinstance(e, TimeoutError)}

    def close(self) -> None:
        self.w.close()


def signame(rc: int | None) -> str | None:
    """The signal that ended a process (its negative return code), by name."""
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return str(rc)


class Pool:
    """Pre-started single-use workers (mlx import and model load overlap the current trial)."""

    def __init__(self, role: str, logdir: Path, spare: int = 1) -> None:
        self.role, self.logdir, self.spare = role, logdir, spare
        self.ws: list[Worker] = []

    def take(self) -> Worker:
        while len(self.ws) < 1 + self.spare:
            self.ws.append(Worker(self.role, self.logdir))
        w = self.ws.pop(0)
        self.ws.append(Worker(self.role, self.logdir))
        w.wait_ready()
        return w

    def close(self) -> None:
        for w in self.ws:
            w.kill()
            w._err.close()
