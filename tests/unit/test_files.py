"""kvstore.files: temporary names are unpredictable and files are created exclusively."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_temp_names_are_unpredictable_and_exclusive(tmp_path: Path) -> None:
    """``replace_file`` writes through a new random name each time and never opens an
    existing one; ``create`` refuses a FIFO or symlink at its name at once."""
    from kvstore import files

    names = {files.temp_name(tmp_path / "clean") for _ in range(100)}
    assert len(names) == 100 and all(files.TEMP_NAME.fullmatch(n.name) for n in names)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "target", tmp_path / "link")
    for n in ("fifo", "link"):
        with pytest.raises(FileExistsError):
            files.create(tmp_path / n)
    assert not (tmp_path / "target").exists()
    files.replace_file(tmp_path / "link", b"x")
    assert (tmp_path / "link").read_bytes() == b"x" and not (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link"]
