"""The shared tier's Redis client: redis-py behind timeouts, a circuit breaker and counters.

``SharedClient`` talks to one Redis / Valkey server (``redis.Redis``) or a Redis Cluster
(``redis.cluster.RedisCluster``). It knows nothing about kvstore's storage format: it moves
bytes under keys built by ``key()``.

Guarantees:

* Bounded time per call. Every socket operation has ``connect_timeout`` /
  ``command_timeout`` and redis-py's own retries are off, so a call to a dead or stopped
  server returns after about ``connect_timeout + command_timeout`` per node it touches.
  Those bound each read, not a call (a slow path that sends a few bytes per timeout keeps
  a large reply going): every call is also bounded in wall time, by its ``until`` (a
  ``time.monotonic()`` deadline; a call given none gets ``default_deadline``), by cutting
  every socket of this client when it passes (``deadline.watch``, ``wire``: the call
  fails as ``errors_deadline``, the next call connects afresh). That covers everything
  redis-py does on the call's behalf: building the client, cluster topology discovery
  (``CLUSTER SLOTS``, ``COMMAND``, again after a node failed), connection handshakes and
  reconnects (no connection is opened once the deadline passed). Cluster pipelines are
  sent per node here, never replayed command by command.
* Never raises for server failures, and nothing redis-py raises escapes. Connection
  errors, timeouts, failed authentication, cluster errors, error replies and any other
  exception raised inside redis-py (``errors_client``: a client that failed is rebuilt)
  are caught, counted in ``stats()``, seen by the breaker and returned as ``None``
  (reads, "unavailable") or ``False`` (writes). ``ValueError`` is raised only for bad
  arguments; an exception raised by a callable given to ``run()`` itself (not inside
  redis-py) that is not a Redis error propagates unchanged.
* A breaker: after ``breaker_failures`` consecutive failures every call returns at once,
  with no I/O, for a backoff (``breaker_backoff`` doubling to ``breaker_backoff_max``);
  then one probe call goes out and its outcome closes or reopens the breaker.
* The user name and password never appear in log messages, ``stats()`` or ``repr()``.
* Thread-safe: redis-py's clients are, and the breaker and counters are locked.

``round_trips`` counts the requests this client sends (one per pipeline per node, one per
SCAN step); connection handshakes and cluster topology discovery are not counted (their
failures are: the call they were made for fails).
``bytes_in`` / ``bytes_out`` count value bytes read and written, not wire bytes.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (AskError, AuthenticationError, AuthorizationError, ClusterError,
                              RedisClusterException, RedisError, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .breaker import Breaker
from . import deadline
from .bulk import Bulk, Tally, read_strings, write_strings
from .config import SharedConfig
from .keys import key_slot, make_key
from .wire import Wire
from ..escape import logger

__all__ = ["SharedClient", "SharedConfig", "ERROR_KINDS", "READ_COMMANDS"]

log = logger("kvstore.shared")

T = TypeVar("T")
Value = bytes | str | int | float
Items = Mapping[str, Value] | Iterable[tuple[str, Value]]
RedisClient = redis.Redis | RedisCluster
Op = tuple[str, Callable[[Pipeline], object]]  # (key, queue the command on a pipeline)

ERROR_KINDS = ("timeout", "deadline", "connection", "auth", "cluster", "client", "other")
_BREAKER_KINDS = frozenset({"timeout", "deadline", "connection", "auth", "cluster", "client"})
_CAUGHT = (RedisError, RedisClusterException, OSError)
_REDIRECTS = (AskError, TryAgainError)  # AskError covers MovedError
BULK_CONNECTIONS = 2  # connections per node reading values at once (hashing on one overlaps receiving on another)
_COUNTERS = ("calls", "round_trips", "skipped_calls", "bytes_in", "bytes_out", "node_failures",
             *(f"errors_{k}" for k in ERROR_KINDS))


class DeadlineExceeded(RedisTimeoutError):
    """A call cut off at its wall-time deadline (its connections were abandoned)."""


class _Unavailable:
    """The result of a call that failed or was skipped (never returned to callers)."""


_UNAVAILABLE = _Unavailable()


class _NodeDown:
    """The result of an op sent to a cluster node that did not answer (see ``_pipelined``)."""


NODE_DOWN = _NodeDown()


class SharedClient:
    """A fail-soft Redis client for the shared tier (see the module docstring)."""

    def __init__(self, config: SharedConfig | str, **overrides: Any) -> None:
        if isinstance(config, str):
            config = SharedConfig.from_url(config, **overrides)
        elif overrides:
            config = config.with_options(**overrides)
        self.config = config
        self._breaker = Breaker(config.breaker_failures, config.breaker_backoff,
                                config.breaker_backoff_max)
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._client: RedisClient | None = None
        self._secrets = tuple(s for s in (config.password, config.username) if s)
        self._next_refresh = 0.0  # a cluster node down: rediscover the topology at most this often
        self._wire = Wire()  # every socket of the redis-py clients built here: cut at a deadline
        self._warned = False

    @property
    def default_deadline(self) -> float:
        """Seconds a call given no ``until`` may take: ``publish_deadline`` (the longest any
        one job of the shared tier may take), or a few requests' timeouts if longer."""
        c = self.config
        return max(c.publish_deadline, 4 * (c.connect_timeout + c.command_timeout))

    def __repr__(self) -> str:
        return f"SharedClient({self.config.redacted()!r}, breaker={self._breaker.state})"

    def __enter__(self) -> SharedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys ------------------------------------------------------------------------

    def key(self, *parts: str | int, tag: str | None = None) -> str:
        """``prefix:{tag}:part:...``: keys with the same ``tag`` share a cluster slot."""
        return make_key(self.config.prefix, *parts, tag=tag)

    # -- reads -----------------------------------------------------------------------

    def pipeline_get(self, keys: Sequence[str], until: float | None = None) -> list[bytes | None] | None:
        """GET every key in one round trip (per cluster node). None = unavailable."""
        _check_keys(keys)
        if not keys:
            return []
        got = self._call("get", lambda c: self._pipelined(c, [(k, _get(k)) for k in keys]), until)
        if isinstance(got, _Unavailable):
            return None
        values = [None if self._item_error(r) else r for r in got]
        self._count("bytes_in", sum(len(v) for v in values if v is not None))
        return values

    def pipeline_hgetall(self, keys: Sequence[str]) -> list[dict[bytes, bytes]] | None:
        """HGETALL every key in one round trip (per node); a missing key gives ``{}``."""
        _check_keys(keys)
        if not keys:
            return []
        got = self._call("hgetall",
                         lambda c: self._pipelined(c, [(k, _hgetall(k)) for k in keys]))
        if isinstance(got, _Unavailable):
            return None
        hashes = [{} if self._item_error(r) else r for r in got]
        self._count("bytes_in", sum(len(v) for h in hashes for v in h.values()))
        return hashes

    def pipeline_read(self, commands: Sequence[tuple[Any, ...]], until: float | None = None) -> list[Any] | None:
        """Mixed read commands in one round trip (per cluster node), replies in order.

        Each command is ``(name, key, *args)`` with ``name`` one of ``READ_COMMANDS``
        (``("GETRANGE", k, 0, 1023)``, ``("STRLEN", k)``, ``("HGETALL", k)``...). An error
        reply to one command gives None in its place (counted); None for the whole call
        means unavailable.
        """
        ops: list[Op] = []
        for cmd in commands:
            if not (isinstance(cmd, tuple) and len(cmd) >= 2 and cmd[0] in READ_COMMANDS):
                raise ValueError(f"commands must be (name, key, *args) with name in "
                                 f"{sorted(READ_COMMANDS)}, got {cmd!r}")
            _check_keys([cmd[1]])
            ops.append((cmd[1], _command(*cmd)))
        if not ops:
            return []
        got = self._call("read", lambda c: self._pipelined(c, ops), until)
        if isinstance(got, _Unavailable):
            return None
        replies = [None if self._item_error(r) else r for r in got]
        self._count("bytes_in", sum(_reply_size(r) for r in replies))
        return replies

    def read_values(self, names: Sequence[str], limit: int, until: float | None = None,
                    hash_from: Callable[[memoryview], int | None] | None = None,
                    tally: Tally | None = None) -> list[Bulk | None] | None:
        """The first ``limit`` bytes of each string, pipelined per cluster node on up to
        ``BULK_CONNECTIONS`` connections at once (the values split between them in order),
        read off the socket once and hashed as they arrive (``bulk.read_strings``); a missing
        key gives an empty value, an error reply or a node that failed gives None. None
        for the whole call means unavailable; ``tally`` counts the bytes received even then."""
        _check_keys(names)
        if limit < 1:
            raise ValueError("limit must be >= 1")
        if not names:
            return []

        def one(node: redis.Redis, idx: list[int], results: list[Any]) -> None:
            self._count("round_trips")  # the connections run at once: one round trip of latency

            def part(ids: list[int]) -> None:
                got = read_strings(node.connection_pool, [names[i] for i in ids], limit, until,
                                   self.config.command_timeout, hash_from, tally)
                for i, v in zip(ids, got):
                    results[i] = v

            _at_once(part, _split(idx, BULK_CONNECTIONS))

        got = self._call("bulk", lambda c: self._per_node(c, list(names), one), until)
        if isinstance(got, _Unavailable):
            return None
        values = [None if self._item_error(v) else v for v in got]
        self._count("bytes_in", sum(len(v.data) for v in values if v is not None))
        return values

    def scan_iter(self, match: str, count: int = 1000) -> Iterator[str]:
        """Keys matching ``match`` (which must start with ``prefix:``), on every primary.

        Each SCAN step is one guarded call; on a failure the iteration just ends (counted).
        """
        if not isinstance(match, str) or not match.startswith(self.config.prefix + ":"):
            raise ValueError(f"scan pattern must start with {self.config.prefix + ':'!r}")
        if count < 1:
            raise ValueError("count must be >= 1")
        return self._scan(match, count)

    # -- writes ----------------------------------------------------------------------

    def set_nx_many(self, items: Items, ttl: float | None = None,
                    until: float | None = None) -> list[bool] | None:
        """SET NX each item (one round trip per node): True where this call wrote the key.

        ``ttl`` in seconds; None uses the config's ttl (None there: no expiry).
        """
        pairs = _pairs(items)
        if not pairs:
            return []
        px = self._ttl_ms(ttl)
        ops = [(k, _set(k, v, px, nx=True)) for k, v in pairs]
        got = self._call("set_nx", lambda c: self._pipelined(c, ops), until)
        if isinstance(got, _Unavailable):
            return None
        written = [not self._item_error(r) and bool(r) for r in got]
        self._count("bytes_out", sum(_size(v) for (_, v), w in zip(pairs, written) if w))
        return written

    def write_values(self, items: Sequence[tuple[str, list[bytes]]], nx: bool = False, ttl: float | None = None,
                     until: float | None = None) -> list[bool] | None:
        """SET (``nx``: NX) each value, given as its pieces in order and sent without
        joining them (``bulk.write_strings``), one pipeline per node: True where written.
        ``ttl`` as in ``set_many``. None = unavailable."""
        names = [n for n, _ in items]
        _check_keys(names)
        if not items:
            return []
        px = self._ttl_ms(ttl)

        def one(node: redis.Redis, idx: list[int], results: list[Any]) -> None:
            self._count("round_trips")
            got = write_strings(node.connection_pool, [items[i] for i in idx], nx, px, until,
                                self.config.command_timeout)
            for i, v in zip(idx, got):
                results[i] = v

        got = self._call("write", lambda c: self._per_node(c, names, one), until)
        if isinstance(got, _Unavailable):
            return None
        written = [r is True for r in got]
        self._count("errors_other", sum(r is None for r in got))  # error replies (OOM, NOPERM...)
        self._count("bytes_out", sum(sum(len(p) for p in parts) for (_, parts), w in zip(items, written) if w))
        return written

    def set_many(self, items: Items, ttl: float | None = None, atomic: bool = False,
                 until: float | None = None) -> bool:
        """SET each item; True if every one was written.

        ``atomic=True`` wraps them in MULTI/EXEC and needs every key in one hash slot (give
        them the same ``tag``), checked here in single-server mode too.
        """
        pairs = _pairs(items)
        if not pairs:
            return True
        if atomic:
            _check_one_slot([k for k, _ in pairs])
        px = self._ttl_ms(ttl)
        ops = [(k, _set(k, v, px)) for k, v in pairs]
        got = self._call("set", lambda c: self._pipelined(c, ops, atomic=atomic), until)
        if isinstance(got, _Unavailable):
            return False
        ok = all([not self._item_error(r) and bool(r) for r in got])  # count every error
        if ok:
            self._count("bytes_out", sum(_size(v) for _, v in pairs))
        return ok

    def hset(self, key: str, mapping: Mapping[str, Value], ttl: float | None = None) -> bool:
        """HSET the fields (and PEXPIRE, in the same MULTI/EXEC, when a ttl applies)."""
        return self.hset_many({key: mapping}, ttl)

    def hset_many(self, hashes: Mapping[str, Mapping[str, Value]], ttl: float | None = None,
                  until: float | None = None) -> bool:
        """HSET fields into several hashes in one round trip per node (each hash followed
        by its PEXPIRE when a ttl applies); True if every command succeeded.

        With a ttl, the whole call is one MULTI/EXEC when the hashes share a slot (one hash,
        or any number on one server); across cluster slots each PEXPIRE follows its HSET in
        the node's pipeline, not atomically (a lost connection may leave a hash's previous
        expiry)."""
        keys = list(hashes)
        _check_keys(keys)
        data: dict[str, dict[Any, Value]] = {k: dict(_pairs(hashes[k])) for k in keys}  # redis-py types field names as any encodable
        if not keys or not all(data.values()):
            raise ValueError("hset needs at least one field per hash")
        px = self._ttl_ms(ttl)
        atomic = px is not None and (not self.config.cluster or len({key_slot(k) for k in keys}) == 1)

        def queue(key: str) -> Callable[[Pipeline], object]:
            def put(p: Pipeline) -> object:
                p.hset(key, mapping=data[key])
                return p.pexpire(key, px) if px is not None else None
            return put

        got = self._call("hset", lambda c: self._pipelined(c, [(k, queue(k)) for k in keys], atomic=atomic),
                         until)
        if isinstance(got, _Unavailable):
            return False
        ok = not any([self._item_error(r) for r in got])
        if ok:
            self._count("bytes_out", sum(_size(v) for m in data.values() for v in m.values()))
        return ok

    def delete_many(self, keys: Sequence[str]) -> int | None:
        """UNLINK the keys (one round trip per node); the number removed, None = unavailable."""
        _check_keys(keys)
        if not keys:
            return 0
        got = self._call("delete",
                         lambda c: self._pipelined(c, [(k, _unlink(k)) for k in keys]))
        if isinstance(got, _Unavailable):
            return None
        return sum(int(r) for r in got if not self._item_error(r))

    # -- generic ---------------------------------------------------------------------

    def run(self, fn: Callable[[RedisClient], T], round_trips: int = 1,
            until: float | None = None) -> T | None:
        """``fn(redis_client)`` behind the breaker and counters; None if unavailable.

        ``fn`` gets a ``redis.Redis`` or a ``RedisCluster`` configured with this client's
        timeouts and no retries. Redis errors and whatever redis-py raises are caught and
        counted; any other exception ``fn`` raises itself propagates. (A RedisCluster may
        refresh its topology inside ``fn``: within the call's deadline like the rest.)
        """
        if round_trips < 0:
            raise ValueError("round_trips must be >= 0")

        def call(client: RedisClient) -> T:
            self._count("round_trips", round_trips)
            return fn(client)

        got = self._call("run", call, until)
        return None if isinstance(got, _Unavailable) else got

    def ping(self) -> bool:
        """True if the server (every cluster primary) answered PING."""
        return bool(self.run(lambda c: c.ping()))

    # -- state -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters (ints), errors by kind, breaker state; the server address is redacted."""
        with self._lock:
            s: dict[str, Any] = dict(self._counters)
        s["errors"] = sum(s[f"errors_{k}"] for k in ERROR_KINDS)
        s["breaker_state"] = self._breaker.state
        s["breaker_opens"] = self._breaker.opens
        s["breaker_retry_in"] = round(self._breaker.retry_in(), 3)
        s["server"] = self.config.redacted()
        return s

    @property
    def breaker_state(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        return self._breaker.state

    def close(self) -> None:
        """Drop the connections (a later call reconnects); a call in flight fails at once
        (its sockets are cut first)."""
        with self._lock:
            client, self._client = self._client, None
        self._wire.cut()
        if client is not None:
            _close_quietly(client)

    # -- internals -------------------------------------------------------------------

    def _call(self, op: str, fn: Callable[[RedisClient], T], until: float | None = None) -> T | _Unavailable:
        """Run ``fn`` with the breaker and counters, cut off at ``until`` (monotonic; None:
        ``default_deadline`` from now); ``_UNAVAILABLE`` if skipped, failed or late. The
        redis-py client is built (a cluster's topology discovered) inside the call's guard
        and deadline, like everything else redis-py does for it."""
        now = time.monotonic()
        until = now + self.default_deadline if until is None else until
        if until <= now:
            self._count("errors_deadline")  # no time left: no I/O, not the server's fault
            return _UNAVAILABLE
        if not self._breaker.allow():
            self._count("skipped_calls")
            return _UNAVAILABLE
        self._count("calls")
        watch = deadline.watch(until, self._wire.cut)
        try:
            with deadline.bound(until):
                result = fn(self._redis())
        except Exception as e:
            if not isinstance(e, _CAUGHT) and not _raised_in_redis(e):
                self._breaker.abandon()  # the caller's own bug (a callable given to run())
                raise
            late = watch.fired or time.monotonic() >= until - 0.01
            self._failed(op, DeadlineExceeded(f"{op} passed its deadline") if late else e)
            return _UNAVAILABLE
        except BaseException:
            self._breaker.abandon()
            raise
        finally:
            watch.cancel()
        if self._breaker.success():
            log.info("shared tier %s answers again", self.config.redacted())
        return result

    def _redis(self) -> RedisClient:
        """The redis-py client, built on first use (a RedisCluster discovers its nodes)."""
        with self._lock:
            client = self._client
        if client is None:
            client = _build(self.config, self._wire)
            with self._lock:
                if self._client is None:
                    self._client = client
                else:  # another thread built one first
                    _close_quietly(client)
                    client = self._client
        return client

    def _pipelined(self, client: RedisClient, ops: list[Op], atomic: bool = False) -> list[Any]:
        """Queue ``ops`` on one pipeline per node, send each once; results in ``ops`` order.

        A cluster node that cannot be reached (down, killed, late) costs only its own ops:
        they get ``NODE_DOWN`` (an item error, counted once per node) and the live nodes'
        answers are used, so a cluster degrades instead of going dark; the topology is
        rediscovered (at most every ``breaker_backoff`` s) in case a replica took over.
        When every node fails, the call fails. A cluster redirect or CLUSTERDOWN in any
        result fails the whole call.
        """
        return self._per_node(client, [k for k, _ in ops],
                              lambda node, idx, res: self._node_pipeline(node, ops, idx, atomic, res))

    def _per_node(self, client: RedisClient, keys: list[str],
                  send: Callable[[redis.Redis, list[int], list[Any]], None]) -> list[Any]:
        """``send(node client, indexes, results)`` for the keys of each node (the whole
        list on one server), every node on a thread of its own at once; a node that fails
        alone gives ``NODE_DOWN`` for its keys."""
        if isinstance(client, RedisCluster):
            groups: dict[str, tuple[redis.Redis, list[int]]] = {}
            for i, key in enumerate(keys):
                node = client.get_node_from_key(key)
                if node.name not in groups:
                    groups[node.name] = (client.get_redis_connection(node), [])
                groups[node.name][1].append(i)
        else:
            groups = {"": (client, list(range(len(keys))))}
        results: list[Any] = [None] * len(keys)
        nodes = list(groups.values())
        failed: list[BaseException | None] = [None] * len(nodes)

        def one(part: list[int]) -> None:
            node_client, indexes = nodes[part[0]]
            try:
                send(node_client, indexes, results)
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                failed[part[0]] = e

        _at_once(one, [[k] for k in range(len(nodes))])  # the nodes at once: one round trip of latency
        down = [e for e in failed if e is not None]
        if down:
            if len(down) == len(nodes):
                raise down[0]
            for (_, indexes), e in zip(nodes, failed):
                for i in indexes if e is not None else ():
                    results[i] = NODE_DOWN
            self._node_down(down[0])
        return results

    def _node_pipeline(self, node_client: redis.Redis, ops: list[Op], indexes: list[int], atomic: bool,
                       results: list[Any]) -> None:
        """One node's pipeline of ``ops[indexes]``, its replies put in ``results``."""
        pipe = node_client.pipeline(transaction=atomic)
        spans = []
        for i in indexes:
            before = len(pipe)
            ops[i][1](pipe)
            spans.append((i, before, len(pipe)))
        self._count("round_trips")
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, (ClusterError, *_REDIRECTS)):
                raise reply
        for i, start, end in spans:  # an op may queue several commands: keep the first
            results[i] = replies[start] if end - start == 1 else replies[start:end]

    def _node_down(self, error: BaseException) -> None:
        """Some cluster nodes answered, one did not: counted, the topology refreshed soon."""
        kind = error_kind(error)
        self._count(f"errors_{kind}")
        self._count("node_failures")
        log.debug("shared: a cluster node failed (%s): %s", kind, self._scrub(f"{type(error).__name__}: {error}"))
        now = time.monotonic()
        with self._lock:
            if now >= self._next_refresh:
                self._next_refresh = now + self.config.breaker_backoff
                self._client = None

    def _scan(self, match: str, count: int) -> Iterator[str]:
        targets = self._call("scan", _scan_targets)
        if isinstance(targets, _Unavailable):
            return
        for node in targets:
            cursor = 0
            while True:
                def step(_: RedisClient, node: redis.Redis = node, cursor: int = cursor) -> Any:
                    self._count("round_trips")
                    return node.scan(cursor, match=match, count=count)

                got = self._call("scan", step)
                if isinstance(got, _Unavailable):
                    return
                cursor, keys = got
                for k in keys:
                    yield k.decode("utf-8", "backslashreplace") if isinstance(k, bytes) else k
                if cursor == 0:
                    break

    def _failed(self, op: str, error: BaseException) -> None:
        kind = error_kind(error)
        self._count(f"errors_{kind}")
        detail = self._scrub(f"{type(error).__name__}: {error}")
        if kind == "client" and not self._warned:  # redis-py failed in itself: say it once, in full
            self._warned = True
            log.warning("shared %s on %s: redis-py raised %s (counted as errors_client; the "
                        "client is rebuilt)", op, self.config.redacted(), detail,
                        exc_info=(type(error), error, error.__traceback__))
        else:
            log.debug("shared %s on %s failed (%s): %s", op, self.config.redacted(), kind, detail)
        if kind == "client" or (self.config.cluster and kind in ("timeout", "connection", "cluster")):
            with self._lock:  # rediscover the topology on the next call; calls in flight
                self._client = None  # keep the old client, closed when it is collected
        if kind not in _BREAKER_KINDS:
            self._breaker.success()  # the server answered, with an error
            return
        if self._breaker.failure():
            log.warning("shared tier %s unavailable (%s); not asking it for %.1f s",
                        self.config.redacted(), detail, self._breaker.retry_in())

    def _item_error(self, reply: Any) -> bool:
        """Count an error reply inside a pipeline (WRONGTYPE, OOM, NOPERM...); an op of a
        node that was down is an error already counted."""
        if reply is NODE_DOWN:
            return True
        if isinstance(reply, list):
            return any([self._item_error(r) for r in reply])
        if isinstance(reply, BaseException):
            self._count(f"errors_{error_kind(reply)}")
            log.debug("shared command failed: %s", self._scrub(f"{type(reply).__name__}: {reply}"))
            return True
        return False

    def _ttl_ms(self, ttl: float | None) -> int | None:
        ttl = self.config.ttl if ttl is None else ttl
        if ttl is None:
            return None
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not (
                math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        return max(1, round(ttl * 1000))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def error_kind(error: BaseException) -> str:
    """``timeout``, ``auth``, ``cluster``, ``connection`` or ``other`` (see ERROR_KINDS)."""
    if isinstance(error, DeadlineExceeded):
        return "deadline"
    if isinstance(error, (RedisTimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(error, (AuthenticationError, AuthorizationError)):
        return "auth"
    if isinstance(error, (ClusterError, RedisClusterException, *_REDIRECTS)):
        return "cluster"
    if isinstance(error, (RedisConnectionError, OSError)):
        return "connection"
    if not isinstance(error, RedisError):
        return "client"  # not a Redis error: redis-py itself failed (see _raised_in_redis)
    return "other"


_REDIS_DIR = os.path.dirname(redis.__file__) + os.sep


def _raised_in_redis(error: BaseException) -> bool:
    """Whether ``error`` was raised inside redis-py (its innermost frame is redis-py's)."""
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(_REDIS_DIR)


def client_kwargs(config: SharedConfig) -> dict[str, Any]:
    """redis-py connection arguments for ``config``: timeouts, credentials, TLS."""
    kw: dict[str, Any] = {
        "username": config.username,
        "password": config.password,
        "socket_connect_timeout": config.connect_timeout,
        "socket_timeout": config.command_timeout,
        "socket_keepalive": True,
    }
    if config.tls:
        kw["ssl"] = True
        kw["ssl_cert_reqs"] = "required"
        if config.tls_ca_file is not None:
            kw["ssl_ca_certs"] = config.tls_ca_file
    return kw


def _build(config: SharedConfig, wire: Wire) -> RedisClient:
    """A redis-py client with no retries of its own (the breaker decides when to retry),
    every socket of which ``wire`` tracks. A cluster's is built from a URL (redis-py then
    makes each node's pool with our connection class) and discovers the topology now."""
    kw = client_kwargs(config)
    kw["connection_class"] = wire.connection_class(bool(kw.pop("ssl", False)))
    if config.cluster:
        (host, port), *others = config.hosts
        return _Cluster(url=f"redis://{_url_host(host)}:{port}", retry=Retry(NoBackoff(), 0),
                        startup_nodes=[ClusterNode(h, p) for h, p in others],
                        require_full_coverage=False, **kw)
    pool = redis.ConnectionPool(host=config.host, port=config.port, db=config.db,
                                retry=Retry(NoBackoff(), 0), **kw)
    return redis.Redis.from_pool(pool)


class _Cluster(RedisCluster):
    """RedisCluster asking ``COMMAND`` (once, at construction) of each primary in turn until
    one answers: redis-py asks its default node (the first primary it discovered), so that
    primary dead failed the construction of every client, and with it every call."""

    def command(self, **kwargs: Any) -> Any:
        error: Exception = RedisClusterException("no cluster primary to ask COMMAND")
        for node in self.get_primaries():
            try:
                return self.execute_command("COMMAND", target_nodes=node, **kwargs)
            except (RedisConnectionError, RedisTimeoutError) as e:
                error = e
        raise error


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in at most ``parts`` contiguous, non-empty runs of near-equal length."""
    n = max(1, min(parts, len(items)))
    return [items[len(items) * i // n : len(items) * (i + 1) // n] for i in range(n)]


def _at_once(fn: Callable[[list[int]], None], parts: list[list[int]]) -> None:
    """``fn(part)`` for every part, the first on this thread and the others on threads of
    their own (working for the same call: ``deadline.bound``); returns when all ended,
    raising the first error."""
    errors: list[BaseException] = []
    until = deadline.current()

    def run(part: list[int]) -> None:
        try:
            fn(part)
        except BaseException as e:  # re-raised on the caller's thread below
            errors.append(e)

    def spawned(part: list[int]) -> None:
        with deadline.bound(until):
            run(part)

    threads = [threading.Thread(target=spawned, args=(p,), name="kvstore-shared-read", daemon=True)
               for p in parts[1:]]
    for t in threads:
        t.start()
    run(parts[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _scan_targets(client: RedisClient) -> list[redis.Redis]:
    if isinstance(client, RedisCluster):
        return [client.get_redis_connection(n) for n in client.get_primaries()]
    return [client]


def _close_quietly(client: RedisClient) -> None:
    try:
        client.close()
    except Exception:  # closing a broken connection must not fail the caller
        pass


def _get(key: str) -> Callable[[Pipeline], object]:
    return lambda p: p.get(key)


def _hgetall(key: str) -> Callable[[Pipeline], object]:
    return lambda p: p.hgetall(key)


def _unlink(key: str) -> Callable[[Pipeline], object]:
    return lambda p: p.unlink(key)


def _set(key: str, value: Value, px: int | None, nx: bool = False) -> Callable[[Pipeline], object]:
    return lambda p: p.set(key, value, px=px, nx=nx)


# read commands ``pipeline_read`` sends, as redis-py pipeline methods
READ_COMMANDS = frozenset({"GET", "GETRANGE", "STRLEN", "EXISTS", "HEXISTS", "HGETALL", "HKEYS", "HLEN"})


def _command(name: str, key: str, *args: Any) -> Callable[[Pipeline], object]:
    return lambda p: getattr(p, name.lower())(key, *args)


def _reply_size(reply: Any) -> int:
    if isinstance(reply, bytes):
        return len(reply)
    if isinstance(reply, dict):
        return sum(len(v) for v in reply.values() if isinstance(v, bytes))
    return 0


def _check_keys(keys: Sequence[str]) -> None:
    if isinstance(keys, (str, bytes)):
        raise ValueError("keys must be a sequence of strings, not one string")
    for k in keys:
        if not isinstance(k, str) or not k:
            raise ValueError(f"keys must be non-empty strings, got {k!r}")


def _pairs(items: Items) -> list[tuple[str, Value]]:
    pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise ValueError(f"items must be (key, value) pairs, got {type(pair).__name__}")
        key, value = pair
        if not isinstance(key, str) or not key:
            raise ValueError(f"keys must be non-empty strings, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (bytes, str, int, float)):
            raise ValueError(f"values must be bytes, str, int or float, "
                             f"got {type(value).__name__} for {key!r}")
    return pairs


def _size(value: Value) -> int:
    return len(value) if isinstance(value, (bytes, str)) else len(str(value))


def _check_one_slot(keys: list[str]) -> None:
    if len({key_slot(k) for k in keys}) > 1:
        raise ValueError("atomic writes need all keys in one hash slot: build them with the "
                         "same tag (SharedClient.key(..., tag=...))")
