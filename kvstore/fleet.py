"""The bridge between a store and its shared tier (a Redis a fleet of machines shares).

On a lookup that memory and disk served short, ``Fleet.lookup`` asks the shared tier for a
longer prefix (``shared.tier``: at most two round trips). A hit that needs nothing held here
is restored straight from the bytes received, its local copy filed behind on the writer
thread; one that builds on chunks held here is filed in the disk tier first and then read
from there, so the next request is a disk hit. After an entry is committed to disk the
writer thread hands it to the publisher (``publish``). Nothing on the request path writes
to Redis; a shared-tier failure of any kind is a counted miss; only an error naming a
value's own bytes drops it from the shared tier (``disk_errors.names_record``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .counters import Counters
from .floors import CutRefused
from .disk import Commit, DiskTier, PersistJob, Plan, Restored
from .disk_errors import DiskErrors, names_record
from .identity import Identity
from .index import IndexFailure
from .query import Query
from .writes import WritePath
from . import files
from .escape import logger

if TYPE_CHECKING:
    from .shared.tier import SharedTier

log = logger("kvstore")


@dataclass
class SharedHit:
    """A shared hit restored straight from the bytes received: what to hand out."""

    plan: Plan
    got: Restored


class Fleet:
    """A store's use of its shared tier; the state it needs is handed in."""

    def __init__(self, tier: "SharedTier", disk: DiskTier, writes: WritePath, counters: Counters,
                 errors: DiskErrors) -> None:
        self.tier, self.disk, self.writes, self.counters, self.errors = tier, disk, writes, counters, errors
        writes.on_written = self._queue_publish

    def lookup(self, ident: Identity, q: Query, plan: Plan | None, better_than: int) -> SharedHit | bool:
        """Ask the shared tier for more than ``better_than`` tokens and the local ``plan``
        hold. A ``SharedHit`` to hand out, True when a longer prefix is now indexed on disk
        (the caller plans again), False for nothing. Never raises."""
        disk = self.disk
        try:
            local = max(better_than, plan.n if plan is not None else 0)
            if local >= q.n:
                return False
            held = set(plan.chain) if plan is not None else set()  # the chain the plan verified
            found = self.tier.lookup(q, held, local)
        except Exception as e:  # a disk problem is a miss, as in fetch
            if not self.errors.index_damaged(e, disk):
                self.errors.warn_once("shared-bug", "kvstore: shared-tier lookup failed (%s); a miss", e)
            return False
        if found is None:
            return False
        if {ck for ck, *_ in found.chunks} != set(found.record.chunks):
            if self.file(ident, found):
                return True
            # Not filed (this disk's write policy or budget says no): the chunks it holds
            # were not sent, so ask again for the whole entry and restore it from memory.
            try:
                found = self.tier.lookup(q, set(), local)
            except Exception as e:  # a miss, as above
                if not self.errors.index_damaged(e, disk):
                    self.errors.warn_once("shared-bug", "kvstore: shared-tier lookup failed (%s); a miss", e)
                return False
            if found is None or {ck for ck, *_ in found.chunks} != set(found.record.chunks):
                return False
        return self._restore(ident, found)

    def _restore(self, ident: Identity, found: Any) -> SharedHit | bool:
        """A whole entry received: restored from its bytes, filed on disk behind."""
        try:
            t0 = time.perf_counter()
            got = self.disk.restore_framed(ident, found.key, found.record, found.n, found.chunks, found.tail)
        except CutRefused:  # the plan cuts the snapshot where its layout does not allow: a miss, kept
            self.counters.add("refused_cuts")
            return False
        except Exception as e:  # a miss, never a crash; only an error naming a record's bytes drops it
            bad = names_record(e)
            if bad is not None:  # verified bytes that do not fit
                self.tier.drop(*bad, ident.digest)
                self.errors.warn_once("shared-reject", "kvstore: dropping a shared entry: %s", e)
            else:  # memory or threads ran out, or a defect: says nothing about the entry, kept
                self.errors.warn_once("shared-bug", "kvstore: could not restore a shared hit (%s: %s); a miss, "
                                      "the entry is kept", type(e).__name__, e)
            return False
        took = time.perf_counter() - t0
        self.counters.add("restores", restore_seconds=took, bytes_read=got.nbytes)
        self.counters.observe("restore_seconds", took)
        writer = self.writes.writer
        if writer is not None:  # a full queue drops it (counted): kept in memory only
            def keep() -> None:
                self.file(ident, found)

            writer.submit(keep)
        rec = found.record
        return SharedHit(Plan(got.n, rec.chunks, None, rec.n, rec.chunked, None, rec.cache_type), got)

    def file(self, ident: Identity, found: Any) -> bool:
        """File a shared hit in the disk tier (on the caller's thread, or behind on the
        writer's); True if it is indexed there now. Never raises."""
        chunks = [(ck, rec, toks, bytes(seg)) for ck, rec, toks, seg in found.chunks]
        try:
            if not self.writes.admit_framed(ident, bytes(found.tokens), found.key, found.record.cache_type):
                return False  # the policy or the budget says no: nothing written
            self.writes.describe(ident)
            status = self.disk.import_entry(ident, found.key, found.record, found.tokens, chunks, bytes(found.tail))
        except (files.BlobError, OSError, IndexFailure) as e:
            bad = names_record(e)
            if bad is not None:  # verified bytes that do not fit this model or directory
                self.tier.drop(*bad, ident.digest)
                self.errors.warn_once("shared-reject", "kvstore: dropping a shared entry: %s", e)
                return False
            self.counters.add("write_errors")  # this directory's problem (I/O, a blobs/ kvstore refuses)
            if not self.errors.index_damaged(e, self.disk):
                self.errors.warn_once("shared-write", "kvstore: could not keep a shared hit on disk (%s)", e)
            return False
        except Exception:  # a defect: a miss, never a crash
            if "shared-bug" not in self.errors.warned:
                self.errors.warned.add("shared-bug")
                log.exception("kvstore: unexpected error in a shared-tier lookup (a kvstore bug: please report)")
            return False
        if status is Commit.RETRY:
            self.counters.add("races")
            return False
        try:
            self.writes.keep_disk_budget()
        except (OSError, IndexFailure) as e:  # the entry is filed; only the budget's pass failed
            self.counters.add("write_errors")
            if not self.errors.index_damaged(e, self.disk):
                self.errors.warn_once("shared-write", "kvstore: could not keep the disk budget (%s)", e)
        return True

    def _queue_publish(self, job: PersistJob) -> None:
        """After a commit (writer thread): the publish, on the tier's own thread and queue
        (a full queue drops it, counted)."""
        self.tier.submit(lambda: self.publish(job))

    def publish(self, job: PersistJob) -> None:
        """The publisher thread's job: the committed entry, read back from its pack files
        (still in the page cache), published to the shared tier."""
        from .shared.tier import PublishItem

        if self.errors.off:
            return
        got = self.disk.export_entry(job.query.key)
        if got is None:  # evicted or removed meanwhile
            return
        rec, tokens, chunks = got
        self.tier.publish(PublishItem(job.identity.digest, job.query.key, rec, tokens, chunks, self.disk.segment_bytes))


def open_shared(shared: Any, queue_size: int) -> "SharedTier | None":
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
