"""The blob format: one safetensors file per chunk, tail or snapshot, written crash-safe.

The framing is the published safetensors layout (8-byte little-endian header length, JSON
header with dtype / shape / data_offsets and ``__metadata__``, raw little-endian data), so
any safetensors reader opens a blob (tests check ``safetensors.safe_open`` and
``mx.load``). kvstore writes and parses the framing itself because it must stream KV views
straight to the file while hashing them, and read a file with one ``readinto`` that is
both checksummed and turned into arrays; the ``safetensors`` binding's Python API changed
shape between 0.4 and 0.8 and offers neither.

Guarantees:
- ``write_blob`` makes a file appear under its final name only complete and fsynced:
  temp file in the same directory, fsync, rename, fsync the directory (F_FULLFSYNC on macOS).
- ``read_blob`` returns arrays only if size and xxh3-128 checksum match the index record;
  anything else raises ``BlobError`` (the store turns that into a miss).
"""

from __future__ import annotations

import json
import os
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

TMP_SUFFIX = ".tmp"
BLOB_SUFFIX = ".safetensors"

# mlx dtype name -> (safetensors dtype, numpy dtype used on the host side)
_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"), "float16": ("F16", "<f2"), "bfloat16": ("BF16", "<u2"),
    "float64": ("F64", "<f8"), "int8": ("I8", "i1"), "uint8": ("U8", "u1"),
    "int16": ("I16", "<i2"), "uint16": ("U16", "<u2"), "int32": ("I32", "<i4"),
    "uint32": ("U32", "<u4"), "int64": ("I64", "<i8"), "uint64": ("U64", "<u8"),
    "bool": ("BOOL", "?"),
}
_FROM_ST = {st: (name, npd) for name, (st, npd) in _DTYPES.items()}


class BlobError(Exception):
    """A blob is missing, truncated, corrupt or not what its index record says."""

    # set by the disk tier's restore: ("entry" | "chunk", key) of the record that failed
    record: tuple[str, bytes] | None = None


def _dtype_name(d: mx.Dtype) -> str:
    return str(d).split(".")[-1]


def host_views(tensors: dict[str, mx.array]) -> dict[str, tuple[str, Any]]:
    """Prepare tensors for a writer thread: ``name -> (safetensors dtype, evaluated array)``.

    Runs on the caller's thread (MLX ops stay there); bfloat16 becomes a free uint16 view so
    the writer needs nothing but numpy's buffer protocol.
    """
    out: dict[str, tuple[str, Any]] = {}
    for name, a in tensors.items():
        dn = _dtype_name(a.dtype)
        if dn not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {dn}, which blobs cannot hold")
        out[name] = (_DTYPES[dn][0], a.view(mx.uint16) if dn == "bfloat16" else a)
    mx.eval([a for _, a in out.values()])
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _full_fsync(fd)
    finally:
        os.close(fd)


def _full_fsync(fd: int) -> None:
    if sys.platform == "darwin":  # fsync does not reach the platter on macOS
        import fcntl
        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def write_blob(path: Path, tensors: dict[str, tuple[str, Any]], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a blob at ``path`` crash-safely; returns (size in bytes, checksum).

    ``tensors`` comes from ``host_views`` (or holds numpy arrays with their dtype tag).
    On any error the temp file is removed and nothing appears at ``path``.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        st, a = tensors[name]
        arr = np.asarray(a)
        n = arr.nbytes
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + n]}
        arrays.append(arr)
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    prefix = struct.pack("<Q", len(hb)) + hb

    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    h = xxhash.xxh3_128()
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            h.update(prefix)
            for arr in arrays:
                buf = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
                f.write(buf)
                h.update(buf)
            f.flush()
            _full_fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return len(prefix) + offset, h.hexdigest()


def parse_header(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """Header dict and the start of the data section; BlobError if malformed."""
    if len(data) < 8:
        raise BlobError("blob shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    if n > len(data) - 8:
        raise BlobError(f"header length {n} exceeds blob size {len(data)}")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as e:
        raise BlobError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise BlobError("header is not a JSON object")
    return header, 8 + n


def read_blob(path: Path, size: int, checksum: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Read, verify and decode one blob. Raises BlobError on any mismatch."""
    try:
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                raise BlobError(f"{path.name}: size {actual}, index says {size}")
            buf = bytearray(size)
            if f.readinto(buf) != size:
                raise BlobError(f"{path.name}: short read")
    except FileNotFoundError:
        raise BlobError(f"{path.name}: blob file is missing") from None
    except OSError as e:
        raise BlobError(f"{path.name}: {e}") from None
    if xxhash.xxh3_128_hexdigest(buf) != checksum:
        raise BlobError(f"{path.name}: checksum mismatch")
    return decode_blob(memoryview(buf))


def decode_blob(buf: memoryview) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Arrays and metadata from verified blob bytes."""
    header, start = parse_header(buf)
    meta = header.pop("__metadata__", {}) or {}
    out: dict[str, mx.array] = {}
    try:
        for name, spec in header.items():
            mx_name, npd = _FROM_ST[spec["dtype"]]
            a, b = spec["data_offsets"]
            arr = np.frombuffer(buf[start + a : start + b], dtype=npd).reshape(spec["shape"])
            x = mx.array(arr)
            out[name] = x.view(mx.bfloat16) if mx_name == "bfloat16" else x
    except (KeyError, ValueError, TypeError) as e:
        raise BlobError(f"malformed tensor entry: {e}") from None
    return out, meta


def blob_path(root: Path, key_hex: str) -> Path:
    """Final path of a new blob for ``key_hex``: fanned out by the key's first byte, with a
    unique suffix so a rewrite never replaces a file another process may still be removing."""
    return root / key_hex[:2] / f"{key_hex}-{uuid.uuid4().hex[:8]}{BLOB_SUFFIX}"
