"""A snapshot: one prefix cache as the memory tier keeps it, and how one is taken.

``take`` (the caller's thread) checks a prompt cache and encodes it (``codec``: views of its
arrays, no copy) and schedules their evaluation on the caller's stream without waiting
(``mx.async_eval``); ``Snapshot.kept`` wraps what a disk or shared restore built. A snapshot
hands out fresh cache objects on every hit, so the caller can extend its cache without
touching the stored arrays and no hit pays a deep copy. Objects kvstore cannot encode are
kept as given and deep-copied on hit, as mlx-lm does.

Why scheduled and not waited for: the caller's cache is often still being computed when
it is inserted (mlx-lm's generation runs one step ahead), and waiting at the insert held
the end of every turn up by that step. Why this is safe across threads (MLX 0.32): only
the caller's thread schedules the work (MLX streams are per thread: no other thread may
evaluate these arrays), and any thread may then wait for it, because waiting is a host
wait on the arrays' event (a mutex and condition variable on the CPU, a shared event on
Metal), no stream involved. But MLX does not synchronise an array's own state (its
event and status, which ``array::wait`` clears): two threads waiting on one array at once
race. So every reader of a snapshot's arrays (a hit's ``materialize``, the write path's
persist) calls ``ready`` first, which waits under the snapshot's lock, once; after it the
arrays are plain evaluated arrays, read by any thread as before.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .. import codec
from ..layout import Layout

ORDERING = ("assistant", "user", "system")  # mlx-lm's eviction order: assistant turns go first


@dataclass
class Snapshot:
    """One stored prefix in memory: encoded tensors (views, no copy) and their layout, or
    objects kvstore cannot encode (``opaque``: kvstore knows no more of them than their
    own ``is_trimmable``, mlx-lm's rule). ``trimmable``: every prefix can be cut from it
    (``Layout.covers_prefixes``; for opaque objects, ``is_trimmable``). ``disk_key``: the
    entry it is on disk as (hits are credited to it); ``persist``: (identity, encoded
    tokens) to write when it is evicted before it reached disk; ``persisted``: queued for,
    or already on, disk."""

    tensors: codec.Tensors | None
    layout: Layout | None
    opaque: list[Any] | None
    nbytes: int
    trimmable: bool
    cache_type: str = "assistant"
    persisted: bool = False
    disk_key: bytes | None = None
    persist: tuple[Any, bytes] | None = None
    scheduled: list[Any] = field(default_factory=list, repr=False, compare=False)  # arrays not waited for yet
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def schedule(self, arrays: list[Any]) -> None:
        """Evaluate ``arrays`` (this snapshot's, or made from them) on this thread's stream
        without waiting: ``ready`` waits for them. Call it on the thread that made them."""
        with self._lock:
            mx.async_eval(arrays)
            self.scheduled += arrays

    def ready(self) -> None:
        """Wait until the arrays ``schedule`` scheduled are computed (any thread; once, under
        this snapshot's lock: see the module docstring). Every reader of the arrays calls it."""
        with self._lock:
            if self.scheduled:
                mx.eval(self.scheduled)  # all scheduled already: a host wait on each, nothing run here
                self.scheduled = []

    @classmethod
    def kept(cls, tensors: codec.Tensors, layout: Layout, cache_type: str, disk_key: bytes | None) -> "Snapshot":
        """What a disk or shared restore built (``tensors`` in ``layout``), kept hot: marked
        as on disk already under ``disk_key``; an unknown ``cache_type`` files as "assistant"."""
        return cls(tensors, layout, None, codec.cache_nbytes(tensors), layout.covers_prefixes,
                   cache_type if cache_type in ORDERING else "assistant", persisted=True, disk_key=disk_key)

    def materialize(self) -> list[Any]:
        """Fresh cache objects; extending them never changes this snapshot."""
        self.ready()
        if self.opaque is not None:
            return copy.deepcopy(self.opaque)
        return codec.decode_cache(self.tensors or {}, self.layout or Layout())

    def cut_to(self, stored: int, n: int) -> bool:
        """Whether this snapshot, stored under ``stored`` tokens, may be cut back to serve
        ``n`` of them: its cache (which may hold fewer positions than ``stored``) cut by
        ``stored - n`` must stop at a point its layout allows (``Layout.can_cut``)."""
        if self.opaque is not None:
            return self.trimmable
        if n >= stored:
            return True
        held = self.layout.length if self.layout is not None else None
        return held is not None and self.layout is not None and self.layout.can_cut(held - (stored - n))


def check(cache: Any, cache_type: str) -> None:
    """Raises ValueError for a ``cache_type`` mlx-lm does not know or a cache that is not
    one (``check_cache``): checked before anything is taken or stored."""
    if cache_type not in ORDERING:
        raise ValueError(f"cache_type must be one of {list(ORDERING)}, got {cache_type!r}")
    check_cache(cache)


def take(cache: list[Any], n_tokens: int, cache_type: str) -> tuple[Snapshot, int, str | None]:
    """(the snapshot of ``cache`` (checked: ``check``), which holds ``n_tokens`` tokens, the
    positions it covers, why it cannot be persisted or None), its evaluation scheduled.
    Raises ValueError when the cache holds more positions than ``n_tokens`` or its layers
    disagree."""
    snap, covered, why = _encoded(cache, n_tokens, cache_type)
    # Every array kvstore waits on is its own: a view that spans the whole array (an
    # exactly-sized KVCache, rotating and recurrent state) is the host's own array, whose
    # event and status the host's thread goes on using in new graphs while a reader's wait
    # clears them (MLX does not synchronise them). ``stop_gradient`` is a new array on the
    # same buffer: no copy, and the host's buffer is still not donated while it is held.
    if snap.tensors is not None:
        snap.tensors = {k: mx.stop_gradient(a) for k, a in snap.tensors.items()}
        waited = list(snap.tensors.values())
    else:  # opaque: deep-copied on hit; waiting on wrappers waits for the host's arrays
        waited = [mx.stop_gradient(a) for c in snap.opaque or [] for a in codec.layer_arrays(c)]
    # Scheduled before any lookup can find it: its arrays are made on this thread's stream,
    # and MLX streams are per thread (MLX >= 0.31.2), so no other thread could evaluate
    # them; readers wait (``Snapshot.ready``). (Views: free once the caller's cache is computed.)
    snap.schedule(waited)
    return snap, covered, why


def _encoded(cache: list[Any], n_tokens: int, cache_type: str) -> tuple[Snapshot, int, str | None]:
    """(the snapshot of ``cache``, positions it covers, why it cannot be persisted or None)."""
    try:
        tensors, layout = codec.encode_cache(cache)
    except codec.Unsupported as e:
        nbytes = sum(getattr(c, "nbytes", 0) for c in cache) if isinstance(cache, (list, tuple)) else 0
        trim = bool(cache) and all(getattr(c, "is_trimmable", lambda: False)() for c in cache)
        return Snapshot(None, None, cache, nbytes, trim, cache_type), 0, str(e)
    offsets = [m["offset"] for m in layout.flat if "offset" in m]
    covered = min(offsets) if offsets else n_tokens
    if covered > n_tokens:
        raise ValueError(f"cache holds {covered} positions but only {n_tokens} tokens were given")
    if len(set(offsets)) > 1:
        raise ValueError(f"cache layers disagree on their length: {sorted(set(offsets))}")
    if not offsets:  # recurrent state only: it must be taken at the prefix boundary
        covered = n_tokens
    try:  # what the snapshot keeps alive: its views pin the whole allocated buffers,
        # which is also what mlx-lm's LRUPromptCache counts against max_bytes
        nbytes = int(sum(c.nbytes for c in cache))
    except Exception:
        nbytes = codec.cache_nbytes(tensors)
    return Snapshot(tensors, layout, None, nbytes, layout.covers_prefixes, cache_type), covered, None


def check_cache(cache: Any) -> None:
    """A prompt cache is a non-empty list of cache objects whose arrays hold what they claim."""
    if not isinstance(cache, (list, tuple)) or not cache:
        raise ValueError(f"cache must be a non-empty list of cache objects (one per layer), "
                         f"got {type(cache).__name__}{' (empty)' if isinstance(cache, (list, tuple)) else ''}")
    for i, c in enumerate(codec.flat_layers(cache)):
        if not (hasattr(type(c), "state") or hasattr(c, "nbytes")) or isinstance(c, (int, float, str, bytes)):
            raise ValueError(f"cache layer {i} is a {type(c).__name__}, not a cache object")
    why = codec.check_holds(cache)
    if why:
        raise ValueError(f"cache {why}")
