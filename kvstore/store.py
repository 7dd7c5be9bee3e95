"""KVStore: one lookup over the memory tier, the disk tier and the shared tier.

``fetch`` returns the longest reusable prefix from any tier as fresh cache objects;
``insert`` keeps a snapshot in memory and queues it for the disk (write-behind). The store
coordinates rooms that each own one part and get their state handed in: ``Resolver``
(model keys to identities), ``MemoryTier`` (its lock, pending inserts and their settling,
memory pressure; what leaves it goes to the write path by ``on_evict``), ``WritePath``
(an insert's snapshot, every write to disk), ``Fleet`` (the shared tier,
``$KVSTORE_SHARED``: a Redis machines share), ``DiskTier`` and the disk-error policy
(``DiskErrors``).

A lookup is one ``Query`` (the tokens encoded once, their chain of chunk keys hashed once)
and one disk plan, shared by every tier it asks; a lookup that served less than a stored
prefix held says why (``Fetched.miss``, ``misses``). A disk problem of any kind (missing,
truncated, corrupt or foreign file, a failed write, a full disk) costs at most a miss: it
is counted, logged once per kind, and never raised to the caller. Bad *input* (tokens that
are not token ids, a cache longer than its tokens) raises ``ValueError`` naming the
problem, and changes nothing.

Thread-safe: the memory tier has its own lock; disk reads run outside it; one writer thread
owns disk writes. Several processes may share a cache directory (LMDB locking, unique pack
names, commit after sync). A cache directory is private to its user unless ``shared_dir``
says a group shares it (see ``cachedir``).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Hashable

from .cachedir import MEMO, StoreOpenError, default_cache_dir, open_disk
from .callers import Tallies, Tally
from .counters import Counters
from .disk import DiskTier, Plan, Restored
from .disk_errors import DiskErrors, Failure
from .fleet import Fleet, SharedHit, open_shared
from .floors import MIN_DISK_GAIN, CutRefused, memory_floor, restore_floor  # MIN_DISK_GAIN: re-exported (tests, README)
from .identity import DigestMemo, Identity
from .keys import TokenError, decode_tokens, encode_tokens
from .memory import ORDERING, MemoryTier, Snapshot
from .misses import OTHER_IDENTITY, Miss, Misses, Near, changed_components, explain
from .options import StoreOptions
from .parts import Part
from .preload import Preloaded, Preloader
from .pressure import Gauge, Watch
from .query import Query
from .resolver import MemoryOnly, Resolver, local_model_dir  # local_model_dir: re-exported (adapters)
from .salt import Salt, check_salt, memory_key, salted
from .write_policy import WritePolicy
from .writer import Writer
from .writes import WritePath
from .escape import logger

__all__ = ["KVStore", "Fetched", "MIN_DISK_GAIN", "local_model_dir"]
log = logger("kvstore")


@dataclass
class Fetched:
    """Result of a lookup: a fresh cache holding ``n`` tokens (or None), its tier, and why
    it is not more (``miss``: a stored prefix held more than was served; else None)."""

    cache: list[Any] | None
    n: int
    source: str | None  # "memory", "disk", "shared" or None
    miss: Miss | None = None


class KVStore:
    """A two-tier prefix cache for mlx-lm prompt caches.

    Its settings are one ``StoreOptions`` (``options=``) or that value's keywords; their
    defaults are written there alone (``kvstore.options``), what they mean here.

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
    so ``kvstore serve``, and ``kvstore warm``) pass ``MIN_DISK_HIT``. ``min_memory_hit``:
    the same floor for a memory hit (``floors.memory_floor``: below it, unless it holds the
    whole prompt, a lookup is a miss in memory as on disk). 0 here and in the drop-in:
    mlx-lm's own memory rules, which its suite pins; ``kvstore serve`` passes its
    ``--min-disk-hit``, so the usage it reports follows one rule for every tier.
    ``whole_copy_min_bytes``: the smallest entry that, served again from disk, is also kept
    as one file MLX's loader reads in one pass (``disk.whole``); None writes no copies (a
    copy already stored is still read).
    """

    def __init__(self, cache_dir: str | Path | None = None, *, options: StoreOptions | None = None,
                 **overrides: Any) -> None:
        """``options`` (default ``StoreOptions()``) with ``overrides``, keywords naming its
        fields (TypeError naming one that is not); ``cache_dir``, when given, is the
        directory's. The value built is ``self.options``."""
        self.options = o = (options or StoreOptions()).but(
            **overrides, **({"cache_dir": cache_dir} if cache_dir is not None else {}))
        self.write_policy = WritePolicy(o.persist, o.max_write_bytes_per_day)  # raises ValueError first
        gauge = Gauge(o.memory_floor) if o.memory_floor else None  # raises ValueError first
        if not isinstance(o.min_disk_hit, int) or o.min_disk_hit < 0:
            raise ValueError(f"min_disk_hit must be a number of tokens >= 0, got {o.min_disk_hit!r}")
        if o.whole_copy_min_bytes is not None and (not isinstance(o.whole_copy_min_bytes, int)
                                                   or isinstance(o.whole_copy_min_bytes, bool) or o.whole_copy_min_bytes < 0):
            raise ValueError(f"whole_copy_min_bytes must be a number of bytes >= 0 or None, got {o.whole_copy_min_bytes!r}")
        if not isinstance(o.min_memory_hit, int) or o.min_memory_hit < 0:
            raise ValueError(f"min_memory_hit must be a number of tokens >= 0, got {o.min_memory_hit!r}")
        self.min_disk_hit, self.min_memory_hit = o.min_disk_hit, o.min_memory_hit
        self.max_bytes = o.max_bytes  # the user's hard cap; the gauge may hold the tier below it
        self.max_disk_bytes = o.max_disk_bytes
        self.cache_dir = Path(o.cache_dir).expanduser() if o.cache_dir is not None else default_cache_dir()
        self._counters = Counters()
        self._errors = DiskErrors(self._counters, self.cache_dir)
        self._memory_only = MemoryOnly()
        self.disk: DiskTier | None = None if o.memory_only else self._open_disk(o.chunk_tokens, o.shared_dir, o.on_disk_error)
        self.memo = DigestMemo(self.cache_dir / MEMO if self.disk else None, self.disk.modes if self.disk else None)
        disk = self.disk
        self.models = Resolver(self.memo, self._memory_only, self._errors.warn_once,
                               (lambda i: _file_identity(disk, i)) if disk is not None else None,
                               o.kv_bits, o.kv_group_size)
        self.writer = Writer(o.queue_size) if self.disk else None
        self.writes = WritePath(self._counters, self._errors, self.disk, self.writer, self.write_policy,
                                max_disk_bytes=o.max_disk_bytes, whole_copy_min_bytes=o.whole_copy_min_bytes)
        self._memory = MemoryTier(o.max_entries, o.max_bytes, touch_on_hit=o.touch_on_hit, gauge=gauge,
                                  counters=self._counters, on_evict=self.writes.write_evicted,
                                  behind=self.writes.behind)
        tier = open_shared(o.shared, o.queue_size) if self.disk else None
        self.shared = tier  # the shared tier itself (stats, its prefill rates), or None
        self.fleet = Fleet(tier, self.disk, self.writes, self._counters, self._errors) \
            if tier is not None and self.disk is not None else None
        if self.disk is None and o.shared:
            log.warning("kvstore: the shared tier needs the disk tier (it restores through it); off")
        self._gauge = gauge
        self._watch = _watch_memory(self) if gauge is not None else None
        self._preloaded: Preloaded | None = None  # the last preload's report (stats() shows it)
        self.misses = Misses()  # why lookups served less than the store held (``Fetched.miss``), counted
        # a salted lookup counts into its salt's tally, never into the shared counters (``callers``)
        self.tallies = Tallies(Tally(self._counters, self.misses))
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
            self._memory_only.record("*", f"the cache directory cannot be used: {e}")
            return None

    @property
    def memory(self) -> MemoryTier:
        """The memory tier: every read of it holds every insert made so far (it settles
        first, ``MemoryTier.settle``)."""
        return self._memory

    def settle(self) -> list[Snapshot]:
        """File every insert made so far into the memory tier (``MemoryTier.settle``)."""
        return self._memory.settle()

    # -- identity ----------------------------------------------------------------------

    def identity(self, model: Any, *, built: Any = None) -> Identity | None:
        """Map a model key to its identity; None if it names no local files (``Resolver``:
        re-derived when any file it came from changed, so a model replaced in place never
        restores the old model's KV). ``built``: the engine's loaded model of that key, so
        a derivation now does not build it again (the same digest: ``model_identity``)."""
        return self.models.identity(model, built)

    def set_kv_quant(self, kv_bits: int | None, kv_group_size: int | None = 64) -> None:
        """Name the KV quantisation the engine runs with (part of every identity this store
        resolves from a model key): identities resolved so far are resolved again."""
        self.models.set_kv_quant(kv_bits, kv_group_size)

    def register(self, model: Hashable, identity: Identity) -> None:
        """Use ``identity`` for ``model`` (engines whose key is not a path)."""
        self.models.register(model, identity)

    def note_memory_only(self, name: str, why: str) -> None:
        """Say once, in the log and in ``stats()["memory_only_reason"]``, that ``name``'s
        caches are kept in memory only and why (an engine adapter that cannot give the
        store an identity says so here: a restart then prefills everything again)."""
        self._memory_only.note(name, why)

    def _mem_key(self, model: Any, ident: Identity | None, salt: Salt | None = None) -> Hashable:
        return ident.digest if ident is not None else memory_key(model, salt)

    def _disk_on(self, ident: Identity | None) -> bool:
        return ident is not None and self.disk is not None and not self._errors.off

    # -- fetch -------------------------------------------------------------------------

    def fetch(self, model: Any, tokens: list[int], *, salt: Salt | None = None,
              name: Callable[[Miss], Part] | None = None) -> Fetched:
        """The longest reusable prefix of ``tokens`` in memory or on disk; a longer disk
        prefix replaces a memory hit only when it holds all of ``tokens`` or more than
        ``MIN_DISK_GAIN`` tokens more, and any disk hit must hold the whole prompt or at
        least ``min_disk_hit`` tokens (``restore_floor``). With ``salt`` only entries
        inserted with the same salt are found (``kvstore.salt``), in every tier. One disk
        plan, the chain hashed once. ``Fetched.miss`` says why not more, when a stored
        prefix held more than was served; ``name`` (the caller's, who knows the request:
        ``parts.locate``) names the part of the request it starts in, before it is counted.

        Raises ValueError (``keys.TokenError``, ``salt.SaltError``) for token lists that
        are not token ids, or a salt that is not a non-empty bounded string.
        """
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        base = self.models.identity(model)  # resolved once: the lookup's key and a miss's explanation
        ident = salted(base, check_salt(salt, "salt"))
        mem_key = self._mem_key(model, ident, salt)
        tally = self.tallies.of(salt)
        near = Near(len(tokens))
        least = memory_floor(len(tokens), self.min_memory_hit)  # one rule for every tier (floors)
        cache, n, snap = self._memory.lookup(mem_key, tokens, near, least)  # settled first
        if cache is not None and n == len(tokens):
            return self._hit("memory", cache, n, snap, counts=tally.counters)
        q = None
        if self._disk_on(ident) and tokens:
            q = self._query(ident, enc, tokens, near)  # type: ignore[arg-type]
            floor = restore_floor(n, len(tokens), self.min_disk_hit)  # what a disk or shared hit must beat,
            whole = restore_floor(n, len(tokens), self.min_disk_hit, holds_prompt=True)  # and one holding the prompt
            got = self._fetch_disk(ident, q, floor, tally.counters, whole)  # type: ignore[arg-type]
            if self.shared is not None:  # the prefill of what was not served starts now
                self.shared.prefill.fetched(ident.digest, got.n if got is not None else n)  # type: ignore[union-attr]
            if got is not None:  # a disk or shared hit may serve less than a stored prefix held too
                got.miss = self._counted(self._miss(base, salt, mem_key, enc, q, near, got.n), tally, name)
                return got
        if cache is not None:
            miss = self._counted(self._miss(base, salt, mem_key, enc, q, near, n), tally, name)
            return self._hit("memory", cache, n, snap, miss, tally.counters)
        tally.counters.add("misses")
        return Fetched(None, 0, None, self._counted(self._miss(base, salt, mem_key, enc, q, near, 0), tally, name))

    def peek(self, model: Any, tokens: list[int], *, salt: Salt | None = None) -> int:
        """How many tokens ``fetch`` would restore now (memory or disk), reading no KV data
        and changing nothing. Engines use it to choose between competing snapshots."""
        tokens = _token_list(tokens)
        enc = encode_tokens(tokens)
        ident = self.models.salted(model, salt)
        n = self._memory.peek(self._mem_key(model, ident, salt), tokens, memory_floor(len(tokens), self.min_memory_hit))
        if n < len(tokens) and self._disk_on(ident) and tokens:
            plan = self._disk_plan(self._query(ident, enc))  # type: ignore[arg-type]
            if plan is not None and plan.n > restore_floor(n, len(tokens), self.min_disk_hit,
                                                           holds_prompt=plan.holds_prompt):
                n = plan.n
        return n

    def _fetch_disk(self, ident: Identity, q: Query, better_than: int, counts: Counters | None = None,
                    whole: int | None = None) -> Fetched | None:
        """The disk tier's longest prefix of ``q`` beyond ``better_than`` tokens (asking the
        shared tier, with the same plan, when the disk holds less than the query), restored
        and promoted into memory; None for nothing. The first plan and the shared tier
        tell ``q.near`` what they saw; a plan made again (after a restore failed, or the
        shared tier filed a longer prefix) tells nobody. ``whole``: the tokens a disk plan holding
        the whole prompt must exceed instead (``restore_floor(holds_prompt=True)``; the
        shared tier is asked with ``better_than``). ``counts``: the caller's (``callers``)."""
        counts = counts if counts is not None else self._counters
        source = "disk"
        skip: frozenset[bytes] = frozenset()  # entries whose cut a restore refused
        plan = self._disk_plan(q, skip)
        if self.fleet is not None:
            shared = self.fleet.lookup(ident, q, plan, better_than)
            if isinstance(shared, SharedHit):
                return self._promote(ident, q, shared.plan, shared.got, "shared", counts)
            if shared:  # a longer prefix is indexed on disk now
                source, plan = "shared", self._disk_plan(q.reporting(None))
        for _ in range(4):  # each failure drops (or skips) a record; the next plan may still hit
            if plan is None or plan.n <= (whole if plan.holds_prompt and whole is not None else better_than):
                return None
            t0 = time.perf_counter()
            got = self._restore(ident, plan, counts)
            if isinstance(got, Restored):
                took = time.perf_counter() - t0
                counts.add("restores", restore_seconds=took, bytes_read=got.nbytes, restores_one_pass=int(got.one_pass))
                counts.observe("restore_seconds", took)
                if got.copy_dropped:
                    self._counters.add("whole_copies_dropped")
                self.writes.copy_whole(ident, plan, got)
                return self._promote(ident, q, plan, got, source, counts)
            if got is Failure.REFUSED and plan.entry is not None:
                skip |= {plan.entry}
                if q.near is not None:
                    q.near.refused(plan.n)
            elif got in (Failure.UNREADABLE, Failure.REFUSED) or self._errors.off:  # a new plan would fail the same way
                return None
            plan = self._disk_plan(q.reporting(None), skip)
        return None

    def _query(self, ident: Identity, enc: bytes, tokens: list[int] | None = None, near: Near | None = None) -> Query:
        """A lookup's one ``Query``: ``enc`` under ``ident``, chained as the disk tier chains
        (the disk plan, the shared tier and a miss's explanation read its chain, hashed
        once), its searches telling ``near`` what they saw."""
        return Query(enc, ident.digest, self.disk.chunk, tokens=tokens, near=near)  # type: ignore[union-attr]

    def _disk_plan(self, q: Query, skip: frozenset[bytes] = frozenset()) -> Plan | None:
        """The disk tier's plan for ``q`` (passing over the entries in ``skip``): None when
        it has none or the lookup failed (a miss, logged once; a damaged index switches
        the disk tier off)."""
        try:
            return self.disk.lookup(q, skip)  # type: ignore[union-attr]
        except Exception as e:
            if not self._errors.index_damaged(e, self.disk):
                self._errors.warn_once("plan", "kvstore: disk lookup failed (%s); treating as a miss", e)
            return None

    def _restore(self, ident: Identity, plan: Plan, counts: Counters | None = None) -> Restored | Failure:
        """Read ``plan`` from disk, or say why not (``disk_errors.Failure``: DAMAGED, dropped or
        raced; UNREADABLE, I/O or resources, kept; REFUSED, a cut its layout refuses, kept)."""
        try:
            return self.disk.restore(plan, ident)  # type: ignore[union-attr]
        except CutRefused:
            (counts if counts is not None else self._counters).add("refused_cuts")
            return Failure.REFUSED
        except Exception as e:
            return self._errors.restore_failed(self.disk, plan, e)  # type: ignore[arg-type]

    def _promote(self, ident: Identity, q: Query, plan: Plan, got: Restored, source: str,
                 counts: Counters | None = None) -> Fetched:
        """Keep a disk or shared hit hot (marked as already on disk) and hand out its cache."""
        snap = Snapshot.kept(got.tensors, got.layout, plan.cache_type, plan.entry)
        self._memory.insert(ident.digest, q.tokens[: got.n], snap)  # what it evicts goes to the write path
        return self._hit(source, got.cache, got.n, snap, counts=counts)

    def _hit(self, tier: str, cache: list[Any], n: int, snap: Snapshot | None, miss: Miss | None = None,
             counts: Counters | None = None) -> Fetched:
        (counts if counts is not None else self._counters).add(f"hits_{tier}", tokens_saved=n, **{f"tokens_{tier}": n})
        self.writes.credit(snap.disk_key if snap is not None else None)
        return Fetched(cache, n, tier, miss)

    def _miss(self, ident: Identity | None, salt: Salt | None, mem_key: Hashable, enc: bytes, q: Query | None,
              near: Near, served: int) -> Miss | None:
        """Why ``served`` tokens were all this lookup gave, from what its searches saw and
        what this process lost (``WritePath.ghosts``; the identity the model had before its
        files changed, whose entries are still in memory). ``ident``: the model's own
        (unsalted) identity. No hashing; no disk read but, where the nearest stored prefix
        is a chunk others go on from, the index edges below it (``DiskTier.nearest``).
        ``near``: the lookup's (``q.near`` when it made a query)."""
        if near.common <= served and served >= near.n_q - 1:
            return None  # served all a stored prefix shared, and all the prompt: nothing to explain
        bounds = q.hashed_bounds() if q is not None else None
        lost = self.writes.ghosts.best(mem_key, enc, bounds, q.chunk if q is not None else 1, served)
        old = self.models.previous.get(ident.digest) if ident is not None else None
        old_key = salted(old, salt) if old is not None else None
        if old_key is not None and ident is not None:
            had = self._memory.peek(old_key.digest, q.tokens if q is not None else decode_tokens(enc))
            if had > max(served, near.common, lost[2] if lost else 0):
                lost = (OTHER_IDENTITY, changed_components(old.info, ident.info), had, had)  # type: ignore[union-attr]
        if near.below and q is not None and self.disk is not None:
            try:  # the nearest is a chunk others go on from: its cost is the entry's own length
                self.disk.nearest(q)
            except Exception as e:  # an explanation never costs the lookup: the chunk's end stays
                log.debug("kvstore: could not name the entry below a chunk: %s", e)
        return explain(near, served, lost)

    def _counted(self, miss: Miss | None, tally: Tally, name: Callable[[Miss], Part] | None) -> Miss | None:
        """``miss`` counted in ``tally``, the caller's (``callers``), and its part named
        (``name``: the part of the request it starts in). Naming renders the request again
        (``parts.locate``: milliseconds): a miss worth a log line is named here (its line
        says the part); any other only counts its part, so it is named when the counts are
        read (``Misses.name_pending``), or behind on the writer thread once ``UNNAMED_MAX``
        wait (each holds its request's messages). Not on the writer thread every time: a
        thread rendering beside the generation slows it down on a loaded machine (measured:
        benchmarks.agent_session --rounds, issue 47)."""
        if miss is None:
            return None
        if name is not None and tally.misses.worth_logging(miss):
            miss, name = replace(miss, part=name(miss)), None  # parts.locate never raises
        tally.misses.record(miss, name=name)
        if tally.misses.unnamed >= UNNAMED_MAX and not self.writes.behind(tally.misses.name_pending):
            tally.misses.name_pending()  # no writer, or its queue is full: here
        return miss

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
        with self._memory.inserting():  # first: a lookup from now on waits for this insert
            tokens = _token_list(tokens)
            enc = encode_tokens(tokens)
            ident = self.models.salted(model, salt) if cache_type in ORDERING else None
            vocab = self.models.vocab_size(ident) if ident is not None else None
            snap, covered, why = self.writes.take(ident, enc, cache, cache_type, vocab)
            self._memory.put(self._mem_key(model, ident, salt), tokens, snap)  # from here on a lookup finds it
            self.writes.follow(snap, ident, enc, covered, self._memory.settle)
        if why is not None:
            self._counters.add("unpersistable")
            self.note_memory_only(ident.name if ident is not None else str(model)[:200], why)
        if self.shared is not None and ident is not None:  # measures this model's prefill rate
            self.shared.prefill.inserted(ident.digest, len(tokens))

    # -- limits, stats, lifecycle ------------------------------------------------------

    def relieve_memory(self) -> int:
        """Give memory back now (``MemoryTier.relieve``); returns the entries evicted."""
        return self._memory.relieve()

    def trim_to(self, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Shrink the memory tier to at most ``n_sequences`` entries / ``n_bytes`` (mlx-lm's
        order); what goes and never reached disk is queued for it."""
        self._memory.trim_to(n_sequences, n_bytes)

    def discard(self, model: Any, tokens: list[int], *, salt: Salt | None = None) -> bool:
        """Drop the memory entry stored under exactly ``tokens`` (an engine's own eviction,
        e.g. exo's); one that never reached disk is queued for it. True if one was held."""
        tokens = _token_list(tokens)
        ident = self.models.salted(model, salt)
        return self._memory.remove(self._mem_key(model, ident, salt), tokens) is not None

    def stats(self, salt: Salt | None = None) -> dict[str, Any]:
        """Counters by tier, plus queue depth, dropped and failed writes, disk totals. The
        lookup counters (``callers.LOOKUP_KEYS``) and the misses count unsalted lookups;
        with ``salt``, those of lookups made with that salt instead (``callers``)."""
        self.settle()  # the counters of what settling evicts, too
        s: dict[str, Any] = self._counters.snapshot()
        s["memory_entries"] = len(self._memory)
        s["memory_only_reason"] = dict(self._memory_only.reasons)
        s["memory_bytes"] = self._memory.nbytes
        s["memory_budget_bytes"] = min(self._memory.max_bytes, self.max_bytes)
        s.update(self._gauge.stats() if self._gauge is not None else {})
        s.update(self.writes.stats())
        if self.shared is not None:
            s.update(self.shared.stats())
        if self.disk is not None:
            s["cache_dir"] = str(self.cache_dir)
        s.update(self.misses.stats())
        s.update((self._preloaded or Preloaded()).as_stats())
        s.update(self._counters.histograms())
        if salt is not None:
            s.update(self.tallies.read(salt))
        return s

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk (or failed)."""
        if self.writer is None:
            return True
        ok = self.writer.flush(timeout)
        if self.writes.credits_pending:
            self.writer.submit(self.writes.flush_credits)
            ok = self.writer.flush(timeout) and ok
        if self.shared is not None:  # after the writer: its commits queue the publishes
            ok = self.shared.flush(timeout) and ok
        return ok

    def close(self, timeout: float | None = None) -> None:
        """Flush the write-behind queue and release the index. Idempotent."""
        if self._watch is not None:
            self._watch.stop()
        if self.writer is not None:
            self.writes.write_unwritten(self._memory.snapshots(), timeout)
            self.flush(timeout)
            self.writer.close(timeout)
            self.writer = self.writes.writer = None
        if self.shared is not None:  # publishes read the disk tier: close it after them
            self.shared.close(timeout)
            self.shared = self.fleet = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        _open_stores.discard(self)

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- preload -----------------------------------------------------------------------

    def preload(self, model: Any, how: int | str = "auto", *, max_bytes: int | None = None,
                progress: Callable[[int, int], None] | None = None,
                stop: threading.Event | None = None, salt: Salt | None = None) -> Preloaded:
        """Restore ``model``'s entries from disk into the memory tier, ahead of traffic:
        pinned first, then by value; ``how`` is "pinned", "auto" (all) or an int N.
        Nothing already in memory is evicted or replaced; an entry goes in only if it fits
        the room left (and ``max_bytes``), filed least recently used; nothing is raised
        (``preload.Preloader.run`` has the whole contract). Thread-safe beside live
        traffic; ``stop`` ends it between two entries; ``progress(done, total)``.
        ``salt``: the entries inserted with that salt (none: the unsalted ones only)."""
        check_salt(salt, "salt")
        report = self._preloaded = Preloaded(running=True)
        preloader = Preloader(self._memory, self.disk, self._errors,
                              lambda m: self.models.salted(m, salt), self._read_whole)
        return preloader.run(report, model, how, max_bytes, progress, stop)

    def _read_whole(self, ident: Identity, enc: bytes) -> Restored | None:
        """Read one entry's whole token list from disk, or None (a miss, handled as in fetch)."""
        q = self._query(ident, enc)
        plan = self._disk_plan(q)
        got = self._restore(ident, plan) if plan is not None and plan.n == q.n else None
        return got if isinstance(got, Restored) else None


def _token_list(tokens: Any) -> list:
    try:
        return list(tokens)
    except TypeError:
        raise TokenError(f"tokens must be a sequence of integers, got {type(tokens).__name__}") from None


UNNAMED_MAX = 16  # misses waiting for their part's name (``KVStore._counted``) before it is named behind

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
        s.memory.tick()
        return True

    return Watch(tick)


def _file_identity(disk: DiskTier, ident: Identity) -> None:
    """Describe a newly derived identity in the index, and say in the log when another
    identity of its model directory holds entries this process cannot use."""
    from .superseded import log_unusable

    disk.index.put_identity(ident.digest, ident.info)
    try:
        log_unusable(disk.index, ident)
    except Exception as e:  # a message, never worth an identity
        log.debug("kvstore: could not list other identities of %s: %s", ident.name, e)
