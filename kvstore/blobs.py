"""The blob format: one safetensors file per chunk, tail or snapshot, written crash-safe.

The framing is the published safetensors layout (8-byte little-endian header length, JSON
header with dtype / shape / data_offsets and ``__metadata__``, raw little-endian data), so
any safetensors reader opens a blob (tests check ``safetensors.safe_open`` and
``mx.load``). kvstore writes and parses the framing itself because it must stream KV views
straight to the file while hashing them, and read a file straight into the memory of the
arrays it restores (or into their token slices) while hashing it; the ``safetensors``
binding's Python API changed shape between 0.4 and 0.8 and offers neither.

Guarantees:
- ``write_blob`` makes a file appear under its final name only complete and fsynced:
  temp file in the same directory, fsync, rename, fsync the directory (F_FULLFSYNC on macOS).
- ``read_blob`` / ``Blob.read`` return arrays only if size and xxh3-128 checksum match the
  index record; anything else raises ``BlobError`` (the store turns that into a miss).
  ``Blob.read_into`` fills caller-owned arrays: they hold unverified bytes until it
  returns, and a caller that gets a ``BlobError`` drops them.
"""

from __future__ import annotations

import json
import math
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


# Bytes read (and hashed right after, while still in cache) per readinto call.
_PIECE = 1 << 20


class Blob:
    """An open blob whose size matched its index record and whose header parsed. Nothing in
    it is verified yet, ``meta`` and ``specs`` included, until ``read``/``read_into``
    returns; their shapes are only bounded (they exactly cover the file's data section).

    ``specs``: name -> (safetensors dtype, shape), in file order.
    """

    def __init__(self, path: Path, size: int, checksum: str) -> None:
        self.path, self.checksum = path, checksum
        try:
            self._f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise BlobError(f"{path.name}: blob file is missing") from None
        except OSError as e:
            raise BlobError(f"{path.name}: {e}") from None
        try:
            actual = os.fstat(self._f.fileno()).st_size
            if actual != size:
                raise BlobError(f"{path.name}: size {actual}, index says {size}")
            if size < 8:
                raise BlobError(f"{path.name}: shorter than its 8-byte header length")
            head = self._exact(8)
            self.prefix = head + self._exact(min(struct.unpack("<Q", head)[0], size - 8))
            header, start = parse_header(self.prefix)
            meta = header.pop("__metadata__", {}) or {}
            self.meta: dict[str, str] = meta if isinstance(meta, dict) else {}
            self.specs = _specs(header, size - start)
        except OSError as e:
            self.close()
            raise BlobError(f"{path.name}: {e}") from None
        except BaseException:
            self.close()
            raise

    def _exact(self, n: int) -> bytes:
        b = self._f.read(n)
        if len(b) != n:
            raise BlobError(f"{self.path.name}: short read")
        return b

    def close(self) -> None:
        self._f.close()

    def read_into(self, dests: dict[str, tuple[str, np.ndarray]]) -> None:
        """Read the tensors straight into ``dests`` (name -> (expected safetensors dtype,
        writable numpy array of the stored shape and host dtype: C-contiguous, or a slice
        of one along axis -2)), hashing the bytes as they land; raises BlobError if a
        tensor is not the one expected or the bytes do not match the checksum, and always
        closes the file. Until it returns, the arrays hold unverified bytes: a caller that
        gets a BlobError must drop them. numpy, I/O and xxhash only (no MLX): callable
        from any thread."""
        try:
            if set(dests) != set(self.specs):
                raise BlobError(f"{self.path.name}: tensors {sorted(self.specs)}, expected {sorted(dests)}")
            h = xxhash.xxh3_128(self.prefix)
            for name, (st, shape) in self.specs.items():
                want, d = dests[name]
                if st != want or d.shape != shape or d.dtype != np.dtype(_FROM_ST[st][1]):
                    raise BlobError(f"{self.path.name}: tensor {name!r} is {st} {list(shape)}, "
                                    f"expected {want} {list(d.shape)}")
                for piece in _pieces(d):
                    if self._f.readinto(piece) != len(piece):
                        raise BlobError(f"{self.path.name}: short read")
                    h.update(piece)
        except OSError as e:
            raise BlobError(f"{self.path.name}: {e}") from None
        finally:
            self.close()
        if h.hexdigest() != self.checksum:
            raise BlobError(f"{self.path.name}: checksum mismatch")

    def read(self) -> dict[str, mx.array]:
        """The verified tensors as fresh MLX arrays (allocated, then read into directly).
        Runs MLX ops: call it on the thread that uses the arrays."""
        arrays, hosts = empty(self.specs)
        self.read_into({name: (st, hosts[name]) for name, (st, _) in self.specs.items()})
        return {name: finish(st, arrays[name]) for name, (st, _) in self.specs.items()}


def _specs(header: dict[str, Any], data_size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor specs in file order; BlobError unless they tile ``data_size`` bytes exactly."""
    try:
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        end = 0
        for name, spec in items:
            st = spec["dtype"]
            shape = tuple(int(d) for d in spec["shape"])
            a, b = (int(x) for x in spec["data_offsets"])
            nbytes = np.dtype(_FROM_ST[st][1]).itemsize * math.prod(shape)
            if min(shape, default=0) < 0 or a != end or b - a != nbytes:
                raise BlobError(f"tensor {name!r}: offsets {a}-{b} do not fit {st} {list(shape)}")
            out[name] = (st, shape)
            end = b
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise BlobError(f"malformed tensor entry: {e!r}") from None
    if end != data_size:
        raise BlobError(f"tensors cover {end} bytes of a {data_size}-byte data section")
    return out


def _pieces(a: np.ndarray):
    """Writable byte views covering ``a`` in C order, each contiguous, at most _PIECE long."""
    rows = [a] if a.flags.c_contiguous else (a[i] for i in np.ndindex(a.shape[:-2]))
    for r in rows:
        if not r.flags.c_contiguous or not r.flags.writeable:
            raise ValueError("destination is not writable in contiguous rows")
        mv = memoryview(r.reshape(-1).view(np.uint8))
        for i in range(0, len(mv), _PIECE):
            yield mv[i : i + _PIECE]


# Read straight into MLX's memory (numpy views of evaluated arrays). If an MLX build ever
# hands numpy a copy instead, restores fall back to numpy buffers and one copy into MLX.
SHARED_MEMORY = True


def empty(specs: dict[str, tuple[str, tuple[int, ...]]]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Destinations for stored tensor specs (bfloat16 as its uint16 storage): fresh
    evaluated MLX arrays and writable numpy views of their memory (or, where MLX does not
    share its memory, numpy buffers standing in for the arrays). Write the views before any
    MLX op uses the arrays, then hand out ``finish(st, array)``. Runs MLX ops (caller's
    thread)."""
    global SHARED_MEMORY
    if SHARED_MEMORY:
        arrays = {name: mx.zeros(shape, _storage_dtype(st)) for name, (st, shape) in specs.items()}
        mx.eval(list(arrays.values()))
        hosts = {name: np.asarray(a) for name, a in arrays.items()}
        if not any(h.flags.owndata or not h.flags.writeable for h in hosts.values()):
            return arrays, hosts
        SHARED_MEMORY = False  # a copy would lose the data
    hosts = {name: np.empty(shape, _FROM_ST[st][1]) for name, (st, shape) in specs.items()}
    return dict(hosts), hosts


def _storage_dtype(st: str) -> mx.Dtype:
    name = {"BF16": "uint16", "BOOL": "bool_"}.get(st) or _FROM_ST[st][0]
    return getattr(mx, name)


def finish(st: str, a: Any) -> mx.array:
    """The MLX array of a filled destination from ``empty``."""
    if isinstance(a, np.ndarray):
        a = mx.array(a, dtype=_storage_dtype(st))
    return a.view(mx.bfloat16) if st == "BF16" else a


def read_blob(path: Path, size: int, checksum: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Read, verify and decode one blob. Raises BlobError on any mismatch.

    The bytes go from the file straight into the returned arrays' memory and are hashed
    there; the arrays are returned only once size and checksum matched."""
    blob = Blob(path, size, checksum)
    try:
        return blob.read(), blob.meta
    finally:
        blob.close()


def decode_blob(buf: memoryview) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Arrays (copies) and metadata from verified blob bytes already in memory. Restores
    do not use it (``Blob`` reads straight into the arrays); kept for tools."""
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
