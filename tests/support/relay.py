"""A real throttling TCP relay on 127.0.0.1, for putting a slow or stalling link in front
of a real redis-server.

``Relay(target_port, rate=10e6).start()`` listens on a free port (``relay.port``) and
forwards every accepted connection to ``127.0.0.1:target_port``, both ways, at about
``rate`` bytes per second per direction, shared by all its connections as a link's
bandwidth is (``rate=None``: as fast as it goes; ``only="down"``: only the replies are paced,
a server that drips its answers). ``stall()`` stops forwarding (connections stay open, nothing moves: a path that
drops every packet) until ``resume()``; ``rate`` may be changed at any time. Threads in
the calling process (one per direction and connection), or a process of its own::

    python -m tests.support.relay TARGET_PORT RATE   # prints the port it listens on
"""

from __future__ import annotations

import socket
import sys
import threading
import time

HOST = "127.0.0.1"
PIECE = 64 << 10


class Relay:
    """Forward 127.0.0.1:port -> 127.0.0.1:target_port at ``rate`` bytes/s (see module)."""

    def __init__(self, target_port: int, rate: float | None = None, target_host: str = HOST,
                 only: str | None = None) -> None:
        if only not in (None, "up", "down"):
            raise ValueError("only must be None, 'up' or 'down'")
        self.target = (target_host, target_port)
        self.rate = rate
        self.only = only
        self.port = 0
        self.moved = 0  # bytes forwarded, both directions
        self._open = threading.Event()
        self._open.set()
        self._closed = False
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._due = {"up": 0.0, "down": 0.0}  # per direction: when the link is free again

    def start(self) -> Relay:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((HOST, 0))
        ls.listen(64)
        self._listener, self.port = ls, ls.getsockname()[1]
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def stall(self) -> None:
        """Stop moving bytes; connections stay open."""
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def close(self) -> None:
        """Stop listening and cut every connection."""
        self._closed = True
        self._open.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _shut(s)

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(self.target, timeout=5)
            except OSError:
                if self._closed:
                    return
                continue
            up.settimeout(None)
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks.update((down, up))
            for src, dst, way in ((down, up, "up"), (up, down, "down")):
                threading.Thread(target=self._pump, args=(src, dst, way), name="relay-pump", daemon=True).start()

    def _wait_turn(self, way: str, n: int, rate: float) -> None:
        """Book ``n`` bytes on direction ``way`` of the link and sleep until they are sent."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._due[way])
            self._due[way] = start + n / rate
        if self._due[way] > now:
            time.sleep(max(0.0, start + n / rate - now))

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        """Copy src -> dst, paced: each piece waits for its turn on the shared link."""
        try:
            while True:
                self._open.wait()
                rate = self.rate if self.only in (None, way) else None
                data = src.recv(PIECE if rate is None else max(1, min(PIECE, int(rate / 100))))
                if not data:
                    break
                self._open.wait()
                if self._closed:
                    break
                if rate is not None:
                    self._wait_turn(way, len(data), rate)
                dst.sendall(data)
                self.moved += len(data)
        except OSError:
            pass
        finally:
            _shut(src)
            _shut(dst)


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


if __name__ == "__main__":
    relay = Relay(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else None).start()
    print(relay.port, flush=True)
    threading.Event().wait()
