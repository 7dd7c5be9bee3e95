"""Whole copies (issue 56): a long entry served again is also kept as one safetensors file
that MLX's loader reads in one pass, and the copy is never trusted more than a segment.

Real stores on real files and LMDB, fresh ``KVStore`` objects for restarts. The entries are
conversations of tiny-llama's KV geometry (synthesized: the bytes are what is checked),
and every store is opened with ``whole_copy_min_bytes=0`` so a test-sized entry
qualifies (the option is a size, not behaviour). Every restore's arrays are compared with the KV inserted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from kvstore import KVStore
from kvstore.options import StoreOptions
from kvstore.budget import evict_to
from kvstore.files import pack_path
from kvstore.maintenance import verify
from tests.support.caches import kv_prefix as prefix, rand_tokens, synth_kv_cache

N = 1300           # tokens: 5 chunks of 256 and a tail
TURN = 512         # a conversation: three inserts, each pack its own
EXTRA = [7, 8, 9]  # a follow-up: the fetch restores all N tokens


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


COPY = {"whole_copy_min_bytes": 0}  # every test-sized entry qualifies for a copy


def kv(n: int, seed: int = 3) -> list[KVCache]:
    return synth_kv_cache(3, 2, n, 32, seed=seed)


def conversation(d: Path, model_dir: Path, tokens: list[int], seed: int = 3) -> list[KVCache]:
    """Store ``tokens`` as a conversation of inserts (several segments); returns its KV."""
    full = kv(len(tokens), seed)
    with KVStore(d, **COPY) as s:
        for k in [*range(TURN, len(tokens), TURN), len(tokens)]:
            s.insert(model_dir, tokens[:k], prefix(full, k))
            assert s.flush(120)
    return full


def fetch(d: Path, model_dir: Path, tokens: list[int], full: list[KVCache], **kw: Any) -> dict[str, Any]:
    """One fetch of ``tokens`` + a follow-up by a fresh store (a restart): all of
    ``tokens`` from disk, the arrays equal to ``full``'s. Returns the store's stats."""
    with KVStore(d, **{**COPY, **kw}) as s:
        got = s.fetch(model_dir, tokens + EXTRA)
        assert (got.source, got.n) == ("disk", len(tokens))
        for c, want in zip(got.cache, full):
            assert c.offset == len(tokens)
            for a, b in ((c.keys, want.keys), (c.values, want.values)):
                assert np.array_equal(np.asarray(a[..., : len(tokens), :]), np.asarray(b))
        assert s.flush(120)
        return s.stats()


def records(d: Path) -> dict[bytes, Any]:
    with KVStore(d, **COPY) as s:
        return s.disk.index.view(lambda r: {k: r.entry(k) for k in r.keys("entries")})  # type: ignore[union-attr]


def entry_of(d: Path, n: int) -> tuple[bytes, Any]:
    (key, rec), = [(k, r) for k, r in records(d).items() if r.n == n]
    return key, rec


def with_copy(tmp_path: Path, model_dir: Path) -> tuple[Path, list[int], list[KVCache], bytes, Any]:
    """A store whose N-token conversation has a whole copy: restored twice (the first
    restore is its first use, the second writes the copy)."""
    d = tmp_path / "c"
    tokens = rand_tokens(N, 1, 259)
    full = conversation(d, model_dir, tokens)
    first = fetch(d, model_dir, tokens, full)
    assert first["restores_one_pass"] == 0 and first["whole_copies_written"] == 0  # never served before
    second = fetch(d, model_dir, tokens, full)
    assert second["restores_one_pass"] == 0 and second["whole_copies_written"] == 1
    key, rec = entry_of(d, N)
    assert rec.whole is not None and rec.whole.offset == 0
    return d, tokens, full, key, rec


def test_a_copy_is_written_once_served_again_and_then_restored_from(tmp_path: Path, model_dir: Path) -> None:
    d, tokens, full, key, rec = with_copy(tmp_path, model_dir)
    path = pack_path(d / "blobs", rec.whole.pack)
    assert path.stat().st_size == rec.whole.length
    assert rec.whole.length >= sum(a.nbytes for c in full for a in (c.keys, c.values))
    third = fetch(d, model_dir, tokens, full)
    assert third["restores_one_pass"] == 1 and third["whole_copies_written"] == 0 and third["corrupt"] == 0
    from kvstore import metrics

    body = metrics.exposition(metrics.registry(lambda: third))[0].decode()
    assert "kvstore_restores_one_pass_total 1.0" in body and 'kvstore_whole_copies_total{event="written"} 0.0' in body
    assert entry_of(d, N)[1].whole == rec.whole  # one copy, kept
    from tests.system.test_cli import cli_json

    (listed,) = [e for g in cli_json("ls", cache_dir=d)["identities"] for e in g["entries"] if e["tokens"] == N]
    assert listed["whole_copy_bytes"] == rec.whole.length and listed["own_bytes"] > rec.whole.length
    with KVStore(d, **COPY) as s:
        assert verify(s.disk) == []  # type: ignore[arg-type]
        s.disk.remove([key])  # type: ignore[union-attr]
    assert not path.exists()  # the copy goes with its entry


def test_a_shorter_query_is_served_from_the_segments(tmp_path: Path, model_dir: Path) -> None:
    d, tokens, full, key, rec = with_copy(tmp_path, model_dir)
    short = tokens[:1100]
    with KVStore(d, **COPY) as s:
        got = s.fetch(model_dir, short + EXTRA)
        assert got.n == 1100 and s.stats()["restores_one_pass"] == 0
        for c, want in zip(got.cache, full):
            assert np.array_equal(np.asarray(c.keys[..., :1100, :]), np.asarray(want.keys[..., :1100, :]))


@pytest.mark.parametrize("damage", ["flip_data", "flip_header", "truncate", "symlink", "missing"])
def test_a_damaged_copy_is_dropped_and_the_entry_served_from_its_segments(
        tmp_path: Path, model_dir: Path, damage: str) -> None:
    d, tokens, full, key, rec = with_copy(tmp_path, model_dir)
    path = pack_path(d / "blobs", rec.whole.pack)
    outside = tmp_path / "outside.bin"
    data = bytearray(path.read_bytes())
    if damage == "flip_data":
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "flip_header":
        at = data.index(b'"kvstore.tokens":"0-')
        data[at + 20] = ord("9")  # the header says other tokens
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "symlink":  # a planted link: never followed, never removed, its target untouched
        outside.write_bytes(bytes(data))
        path.unlink()
        path.symlink_to(outside)
    else:
        path.unlink()
    got = fetch(d, model_dir, tokens, full)
    assert got["restores_one_pass"] == 0 and got["whole_copies_dropped"] == 1 and got["corrupt"] == 0
    key2, now = entry_of(d, N)
    assert key2 == key and now.whole is None and now.tail == rec.tail  # only the copy went
    if damage == "symlink":
        assert path.is_symlink() and outside.read_bytes() == bytes(data)
    else:
        assert not path.exists()
    with KVStore(d, **COPY) as s:
        left = [p for p in verify(s.disk) if p.kind != "foreign_file"]  # type: ignore[arg-type]
        assert left == []


def test_a_copy_naming_another_records_pack_never_releases_it(tmp_path: Path, model_dir: Path) -> None:
    """A crafted record whose copy is another entry's pack: the header names that entry, so
    the copy is forgotten and the other entry's pack keeps every segment."""
    d = tmp_path / "c"
    a_tokens, b_tokens = rand_tokens(N, 1, 259), rand_tokens(N, 2, 259)
    a_full = conversation(d, model_dir, a_tokens, 3)
    a_key = entry_of(d, N)[0]
    conversation(d, model_dir, b_tokens, 4)
    with KVStore(d, **COPY) as s:
        idx = s.disk.index  # type: ignore[union-attr]
        recs = idx.view(lambda r: {k: r.entry(k) for k in r.keys("entries")})
        a_rec = recs[a_key]
        b_rec = next(r for k, r in recs.items() if r.n == N and k != a_key)
        b_first = idx.chunk(b_rec.chunks[0]).segment  # offset 0 of B's first pack
        assert b_first.offset == 0
        before = idx.pack(b_first.pack)
        idx.transact(lambda t: t.set_entry(a_key, a_rec.with_whole(b_first)))
    got = fetch(d, model_dir, a_tokens, a_full)
    assert got["restores_one_pass"] == 0 and got["whole_copies_dropped"] == 1
    with KVStore(d, **COPY) as s:
        assert s.disk.index.pack(b_first.pack) == before  # type: ignore[union-attr]
        assert pack_path(d / "blobs", b_first.pack).exists()
        assert s.disk.index.entry(a_key).whole is None  # type: ignore[union-attr]


def test_a_budget_drops_copies_before_any_entry(tmp_path: Path, model_dir: Path) -> None:
    from tests.system.test_cli import cli_json, main_text

    d, tokens, full, key, rec = with_copy(tmp_path, model_dir)
    before = set(records(d))
    with KVStore(d, **COPY) as s:
        total = s.disk.index.total_bytes()  # type: ignore[union-attr]
        planned = evict_to(s.disk, total - 1, dry_run=True)  # type: ignore[arg-type]
        assert [(r.key, r.copy, r.freed) for r in planned] == [(key, True, rec.whole.length)]
    text = main_text("gc", "--max-bytes", total - 1, "--dry-run", cache_dir=d)
    assert f"would remove the whole copy of {key.hex()[:12]}" in text and "0 entries, 1 whole copy" in text
    out = cli_json("gc", "--max-bytes", total - 1, cache_dir=d)
    assert [(r["key"], r["reason"], r["bytes"]) for r in out["removed"]] == [(key.hex(), "whole_copy", rec.whole.length)]
    assert out["bytes_left"] == total - rec.whole.length and out["entries_left"] == len(before)
    assert set(records(d)) == before and entry_of(d, N)[1].whole is None
    assert not pack_path(d / "blobs", rec.whole.pack).exists()


def test_the_write_paths_budget_takes_the_copy_not_an_entry(tmp_path: Path, model_dir: Path) -> None:
    d, tokens, full, key, rec = with_copy(tmp_path, model_dir)
    before = set(records(d))
    with KVStore(d, **COPY) as s:
        total = s.disk.index.total_bytes()  # type: ignore[union-attr]
    with KVStore(d, max_disk_bytes=total + 4096, **COPY) as s:  # a small new entry puts it over by less than the copy
        s.insert(model_dir, tokens[:300], prefix(full, 300))
        assert s.flush(120)
        st = s.stats()
    assert st["evictions_disk"] == 0 and st["gc_runs"] == 1 and st["gc_freed_bytes"] == rec.whole.length
    assert before < set(records(d)) and entry_of(d, N)[1].whole is None


def test_no_copy_where_the_disk_budget_has_no_room(tmp_path: Path, model_dir: Path) -> None:
    d = tmp_path / "c"
    tokens = rand_tokens(N, 1, 259)
    full = conversation(d, model_dir, tokens)
    fetch(d, model_dir, tokens, full)
    with KVStore(d, **COPY) as s:
        total = s.disk.index.total_bytes()  # type: ignore[union-attr]
    got = fetch(d, model_dir, tokens, full, max_disk_bytes=total + 1000)
    assert got["whole_copies_written"] == 0 and got["evictions_disk"] == 0
    assert entry_of(d, N)[1].whole is None


def test_a_copy_of_an_entry_removed_meanwhile_is_not_kept(tmp_path: Path, model_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A gc removes the entry between the copy's write and its commit: the commit finds the
    entry gone, the file it wrote is removed, nothing names it."""
    from kvstore import codec, segments

    d = tmp_path / "c"
    tokens = rand_tokens(N, 1, 259)
    full = conversation(d, model_dir, tokens)
    fetch(d, model_dir, tokens, full)  # served once: the next restore qualifies
    key, _ = entry_of(d, N)
    with KVStore(d, **COPY) as s:
        disk = s.disk
        got = s.fetch(model_dir, tokens + EXTRA)
        assert s.flush(120) and s.stats()["whole_copies_written"] == 1  # what the copy would be
        disk.forget_whole(key, disk.index.entry(key).whole)  # type: ignore[union-attr]
        tensors, layout = codec.encode_cache(got.cache)
        host = segments.host_views(tensors)
        files_before = sorted(p.name for p in (d / "blobs").rglob("*") if p.is_file())
        seal = segments.PackWriter.seal

        def seal_then_gc(w: Any) -> None:
            seal(w)
            disk.remove([key])  # type: ignore[union-attr]

        monkeypatch.setattr(segments.PackWriter, "seal", seal_then_gc)
        assert disk.write_whole(s.identity(model_dir), key, N, host, layout) == 0  # type: ignore[union-attr]
        monkeypatch.undo()
        assert disk.index.entry(key) is None  # type: ignore[union-attr]
        left = sorted(p.name for p in (d / "blobs").rglob("*") if p.is_file())
        assert set(left) <= set(files_before)  # the copy's file is gone with nothing naming it
        assert [p for p in verify(disk) if p.kind != "foreign_file"] == []  # type: ignore[arg-type]


def test_entry_records_with_and_without_a_copy_round_trip() -> None:
    from dataclasses import replace

    from kvstore.records import EntryRecord, RecordError, Segment

    k = os.urandom(16)
    seg = Segment(os.urandom(16), 100, 50, os.urandom(16))
    copy = Segment(os.urandom(16), 0, 5000, os.urandom(16))
    rec = EntryRecord(k, 300, 256, True, True, k, (os.urandom(16),), seg)
    old = rec.to_bytes()  # the format before copies: read as it always was
    assert EntryRecord.from_bytes(old) == rec and old[3] & 16 == 0
    withc = replace(rec, whole=copy)
    assert EntryRecord.from_bytes(withc.to_bytes()) == withc
    assert withc.segments == (seg, copy)
    for bad in (withc.to_bytes()[:-1], withc.to_bytes() + b"x", old[:3] + bytes([old[3] | 16]) + old[4:],
                old[:3] + bytes([old[3] | 32]) + old[4:]):
        with pytest.raises(RecordError):
            EntryRecord.from_bytes(bad)
    with pytest.raises(RecordError):  # a copy must start a pack of its own
        replace(rec, whole=Segment(seg.pack, 0, 10, seg.checksum))
    with pytest.raises(RecordError):
        replace(rec, whole=Segment(copy.pack, 8, 10, copy.checksum))


def test_verify_reports_a_damaged_copy_and_fix_drops_only_the_copy(tmp_path: Path, model_dir: Path) -> None:
    d, tokens, full, key, rec = with_copy(tmp_path, model_dir)
    path = pack_path(d / "blobs", rec.whole.pack)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with KVStore(d, **COPY) as s:
        found = verify(s.disk)  # type: ignore[arg-type]
        assert [(p.kind, p.record, p.key) for p in found] == [("bad_checksum", "whole", key.hex())]
        fixed = verify(s.disk, fix=True)  # type: ignore[arg-type]
        assert [p.fixed for p in fixed] == [True]
        assert verify(s.disk) == []  # type: ignore[arg-type]
    key2, now = entry_of(d, N)
    assert key2 == key and now.whole is None and now.tail == rec.tail and not path.exists()
    fetch(d, model_dir, tokens, full)  # still served, from its segments


def test_the_system_write_policy_copies_no_conversation(tmp_path: Path, model_dir: Path) -> None:
    """``persist="system"`` keeps the SSD to system prompts and pinned entries: a copy is a
    write too."""
    d = tmp_path / "c"
    tokens = rand_tokens(N, 1, 259)
    full = conversation(d, model_dir, tokens)
    for _ in range(2):
        got = fetch(d, model_dir, tokens, full, persist="system")
    assert got["whole_copies_written"] == 0 and entry_of(d, N)[1].whole is None
    key, rec = entry_of(d, N)
    with KVStore(d, **COPY) as s:
        s.disk.index.transact(lambda t: t.set_entry(key, rec.pinned_as(True)))  # type: ignore[union-attr]
    assert fetch(d, model_dir, tokens, full, persist="system")["whole_copies_written"] == 1  # pinned: copied


def test_a_bfloat16_entry_round_trips_through_its_copy(tmp_path: Path) -> None:
    """bfloat16 (no numpy dtype: stored as its uint16 bits) loads and hashes as written."""
    from kvstore import Identity

    model_dir = Identity.from_components({"test": "whole-copies-bf16"}, name="bf16-kv")  # an identity of no model
    d = tmp_path / "c"
    tokens = rand_tokens(N, 1, 259)
    full = synth_kv_cache(3, 2, N, 32, seed=5, dtype=mx.bfloat16)
    with KVStore(d, **COPY) as s:
        for k in [*range(TURN, N, TURN), N]:
            s.insert(model_dir, tokens[:k], prefix(full, k))
            assert s.flush(120)

    def fetched() -> dict[str, Any]:
        with KVStore(d, **COPY) as s:
            got = s.fetch(model_dir, tokens + EXTRA)
            assert (got.source, got.n) == ("disk", N)
            for c, want in zip(got.cache, full):
                assert c.keys.dtype == mx.bfloat16 and c.values.dtype == mx.bfloat16
                assert mx.array_equal(c.keys[..., :N, :], want.keys).item()
                assert mx.array_equal(c.values[..., :N, :], want.values).item()
            assert s.flush(120)
            return s.stats()

    fetched()
    assert fetched()["whole_copies_written"] == 1
    assert fetched()["restores_one_pass"] == 1


# ----------------------------------------------------------------------------- snapshots


def snapshot_store(d: Path, tokens: list[int]) -> tuple[Any, Path]:
    """A snapshot entry (a recurrent-state layer: stored whole, one segment) and its pack."""
    from tests.support.caches import ident, synth

    who = ident("whole-copies-snapshot")
    with KVStore(d, **COPY) as s:
        s.insert(who, tokens, synth(tokens, snapshot=True))
        assert s.flush(120)
    (rec,) = records(d).values()
    assert not rec.chunked and rec.tail.offset == 0
    return who, pack_path(d / "blobs", rec.tail.pack)


def test_a_snapshot_alone_in_its_pack_is_read_in_one_pass(tmp_path: Path) -> None:
    from tests.support.caches import assert_synth

    tokens = list(range(100, 400))
    who, path = snapshot_store(tmp_path / "c", tokens)
    with KVStore(tmp_path / "c", **COPY) as s:
        got = s.fetch(who, tokens + EXTRA)
        assert (got.source, got.n) == ("disk", len(tokens)) and s.stats()["restores_one_pass"] == 1
        assert_synth(got.cache, tokens, snapshot=True)
    with path.open("ab") as f:  # a pack holding more than the segment: read from the segment instead
        f.write(b"\0" * 64)
    with KVStore(tmp_path / "c", **COPY) as s:
        got = s.fetch(who, tokens + EXTRA)
        assert got.source == "disk" and s.stats()["restores_one_pass"] == 0
        assert_synth(got.cache, tokens, snapshot=True)


@pytest.mark.parametrize("damage", ["flip_data", "flip_header_key", "truncate"])
def test_a_damaged_snapshot_read_in_one_pass_is_a_miss_and_dropped(tmp_path: Path, damage: str) -> None:
    tokens = list(range(100, 400))
    who, path = snapshot_store(tmp_path / "c", tokens)
    data = bytearray(path.read_bytes())
    if damage == "flip_data":
        data[-3] ^= 0x01
    elif damage == "flip_header_key":
        at = data.index(b'"kvstore.key":"') + 15
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    else:
        data = data[: len(data) - 8]
    path.write_bytes(bytes(data))
    with KVStore(tmp_path / "c", **COPY) as s:
        got = s.fetch(who, tokens + EXTRA)
        st = s.stats()
        assert got.source is None and st["restores_one_pass"] == 0 and st["corrupt"] == 1
    assert records(tmp_path / "c") == {}  # dropped: the next insert stores it again


def test_copies_are_an_option_and_a_bad_value_is_refused(tmp_path: Path, model_dir: Path) -> None:
    d = tmp_path / "c"
    tokens = rand_tokens(N, 1, 259)
    full = conversation(d, model_dir, tokens)
    for _ in range(3):  # served again and again, but copies are switched off
        got = fetch(d, model_dir, tokens, full, whole_copy_min_bytes=None)
    assert got["whole_copies_written"] == 0 and entry_of(d, N)[1].whole is None
    default = fetch(d, model_dir, tokens, full, whole_copy_min_bytes=StoreOptions().whole_copy_min_bytes)
    assert default["whole_copies_written"] == 0  # the default, 64 MB: this entry is 2 MB
    for bad in (-1, 1.5, "64M", True):
        with pytest.raises(ValueError, match="whole_copy_min_bytes"):
            KVStore(d, whole_copy_min_bytes=bad)

