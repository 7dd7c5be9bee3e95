"""Large Redis string replies read straight off the socket, hashed as they arrive.

redis-py (even with hiredis) copies a bulk reply twice before the caller sees it: from the
socket into the parser's buffer, then into a new ``bytes``. ``read_strings`` sends one
pipeline of ``GETRANGE key 0 limit-1`` on a connection of a redis-py pool (its handshake,
credentials and TLS are redis-py's) and reads the replies itself: each value lands once,
with ``recv_into``, in a buffer of exactly its announced length (``alloc.fresh_bytes``:
untouched pages, faulted in by the copy itself), and ``hash_from(head)`` may name, from
a value's first ``HEAD`` bytes, an offset from which the bytes are hashed (xxh3-128)
piece by piece as they arrive, while the server is still sending: the caller's checksum
costs no pass of its own.

Guarantees: a reply longer than ``limit`` is never read (the connection is dropped: the
server was asked for at most ``limit`` bytes, so it is not the reply we asked for); every
socket read waits at most ``min(timeout, until - now)`` (``until``: monotonic deadline),
so a slow or stalling server costs the call, not more; on any failure the connection is
closed, never returned to the pool with bytes in flight. Error replies give None in
their place. Raises redis-py's ConnectionError / TimeoutError (the client counts them).
"""

from __future__ import annotations

import ssl
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import xxhash
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..alloc import fresh_bytes

HEAD = 64           # bytes of a value ``hash_from`` sees
PIECE = 4 << 20     # bytes per recv_into


@dataclass
class Bulk:
    """One value: ``data`` (a memoryview of exactly its bytes) and, when ``hash_from``
    named an offset, ``digest`` (xxh3-128 of ``data[offset:]``)."""

    data: memoryview
    offset: int | None = None
    digest: bytes | None = None


class Tally:
    """Bytes received so far by the readers of one call (any threads), kept when the
    call fails: what a link delivered before its deadline measures the link."""

    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.n += n


class _Reader:
    def __init__(self, sock: Any, until: float | None, timeout: float, tally: Tally | None = None) -> None:
        self.sock, self.until, self.timeout = sock, until, timeout
        self.tally = tally or Tally()
        self.buf = bytearray()

    def _wait(self) -> None:
        left = self.timeout if self.until is None else min(self.timeout, self.until - time.monotonic())
        if left <= 0:
            raise RedisTimeoutError("bulk read passed its deadline")
        self.sock.settimeout(left)

    def _more(self) -> None:
        self._wait()
        try:
            got = self.sock.recv(65536)
        except TimeoutError:
            raise RedisTimeoutError("timeout reading a bulk reply") from None
        if not got:
            raise RedisConnectionError("connection closed while reading a bulk reply")
        self.tally.add(len(got))
        self.buf += got

    def line(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return out
            if len(self.buf) > 1 << 16:
                raise RedisConnectionError("reply line too long")
            self._more()

    def fill(self, view: memoryview, on_piece: Callable[[int, int], None]) -> None:
        """Fill ``view`` from the buffer, then straight from the socket; ``on_piece(a, b)``
        after bytes a..b landed."""
        pos = min(len(self.buf), len(view))
        view[:pos] = self.buf[:pos]
        del self.buf[:pos]
        if pos:
            on_piece(0, pos)
        while pos < len(view):
            self._wait()
            try:
                got = self.sock.recv_into(view[pos : pos + PIECE])
            except TimeoutError:
                raise RedisTimeoutError("timeout reading a bulk reply") from None
            if not got:
                raise RedisConnectionError("connection closed while reading a bulk reply")
            self.tally.add(got)
            on_piece(pos, pos + got)
            pos += got


def read_strings(pool: Any, names: list[str], limit: int, until: float | None, timeout: float,
                 hash_from: Callable[[memoryview], int | None] | None = None,
                 tally: Tally | None = None) -> list[Bulk | None]:
    """``GETRANGE name 0 limit-1`` of each name in one pipeline on one connection of
    ``pool`` (see the module docstring); None where the server answered an error. Every
    byte received is added to ``tally`` as it arrives."""
    with _connection(pool) as conn:
        conn.send_packed_command(conn.pack_commands([("GETRANGE", n, 0, limit - 1) for n in names]))
        r = _Reader(conn._sock, until, timeout, tally)
        return [_one(r, limit, hash_from) for _ in names]


@contextmanager
def _connection(pool: Any) -> Iterator[Any]:
    """A connection of ``pool``, returned to it after; closed first on any failure (it may
    have bytes in flight)."""
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _one(r: _Reader, limit: int, hash_from: Callable[[memoryview], int | None] | None) -> Bulk | None:
    head = r.line()
    if head[:1] == b"-":
        return None
    if head[:1] != b"$" or not head[1:].lstrip(b"-").isdigit():
        raise RedisConnectionError("unexpected reply to GETRANGE")
    n = int(head[1:])
    if n < 0:
        return Bulk(memoryview(b""))
    if n > limit:
        raise RedisConnectionError(f"a {n}-byte reply to a GETRANGE of at most {limit}")
    view = fresh_bytes(n)
    state: dict[str, Any] = {"offset": None, "h": None, "done": 0}

    def piece(a: int, b: int) -> None:
        if hash_from is not None and state["offset"] is None and b >= min(HEAD, n):
            off = hash_from(view[: min(HEAD, n)])
            state["offset"], state["h"] = (off, xxhash.xxh3_128()) if off is not None and off <= n else (-1, None)
            state["done"] = min(off, n) if off is not None and off >= 0 else 0
        h = state["h"]
        if h is not None and b > state["done"]:
            h.update(view[state["done"] : b])
            state["done"] = b

    r.fill(view, piece)
    crlf = memoryview(bytearray(2))
    r.fill(crlf, lambda a, b: None)
    if bytes(crlf) != b"\r\n":
        raise RedisConnectionError("bulk reply not terminated by CRLF")
    if state["h"] is None:
        return Bulk(view)
    return Bulk(view, state["offset"], state["h"].digest())


def write_strings(pool: Any, items: Sequence[tuple[str, Sequence[bytes | memoryview]]], nx: bool, px: int | None,
                  until: float | None, timeout: float) -> list[bool | None]:
    """``SET name value [NX] [PX px]`` of each item in one pipeline on one connection of
    ``pool``, each value given as its pieces in order and sent as they are (``sendmsg``:
    no joined copy of a many-MB value). Per item: True (written), False (NX: the key was
    there) or None (an error reply). Bounded like ``read_strings``."""
    opts = [b"NX"] if nx else []
    if px is not None:
        opts += [b"PX", str(int(px)).encode()]
    with _connection(pool) as conn:
        sock = conn._sock
        for name, parts in items:
            head = [b"SET", name.encode()]
            size = sum(len(p) for p in parts)
            cmd = b"*%d\r\n" % (3 + len(opts)) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in head) \
                + b"$%d\r\n" % size
            tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in opts)
            _send_all(sock, [cmd, *parts, tail], until, timeout)
        r = _Reader(sock, until, timeout)
        return [_set_reply(r.line()) for _ in items]


def _send_all(sock: Any, buffers: list[bytes | memoryview], until: float | None, timeout: float) -> None:
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS: one buffer at a time
        for v in views:
            _send_all(_Plain(sock), [v], until, timeout)
        return
    while views:
        left = timeout if until is None else min(timeout, until - time.monotonic())
        if left <= 0:
            raise RedisTimeoutError("bulk write passed its deadline")
        sock.settimeout(left)
        try:
            sent = sock.sendmsg(views[:64])
        except TimeoutError:
            raise RedisTimeoutError("timeout writing a bulk value") from None
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0], sent = views[0][sent:], 0


class _Plain:
    """A TLS socket seen through ``sendmsg`` of one buffer (``send``)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def settimeout(self, t: float) -> None:
        self.sock.settimeout(t)

    def sendmsg(self, views: list[memoryview]) -> int:
        return self.sock.send(views[0])


def _set_reply(line: bytes) -> bool | None:
    if line == b"+OK":
        return True
    if line in (b"$-1", b"_"):  # NX and the key exists (RESP2 nil, RESP3 null)
        return False
    if line[:1] == b"-":
        return None
    raise RedisConnectionError("unexpected reply to SET")
