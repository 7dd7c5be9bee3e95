"""KVStore: one lookup over the memory tier and the disk tier.

``fetch`` returns the longest reusable prefix from either tier as fresh cache objects;
``insert`` keeps a snapshot in memory and queues it for the disk (write-behind).

With ``shared=`` (or ``$KVSTORE_SHARED``) a third tier sits behind the disk: a Redis that
machines share (``kvstore.shared.tier``). When memory and disk give fewer tokens than the
prompt, ``fetch`` asks it for a longer prefix (at most two round trips); a hit is verified,
written into the disk tier and restored from there, so the next request is a disk hit.
After an entry is committed to disk the writer thread hands it to the shared tier's
publisher. Nothing on the request path writes to Redis, and a shared-tier failure of any
kind is a counted miss. A disk
problem of any kind (missing, truncated, corrupt or foreign file, a failed write, a full
disk) costs at most a miss: it is counted, logged once per kind, and never raised to the
caller. Bad *input* (tokens that are not token ids, a cache longer than its tokens) raises
``ValueError`` naming the problem, and changes nothing.

Thread-safe: one lock guards the memory tier; disk reads run outside it; one writer thread
owns disk writes. Several processes may share a cache directory (LMDB locking, unique pack
names, commit after sync). A cache directory is private to its user unless ``shared_dir``
says a group shares it (see ``cachedir``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable

import mlx.core as mx
import numpy as np

from . import blobs, codec
from .budget import evict_to
from .cachedir import MEMO, StoreOpenError, default_cache_dir, open_disk
from .counters import Counters
from .served_tokens import CutRefused
from .disk import Commit, DiskTier, PersistJob, Plan, Restored
from .disk_errors import DiskErrors, Failure, names_record
from .floors import MIN_DISK_GAIN, restore_floor  # MIN_DISK_GAIN: re-exported (tests, README)
from .identity import DigestMemo, Identity, file_stamp, model_identity, watch
from .index import IndexFailure
from .keys import TOKEN_BYTES, TokenError, boundaries, decode_tokens, encode_tokens, key_of, root_key
from .layouts import layout_problem
from .memory import ORDERING, MemoryTier, Snapshot
from .preload import Preloaded, Preloader
from .salt import Salt, check_salt, memory_key, salted
from .write_policy import WritePolicy
from .pressure import DEFAULT_MEMORY_FLOOR, Gauge, Watch
from .bytes_written import written as written_bytes
from .writer import Writer

if TYPE_CHECKING:
    from .shared import SharedConfig
    from .shared.tier import SharedTier

log = logging.getLogger("kvstore")


@dataclass
class Fetched:
    """Result of a lookup: a fresh cache holding ``n`` tokens (or None), and its tier."""

    cache: list[Any] | None
    n: int
    source: str | None  # "memory", "disk", "shared" or None


class KVStore:
    """A two-tier prefix cache for mlx-lm prompt caches.

    ``model`` arguments may be an ``Identity``, a model directory, or mlx-lm's server key
    ``(model path, adapter path, draft model path)``; a key that cannot be resolved to
    files on disk is served from memory only. ``kv_bits`` / ``kv_group_size`` name the KV
    quantisation the engine runs with (it is part of every identity this store resolves).
    ``shared_dir``: the directory is shared by a group on purpose (else it must be this
    user's alone). ``on_disk_error="memory"``: a directory that cannot be used is warned
    about and the store serves from memory, instead of raising ``StoreOpenError``.
    ``shared``: the shared tier, a ``redis://[user:pass@]host:port/db`` URL (``rediss://``,
    ``redis+cluster://``: see ``SharedConfig.from_url``) or a ``SharedConfig``; None (the
    default) reads ``$KVSTORE_SHARED``, False turns it off. It needs the disk tier.
    ``persist`` ("all", "system", "reused") and ``max_write_bytes_per_day``: what reaches
    the SSD (``kvstore.write_policy``); a job they skip stays in memory, counted.
    ``min_disk_hit``: the fewest tokens a disk or shared hit must restore when memory has
    none of the prompt (a hit holding the whole prompt always counts). 0 here: any stored
    prefix, the exact lookup rules; the front ends a newcomer meets (``LRUPromptCache``,
    so ``kvstore serve``, and ``kvstore warm``) pass ``MIN_DISK_HIT``.
    """

    def __init__(
        self,
        cache_dir: str | Path | None = None,
        *,
        max_entries: int = 10,
        max_bytes: int = 1 << 63,
        max_disk_bytes: int | None = None,
        chunk_tokens: int = 256,
        queue_size: int = 16,
        touch_on_hit: bool = True,
        memory_only: bool = False,
        on_disk_error: str = "raise",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        shared_dir: bool = False,
        shared: "str | SharedConfig | None | bool" = None,
        persist: str = "all",
        max_write_bytes_per_day: int | None = None,
        memory_floor: float | int | None = DEFAULT_MEMORY_FLOOR,
        min_disk_hit: int = 0,
    ) -> None:
        self.write_policy = WritePolicy(persist, max_write_bytes_per_day)  # raises ValueError first
        self._gauge = Gauge(memory_floor) if memory_floor else None  # raises ValueError first
        if not isinstance(min_disk_hit, int) or min_disk_hit < 0:
            raise ValueError(f"min_disk_hit must be a number of tokens >= 0, got {min_disk_hit!r}")
        self.min_disk_hit = min_disk_hit
        self._memory = MemoryTier(max_entries, max_bytes, touch_on_hit=touch_on_hit)
        self.max_bytes = max_bytes  # the user's hard cap; the gauge may hold the tier below it
        self._pending: list[tuple[Hashable, list[int], Snapshot]] = []  # inserts not in the tier yet
        self._inserting: dict[int, int] = {}  # thread id -> inserts under way that are not pending yet
        self.max_disk_bytes = max_disk_bytes
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        self._lock = threading.RLock()
        self._inserted = threading.Condition(self._lock)
        self._counters = Counters()
        self._errors = DiskErrors(self._counters, self.cache_dir)
        self._idents: dict[Hashable, tuple[Identity | None, tuple | None, tuple | None]] = {}
        self._vocab: dict[bytes, int | None] = {}
        self._kv_quant = (kv_bits, kv_group_size if kv_bits else None)
        self._memory_only: dict[str, str] = {}  # model -> why its caches stay in memory
        self._host: dict[int, dict[str, Any]] = {}  # id(pending snapshot) -> its host views
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._touch_scheduled = False
        self._described: set[bytes] = set()  # salted identities filed in the index
        self.disk: DiskTier | None = None if memory_only else self._open_disk(chunk_tokens, shared_dir, on_disk_error)
        self.memo = DigestMemo(self.cache_dir / MEMO if self.disk else None, self.disk.modes if self.disk else None)
        self.shared = _open_shared(shared, queue_size) if self.disk else None
        self.writer = Writer(queue_size) if self.disk else None
        if self.disk is None and shared:
            log.warning("kvstore: the shared tier needs the disk tier (it restores through it); off")
        self._relief_queued = False
        self._watch = _watch_memory(self) if self._gauge is not None else None
        _open_stores.add(self)

    def _open_disk(self, chunk_tokens: int, shared_dir: bool, on_disk_error: str) -> DiskTier | None:
        """The disk tier of ``cache_dir``; a directory that cannot be used raises
        ``StoreOpenError``, or with ``on_disk_error="memory"`` is said once and gives None."""
        try:
            return open_disk(self.cache_dir, chunk_tokens, shared_dir=shared_dir)
        except StoreOpenError as e:
            if on_disk_error != "memory":
                raise
            log.warning("kvstore: %s; serving from memory only", e)
            self._record_memory_only("*", f"the cache directory cannot be used: {e}")
            return None

    @property
    def memory(self) -> MemoryTier:
        """The memory tier, with every insert made so far in it (``settle``)."""
        self.settle()
        return self._memory

    def settle(self) -> list[Snapshot]:
        """File the inserts still pending into the memory tier, in order, and queue what
        that evicted for disk; returns the snapshots filed. ``insert`` leaves this to the
        writer thread (the trie and the limits cost O(prompt) of Python), and every reader
        of the memory tier does it first, so a lookup always sees every earlier insert."""
        with self._lock:
            me = threading.get_ident()  # an insert another thread has begun is waited for
            self._inserted.wait_for(lambda: not any(t != me for t in self._inserting), timeout=5.0)
            if not self._pending:
                return []
            pending, self._pending = self._pending, []
            evicted = []
            squeezed = self._follow_memory() < self.max_bytes  # memory, not the user's cap, sets the budget
            for mem_key, tokens, snap in pending:
                evicted += self._memory.insert(mem_key, tokens, snap)
            if squeezed and evicted:
                self._counters.add("evictions_pressure", len(evicted))
        self._persist_evicted(evicted)
        return [snap for _, _, snap in pending]

    # -- identity ----------------------------------------------------------------------

    def identity(self, model: Any) -> Identity | None:
        """Map a model key to its identity; None if it names no local files.

        Remembered per key, and re-derived when any file it was derived from changed
        (``identity.watch``: a few stat calls on every use), so weights replaced in place
        (even under their old mtime) or a model directory swapped under a running server
        never restore the old model's KV."""
        if isinstance(model, Identity):
            return model
        try:
            key: Hashable = model if isinstance(model, Hashable) else repr(model)
        except TypeError:
            key = repr(model)
        known = self._idents.get(key)
        if known is not None:
            ident, dirs, stamp = known
            if dirs is None or (stamp is not None and _unchanged(stamp)) or watch(*dirs) == stamp:
                return ident
        ident, dirs, stamp = None, None, None
        try:
            parts = list(model) if isinstance(model, (tuple, list)) else [model]
            parts += [None] * (3 - len(parts))
            path, adapter, draft = (local_model_dir(p) if p is not None else None for p in parts[:3])
            if path is not None:
                dirs = (path, adapter, draft)
                stamp = watch(*dirs)
                ident = model_identity(path, adapter_path=adapter, draft_path=draft, memo=self.memo,
                                       kv_bits=self._kv_quant[0], kv_group_size=self._kv_quant[1])
                if self.disk is not None:
                    self.disk.index.put_identity(ident.digest, ident.info)
        except Exception as e:  # unresolvable: memory only, said once (and in stats())
            self._warn_once("identity", "kvstore: no identity for model %r (%s); memory only", model, e)
            self._record_memory_only(str(model)[:200], f"no identity for the model ({e})")
        if ident is None:
            dirs = None
            self._warn_once("identity", "kvstore: model %r is not a local directory; memory only", model)
            self._record_memory_only(str(model)[:200], "the model is not a local directory: no identity")
        self._idents[key] = (ident, dirs, stamp)
        return ident

    def set_kv_quant(self, kv_bits: int | None, kv_group_size: int | None = 64) -> None:
        """Name the KV quantisation the engine runs with (part of every identity this store
        resolves from a model key): identities resolved so far are resolved again."""
        quant = (kv_bits, kv_group_size if kv_bits else None)
        if quant != self._kv_quant:
            self._kv_quant = quant
            self._idents.clear()

    def _vocab_size(self, ident: Identity) -> int | None:
        """The model's vocabulary size from its config.json (None when unknown)."""
        if ident.digest in self._vocab:
            return self._vocab[ident.digest]
        vocab = None
        path = ident.info.get("path")
        if path:
            try:
                from .identity import read_config

                cfg = read_config(Path(path))
                v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
                vocab = int(v) if v else None
            except (OSError, ValueError, TypeError, AttributeError):
                vocab = None
        self._vocab[ident.digest] = vocab
        return vocab

    def register(self, model: Hashable, identity: Identity) -> None:
        """Use ``identity`` for ``model`` (engines whose key is not a path)."""
        self._idents[model] = (identity, None, None)
        if self.disk is not None:
            self.disk.index.put_identity(identity.digest, identity.info)

    def _mem_key(self, model: Any, ident: Identity | None, salt: Salt | None = None) -> Hashable:
        return ident.digest if ident is not None else memory_key(model, salt)

    def _salted(self, model: Any, salt: Salt | None) -> Identity | None:
        """The identity ``model``'s entries under ``salt`` are filed under (``salt.salted``:
        its own keys in every tier; no salt: the model's identity)."""
        return salted(self.identity(model), check_salt(salt, "salt"))

    def _disk_on(self, ident: Identity | None) -> bool:
        return ident is not None and self.disk is not None and not self._disk_off

    # -- fetch -------------------------------------------------------------------------

    def fetch(self, model: Any, tokens: list[int], *, salt: Salt | None = None) -> Fetched:
        """The longest reusable prefix of ``tokens`` in memory or on disk; a longer disk
        prefix replaces a memory hit only when it holds all of ``tokens`` or more than
        ``MIN_DISK_GAIN`` tokens more, and any disk hit must hold the whole prompt or at
        least ``min_disk_hit`` tokens (``restore_floor``). With ``salt`` only entries
        inserted with the same salt are found (``kvstore.salt``), in every tier.

        Raises ValueError (``keys.TokenError``, ``salt.SaltError``) for token lists that
        are not token ids, or a salt that is not a non-empty bounded string.
        """
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        ident = self._salted(model, salt)
        with self._lock:
            cache, n, snap = self.memory.lookup(self._mem_key(model, ident, salt), tokens)
        if cache is not None:
            # A snapshot is keyed by the tokens it was inserted with; a cache that holds fewer
            # positions (mlx-lm's server inserts prompt + generated tokens with a cache that
            # has not seen the last one) serves only the prefix it holds.
            held = codec.held(cache)
            if held is not None and held < n:
                n = held
                if n <= 0:
                    cache, n = None, 0
        if cache is not None and n == len(tokens):
            self._hit("memory", n, snap)
            return Fetched(cache, n, "memory")
        if self._disk_on(ident) and tokens:
            floor = restore_floor(n, len(tokens), self.min_disk_hit)  # what a disk or shared hit must beat
            shared = self.shared is not None and self._from_shared(ident, enc, floor)  # type: ignore[arg-type]
            got = shared if isinstance(shared, Fetched) else \
                self._fetch_disk(ident, enc, better_than=floor, source="shared" if shared else "disk")  # type: ignore[arg-type]
            if self.shared is not None:  # the prefill of what was not served starts now
                self.shared.prefill.fetched(ident.digest, got.n if got is not None else n)  # type: ignore[union-attr]
            if got is not None:
                return got
        if cache is not None:
            self._hit("memory", n, snap)
            return Fetched(cache, n, "memory")
        self._counters.add("misses")
        return Fetched(None, 0, None)

    def peek(self, model: Any, tokens: list[int], *, salt: Salt | None = None) -> int:
        """How many tokens ``fetch`` would restore now (memory or disk), reading no KV data
        and changing nothing. Engines use it to choose between competing snapshots."""
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        ident = self._salted(model, salt)
        with self._lock:
            n = self.memory.peek(self._mem_key(model, ident, salt), tokens)
        if n < len(tokens) and self._disk_on(ident) and tokens:
            try:
                plan = self.disk.plan(ident, enc)  # type: ignore[union-attr,arg-type]
                n = plan.n if plan is not None and plan.n > restore_floor(n, len(tokens), self.min_disk_hit) else n
            except Exception:  # a disk problem is a miss, as in fetch
                pass
        return n

    def _from_shared(self, ident: Identity, enc: bytes, better_than: int) -> "Fetched | bool":
        """Ask the shared tier for more than the local tiers hold. A hit that needs nothing
        held here is restored straight from the bytes received and handed out (a
        ``Fetched``), its local copy written behind by the writer thread; one that builds
        on chunks held here is written into the disk tier first (True: a longer prefix is
        now indexed there). False: nothing. Never raises."""
        assert self.shared is not None and self.disk is not None
        disk, n_q = self.disk, len(enc) // TOKEN_BYTES
        try:
            plan = disk.plan(ident, enc)
            local = max(better_than, plan.n if plan is not None else 0)
            if local >= n_q:
                return False
            bounds = boundaries(root_key(ident.digest), enc, disk.chunk)
            found = self.shared.lookup(ident.digest, enc, bounds, disk.chunk, disk.held_chunks(bounds, enc), local)
        except Exception as e:  # a disk problem is a miss, as in fetch
            if not self._index_damaged(e):
                self._warn_once("shared-bug", "kvstore: shared-tier lookup failed (%s); a miss", e)
            return False
        if found is None:
            return False
        if {ck for ck, *_ in found.chunks} != set(found.record.chunks):
            return self._import_shared(ident, found)
        try:
            t0 = time.perf_counter()
            got = disk.restore_framed(ident, found.key, found.record, found.n, found.chunks, found.tail,
                                      lambda specs, layout: layout_problem(ident, specs, layout))
        except CutRefused:  # the plan cuts the snapshot where its layout does not allow: a miss, kept
            self._counters.add("refused_cuts")
            return False
        except Exception as e:  # a miss, never a crash; only an error naming a record's bytes drops it
            bad = names_record(e)
            if bad is not None:  # verified bytes that do not fit
                self.shared.drop(*bad, ident.digest)
                self._warn_once("shared-reject", "kvstore: dropping a shared entry: %s", e)
            else:  # memory or threads ran out, or a defect: says nothing about the entry, kept
                self._warn_once("shared-bug", "kvstore: could not restore a shared hit (%s: %s); a miss, "
                                "the entry is kept", type(e).__name__, e)
            return False
        took = time.perf_counter() - t0
        self._counters.add("restores", restore_seconds=took, bytes_read=got.nbytes)
        self._counters.observe("restore_seconds", took)
        if self.writer is not None:  # a full queue drops it (counted): kept in memory only
            def keep() -> None:
                self._import_shared(ident, found)

            self.writer.submit(keep)
        rec = found.record
        return self._promote(ident, enc, Plan(got.n, rec.chunks, None, rec.n, rec.chunked, None, rec.cache_type),
                             got, "shared")

    def _import_shared(self, ident: Identity, found: Any) -> bool:
        """File a shared hit in the disk tier (on the caller's thread, or behind on the
        writer's); True if it is indexed there now. Never raises."""
        assert self.shared is not None and self.disk is not None
        chunks = [(ck, rec, toks, bytes(seg)) for ck, rec, toks, seg in found.chunks]
        try:
            job = PersistJob(ident, bytes(found.tokens), found.key, {}, [], found.record.cache_type)
            if self._admit(job, framed=True) is None:  # the policy or the budget says no: nothing written
                return False
            self._describe(ident)
            status = self.disk.import_entry(ident, found.key, found.record, found.tokens, chunks, bytes(found.tail),
                                            lambda specs, layout: layout_problem(ident, specs, layout))
        except (blobs.BlobError, OSError, IndexFailure) as e:
            bad = names_record(e)
            if bad is not None:  # verified bytes that do not fit this model or directory
                self.shared.drop(*bad, ident.digest)
                self._warn_once("shared-reject", "kvstore: dropping a shared entry: %s", e)
                return False
            self._counters.add("write_errors")  # this directory's problem (I/O, a blobs/ kvstore refuses)
            if not self._index_damaged(e):
                self._warn_once("shared-write", "kvstore: could not keep a shared hit on disk (%s)", e)
            return False
        except Exception:  # a defect: a miss, never a crash
            if "shared-bug" not in self._warned:
                self._warned.add("shared-bug")
                log.exception("kvstore: unexpected error in a shared-tier lookup (a kvstore bug: please report)")
            return False
        if status is Commit.RETRY:
            self._counters.add("races")
            return False
        try:
            self._keep_disk_budget()
        except (OSError, IndexFailure) as e:  # the entry is filed; only the budget's pass failed
            self._counters.add("write_errors")
            if not self._index_damaged(e):
                self._warn_once("shared-write", "kvstore: could not keep the disk budget (%s)", e)
        return True

    def _fetch_disk(self, ident: Identity, enc: bytes, better_than: int, source: str = "disk") -> Fetched | None:
        assert self.disk is not None
        skip: frozenset[bytes] = frozenset()  # entries whose cut a restore refused
        for _ in range(4):  # each failure drops (or skips) a record; the next plan may still hit
            plan = self._disk_plan(ident, enc, skip)
            if plan is None or plan.n <= better_than:
                return None
            t0 = time.perf_counter()
            got = self._restore(ident, plan)
            if not isinstance(got, Restored):
                if got is Failure.REFUSED and plan.entry is not None:
                    skip |= {plan.entry}
                elif got in (Failure.UNREADABLE, Failure.REFUSED) or self._disk_off:  # a new plan would fail the same way
                    return None
                continue
            took = time.perf_counter() - t0
            self._counters.add("restores", restore_seconds=took, bytes_read=got.nbytes)
            self._counters.observe("restore_seconds", took)
            return self._promote(ident, enc, plan, got, source)
        return None

    def _disk_plan(self, ident: Identity, enc: bytes, skip: frozenset[bytes] = frozenset()) -> Plan | None:
        """The disk tier's plan for ``enc`` (passing over the entries in ``skip``): None when
        it has none or the lookup failed (a miss, logged once; a damaged index switches
        the disk tier off)."""
        try:
            return self.disk.plan(ident, enc, skip)  # type: ignore[union-attr]
        except Exception as e:
            if not self._index_damaged(e):
                self._warn_once("plan", "kvstore: disk lookup failed (%s); treating as a miss", e)
            return None

    def _restore(self, ident: Identity, plan: Plan) -> Restored | Failure:
        """Read ``plan`` from disk, or say why not (``errors.Failure``): DAMAGED (the record
        was dropped, or a concurrent gc removed it: a counted race; a new plan may still
        hit, unless the index itself is damaged and the disk tier is off), UNREADABLE (an
        I/O error about the process or the system, EMFILE or EIO: the entry is kept,
        counted in ``io_errors``) or REFUSED (the plan cuts a snapshot where its layout does
        not allow: a miss, the entry is kept, counted in ``refused_cuts``)."""
        try:
            return self.disk.restore(plan, ident, lambda specs, layout: layout_problem(ident, specs, layout))  # type: ignore[union-attr]
        except CutRefused:
            self._counters.add("refused_cuts")
            return Failure.REFUSED
        except Exception as e:
            return self._errors.restore_failed(self.disk, plan, e)  # type: ignore[arg-type]

    def _promote(self, ident: Identity, enc: bytes, plan: Plan, got: Restored, source: str = "disk") -> Fetched:
        """Keep a disk hit hot (marked as already on disk) and hand out its cache;
        ``source`` ("disk" | "shared") is where it came from for this request."""
        ctype = plan.cache_type if plan.cache_type in ORDERING else "assistant"
        snap = Snapshot(got.tensors, got.layout, None, codec.cache_nbytes(got.tensors),
                        codec.covers_prefixes(got.layout), ctype, persisted=True, disk_key=plan.entry)
        with self._lock:
            evicted = self.memory.insert(ident.digest, decode_tokens(enc[: got.n * TOKEN_BYTES]), snap)
        self._persist_evicted(evicted)
        self._hit(source, got.n, snap)
        return Fetched(got.cache, got.n, source)

    def _hit(self, tier: str, n: int, snap: Snapshot | None) -> None:
        self._counters.add(f"hits_{tier}", tokens_saved=n, **{f"tokens_{tier}": n})
        key = snap.disk_key if snap is not None else None
        if key is not None and self.writer is not None:
            with self._lock:
                _when, hits = self._touches.get(key, (0.0, 0))
                self._touches[key] = (time.time(), hits + 1)
                schedule = not self._touch_scheduled
                self._touch_scheduled = True
            if schedule and not self.writer.submit(self._flush_touches):
                self._touch_scheduled = False

    def _flush_touches(self) -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
            self._touch_scheduled = False
        if touches and self.disk is not None and not self._disk_off:
            try:
                self.disk.touch(touches)
            except IndexFailure as e:  # bookkeeping only: a failed touch costs nothing else
                if not self._index_damaged(e):
                    self._warn_once("touch", "kvstore: could not record hits: %s", e)

    # -- insert ------------------------------------------------------------------------

    def insert(self, model: Any, tokens: list[int], cache: list[Any], *,
               cache_type: str = "assistant", salt: Salt | None = None) -> None:
        """Keep ``cache`` (which holds ``tokens``) hot and queue it for disk; returns at once.
        With ``salt`` it is filed for lookups with the same salt only (``kvstore.salt``).

        On the caller's thread: the checks, and the snapshot (views of the cache's arrays:
        MLX work stays on the caller's thread). Filing it in the memory tier (``settle``)
        and the disk write run on the writer thread; any lookup made after this call
        returns sees it all the same. Raises ValueError when the tokens are not token ids
        or the cache holds more positions than ``tokens``; nothing is stored then.
        """
        me = threading.get_ident()
        with self._lock:  # a lookup on another thread from now on waits for this insert
            self._inserting[me] = self._inserting.get(me, 0) + 1
        try:
            snap, covered, ident, enc = self._take(model, tokens, cache, cache_type, salt)
        finally:
            with self._lock:
                self._inserting[me] -= 1
                if not self._inserting[me]:
                    del self._inserting[me]
                self._inserted.notify_all()
        if snap.tensors is not None and self._disk_on(ident) and covered > 0:
            host = self._host_views(snap)
            if host is not None:
                with self._lock:
                    snap.persist = (ident, enc[: covered * TOKEN_BYTES])
                    self._host[id(snap)] = host
        job = lambda: self._file(snap)  # noqa: E731
        if self.writer is None or not self.writer.submit(job):
            job()  # no writer, or its queue is full: here, as before

    def _take(self, model: Any, tokens: list[int], cache: list[Any],
              cache_type: str, salt: Salt | None = None) -> tuple[Snapshot, int, Identity | None, bytes]:
        """``insert``'s checks and snapshot, then the snapshot into the pending list:
        (snapshot, positions it covers, identity, encoded tokens)."""
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        if cache_type not in ORDERING:
            raise ValueError(f"cache_type must be one of {list(ORDERING)}, got {cache_type!r}")
        _check_cache(cache)
        ident = self._salted(model, salt)
        if ident is not None and tokens:
            vocab = self._vocab_size(ident)
            top = int(np.frombuffer(enc, dtype="<i8").max())
            if vocab is not None and top >= vocab:
                raise TokenError(f"token id {top} is out of the vocabulary of {ident.name} (vocab_size {vocab})")
        if self.shared is not None and ident is not None:  # measures this model's prefill rate
            self.shared.prefill.inserted(ident.digest, len(tokens))
        snap, covered, why = self._snapshot(cache, len(tokens), cache_type)
        if why is not None:
            self._note_memory_only(model, ident, why)
        # Evaluated before any lookup can find it: its views are made on this thread's
        # stream, and MLX streams are per thread (Metal, MLX >= 0.31.2), so no other thread
        # could evaluate them. (Views: free once the caller's cache is computed.)
        mx.eval([a for c in snap.opaque for a in codec.layer_arrays(c)] if snap.opaque is not None
                else list((snap.tensors or {}).values()))
        with self._lock:  # from here on a lookup finds it
            self._pending.append((self._mem_key(model, ident, salt), tokens, snap))
        return snap, covered, ident, enc

    def _file(self, snap: Snapshot) -> None:
        """The writer thread's half of ``insert``: the pending inserts into the memory
        tier, then ``snap`` to disk."""
        self.settle()
        self._queue_write(snap)

    def _queue_write(self, snap: Snapshot) -> None:
        """Write ``snap`` to disk (queued; inline on the writer thread) unless it is there
        or queued already, or has nothing to write. A new snapshot's layout is checked
        against its identity first: a cache that does not fit is never stored under it."""
        with self._lock:  # claimed once: the writer's settle and a close may meet here
            host = self._host.pop(id(snap), None)
            if snap.persisted or snap.persist is None or self.writer is None:
                return
            snap.persisted = True
        if host is not None and snap.tensors is not None and snap.layout is not None:  # new: not checked yet
            wrong = layout_problem(snap.persist[0], snap.tensors, snap.layout)
            if wrong is not None:  # memory is the caller's own; the disk is not
                snap.persist, snap.persisted = None, False
                self._counters.add("unpersistable")
                self._warn_once("layout", "kvstore: %s; kept in memory only", wrong)
                return
        snap.persisted = self._submit(snap, host)

    def _note_memory_only(self, model: Any, ident: Identity | None, why: str) -> None:
        """Count a cache kvstore cannot persist; say why once per model (in the log and in
        ``stats()["memory_only_reason"]``, at most 64 models named)."""
        self._counters.add("unpersistable")
        self.note_memory_only(ident.name if ident is not None else str(model)[:200], why)

    def note_memory_only(self, name: str, why: str) -> None:
        """Say once, in the log and in ``stats()["memory_only_reason"]``, that ``name``'s
        caches are kept in memory only and why (an engine adapter that cannot give the
        store an identity says so here: a restart then prefills everything again)."""
        if self._record_memory_only(name, why):
            log.warning("kvstore: %s: %s; its caches are served from memory only", name, why)

    def _record_memory_only(self, name: str, why: str) -> bool:
        """``why`` into ``stats()["memory_only_reason"][name]`` (at most 64 names); True if
        it is new."""
        with self._lock:
            if name in self._memory_only or len(self._memory_only) >= 64:
                return False
            self._memory_only[name] = why
        return True

    def _snapshot(self, cache: list[Any], n_tokens: int, cache_type: str) -> tuple[Snapshot, int, str | None]:
        """(the snapshot, positions it covers, why it cannot be persisted or None)."""
        try:
            tensors, layout = codec.encode_cache(cache)
        except codec.Unsupported as e:
            nbytes = sum(getattr(c, "nbytes", 0) for c in cache) if isinstance(cache, (list, tuple)) else 0
            trim = bool(cache) and all(getattr(c, "is_trimmable", lambda: False)() for c in cache)
            return Snapshot(None, None, cache, nbytes, trim, cache_type), 0, str(e)
        offsets = [m["offset"] for m in codec.flat_layout(layout) if "offset" in m]
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
        return Snapshot(tensors, layout, None, nbytes, codec.covers_prefixes(layout), cache_type), covered, None

    def _host_views(self, snap: Snapshot) -> dict[str, Any] | None:
        """``blobs.host_views`` of a snapshot (MLX work: the caller's thread), None if its
        dtype cannot be stored (said once)."""
        try:
            return blobs.host_views(snap.tensors)  # type: ignore[arg-type]
        except TypeError as e:
            self._warn_once("dtype", "kvstore: %s; kept in memory only", e)
            return None

    def _submit(self, snap: Snapshot, host: dict[str, Any] | None = None) -> bool:
        assert self.writer is not None and self.disk is not None and snap.tensors is not None and snap.persist
        ident, enc = snap.persist
        host = host if host is not None else self._host_views(snap)
        if host is None:
            return False
        key = key_of(root_key(ident.digest), enc, self.disk.chunk)
        job = PersistJob(ident, enc, key, host, snap.layout or [], snap.cache_type)
        snap.disk_key = key
        if self.writer.on_thread():  # settling on the writer thread: write now, keep the queue's room
            self._persist(job)
            return True
        return self.writer.submit(lambda: self._persist(job))

    def _persist(self, job: PersistJob) -> None:
        """The writer thread's half of an insert: write, commit, keep the budget."""
        disk = self.disk
        if disk is None or self._disk_off:
            return
        t0 = time.perf_counter()
        try:
            admitted = self._admit(job)
            if admitted is None:  # the job's snapshot stays in memory
                return
            job = admitted
            self._describe(job.identity)
            written = disk.persist(job)
            self._keep_disk_budget()
        except (OSError, IndexFailure, blobs.BlobError) as e:  # a write or commit failed (full disk, I/O)
            self._counters.add("write_errors")
            if not self._index_damaged(e):
                self._warn_once(f"write:{getattr(e, 'errno', None) or type(e).__name__}",
                                "kvstore: write failed (%s); entry stays in memory only", e)
            return
        took = time.perf_counter() - t0
        self._counters.add("writes", write_seconds=took, bytes_written=written)
        self._counters.observe("persist_seconds", took)
        if self.shared is not None:  # its own thread and queue: a full queue drops, counted
            self.shared.submit(lambda: self._publish(job))

    def _admit(self, job: PersistJob, *, framed: bool = False) -> PersistJob | None:
        """The one door to the disk tier: every write (a persist, a shared hit filed here)
        asks the write policy and the daily budget first. The job to write (for "reused"
        perhaps its prefix), or None, the skip counted."""
        assert self.disk is not None
        admitted = self.write_policy.admit(self.disk, job, framed=framed)
        if isinstance(admitted, str):
            self._counters.add(f"writes_skipped_{admitted}")
            return None
        return admitted

    def _describe(self, ident: Identity) -> None:
        """File a salted identity's description (``salt.salted``: the model's, marked
        salted; never the salt) before its first entry, once per process, so maintenance
        (ls, gc of missing models) sees whose entries they are."""
        if ident.info.get("salted") and ident.digest not in self._described and self.disk is not None:
            self.disk.index.put_identity(ident.digest, ident.info)
            self._described.add(ident.digest)

    def _keep_disk_budget(self) -> None:
        """After every write: evict least recently used entries down to ``max_disk_bytes``."""
        if self.max_disk_bytes is not None and self.disk is not None:
            gone = evict_to(self.disk, self.max_disk_bytes)
            self._counters.add("gc_runs", int(bool(gone)), evictions_disk=len(gone),
                               gc_freed_bytes=sum(r.freed for r in gone))

    def _publish(self, job: PersistJob) -> None:
        """The publisher thread's job: the committed entry, read back from its pack files
        (still in the page cache), published to the shared tier."""
        from .shared.tier import PublishItem

        disk, shared = self.disk, self.shared
        if disk is None or shared is None or self._disk_off:
            return
        got = disk.export_entry(job.key)
        if got is None:  # evicted or removed meanwhile
            return
        rec, tokens, chunks = got
        shared.publish(PublishItem(job.identity.digest, job.key, rec, tokens, chunks, disk.segment_bytes))

    def _persist_evicted(self, evicted: list) -> None:
        self._counters.add("evictions_memory", len(evicted))
        for _, _, snap in evicted:
            self._queue_write(snap)

    # -- limits, stats, lifecycle ------------------------------------------------------

    def _follow_memory(self) -> int:
        """Set the memory tier's byte budget from the machine's available memory (the
        user's ``max_bytes`` stays a hard cap); returns it. Called under the lock."""
        if self._gauge is None:
            return self._memory.max_bytes
        self._memory.max_bytes = self._gauge.budget(self._memory.nbytes, self.max_bytes)
        return self._memory.max_bytes

    def _memory_tick(self) -> None:
        """The watch's look (every ``WATCH_SECONDS``): when the tier holds more than the
        budget allows, relief is queued on the writer thread (once at a time), where each
        evicted entry is written before it goes."""
        with self._lock:
            over = self._memory.nbytes > self._follow_memory() and len(self._memory) > 0
            if not over or self._relief_queued:
                return
            self._relief_queued = True

        def relief() -> None:
            try:
                self.relieve_memory()
            finally:
                self._relief_queued = False

        if self.writer is None or not self.writer.submit(relief):
            relief()  # memory only (nothing to write first), or a full queue: relieve now

    def relieve_memory(self) -> int:
        """Give memory back when available memory fell under the floor: entries leave the
        memory tier least valuable first (mlx-lm's eviction order), each written to disk
        first when it is not there yet (run on the writer thread, the writes are inline),
        then MLX's buffer cache is emptied so the bytes go back to the system. Returns the
        entries evicted."""
        with self._lock:
            budget = self._follow_memory()
            evicted = self._memory.trim_to(n_bytes=budget) if self._memory.nbytes > budget else []
        if not evicted:
            return 0
        self._counters.add("evictions_pressure", len(evicted))
        self._persist_evicted(evicted)
        del evicted
        mx.clear_cache()  # the allocator's free buffers, not a limit or a setting of the host
        return 1

    def trim_to(self, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Shrink the memory tier to at most ``n_sequences`` entries / ``n_bytes`` (mlx-lm's
        order); what goes and never reached disk is queued for it."""
        with self._lock:
            evicted = self.memory.trim_to(n_sequences, n_bytes)
        self._persist_evicted(evicted)

    def discard(self, model: Any, tokens: list[int], *, salt: Salt | None = None) -> bool:
        """Drop the memory entry stored under exactly ``tokens`` (an engine's own eviction,
        e.g. exo's); one that never reached disk is queued for it. True if one was held."""
        tokens = _token_list(tokens)
        ident = self._salted(model, salt)
        with self._lock:
            snap = self.memory.remove(self._mem_key(model, ident, salt), tokens)
        if snap is not None:
            self._persist_evicted([(model, tokens, snap)])
        return snap is not None

    def stats(self) -> dict[str, Any]:
        """Counters by tier, plus queue depth, dropped and failed writes, disk totals."""
        s: dict[str, Any] = self._counters.snapshot()
        s["memory_entries"] = len(self.memory)
        s["memory_only_reason"] = dict(self._memory_only)
        s["memory_bytes"] = self.memory.nbytes
        s["memory_budget_bytes"] = min(self._memory.max_bytes, self.max_bytes)
        if self._gauge is not None:
            r = self._gauge.reading()
            s["memory_available_bytes"] = r.available if r is not None else None
            s["memory_floor_bytes"] = self._gauge.floor_of()
        s.update(self.write_policy.stats())
        if self.writer is not None:
            s["queue_depth"] = self.writer.depth
            s["pending_writes"] = self.writer.pending
            s["dropped_writes"] = self.writer.dropped
        if self.shared is not None:
            s.update(self.shared.stats())
        if self.disk is not None:
            s["cache_dir"] = str(self.cache_dir)
            try:
                if not self._disk_off:
                    s["disk_bytes"] = self.disk.index.total_bytes()
                    s.update({f"disk_{k}": v for k, v in self.disk.index.counts().items()})
                    s["written_today_bytes"], s["written_total_bytes"] = written_bytes(self.disk.index)
            except IndexFailure as e:
                self._index_damaged(e)
            if self._disk_off:
                s["disk_off"] = self._disk_off
        s.update((self._preloaded or Preloaded()).as_stats())
        s.update(self._counters.histograms())
        return s

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or failed)."""
        if self.writer is None:
            return True
        ok = self.writer.flush(timeout)
        if self._touches:
            self.writer.submit(self._flush_touches)
            ok = self.writer.flush(timeout) and ok
        if self.shared is not None:  # after the writer: its commits queue the publishes
            ok = self.shared.flush(timeout) and ok
        return ok

    def close(self, timeout: float | None = None) -> None:
        """Flush the write-behind queue and release the index. Idempotent."""
        if self._watch is not None:
            self._watch.stop()
        if self.writer is not None:
            self._persist_unwritten(timeout)
            self.flush(timeout)
            self.writer.close(timeout)
            self.writer = None
        if self.shared is not None:  # publishes read the disk tier: close it after them
            self.shared.close(timeout)
            self.shared = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        _open_stores.discard(self)

    def _persist_unwritten(self, timeout: float | None) -> None:
        """Queue the snapshots still in memory whose write was dropped (queue full): at
        close there is no generation left to hold up, so wait for room if needed."""
        assert self.writer is not None
        with self._lock:
            pending = [s for s in self.memory.snapshots() if not s.persisted and s.persist is not None]
        for snap in pending:
            self._queue_write(snap)
            if not snap.persisted and snap.persist is not None:
                self.writer.flush(timeout)
                self._queue_write(snap)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _index_damaged(self, e: BaseException) -> bool:
        """True if ``e`` says the index is damaged; the disk tier is then off for this
        process (``errors.DiskErrors.index_damaged``), memory keeps serving."""
        return self._errors.index_damaged(e, self.disk)

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log ``msg`` once per ``kind``; later ones only counted (``errors.DiskErrors.warn_once``)."""
        self._errors.warn_once(kind, msg, *args)

    @property
    def _disk_off(self) -> str | None:
        """Why the disk tier was switched off (a damaged index), or None."""
        return self._errors.off

    @property
    def _warned(self) -> set[str]:
        return self._errors.warned

    # -- preload -----------------------------------------------------------------------

    _preloaded: "Preloaded | None" = None  # the last preload's report (stats() shows it)

    def preload(self, model: Any, how: int | str = "auto", *, max_bytes: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                stop: threading.Event | None = None, salt: Salt | None = None) -> Preloaded:
        """Restore ``model``'s entries from disk into the memory tier, ahead of traffic.

        Order: pinned entries first, then by value, ``(1 + hits) x tokens`` (an entry's write
        counts as its first use), the most recently used first on ties. ``how``: "pinned"
        (pinned entries only), "auto" (all of them), or an int N (the first N).
        Guarantees: nothing already in memory is evicted or replaced. An entry goes in only
        if it fits the room left (``max_entries``, the memory tier's ``max_bytes``, and
        ``max_bytes`` here) and its insertion drops no stored prefix (mlx-lm's rule for a
        trimmable entry); the first entry that does not fit ends the preload (its bytes
        are known once read, so that one entry may be read for nothing). A preloaded
        entry is an ordinary memory entry (same LRU lists, limits, byte accounting) filed
        least recently used, so live inserts outrank it. No hit is credited on disk; a
        damaged entry is dropped and counted as ``fetch`` does; nothing is raised.
        Thread-safe: may run beside live traffic; ``stop`` ends it between two entries.
        ``progress(done, total)`` is called once the candidates are known, then after each.
        ``salt``: the entries inserted with that salt (none: the unsalted ones only)."""
        check_salt(salt, "salt")
        report = self._preloaded = Preloaded(running=True)
        preloader = Preloader(self.memory, self._lock, lambda m: self._salted(m, salt), self._disk_on, self._disk_entries,
                              lambda key: self.disk.index.view(lambda r: r.tokens(key)),  # type: ignore[union-attr]
                              self._read_whole)
        return preloader.run(report, model, how, max_bytes, progress, stop)

    def _disk_entries(self) -> dict[bytes, Any] | None:
        """Every entry record on disk (None for unreadable ones), or None if they cannot
        be listed (logged once; a damaged index switches the disk tier off)."""
        from .index import scan

        try:
            return scan(self.disk.index, full=False).entries  # type: ignore[union-attr]
        except IndexFailure as e:
            if not self._index_damaged(e):
                self._warn_once("preload", "kvstore: cannot list entries to preload (%s)", e)
            return None

    def _read_whole(self, ident: Identity, enc: bytes) -> Restored | None:
        """Read one entry's whole token list from disk, or None (a miss, handled as in fetch)."""
        plan = self._disk_plan(ident, enc)
        got = self._restore(ident, plan) if plan is not None and plan.n == len(enc) // TOKEN_BYTES else None
        return got if isinstance(got, Restored) else None


def _unchanged(stamp: tuple) -> bool:
    """True if every path in ``stamp`` (``identity.watch``'s) still stats as recorded: one
    ``os.stat`` each. A file added to or removed from a watched directory changes that
    directory's own stamp, so this is ``watch(...) == stamp`` without listing anything."""
    try:
        return all(len(e) == 6 and tuple(file_stamp(os.stat(e[0]))) == e[1:] for e in stamp)
    except OSError:
        return False


def _token_list(tokens: Any) -> list:
    try:
        return list(tokens)
    except TypeError:
        raise TokenError(f"tokens must be a sequence of integers, got {type(tokens).__name__}") from None


def _check_cache(cache: Any) -> None:
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


def _open_shared(shared: Any, queue_size: int) -> "SharedTier | None":
    """The shared tier named by ``shared`` (see ``KVStore``), or None. A URL that does not
    parse raises ValueError (a configuration error, said at start-up); a server that does
    not answer is not an error here: every call is then a counted miss."""
    if shared is False or ((shared is None or shared is True) and not os.environ.get("KVSTORE_SHARED", "").strip()):
        return None  # (the shared package is not even imported: a start without it is sooner)
    from .shared import SharedConfig

    config = SharedConfig.from_env() if shared is None or shared is True else (
        shared if isinstance(shared, SharedConfig) else SharedConfig.from_url(str(shared)))
    if config is None:
        return None
    from .shared.tier import SharedTier

    return SharedTier(config, queue_size=queue_size)


def local_model_dir(p: Any) -> Path | None:
    """A model key as a local directory: a path, or a hub repo id already in the local
    hub cache (never downloaded); None otherwise."""
    path = Path(str(p)).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download
        got = Path(snapshot_download(str(p), local_files_only=True))
        return got if got.is_dir() else None
    except Exception:
        return None


_open_stores: "weakref.WeakSet[KVStore]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # interpreter exit flushes the write-behind queue
    for store in list(_open_stores):
        try:
            store.close(timeout=60)
        except Exception:
            pass


def _watch_memory(store: KVStore) -> Watch:
    """A watch thread that looks at available memory for ``store`` and ends with it (it
    holds the store weakly, so an unclosed store is still collected)."""
    ref = weakref.ref(store)

    def tick() -> bool:
        s = ref()
        if s is None:
            return False
        s._memory_tick()
        return True

    return Watch(tick)
