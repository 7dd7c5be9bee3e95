"""Whose lookups a counter counts: the unsalted ones in the store's shared counters, each
salt's in its own.

Anyone who may read a server's ``/v1/cache/stats`` or ``/metrics`` can read them around
one request of another caller: a shared counter that moved by a tenant's lookup tells its
hit length (``tokens_memory``), where its prompt parted from the store (``miss_diverged``,
``miss_lost_tokens``) and so on, which a salt is there to hide. So a salted lookup (a
request's ``cache_salt``, an isolated key) is counted here, in the tally of its salt, never
in the shared counters, and only a caller presenting the same salt reads that tally
(``KVStore.stats(salt=)``). Salts are held as ``salt.salt_key`` digests; the tallies of
the ``keep`` salts least recently used are dropped (a tenant's counts then restart at 0).
MLX-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .counters import Counters
from .misses import Misses
from .salt import Salt, salt_key

# The counters a lookup moves (``KVStore.fetch``): these are a caller's own. The others
# (writes, evictions, errors, gauges) are the server's.
LOOKUP_KEYS = ("hits_memory", "hits_disk", "hits_shared", "misses", "tokens_saved", "tokens_memory",
               "tokens_disk", "tokens_shared", "bytes_read", "restore_seconds", "restores", "refused_cuts",
               "restores_one_pass")
KEEP = 4096  # tallies kept: salts are per tenant or per conversation, not per request


class Tally:
    """One caller's counts: its lookups' counters and its misses."""

    def __init__(self, counters: Counters | None = None, misses: Misses | None = None) -> None:
        self.counters = counters if counters is not None else Counters()
        self.misses = misses if misses is not None else Misses()

    def stats(self) -> dict[str, object]:
        """The ``LOOKUP_KEYS`` of ``counters``, the restore histogram, and ``misses.stats()``."""
        values = self.counters.snapshot()
        out: dict[str, object] = {k: values[k] for k in LOOKUP_KEYS}
        out["restore_seconds_histogram"] = self.counters.histograms()["restore_seconds_histogram"]
        out.update(self.misses.stats())
        return out


class Tallies:
    """A ``Tally`` per salt, thread-safe; ``of(None)`` is the shared one."""

    def __init__(self, shared: Tally, keep: int = KEEP) -> None:
        self.shared = shared
        self.keep = keep
        self._lock = threading.Lock()
        self._by_salt: OrderedDict[bytes, Tally] = OrderedDict()

    def of(self, salt: Salt | None) -> Tally:
        """The tally ``salt``'s lookups count into (made on first use)."""
        if salt is None:
            return self.shared
        key = salt_key(salt)
        with self._lock:
            got = self._by_salt.get(key)
            if got is None:
                got = self._by_salt[key] = Tally()
                while len(self._by_salt) > self.keep:
                    self._by_salt.popitem(last=False)
            else:
                self._by_salt.move_to_end(key)
            return got

    def read(self, salt: Salt) -> dict[str, object]:
        """What a caller presenting ``salt`` reads of its own lookups (zeros when it made none)."""
        with self._lock:
            got = self._by_salt.get(salt_key(salt))
        return (got or Tally()).stats()

    def __len__(self) -> int:
        return len(self._by_salt)
