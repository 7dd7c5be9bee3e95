"""Reading an index for maintenance: problem kinds, blob checks, one-transaction
snapshots of every record, and the consistency rules a record must meet."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import lmdb
import xxhash

from .. import blobs
from ..keys import KEY_BYTES
from .pages import check_pages

if TYPE_CHECKING:  # maintenance needs no MLX itself; DiskTier is only a type here
    from ..disk import DiskTier

STALE_TMP_SECONDS = 600  # a temp file older than this has no live writer
ORPHAN_BLOB_SECONDS = 60  # a blob file older than this and not indexed is an orphan

# Problem kinds, in the order verify reports them.
KINDS = (
    "corrupt_index",   # the LMDB index itself cannot be read (never repaired in place)
    "bad_record",      # an index record that cannot be used (unparsable, no token ids, unreachable)
    "missing_chunk",   # an entry names a chunk record that does not exist
    "missing_blob",    # a record's blob file does not exist
    "truncated",       # a record's blob file has the wrong size
    "bad_checksum",    # a record's blob file has the right size but the wrong xxh3-128
    "orphan_chunk",    # a chunk no entry references, or whose refcount drifted
    "dangling_bound",  # a trie edge pointing at no record (or at the wrong parent)
    "missing_bound",   # a record without its trie edge: lookups cannot reach it (re-added)
    "orphan_tokens",   # token ids stored for a key that is neither entry nor chunk
    "bytes_drift",     # the index's byte counter disagrees with its records
    "orphan_blob",     # a blob file no record names (older than the grace period)
    "stale_tmp",       # a temp file left by a writer that died
)
BLOB_KINDS = ("missing_blob", "truncated", "bad_checksum")


@dataclass
class Problem:
    """One thing wrong with a cache directory.

    ``key``: entry / chunk key (hex) the problem is about, if any; ``path``: the file
    (relative to the cache directory) if any; ``record``: "entry", "chunk", "bound",
    "tokens", "meta" or "file"; ``bytes``: bytes the repair frees (file problems).
    """

    kind: str
    key: str | None = None
    path: str | None = None
    detail: str = ""
    record: str = "file"
    bytes: int = 0
    fixed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- blobs


def check_blob(path: Path, size: int, checksum: str | None, *, checksums: bool = True) -> tuple[str, str] | None:
    """``None`` if the file has ``size`` bytes and (when ``checksums``) hashes to
    ``checksum``; else ``(kind, detail)`` with kind in ``BLOB_KINDS``. Streams the file
    (no arrays are built)."""
    try:
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size
            if actual != size:
                return "truncated", f"size {actual}, index says {size}"
            if not checksums:
                return None
            h = xxhash.xxh3_128()
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except FileNotFoundError:
        return "missing_blob", "blob file is missing"
    except OSError as e:
        return "missing_blob", f"cannot read blob: {e.strerror or e}"
    if checksum is not None and h.hexdigest() != checksum:
        return "bad_checksum", f"xxh3-128 {h.hexdigest()}, index says {checksum}"
    return None


def blob_header(path: Path) -> dict[str, Any]:
    """The safetensors header of a blob (tensor specs and ``__metadata__``), read without
    the data. Raises BlobError / OSError."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise blobs.BlobError(f"{path.name}: shorter than its header length")
        n = int.from_bytes(head, "little")
        if n > 100 << 20:
            raise blobs.BlobError(f"{path.name}: header length {n} is implausible")
        header, _ = blobs.parse_header(head + f.read(n))
    return header


_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
              "U32": "uint32", "I8": "int8", "U8": "uint8"}


def kv_dtype(layout: list[dict] | None, header: dict[str, Any] | None = None) -> str | None:
    """A short description of how KV is stored: ``"8-bit (group 64)"`` for quantised
    layers, else the dtype of the first key tensor in ``header`` (``"float16"``...)."""
    flat = _flat(layout or [])
    q = [m for m in flat if m.get("class") == "QuantizedKVCache"]
    if q:
        return f"{q[0].get('bits')}-bit (group {q[0].get('group_size')})"
    if header:
        names = sorted(k for k in header if k != "__metadata__")
        pick = next((k for k in names if k.endswith(".k")), names[0] if names else None)
        if pick is not None:
            st = header[pick].get("dtype", "?")
            return _ST_DTYPES.get(st, st)
    return None


def _flat(layout: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in layout:
        out.extend(_flat(m.get("sub", [])) if m.get("class") == "CacheList" else [m])
    return out


def entry_bytes(rec: dict, chunks: dict[bytes, dict | None]) -> int:
    """An entry's footprint: its own blob plus every chunk it uses (shared chunks counted
    in full)."""
    total = int(rec.get("size") or 0)
    for ck in rec.get("chunks", []):
        c = chunks.get(bytes.fromhex(ck))
        total += int(c.get("size", 0)) if c else 0
    return total


# ----------------------------------------------------------------------------- snapshot


@dataclass
class Snapshot:
    """Every record of the index, read in one transaction (a consistent view)."""

    entries: dict[bytes, dict | None]       # None: unreadable record (not JSON, fields missing)
    chunks: dict[bytes, dict | None]
    tokens: dict[bytes, bytes]              # key -> its token ids (uint32 LE)
    bounds: list[tuple[bytes, bytes, bytes, bytes]]  # (boundary, child, kind b"c"/b"e", edge key)
    identities: dict[str, dict]
    meta_bytes: int


def _parse(v: bytes) -> dict | None:
    import json
    try:
        rec = json.loads(bytes(v))
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _hex16(x: Any) -> bool:
    try:
        return isinstance(x, str) and len(bytes.fromhex(x)) == KEY_BYTES
    except ValueError:
        return False


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry_ok(rec: dict | None) -> dict | None:
    """``rec`` if it has every field the index and the tier rely on, else None (unreadable)."""
    if (rec is None or not _int(rec.get("n")) or not _hex16(rec.get("boundary")) or not _hex16(rec.get("root"))
            or not isinstance(rec.get("chunks", []), list) or not all(_hex16(c) for c in rec.get("chunks", []))
            or not (rec.get("blob") is None or (isinstance(rec.get("blob"), str) and _hex16(rec.get("checksum"))))
            or not _int(rec.get("size", 0)) or not isinstance(rec.get("layout", []), list)):
        return None
    return rec


def _chunk_ok(rec: dict | None) -> dict | None:
    """The same for a chunk record (a restore reads its blob, checksum and layout)."""
    if (rec is None or not isinstance(rec.get("blob"), str) or not _int(rec.get("size"))
            or not _hex16(rec.get("checksum")) or not isinstance(rec.get("layout"), list)
            or not isinstance(rec.get("refs"), int) or not (rec.get("parent") is None or _hex16(rec.get("parent")))):
        return None
    return rec


def snapshot(disk: DiskTier, *, full: bool = True, check: bool = False) -> Snapshot:
    """All records in one read transaction; ``full=False`` skips token ids and trie edges
    (what budgets need). ``check``: walk the pages first (``check_pages``), so a damaged
    index is a CorruptedError rather than an abort inside LMDB."""
    idx = disk.index
    db = idx._db  # maintenance works on the raw databases (one consistent read)

    def items(txn: Any, name: str) -> list[tuple[bytes, bytes]]:
        """A database's records, checking LMDB's order on the way: a B-tree whose keys are
        out of order (damaged pages) hides records from lookups though a scan shows them."""
        out: list[tuple[bytes, bytes]] = []
        for k, v in txn.cursor(db=db[name]):
            k = bytes(k)
            if out and k <= out[-1][0]:
                raise lmdb.CorruptedError(f"keys out of order in the {name} database")
            out.append((k, bytes(v)))
        look = txn.cursor(db=db[name])  # a damaged branch page misroutes lookups only
        for k, _ in out:
            if not look.set_key(k):
                raise lmdb.CorruptedError(f"a key of the {name} database is not found by lookup")
        return out

    def run(txn: Any) -> Snapshot:
        if check:
            check_pages(disk, txn)
        entries = {k: _entry_ok(_parse(v)) for k, v in items(txn, "entries")}
        chunks = {k: _chunk_ok(_parse(v)) for k, v in items(txn, "chunks")}
        tokens: dict[bytes, bytes] = {}
        bounds: list[tuple[bytes, bytes, bytes, bytes]] = []
        if full:
            tokens = dict(items(txn, "tokens"))
            bounds = [(k[:KEY_BYTES], k[-KEY_BYTES:], v, k) for k, v in items(txn, "bounds")]
        idents = {}
        for k, v in txn.cursor(db=db["identities"]):
            idents[bytes(k).hex()] = _parse(v) or {}
        mb = txn.get(b"bytes", db=db["meta"])
        try:
            meta_bytes = int(mb) if mb else 0
        except ValueError:
            meta_bytes = -1
        return Snapshot(entries, chunks, tokens, bounds, idents, meta_bytes)

    for _ in range(20):
        try:
            return idx.read(run)
        except LookupError:  # a commit reused our snapshot's meta page: take a new snapshot
            continue
    check = False  # writers never pause: check nothing rather than loop forever
    return idx.read(run)


def _offsets_ok(layout: Any, n: int) -> bool:
    try:
        return all(m.get("offset", n) == n for m in _flat(layout))
    except (AttributeError, TypeError):
        return False


def _entry_mismatch(key: bytes, rec: dict, toks: bytes | None) -> str | None:
    """Why an entry record disagrees with its own token ids (every key is a hash of them),
    or None. A record that fails this can never be hit, or would restore the wrong thing."""
    from ..keys import boundaries, entry_key, root_key

    if toks is None:
        return "no token ids stored"
    if len(toks) != 4 * rec["n"]:
        return f"token ids hold {len(toks) // 4} tokens, record says {rec['n']}"
    C, ident = rec.get("chunk"), rec.get("identity")
    if not _int(C) or C == 0:
        return f"bad chunk size {C!r}"
    root = bytes.fromhex(rec["root"])
    if not _hex16(ident) or root_key(bytes.fromhex(ident)) != root:
        return "root key does not derive from the record's identity"
    b = boundaries(root, toks, C)
    if entry_key(b[-1], toks[(len(b) - 1) * C * 4 :]) != key:
        return "token ids do not hash to the entry key"
    if b[-1].hex() != rec["boundary"]:
        return "boundary does not match the token ids"
    if rec.get("chunks", []) != ([x.hex() for x in b[1:]] if rec.get("kind") == "chunked" else []):
        return "chunk list does not match the token ids"
    if not _offsets_ok(rec.get("layout", []), rec["n"]):
        return "layout offsets disagree with the token count"
    return None


def _chunk_mismatch(key: bytes, rec: dict, toks: bytes | None) -> str | None:
    from ..keys import chunk_key

    if toks is None:
        return "no token ids stored"
    if rec.get("parent") is not None and chunk_key(bytes.fromhex(rec["parent"]), toks) != key:
        return "token ids do not hash to the chunk key"
    if not _int(rec.get("n", len(toks) // 4)) or len(toks) != 4 * rec.get("n", len(toks) // 4):
        return f"token ids hold {len(toks) // 4} tokens, record says {rec.get('n')}"
    if not _offsets_ok(rec.get("layout", []), len(toks) // 4):
        return "layout offsets disagree with the token count"
    return None


def _refcounts(entries: Iterable[dict | None]) -> dict[bytes, int]:
    refs: dict[bytes, int] = {}
    for rec in entries:
        for ck in (rec or {}).get("chunks", []):
            k = bytes.fromhex(ck)
            refs[k] = refs.get(k, 0) + 1
    return refs
