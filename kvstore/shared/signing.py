"""Signed shared values: a fleet secret makes the shared tier unforgeable by its other writers.

Keys and checksums are not signatures: anyone who can write the Redis can store a
well-formed value under any name. With a fleet secret (``SharedConfig.secret``: at least
16 bytes, from ``--shared-secret-file`` or ``$KVSTORE_SHARED_SECRET[_FILE]``), every chunk
and entry value kvstore publishes ends with ``TAG_BYTES`` of HMAC-SHA256 over its Redis
name (prefix, kind, key, identity) and its bytes; a reader verifies the tag before parsing
anything and rejects a value without a valid one (counted as ``bad_signature``, deleted,
a miss). So a value copied under another prompt's name, or built by a process without
the secret, never reaches a cache; such a process can still delete values (a miss).

Guarantees: the tag covers the whole value and its name; it is compared in constant time
(``hmac.compare_digest``); the secret is never logged nor sent. Without a secret nothing
here runs and values are as before (a reader with a secret rejects them; one without
rejects signed values: a fleet changes its secret, or adopts one, all at once).
"""

from __future__ import annotations

import hmac
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

from .bulk import Bulk
from .values import ValueFormatError

TAG_BYTES = 32
_DOMAIN = b"kvstore/shared-value/v1\0"


class BadSignature(ValueFormatError):
    """A shared value without a valid tag under this fleet's secret."""


def tag(secret: bytes, name: str, parts: Iterable[bytes | memoryview]) -> bytes:
    """The tag of a value (its ``parts`` concatenated) stored under ``name``."""
    mac = hmac.new(secret, _DOMAIN + name.encode() + b"\0", "sha256")
    for p in parts:
        mac.update(p)
    return mac.digest()


def seal(secret: bytes | None, name: str, parts: list[bytes]) -> list[bytes]:
    """``parts`` of a value to store under ``name``, its tag appended (as is without a secret)."""
    return parts if secret is None else [*parts, tag(secret, name, parts)]


def unseal(secret: bytes, name: str, data: bytes | memoryview) -> memoryview:
    """The value ``data`` holds under ``name`` without its tag, once the tag checks out;
    BadSignature otherwise (a view of ``data``: nothing is copied)."""
    view = memoryview(data)
    if len(view) < TAG_BYTES:
        raise BadSignature(f"value of {len(view)} bytes carries no signature")
    body, got = view[:-TAG_BYTES], view[-TAG_BYTES:]
    if not hmac.compare_digest(tag(secret, name, [body]), bytes(got)):
        raise BadSignature("value is not signed with this fleet's secret (forged, copied or unsigned)")
    return body


@dataclass
class Checked(Bulk):
    """A value read whose tag was checked: ``data`` without its tag, or (``error`` set) the
    value as read. No arrival digest: the segment is hashed again when parsed."""

    error: BadSignature | None = None


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)),
                                       thread_name_prefix="kvstore-verify")
        return _POOL


def unseal_all(secret: bytes, names: Sequence[str], values: Sequence[Bulk | None]) -> list[Bulk | None]:
    """Every value read (``None`` and empty ones, i.e. missing, as they are) as ``Checked``,
    its tag verified under its name; the tags of several values are checked in parallel
    (HMAC releases the GIL), which is what a restore of many chunks waits for."""
    def one(name: str, v: Bulk) -> Checked:
        try:
            return Checked(unseal(secret, name, v.data))
        except BadSignature as e:
            return Checked(v.data, error=e)

    todo = [(i, n, v) for i, (n, v) in enumerate(zip(names, values)) if v is not None and len(v.data)]
    out: list[Bulk | None] = list(values)
    if len(todo) == 1:
        i, n, v = todo[0]
        out[i] = one(n, v)
    elif todo:
        for (i, _n, _v), got in zip(todo, _pool().map(lambda t: one(t[1], t[2]), todo)):
            out[i] = got
    return out
