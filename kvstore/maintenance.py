"""Offline care of a cache directory: budgets, gc and verify (fsck).

Every function works while servers use the directory: records are dropped in one LMDB
transaction and their blobs unlinked only after it commits, so a concurrent reader sees an
entry either whole or not at all (a reader already holding a record finds a missing blob,
which is a miss, never an error).

``verify`` is modelled on python-diskcache's ``check(fix=True)``: it returns typed
``Problem`` records and repairs them when asked. Repairs re-check their condition inside
the write transaction that applies them, so a record a server commits between the scan and
the repair is never dropped by mistake. Files are only judged by age: a blob a live writer
has renamed into place but not yet committed looks exactly like an orphan, so blob files
younger than ``blob_age`` (and temp files younger than ``tmp_age``) are left alone.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import lmdb
import xxhash

from . import blobs
from .index import chunk_edge, drop_edge, entry_edge
from .keys import KEY_BYTES

if TYPE_CHECKING:  # maintenance needs no MLX itself; DiskTier is only a type here
    from .disk import DiskTier

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


# ----------------------------------------------------------------------------- LMDB pages
#
# LMDB checks little of what it reads: a damaged page that a cursor steps onto is an
# assertion failure, i.e. abort() of the whole process, not an error Python can catch.
# ``verify`` walks every record, so before it lets LMDB do that it walks the B-trees itself,
# page by page, from the meta page of its own read transaction (pages a live reader's
# snapshot uses are never rewritten while it is open), and reports any page that is not
# what its parent says as ``corrupt_index``. ``rebuild_index`` uses the same walk to salvage
# records from the pages that are intact. On-disk format: LMDB 0.9 (``mdb.c``), 64-bit.

_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_P_INVALID = (1 << 64) - 1
_HDR, _NODE = 16, 8


class _Damaged(Exception):
    pass


class _Pages:
    """The pages of one snapshot of an LMDB data file, read with pread (no mmap)."""

    def __init__(self, path: Path, psize: int, txnid: int | None) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.psize = psize
        self.size = os.fstat(self.fd).st_size
        metas = []
        for m in (0, 1):
            b = os.pread(self.fd, 160, m * psize)
            if len(b) < 152 or int.from_bytes(b[16:20], "little") != 0xBEEFC0DE:
                continue
            metas.append((int.from_bytes(b[144:152], "little"), b))
        if not metas:
            raise _Damaged("no valid meta page")
        pick = [mb for mb in metas if mb[0] == txnid] if txnid is not None else sorted(metas)[-1:]
        if not pick:
            raise LookupError("the read transaction's meta page was overwritten meanwhile")
        b = pick[0][1]
        self.last_pg = int.from_bytes(b[136:144], "little")
        self.main = struct.unpack_from("<IHHQQQQQ", b, 40 + 48)

    def close(self) -> None:
        os.close(self.fd)

    def page(self, pgno: int, n: int = 1) -> bytes:
        if pgno < 2 or pgno + n - 1 > self.last_pg or (pgno + n) * self.psize > self.size:
            raise _Damaged(f"page {pgno} is outside the file")
        b = os.pread(self.fd, n * self.psize, pgno * self.psize)
        if int.from_bytes(b[:8], "little") != pgno:
            raise _Damaged(f"page {pgno} says it is page {int.from_bytes(b[:8], 'little')}")
        return b

    def walk(self, db: tuple, sink: Callable[[bytes, bytes, int], None] | None, errors: list[str],
             name: str) -> None:
        """Every leaf record of the tree ``db`` (an MDB_db tuple), in key order, checking
        page numbers, flags, bounds, depth and key order; ``sink(key, value, node_flags)``.
        A damaged subtree is recorded in ``errors`` and skipped."""
        depth, root = db[2], db[7]
        if root == _P_INVALID:
            return
        seen: set[int] = set()
        last: list[bytes] = []

        def visit(pgno: int, level: int, lo: bytes | None, hi: bytes | None) -> None:
            try:
                if pgno in seen:
                    raise _Damaged(f"page {pgno} is reachable twice")
                seen.add(pgno)
                b = self.page(pgno)
                flags, lower, upper = struct.unpack_from("<HHH", b, 10)
                kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW)
                want = _P_LEAF if level == depth else _P_BRANCH
                if kind != want:
                    raise _Damaged(f"page {pgno} has flags {flags:#x}, its parent expects "
                                   f"a {'leaf' if want == _P_LEAF else 'branch'}")
                if not (_HDR <= lower <= upper <= self.psize) or (lower - _HDR) % 2:
                    raise _Damaged(f"page {pgno} has bad bounds {lower}/{upper}")
                n = (lower - _HDR) // 2
                if n == 0 and want == _P_BRANCH:
                    raise _Damaged(f"branch page {pgno} holds no nodes")
                nodes = []
                for i in range(n):
                    off = int.from_bytes(b[_HDR + 2 * i : _HDR + 2 * i + 2], "little")
                    if not upper <= off <= self.psize - _NODE:
                        raise _Damaged(f"page {pgno} node {i} is out of bounds")
                    mlo, mhi, mflags, ksize = struct.unpack_from("<HHHH", b, off)
                    kend = off + _NODE + ksize
                    if kend > self.psize:
                        raise _Damaged(f"page {pgno} node {i} key runs past the page")
                    nodes.append((off, mlo | (mhi << 16), mflags, bytes(b[off + _NODE : kend]), kend))
                if want == _P_BRANCH:
                    # separator i (node 0's key is implicit) bounds child i: [key_i, key_i+1)
                    keys = [nd[3] for nd in nodes]
                    for i in range(1, n):
                        if ((i > 1 and keys[i] <= keys[i - 1]) or (lo is not None and keys[i] < lo)
                                or (hi is not None and keys[i] >= hi)):
                            raise _Damaged(f"page {pgno} branch keys are out of order")
                    for i, (_, lohi, mflags, _key, _) in enumerate(nodes):
                        visit(lohi | (mflags << 32), level + 1, lo if i == 0 else keys[i],
                              keys[i + 1] if i + 1 < n else hi)
                    return
                for i, (off, dsize, mflags, key, kend) in enumerate(nodes):
                    if (lo is not None and key < lo) or (hi is not None and key >= hi) or (last and key <= last[0]):
                        raise _Damaged(f"page {pgno} leaf keys are out of order")
                    last[:] = [key]
                    if mflags & _F_DUPDATA:
                        raise _Damaged(f"page {pgno} has a duplicate-sorted node (kvstore has none)")
                    if mflags & _F_BIGDATA:
                        if kend + 8 > self.psize:
                            raise _Damaged(f"page {pgno} node {i} overflow pointer runs past the page")
                        ov = int.from_bytes(b[kend : kend + 8], "little")
                        head = self.page(ov)
                        oflags, count = struct.unpack_from("<H", head, 10)[0], int.from_bytes(head[12:16], "little")
                        if not oflags & _P_OVERFLOW or count < 1 or dsize > count * self.psize - _HDR:
                            raise _Damaged(f"overflow page {ov} does not hold {dsize} bytes")
                        value = self.page(ov, count)[_HDR : _HDR + dsize]
                    else:
                        if kend + dsize > self.psize:
                            raise _Damaged(f"page {pgno} node {i} value runs past the page")
                        value = bytes(b[kend : kend + dsize])
                    if sink is not None:
                        sink(key, value, mflags)
            except _Damaged as e:
                errors.append(f"{name}: {e}")

        visit(root, 1, None, None)


def _walk_all(path: Path, psize: int, txnid: int | None, *, collect: bool
              ) -> tuple[list[str], dict[str, list[tuple[bytes, bytes]]]]:
    """Walk the main tree and every named database in it. Returns (damage found, records
    by database name when ``collect``)."""
    pages = _Pages(path, psize, txnid)
    errors: list[str] = []
    out: dict[str, list[tuple[bytes, bytes]]] = {}
    try:
        subs: list[tuple[str, tuple]] = []

        def main_sink(key: bytes, value: bytes, flags: int) -> None:
            if flags & _F_SUBDATA and len(value) == 48:
                subs.append((key.decode(errors="replace"), struct.unpack("<IHHQQQQQ", value)))

        pages.walk(pages.main, main_sink, errors, "main")
        for name, db in subs:
            got: list[tuple[bytes, bytes]] = []
            pages.walk(db, (lambda k, v, f, got=got: got.append((k, v))) if collect else None, errors, name)
            out[name] = got
    finally:
        pages.close()
    return errors, out


def check_pages(disk: DiskTier, txn: Any) -> None:
    """Raise lmdb.CorruptedError if any page of ``txn``'s snapshot is damaged, before a
    cursor steps on it (see above). LookupError if the snapshot's meta page was reused."""
    errors, _ = _walk_all(disk.index.path / "data.mdb", disk.index.env.stat()["psize"], txn.id(), collect=False)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise lmdb.CorruptedError(f"damaged pages: {errors[0]}{more}")


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
            or not (rec.get("blob") is None or isinstance(rec.get("blob"), str))
            or not _int(rec.get("size", 0)) or not isinstance(rec.get("layout", []), list)):
        return None
    return rec


def _chunk_ok(rec: dict | None) -> dict | None:
    if (rec is None or not isinstance(rec.get("blob"), str) or not _int(rec.get("size"))
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
    from .keys import boundaries, entry_key, root_key

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
    from .keys import chunk_key

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


# ----------------------------------------------------------------------------- verify


def _files(disk: DiskTier) -> list[tuple[Path, os.stat_result]]:
    """Every regular file under blobs/, plus temp files at the top of the cache dir."""
    out = []
    if disk.blob_root.is_dir():
        for dirpath, _dirs, names in os.walk(disk.blob_root):
            for n in names:
                p = Path(dirpath) / n
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                out.append((p, st))
    try:
        for p in disk.root.iterdir():
            if p.name.endswith(blobs.TMP_SUFFIX) and p.is_file():
                out.append((p, p.stat()))
    except (FileNotFoundError, NotADirectoryError):
        pass
    return out


def verify(disk: DiskTier, *, fix: bool = False, checksums: bool = True,
           tmp_age: float = STALE_TMP_SECONDS, blob_age: float = ORPHAN_BLOB_SECONDS,
           now: float | None = None) -> list[Problem]:
    """Check every record against its blob files and every file against the index.

    With ``fix``, repair each problem (``Problem.fixed`` says which were): broken entries
    are removed through ``DiskTier.remove`` (refcounts stay right), broken chunks are
    dropped together with the entries built on them, refcounts are recounted, dangling
    trie edges and orphan token records deleted, orphan blobs and stale temp files
    unlinked. ``checksums=False`` checks sizes only (cheap; ``gc`` uses it).

    Never raises for a damaged directory: an index LMDB cannot read (or whose B-tree no
    longer finds its own keys) is reported as one ``corrupt_index`` problem; ``fix``
    rebuilds it from its readable records (``rebuild_index``) and then verifies the result.
    """
    kw = dict(checksums=checksums, tmp_age=tmp_age, blob_age=blob_age, now=now)
    try:
        return _verify(disk, fix=fix, **kw)  # type: ignore[arg-type]
    except lmdb.Error as e:
        bad = Problem("corrupt_index", None, str(Path("index") / "data.mdb"),
                      f"the index is damaged ({type(e).__name__}: {e})", "meta")
    if not fix:
        bad.detail += ("; `kvstore verify --fix` rebuilds it from its readable records (restart the "
                       "servers using this directory afterwards)")
        return [bad]
    try:
        how = rebuild_index(disk)
    except (lmdb.Error, OSError) as e:
        bad.detail += f"; rebuilding it failed ({e}): stop the servers and move {disk.index.path} aside"
        return [bad]
    bad.fixed = True
    bad.detail += f"; rebuilt from its readable records ({how}): restart the servers using this directory"
    try:
        return [bad] + _verify(disk, fix=True, **kw)  # type: ignore[arg-type]
    except lmdb.Error as e:
        return [bad, Problem("corrupt_index", None, bad.path, f"still unreadable after the rebuild: {e}", "meta")]


def rebuild_index(disk: DiskTier) -> str:
    """Copy every record LMDB can still read into a fresh index, swap it in place of the
    damaged one (kept as ``index.corrupt-<time>``) and point ``disk`` at it.

    The copy re-inserts keys, so a B-tree whose keys were out of order comes back ordered;
    records on unreadable pages are lost (their blobs become orphans ``verify --fix``
    removes). Processes that still have the old index open keep reading it safely, but what
    they write from then on is not seen by the new one: restart them.
    """
    from .index import _DBS, Index

    old = disk.index
    path = old.path
    psize = old.env.stat()["psize"]
    for _ in range(20):  # read the pages ourselves: LMDB would abort on a damaged one
        try:
            with old.env.begin() as txn:  # pins the snapshot while its pages are read
                lost, salvaged = _walk_all(path / "data.mdb", psize, txn.id(), collect=True)
            break
        except LookupError:
            continue
    else:
        lost, salvaged = _walk_all(path / "data.mdb", psize, None, collect=True)
    salvaged = {name: salvaged.get(name, []) for name in _DBS}
    stamp = f"{int(time.time())}-{os.getpid()}"
    tmp = path.with_name(f"{path.name}.rebuild-{stamp}")
    new = Index(tmp)

    def copy(txn: Any) -> int:
        n = 0
        for name, got in salvaged.items():
            for k, v in got:
                if name == "meta" and k == b"format":
                    continue  # the fresh index wrote its own
                try:
                    txn.put(k, v, db=new._db[name])
                    n += 1
                except lmdb.Error:  # a key LMDB cannot hold (damaged length)
                    pass
        return n

    kept = new.write(copy)
    new.close()
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    os.replace(path, aside)
    os.replace(tmp, path)
    # The old environment is left open, not closed: another thread or Index of this process
    # (a KVStore's writer) may be inside a transaction on it. It is only taken out of the
    # index module's per-process registry, so that opening the path again maps the new files.
    _forget_shared(old)
    disk.index = Index(path)
    skipped = f"; skipped {len(lost)} damaged part(s), first: {lost[0]}" if lost else ""
    return f"{kept} records kept{skipped}; old index in {aside.name}"


def _verify(disk: DiskTier, *, fix: bool, checksums: bool, tmp_age: float, blob_age: float,
            now: float | None) -> list[Problem]:
    now = time.time() if now is None else now
    files = _files(disk)  # list files before reading the index: a blob committed in
    snap = snapshot(disk, check=True)  # between is then seen as indexed, not as an orphan
    problems: list[Problem] = []
    bounds = {edge: kind for _, _, kind, edge in snap.bounds}
    rel_root = disk.root

    def relpath(rel_blob: str) -> str:
        return str(Path(disk.blob_root.relative_to(rel_root)) / rel_blob)

    def still(kind: str, key: bytes, rec: dict) -> bool:
        """The record still exists as scanned (a concurrent gc did not just drop it)."""
        cur = disk.index.entry(key) if kind == "entry" else disk.index.chunk(key)
        return cur is not None and cur.get("blob") == rec.get("blob")

    # entries
    for key, rec in snap.entries.items():
        hx = key.hex()
        if rec is None:
            problems.append(Problem("bad_record", hx, None, "entry record is unreadable (not JSON, or fields missing)", "entry"))
            continue
        toks = snap.tokens.get(key)
        why = _entry_mismatch(key, rec, toks)
        if why:
            problems.append(Problem("bad_record", hx, None, why, "entry"))
            continue
        edge = entry_edge(key, rec, toks)
        if edge is None or bounds.get(edge) != b"e":
            problems.append(Problem("missing_bound", (edge or key).hex(), None,
                                    f"entry {hx[:12]} has no trie edge: lookups cannot reach it", "bound"))
        missing = [ck for ck in rec.get("chunks", []) if bytes.fromhex(ck) not in snap.chunks]
        if missing:
            problems.append(Problem("missing_chunk", hx, None,
                                    f"{len(missing)} of {len(rec.get('chunks', []))} chunk records missing "
                                    f"(first {missing[0][:12]})", "entry"))
            continue
        if rec.get("blob"):
            bad = check_blob(disk.blob_root / rec["blob"], int(rec.get("size", -1)), rec.get("checksum"),
                             checksums=checksums)
            if bad is not None and still("entry", key, rec):
                problems.append(Problem(bad[0], hx, relpath(rec["blob"]), bad[1], "entry"))

    # chunks
    actual_refs = _refcounts(snap.entries.values())
    for key, rec in snap.chunks.items():
        hx = key.hex()
        if rec is None:
            problems.append(Problem("bad_record", hx, None, "chunk record is unreadable (not JSON, or fields missing)", "chunk"))
            continue
        why = _chunk_mismatch(key, rec, snap.tokens.get(key))
        if why:
            problems.append(Problem("bad_record", hx, None, why, "chunk"))
            continue
        bad = check_blob(disk.blob_root / rec.get("blob", ""), int(rec.get("size", -1)), rec.get("checksum"),
                         checksums=checksums)
        if bad is not None and still("chunk", key, rec):
            problems.append(Problem(bad[0], hx, relpath(rec.get("blob", "")), bad[1], "chunk"))
            continue
        edge = chunk_edge(key, rec, snap.tokens.get(key))
        if rec.get("parent") and (edge is None or bounds.get(edge) != b"c"):
            problems.append(Problem("missing_bound", (edge or key).hex(), None,
                                    f"chunk {hx[:12]} has no trie edge: entries built on it cannot be reached",
                                    "bound"))
        have, want = rec.get("refs", 0), actual_refs.get(key, 0)
        if want == 0:
            problems.append(Problem("orphan_chunk", hx, relpath(rec["blob"]),
                                    f"refs={have} but no entry references it", "chunk", int(rec.get("size", 0))))
        elif have != want:
            problems.append(Problem("orphan_chunk", hx, None,
                                    f"refcount drift: refs={have}, {want} entries reference it", "chunk"))

    # trie edges
    bad_records = {p.key for p in problems if p.kind == "bad_record"}  # their edges follow them
    for b, c, kind, edge in snap.bounds:
        target = snap.entries.get(c, False) if kind == b"e" else snap.chunks.get(c, False) if kind == b"c" else False
        why = None
        if kind not in (b"e", b"c"):
            why = f"unknown edge kind {kind!r}"
        elif target is False:
            why = f"points at {'entry' if kind == b'e' else 'chunk'} {c.hex()[:12]}, which does not exist"
        elif target is not None:
            parent = target.get("boundary") if kind == b"e" else target.get("parent")
            want = None if c.hex() in bad_records else _edge_of(c, kind, target, snap.tokens.get(c))
            if parent != b.hex():
                why = f"edge from {b.hex()[:12]} but the record's parent is {str(parent)[:12]}"
            elif want is not None and want != edge:
                why = f"edge to {c.hex()[:12]} does not spell its token ids: lookups seek past it"
        if why:
            problems.append(Problem("dangling_bound", edge.hex(), None, why, "bound"))

    for key in snap.tokens:
        if key not in snap.entries and key not in snap.chunks:
            problems.append(Problem("orphan_tokens", key.hex(), None, "token ids of no entry or chunk", "tokens"))

    counted = sum(int((r or {}).get("size") or 0) for r in snap.entries.values())
    counted += sum(int((r or {}).get("size") or 0) for r in snap.chunks.values())
    if counted != snap.meta_bytes:
        problems.append(Problem("bytes_drift", None, None,
                                f"index counts {snap.meta_bytes} blob bytes, its records hold {counted}", "meta"))

    # files
    named = {rec["blob"] for rec in list(snap.entries.values()) + list(snap.chunks.values())
             if rec and rec.get("blob")}
    for path, st in files:
        age = now - st.st_mtime
        rel = str(path.relative_to(rel_root))
        if path.name.endswith(blobs.TMP_SUFFIX):
            if age >= tmp_age:
                problems.append(Problem("stale_tmp", None, rel, f"temp file {age:.0f}s old", "file", st.st_size))
            continue
        if path.parent == disk.root:
            continue
        if str(path.relative_to(disk.blob_root)) not in named and age >= blob_age:
            problems.append(Problem("orphan_blob", _key_of_file(path), rel,
                                    f"no record names this file ({age:.0f}s old)", "file", st.st_size))

    problems.sort(key=lambda p: KINDS.index(p.kind))
    if fix:
        _fix(disk, problems, snap, tmp_age=tmp_age, blob_age=blob_age)
    return problems


def _key_of_file(path: Path) -> str | None:
    stem = path.name.split("-", 1)[0]
    try:
        return bytes.fromhex(stem).hex() if len(stem) == 2 * KEY_BYTES else None
    except ValueError:
        return None


# ----------------------------------------------------------------------------- repairs


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _fix(disk: DiskTier, problems: list[Problem], snap: Snapshot, *, tmp_age: float, blob_age: float) -> None:
    idx = disk.index
    db = idx._db
    by_kind: dict[str, list[Problem]] = {}
    for p in problems:
        by_kind.setdefault(p.kind, []).append(p)

    broken_entries = [p for p in problems if p.record == "entry"]
    raw_entries = [bytes.fromhex(p.key) for p in broken_entries if snap.entries.get(bytes.fromhex(p.key)) is None]

    # 1. broken chunks: drop the record (unlink after commit), then every entry built on it
    raw_chunks: list[bytes] = []  # unreadable chunk records dropped (blobs found by name)
    bad_chunks = {bytes.fromhex(p.key): p for p in problems if p.record == "chunk" and p.kind in BLOB_KINDS + ("bad_record",)}
    if bad_chunks:
        def drop_chunks(txn: Any) -> tuple[list[str], list[bytes]]:
            unlink: list[str] = []
            freed = 0
            for ck, p in bad_chunks.items():
                raw = txn.get(ck, db=db["chunks"])
                if raw is None:
                    continue
                crec = _chunk_ok(_parse(raw))
                orig = snap.chunks.get(ck)
                if crec is not None and orig is not None and crec.get("blob") != orig.get("blob"):
                    continue  # rewritten meanwhile: not the record we judged
                if crec is None:
                    _drop_raw(txn, db, {ck}, "chunks")
                    raw_chunks.append(ck)
                    continue
                if crec.get("parent"):
                    drop_edge(txn, db["bounds"], bytes.fromhex(crec["parent"]), ck,
                              chunk_edge(ck, crec, txn.get(ck, db=db["tokens"])))
                txn.delete(ck, db=db["chunks"])
                txn.delete(ck, db=db["tokens"])
                unlink.append(crec.get("blob", ""))
                freed += int(crec.get("size", 0))
            idx._add_bytes(txn, -freed)
            hexes = {ck.hex() for ck in bad_chunks}
            users = [bytes(k) for k, v in txn.cursor(db=db["entries"])
                     if hexes.intersection((_entry_ok(_parse(v)) or {}).get("chunks", []))]
            return unlink, users
        unlink, users = idx.write(drop_chunks)
        disk._unlink([u for u in unlink if u])
        _unlink_named(disk, raw_chunks)
        if users:
            _safe_remove(disk, users)
        for ck, p in bad_chunks.items():
            p.fixed = idx.read(lambda t, ck=ck: t.get(ck, db=db["chunks"])) is None

    # 2. broken entries: removed through the normal path (chunk refcounts stay right)
    good_json = [p for p in broken_entries if snap.entries.get(bytes.fromhex(p.key)) is not None]
    for p in good_json:
        key = bytes.fromhex(p.key)
        orig = snap.entries[key]
        assert orig is not None
        _safe_remove(disk, [key], only_if=lambda _, r, o=orig: r.get("blob") == o.get("blob")
                     and r.get("chunks") == o.get("chunks"))
        p.fixed = idx.entry(key) is None
    if raw_entries:
        idx.write(lambda txn: _drop_raw(txn, db, set(raw_entries), "entries"))
        _unlink_named(disk, raw_entries)
        for p in broken_entries:
            if bytes.fromhex(p.key) in raw_entries:
                p.fixed = True

    # 3. files: orphans re-checked against the index just before unlinking
    now = time.time()
    for p in by_kind.get("orphan_blob", []):
        path = disk.root / p.path  # type: ignore[operator]
        rel = str(path.relative_to(disk.blob_root))
        try:
            st = path.stat()
        except FileNotFoundError:
            p.fixed = True
            continue
        if now - st.st_mtime < blob_age:
            continue
        if p.key is not None and _names(disk, bytes.fromhex(p.key), rel):
            continue  # a writer committed it after all
        p.fixed = _unlink(path)
    for p in by_kind.get("stale_tmp", []):
        p.fixed = _unlink(disk.root / p.path)  # type: ignore[operator]

    # 4. one sweep, re-read inside its write transaction: orphan chunks (refcounts recounted),
    # dangling trie edges, orphan token ids and the byte counter. It also cleans up after
    # steps 1-2 where a damaged record misled the removal (a wrong parent or chunk list).
    if any(p.record != "file" for p in problems):
        disk._unlink(idx.write(lambda txn: _sweep(txn, idx)))
        for kind in ("orphan_chunk", "dangling_bound", "missing_bound", "orphan_tokens", "bytes_drift"):
            for p in by_kind.get(kind, []):
                p.fixed = True


def _sweep(txn: Any, idx: Any) -> list[str]:
    """In one write transaction: drop chunks no entry references (blobs returned for the
    caller to unlink after the commit), set drifted refcounts, delete trie edges and token
    ids that point at nothing, and recompute the byte counter. Everything is re-read inside
    the transaction, so a concurrent writer's commit is either fully seen or not at all."""
    db = idx._db
    entries = {bytes(k): _entry_ok(_parse(v)) for k, v in txn.cursor(db=db["entries"])}
    chunks = {bytes(k): _chunk_ok(_parse(v)) for k, v in txn.cursor(db=db["chunks"])}
    refs = _refcounts(entries.values())
    unlink: list[str] = []
    for ck, crec in list(chunks.items()):
        if crec is None:
            continue
        want = refs.get(ck, 0)
        if want == 0:
            txn.delete(ck, db=db["chunks"])
            unlink.append(crec["blob"])
            del chunks[ck]
        elif crec["refs"] != want:
            txn.put(ck, _dump(dict(crec, refs=want)), db=db["chunks"])
    dead = []
    for k, v in txn.cursor(db=db["bounds"]):
        k, v = bytes(k), bytes(v)
        b, c = k[:KEY_BYTES], k[-KEY_BYTES:]
        rec = entries.get(c) if v == b"e" else chunks.get(c) if v == b"c" else None
        if (rec is None or rec.get("boundary" if v == b"e" else "parent") != b.hex()
                or _edge_of(c, v, rec, txn.get(c, db=db["tokens"])) not in (None, k)):
            dead.append(k)
    for k in dead:
        txn.delete(k, db=db["bounds"])
    for key, rec in list(entries.items()) + list(chunks.items()):  # every record reachable again
        kind = b"e" if key in entries else b"c"
        edge = _edge_of(key, kind, rec, txn.get(key, db=db["tokens"])) if rec is not None else None
        if edge is not None and txn.get(edge, db=db["bounds"]) != kind:
            txn.put(edge, kind, db=db["bounds"])
    stale = [bytes(k) for k in txn.cursor(db=db["tokens"]).iternext(keys=True, values=False)
             if bytes(k) not in entries and bytes(k) not in chunks]
    for k in stale:
        txn.delete(k, db=db["tokens"])
    total = sum(int(r.get("size") or 0) for r in entries.values() if r)
    total += sum(int(r.get("size") or 0) for r in chunks.values() if r)
    txn.put(b"bytes", str(total).encode(), db=db["meta"])
    return unlink


def _edge_of(key: bytes, kind: bytes, rec: dict, tokens: bytes | None) -> bytes | None:
    """The trie edge a record should have (None: unknown, its token ids are damaged)."""
    return entry_edge(key, rec, tokens) if kind == b"e" else chunk_edge(key, rec, tokens)


def _forget_shared(old: Any) -> None:
    """Drop ``old``'s environment from ``kvstore.index``'s per-process registry (which hands
    every Index on one path the same environment) without closing it."""
    from . import index as I

    shared, lock = getattr(I, "_SHARED", None), getattr(I, "_SHARED_LOCK", None)
    if shared is None or lock is None:
        return
    with lock:
        for key, got in list(shared.items()):
            if got[0] is old.env:
                del shared[key]


def _safe_remove(disk: DiskTier, keys: list[bytes], only_if: Callable[[bytes, dict], bool] | None = None) -> bool:
    """DiskTier.remove, except that a malformed record in the way (which remove_entries
    cannot read) leaves the entry for the next repair instead of raising."""
    try:
        disk.remove(keys, only_if=only_if)
        return True
    except (ValueError, KeyError, TypeError):
        return False


def _names(disk: DiskTier, key: bytes, rel: str) -> bool:
    """Whether the entry or chunk record under ``key`` names blob ``rel`` (raw read: an
    unreadable record names nothing)."""
    db = disk.index._db

    def run(txn: Any) -> bool:
        for name in ("entries", "chunks"):
            rec = _parse(txn.get(key, db=db[name]) or b"null")
            if rec is not None and rec.get("blob") == rel:
                return True
        return False

    return disk.index.read(run)


def _unlink_named(disk: DiskTier, keys: list[bytes]) -> None:
    """After dropping unparsable records: their blobs, found by the key in the file name
    (``<key hex>-<rand>.safetensors``), unless a record names the file again."""
    for key in keys:
        hx = key.hex()
        for path in (disk.blob_root / hx[:2]).glob(f"{hx}-*{blobs.BLOB_SUFFIX}"):
            if not _names(disk, key, str(path.relative_to(disk.blob_root))):
                _unlink(path)


def _drop_raw(txn: Any, db: dict, keys: set[bytes], name: str) -> None:
    """Delete unparsable records, their token ids and every trie edge to them."""
    for key in keys:
        txn.delete(key, db=db[name])
        txn.delete(key, db=db["tokens"])
    dead = [bytes(k) for k, _ in txn.cursor(db=db["bounds"]) if bytes(k[-KEY_BYTES:]) in keys]
    for k in dead:
        txn.delete(k, db=db["bounds"])


def _dump(rec: dict) -> bytes:
    import json
    return json.dumps(rec, separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- budgets


def lru_order(records: Iterable[tuple[bytes, dict]]) -> list[tuple[bytes, dict]]:
    """Eviction order: unpinned before pinned, least recently used first."""
    def when(rec: dict) -> float:
        v = rec.get("last_used", 0)
        return float(v) if isinstance(v, (int, float)) else 0.0

    return sorted(records, key=lambda kr: (bool(kr[1].get("pinned")), when(kr[1])))


class _Sim:
    """What removing entries would free, chunk refcounts included (for dry runs and for
    reporting what a real removal freed)."""

    def __init__(self, snap: Snapshot) -> None:
        self.total = snap.meta_bytes
        self.refs = {k: int(r.get("refs", 0)) for k, r in snap.chunks.items() if r}
        self.sizes = {k: int(r.get("size", 0)) for k, r in snap.chunks.items() if r}
        self.gone: set[bytes] = set()

    def preview(self, rec: dict, drops: dict[bytes, int]) -> int:
        """What removing ``rec`` would free after the entries already counted in ``drops``
        (chunk key -> references they drop; updated) went, without removing anything."""
        freed = int(rec.get("size") or 0)
        for ck in rec.get("chunks", []):
            k = bytes.fromhex(ck)
            drops[k] = drops.get(k, 0) + 1
            if k in self.refs and self.refs[k] == drops[k]:
                freed += self.sizes[k]
        return freed

    def remove(self, key: bytes, rec: dict) -> int:
        if key in self.gone:
            return 0
        self.gone.add(key)
        freed = int(rec.get("size") or 0)
        for ck in rec.get("chunks", []):
            k = bytes.fromhex(ck)
            if k in self.refs:
                self.refs[k] -= 1
                if self.refs[k] == 0:
                    freed += self.sizes[k]
        self.total -= freed
        return freed


def evict_to(disk: DiskTier, max_bytes: int, *, dry_run: bool = False) -> list[tuple[bytes, dict]]:
    """Drop least recently used entries (pinned last) until the blobs fit ``max_bytes``.

    Sizes count shared chunks once; an entry's eviction frees only what no other entry
    still references, so this loops on the index total rather than predicting it. Each
    returned record carries ``_frees``: the bytes its removal freed (or would free).
    """
    if disk.index.total_bytes() <= max_bytes:
        return []
    snap = snapshot(disk, full=False)
    return _evict(disk, _Sim(snap), [(k, r) for k, r in snap.entries.items() if r], max_bytes, dry_run)


def _evict(disk: DiskTier, sim: _Sim, records: list[tuple[bytes, dict]], max_bytes: int,
           dry_run: bool) -> list[tuple[bytes, dict]]:
    """Remove in LRU order, a batch per transaction: each batch is what the simulation
    says reaches ``max_bytes`` (at most ``BATCH``); the index total is re-read between
    batches, so concurrent writers and shared chunks only cost another round."""
    gone: list[tuple[bytes, dict]] = []
    order = [kr for kr in lru_order((k, r) for k, r in records) if kr[0] not in sim.gone]
    i = 0
    while i < len(order):
        total = sim.total if dry_run else disk.index.total_bytes()
        if total <= max_bytes:
            break
        batch, frees, drops = [], 0, {}
        while i < len(order) and len(batch) < BATCH and frees < total - max_bytes:
            batch.append(order[i])
            frees += sim.preview(order[i][1], drops)
            i += 1
        done = set(k for k, _ in batch) if dry_run else _remove_many(disk, batch)
        gone += [(k, dict(r, _frees=sim.remove(k, r))) for k, r in batch if k in done]
    return gone


BATCH = 256  # entries removed per transaction (one fsync each)


def _remove_many(disk: DiskTier, batch: list[tuple[bytes, dict]],
                 guard: Callable[[dict], bool] | None = None) -> set[bytes]:
    """Remove entries in one transaction, each unless it was pinned or unpinned since its
    record was read, or ``guard`` rejects its current record (checked in the transaction).
    A use since then does not save it from a size budget (a busy server touches everything
    all the time), only from ``max_age`` (whose guard re-checks the age). Returns the keys
    removed; a malformed record in the way leaves the batch to ``verify --fix``."""
    pinned = {k: bool(r.get("pinned")) for k, r in batch}
    removed: list[bytes] = []

    def only_if(key: bytes, cur: dict) -> bool:
        return bool(cur.get("pinned")) == pinned[key] and (guard is None or guard(cur))

    try:
        disk.remove([k for k, _ in batch], only_if=only_if, removed=removed)
    except (ValueError, KeyError, TypeError):
        if len(batch) == 1:
            return set()
        return set().union(*(_remove_many(disk, [kr], guard) for kr in batch))
    return set(removed)


# ----------------------------------------------------------------------------- gc


@dataclass
class GcResult:
    removed: list[dict] = field(default_factory=list)   # {"key", "reason", "bytes", "tokens", ...}
    problems: list[Problem] = field(default_factory=list)  # orphans / broken records found
    dry_run: bool = False

    @property
    def freed(self) -> int:
        return sum(r["bytes"] for r in self.removed) + sum(
            p.bytes for p in self.problems if p.fixed or self.dry_run)

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "freed_bytes": self.freed, "removed": self.removed,
                "problems": [p.to_dict() for p in self.problems]}


def gc(disk: DiskTier, *, max_bytes: int | None = None, max_age: float | None = None,
       identities: Iterable[str] = (), missing_models: bool = False, orphans: bool = True,
       dry_run: bool = False, tmp_age: float = STALE_TMP_SECONDS,
       blob_age: float = ORPHAN_BLOB_SECONDS, now: float | None = None) -> GcResult:
    """Collect garbage, in this order:

    1. entries of the named identities (hex prefixes) and, with ``missing_models``, of
       identities whose model directory no longer exists (pinned ones too: the pin guards
       against budgets, not against dropping a model);
    2. unpinned entries not used for ``max_age`` seconds (pinned entries never age out);
    3. least recently used entries until the blobs fit ``max_bytes`` (pinned ones only
       when nothing else is left);
    4. with ``orphans``: orphan blobs, stale temp files, orphan chunks and records whose
       blobs are gone or the wrong size (``verify`` with sizes only, repaired).

    ``dry_run`` changes nothing (open the index read-only for it) and reports what would go.
    """
    now = time.time() if now is None else now
    snap = snapshot(disk)
    sim = _Sim(snap)
    res = GcResult(dry_run=dry_run)
    records = [(k, r) for k, r in snap.entries.items() if r]
    idents = [s.lower() for s in identities]

    def note(key: bytes, rec: dict, reason: str, freed: int) -> None:
        ident = snap.identities.get(rec.get("identity", ""), {})
        res.removed.append({"key": key.hex(), "reason": reason, "bytes": freed, "tokens": rec.get("n"),
                            "identity": rec.get("identity"), "model": ident.get("name"),
                            "pinned": bool(rec.get("pinned")), "last_used": rec.get("last_used")})

    def take(items: list[tuple[bytes, dict]], reason: str, guard: Callable[[dict], bool] | None = None) -> None:
        items = [(k, r) for k, r in items if k not in sim.gone]
        for j in range(0, len(items), BATCH):
            batch = items[j : j + BATCH]
            done = {k for k, _ in batch} if dry_run else _remove_many(disk, batch, guard)
            for key, rec in batch:
                if key in done:
                    note(key, rec, reason, sim.remove(key, rec))

    gone_models = set()
    if missing_models:
        for hx, info in snap.identities.items():
            p = info.get("path")
            if p and not Path(p).exists():
                gone_models.add(hx)
    named = [(k, r) for k, r in lru_order(records) if any(r.get("identity", "").startswith(p) for p in idents)]
    take(named, "identity")
    take([(k, r) for k, r in lru_order(records) if r.get("identity", "") in gone_models], "missing_model")
    if max_age is not None:
        cutoff = now - max_age
        take([(k, r) for k, r in lru_order(records) if not r.get("pinned") and r.get("last_used", 0) < cutoff],
             "max_age", guard=lambda cur: cur.get("last_used", 0) < cutoff)
    if max_bytes is not None:
        for key, rec in _evict(disk, sim, records, max_bytes, dry_run):
            note(key, rec, "max_bytes", rec["_frees"])
    if orphans:
        res.problems = verify(disk, fix=not dry_run, checksums=False, tmp_age=tmp_age,
                              blob_age=blob_age, now=now)
        if dry_run:  # records that step 1-3 would already have removed are no news
            res.problems = [p for p in res.problems
                            if not (p.record == "entry" and p.key and bytes.fromhex(p.key) in sim.gone)]
    return res
