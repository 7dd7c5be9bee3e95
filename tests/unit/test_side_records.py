"""kvstore.side_records: bounded record directories, ordered by kvstore's own sequence,
counted by ls / stats / the disk budget and trimmed by gc; planted files left alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvstore import side_records as sr

NAMES = [f"{k:032x}.json" for k in range(8)]


def _dir(root: Path, **bounds: int) -> sr.RecordDir:
    opts = {"max_count": 100, "max_bytes": 1 << 20, "max_record": 4096, **bounds}
    return sr.RecordDir(root / sr.DIRECTORIES[0], **opts)


def test_count_and_byte_bounds_evict_by_sequence_not_mtime(tmp_path: Path) -> None:
    d = _dir(tmp_path, max_count=3)
    for name in NAMES[:3]:
        d.write(name, {"v": name})
    os.utime(d.path / NAMES[0], (4e9, 4e9))  # the oldest made to look newest
    d = _dir(tmp_path, max_count=3)  # another process: the order comes from the records
    d.write(NAMES[3], {"v": 3})
    assert sorted(p.name for p in d.path.iterdir()) == NAMES[1:4]
    assert d.read(NAMES[1]) is not None  # read: counts as used in this process
    d.write(NAMES[4], {"v": 4})
    assert sorted(p.name for p in d.path.iterdir()) == [NAMES[1], NAMES[3], NAMES[4]]
    small = _dir(tmp_path / "b", max_bytes=100)
    (tmp_path / "b").mkdir()
    for name in NAMES:
        small.write(name, {"v": "x" * 30})
    assert sum(p.stat().st_size for p in small.path.iterdir()) <= 100


def test_a_record_over_its_cap_is_refused_and_names_are_checked(tmp_path: Path) -> None:
    d = _dir(tmp_path, max_record=64)
    with pytest.raises(ValueError, match="more than the 64"):
        d.write(NAMES[0], {"v": "x" * 100})
    for bad in ("../x.json", "ABC.json", NAMES[0] + "x"):
        with pytest.raises(ValueError, match="not a record name"):
            d.write(bad, {})
        assert d.read(bad) is None
    d.write(NAMES[1], {"v": "\ud800 surrogate"})  # lone surrogates round-trip (escaped)
    assert (d.read(NAMES[1]) or {}).get("v") == "\ud800 surrogate"


def test_planted_files_are_never_read_counted_or_removed(tmp_path: Path) -> None:
    """A symlink, a FIFO, a directory and foreign names in a record directory: not
    counted, not read, not removed; damaged records are no record and go first."""
    d = _dir(tmp_path, max_count=2)
    d.path.mkdir()
    secret = tmp_path / "secret"
    secret.write_text('{"seq": 99}')
    os.symlink(secret, d.path / NAMES[5])
    os.mkfifo(d.path / NAMES[6])
    (d.path / NAMES[7]).mkdir()
    (d.path / "notes.txt").write_text("mine")
    (d.path / NAMES[4]).write_text("{not json")
    assert sr.usage(tmp_path)[sr.DIRECTORIES[0]].count == 1
    assert d.read(NAMES[5]) is None and d.read(NAMES[6]) is None and d.read(NAMES[4]) is None
    for name in NAMES[:3]:
        d.write(name, {})
    left = sorted(p.name for p in d.path.iterdir())
    assert left == sorted([NAMES[1], NAMES[2], NAMES[5], NAMES[6], NAMES[7], "notes.txt"])
    assert secret.read_text() == '{"seq": 99}'


def test_usage_budget_and_trim(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    for name in NAMES[:4]:
        d.write(name, {"v": "x" * 200})
    sizes = {p.name: p.stat().st_size for p in d.path.iterdir()}
    total = sum(sizes.values())
    assert sr.usage(tmp_path)[sr.DIRECTORIES[0]] == sr.Usage(4, total) and sr.total_bytes(tmp_path) == total
    assert sr.budget_for(tmp_path, total + 10) == 10 and sr.budget_for(tmp_path, 5) == 0
    assert sr.bound(1 << 20, None) == 1 << 20 and sr.bound(1 << 20, 4000) == 1000
    planned = sr.trim(tmp_path, total - 1, dry_run=True)
    assert [n for _, n, _ in planned] == NAMES[:1] and len(list(d.path.iterdir())) == 4
    gone = sr.trim(tmp_path, sizes[NAMES[3]])
    assert [n for _, n, _ in gone] == NAMES[:3] and [p.name for p in d.path.iterdir()] == NAMES[3:4]
    assert json.loads((d.path / NAMES[3]).read_text())["seq"] == 3
    assert sr.usage(tmp_path / "nowhere")[sr.DIRECTORIES[0]] == sr.Usage()
