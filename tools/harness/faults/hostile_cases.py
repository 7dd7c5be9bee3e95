"""The hostile directories of the ``hostile`` fault kind: how each case is crafted.

A case dir holds ``cache/`` (a copy of a populated template) and ``outside/`` (someone's
files next to it). Each setup changes them as someone else might have and says what that
explains (``Crafted``): the entries whose misses it causes, the files kvstore did not
write that must stay as they are, and, for a directory kvstore must refuse to open, the
words its refusal must contain. Records are written with ``lmdb`` directly and files
with plain file operations (``craft``), never through kvstore's own write path.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from . import craft


@dataclass
class Crafted:
    """What a setup did: a description, the entry keys (hex) whose misses it explains,
    files kvstore did not write (relative to the case dir) that must stay as they are,
    and, if kvstore must refuse the directory, words its refusal must contain."""

    desc: str
    targets: set[str] = field(default_factory=set)
    foreign: list[str] = field(default_factory=list)
    refuse: tuple[str, ...] = ()


Setup = Callable[[Path, dict, random.Random], Crafted]


@dataclass(frozen=True)
class Case:
    """One hostile directory: its name, its setup, whether it is about ``records`` or
    ``planted`` files, and whether the CI subset runs it."""

    name: str
    setup: Setup
    group: str
    ci: bool = False


# ======================================================================= helpers


def _entries(cache: Path) -> dict[bytes, Any]:
    return {k: r for k, r in craft.records(cache, "entries").items() if r is not None}


def _pick(cache: Path, rng: random.Random, want: Callable[[Any], bool]) -> tuple[bytes, Any]:
    """A random readable entry record for which ``want(record)`` holds."""
    found = sorted((k, r) for k, r in _entries(cache).items() if want(r))
    if not found:
        raise RuntimeError("the template has no entry of the kind this case needs")
    return rng.choice(found)


def _chunk_users(cache: Path) -> dict[bytes, set[str]]:
    """chunk key -> entry keys (hex) built on it."""
    users: dict[bytes, set[str]] = {}
    for k, r in _entries(cache).items():
        for ck in r.chunks:
            users.setdefault(ck, set()).add(k.hex())
    return users


def _pack_users(tpl: dict, rel_pack: str) -> set[str]:
    return {u for s in tpl["segments"] if s["pack"] == rel_pack for u in s["users"]}


def _put_entry(cache: Path, key: bytes, rec: Any) -> None:
    craft.put_raw(cache, "entries", key, rec.to_bytes())


def _rel_pack(cache: Path, seg: Any) -> str:
    from kvstore.files import pack_path
    return str(pack_path(cache / "blobs", seg.pack).relative_to(cache))


# ======================================================================= crafted records


def entry_segment_huge_length(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A snapshot entry's segment claims 2**40 bytes (its pack holds a few KiB)."""
    from kvstore.records import MAX_SEGMENT, Segment
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: not r.chunked)
    t = rec.tail
    _put_entry(cache, key, replace(rec, tail=Segment(t.pack, t.offset, MAX_SEGMENT, t.checksum)))
    return Crafted(f"entry {key.hex()[:12]}: segment length 2**40", {key.hex()})


def entry_segment_huge_offset(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """An entry's tail / snapshot segment starts 1 TiB into its pack."""
    from kvstore.records import MAX_SEGMENT, Segment
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: r.tail is not None)
    t = rec.tail
    _put_entry(cache, key, replace(rec, tail=Segment(t.pack, MAX_SEGMENT - t.length, t.length, t.checksum)))
    return Crafted(f"entry {key.hex()[:12]}: segment offset 2**40 - length", {key.hex()})


def chunk_segment_huge_length(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """The most shared chunk's segment claims 2**40 bytes."""
    from kvstore.records import MAX_SEGMENT, Segment
    cache = case / "cache"
    users = _chunk_users(cache)
    ck = max(sorted(users), key=lambda c: len(users[c]))
    crec = craft.records(cache, "chunks")[ck]
    s = crec.segment
    huge = Segment(s.pack, s.offset, MAX_SEGMENT, s.checksum)
    craft.put_raw(cache, "chunks", ck, replace(crec, segment=huge).to_bytes())
    return Crafted(f"chunk {ck.hex()[:12]} ({len(users[ck])} users): segment length 2**40", users[ck])


def entry_n_lies(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A snapshot entry claims 7 more tokens than its token ids and its KV hold."""
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: not r.chunked)
    _put_entry(cache, key, replace(rec, n=rec.n + 7))
    return Crafted(f"entry {key.hex()[:12]}: n={rec.n + 7}, holds {rec.n}", {key.hex()})


def entry_chunks_lie(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A chunked entry names other chunks than its tokens make (another entry's, or
    random keys), same count."""
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: r.chunked and len(r.chunks) > 0)
    others = [r.chunks for k, r in _entries(cache).items() if k != key and len(r.chunks) == len(rec.chunks)
              and r.chunks != rec.chunks]
    lie = rng.choice(others) if others and rng.random() < 0.7 else tuple(os.urandom(16) for _ in rec.chunks)
    _put_entry(cache, key, replace(rec, chunks=tuple(lie)))
    return Crafted(f"entry {key.hex()[:12]}: its {len(lie)} chunks replaced", {key.hex()})


def entry_other_segment(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """An entry's tail / snapshot replaced by another entry's: a real segment whose
    checksum verifies, holding someone else's KV."""
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: r.tail is not None)
    other = sorted((r.tail for k, r in _entries(cache).items() if k != key and r.tail is not None
                    and r.tail != rec.tail), key=lambda s: s.to_bytes())
    seg = rng.choice(other)
    _put_entry(cache, key, replace(rec, tail=seg))
    return Crafted(f"entry {key.hex()[:12]}: tail of another entry ({seg.length} bytes)", {key.hex()})


def chunk_other_segment(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A chunk's segment replaced by another chunk's (verifies, wrong KV)."""
    cache = case / "cache"
    users = _chunk_users(cache)
    chunks = {k: r for k, r in craft.records(cache, "chunks").items() if r is not None}
    ck = rng.choice(sorted(users))
    other = rng.choice(sorted(k for k in chunks if k != ck))
    craft.put_raw(cache, "chunks", ck, replace(chunks[ck], segment=chunks[other].segment).to_bytes())
    return Crafted(f"chunk {ck.hex()[:12]}: segment of chunk {other.hex()[:12]}", users[ck])


def entry_wrong_tag(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """An entry record under another record kind's tag, or an older format's."""
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: True)
    tag = rng.choice([b"C\x03", b"E\x02", b"P\x03", b"E\x04"])
    craft.put_raw(cache, "entries", key, tag + rec.to_bytes()[2:])
    return Crafted(f"entry {key.hex()[:12]}: tag {tag!r}", {key.hex()})


def entry_truncated(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """An entry record cut short."""
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: True)
    raw = rec.to_bytes()
    n = rng.randrange(len(raw))
    craft.put_raw(cache, "entries", key, raw[:n])
    return Crafted(f"entry {key.hex()[:12]}: record cut to {n} of {len(raw)} bytes", {key.hex()})


def pack_record_lies(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A pack record claiming 1 TiB and no live segment."""
    from kvstore.records import PackRecord
    cache = case / "cache"
    seg = rng.choice(tpl["segments"])
    pack = bytes.fromhex(Path(seg["pack"]).name.split(".")[0])
    craft.put_raw(cache, "packs", pack, PackRecord(1 << 40, 0, 0, time.time()).to_bytes())
    return Crafted(f"pack {pack.hex()[:12]}: size 2**40, 0 segments", _pack_users(tpl, seg["pack"]))


def tokens_of_another_prompt(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """An entry's token ids replaced by other ids of the same length: its key no
    longer hashes from them (a fetch of those ids must not get this KV)."""
    cache = case / "cache"
    key, rec = _pick(cache, rng, lambda r: True)
    from kvstore.keys import encode_tokens
    toks = encode_tokens([rng.randrange(256) for _ in range(rec.n)])  # byte tokens, as prompts use; the format's width
    craft.put_raw(cache, "tokens", key, toks)
    return Crafted(f"entry {key.hex()[:12]}: token ids of another prompt", {key.hex()})


def edge_to_another_entry(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A trie edge filing another identity's entry under this entry's boundary and
    tokens (a lookup following it must check the stored token ids and key)."""
    from kvstore.keys import edge_keys, residual
    from kvstore.records import Kind
    cache = case / "cache"
    entries = _entries(cache)
    key, rec = _pick(cache, rng, lambda r: True)
    other = rng.choice(sorted(k for k, r in entries.items() if r.identity != rec.identity))
    toks = craft.read_raw(cache, "tokens")[key]
    for edge in edge_keys(rec.boundary, residual(toks, rec.chunk), other):
        craft.put_raw(cache, "bounds", edge, Kind.ENTRY.value)
    return Crafted(f"edges of entry {key.hex()[:12]} lead to {other.hex()[:12]} (another identity)")


def arrays_cache_size_huge(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A tiny-qwen3next snapshot rewritten with a header whose layout claims an
    ArraysCache of 20,000,000 arrays, in a new pack, checksum true: only the layout
    check stands between it and a 20-million-slot allocation."""
    cache = case / "cache"
    qwen = sorted(e["key"] for e in tpl["entries"] if e["model"] == "qwen")
    if not qwen:
        raise RuntimeError("the template has no tiny-qwen3next entry")
    key = bytes.fromhex(rng.choice(qwen))
    rec = _entries(cache)[key]
    header, body = craft.frame_of(craft.segment_bytes(cache, rec.tail))
    layout = json.loads(header["__metadata__"]["kvstore.layout"])
    for m in layout:
        if m.get("class") == "ArraysCache":
            m["size"] = 20_000_000
    header["__metadata__"]["kvstore.layout"] = json.dumps(layout)
    (seg,) = craft.new_pack(cache, [craft.reframed(header, body)], rec.created)
    _put_entry(cache, key, replace(rec, tail=seg))
    return Crafted(f"qwen entry {key.hex()[:12]}: layout claims ArraysCache size 20,000,000", {key.hex()})


def arrays_of_another_shape(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A tiny-qwen3next or tiny-gemma3 snapshot rewritten, in a new pack, checksum true,
    with every array of batch 2 (its data twice) or given a fifth axis: the model's
    layer classes, heads and head_dim, but no cache the model makes (it killed
    mlx_lm.server's generation thread). Only the whole-shape check stands between it
    and a hit (issue 31.2)."""
    cache = case / "cache"
    snaps = sorted(e["key"] for e in tpl["entries"] if e["model"] in ("qwen", "gemma"))
    if not snaps:
        raise RuntimeError("the template has no tiny-qwen3next or tiny-gemma3 entry")
    key = bytes.fromhex(rng.choice(snaps))
    rec = _entries(cache)[key]
    header, body = craft.frame_of(craft.segment_bytes(cache, rec.tail))
    batch = rng.random() < 0.5
    out, parts, pos = {"__metadata__": header.pop("__metadata__")}, [], 0
    for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = spec["data_offsets"]
        data = body[a:b] * 2 if batch else body[a:b]
        shape = [2 * spec["shape"][0], *spec["shape"][1:]] if batch else [1, *spec["shape"]]
        out[name] = {"dtype": spec["dtype"], "shape": shape, "data_offsets": [pos, pos + len(data)]}
        parts.append(data)
        pos += len(data)
    (seg,) = craft.new_pack(cache, [craft.reframed(out, b"".join(parts))], rec.created)
    _put_entry(cache, key, replace(rec, tail=seg))
    return Crafted(f"entry {key.hex()[:12]}: every array {'of batch 2' if batch else 'given a fifth axis'}",
                   {key.hex()})


def _model_identity_key(cache: Path, tpl: dict, name: str) -> bytes:
    want = {e["key"] for e in tpl["entries"] if e["model"] == name}
    for k, r in _entries(cache).items():
        if k.hex() in want:
            return r.identity
    raise RuntimeError(f"no {name} entry in the template")


def identity_deep_json(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """tiny-llama's identity description nested 100,000 levels deep."""
    cache = case / "cache"
    craft.put_raw(cache, "identities", _model_identity_key(cache, tpl, "llama"), b"[" * 100_000 + b"]" * 100_000)
    return Crafted("llama identity: JSON nested 100,000 deep")


def identity_wrong_types(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """Identity descriptions whose fields have other types ("path": 5, "name": [1]) or
    that are far too large."""
    cache = case / "cache"
    bad = json.dumps({"name": [1], "path": 5, "components": "x", "kv_bits": "8"}).encode()
    craft.put_raw(cache, "identities", _model_identity_key(cache, tpl, "llama"), bad)
    craft.put_raw(cache, "identities", _model_identity_key(cache, tpl, "gemma"),
                  json.dumps({"name": "x" * (2 << 20)}).encode())
    return Crafted("llama identity: wrong-typed fields; gemma identity: 2 MiB")


def meta_chunk_size(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """The directory's chunk size record replaced by one kvstore never writes."""
    value = rng.choice([b"0", b"-32", b"1e9", b"\xff\xfe"])
    craft.put_raw(case / "cache", "meta", b"chunk_tokens", value)
    return Crafted(f"meta chunk_tokens = {value!r}", refuse=("chunk_tokens",))


def meta_format(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """The index claims another format."""
    craft.put_raw(case / "cache", "meta", b"format", b"2")
    return Crafted("meta format = 2", refuse=("format",))


def meta_byte_counter(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """The byte counter replaced by garbage or a negative number."""
    value = rng.choice([b"-9", b"x" * 40, b"99999999999999999999"])
    craft.put_raw(case / "cache", "meta", b"bytes", value)
    return Crafted(f"meta bytes = {value[:20]!r}")


RECORD_CASES = [
    Case("entry segment of length 2**40", entry_segment_huge_length, "records", ci=True),
    Case("entry segment at offset 2**40", entry_segment_huge_offset, "records"),
    Case("chunk segment of length 2**40", chunk_segment_huge_length, "records"),
    Case("entry n lies", entry_n_lies, "records"),
    Case("entry chunk list lies", entry_chunks_lie, "records", ci=True),
    Case("entry names another entry's segment", entry_other_segment, "records", ci=True),
    Case("chunk names another chunk's segment", chunk_other_segment, "records"),
    Case("entry record with a wrong tag", entry_wrong_tag, "records"),
    Case("entry record truncated", entry_truncated, "records"),
    Case("pack record lies", pack_record_lies, "records"),
    Case("token ids of another prompt", tokens_of_another_prompt, "records"),
    Case("trie edge to another identity's entry", edge_to_another_entry, "records"),
    Case("ArraysCache size 20,000,000 in a segment header", arrays_cache_size_huge, "records", ci=True),
    Case("arrays of batch 2 or a fifth axis in a segment header", arrays_of_another_shape, "records", ci=True),
    Case("identity JSON nested 100,000 deep", identity_deep_json, "records", ci=True),
    Case("identity fields of the wrong type", identity_wrong_types, "records"),
    Case("chunk size record kvstore never writes", meta_chunk_size, "records", ci=True),
    Case("index of another format", meta_format, "records"),
    Case("byte counter garbage", meta_byte_counter, "records"),
]


# ======================================================================= planted files


def _pack_files(case: Path) -> list[Path]:
    return craft.packs(case / "cache")


def blobs_symlink(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """blobs/ replaced by a symlink to a directory of someone's files laid out like
    blobs/ (pack-named copies in fan-out directories, and their notes)."""
    cache, user = case / "cache", case / "outside" / "user-files"
    shutil.copytree(cache / "blobs", user)
    craft.user_files(user, [])
    shutil.rmtree(cache / "blobs")
    os.symlink(user, cache / "blobs")
    return Crafted("blobs/ -> outside/user-files", foreign=["cache/blobs"], refuse=("blobs",))


def fanout_symlink(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A fan-out directory replaced by a symlink to someone's directory holding files
    under the names of the packs it held."""
    cache = case / "cache"
    fan = rng.choice(sorted({p.parent for p in _pack_files(case)}))
    user = case / "outside" / "user-fanout"
    craft.user_files(user, sorted(fan.glob("*.kvpack")))
    targets = {u for p in fan.glob("*.kvpack") for u in _pack_users(tpl, str(p.relative_to(cache)))}
    shutil.rmtree(fan)
    os.symlink(user, fan)
    return Crafted(f"blobs/{fan.name}/ -> outside/user-fanout", targets, [str(fan.relative_to(case))])


def pack_symlink(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A pack file replaced by a symlink to someone's copy of it."""
    cache = case / "cache"
    pack = rng.choice(_pack_files(case))
    user = case / "outside" / "user-files"
    craft.user_files(user, [pack])
    targets = _pack_users(tpl, str(pack.relative_to(cache)))
    pack.unlink()
    os.symlink(user / pack.name, pack)
    return Crafted(f"{pack.relative_to(cache)} -> outside/user-files/{pack.name}", targets,
                   [str(pack.relative_to(case))])


def pack_fifo(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """A pack file replaced by a FIFO nobody writes to."""
    cache = case / "cache"
    pack = rng.choice(_pack_files(case))
    targets = _pack_users(tpl, str(pack.relative_to(cache)))
    pack.unlink()
    os.mkfifo(pack, 0o600)
    return Crafted(f"{pack.relative_to(cache)} is a FIFO", targets, [str(pack.relative_to(case))])


def _plant(case: Path, rel: str, data: bytes) -> str:
    p = case / "cache" / rel
    p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    p.write_bytes(data)
    return str(p.relative_to(case))


def pack_like_names(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """Copies of a pack under pack-like names in the wrong places: another fan-out
    directory, blobs/ itself, the cache root, upper-case hex, another suffix."""
    pack = rng.choice(_pack_files(case))
    data, h = pack.read_bytes(), "%032x" % rng.getrandbits(128)
    wrong = "%02x" % ((int(h[:2], 16) + 1) % 256)
    rels = [f"blobs/{wrong}/{h}.kvpack", f"blobs/{h}.kvpack", f"{h}.kvpack", f"blobs/{h[:2]}/{h.upper()}.kvpack",
            f"blobs/{h[:2]}/{h}.kvpack.bak", f"blobs/{h[:2]}/{h[:30]}.kvpack", f"blobs/zz/{h}.kvpack"]
    return Crafted("pack-like names in the wrong places", foreign=[_plant(case, r, data) for r in rels])


def tmp_files(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """``*.tmp`` files everywhere kvstore writes: the cache root, index/ (one named as
    kvstore names its own stamp's temp file), blobs/ and a fan-out directory."""
    fan = rng.choice(_pack_files(case)).parent.name
    rels = ["data.tmp", "index/clean.99999.tmp", "index/data.mdb.tmp", f"blobs/{fan}/x.kvpack.tmp", "blobs/y.tmp",
            "file-digests.json.99999.tmp"]
    return Crafted("*.tmp files", foreign=[_plant(case, r, os.urandom(rng.randint(0, 4000))) for r in rels])


def sha256_files(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """Files and a directory named like another tool's content-addressed blobs
    (``sha256-<hex>``) in blobs/, a fan-out directory and the cache root."""
    fan = rng.choice(_pack_files(case)).parent.name
    h = "%064x" % rng.getrandbits(256)
    rels = [f"blobs/sha256-{h}", f"blobs/{fan}/sha256-{h}", f"sha256-{h}", f"blobs/sha256-{h[:8]}/data"]
    return Crafted("sha256-* files", foreign=[_plant(case, r, os.urandom(2048)) for r in rels])


def _fifo_at(case: Path, rel: str) -> None:
    p = case / "cache" / rel
    if p.exists():
        p.unlink()
    os.mkfifo(p, 0o600)


def stamp_fifo(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """index/clean (the clean-close stamp) replaced by a FIFO."""
    _fifo_at(case, "index/clean")
    return Crafted("index/clean is a FIFO")


def memo_fifo(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """file-digests.json (the digest memo) replaced by a FIFO."""
    _fifo_at(case, "file-digests.json")
    return Crafted("file-digests.json is a FIFO")


def data_fifo(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """index/data.mdb replaced by a FIFO: refused, never waited on."""
    _fifo_at(case, "index/data.mdb")
    return Crafted("index/data.mdb is a FIFO", foreign=["cache/index/data.mdb"], refuse=("data.mdb",))


def temp_name_fifos(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """FIFOs at the temp names earlier versions wrote the stamp, the damage marker and the
    digest memo through (``<name>.<pid>.tmp``) for the next pids, the stamp removed so
    the next writer writes one: kvstore's temp names are random and created with
    ``O_EXCL``, so none of them is ever opened."""
    cache = case / "cache"
    (cache / "index" / "clean").unlink(missing_ok=True)
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text()) if Path("/proc/sys/kernel/ns_last_pid").exists() \
        else os.getpid()
    planted = []
    for rel in ("index/clean", "index/damaged", "file-digests.json"):
        for pid in range(last + 1, last + 400):
            os.mkfifo(cache / f"{rel}.{pid}.tmp", 0o600)
            planted.append(f"cache/{rel}.{pid}.tmp")
    return Crafted("FIFOs at <name>.<pid>.tmp for the next pids", foreign=planted)


def written_name_symlinks(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """The clean stamp, the damage marker and the digest memo as symlinks to someone's
    files: kvstore replaces a name it writes (a rename), never writes through it."""
    cache = case / "cache"
    user = case / "outside" / "user-files"
    user.mkdir(parents=True, exist_ok=True)
    foreign = []
    for rel in ("index/clean", "index/damaged", "file-digests.json"):
        target = user / rel.replace("/", "_")
        target.write_bytes(os.urandom(rng.randint(1, 2000)))
        foreign.append(str(target.relative_to(case)))
        (cache / rel).unlink(missing_ok=True)
        os.symlink(target, cache / rel)
    return Crafted("index/clean, index/damaged and file-digests.json are symlinks to someone's files", foreign=foreign)


def damaged_fifo(case: Path, tpl: dict, rng: random.Random) -> Crafted:
    """index/damaged (the damage marker) replaced by a FIFO."""
    _fifo_at(case, "index/damaged")
    return Crafted("index/damaged is a FIFO")


PLANTED_CASES = [
    Case("blobs/ is a symlink to someone's files", blobs_symlink, "planted", ci=True),
    Case("a fan-out directory is a symlink", fanout_symlink, "planted", ci=True),
    Case("a pack file is a symlink", pack_symlink, "planted"),
    Case("a pack file is a FIFO", pack_fifo, "planted", ci=True),
    Case("pack-like names in the wrong places", pack_like_names, "planted"),
    Case("*.tmp files", tmp_files, "planted", ci=True),
    Case("sha256-* files", sha256_files, "planted"),
    Case("index/clean is a FIFO", stamp_fifo, "planted"),
    Case("file-digests.json is a FIFO", memo_fifo, "planted"),
    Case("index/data.mdb is a FIFO", data_fifo, "planted"),
    Case("FIFOs at the next pids' temp names", temp_name_fifos, "planted", ci=True),
    Case("written names are symlinks to someone's files", written_name_symlinks, "planted", ci=True),
    Case("index/damaged is a FIFO", damaged_fifo, "planted"),
]
DIR_CASES = RECORD_CASES + PLANTED_CASES
