"""kvstore.maintenance in process: verify (each problem kind found and repaired), budgets and gc
rules, on real stores written by KVStore with tiny-llama (chunk 64)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore import maintenance as M
from kvstore.maintenance import budgets as MG, fsck as MV, pages as MP
from kvstore.index import chunk_edges, entry_edges

CHUNK = 64
DAY = 86400.0


@pytest.fixture(scope="module")
def tmpl(tmp_path_factory, tiny_llama) -> dict[str, Any]:
    from conftest import text_prompt
    from kvstore import KVStore
    from kvstore.disk import DiskTier
    from kvstore.keys import encode_tokens, key_of, root_key
    from tools.models import model_path
    from tools.oracle import prefill

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
    ident = store.identity(mdir)
    store.close()
    keys = {n: key_of(root_key(ident.digest), encode_tokens(t), CHUNK) for n, t in prompts.items()}
    now = time.time()
    used = {"P": now - 5 * DAY, "Q": now - 100, "R": now - 3 * DAY, "S": now - 50}
    disk = DiskTier(base / "cache")
    for n, k in keys.items():
        disk.index.update_entry(k, lambda r, n=n: dict(r, last_used=used[n], pinned=(n == "R")))
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


def chunk_of(disk, key: bytes, i: int) -> tuple[bytes, dict]:
    ck = bytes.fromhex(disk.index.entry(key)["chunks"][i])
    return ck, disk.index.chunk(ck)


def raw_put(disk, dbname: str, key: bytes, value: bytes | None) -> None:
    db = disk.index._db[dbname]
    disk.index.write(lambda t: t.put(key, value, db=db) if value is not None else t.delete(key, db=db))


def test_clean_store_verifies_clean(tmpl, disk):
    assert M.verify(disk, tmp_age=0, blob_age=0) == []
    assert M.verify(disk, checksums=False, tmp_age=0, blob_age=0) == []


# Each fault: (name, inject(disk, tmpl) -> None, kinds that must be reported, prompts served in
# full after the fix)
def _flip(disk, t):
    path = disk.blob_root / disk.index.entry(t["keys"]["S"])["blob"]
    b = bytearray(path.read_bytes())
    b[-1] ^= 0x80
    path.write_bytes(bytes(b))


def _truncate_shared(disk, t):  # P's first chunk is Q's too
    _, crec = chunk_of(disk, t["keys"]["P"], 0)
    os.truncate(disk.blob_root / crec["blob"], crec["size"] - 1)


def _delete(disk, t):
    os.unlink(disk.blob_root / disk.index.entry(t["keys"]["R"])["blob"])


def _orphan_blob(disk, t):
    _, crec = chunk_of(disk, t["keys"]["R"], 0)
    dst = disk.blob_root / "ab" / ("ab" * 16 + "-00000000.safetensors")
    dst.parent.mkdir(exist_ok=True)
    shutil.copyfile(disk.blob_root / crec["blob"], dst)


def _stale_tmp(disk, t):
    (disk.blob_root / "ab").mkdir(exist_ok=True)
    (disk.blob_root / "ab" / "x.safetensors.99.abcdef.tmp").write_bytes(b"half")
    (disk.root / "file-digests.json.99.tmp").write_text("{")


def _missing_chunk(disk, t):  # Q's own 4th chunk record vanishes (its blob stays: an orphan)
    ck, _ = chunk_of(disk, t["keys"]["Q"], 3)
    raw_put(disk, "chunks", ck, None)


def _refcount_drift(disk, t):
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, json.dumps(dict(crec, refs=5)).encode())


def _orphan_chunk(disk, t):  # a chunk record no entry uses (an entry removed without its chunk)
    key = t["keys"]["S"]
    rec = disk.index.entry(key)
    raw_put(disk, "entries", key, None)
    raw_put(disk, "bounds", entry_edges(key, rec, disk.index.tokens(key))[0], None)
    raw_put(disk, "tokens", key, None)
    os.unlink(disk.blob_root / rec["blob"])  # its tail is gone too; its 3 chunks linger


def _dangling_bound(disk, t):
    raw_put(disk, "bounds", b"\x01" * 16 + b"\x02" * 16, b"e")


def _orphan_tokens(disk, t):
    raw_put(disk, "tokens", b"\x03" * 16, b"\x00" * 8)


def _bytes_drift(disk, t):
    raw_put(disk, "meta", b"bytes", b"12345")


def _bad_record(disk, t):
    raw_put(disk, "entries", t["keys"]["S"], b"{not json")


def _bad_chunk_record(disk, t):
    ck, _ = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, b"\x00garbage")


def _chunk_field_renamed(field):  # a flipped byte in a field name: the record lacks it
    def inject(disk, t):
        ck, crec = chunk_of(disk, t["keys"]["R"], 1)
        crec[field[0] + "{" + field[2:]] = crec.pop(field)
        raw_put(disk, "chunks", ck, json.dumps(crec).encode())
    return inject


def _chunk_identity_flipped(disk, t):  # informational: the chunk key already binds the identity
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, json.dumps(dict(crec, identity="0" * 32)).encode())


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


def _layout_offset(disk, t):
    key = t["keys"]["S"]
    rec = disk.index.entry(key)
    rec["layout"][1]["offset"] += 1
    raw_put(disk, "entries", key, json.dumps(rec).encode())


def _chunk_parent_flipped(disk, t):  # a damaged parent misleads the removal's edge delete
    ck, crec = chunk_of(disk, t["keys"]["R"], 1)
    raw_put(disk, "chunks", ck, json.dumps(dict(crec, parent="ff" * 16)).encode())


def _entry_boundary_and_chunks_flipped(disk, t):  # ... and so do an entry's boundary and chunk list
    key = t["keys"]["Q"]
    rec = disk.index.entry(key)
    rec["boundary"] = "ee" * 16
    rec["chunks"] = rec["chunks"][:2]
    raw_put(disk, "entries", key, json.dumps(rec).encode())


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
    "stale_tmp": (_stale_tmp, {"stale_tmp"}, "PQRS"),
    "missing_chunk": (_missing_chunk, {"missing_chunk", "dangling_bound", "orphan_tokens", "orphan_blob",
                                       "bytes_drift"}, "PRS"),
    "refcount_drift": (_refcount_drift, {"orphan_chunk"}, "PQRS"),
    "orphan_chunk": (_orphan_chunk, {"orphan_chunk", "bytes_drift"}, "PQR"),
    "dangling_bound": (_dangling_bound, {"dangling_bound"}, "PQRS"),
    "orphan_tokens": (_orphan_tokens, {"orphan_tokens"}, "PQRS"),
    "bytes_drift": (_bytes_drift, {"bytes_drift"}, "PQRS"),
    "bad_chunk_record": (_bad_chunk_record, {"bad_record", "orphan_blob", "bytes_drift"}, "PQS"),
    "chunk_checksum_renamed": (_chunk_field_renamed("checksum"), {"bad_record", "orphan_blob", "bytes_drift"}, "PQS"),
    "chunk_layout_renamed": (_chunk_field_renamed("layout"), {"bad_record", "orphan_blob", "bytes_drift"}, "PQS"),
    "chunk_identity_flipped": (_chunk_identity_flipped, set(), "PQRS"),
    "entry_tokens_flipped": (_entry_tokens_flipped, {"bad_record"}, "PQR"),
    "chunk_tokens_flipped": (_chunk_tokens_flipped, {"bad_record"}, "PQS"),
    "layout_offset": (_layout_offset, {"bad_record"}, "PQR"),
    # a bad record's trie edges are part of it (not reported again); --fix's sweep removes them
    "chunk_parent_flipped": (_chunk_parent_flipped, {"bad_record"}, "PQS"),
    "entry_fields_flipped": (_entry_boundary_and_chunks_flipped, {"bad_record", "orphan_chunk"}, "PRS"),
    "entry_edge_deleted": (_entry_edge_deleted, {"missing_bound"}, "PQRS"),  # re-added
    "chunk_edge_deleted": (_chunk_edge_deleted, {"missing_bound"}, "PQRS"),
    "chunk_deep_edge_deleted": (_chunk_deep_edge_deleted, {"missing_bound"}, "PQRS"),
    "bad_record": (_bad_record, {"bad_record", "orphan_chunk", "orphan_blob", "bytes_drift"}, "PQR"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_verify_finds_and_fixes(tmpl, disk, fault):
    inject, want, full = FAULTS[fault]
    inject(disk, tmpl)
    problems = M.verify(disk, tmp_age=0, blob_age=0)
    assert kinds(problems) == want, [p.to_dict() for p in problems]
    assert all(p.kind in M.KINDS for p in problems)
    fixed = M.verify(disk, fix=True, tmp_age=0, blob_age=0)
    assert kinds(fixed) == want and all(p.fixed for p in fixed), [p.to_dict() for p in fixed]
    assert M.verify(disk, tmp_age=0, blob_age=0) == []
    # the byte counter matches the files left
    on_disk = sum(f.stat().st_size for f in disk.blob_root.rglob("*") if f.is_file())
    assert disk.index.total_bytes() == on_disk
    root = disk.root
    disk.close()
    got = served(tmpl, root)
    for name in full:
        assert got[name] == len(tmpl["prompts"][name]), (name, got)
    for name in set("PQRS") - set(full):
        assert got[name] < len(tmpl["prompts"][name]), (name, got)


def test_grace_periods(tmpl, disk):
    _orphan_blob(disk, tmpl)
    _stale_tmp(disk, tmpl)
    assert M.verify(disk) == []  # young: maybe a live writer's
    assert kinds(M.verify(disk, blob_age=0)) == {"orphan_blob"}
    old = time.time() - 300  # past the blob grace (60 s), not the temp file one (600 s)
    for f in list(disk.blob_root.rglob("ab*")) + list(disk.blob_root.rglob("*.tmp")):
        os.utime(f, (old, old))
    assert kinds(M.verify(disk)) == {"orphan_blob"}
    assert kinds(M.verify(disk, tmp_age=200)) == {"orphan_blob", "stale_tmp"}


def test_fix_leaves_a_blob_committed_after_the_scan(tmpl, disk):
    """An 'orphan' that a writer indexes between verify's scan and its repair is kept."""
    ck, crec = chunk_of(disk, tmpl["keys"]["R"], 0)
    rel = "ab/" + "ab" * 16 + "-11111111.safetensors"
    (disk.blob_root / "ab").mkdir(exist_ok=True)
    shutil.copyfile(disk.blob_root / crec["blob"], disk.blob_root / rel)
    problems = M.verify(disk, blob_age=0)
    assert kinds(problems) == {"orphan_blob"}
    # ... the writer commits: a record now names the file
    raw_put(disk, "chunks", b"\xab" * 16, json.dumps(dict(crec, blob=rel, refs=0)).encode())
    MV._fix(disk, problems, M.snapshot(disk), tmp_age=0, blob_age=0)
    assert (disk.blob_root / rel).exists() and not problems[0].fixed


def test_evict_to_dry_run_predicts_the_real_run(tmpl, disk, tmp_path):
    from kvstore.disk import DiskTier

    total = disk.index.total_bytes()
    budget = total // 3
    before = {str(f) for f in disk.root.rglob("*")}
    plan = M.evict_to(disk, budget, dry_run=True)
    assert {str(f) for f in disk.root.rglob("*")} == before and disk.index.total_bytes() == total
    other = DiskTier(shutil.copytree(disk.root, tmp_path / "other"))
    try:
        done = M.evict_to(other, budget)
        assert [k for k, _ in done] == [k for k, _ in plan]
        assert sum(r["_frees"] for _, r in done) == total - other.index.total_bytes()
        assert other.index.total_bytes() <= budget
        assert M.verify(other, tmp_age=0, blob_age=0) == []
    finally:
        other.close()
    # LRU with the pinned entry (R) last: P (5 days), then Q, S, R
    order = [k for k, _ in M.lru_order(disk.index.entries())]
    t = tmpl["keys"]
    assert order == [t["P"], t["Q"], t["S"], t["R"]]


def test_gc_rules(tmpl, disk):
    t = tmpl["keys"]
    # --max-age: P (5 days) goes, R (3 days, pinned) never does
    total = disk.index.total_bytes()
    res = M.gc(disk, max_age=DAY)
    assert [(r["key"], r["reason"]) for r in res.removed] == [(t["P"].hex(), "max_age")]
    assert res.freed == total - disk.index.total_bytes() > 0  # P's tail only: Q shares its chunks
    assert disk.index.entry(t["P"]) is None and res.removed[0]["bytes"] == res.freed
    # --max-bytes: unpinned first, LRU; the pinned entry only when nothing else is left
    res = M.gc(disk, max_bytes=1)
    assert [r["key"] for r in res.removed] == [t["Q"].hex(), t["S"].hex(), t["R"].hex()]
    assert disk.index.total_bytes() == 0 and disk.index.counts()["chunks"] == 0
    assert not [f for f in disk.blob_root.rglob("*") if f.is_file()]


def test_gc_identities_missing_models_and_dry_run(tmpl, disk):
    ident = tmpl["ident"]
    snap_files = {str(f): f.stat().st_size for f in disk.root.rglob("*") if f.is_file() and f.name != "lock.mdb"}
    res = M.gc(disk, identities=[ident.hex[:8]], dry_run=True)
    assert {r["key"] for r in res.removed} == {k.hex() for k in tmpl["keys"].values()}
    assert res.freed == disk.index.total_bytes()
    assert {str(f): f.stat().st_size for f in disk.root.rglob("*") if f.is_file() and f.name != "lock.mdb"} == snap_files
    # the model dir exists: --missing-models leaves it alone
    assert M.gc(disk, missing_models=True).removed == []
    # now point the identity at a directory that is gone
    info = dict(disk.index.identities()[ident.hex], path="/nonexistent/model")
    raw_put(disk, "identities", ident.digest, json.dumps(info).encode())
    res = M.gc(disk, missing_models=True)
    assert len(res.removed) == 4 and {r["reason"] for r in res.removed} == {"missing_model"}
    assert disk.index.counts()["entries"] == 0 and disk.index.total_bytes() == 0


def test_gc_skips_an_entry_pinned_meanwhile(tmpl, disk):
    """Removal re-checks the record in the write transaction: a pin (or use) that lands
    after gc read the index wins."""
    t = tmpl["keys"]
    rec = disk.index.entry(t["P"])
    disk.index.update_entry(t["P"], lambda r: dict(r, pinned=True))
    assert MG._remove_many(disk, [(t["P"], rec)]) == set()
    assert disk.index.entry(t["P"]) is not None
    # a use after the read saves it from --max-age (its guard re-checks the age) ...
    disk.index.update_entry(t["P"], lambda r: dict(r, pinned=False, last_used=time.time()))
    cutoff = time.time() - DAY
    assert MG._remove_many(disk, [(t["P"], rec)], guard=lambda cur: cur.get("last_used", 0) < cutoff) == set()
    assert disk.index.entry(t["P"]) is not None
    # ... but not from a size budget
    # and in a batch, only the entry whose pin changed is kept
    q = disk.index.entry(t["Q"])
    disk.index.update_entry(t["Q"], lambda r: dict(r, pinned=True))
    assert MG._remove_many(disk, [(t["P"], rec), (t["Q"], q)]) == {t["P"]}
    assert disk.index.entry(t["P"]) is None and disk.index.entry(t["Q"]) is not None


def test_blob_helpers(tmpl, disk):
    rec = disk.index.entry(tmpl["keys"]["P"])
    path = disk.blob_root / rec["blob"]
    assert M.check_blob(path, rec["size"], rec["checksum"]) is None
    assert M.check_blob(path, rec["size"] + 1, rec["checksum"])[0] == "truncated"
    assert M.check_blob(path, rec["size"], "0" * 32)[0] == "bad_checksum"
    assert M.check_blob(path, rec["size"], "0" * 32, checksums=False) is None
    assert M.check_blob(path.with_name("nope"), 1, None)[0] == "missing_blob"
    header = M.blob_header(path)
    assert header["__metadata__"]["kvstore.key"] == tmpl["keys"]["P"].hex()
    assert M.kv_dtype(rec["layout"], header) == "float32"
    assert M.kv_dtype([{"class": "QuantizedKVCache", "bits": 4, "group_size": 64}]) == "4-bit (group 64)"
    assert M.kv_dtype([{"class": "CacheList", "sub": [{"class": "QuantizedKVCache", "bits": 8,
                                                       "group_size": 32}]}]) == "8-bit (group 32)"


def test_damaged_index_is_reported_and_rebuilt(tmpl, disk, monkeypatch):
    """An index LMDB cannot read is one corrupt_index problem (never an exception);
    --fix rebuilds it from its readable records and the store serves again."""
    import lmdb

    real = MV.snapshot  # what verify calls
    fail = {"n": 0}

    def flaky(*a, **k):
        if fail["n"]:
            fail["n"] -= 1
            raise lmdb.PageNotFoundError("mdb_cursor_get: MDB_PAGE_NOTFOUND: Requested page not found")
        return real(*a, **k)

    monkeypatch.setattr(MV, "snapshot", flaky)
    monkeypatch.setattr(MG, "snapshot", flaky)
    fail["n"] = 1
    got = M.verify(disk)
    assert [p.kind for p in got] == ["corrupt_index"] and not got[0].fixed and "--fix" in got[0].detail
    fail["n"] = 1
    old_index = disk.index
    got = M.verify(disk, fix=True, tmp_age=0, blob_age=0)
    assert [p.kind for p in got] == ["corrupt_index"] and got[0].fixed, [p.to_dict() for p in got]
    assert list(disk.root.glob("index.corrupt-*"))
    assert disk.index.env is not old_index.env  # the new files, not the shared old environment
    assert disk.index.env.info()["last_txnid"] < old_index.env.info()["last_txnid"]
    assert M.verify(disk, tmp_age=0, blob_age=0) == []
    assert disk.index.counts()["entries"] == 4
    root = disk.root
    disk.close()
    got = served(tmpl, root)
    assert all(got[n] == len(t) for n, t in tmpl["prompts"].items()), got
    fail["n"] = 10
    with pytest.raises(lmdb.Error):  # budgets (gc, the store's evict_to) do raise; the CLI says so
        M.gc(None)


def test_damaged_pages_are_found_without_lmdb_and_salvaged(tmpl, disk):
    """A page that is not what its parent says (here: the identities database's root page
    claims another page number) is a corrupt_index problem found by walking the pages
    (LMDB itself would abort() on some such pages); --fix salvages every intact record."""
    import struct

    path, psize = disk.index.path / "data.mdb", disk.index.env.stat()["psize"]
    pages = MP._Pages(path, psize, None)
    subs = {}
    pages.walk(pages.main, lambda k, v, f: subs.__setitem__(k.decode(), struct.unpack("<IHHQQQQQ", v)), [], "main")
    pages.close()
    root = subs["identities"][7]
    with open(path, "r+b") as f:
        f.seek(root * psize)
        f.write((root + 7).to_bytes(8, "little"))
    got = M.verify(disk)
    assert [p.kind for p in got] == ["corrupt_index"] and "identities" in got[0].detail
    got = M.verify(disk, fix=True, tmp_age=0, blob_age=0)
    assert got[0].kind == "corrupt_index" and got[0].fixed and "skipped 1 damaged" in got[0].detail
    assert M.verify(disk, tmp_age=0, blob_age=0) == []
    assert disk.index.counts()["entries"] == 4 and disk.index.identities() == {}
    root_dir = disk.root
    disk.close()
    got = served(tmpl, root_dir)
    assert all(got[n] == len(t) for n, t in tmpl["prompts"].items()), got


def test_damaged_index_at_open_keeps_its_readable_records(tmpl, disk, caplog):
    """An index found damaged when a store opens it is moved aside and a new one starts
    with every record still readable (here all entries: the damage is in the identities
    database), so the entries keep serving; the aside copy stays for inspection."""
    import struct

    path, psize = disk.index.path / "data.mdb", disk.index.env.stat()["psize"]
    pages = MP._Pages(path, psize, None)
    subs = {}
    pages.walk(pages.main, lambda k, v, f: subs.__setitem__(k.decode(), struct.unpack("<IHHQQQQQ", v)), [], "main")
    pages.close()
    root = subs["identities"][7]
    with open(path, "r+b") as f:  # zeroed: LMDB reports MDB_CORRUPTED reading it
        f.seek(root * psize)
        f.write(bytes(psize))
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
        assert [p.kind for p in M.verify(d, tmp_age=0, blob_age=0)] == []
    finally:
        d.close()
