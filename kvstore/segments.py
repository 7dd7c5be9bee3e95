"""The segment format: one writer and one reader of kvstore's safetensors segments.

A persist writes ONE pack file (``PackWriter``) holding every new segment of the entry (its
new chunks and its tail or snapshot). Each segment is a complete safetensors buffer (8-byte
little-endian header length, JSON header with dtype / shape / data_offsets and
``__metadata__``, raw data), so any safetensors reader opens a segment cut out of its pack;
its xxh3-128 is its checksum. kvstore writes and parses the framing here and nowhere else:
it streams KV views straight to the file while hashing them, and reads a file straight into
the memory of the arrays it restores. Which files it may open, create or remove to do so is
``files``' to say.

Guarantees:
- One dtype table (``_DTYPES``: MLX name, safetensors code, host numpy dtype); every
  mapping between them is read from it (``host_dtype``, ``mlx_dtype_name``).
- Every segment carries a ``SegmentMeta`` (``to_meta``) naming the format version, the
  identity, what it is (``snapshot``, ``chunk`` or ``tail``), the key of the record it
  belongs to, the token range it holds and its cache layout. A restore reads it back
  through ``expect`` before allocating anything: a segment whose metadata is not exactly
  what its record says is refused, so a pack file moved, copied or crafted under another
  record's name is never read as that record's KV. Nothing else in kvstore builds or
  parses these fields (``stored_layout`` reads the layout for display, unchecked: what a
  layout may hold is ``layout.Layout.from_json``'s to say).
- ``parse_header`` accepts only a header whose tensors exactly tile the segment, so nothing
  a header says makes a reader allocate more than the segment holds.
- ``PackWriter`` writes a new, never reused name (``files.create_own``): a crash leaves at
  most an unnamed file, which the index never points at. ``seal`` makes it durable
  (``files.sync``) before any record names it.
- ``read_into`` / ``SegmentRead`` hand back nothing unverified: a size, header or checksum
  mismatch raises ``BlobError``, and the caller drops the arrays it was filling.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import xxhash

from .files import PRIVATE, BlobError, Modes, create_own, make_dir, pack_path, sync, sync_dir, unlink_own
from .keys import FORMAT_VERSION
from .keys import KEY_BYTES
from .records import Segment

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np

MAX_HEADER = 16 << 20  # bytes of one segment's JSON header
_PIECE = 1 << 20       # bytes read (or written) and hashed at a time: still in cache when hashed
_SPAN = 4 << 20        # bytes of one restore read task: a segment is read by several at once
_IOV_MAX = 512

# mlx dtype name -> (safetensors dtype, numpy dtype used on the host side)
_DTYPES: dict[str, tuple[str, str]] = {
    "float32": ("F32", "<f4"), "float16": ("F16", "<f2"), "bfloat16": ("BF16", "<u2"),
    "float64": ("F64", "<f8"), "int8": ("I8", "i1"), "uint8": ("U8", "u1"),
    "int16": ("I16", "<i2"), "uint16": ("U16", "<u2"), "int32": ("I32", "<i4"),
    "uint32": ("U32", "<u4"), "int64": ("I64", "<i8"), "uint64": ("U64", "<u8"),
    "bool": ("BOOL", "?"),
}
_FROM_ST = {st: (name, npd) for name, (st, npd) in _DTYPES.items()}

Specs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape), file order


def host_dtype(st: str) -> np.dtype:
    """The numpy dtype holding a safetensors dtype on the host (``uint16`` for ``BF16``)."""
    import numpy as np
    return np.dtype(_FROM_ST[st][1])


class _HostDtypes(dict):
    """``host_dtype`` by safetensors dtype, filled as asked (numpy imported only then)."""

    def __missing__(self, st: str) -> np.dtype:
        self[st] = got = host_dtype(st)
        return got


_HOST: dict[str, np.dtype] = _HostDtypes()


def mlx_dtype_name(st: str) -> str:
    """The MLX dtype name of a safetensors dtype (``bfloat16`` for ``BF16``)."""
    return _FROM_ST[st][0]


# ----------------------------------------------------------------------------- metadata


FORMAT_TAG = str(FORMAT_VERSION)  # "kvstore.format" of every segment this version writes
KINDS = ("snapshot", "chunk", "tail", "whole")


class SegmentMismatch(ValueError):
    """A segment whose metadata is not its record's (``fields``: the ones that differ,
    ``foreign``: it names another key, i.e. it is some other record's segment)."""

    def __init__(self, fields: list[str], foreign: bool) -> None:
        super().__init__(f"the segment is not what its record says ({', '.join(fields) or 'format'})")
        self.fields = fields
        self.foreign = foreign


@dataclass(frozen=True)
class SegmentMeta:
    """One segment's own description: ``tokens [lo, hi)`` of the entry or chunk ``key``
    of identity ``identity`` (hex digest), in cache layout ``layout`` (JSON-able)."""

    identity: str
    kind: str
    key: bytes
    lo: int
    hi: int
    layout: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"segment kind {self.kind!r}")

    def fields(self) -> dict[str, str]:
        """The header fields that name the segment (all but format and layout)."""
        return {"kvstore.key": self.key.hex(), "kvstore.kind": self.kind, "kvstore.identity": self.identity,
                "kvstore.tokens": f"{self.lo}-{self.hi}"}

    def to_meta(self) -> dict[str, str]:
        """The header ``__metadata__`` to write (the one writer of segment metadata)."""
        return {"kvstore.format": FORMAT_TAG, "kvstore.identity": self.identity, "kvstore.kind": self.kind,
                "kvstore.key": self.key.hex(), "kvstore.tokens": f"{self.lo}-{self.hi}",
                "kvstore.layout": json.dumps(self.layout)}

    def expect(self, meta: Mapping[str, Any]) -> Any:
        """The stored layout (parsed JSON) of a segment whose header ``meta`` must name
        this segment (the one reader). Raises ``SegmentMismatch`` if a naming field or the
        format differs, ValueError / RecursionError if the layout is not JSON."""
        bad = [k for k, v in self.fields().items() if meta.get(k) != v]
        if bad or meta.get("kvstore.format") != FORMAT_TAG:
            raise SegmentMismatch(bad, "kvstore.key" in bad and isinstance(meta.get("kvstore.key"), str))
        return stored_layout(meta)


def stored_layout(meta: Mapping[str, Any]) -> Any:
    """The layout (parsed JSON, unchecked) a segment header's ``meta`` records; ValueError
    / RecursionError if it has none or it is not JSON."""
    return json.loads(meta.get("kvstore.layout", ""))


# ----------------------------------------------------------------------------- framing


def _dtype_name(d: Any) -> str:
    return str(d).split(".")[-1]


def own_copies() -> bool:
    """Whether the writer must read copies of a snapshot's arrays in buffers of their own
    (``host_views(copy=True)``) rather than the buffers the host's cache and the memory
    hits share: on a GPU with memory of its own (MLX's CUDA backend reports
    ``free_memory``), the first host (numpy) view of a device buffer moves it into managed
    memory and frees the device memory on a side stream, not ordered against kernels other
    streams still have queued on the old pointer (issue 55, hazard a). ``OWN_COPIES``
    decides when set; otherwise True only there (a view is free on the CPU and on Metal,
    whose memory is the host's)."""
    if OWN_COPIES is not None:
        return OWN_COPIES
    if not _asked:
        import mlx.core as mx

        try:
            _asked.append(bool(mx.is_available(mx.gpu) and "free_memory" in mx.device_info(mx.gpu)))
        except Exception:  # an MLX without device_info: no GPU memory of its own known
            _asked.append(False)
    return _asked[0]


OWN_COPIES: bool | None = None  # None: ``own_copies`` asks MLX (once)
_asked: list[bool] = []


_BITS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}  # an unsigned type of each item size


def own_copy(a: Any) -> Any:
    """``a`` bit for bit in a buffer of its own (unevaluated): its bits as unsigned integers
    plus 0, an exact new array whose input is shared (never donated), viewed back."""
    import mlx.core as mx

    bits = getattr(mx, _BITS[a.dtype.size])
    return (a.view(bits) + 0).view(a.dtype)


def host_views(tensors: dict[str, Any], evaluate: bool = True, copy: bool = False) -> dict[str, tuple[str, Any]]:
    """Prepare MLX tensors for a writer thread: ``name -> (safetensors dtype, evaluated
    array)``. Runs on the caller's thread (MLX ops stay there); bfloat16 becomes a free
    uint16 view so the writer needs nothing but numpy's buffer protocol. ``evaluate=False``:
    the arrays are returned unevaluated, for the caller to schedule (``Snapshot.schedule``).
    ``copy``: each array a copy in a buffer of its own (``own_copies`` says when)."""
    import mlx.core as mx

    out: dict[str, tuple[str, Any]] = {}
    for name, a in tensors.items():
        dn = _dtype_name(a.dtype)
        if dn not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {dn}, which blobs cannot hold")
        if copy:
            a = own_copy(a)
        out[name] = (_DTYPES[dn][0], a.view(mx.uint16) if dn == "bfloat16" else a)
    if evaluate:
        mx.eval([a for _, a in out.values()])
    return out


def byte_view(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a writable view (no copy)."""
    import numpy as np
    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12 (the checked target is 3.10)
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _rows(a: np.ndarray) -> Iterator[np.ndarray]:
    """``a`` as C-order runs of contiguous memory: itself, or its last-two-axes slabs (a
    token slice of a KV array is contiguous per head)."""
    import numpy as np
    if a.flags.c_contiguous:
        yield a
        return
    for idx in np.ndindex(a.shape[:-2]):
        r = a[idx]
        if not r.flags.c_contiguous:
            r = np.ascontiguousarray(r)
        yield r


def frame(tensors: dict[str, tuple[str, Any]], metadata: dict[str, str]) -> tuple[bytes, list[np.ndarray]]:
    """A segment's header prefix and its tensors' host arrays, in file (name) order."""
    import numpy as np
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        st, a = tensors[name]
        arr = np.asarray(a)
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        arrays.append(arr)
        offset += arr.nbytes
    return header_prefix(header), arrays


def header_prefix(header: dict[str, Any]) -> bytes:
    """The bytes of a safetensors header: its length (8 bytes, little-endian), then the
    JSON, padded with spaces to a multiple of 8."""
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb


@dataclass(frozen=True)
class Header:
    """A segment's parsed header: ``meta`` (``__metadata__``), tensor ``specs`` in file
    order, and ``start``, the bytes before the data. Unverified until the segment's
    checksum matched; its specs exactly tile the segment (nothing it says can make a reader
    allocate more than the segment holds)."""

    meta: dict[str, str]
    specs: Specs
    start: int
    prefix: bytes


def parse_header(data: bytes, length: int) -> Header:
    """The header of a segment of ``length`` bytes whose first bytes are ``data`` (at
    least 8 + the header length); BlobError if malformed or not tiling the segment."""
    if len(data) < 8 or length < 8:
        raise BlobError("segment shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(length - 8, MAX_HEADER) or n > len(data) - 8:
        raise BlobError(f"header length {n} does not fit a {length}-byte segment")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as e:
        raise BlobError(f"header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise BlobError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BlobError("header metadata is not a string map")
    return Header(meta, _specs(header, length - 8 - n), 8 + n, bytes(data[: 8 + n]))


def _specs(header: dict[str, Any], data_size: int) -> Specs:
    """Tensor specs in file order; BlobError unless they tile ``data_size`` bytes exactly."""
    import numpy as np
    try:
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        out: Specs = {}
        end = 0
        for name, spec in items:
            st = spec["dtype"]
            shape = tuple(int(d) for d in spec["shape"])
            a, b = (int(x) for x in spec["data_offsets"])
            nbytes = np.dtype(_FROM_ST[st][1]).itemsize * math.prod(shape)
            if len(shape) > 8 or min(shape, default=0) < 0 or a != end or b - a != nbytes:
                raise BlobError(f"tensor {name!r}: offsets {a}-{b} do not fit {st} {list(shape)}")
            out[str(name)] = (st, shape)
            end = b
    except (KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise BlobError(f"malformed tensor entry: {e!r}") from None
    if end != data_size:
        raise BlobError(f"tensors cover {end} bytes of a {data_size}-byte data section")
    return out


# ----------------------------------------------------------------------------- writing


class PackWriter:
    """One new pack file: ``add`` segments, ``seal`` it, then let the index name it.

    Until the index commit names it, the file is an orphan that ``gc`` may remove once old
    enough; ``still_there`` lets that commit check, inside its write transaction, that the
    file it is about to name is still the one written here."""

    def __init__(self, blob_root: Path, *, modes: Modes = PRIVATE) -> None:
        self.pack = os.urandom(KEY_BYTES)
        self.path = pack_path(blob_root, self.pack)
        self.blob_root = blob_root
        self._new_dir = make_dir(self.path.parent, modes)
        self.fd = create_own(self.path, modes)  # in kvstore's own directory, never through a symlink
        self.size = 0

    def add(self, tensors: dict[str, tuple[str, Any]], metadata: dict[str, str]) -> Segment:
        """Append one segment (``tensors`` from ``host_views``, or numpy arrays with their
        safetensors dtype); returns where it is and its checksum."""
        prefix, arrays = frame(tensors, metadata)
        h = xxhash.xxh3_128(prefix)
        start = self.size
        self._write([memoryview(prefix)])
        batch: list[memoryview] = []
        size = 0
        for arr in arrays:
            for row in _rows(arr):
                mv = byte_view(row)
                for i in range(0, len(mv), _PIECE):
                    batch.append(mv[i : i + _PIECE])
                    size += len(batch[-1])
                    if size >= _PIECE or len(batch) >= _IOV_MAX:
                        self._write(batch, h)
                        batch, size = [], 0
        self._write(batch, h)
        return Segment(self.pack, start, self.size - start, h.digest())

    def add_framed(self, data: bytes | memoryview, checksum: bytes) -> Segment:
        """Append one segment already framed elsewhere (a shared tier's copy of a segment
        some writer ``add``-ed); BlobError, with nothing appended past it that a record
        names, unless its bytes hash to ``checksum``."""
        h = xxhash.xxh3_128()
        start = self.size
        view = memoryview(data)
        for batch in _batches([view[i : i + _PIECE] for i in range(0, len(view), _PIECE)]):
            self._write(batch, h)
        if h.digest() != checksum:
            raise BlobError("segment checksum mismatch")
        return Segment(self.pack, start, self.size - start, checksum)

    def _write(self, views: list[memoryview], h: Any = None) -> None:
        while views:
            n = os.writev(self.fd, views)
            self.size += n
            done = 0
            while views and done + len(views[0]) <= n:
                done += len(views[0])
                if h is not None:
                    h.update(views[0])
                views = views[1:]
            if views and n > done:  # a short write: finish the partial view
                if h is not None:
                    h.update(views[0][: n - done])
                views[0] = views[0][n - done :]

    def seal(self) -> None:
        """Make the file and its name durable (see ``sync``)."""
        sync(self.fd)
        sync_dir(self.path.parent)
        if self._new_dir:
            sync_dir(self.blob_root)

    def still_there(self) -> bool:
        """The file at ``path`` is still the one this writer wrote (not removed by a gc)."""
        try:
            a, b = os.stat(self.path, follow_symlinks=False), os.fstat(self.fd)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        """Close and remove the file (nothing names it)."""
        self.close()
        unlink_own(self.path)


# ----------------------------------------------------------------------------- reading


def read_header(fd: int, seg: Segment, name: str = "segment") -> Header:
    """Read and parse the header of ``seg`` in the open pack ``fd`` (unverified)."""
    head = os.pread(fd, min(seg.length, 64 << 10), seg.offset)
    if len(head) >= 8:
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n > len(head) and n <= min(seg.length - 8, MAX_HEADER):
            head += os.pread(fd, 8 + n - len(head), seg.offset + len(head))
    try:
        return parse_header(head, seg.length)
    except BlobError as e:
        raise BlobError(f"{name}: {e}") from None


def read_into(fd: int, seg: Segment, header: Header, dests: dict[str, np.ndarray], name: str = "segment") -> None:
    """Read ``seg``'s tensors straight into ``dests`` (see ``SegmentRead``) on this thread
    and verify them; BlobError if a tensor is not the one expected, the file is short or
    the bytes do not match the checksum. Until it returns, ``dests`` hold unverified bytes."""
    r = SegmentRead(fd, seg, header, name)
    for i in r.add(dests):
        r.read(i)
    r.verify()


class SegmentRead:
    """One segment read straight into the arrays that will hold it, in ``spans`` of about
    ``_SPAN`` bytes that any threads may ``read`` in any order, many in flight at once.

    ``add`` gives the next tensors in file order their destinations (name -> writable
    numpy array of the stored shape and host dtype: contiguous, or a token slice of one)
    and returns the indices of their spans, so reading can start before every array
    exists. The bytes are hashed in file order as they land, by whichever reader
    completes the next span, from the memory they landed in (what is verified is what
    is handed out). ``verify`` raises BlobError unless every tensor was added, every
    span landed and the checksum matched; until it returns, the destinations hold
    unverified bytes. numpy, I/O and xxhash only: ``preadv`` and xxhash (for large
    buffers) release the GIL, so reads overlap each other and the hashing."""

    def __init__(self, fd: int, seg: Segment, header: Header, name: str = "segment", span: int = 0) -> None:
        self.fd, self.seg, self.header, self.name = fd, seg, header, name
        self.spans: list[tuple[int, list[memoryview]]] = []  # (file position, destination views)
        self._span = span or _SPAN
        self._tensors = list(header.specs)  # file order
        self._added = 0
        self._pos = seg.offset + header.start
        self._hash = xxhash.xxh3_128(header.prefix)
        self._landed: list[bool] = []
        self._next = 0          # the first span not hashed yet
        self._hashing = False   # a reader is hashing spans from ``_next`` on
        self._lock = threading.Lock()

    def add(self, dests: dict[str, np.ndarray]) -> range:
        """Destinations for the next ``len(dests)`` tensors in file order; the indices of
        their spans. BlobError if they are not those tensors, shapes and dtypes."""
        names = self._next_names(dests)
        return self._add(names, _dest_views(self.header, dests, names, self.name))

    def add_tokens(self, dests: Mapping[str, TokenRuns], lo: int, hi: int) -> range:
        """As ``add``, for tokens ``[lo, hi)`` of whole arrays (``TokenRuns``): the
        destinations are slices of views made once per array, not numpy views made per
        segment and tensor (a long conversation has one segment per 256 tokens)."""
        names = self._next_names(dests)
        return self._add(names, _run_views(self.header, dests, names, lo, hi, self.name))

    def _next_names(self, dests: Mapping[str, Any]) -> list[str]:
        names = self._tensors[self._added : self._added + len(dests)]
        if set(names) != set(dests) or (len(dests) == 0 and self._added < len(self._tensors)):
            raise BlobError(f"{self.name}: tensors {self._tensors}, expected {sorted(dests)}")
        return names

    def _add(self, names: list[str], views: list[memoryview]) -> range:
        spans = _spans(views, self._pos, self._span)
        self._added += len(names)
        if spans:
            self._pos = spans[-1][0] + sum(len(v) for v in spans[-1][1])
        if self._added == len(self._tensors) and self._pos != self.seg.end:
            raise BlobError(f"{self.name}: tensors end at {self._pos - self.seg.offset}, the segment at {self.seg.length}")
        with self._lock:
            first = len(self.spans)
            self.spans.extend(spans)
            self._landed.extend([False] * len(spans))
        return range(first, first + len(spans))

    def read(self, i: int, fd: int | None = None) -> None:
        """Read span ``i`` into its destinations (from ``fd`` if given, an open descriptor
        of the same pack file, else the one this read was made with), then hash every span
        that is next in file order and has landed (unless another reader is doing so)."""
        pos, views = self.spans[i]
        for batch in _batches(views):
            got = _preadv(self.fd if fd is None else fd, batch, pos)
            if got != sum(len(v) for v in batch):
                raise BlobError(f"{self.name}: short read (the pack file is truncated)")
            pos += got
        with self._lock:
            self._landed[i] = True
            if self._hashing or self._next != i:
                return
            self._hashing = True
        while True:
            for v in self.spans[self._next][1]:
                self._hash.update(v)
            with self._lock:
                self._next += 1
                if self._next == len(self.spans) or not self._landed[self._next]:
                    self._hashing = False
                    return

    def verify(self) -> None:
        """BlobError unless every byte landed and hashed to the segment's checksum."""
        with self._lock:
            if self._added != len(self._tensors) or self._next != len(self.spans) or self._hashing:
                raise BlobError(f"{self.name}: not every tensor was read")
        if self._hash.digest() != self.seg.checksum:
            raise BlobError(f"{self.name}: checksum mismatch")


def _dest_views(header: Header, dests: dict[str, np.ndarray], names: list[str], name: str) -> list[memoryview]:
    """The memory of ``dests`` for tensors ``names`` in file order, in pieces of at most
    ``_PIECE`` bytes; BlobError unless each has the header's shape and dtype."""
    import numpy as np
    views: list[memoryview] = []
    for tname in names:
        st, shape = header.specs[tname]
        d = dests[tname]
        if d.shape != shape or d.dtype != np.dtype(_FROM_ST[st][1]):
            raise BlobError(f"{name}: tensor {tname!r} is {st} {list(shape)}, expected {list(d.shape)} {d.dtype}")
        for mv in _dest_rows(d):
            if len(mv) <= _PIECE:
                views.append(mv)
            else:
                views.extend(mv[i : i + _PIECE] for i in range(0, len(mv), _PIECE))
    return views


class TokenRuns:
    """A contiguous, writable host array ``(..., tokens, width)`` that segments holding
    token ranges of it are read into. Its bytes are viewed once: the runs of a range
    (one per leading index, contiguous in a C-order array) are slices of that view, so a
    segment costs a few slices per tensor, not numpy views and reshapes (issue 47)."""

    __slots__ = ("dtype", "shape", "codes", "_token", "_starts", "_bytes")

    def __init__(self, a: np.ndarray) -> None:
        if not a.flags.c_contiguous or not a.flags.writeable or a.ndim < 2:
            raise RuntimeError("token runs need a contiguous, writable array with a token axis")
        self.dtype, self.shape = a.dtype, tuple(a.shape)
        self.codes = frozenset(st for st in _FROM_ST if _HOST[st] == a.dtype)  # what it may hold
        self._token = a.shape[-1] * a.dtype.itemsize
        stride = a.shape[-2] * self._token
        self._starts = [r * stride for r in range(math.prod(a.shape[:-2]))]
        self._bytes = byte_view(a)

    def shape_of(self, lo: int, hi: int) -> tuple[int, ...]:
        """The shape of tokens ``[lo, hi)`` of the array."""
        return (*self.shape[:-2], hi - lo, self.shape[-1])

    def runs(self, lo: int, hi: int) -> list[memoryview]:
        """The bytes of tokens ``[lo, hi)``, in C order, as writable views."""
        if not 0 <= lo <= hi <= self.shape[-2]:
            raise ValueError(f"tokens {lo}-{hi} of an array of {self.shape[-2]}")
        a, b, mv = lo * self._token, hi * self._token, self._bytes
        return [mv[s + a : s + b] for s in self._starts] if b > a else []


def _run_views(header: Header, dests: Mapping[str, TokenRuns], names: list[str], lo: int, hi: int,
               name: str) -> list[memoryview]:
    """``_dest_views`` for tokens ``[lo, hi)`` of ``TokenRuns``: the same checks (each
    tensor has the header's shape and dtype), the same pieces."""
    views: list[memoryview] = []
    specs = header.specs
    for tname in names:
        st, shape = specs[tname]
        d = dests[tname]
        want = d.shape_of(lo, hi)
        if want != shape or st not in d.codes:
            raise BlobError(f"{name}: tensor {tname!r} is {st} {list(shape)}, expected {list(want)} {d.dtype}")
        if (hi - lo) * d._token <= _PIECE:
            views += d.runs(lo, hi)
            continue
        for mv in d.runs(lo, hi):
            views.extend(mv[i : i + _PIECE] for i in range(0, len(mv), _PIECE))
    return views


def _spans(views: list[memoryview], pos: int, span: int) -> list[tuple[int, list[memoryview]]]:
    """``views`` (contiguous in the file from ``pos``) grouped into runs of about ``span``
    bytes: (file position, views); a run ends with the view that reaches ``span``. The
    ends are found by bisection over the running sizes (a 128k-token restore groups
    ~90,000 views: no Python per view)."""
    out: list[tuple[int, list[memoryview]]] = []
    ends = list(itertools.accumulate(map(len, views)))
    i, base = 0, 0
    while i < len(views):
        j = min(bisect.bisect_left(ends, base + span, i), len(views) - 1)
        out.append((pos + base, views[i : j + 1]))
        base, i = ends[j], j + 1
    return out


def _dest_rows(d: np.ndarray) -> list[memoryview]:
    """The memory of destination ``d`` as writable byte views in C order: one if it is
    contiguous, else one per run of its last two axes (a token slice of a KV array is
    contiguous per head). One reshape and a view per run: a restore makes one call per
    tensor per segment, thousands for a long conversation (issue 47, item 2)."""
    import numpy as np
    if not d.flags.writeable:
        raise RuntimeError("destination is not writable")  # kvstore's arrays, not the file
    if d.flags.c_contiguous:
        return [byte_view(d)]
    if d.size == 0:
        return []
    rows = d.view()
    try:  # setting the shape never copies: it raises where one view cannot hold the runs
        rows.shape = (-1, d.shape[-2] * d.shape[-1])
    except AttributeError:
        return [m for i in np.ndindex(d.shape[:-2]) for m in _dest_rows(d[i])]
    if not rows[0].flags.c_contiguous:
        raise RuntimeError("destination is not writable in contiguous rows")
    return [memoryview(r).cast("B") for r in rows]


def _batches(views: list[memoryview]) -> Iterator[list[memoryview]]:
    batch: list[memoryview] = []
    size = 0
    for v in views:
        batch.append(v)
        size += len(v)
        if size >= _PIECE or len(batch) >= _IOV_MAX:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _preadv(fd: int, views: list[memoryview], pos: int) -> int:
    """Fill ``views`` from ``pos`` (a short count only at the end of the file)."""
    if hasattr(os, "preadv"):
        total = want = sum(len(v) for v in views)
        got = os.preadv(fd, views, pos)
        while got < total:  # preadv may stop early; finish with plain preads
            done = 0
            for v in views:
                if got < done + len(v):
                    part = v[got - done :]
                    n = os.preadv(fd, [part], pos + got)
                    if n <= 0:
                        return got
                    got += n
                    break
                done += len(v)
        return min(got, want)
    got = 0
    for v in views:
        data = os.pread(fd, len(v), pos + got)
        v[: len(data)] = data
        got += len(data)
        if len(data) < len(v):
            break
    return got


def hash_segment(fd: int, seg: Segment) -> bytes:
    """xxh3-128 of a segment's bytes as they are on disk (``verify``)."""
    h = xxhash.xxh3_128()
    pos, end = seg.offset, seg.end
    while pos < end:
        data = os.pread(fd, min(8 << 20, end - pos), pos)
        if not data:
            break
        h.update(data)
        pos += len(data)
    return h.digest()
