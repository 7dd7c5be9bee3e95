"""Every socket a SharedClient's redis-py clients open: tracked, cut at a deadline, never
connected past one.

redis-py opens sockets on its own: the connections of each node's pool, those of cluster
topology discovery (``CLUSTER SLOTS`` to the startup nodes, ``COMMAND`` at construction,
again after any connection error), and a reconnect whenever a pooled connection turns out
broken. ``Wire.connection_class(tls)`` is a redis-py connection class that registers each
socket it opens with its ``Wire``, so that ``Wire.cut()`` (run by the deadline watchdog)
shuts down every one of them at once, whichever redis-py object opened it: a reader
blocked on one wakes with an error, on its own thread (which then closes it; an idle one
is found broken by its pool and reopened on the next call).

A connection opened on a thread running a call with a deadline (``deadline.bound``) waits
for the TCP connect at most until that deadline, and none is opened once it has passed
(``socket.timeout``, which redis-py reports as its ``TimeoutError``): what a cut call's
redis-py does next (discovering the topology again, reconnecting) exchanges no byte.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from typing import Any

from redis.connection import Connection, SSLConnection

from . import deadline

__all__ = ["Wire"]


class Wire:
    """The live sockets of one SharedClient (weakly held: a closed one is forgotten)."""

    def __init__(self) -> None:
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._classes: dict[bool, type[Connection]] = {}
        self.cuts = 0

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)

    def cut(self) -> None:
        """Shut down every live socket (both directions); never blocks, never raises."""
        with self._lock:
            socks = list(self._socks)
            self.cuts += 1
        for s in socks:
            _shut(s)

    def connection_class(self, tls: bool) -> type[Connection]:
        """A redis-py connection class (plain TCP or TLS) whose sockets this wire tracks
        (one per kind and wire: the clients rebuilt after a failure share it)."""
        if tls not in self._classes:
            self._classes[tls] = self._make(tls)
        return self._classes[tls]

    def _make(self, tls: bool) -> type[Connection]:
        wire = self
        base: type[Connection] = SSLConnection if tls else Connection

        class Tracked(base):  # type: ignore[valid-type,misc]
            def _connect(self) -> Any:
                until = deadline.current()
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    raise socket.timeout("the call's deadline passed: no new connection")
                saved = getattr(self, "socket_connect_timeout")
                if left is not None:
                    setattr(self, "socket_connect_timeout", left if saved is None else min(saved, left))
                try:
                    sock = super()._connect()
                finally:
                    setattr(self, "socket_connect_timeout", saved)
                wire.add(sock)
                if until is not None and time.monotonic() >= until:  # a cut while connecting missed it
                    _shut(sock)
                    sock.close()
                    raise socket.timeout("the call's deadline passed while connecting")
                return sock

            def _wrap_socket_with_ssl(self, sock: socket.socket) -> Any:
                wire.add(sock)  # the TLS handshake is cut like any read
                return super()._wrap_socket_with_ssl(sock)

        Tracked.__name__ = Tracked.__qualname__ = f"Tracked{base.__name__}"
        return Tracked


def _shut(sock: socket.socket) -> None:
    try:  # socket.socket's own shutdown: on a TLS socket too, the fd itself
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except (OSError, ValueError):  # closed or never connected: nothing to cut
        pass
