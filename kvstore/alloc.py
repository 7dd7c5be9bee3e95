"""MLX arrays for restores: allocated without touching their pages, filled through numpy.

``alloc`` gives MLX arrays whose memory the kernel zeroed (loaded by MLX from a sparse
scratch file) and writable numpy views of that memory, so ``segments.read_into`` reads a
segment straight into the arrays a restore hands out: one copy, from the page cache. Where
that cannot be done (no sparse files, an MLX that hands numpy a copy), numpy buffers stand
in and ``finish`` copies them into MLX once. A restore allocates its arrays in ``groups``
so the reads into the first ones start while MLX still allocates the rest. ``files`` keeps
the files and ``segments`` the framing; this module is the only one that allocates MLX
memory for them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast


from .files import BlobError, open_own
from .segments import Specs, header_prefix, host_dtype, mlx_dtype_name, read_header, read_into
from .records import Segment

if TYPE_CHECKING:
    import numpy as np

# Allocated as a same-width integer and viewed as the real dtype at the end: bfloat16 has
# no numpy dtype, and MLX's safetensors loader has no float64.
_STORAGE = {"BF16": "U16", "F64": "U64"}

# Read straight into MLX's memory (numpy views of evaluated arrays). If an MLX build ever
# hands numpy a copy instead, or the temp directory makes no sparse files, restores fall
# back to numpy buffers and one copy into MLX (for one restore only, if making the scratch
# file failed: EMFILE, ENOSPC...).
SHARED_MEMORY = True


# Bytes of one ``alloc`` call in a restore: the arrays are made a group at a time, so the
# first segments' reads start while MLX still allocates (pages the rest) of the others.
GROUP = 32 << 20
# At most this many groups, fewer the more segments an entry has (``groups``): each group is
# read from every segment (a chunked entry has one per 256 tokens), so groups multiply the
# reads. A fixed group size made them grow as the square of the length (issue 47, item 3);
# eight groups whatever the segments still made 8 x 512 reads of a 128k-token conversation,
# and measured slower than one group at 8k, 32k and 128k tokens, warm and cold (issue 56:
# docs/design.md, "The restore path").
MAX_GROUPS = 8


def fresh_bytes(n: int) -> memoryview:
    """``n`` writable bytes of new anonymous memory whose pages nobody touched yet (an
    anonymous ``mmap``, freed when the last view of it goes): a read into it faults each
    page in as it copies, one pass. Not ``numpy.empty``: numpy advises huge pages for
    large arrays, and where the kernel compacts memory for such advice on a fault
    (``defrag=madvise``, this Linux VM) a 189 MB receive took 2-5x longer. Private, not
    Python's default ``MAP_SHARED``: shared anonymous memory is shmem on Linux, whose
    faults cost about 1.4x as much CPU (a 377 MB read into it: 0.34-0.49 s against
    0.26 s, the same as ``mx.load``'s)."""
    import mmap

    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", 0))
    return memoryview(mmap.mmap(-1, max(n, 1), flags=flags) if flags else mmap.mmap(-1, max(n, 1)))[:n]


def groups(specs: Specs, nbytes: int | None = None, segments: int = 1) -> list[Specs]:
    """``specs`` cut, in order, into runs of about ``nbytes`` (every tensor whole; by
    default ``GROUP``, or larger so there are at most about ``MAX_GROUPS // segments``,
    at least one): the reads of a restore from ``segments`` segments, one per group and
    segment, stay at most about ``MAX_GROUPS`` beyond one per segment."""
    if not nbytes:
        total = sum(host_dtype(st).itemsize * math.prod(shape) for st, shape in specs.values())
        nbytes = max(GROUP, -(-total // max(1, MAX_GROUPS // max(1, segments))))
    out: list[Specs] = [{}]
    size = 0
    for name, (st, shape) in specs.items():
        if size >= nbytes:
            out.append({})
            size = 0
        out[-1][name] = (st, shape)
        size += host_dtype(st).itemsize * math.prod(shape)
    return out if out[0] else []


def alloc(specs: Specs) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Destinations for tensor specs (bfloat16 as its uint16 storage): MLX arrays whose
    memory the kernel filled with zeros, and writable numpy views of it (or, where that
    is not possible, numpy buffers standing in for the arrays). Fill the views before
    any MLX op uses the arrays, then hand out ``finish(st, array)``."""
    import numpy as np
    global SHARED_MEMORY
    if SHARED_MEMORY:
        arrays = _zeroed_by_kernel(specs)
        if arrays is not None:
            hosts = {name: np.asarray(a).view(host_dtype(specs[name][0])) for name, a in arrays.items()}
            if not any(h.flags.owndata or not h.flags.writeable for h in hosts.values()):
                return arrays, hosts
            SHARED_MEMORY = False  # a copy would lose the data
    hosts = {name: np.empty(shape, host_dtype(st)) for name, (st, shape) in specs.items()}
    return dict(hosts), hosts


def _zeroed_by_kernel(specs: Specs) -> dict[str, Any] | None:
    """Evaluated MLX arrays for ``specs``, loaded by MLX from a sparse safetensors file
    (a header, then a hole), or None if no such file can be made (``SHARED_MEMORY`` is
    turned off if the reason is that the scratch directory makes no sparse files).

    Why: MLX has no uninitialised allocation. ``mx.zeros`` touches every page from user
    code, which in a fresh process costs more than the read that follows; ``read()`` of a
    hole has the kernel fill the pages instead, and MLX reads a path with its own
    threads. A Python file object would leave the pages untouched, but MLX
    then reads through it on a worker thread that needs the GIL: while a thread holding
    the GIL waits for MLX's CPU streams (mlx-lm calls ``mx.clear_cache()`` after every
    prefill step), that deadlocks (mlx 0.32, seen beside ``--preload-background``).
    The file is unlinked as soon as MLX has opened it. It lives on a tmpfs where there is
    one (``_scratch_dir``): a disk filesystem puts zeroed pages in the page cache for a
    hole's read, which made a 940 MB restore 2-4x slower than on tmpfs here."""
    global SHARED_MEMORY
    import tempfile

    import mlx.core as mx

    header: dict[str, Any] = {}
    offset = 0
    for tname, (st, shape) in specs.items():
        st = _STORAGE.get(st, st)  # see ``_STORAGE``
        n = host_dtype(st).itemsize * math.prod(shape)
        header[tname] = {"dtype": st, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    prefix = header_prefix(header)
    try:
        fd, path = tempfile.mkstemp(prefix="kvstore-alloc-", suffix=".safetensors", dir=_scratch_dir())
    except OSError:
        return None
    try:
        os.write(fd, prefix)
        os.ftruncate(fd, len(prefix) + offset)
        if os.fstat(fd).st_blocks * 512 > len(prefix) + (1 << 20):  # not sparse: zeros written to disk
            SHARED_MEMORY = False
            return None
        arrays = cast(dict[str, Any], mx.load(path, format="safetensors"))  # a safetensors file: a dict
    except (OSError, RuntimeError, ValueError):
        return None
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
    mx.eval(list(arrays.values()))
    return arrays


def _scratch_dir() -> str | None:
    """Where ``_zeroed_by_kernel`` makes its file: ``/dev/shm`` (tmpfs: a hole reads from
    the kernel's zero page) when it is a writable directory, else the temp directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def finish(st: str, a: Any) -> Any:
    """The MLX array of a filled destination from ``alloc``."""
    import numpy as np
    import mlx.core as mx

    if isinstance(a, np.ndarray):
        a = mx.array(a.view(host_dtype(_STORAGE.get(st, st))))
    return a.view(getattr(mx, mlx_dtype_name(st))) if st in _STORAGE else a


def read_segment(path: Path, seg: Segment) -> tuple[dict[str, Any], dict[str, str]]:
    """One segment, verified, as fresh MLX arrays with its header metadata (for tools
    and tests; restores read many segments into shared arrays instead). BlobError if it
    is not kvstore's file or does not match ``seg``."""
    fd = open_own(path)
    try:
        if os.fstat(fd).st_size < seg.end:
            raise BlobError(f"{path.name}: shorter than the segment")
        header = read_header(fd, seg, path.name)
        arrays, hosts = alloc(header.specs)
        read_into(fd, seg, header, hosts, path.name)
    finally:
        os.close(fd)
    return {n: finish(header.specs[n][0], a) for n, a in arrays.items()}, header.meta
