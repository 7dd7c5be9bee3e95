"""kvstore.maintenance in process: verify (each problem kind found and repaired), budgets and gc
rules, on real stores written by KVStore with tiny-llama (chunk 64).

The template: P (200 tokens) and Q (P + 100) share P's three chunks; R (250, pinned) and S
(210) are unrelated. Each persist wrote one pack file (its new chunks and its tail)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import files, maintenance as M
from kvstore.budget import evict_to, lru_order, remove_unchanged
from kvstore.index import scan
from kvstore.index.pages import db_roots
from kvstore.index.trie import chunk_edges, entry_edges
import importlib

from kvstore.maintenance import fsck as MV

MG = importlib.import_module("kvstore.maintenance.gc")  # the package exports the function gc

CHUNK = 64
DAY = 86400.0


@pytest.fixture(scope="module")
def tmpl(tmp_path_factory, tiny_llama) -> dict[str, Any]:
    from tests.support.prompts import text_prompt
    from kvstore import KVStore
    from kvstore.disk import DiskTier
    from kvstore.keys import encode_tokens, key_of, root_key
    from tools.testing.model_builds import model_path
    from tools.testing.oracle import prefill

    model, tok = tiny_llama
    mdir = model_path("tiny-llama")
    base = tmp_path_factory.mktemp("maint-template")
    p = text_prompt(tok, 200, seed=11)
    prompts = {"P": p, "Q": p + text_prompt(tok, 100, seed=12), "R": text_prompt(tok, 250, seed=13),
               "S": text_prompt(tok, 210, seed=14)}
    refs = {}
    store = KVStore(base / "cache", chunk_tokens=CHUNK)
    for name, toks in prompts.items():
        cache = prefill(model, toks)
        refs[name] = [np.array(c.keys[..., : len(toks), :]) for c in cache]
        store.insert(mdir, toks, cache)
        store.flush()  # one pack per entry, in this order
    ident = store.identity(mdir)
    store.close()
    keys = {n: key_of(root_key(ident.digest), encode_tokens(t), CHUNK) for n, t in prompts.items()}
    now = time.time()
    used = {"P": now - 5 * DAY, "Q": now - 100, "R": now - 3 * DAY, "S": now - 50}
    disk = DiskTier(base / "cache")
    for n, k in keys.items():
        set_entry(disk, k, last_used=used[n], pinned=(n == "R"))
    disk.close()
    return {"dir": base / "cache", "prompts": prompts, "keys": keys, "refs": refs, "model_dir": mdir,
            "ident": ident, "model": model}


@pytest.fixture
def disk(tmpl, tmp_path):
    from kvstore.disk import DiskTier

    d = tmp_path / "cache"
    shutil.copytree(tmpl["dir"], d)
    dt = DiskTier(d)
    yield dt
    dt.close()


def served(tmpl, root: Path, names=None) -> dict[str, int]:
    """Fetch each prompt (plus two tokens) from a store opened fresh: tokens restored, with the
    restored keys checked against a cold prefill's."""
    from kvstore import KVStore

    out = {}
    with KVStore(root, chunk_tokens=CHUNK, max_entries=0) as store:
        for name, toks in tmpl["prompts"].items():
            if names is not None and name not in names:
                continue
            f = store.fetch(tmpl["model_dir"], toks + [10, 33])
            if f.cache is not None:
                for layer, ref in zip(f.cache, tmpl["refs"][name]):
                    np.testing.assert_allclose(np.array(layer.keys[..., : f.n, :]), ref[..., : f.n, :], atol=1e-4)
            out[name] = f.n
    return out


def kinds(problems) -> set[str]:
    return {p.kind for p in problems}


def set_entry(disk, key: bytes, **changes) -> None:
    disk.index.transact(lambda t: t.set_entry(key, replace(t.entry(key), **changes)))


def chunk_of(disk, key: bytes, i: int):
    ck = disk.index.entry(key).chunks[i]
    return ck, disk.index.chunk(ck)


def pack_file(disk, seg) -> Path:
    return files.pack_path(disk.blob_root, seg.pack)


def raw_put(disk, dbname: str, key: bytes, value: bytes | None) -> None:
    disk.index.transact(lambda t: t.put_raw(dbname, key, value) if value is not None else t.delete_raw(dbname, key))


def test_clean_store_verifies_clean(tmpl, disk):
    assert M.verify(disk, blob_age=0) == []
    assert M.verify(disk, checksums=False, blob_age=0) == []
    assert len(list(disk.blob_root.rglob("*.kvpack"))) == 4  # one pack per persist


# Each fault: (inject(disk, tmpl) -> None, kinds that must be reported, prompts served in
# full after the fix)
def _flip(disk, t):
    seg = disk.index.entry(t["keys"]["S"]).tail
    with open(pack_file(disk, seg), "r+b") as f:
        f.seek(seg.end - 1)
        b = f.read(1)
        f.seek(seg.end - 1)
        f.write(bytes([b[0] ^ 0x80]))


def _truncate_shared(disk, t):  # P's pack holds the three chunks Q shares
    _, crec = chunk_of(disk, t["keys"]["P"], 0)
    path = pack_file(disk, crec.segment)
    os.truncate(path, path.stat().st_size - 1)


def _delete(disk, t):
    os.unlink(pack_file(disk, disk.index.entry(t["keys"]["R"]).tail))


def _orphan_blob(disk, t):
    src = pack_file(disk, disk.index.entry(t["keys"]["R"]).tail)
    dst = files.pack_path(disk.blob_root, b"\xab" * 16)
    dst.parent.mkdir(exist_ok=True)
    shutil.copyfile(src, dst)


def _missing_chunk(disk, t):  # Q's own 4th chunk record vanishes (its segment stays in Q's pack)
    ck, _ = chunk_of(disk, t["keys"]["Q"], 3)
    raw_put(disk, "chunks", ck, None)


def _refcount_drift(disk, t):
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, crec.with_refs(5).to_bytes())


def _orphan_chunk(disk, t):  # an entry removed without its chunks (its pack's tail unused too)
    key = t["keys"]["S"]
    rec = disk.index.entry(key)
    raw_put(disk, "bounds", entry_edges(key, rec, disk.index.tokens(key))[0], None)
    raw_put(disk, "entries", key, None)
    raw_put(disk, "tokens", key, None)


def _dangling_bound(disk, t):
    raw_put(disk, "bounds", b"\x01" * 16 + b"\x02" * 16, b"e")


def _orphan_tokens(disk, t):
    raw_put(disk, "tokens", b"\x03" * 16, b"\x00" * 8)


def _bytes_drift(disk, t):
    raw_put(disk, "meta", b"bytes", b"12345")


def _bad_record(disk, t):
    raw_put(disk, "entries", t["keys"]["S"], b'{"not": "ours"}')


def _bad_chunk_record(disk, t):
    ck, _ = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, b"\x00garbage")


def _chunk_record_cut(disk, t):  # a record cut short: not one kvstore writes
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, crec.to_bytes()[:-9])


def _chunk_checksum_flipped(disk, t):  # a flip in the record: its segment no longer matches
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    seg = replace(crec.segment, checksum=bytes([crec.segment.checksum[0] ^ 1]) + crec.segment.checksum[1:])
    raw_put(disk, "chunks", ck, replace(crec, segment=seg).to_bytes())


def _chunk_identity_flipped(disk, t):  # informational: the chunk key already binds the identity
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, replace(crec, identity=b"\0" * 16).to_bytes())


def _entry_tokens_flipped(disk, t):  # the entry can no longer be found by its own tokens
    key = t["keys"]["S"]
    toks = bytearray(disk.index.tokens(key))
    toks[-4] ^= 0x01
    raw_put(disk, "tokens", key, bytes(toks))


def _chunk_tokens_flipped(disk, t):
    ck, _ = chunk_of(disk, t["keys"]["R"], 2)
    toks = bytearray(disk.index.tokens(ck))
    toks[0] ^= 0x02
    raw_put(disk, "tokens", ck, bytes(toks))


def _entry_n_changed(disk, t):  # a record that says it holds another number of tokens
    key = t["keys"]["S"]
    rec = disk.index.entry(key)
    raw_put(disk, "entries", key, replace(rec, n=rec.n - 1).to_bytes())


def _chunk_parent_flipped(disk, t):  # a damaged parent misleads the removal's edge delete
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, replace(crec, parent=b"\xff" * 16).to_bytes())


def _entry_boundary_and_chunks_flipped(disk, t):  # ... and so do an entry's boundary and chunks
    key = t["keys"]["Q"]
    rec = disk.index.entry(key)
    raw_put(disk, "entries", key, replace(rec, boundary=b"\xee" * 16, chunks=rec.chunks[::-1]).to_bytes())


def _bad_pack_record(disk, t):  # R's pack record: the file's segments can no longer be vouched for
    raw_put(disk, "packs", disk.index.entry(t["keys"]["R"]).tail.pack, b"P\x03short")


def _entry_edge_deleted(disk, t):
    key = t["keys"]["P"]
    raw_put(disk, "bounds", entry_edges(key, disk.index.entry(key), disk.index.tokens(key))[0], None)


def _chunk_edge_deleted(disk, t):  # Q's and P's second chunk: the chain breaks there
    ck, crec = chunk_of(disk, t["keys"]["Q"], 1)
    raw_put(disk, "bounds", chunk_edges(ck, crec, disk.index.tokens(ck))[0], None)


def _chunk_deep_edge_deleted(disk, t):  # a chunk's 64 tokens are filed on two levels (48 + 16)
    ck, crec = chunk_of(disk, t["keys"]["Q"], 1)
    edges = chunk_edges(ck, crec, disk.index.tokens(ck))
    assert len(edges) == 2
    raw_put(disk, "bounds", edges[1], None)


FAULTS = {
    "flip": (_flip, {"bad_checksum"}, "PQR"),
    "truncate_shared_chunk": (_truncate_shared, {"truncated"}, "RS"),
    "delete": (_delete, {"missing_blob"}, "PQS"),
    "orphan_blob": (_orphan_blob, {"orphan_blob"}, "PQRS"),
    "missing_chunk": (_missing_chunk, {"missing_chunk", "dangling_bound", "orphan_tokens", "orphan_pack"}, "PRS"),
    "refcount_drift": (_refcount_drift, {"orphan_chunk"}, "PQRS"),
    "orphan_chunk": (_orphan_chunk, {"orphan_chunk", "orphan_pack"}, "PQR"),
    "dangling_bound": (_dangling_bound, {"dangling_bound"}, "PQRS"),
    "orphan_tokens": (_orphan_tokens, {"orphan_tokens"}, "PQRS"),
    "bytes_drift": (_bytes_drift, {"bytes_drift"}, "PQRS"),
    "bad_chunk_record": (_bad_chunk_record, {"bad_record", "orphan_pack"}, "PQS"),
    "chunk_record_cut": (_chunk_record_cut, {"bad_record", "orphan_pack"}, "PQS"),
    "chunk_checksum_flipped": (_chunk_checksum_flipped, {"bad_checksum"}, "PQS"),
    "chunk_identity_flipped": (_chunk_identity_flipped, set(), "PQRS"),
    "entry_tokens_flipped": (_entry_tokens_flipped, {"bad_record"}, "PQR"),
    "chunk_tokens_flipped": (_chunk_tokens_flipped, {"bad_record"}, "PQS"),
    "entry_n_changed": (_entry_n_changed, {"bad_record"}, "PQR"),
    # a bad record's trie edges are part of it (not reported again); --fix's sweep removes them
    "chunk_parent_flipped": (_chunk_parent_flipped, {"bad_record"}, "PQS"),
    "entry_fields_flipped": (_entry_boundary_and_chunks_flipped, {"bad_record"}, "PRS"),
    "bad_pack_record": (_bad_pack_record, {"bad_record", "missing_pack", "bytes_drift"}, "PQS"),
    "entry_edge_deleted": (_entry_edge_deleted, {"missing_bound"}, "PQRS"),  # re-added
    "chunk_edge_deleted": (_chunk_edge_deleted, {"missing_bound"}, "PQRS"),
    "chunk_deep_edge_deleted": (_chunk_deep_edge_deleted, {"missing_bound"}, "PQRS"),
    "bad_record": (_bad_record, {"bad_record", "orphan_chunk", "orphan_pack"}, "PQR"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_verify_finds_and_fixes(tmpl, disk, fault):
    inject, want, full = FAULTS[fault]
    inject(disk, tmpl)
    problems = M.verify(disk, blob_age=0)
    assert kinds(problems) == want, [p.to_dict() for p in problems]
    assert all(p.kind in M.KINDS for p in problems)
    fixed = M.verify(disk, fix=True, blob_age=0)
    assert kinds(fixed) == want and all(p.fixed for p in fixed), [p.to_dict() for p in fixed]
    assert M.verify(disk, blob_age=0) == []
    # the byte counter matches the pack files left
    on_disk = sum(f.stat().st_size for f in disk.blob_root.rglob("*") if f.is_file())
    assert disk.index.total_bytes() == on_disk
    root = disk.root
    disk.close()
    got = served(tmpl, root)
    for name in full:
        assert got[name] == len(tmpl["prompts"][name]), (name, got)
    for name in set("PQRS") - set(full):
        assert got[name] < len(tmpl["prompts"][name]), (name, got)


def test_fix_counts_what_a_reader_removed_since_the_scan_as_fixed(tmpl, disk, monkeypatch):
    """R's pack file is deleted; after ``verify --fix`` scanned the index, another store
    fetches R, meets the damage and drops what it read. The fix then finds those records
    gone: they are fixed (nothing is left to repair), not "could not be fixed now" (exit
    1 from ``kvstore verify --fix``: a CI failure beside a live reader), and the index is
    clean after that one run."""
    from kvstore import KVStore

    _delete(disk, tmpl)
    real_scan, met = MV.scan, []

    def scan_then_reader(*a, **kw):
        snap = real_scan(*a, **kw)
        if not met:  # the reader, a real second store on the same directory
            with KVStore(disk.root, chunk_tokens=CHUNK, max_entries=0) as other:
                f = other.fetch(tmpl["model_dir"], tmpl["prompts"]["R"] + [10, 33])
                met.append(f.n)
        return snap

    monkeypatch.setattr(MV, "scan", scan_then_reader)
    fixed = M.verify(disk, fix=True, blob_age=0)
    monkeypatch.setattr(MV, "scan", real_scan)
    assert met and met[0] < len(tmpl["prompts"]["R"]), met  # the reader did meet the damage
    assert "missing_blob" in kinds(fixed) and all(p.fixed for p in fixed), [p.to_dict() for p in fixed]
    assert M.verify(disk, blob_age=0) == []


def test_foreign_files_are_reported_and_never_touched(tmpl, disk):
    """Files kvstore did not write (another tool's, a temp file, a symlink, a pack name in
    the wrong fan-out directory) are reported and left alone by --fix and gc."""
    planted = [disk.blob_root / "ab" / "x.safetensors.99.abcdef.tmp", disk.blob_root / "sha256-0123",
               disk.blob_root / "cd" / ("ab" * 16 + ".kvpack")]
    for p in planted:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"not kvstore's")
        os.utime(p, (0, 0))
    # a fan-out name no pack of this store uses (pack ids are random: "ef" was taken 1 run in ~60)
    link = next(disk.blob_root / f"{i:02x}" for i in range(256) if not (disk.blob_root / f"{i:02x}").exists())
    link.symlink_to(disk.root / "index")
    problems = M.verify(disk, fix=True, blob_age=0)
    assert kinds(problems) == {"foreign_file"} and not any(p.fixed for p in problems)
    assert M.gc(disk, blob_age=0).removed == []
    assert all(p.exists() for p in planted) and link.is_symlink() and (disk.root / "index" / "data.mdb").exists()


def test_grace_periods(tmpl, disk):
    _orphan_blob(disk, tmpl)
    assert M.verify(disk) == []  # young: maybe a live writer's
    assert kinds(M.verify(disk, blob_age=0)) == {"orphan_blob"}
    orphan = files.pack_path(disk.blob_root, b"\xab" * 16)
    old = time.time() - 300  # past the grace (60 s)
    os.utime(orphan, (old, old))
    assert kinds(M.verify(disk)) == {"orphan_blob"}
    future = time.time() + 10 * DAY  # another host's clock: counts as now, not as forever young
    os.utime(orphan, (future, future))
    assert kinds(M.verify(disk, blob_age=0)) == {"orphan_blob"}
    assert M.gc(disk, blob_age=0).freed > 0 and not orphan.exists()


def test_an_orphan_committed_after_the_scan_is_kept(tmpl, disk):
    """A pack that a writer indexes between verify's scan and the repair is kept: the
    removal decides inside a write transaction (the writer's commit holds the same lock)."""
    _orphan_blob(disk, tmpl)
    orphan = files.pack_path(disk.blob_root, b"\xab" * 16)
    problems = M.verify(disk, blob_age=0)
    assert kinds(problems) == {"orphan_blob"}
    # ... the writer commits: a record now names the file
    raw_put(disk, "packs", b"\xab" * 16, disk.index.pack(disk.index.entry(tmpl["keys"]["R"]).tail.pack).to_bytes())
    assert M.remove_orphan(disk, b"\xab" * 16, blob_age=0) is False and orphan.exists()
    raw_put(disk, "packs", b"\xab" * 16, None)
    assert M.remove_orphan(disk, b"\xab" * 16, blob_age=0) is True and not orphan.exists()


def test_evict_to_dry_run_predicts_the_real_run(tmpl, disk, tmp_path):
    from kvstore.disk import DiskTier

    total = disk.index.total_bytes()
    budget = total // 3
    before = {str(f) for f in disk.root.rglob("*")}
    plan = evict_to(disk, budget, dry_run=True)
    assert {str(f) for f in disk.root.rglob("*")} == before and disk.index.total_bytes() == total
    other = DiskTier(shutil.copytree(disk.root, tmp_path / "other"))
    try:
        done = evict_to(other, budget)
        assert [r.key for r in done] == [r.key for r in plan]
        assert sum(r.freed for r in done) == total - other.index.total_bytes()
        assert other.index.total_bytes() <= budget
        assert M.verify(other, blob_age=0) == []
    finally:
        other.close()
    # LRU with the pinned entry (R) last: P (5 days), then Q, S, R
    snap = scan(disk.index, full=False)
    order = [k for k, _ in lru_order(snap.entries.items())]
    t = tmpl["keys"]
    assert order == [t["P"], t["Q"], t["S"], t["R"]]


def test_budget_removes_entries_that_free_space_before_old_prefixes_that_free_none(tmpl, disk):
    """P (5 days old) is the prefix Q extends: its pack holds the chunks Q uses, so removing
    P frees nothing while Q lives. A budget one byte under the total removes Q (the least
    recently used entry that frees bytes), not P and then Q: one entry lost, not two."""
    t = tmpl["keys"]
    total = disk.index.total_bytes()
    done = evict_to(disk, total - 1)
    assert [r.key for r in done] == [t["Q"]] and done[0].freed > 0
    assert disk.index.total_bytes() == total - done[0].freed <= total - 1
    assert disk.index.entry(t["P"]) is not None and disk.index.entry(t["S"]) is not None
    assert M.verify(disk, blob_age=0) == []


def test_gc_rules(tmpl, disk):
    t = tmpl["keys"]
    # --max-age: P (5 days) goes, R (3 days, pinned) never does
    total = disk.index.total_bytes()
    res = M.gc(disk, max_age=DAY)
    assert [(r["key"], r["reason"]) for r in res.removed] == [(t["P"].hex(), "max_age")]
    # P's pack also holds the three chunks Q uses: it stays (its tail is dead space until Q goes)
    assert res.freed == total - disk.index.total_bytes() == 0 and res.removed[0]["bytes"] == 0
    assert disk.index.entry(t["P"]) is None
    # --max-bytes: unpinned first, LRU; the pinned entry never unless asked for (pinned=True),
    # and then only when nothing else is left
    res = M.gc(disk, max_bytes=1)
    assert [r["key"] for r in res.removed] == [t["Q"].hex(), t["S"].hex()] and disk.index.entry(t["R"]) is not None
    assert res.entries_left == 1 and res.bytes_left == disk.index.total_bytes() > 0
    freed = res.freed
    res = M.gc(disk, max_bytes=1, pinned=True)
    assert [r["key"] for r in res.removed] == [t["R"].hex()]
    assert freed + res.freed == total and res.bytes_left == 0 and res.entries_left == 0
    assert disk.index.total_bytes() == 0 and disk.index.counts()["chunks"] == 0
    assert not [f for f in disk.blob_root.rglob("*") if f.is_file()]


def test_gc_identities_missing_models_and_dry_run(tmpl, disk):
    from kvstore.records import IdentityRecord

    ident = tmpl["ident"]
    snap_files = {str(f): f.stat().st_size for f in disk.root.rglob("*") if f.is_file() and f.name != "lock.mdb"}
    total = disk.index.total_bytes()
    res = M.gc(disk, identities=[ident.hex[:8]], dry_run=True)
    assert {r["key"] for r in res.removed} == {k.hex() for k in tmpl["keys"].values()}
    assert res.freed == total and (res.bytes_left, res.entries_left) == (0, 0)
    assert {str(f): f.stat().st_size for f in disk.root.rglob("*") if f.is_file() and f.name != "lock.mdb"} == snap_files
    res = M.gc(disk, max_bytes=total // 2, dry_run=True)  # what would be left, not today's totals
    assert 0 < res.bytes_left <= total // 2 and res.entries_left == 4 - len(res.removed)
    # the model dir exists: --missing-models leaves it alone
    assert M.gc(disk, missing_models=True).removed == []
    # now point the identity at a directory that is gone
    info = dict(disk.index.identities()[ident.hex].info, path="/nonexistent/model")
    raw_put(disk, "identities", ident.digest, IdentityRecord(info).to_bytes())
    res = M.gc(disk, missing_models=True)
    assert len(res.removed) == 4 and {r["reason"] for r in res.removed} == {"missing_model"}
    assert disk.index.counts()["entries"] == 0 and disk.index.total_bytes() == 0


def test_gc_skips_an_entry_pinned_meanwhile(tmpl, disk):
    """Removal re-checks the record in the write transaction: a pin (or use) that lands
    after gc read the index wins."""
    t = tmpl["keys"]
    rec = disk.index.entry(t["P"])
    set_entry(disk, t["P"], pinned=True)
    assert remove_unchanged(disk, [(t["P"], rec)]) == set()
    assert disk.index.entry(t["P"]) is not None
    # a use after the read saves it from --max-age (its guard re-checks the age) ...
    set_entry(disk, t["P"], pinned=False, last_used=time.time())
    cutoff = time.time() - DAY
    assert remove_unchanged(disk, [(t["P"], rec)], guard=lambda cur: cur.last_used < cutoff) == set()
    assert disk.index.entry(t["P"]) is not None
    # ... but not from a size budget; in a batch, only the entry whose pin changed is kept
    q = disk.index.entry(t["Q"])
    set_entry(disk, t["Q"], pinned=True)
    assert remove_unchanged(disk, [(t["P"], rec), (t["Q"], q)]) == {t["P"]}
    assert disk.index.entry(t["P"]) is None and disk.index.entry(t["Q"]) is not None


def test_segment_check(tmpl, disk):
    rec = disk.index.entry(tmpl["keys"]["P"])
    seg = rec.tail
    packs = {seg.pack: disk.index.pack(seg.pack)}
    with M.SegmentCheck(disk, packs) as check:
        assert check.problem(seg) is None
        assert check.problem(replace(seg, checksum=b"\0" * 16))[0] == "bad_checksum"
        assert check.problem(replace(seg, pack=b"\1" * 16))[0] == "missing_pack"
    with M.SegmentCheck(disk, packs, checksums=False) as check:
        assert check.problem(replace(seg, checksum=b"\0" * 16)) is None
    with M.SegmentCheck(disk, {seg.pack: replace(packs[seg.pack], size=packs[seg.pack].size + 1)}) as check:
        assert check.problem(seg)[0] == "truncated"
    os.unlink(pack_file(disk, seg))
    with M.SegmentCheck(disk, packs) as check:
        assert check.problem(seg)[0] == "missing_blob"


def test_damaged_index_is_reported_and_rebuilt(tmpl, disk, monkeypatch):
    """An index LMDB cannot read is one corrupt_index problem (never an exception);
    --fix rebuilds it from its readable records and the store serves again."""
    import lmdb

    real = MV.scan  # what verify calls
    fail = {"n": 0}

    def flaky(*a, **k):
        if fail["n"]:
            fail["n"] -= 1
            raise lmdb.PageNotFoundError("mdb_cursor_get: MDB_PAGE_NOTFOUND: Requested page not found")
        return real(*a, **k)

    monkeypatch.setattr(MV, "scan", flaky)
    monkeypatch.setattr(MG, "scan", flaky)
    fail["n"] = 1
    got = M.verify(disk)
    assert [p.kind for p in got] == ["corrupt_index"] and not got[0].fixed and "--fix" in got[0].detail
    fail["n"] = 1
    old_index = disk.index
    got = M.verify(disk, fix=True, blob_age=0)
    assert [p.kind for p in got] == ["corrupt_index"] and got[0].fixed, [p.to_dict() for p in got]
    assert list(disk.root.glob("index.corrupt-*"))
    assert disk.index.env is not old_index.env  # the new files, not the shared old environment
    assert disk.index.env.info()["last_txnid"] < old_index.env.info()["last_txnid"]
    assert M.verify(disk, blob_age=0) == []
    assert disk.index.counts()["entries"] == 4
    root = disk.root
    fail["n"] = 10
    with pytest.raises(lmdb.Error):  # gc's own rules do raise; the CLI says so
        M.gc(disk)
    disk.close()
    got = served(tmpl, root)
    assert all(got[n] == len(t) for n, t in tmpl["prompts"].items()), got


def _damage_root_page(disk, db: str, how: str) -> None:
    path, psize = disk.index.path / "data.mdb", disk.index.env.stat()["psize"]
    root = db_roots(path)[db]
    with open(path, "r+b") as f:
        f.seek(root * psize)
        f.write((root + 7).to_bytes(8, "little") if how == "renumber" else bytes(psize))


def test_damaged_pages_are_found_without_lmdb_and_salvaged(tmpl, disk):
    """A page that is not what its parent says (here: the identities database's root page
    claims another page number) is a corrupt_index problem found by walking the pages
    (LMDB itself would abort() on some such pages); --fix salvages every intact record."""
    _damage_root_page(disk, "identities", "renumber")
    got = M.verify(disk)
    assert [p.kind for p in got] == ["corrupt_index"] and "identities" in got[0].detail
    got = M.verify(disk, fix=True, blob_age=0)
    assert got[0].kind == "corrupt_index" and got[0].fixed and "skipped 1 damaged" in got[0].detail
    assert M.verify(disk, blob_age=0) == []
    assert disk.index.counts()["entries"] == 4 and disk.index.identities() == {}
    root_dir = disk.root
    disk.close()
    got = served(tmpl, root_dir)
    assert all(got[n] == len(t) for n, t in tmpl["prompts"].items()), got


def test_damaged_index_at_open_keeps_its_readable_records(tmpl, disk, caplog):
    """An index found damaged when a store opens it is moved aside and a new one starts
    with every record still readable (here all entries: the damage is in the identities
    database), so the entries keep serving; the aside copy stays for inspection."""
    _damage_root_page(disk, "identities", "zero")  # zeroed: LMDB reports MDB_CORRUPTED reading it
    root_dir = disk.root
    disk.close()
    with caplog.at_level("WARNING", logger="kvstore"):
        got = served(tmpl, root_dir)
    assert all(got[n] == len(t) for n, t in tmpl["prompts"].items()), got
    assert len(list(root_dir.glob("index.corrupt-*"))) == 1
    assert any("moved aside" in r.getMessage() and "kept" in r.getMessage() for r in caplog.records)
    from kvstore.disk import DiskTier

    d = DiskTier(root_dir, chunk_tokens=CHUNK)
    try:
        assert d.index.counts()["entries"] == 4
        assert [p.kind for p in M.verify(d, blob_age=0)] == []
    finally:
        d.close()


def test_verify_and_gc_out_of_file_descriptors_drop_nothing(tmp_path):
    """A directory with more pack files than the process may open at once: verify reads
    them all without running out of descriptors, and when the process is out of them
    anyway (EMFILE) verify --fix and gc stop with that error instead of taking every pack
    they could not open for missing and dropping its entry (the scale benchmark's gc at
    100,000 entries once dropped 87,938 entries that way)."""
    import random
    import resource

    from kvstore import KVStore
    from kvstore.identity import Identity
    from kvstore.model_layout import layout_of
    from tests.support.caches import synth_kv_cache
    from tests.support.stores import out_of_descriptors

    cache = synth_kv_cache(1, 1, 4, 4)
    ident = Identity.from_components({"test": "emfile", "layout": layout_of(cache)})
    rng = random.Random(5)
    with KVStore(tmp_path / "c", chunk_tokens=16) as store:
        for i in range(120):
            store.insert(ident, [rng.randrange(1, 999) for _ in range(4)], synth_kv_cache(1, 1, 4, 4, seed=i))
            store.flush()  # one pack each
    from kvstore.disk import DiskTier

    disk = DiskTier(tmp_path / "c")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 32
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 90, hard))  # fewer than 120 packs, more than verify keeps open
        assert M.verify(disk, blob_age=0) == []
        with out_of_descriptors(spare=2):  # LMDB's reads work, pack opens fail
            with pytest.raises(OSError):
                M.verify(disk, fix=True, blob_age=0)
            with pytest.raises(OSError):
                M.gc(disk, max_bytes=1 << 40)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(scan(disk.index, full=False).entries) == 120
    assert M.verify(disk, blob_age=0) == []
    disk.close()
