"""kvstore.segments: a failed pack write leaves no file; segment metadata reads back what it wrote."""

from __future__ import annotations

import pytest

from kvstore import keys, segments


def test_pack_write_failure_leaves_nothing(tmp_path):
    class Boom:
        nbytes = 4

        def __array__(self, *a, **k):
            raise RuntimeError("boom")

    w = segments.PackWriter(tmp_path)
    with pytest.raises(RuntimeError):
        w.add({"t": ("F32", Boom())}, {})
    w.discard()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_segment_metadata_round_trips_and_names_what_differs():
    """One writer, one validating reader (``segments``): what ``to_meta`` writes reads back
    as its layout; a field that differs is named, a key naming another record marks the
    segment foreign, and a segment of another format version is refused. The version is
    the one constant ``keys.FORMAT_VERSION`` (records' tags carry it too)."""
    from kvstore import records, segments

    meta = segments.SegmentMeta("ab" * 16, "tail", b"\x01" * 16, 256, 300, [{"class": "KVCache"}])
    assert meta.expect(meta.to_meta()) == [{"class": "KVCache"}]
    for field, value, foreign in (("kvstore.key", "02" * 16, True), ("kvstore.kind", "chunk", False),
                                  ("kvstore.tokens", "0-300", False), ("kvstore.identity", "cd" * 16, False)):
        with pytest.raises(segments.SegmentMismatch, match=field) as e:
            meta.expect({**meta.to_meta(), field: value})
        assert e.value.foreign is foreign
    with pytest.raises(segments.SegmentMismatch, match=r"\(format\)"):
        meta.expect({**meta.to_meta(), "kvstore.format": str(keys.FORMAT_VERSION - 1)})
    with pytest.raises(ValueError):
        meta.expect({**meta.to_meta(), "kvstore.layout": "[{"})
    assert segments.FORMAT_TAG == str(keys.FORMAT_VERSION)
    assert {r.TAG[1] for r in (records.EntryRecord, records.ChunkRecord, records.PackRecord)} == {keys.FORMAT_VERSION}
