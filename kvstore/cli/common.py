"""Shared pieces of the ``kvstore`` commands: ``--cache-dir``, opening the store, sizes,
durations, entry ids, tables and error reporting.

Opening a cache directory
-------------------------
Commands that only read (``ls``, ``stats``, ``inspect``, ``verify`` without ``--fix``,
``gc --dry-run``) open the LMDB index read-only and never create anything: a directory that
does not exist, or holds no index, is an error (exit 1) with a message saying which
``--cache-dir`` to pass. LMDB's read-only mode still registers the reader in
``index/lock.mdb`` (that is how it stays safe next to live servers), so the user needs
write permission on that one file. Commands that change the store (``verify --fix``,
``gc``, ``pin``/``unpin``) open it read-write but also refuse a directory that holds no
index; only ``warm`` creates a new cache directory, as a server would.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..escape import visible

ENTRY_ID_CHARS = 12


class CLIError(Exception):
    """A problem the user can fix; printed as ``kvstore: error: ...``, exit ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def error(message: str) -> None:
    print(f"kvstore: error: {visible(message)}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"kvstore: warning: {visible(message)}", file=sys.stderr)


# ----------------------------------------------------------------------------- options


def add_cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", metavar="DIR", type=Path, default=None,
        help="the cache directory (default: $KVSTORE_DIR if set, else the user cache dir, "
             "e.g. ~/.cache/kvstore/cache on Linux, ~/Library/Caches/kvstore/cache on macOS)")
    parser.add_argument(
        "--shared-dir", action="store_true",
        help="the directory is shared by a group on purpose: accept it group-writable or owned by "
             "another member (without it, a directory another user could write is refused)")


def add_shared(parser: argparse.ArgumentParser) -> None:
    """``--shared [URL]`` and ``--shared-prefix``: ask a shared tier (``shared_tier``)."""
    parser.add_argument(
        "--shared", nargs="?", const="", default=None, metavar="URL",
        help="ask a shared tier instead of a cache directory: redis://[user:pass@]host:port/db, "
             "rediss://, redis+cluster://h1:p1,h2:p2 (no URL: $KVSTORE_SHARED)")
    parser.add_argument("--shared-prefix", metavar="P", default=None,
                        help="the shared tier's key prefix (default: the URL's ?prefix=, else kvstore)")


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")


def run_hint(command: str, root: Path | str | None = None) -> str:
    """"run `kvstore COMMAND`", with ``--cache-dir ROOT`` when ``root`` is not the default
    cache directory: a hint the user can paste as it is, about the directory they named."""
    from ..cachedir import default_cache_dir

    where = ""
    if root is not None and Path(root).expanduser() != default_cache_dir():
        import shlex

        where = f" --cache-dir {shlex.quote(str(root))}"
    return f"run `kvstore {command}{where}`"


def cache_dir(args: argparse.Namespace) -> Path:
    if getattr(args, "cache_dir", None) is not None:
        return Path(args.cache_dir).expanduser()
    from ..cachedir import default_cache_dir

    return default_cache_dir()


def open_disk(args: argparse.Namespace, *, write: bool = False, index_only: bool = False):
    """The cache directory's DiskTier: read-only unless ``write``; with ``index_only`` a
    read-only ``cachedir.IndexDir`` (its index, no lookup or restore code: the command
    starts sooner). Raises CLIError."""
    from ..cachedir import StoreOpenError, open_disk as open_store_disk, open_index_dir

    root = cache_dir(args)
    hint = "pass --cache-dir DIR (or set KVSTORE_DIR) naming the directory your servers use"
    if not root.exists():
        raise CLIError(f"cache directory {root} does not exist (nothing has been cached there): {hint}")
    if not root.is_dir():
        raise CLIError(f"cache path {root} is a file, not a directory: {hint}")
    if not (root / "index" / "data.mdb").is_file():
        raise CLIError(f"{root} is not a kvstore cache directory (it has no index/data.mdb): {hint}")
    try:
        if index_only and not write:
            return open_index_dir(root, shared_dir=getattr(args, "shared_dir", False))
        return open_store_disk(root, shared_dir=getattr(args, "shared_dir", False), readonly=not write)
    except StoreOpenError as e:
        extra = "" if write else " (read-only commands still need write access to index/lock.mdb)"
        raise CLIError(f"{e}{extra if 'lock.mdb' in str(e) or 'Permission' in str(e) else ''}") from None


# ----------------------------------------------------------------------------- entries


def short_id(key: bytes | str) -> str:
    return (key.hex() if isinstance(key, bytes) else key)[:ENTRY_ID_CHARS]


def resolve_entry(disk, prefix: str) -> tuple[bytes, Any]:
    """The one entry whose key (hex) starts with ``prefix``, and its record. Raises
    CLIError (no match, several, or a record kvstore did not write)."""
    from ..records import RecordError

    p = prefix.strip().lower()
    if not p or not re.fullmatch(r"[0-9a-f]+", p):
        raise CLIError(f"ENTRY must be a hex prefix of an entry id (as `kvstore ls` shows), got {prefix!r}")
    start = bytes.fromhex(p[: len(p) // 2 * 2])

    def run(r: Any) -> list[bytes]:
        out = []
        for k in r.keys_from("entries", start):
            if not k.hex().startswith(p[: len(start) * 2]):
                break
            if k.hex().startswith(p):
                out.append(k)
                if len(out) > 10:
                    break
        return out

    keys = disk.index.view(run)
    if not keys:
        raise CLIError(f"no entry matches {prefix!r} in {disk.root}: {run_hint('ls', disk.root)} to see the entry ids")
    if len(keys) > 1:
        shown = ", ".join(short_id(k) for k in keys[:10])
        raise CLIError(f"{prefix!r} matches several entries ({shown}{', ...' if len(keys) > 10 else ''}): "
                       "give more hex digits")
    try:
        rec = disk.index.entry(keys[0])
    except RecordError as e:
        raise CLIError(f"entry {short_id(keys[0])} has a damaged record ({e}): "
                       f"{run_hint('verify --fix', disk.root)}") from None
    if rec is None:  # removed between the two reads
        raise CLIError(f"entry {short_id(keys[0])} was just removed by another process")
    return keys[0], rec


def entry_key(store: Any, model: Any, tokens: list[int]) -> bytes:
    """The key ``store`` files ``tokens`` of ``model`` under (its id is what `kvstore ls`
    shows). Raises CLIError when the model has no identity or the store no disk tier."""
    from ..keys import encode_tokens, key_of, root_key

    ident = store.identity(model)
    if ident is None or store.disk is None:
        raise CLIError(f"cannot derive a store identity for {model}")
    return key_of(root_key(ident.digest), encode_tokens(tokens), store.disk.chunk)


def resolve_identity(identities: dict[str, dict], prefix: str, root: Path | None = None) -> str:
    """The one identity (hex) in ``identities`` that starts with ``prefix``; ``root``: the
    cache directory they were read from, for the hint. Raises CLIError."""
    p = prefix.strip().lower()
    if not p or not re.fullmatch(r"[0-9a-f]+", p):
        raise CLIError(f"--identity takes a hex prefix of an identity (as `kvstore ls` shows), got {prefix!r}")
    hits = [h for h in identities if h.startswith(p)]
    if not hits:
        raise CLIError(f"no identity matches {prefix!r}: {run_hint('ls', root)} to see the identities")
    if len(hits) > 1:
        raise CLIError(f"{prefix!r} matches {len(hits)} identities ({', '.join(h[:12] for h in hits)}): "
                       "give more hex digits")
    return hits[0]


# ----------------------------------------------------------------------------- describing entries


def entry_bytes(rec: Any, chunks: dict[bytes, Any]) -> int:
    """An entry's footprint: its own segment plus every chunk it uses (shared chunks
    counted in full; unknown chunks as 0)."""
    total = sum(s.length for s in rec.segments)
    for ck in rec.chunks:
        c = chunks.get(ck)
        total += c.segment.length if c else 0
    return total


def segment_header(disk: Any, seg: Any) -> Any:
    """The (unverified) header of a segment, or None if it cannot be read. Opens only
    kvstore's own files (``files.open_own``)."""
    from .. import files, segments

    try:
        fd = files.open_own(files.pack_path(disk.blob_root, seg.pack))
    except files.BlobError:
        return None
    try:
        return segments.read_header(fd, seg)
    except (files.BlobError, OSError):
        return None
    finally:
        os.close(fd)


def header_layout(header: Any) -> list:
    """The layout a segment header's metadata records ([] if none or unreadable)."""
    from ..segments import stored_layout

    try:
        got = stored_layout(header.meta if header else {})
    except (ValueError, RecursionError):
        return []
    return got if isinstance(got, list) else []


def kv_dtype(header: Any) -> str | None:
    """How KV is stored, from a segment header: ``"8-bit (group 64)"`` for quantised
    layers, else the dtype of its first key tensor (``"float16"``...)."""
    if header is None:
        return None
    from ..layout import facts

    q = [m for m in header_layout(header) if isinstance(m, dict) and facts(m.get("class")).quantized]
    if q:
        return f"{q[0].get('bits')}-bit (group {q[0].get('group_size')})"
    names = sorted(header.specs)
    pick = next((k for k in names if k.endswith(".k")), names[0] if names else None)
    if pick is None:
        return None
    from ..segments import mlx_dtype_name

    return mlx_dtype_name(header.specs[pick][0])  # a parsed header holds known dtypes only


def first_segment(disk: Any, rec: Any) -> Any:
    """A segment of an entry to read its header from: its tail / snapshot, else its first
    chunk's (None if neither is readable)."""
    from ..records import RecordError

    if rec.tail is not None:
        return rec.tail
    if rec.chunks:
        try:
            c = disk.index.chunk(rec.chunks[0])
        except RecordError:
            return None
        return c.segment if c else None
    return None


from ..units import human_bytes, parse_duration, parse_size, seconds  # noqa: F401 (the commands' one parser)


def ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "never"
    d = (time.time() if now is None else now) - ts
    if d < 1:
        return "just now"
    for unit, s in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= s:
            return f"{int(d // s)}{unit} ago"
    return f"{int(d)}s ago"


def iso(ts: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ts)) if ts else None


# ----------------------------------------------------------------------------- output


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str], *, right: Iterable[int] = (),
          indent: str = "") -> str:
    """A plain-text table; columns in ``right`` are right-aligned."""
    rows = [[str(c) for c in r] for r in rows]
    right = set(right)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(out)).rstrip()

    return "\n".join([fmt(headers)] + [fmt(r) for r in rows])


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def identity_name(hx: str, info: Any) -> str:
    """A model name for display (``info``: an IdentityRecord or a dict with "name")."""
    name = info.get("name") if info is not None else None
    return str(name or f"identity {hx[:12]}")


def model_present(info: Any) -> bool | None:
    p = info.get("path") if info is not None else None
    return None if not isinstance(p, str) or not p else os.path.isdir(p)
