"""kvstore.index.core: the LMDB lock file has real blocks before it is mapped."""

from __future__ import annotations

import os

from kvstore.disk import DiskTier


def test_lock_file_gets_real_blocks_without_posix_fallocate(tmp_path, monkeypatch):
    """Issue 31, item 12: ``lock.mdb`` was preallocated with ``posix_fallocate`` only, which
    macOS lacks: there LMDB's sparse lock file stayed sparse, and a reader-table write
    through its map on a full disk is a SIGBUS. Without posix_fallocate (taken away here,
    as on macOS) the open now writes zeros past the file's end: every byte of the lock
    file has a real block before LMDB maps it."""
    from kvstore.index.core import _LOCK_BYTES

    monkeypatch.delattr(os, "posix_fallocate")
    disk = DiskTier(tmp_path)
    try:
        st = (tmp_path / "index" / "lock.mdb").stat()
        assert st.st_size >= _LOCK_BYTES and st.st_blocks * 512 >= st.st_size, (st.st_size, st.st_blocks)
        with disk.index.env.begin() as txn:  # LMDB works on the file so made
            txn.stat()
    finally:
        disk.close()
