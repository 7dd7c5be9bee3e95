"""``verify`` (fsck) and its repairs, and ``rebuild_index`` for an index LMDB cannot read.

``verify`` is modelled on python-diskcache's ``check(fix=True)``: it returns typed
``Problem`` records and repairs them when asked. Repairs re-check their condition inside
the write transaction that applies them, so a record a server commits between the scan and
the repair is never dropped by mistake. Files are only judged by age: a blob a live writer
has renamed into place but not yet committed looks exactly like an orphan, so blob files
younger than ``blob_age`` (and temp files younger than ``tmp_age``) are left alone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import lmdb

from .. import blobs
from ..index import chunk_edges, drop_edges, entry_edges
from ..keys import KEY_BYTES
from .pages import _walk_all
from .records import (BLOB_KINDS, KINDS, ORPHAN_BLOB_SECONDS, STALE_TMP_SECONDS, Problem, Snapshot, _chunk_mismatch,
                      _chunk_ok, _entry_mismatch, _entry_ok, _parse, _refcounts, check_blob, snapshot)

if TYPE_CHECKING:  # maintenance needs no MLX itself; DiskTier is only a type here
    from ..disk import DiskTier

def _files(disk: DiskTier) -> list[tuple[Path, os.stat_result]]:
    """Every regular file under blobs/, plus temp files at the top of the cache dir."""
    out = []
    if disk.blob_root.is_dir():
        for dirpath, _dirs, names in os.walk(disk.blob_root):
            for n in names:
                p = Path(dirpath) / n
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                out.append((p, st))
    try:
        for p in disk.root.iterdir():
            if p.name.endswith(blobs.TMP_SUFFIX) and p.is_file():
                out.append((p, p.stat()))
    except (FileNotFoundError, NotADirectoryError):
        pass
    return out


def verify(disk: DiskTier, *, fix: bool = False, checksums: bool = True,
           tmp_age: float = STALE_TMP_SECONDS, blob_age: float = ORPHAN_BLOB_SECONDS,
           now: float | None = None) -> list[Problem]:
    """Check every record against its blob files and every file against the index.

    With ``fix``, repair each problem (``Problem.fixed`` says which were): broken entries
    are removed through ``DiskTier.remove`` (refcounts stay right), broken chunks are
    dropped together with the entries built on them, refcounts are recounted, dangling
    trie edges and orphan token records deleted, orphan blobs and stale temp files
    unlinked. ``checksums=False`` checks sizes only (cheap; ``gc`` uses it).

    Never raises for a damaged directory: an index LMDB cannot read (or whose B-tree no
    longer finds its own keys) is reported as one ``corrupt_index`` problem; ``fix``
    rebuilds it from its readable records (``rebuild_index``) and then verifies the result.
    """
    kw = dict(checksums=checksums, tmp_age=tmp_age, blob_age=blob_age, now=now)
    try:
        return _verify(disk, fix=fix, **kw)  # type: ignore[arg-type]
    except lmdb.Error as e:
        bad = Problem("corrupt_index", None, str(Path("index") / "data.mdb"),
                      f"the index is damaged ({type(e).__name__}: {e})", "meta")
    if not fix:
        bad.detail += ("; `kvstore verify --fix` rebuilds it from its readable records (restart the "
                       "servers using this directory afterwards)")
        return [bad]
    try:
        how = rebuild_index(disk)
    except (lmdb.Error, OSError) as e:
        bad.detail += f"; rebuilding it failed ({e}): stop the servers and move {disk.index.path} aside"
        return [bad]
    bad.fixed = True
    bad.detail += f"; rebuilt from its readable records ({how}): restart the servers using this directory"
    try:
        return [bad] + _verify(disk, fix=True, **kw)  # type: ignore[arg-type]
    except lmdb.Error as e:
        return [bad, Problem("corrupt_index", None, bad.path, f"still unreadable after the rebuild: {e}", "meta")]


def rebuild_index(disk: DiskTier) -> str:
    """Copy every record LMDB can still read into a fresh index, swap it in place of the
    damaged one (kept as ``index.corrupt-<time>``) and point ``disk`` at it.

    The copy re-inserts keys, so a B-tree whose keys were out of order comes back ordered;
    records on unreadable pages are lost (their blobs become orphans ``verify --fix``
    removes). Processes that still have the old index open keep reading it safely, but what
    they write from then on is not seen by the new one: restart them.
    """
    from ..index import _DBS, Index

    old = disk.index
    path = old.path
    psize = old.env.stat()["psize"]
    for _ in range(20):  # read the pages ourselves: LMDB would abort on a damaged one
        try:
            with old.env.begin() as txn:  # pins the snapshot while its pages are read
                lost, salvaged = _walk_all(path / "data.mdb", psize, txn.id(), collect=True)
            break
        except LookupError:
            continue
    else:
        lost, salvaged = _walk_all(path / "data.mdb", psize, None, collect=True)
    salvaged = {name: salvaged.get(name, []) for name in _DBS}
    stamp = f"{int(time.time())}-{os.getpid()}"
    tmp = path.with_name(f"{path.name}.rebuild-{stamp}")
    new = Index(tmp)

    def copy(txn: Any) -> int:
        n = 0
        for name, got in salvaged.items():
            for k, v in got:
                if name == "meta" and k == b"format":
                    continue  # the fresh index wrote its own
                try:
                    txn.put(k, v, db=new._db[name])
                    n += 1
                except lmdb.Error:  # a key LMDB cannot hold (damaged length)
                    pass
        return n

    kept = new.write(copy)
    new.close()
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    os.replace(path, aside)
    os.replace(tmp, path)
    # The old environment is left open, not closed: another thread or Index of this process
    # (a KVStore's writer) may be inside a transaction on it. It is only taken out of the
    # index module's per-process registry, so that opening the path again maps the new files.
    _forget_shared(old)
    disk.index = Index(path)
    skipped = f"; skipped {len(lost)} damaged part(s), first: {lost[0]}" if lost else ""
    return f"{kept} records kept{skipped}; old index in {aside.name}"


def _verify(disk: DiskTier, *, fix: bool, checksums: bool, tmp_age: float, blob_age: float,
            now: float | None) -> list[Problem]:
    now = time.time() if now is None else now
    files = _files(disk)  # list files before reading the index: a blob committed in
    snap = snapshot(disk, check=True)  # between is then seen as indexed, not as an orphan
    problems: list[Problem] = []
    bounds = {edge: kind for _, _, kind, edge in snap.bounds}
    rel_root = disk.root

    def relpath(rel_blob: str) -> str:
        return str(Path(disk.blob_root.relative_to(rel_root)) / rel_blob)

    def still(kind: str, key: bytes, rec: dict) -> bool:
        """The record still exists as scanned (a concurrent gc did not just drop it)."""
        cur = disk.index.entry(key) if kind == "entry" else disk.index.chunk(key)
        return cur is not None and cur.get("blob") == rec.get("blob")

    # entries
    for key, rec in snap.entries.items():
        hx = key.hex()
        if rec is None:
            problems.append(Problem("bad_record", hx, None, "entry record is unreadable (not JSON, or fields missing)", "entry"))
            continue
        toks = snap.tokens.get(key)
        why = _entry_mismatch(key, rec, toks)
        if why:
            problems.append(Problem("bad_record", hx, None, why, "entry"))
            continue
        gone = _missing_edge(entry_edges(key, rec, toks), bounds, b"e")
        if gone is not None:
            problems.append(Problem("missing_bound", (gone or key).hex(), None,
                                    f"entry {hx[:12]} lacks a trie edge: lookups cannot reach it", "bound"))
        missing = [ck for ck in rec.get("chunks", []) if bytes.fromhex(ck) not in snap.chunks]
        if missing:
            problems.append(Problem("missing_chunk", hx, None,
                                    f"{len(missing)} of {len(rec.get('chunks', []))} chunk records missing "
                                    f"(first {missing[0][:12]})", "entry"))
            continue
        if rec.get("blob"):
            bad = check_blob(disk.blob_root / rec["blob"], int(rec.get("size", -1)), rec.get("checksum"),
                             checksums=checksums)
            if bad is not None and still("entry", key, rec):
                problems.append(Problem(bad[0], hx, relpath(rec["blob"]), bad[1], "entry"))

    # chunks
    actual_refs = _refcounts(snap.entries.values())
    for key, rec in snap.chunks.items():
        hx = key.hex()
        if rec is None:
            problems.append(Problem("bad_record", hx, None, "chunk record is unreadable (not JSON, or fields missing)", "chunk"))
            continue
        why = _chunk_mismatch(key, rec, snap.tokens.get(key))
        if why:
            problems.append(Problem("bad_record", hx, None, why, "chunk"))
            continue
        bad = check_blob(disk.blob_root / rec.get("blob", ""), int(rec.get("size", -1)), rec.get("checksum"),
                         checksums=checksums)
        if bad is not None and still("chunk", key, rec):
            problems.append(Problem(bad[0], hx, relpath(rec.get("blob", "")), bad[1], "chunk"))
            continue
        gone = _missing_edge(chunk_edges(key, rec, snap.tokens.get(key)), bounds, b"c")
        if gone is not None:
            problems.append(Problem("missing_bound", (gone or key).hex(), None,
                                    f"chunk {hx[:12]} lacks a trie edge: entries built on it cannot be reached",
                                    "bound"))
        have, want = rec.get("refs", 0), actual_refs.get(key, 0)
        if want == 0:
            problems.append(Problem("orphan_chunk", hx, relpath(rec["blob"]),
                                    f"refs={have} but no entry references it", "chunk", int(rec.get("size", 0))))
        elif have != want:
            problems.append(Problem("orphan_chunk", hx, None,
                                    f"refcount drift: refs={have}, {want} entries reference it", "chunk"))

    # trie edges
    bad_records = {p.key for p in problems if p.kind == "bad_record"}  # their edges follow them
    for b, c, kind, edge in snap.bounds:
        target = snap.entries.get(c, False) if kind == b"e" else snap.chunks.get(c, False) if kind == b"c" else False
        why = None
        if kind not in (b"e", b"c"):
            why = f"unknown edge kind {kind!r}"
        elif target is False:
            why = f"points at {'entry' if kind == b'e' else 'chunk'} {c.hex()[:12]}, which does not exist"
        elif target is not None and c.hex() not in bad_records:  # a bad record's edges go with it
            want = _edges_of(c, kind, target, snap.tokens.get(c))
            if want is not None and edge not in want:
                why = (f"edge from {b.hex()[:12]} to {c.hex()[:12]} is not one the record's boundary and "
                       "token ids make: lookups seek past it")
        if why:
            problems.append(Problem("dangling_bound", edge.hex(), None, why, "bound"))

    for key in snap.tokens:
        if key not in snap.entries and key not in snap.chunks:
            problems.append(Problem("orphan_tokens", key.hex(), None, "token ids of no entry or chunk", "tokens"))

    counted = sum(int((r or {}).get("size") or 0) for r in snap.entries.values())
    counted += sum(int((r or {}).get("size") or 0) for r in snap.chunks.values())
    if counted != snap.meta_bytes:
        problems.append(Problem("bytes_drift", None, None,
                                f"index counts {snap.meta_bytes} blob bytes, its records hold {counted}", "meta"))

    # files
    named = {rec["blob"] for rec in list(snap.entries.values()) + list(snap.chunks.values())
             if rec and rec.get("blob")}
    for path, st in files:
        age = now - st.st_mtime
        rel = str(path.relative_to(rel_root))
        if path.name.endswith(blobs.TMP_SUFFIX):
            if age >= tmp_age:
                problems.append(Problem("stale_tmp", None, rel, f"temp file {age:.0f}s old", "file", st.st_size))
            continue
        if path.parent == disk.root:
            continue
        if str(path.relative_to(disk.blob_root)) not in named and age >= blob_age:
            problems.append(Problem("orphan_blob", _key_of_file(path), rel,
                                    f"no record names this file ({age:.0f}s old)", "file", st.st_size))

    problems.sort(key=lambda p: KINDS.index(p.kind))
    if fix:
        _fix(disk, problems, snap, tmp_age=tmp_age, blob_age=blob_age)
    return problems


def _key_of_file(path: Path) -> str | None:
    stem = path.name.split("-", 1)[0]
    try:
        return bytes.fromhex(stem).hex() if len(stem) == 2 * KEY_BYTES else None
    except ValueError:
        return None


# ----------------------------------------------------------------------------- repairs


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _fix(disk: DiskTier, problems: list[Problem], snap: Snapshot, *, tmp_age: float, blob_age: float) -> None:
    idx = disk.index
    db = idx._db
    by_kind: dict[str, list[Problem]] = {}
    for p in problems:
        by_kind.setdefault(p.kind, []).append(p)

    broken_entries = [p for p in problems if p.record == "entry"]
    raw_entries = [bytes.fromhex(p.key) for p in broken_entries if snap.entries.get(bytes.fromhex(p.key)) is None]

    # 1. broken chunks: drop the record (unlink after commit), then every entry built on it
    raw_chunks: list[bytes] = []  # unreadable chunk records dropped (blobs found by name)
    bad_chunks = {bytes.fromhex(p.key): p for p in problems if p.record == "chunk" and p.kind in BLOB_KINDS + ("bad_record",)}
    if bad_chunks:
        def drop_chunks(txn: Any) -> tuple[list[str], list[bytes]]:
            unlink: list[str] = []
            freed = 0
            for ck, p in bad_chunks.items():
                raw = txn.get(ck, db=db["chunks"])
                if raw is None:
                    continue
                crec = _chunk_ok(_parse(raw))
                orig = snap.chunks.get(ck)
                if crec is not None and orig is not None and crec.get("blob") != orig.get("blob"):
                    continue  # rewritten meanwhile: not the record we judged
                if crec is None:
                    _drop_raw(txn, db, {ck}, "chunks")
                    raw_chunks.append(ck)
                    continue
                if crec.get("parent"):
                    drop_edges(txn, db["bounds"], bytes.fromhex(crec["parent"]), ck,
                               chunk_edges(ck, crec, txn.get(ck, db=db["tokens"])))
                txn.delete(ck, db=db["chunks"])
                txn.delete(ck, db=db["tokens"])
                unlink.append(crec.get("blob", ""))
                freed += int(crec.get("size", 0))
            idx._add_bytes(txn, -freed)
            hexes = {ck.hex() for ck in bad_chunks}
            users = [bytes(k) for k, v in txn.cursor(db=db["entries"])
                     if hexes.intersection((_entry_ok(_parse(v)) or {}).get("chunks", []))]
            return unlink, users
        unlink, users = idx.write(drop_chunks)
        disk._unlink([u for u in unlink if u])
        _unlink_named(disk, raw_chunks)
        if users:
            _safe_remove(disk, users)
        for ck, p in bad_chunks.items():
            p.fixed = idx.read(lambda t, ck=ck: t.get(ck, db=db["chunks"])) is None

    # 2. broken entries: removed through the normal path (chunk refcounts stay right)
    good_json = [p for p in broken_entries if snap.entries.get(bytes.fromhex(p.key)) is not None]
    for p in good_json:
        key = bytes.fromhex(p.key)
        orig = snap.entries[key]
        assert orig is not None
        _safe_remove(disk, [key], only_if=lambda _, r, o=orig: r.get("blob") == o.get("blob")
                     and r.get("chunks") == o.get("chunks"))
        p.fixed = idx.entry(key) is None
    if raw_entries:
        idx.write(lambda txn: _drop_raw(txn, db, set(raw_entries), "entries"))
        _unlink_named(disk, raw_entries)
        for p in broken_entries:
            if bytes.fromhex(p.key) in raw_entries:
                p.fixed = True

    # 3. files: orphans re-checked against the index just before unlinking
    now = time.time()
    for p in by_kind.get("orphan_blob", []):
        path = disk.root / p.path  # type: ignore[operator]
        rel = str(path.relative_to(disk.blob_root))
        try:
            st = path.stat()
        except FileNotFoundError:
            p.fixed = True
            continue
        if now - st.st_mtime < blob_age:
            continue
        if p.key is not None and _names(disk, bytes.fromhex(p.key), rel):
            continue  # a writer committed it after all
        p.fixed = _unlink(path)
    for p in by_kind.get("stale_tmp", []):
        p.fixed = _unlink(disk.root / p.path)  # type: ignore[operator]

    # 4. one sweep, re-read inside its write transaction: orphan chunks (refcounts recounted),
    # dangling trie edges, orphan token ids and the byte counter. It also cleans up after
    # steps 1-2 where a damaged record misled the removal (a wrong parent or chunk list).
    if any(p.record != "file" for p in problems):
        disk._unlink(idx.write(lambda txn: _sweep(txn, idx)))
        for kind in ("orphan_chunk", "dangling_bound", "missing_bound", "orphan_tokens", "bytes_drift"):
            for p in by_kind.get(kind, []):
                p.fixed = True


def _sweep(txn: Any, idx: Any) -> list[str]:
    """In one write transaction: drop chunks no entry references (blobs returned for the
    caller to unlink after the commit), set drifted refcounts, delete trie edges and token
    ids that point at nothing, and recompute the byte counter. Everything is re-read inside
    the transaction, so a concurrent writer's commit is either fully seen or not at all."""
    db = idx._db
    entries = {bytes(k): _entry_ok(_parse(v)) for k, v in txn.cursor(db=db["entries"])}
    chunks = {bytes(k): _chunk_ok(_parse(v)) for k, v in txn.cursor(db=db["chunks"])}
    refs = _refcounts(entries.values())
    unlink: list[str] = []
    for ck, crec in list(chunks.items()):
        if crec is None:
            continue
        want = refs.get(ck, 0)
        if want == 0:
            txn.delete(ck, db=db["chunks"])
            unlink.append(crec["blob"])
            del chunks[ck]
        elif crec["refs"] != want:
            txn.put(ck, _dump(dict(crec, refs=want)), db=db["chunks"])
    dead = []
    for k, v in txn.cursor(db=db["bounds"]):
        k, v = bytes(k), bytes(v)
        c = k[-KEY_BYTES:]
        rec = entries.get(c) if v == b"e" else chunks.get(c) if v == b"c" else None
        want = _edges_of(c, v, rec, txn.get(c, db=db["tokens"])) if rec is not None else None
        if rec is None or k not in (want or ()):
            dead.append(k)
    for k in dead:
        txn.delete(k, db=db["bounds"])
    for key, rec in list(entries.items()) + list(chunks.items()):  # every record reachable again
        kind = b"e" if key in entries else b"c"
        for edge in (_edges_of(key, kind, rec, txn.get(key, db=db["tokens"])) if rec is not None else None) or []:
            if txn.get(edge, db=db["bounds"]) != kind:
                txn.put(edge, kind, db=db["bounds"])
    stale = [bytes(k) for k in txn.cursor(db=db["tokens"]).iternext(keys=True, values=False)
             if bytes(k) not in entries and bytes(k) not in chunks]
    for k in stale:
        txn.delete(k, db=db["tokens"])
    total = sum(int(r.get("size") or 0) for r in entries.values() if r)
    total += sum(int(r.get("size") or 0) for r in chunks.values() if r)
    txn.put(b"bytes", str(total).encode(), db=db["meta"])
    return unlink


def _edges_of(key: bytes, kind: bytes, rec: dict, tokens: bytes | None) -> list[bytes] | None:
    """The trie edges a record should have (None: unknown, its token ids are damaged)."""
    return entry_edges(key, rec, tokens) if kind == b"e" else chunk_edges(key, rec, tokens)


def _missing_edge(want: list[bytes] | None, have: dict[bytes, bytes], kind: bytes) -> bytes | None:
    """The first edge of ``want`` not in the index (b"" if ``want`` is unknown), or None."""
    if want is None:
        return b""
    return next((e for e in want if have.get(e) != kind), None)


def _forget_shared(old: Any) -> None:
    """Drop ``old``'s environment from ``kvstore.index``'s per-process registry (which hands
    every Index on one path the same environment) without closing it."""
    from .. import index as I

    shared, lock = getattr(I, "_SHARED", None), getattr(I, "_SHARED_LOCK", None)
    if shared is None or lock is None:
        return
    with lock:
        for key, got in list(shared.items()):
            if got[0] is old.env:
                del shared[key]


def _safe_remove(disk: DiskTier, keys: list[bytes], only_if: Callable[[bytes, dict], bool] | None = None) -> bool:
    """DiskTier.remove, except that a malformed record in the way (which remove_entries
    cannot read) leaves the entry for the next repair instead of raising."""
    try:
        disk.remove(keys, only_if=only_if)
        return True
    except (ValueError, KeyError, TypeError):
        return False


def _names(disk: DiskTier, key: bytes, rel: str) -> bool:
    """Whether the entry or chunk record under ``key`` names blob ``rel`` (raw read: an
    unreadable record names nothing)."""
    db = disk.index._db

    def run(txn: Any) -> bool:
        for name in ("entries", "chunks"):
            rec = _parse(txn.get(key, db=db[name]) or b"null")
            if rec is not None and rec.get("blob") == rel:
                return True
        return False

    return disk.index.read(run)


def _unlink_named(disk: DiskTier, keys: list[bytes]) -> None:
    """After dropping unparsable records: their blobs, found by the key in the file name
    (``<key hex>-<rand>.safetensors``), unless a record names the file again."""
    for key in keys:
        hx = key.hex()
        for path in (disk.blob_root / hx[:2]).glob(f"{hx}-*{blobs.BLOB_SUFFIX}"):
            if not _names(disk, key, str(path.relative_to(disk.blob_root))):
                _unlink(path)


def _drop_raw(txn: Any, db: dict, keys: set[bytes], name: str) -> None:
    """Delete unparsable records, their token ids and every trie edge to them."""
    for key in keys:
        txn.delete(key, db=db[name])
        txn.delete(key, db=db["tokens"])
    dead = [bytes(k) for k, _ in txn.cursor(db=db["bounds"]) if bytes(k[-KEY_BYTES:]) in keys]
    for k in dead:
        txn.delete(k, db=db["bounds"])


def _dump(rec: dict) -> bytes:
    import json
    return json.dumps(rec, separators=(",", ":")).encode()
