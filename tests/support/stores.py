"""Shared helpers for the store tests: blob-file accounting, cache digests and the oracle
on a fetch (synthetic caches are in tests.support.caches, child processes in
tests.support.children).

Import as ``import tests.support.stores as U`` (pytest's ``pythonpath`` puts the repo root on
sys.path).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
import xxhash


# Chunk size for store tests: prompts of 100-300 tokens then span several chunks plus a tail.
CHUNK = 64


# --------------------------------------------------------------------------- descriptors


@contextmanager
def out_of_descriptors(spare: int = 0) -> Iterator[None]:
    """Run the block with every file descriptor this process may open in use but ``spare``
    (opens of /dev/null, closed on the way out): the next ``open`` beyond those is EMFILE."""
    hog: list[int] = []
    try:
        while True:
            hog.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    for _ in range(min(spare, len(hog))):
        os.close(hog.pop())
    try:
        yield
    finally:
        for fd in hog:
            os.close(fd)


# --------------------------------------------------------------------------- disk accounting


def blob_files(cache_dir: str | Path) -> list[Path]:
    """Every file under ``cache_dir/blobs`` (pack files and anything else found there)."""
    root = Path(cache_dir) / "blobs"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def blob_bytes(cache_dir: str | Path) -> int:
    """Sum of the sizes of every file under ``cache_dir/blobs``."""
    return sum(p.stat().st_size for p in blob_files(cache_dir))


@dataclass(frozen=True)
class SegRef:
    """A segment on disk: the pack file it is in, and its byte range."""

    path: Path
    offset: int
    length: int


def entry_segments(store, tokens: list[int], identity) -> list[SegRef]:
    """The segments the indexed entry for exactly ``tokens`` reads (its chunks, then its own
    tail / snapshot if any), in restore order."""
    from kvstore.files import pack_path
    from kvstore.keys import encode_tokens, key_of, root_key

    disk = store.disk
    key = key_of(root_key(identity.digest), encode_tokens(tokens), disk.chunk)
    rec = disk.index.entry(key)
    assert rec is not None, "entry is not indexed"
    segs = [disk.index.chunk(c).segment for c in rec.chunks] + list(rec.segments)
    return [SegRef(pack_path(disk.blob_root, s.pack), s.offset, s.length) for s in segs]


def damage_segment(seg: SegRef, how: str) -> None:
    """Damage one segment as a failing disk or a careless hand would: ``flip`` a bit in its
    middle, ``truncate`` its pack file there (later segments of the pack go too), or
    ``delete`` the whole pack file."""
    if how == "flip":
        with open(seg.path, "r+b") as f:
            f.seek(seg.offset + seg.length // 2)
            b = f.read(1)
            f.seek(seg.offset + seg.length // 2)
            f.write(bytes([b[0] ^ 0x40]))
    elif how == "truncate":
        os.truncate(seg.path, seg.offset + seg.length // 2)
    elif how == "delete":
        seg.path.unlink()
    else:
        raise AssertionError(how)


def damaged_by(seg: SegRef, how: str, other: SegRef) -> bool:
    """Whether ``damage_segment(seg, how)`` makes ``other`` unreadable."""
    if other == seg:
        return True
    if other.path != seg.path or how == "flip":
        return False
    return how == "delete" or other.offset + other.length > seg.offset + seg.length // 2


# --------------------------------------------------------------------------- cache digests


def layer_arrays(cache: list) -> dict[str, np.ndarray]:
    """The encoded tensors of a cache (codec.encode_cache) as numpy arrays (bfloat16 as its
    uint16 bit pattern): the exact content a store keeps and restores."""
    from kvstore import codec

    tensors, _ = codec.encode_cache(cache)
    out = {}
    for name, a in tensors.items():
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        out[name] = np.array(a)
    return out


def cache_digest(cache: list) -> dict[str, Any]:
    """A JSON-able digest of a cache: its layout (with lengths) and an xxh3 of every
    encoded tensor's bytes, shape and dtype. Equal digests mean bit-identical caches."""
    from kvstore import codec

    _, layout = codec.encode_cache(cache)
    arrays = layer_arrays(cache)
    return {
        "layout": json.loads(json.dumps(layout.to_json())),
        "tensors": {k: f"{v.dtype}{list(v.shape)}:{xxhash.xxh3_64_hexdigest(np.ascontiguousarray(v).tobytes())}"
                    for k, v in sorted(arrays.items())},
    }


def offsets(cache: list) -> list[int]:
    """Every ``offset`` in a cache (CacheList members included)."""
    out = []
    for c in cache:
        for sub in getattr(c, "caches", (c,)):
            if isinstance(getattr(sub, "offset", None), int):
                out.append(sub.offset)
    return out


# --------------------------------------------------------------------------- oracle on a fetch


def check_fetched(model, fetched, prompt, ref, *, oracle: bool, trim1: bool, kv: dict) -> dict:
    """What a ``KVStore.fetch`` gave (n, tier, offsets, bit digest), then the
    restored-equals-cold oracle on it against the cold reference ``ref`` (a
    ``tools.testing.oracle.cold_run`` of ``prompt``). ``trim1``: an exact hit holds the whole
    prompt, so trim one token off to leave the oracle a token to feed. JSON-able result."""
    from tools.testing.oracle import check_restore

    out: dict[str, Any] = {"n": fetched.n, "source": fetched.source}
    if fetched.cache is None:
        return out
    out["offsets"] = offsets(fetched.cache)
    out["digest"] = cache_digest(fetched.cache)
    if oracle:
        cache, n = fetched.cache, fetched.n
        if trim1:
            for c in cache:
                assert c.trim(1) == 1
            n -= 1
        r = check_restore(model, prompt, cache, n, n_gen=ref.n_gen, reference=ref, **kv)
        out.update(ok=bool(r.ok), detail=r.detail, n_cached=n)
    return out
