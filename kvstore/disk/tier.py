"""A disk tier's state: one cache directory's pack files under ``blobs/`` and the LMDB
index under ``index/`` that names them, opened with the directory's own chunk size; and
what changes entries without reading a segment (remove, drop a damaged chunk or a whole
copy, touch).
The jobs that read or write segments (plan, restore, persist, transfer) are rooms of
their own, given this state (see ``kvstore.disk``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .. import files
from ..index import FormatError, Index, IndexOpenError, WriteTxn, chunk_size
from ..records import EntryRecord, RecordError, Segment
from ..escape import logger

log = logger("kvstore")


class Tier:
    """Pack files + index of one cache directory. ``shared_dir``: a group shares the
    directory on purpose (files 0660, directories 2770, the directory's group: see
    ``files.Modes``) instead of private (0600, 0700)."""

    def __init__(self, root: Path, *, chunk_tokens: int = 256, readonly: bool = False,
                 shared_dir: bool = False) -> None:
        self.root = Path(root)
        self.blob_root = self.root / "blobs"
        self.modes = files.Modes.of(self.root, shared_dir)
        if not readonly:
            for d in (self.root / "index", self.blob_root):
                files.make_dir(d, self.modes)
        try:
            self.index = Index(self.root, readonly=readonly, modes=self.modes)
        except FormatError as e:
            if readonly or e.found < 0:
                raise
            self._set_aside(e.found)
            self.index = Index(self.root, readonly=readonly, modes=self.modes)
        # The chunk size is part of the directory's format (it places every key boundary):
        # the first opener fixes it, later openers use it whatever they ask for.
        stored = self.index.meta_setdefault(b"chunk_tokens", str(int(chunk_tokens)).encode())
        try:
            self.chunk = chunk_size(stored, chunk_tokens, self.index.path)
        except IndexOpenError:
            self.index.close()
            raise
        if self.chunk != chunk_tokens:
            log.info("kvstore: %s uses chunk_tokens=%d (asked for %d)", self.root, self.chunk, chunk_tokens)

    def _set_aside(self, found: int) -> None:
        """Move the store of format ``found`` aside whole (``index.formats``) and make the
        directories of a new one: persistence goes on, the old store is kept, named, sized."""
        from ..index.formats import set_aside
        from ..keys import FORMAT_VERSION
        from ..units import human_bytes

        moved = set_aside(self.root, found, FORMAT_VERSION, self.modes)  # makes the new store's directories
        if moved is not None:
            log.warning("kvstore: the store in %s has format %d, this kvstore reads %d: set it aside as %s (%s; "
                        "the kvstore that wrote it can use it as its --cache-dir) and started a new store here. "
                        "`kvstore gc --old-formats --cache-dir %s` removes it", self.root, found, FORMAT_VERSION,
                        moved[0], human_bytes(moved[1]), self.root)

    def close(self) -> None:
        """Release the index (see ``Index.close``)."""
        self.index.close()

    # -- removal -----------------------------------------------------------------------

    def remove(self, keys: list[bytes], *, only_if: Callable[[bytes, EntryRecord], bool] | None = None,
               release: bool = True) -> list[bytes]:
        """Drop entries (and the chunks and pack files no longer used) in one transaction;
        ``only_if(key, record)`` is asked inside it. Files go after the commit. Returns the
        keys removed; unreadable records are left to ``verify --fix``. ``release=False``:
        their own segments are not theirs (``BlobError.foreign``) and are not released."""
        def run(t: WriteTxn) -> list[bytes]:
            out = []
            for key in keys:
                try:
                    rec = t.entry(key)
                except RecordError:
                    continue
                if rec is not None and (only_if is None or only_if(key, rec)):
                    t.remove_entry(key, release=release)
                    out.append(key)
            return out

        return self.index.transact(run)

    def drop_chunk_and_users(self, key: bytes, *, release: bool = True) -> None:
        """Drop a damaged chunk and every entry built on it (none of them can be restored),
        so rewriting one of those entries stores it whole again. ``release=False``: the
        chunk's segment is not its own (``BlobError.foreign``) and is not released."""
        def run(t: WriteTxn) -> None:
            for ek in t.keys("entries"):
                try:
                    rec = t.entry(ek)
                except RecordError:
                    continue
                if rec is not None and key in rec.chunks:
                    t.remove_entry(ek)
            t.remove_chunk(key, release=release)

        self.index.transact(run)

    def forget_whole(self, key: bytes, seg: Segment, *, release: bool = True) -> bool:
        """Drop entry ``key``'s whole copy ``seg`` (``disk.whole``) if its record still names
        it, the pack released (the file goes after the commit) unless ``release`` is False
        (the copy's header names another record: the pack is not the copy's). The entry
        and its segments stay. True if it was dropped."""
        def run(t: WriteTxn) -> bool:
            try:
                rec = t.entry(key)
            except RecordError:
                return False
            if rec is None or rec.whole != seg:
                return False
            t.set_entry(key, rec.with_whole(None))
            if release:
                t.release(seg)
            return True

        return self.index.transact(run)

    def touch(self, hits: dict[bytes, tuple[float, int]]) -> None:
        """Record uses: ``key -> (when, extra hits)``; missing or unreadable keys skipped."""
        def run(t: WriteTxn) -> None:
            for key, (when, n) in hits.items():
                try:
                    rec = t.entry(key)
                except RecordError:
                    continue
                if rec is not None:
                    t.set_entry(key, rec.touched(when, n))

        self.index.transact(run)

