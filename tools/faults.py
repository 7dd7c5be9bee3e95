#!/usr/bin/env python
"""Fault harness: a crash, a damaged file, a full disk or a bad call costs kvstore at most a miss.

Usage::

    python tools/faults.py                    # full size (the figures in tools/faults_results/)
    python tools/faults.py --quick            # a small run (a few minutes)
    python tools/faults.py --json FILE        # also write the figures as JSON
    python tools/faults.py --only crash,bad_input --seed 3 -v

Every fault kind counts, per trial, ``wrong_restores`` (a fetch hit whose cache fails the
oracle), ``escaped_exceptions`` (an exception that reached the caller of a KVStore method, or
a traceback out of ``verify``), ``crashes`` (a process the harness did not kill died by a
signal: LMDB segfault / SIGBUS) and ``entries_lost`` (an entry the store must still hold but
does not serve in full). All four must be 0.

What is checked after every fault ("the check", run in a separate checker process that
opens the directory fresh):
- every entry the index still claims (``Index.entries()``) is fetched by its stored token
  ids; a hit must pass the restored-equals-cold oracle (``tools/oracle.py``, tiny models,
  tolerance mode) *and* match a fresh prefill of the same tokens layer by layer (KV
  layers; synthetic caches are compared bit for bit with their deterministic regeneration);
  a hit whose arrays are bit-identical to a cache that already passed is not re-run;
- a claimed entry that misses (or only partly hits) must be explained: ``verify`` reports
  it (or one of its chunks), or the fault targeted it; otherwise it is an
  ``unexplained_miss``;
- ``maintenance.verify`` runs before the fetches (what is left), then ``verify(fix=True)``,
  then ``verify`` again, which must be clean (``verify_unclean`` otherwise); a reopened
  store must then serve every remaining entry in full from disk (``post_fix_misses``).

Fault kinds:
- ``crash``: kill -9 of a worker process at a random moment inside insert+flush, inside a
  write-behind flush, inside gc and inside ``verify --fix`` (the API, and the CLI when it is
  installed), plus mixed sequences. Directories live for several trials, so crash residue
  accumulates. An entry whose insert+flush returned before the kill must survive (entries
  gc chose to evict and entries the trial damaged on purpose are excused).
- ``corruption``: byte flips, truncation, deletion, zeroed ranges, swaps and stray files
  in blobs; flips, zeroed pages, truncation, deletion and garbage in ``index/data.mdb`` and
  ``lock.mdb``; single bit flips written through LMDB into one stored value (an entry or
  chunk record, token ids, a trie edge, a counter: what a flip LMDB cannot detect looks
  like); and ``live`` flips of data.mdb under an open store that must keep serving from
  memory. An entry whose blobs were not damaged must survive a blob fault. A damaged index
  may give a clear error (StoreOpenError), be moved aside at open (the documented
  recovery, which must be logged) or degrade to misses, never a crash or a wrong hit.
- ``full_disk``: the cache directory on a 4 MiB tmpfs mounted by the harness, filled by a
  filler file of random size and then by the store itself: serving continues from memory,
  every failed write is counted in ``stats()["write_errors"]``, nothing half-written is
  indexed, and writes resume once the filler is removed.
- ``permissions``: missing directory, a file in the way, read-only mounts, no permission
  (a worker running as ``nobody``), unusable ``index/`` or ``blobs/``: a clear
  ``StoreOpenError`` naming the problem, or (``on_disk_error="memory"``, and the
  LRUPromptCache drop-in) a warning and memory-only serving.
- ``concurrency``: 4 processes x 4 threads inserting, fetching, gc-ing and verifying one
  directory (synthetic caches checked bit for bit on every hit, tiny-llama caches through the
  oracle), then the check.
- ``bad_input``: empty, non-integer, negative, out-of-range and out-of-vocabulary token
  lists, enormous token lists, caches of the wrong length or classes, caches from another
  model (other layer classes, or the same classes with other KV heads, head_dim or dtype):
  a ValueError/TokenError naming the problem, a documented miss, or (a cache that does not
  fit the model) a documented refusal: counted in ``stats()["unpersistable"]``, warned, kept
  in memory only. The store (index records, blob files; the memory tier too for errors and
  misses) is unchanged.

The harness needs root for tmpfs mounts and for dropping to ``nobody``; without it those
cases are reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import platform
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHUNK = 32           # KVStore(chunk_tokens=...) everywhere: small blobs, many of them
EXTRA_TOKEN = 65     # token appended after a restored prefix for the oracle
N_GEN = 3            # greedy steps the oracle compares
VOCAB = 256          # prompts use the byte tokens of the tiny models

# trials per kind and size; "ci" is the subset tests/test_faults.py runs
SIZES: dict[str, dict[str, Any]] = {
    "full": dict(crash=240, crash_lineage=6, blob=720, lmdb=300, lmdb_live=40, full_disk=12,
                 conc_seconds=60, conc_procs=4, conc_threads=4, templates=3, huge_fetch=2_000_000,
                 huge_insert=100_000),
    "quick": dict(crash=24, crash_lineage=4, blob=60, lmdb=30, lmdb_live=6, full_disk=3,
                  conc_seconds=15, conc_procs=4, conc_threads=4, templates=2, huge_fetch=2_000_000,
                  huge_insert=100_000),
    "ci": dict(crash=8, crash_lineage=4, blob=24, lmdb=16, lmdb_live=2, full_disk=1,
               conc_seconds=8, conc_procs=4, conc_threads=4, templates=1, huge_fetch=200_000,
               huge_insert=20_000),
}

KINDS = ("crash", "corruption", "full_disk", "permissions", "concurrency", "bad_input")

# Bad inputs kvstore cannot detect with what it knows; reported, not counted as failures.
# (Empty since the identity records each attention layer's KV heads, head_dim and dtype: a
# cache of another model with the same layer classes is now refused like other mismatches.)
LIMITATIONS: dict[str, str] = {}
M64 = (1 << 64) - 1

log = logging.getLogger("kvfaults")


# =============================================================================== helpers


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def exc_info(where: str, e: BaseException) -> dict:
    return {"where": where, "type": type(e).__name__, "msg": str(e)[:500],
            "tb": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]}


class LogCapture(logging.Handler):
    """Collects warnings of the ``kvstore`` logger (what an operator would see)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(f"{record.levelname}: {record.getMessage()}"[:400])
        except Exception:
            pass

    def __enter__(self) -> "LogCapture":
        lg = logging.getLogger("kvstore")
        lg.addHandler(self)
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
        return self

    def __exit__(self, *a: Any) -> None:
        logging.getLogger("kvstore").removeHandler(self)

    def has(self, text: str) -> bool:
        return any(text in r for r in self.records)


# ================================================================ synthetic caches
# Values are a pure function of the token prefix (a rolling splitmix hash), so any restore
# can be checked bit for bit against a regeneration, without running a model.

SYN_LAYERS, SYN_HEADS, SYN_DIM = 2, 2, 8


def _prefix_hashes(tokens: list[int]):
    import numpy as np
    out = np.empty(len(tokens), dtype=np.uint64)
    h = 0x243F6A8885A308D3
    for i, t in enumerate(tokens):
        h = _splitmix(h ^ (int(t) * 0x9E3779B1 + i))
        out[i] = h
    return out


def _syn_values(tokens: list[int]):
    """float32 array (SYN_LAYERS, 2, 1, SYN_HEADS, n, SYN_DIM): exact 16-bit fractions."""
    import numpy as np
    n = len(tokens)
    H = _prefix_hashes(tokens)
    idx = np.arange(SYN_LAYERS * 2 * SYN_HEADS * SYN_DIM, dtype=np.uint64)
    shifts = (idx * np.uint64(7)) % np.uint64(49)
    bits = (H[:, None] >> shifts[None, :]) & np.uint64(0xFFFF)
    vals = (bits.astype(np.float32) / np.float32(65536.0)).reshape(n, SYN_LAYERS, 2, SYN_HEADS, SYN_DIM)
    return np.ascontiguousarray(vals.transpose(1, 2, 3, 0, 4)[:, :, None])


def _syn_state(tokens: list[int]):
    import numpy as np
    h = int(_prefix_hashes(tokens)[-1]) if tokens else 0
    return np.array([[((h >> s) & 0xFFFF) / 65536.0 for s in (0, 13, 26, 39)]], dtype=np.float32)


def syn_cache(kind: str, tokens: list[int]) -> list:
    """A synthetic prompt cache for ``tokens``: ``kv`` = 2 KVCache layers (chunkable),
    ``snap`` = ArraysCache + KVCache (a snapshot entry)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache
    vals = _syn_values(tokens)
    layers = []
    for layer in range(SYN_LAYERS):
        c = KVCache()
        if tokens:
            c.keys, c.values = mx.array(vals[layer, 0]), mx.array(vals[layer, 1])
            c.offset = len(tokens)
        layers.append(c)
    if kind == "snap":
        a = ArraysCache(1)
        if tokens:
            a.cache[0] = mx.array(_syn_state(tokens))
        layers[0] = a
    mx.eval([x for c in layers for x in (getattr(c, "keys", None), getattr(c, "values", None)) if x is not None])
    return layers


def syn_identity(kind: str):
    from kvstore.identity import Identity, layout_of
    return Identity.from_components({"synthetic": f"kvfaults-{kind}-v1", "layout": layout_of(syn_cache(kind, []))},
                                    name=f"synthetic-{kind}")


def syn_check(kind: str, tokens: list[int], cache: list, n: int) -> tuple[bool, str]:
    """Bit-exact comparison of a restored synthetic cache with its regeneration."""
    import numpy as np
    from mlx_lm.models.cache import ArraysCache, KVCache
    want = _syn_values(tokens[:n])
    if not isinstance(cache, list) or len(cache) != SYN_LAYERS:
        return False, f"cache has {len(cache) if isinstance(cache, list) else type(cache)} layers"
    for layer, c in enumerate(cache):
        if kind == "snap" and layer == 0:
            if type(c) is not ArraysCache or c.cache[0] is None:
                return False, f"layer 0 is {type(c).__name__}"
            if not np.array_equal(np.array(c.cache[0]), _syn_state(tokens[:n])):
                return False, "recurrent state differs"
            continue
        if type(c) is not KVCache or c.offset != n:
            return False, f"layer {layer}: {type(c).__name__} offset {getattr(c, 'offset', None)} != {n}"
        k, v = np.array(c.keys[..., :n, :]), np.array(c.values[..., :n, :])
        if k.shape != want[layer, 0].shape or not np.array_equal(k, want[layer, 0]) or not np.array_equal(v, want[layer, 1]):
            return False, f"layer {layer}: arrays differ from the regeneration"
    return True, "ok"


# ================================================================ prompts


def random_prompt(rng: random.Random, lo: int = 8, hi: int = 160, bases: list[list[int]] | None = None) -> list[int]:
    """Byte tokens; shares prefixes with ``bases`` (system prompts, earlier turns) often."""
    if bases and rng.random() < 0.6:
        base = rng.choice(bases)
        cut = len(base) if rng.random() < 0.5 else rng.randint(1, len(base))
        return base[:cut] + [rng.randrange(VOCAB) for _ in range(rng.randint(max(1, lo // 2), max(2, hi // 2)))]
    return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]


SYSTEM_PROMPTS = [[(i * 37 + 11 * s) % VOCAB for i in range(n)] for s, n in ((1, 40), (2, 70), (3, 33))]


# ================================================================ models and the oracle


MODEL_NAMES = {"llama": "tiny-llama", "gemma": "tiny-gemma3", "qwen": "tiny-qwen3next"}


class Zoo:
    """Tiny models, their identities and the oracle, with a memo of verified caches."""

    def __init__(self, names: tuple[str, ...] = ("llama", "gemma", "qwen")) -> None:
        from tools.models import load_model, model_path
        self.models: dict[str, Any] = {}
        self.paths: dict[str, str] = {}
        for n in names:
            self.models[n] = load_model(MODEL_NAMES[n])[0]
            self.paths[n] = str(model_path(MODEL_NAMES[n]))
        self._refs: dict[tuple, Any] = {}
        self.verified: dict[tuple, str] = {}   # (model, tokens) -> digest of a cache that passed
        self.oracle_runs = 0
        self.syn = {k: syn_identity(k) for k in ("kv", "snap")}
        self._ident_hex: dict[str, str] = {}

    def prefill(self, name: str, tokens: list[int]) -> list:
        from tools import oracle
        return oracle.prefill(self.models[name], tokens)

    def model_arg(self, name: str) -> Any:
        """What a caller passes to KVStore.fetch / insert for this model."""
        if name.startswith("syn-"):
            return self.syn[name[4:]]
        return self.paths[name]

    def make_cache(self, name: str, tokens: list[int]) -> list:
        return syn_cache(name[4:], tokens) if name.startswith("syn-") else self.prefill(name, tokens)

    def ident_map(self, store: Any) -> dict[str, str]:
        """identity hex -> model name (real and synthetic)."""
        if not self._ident_hex:
            for n in self.paths:
                ident = store.identity(self.paths[n])
                if ident is not None:
                    self._ident_hex[ident.hex] = n
            for k, ident in self.syn.items():
                self._ident_hex[ident.hex] = f"syn-{k}"
        return self._ident_hex

    def check(self, name: str, tokens: list[int], cache: list, n: int) -> tuple[bool, str]:
        """Does ``cache`` (claimed to hold ``tokens[:n]``) restore correctly?"""
        if name.startswith("syn-"):
            return syn_check(name[4:], tokens, cache, n)
        from tools import oracle
        try:
            digest = cache_digest(cache)
        except Exception as e:
            return False, f"cannot read restored cache: {e!r}"
        key = (name, tuple(tokens[:n]))
        if self.verified.get(key) == digest:
            return True, "ok (bit-identical to a verified cache)"
        model = self.models[name]
        vocab = self.vocab(name)
        bad = next((t for t in tokens[:n] if not 0 <= int(t) < vocab), None)
        if bad is not None:  # (and running the model on it would read out of bounds)
            return False, f"a hit covers token {bad}, outside the vocabulary ({vocab}): no valid cache exists"
        prompt = list(tokens[:n]) + [EXTRA_TOKEN]
        ok_regen, why = self._regen_check(name, tokens[:n], cache)
        ref = self._refs.get((name, tuple(prompt)))
        if ref is None:
            ref = oracle.cold_run(model, prompt, n_gen=N_GEN)
            if len(self._refs) > 4000:
                self._refs.clear()
            self._refs[(name, tuple(prompt))] = ref
        try:
            res = oracle.check_restore(model, prompt, cache, n, n_gen=N_GEN, reference=ref)
        except Exception as e:
            return False, f"oracle could not run the restored cache: {e!r}"
        self.oracle_runs += 1
        if res.ok and ok_regen:
            self.verified[key] = digest
            return True, res.detail
        return False, res.detail if not res.ok else why

    def vocab(self, name: str) -> int:
        return int(json.loads((Path(self.paths[name]) / "config.json").read_text())["vocab_size"])

    def _regen_check(self, name: str, tokens: list[int], cache: list) -> tuple[bool, str]:
        """KV layers equal (to 1e-4) a fresh prefill of the same tokens."""
        import numpy as np
        from mlx_lm.models.cache import KVCache
        fresh = self.prefill(name, tokens)
        if len(fresh) != len(cache):
            return False, f"restored cache has {len(cache)} layers, the model {len(fresh)}"
        n = len(tokens)
        for i, (a, b) in enumerate(zip(cache, fresh)):
            if type(a) is not type(b):
                return False, f"layer {i}: {type(a).__name__}, the model makes {type(b).__name__}"
            if type(a) is KVCache:
                if a.offset != n:
                    return False, f"layer {i}: offset {a.offset} != {n}"
                ka, kb = np.array(a.keys[..., :n, :]), np.array(b.keys[..., :n, :])
                va, vb = np.array(a.values[..., :n, :]), np.array(b.values[..., :n, :])
                if ka.shape != kb.shape or not (np.allclose(ka, kb, atol=1e-4) and np.allclose(va, vb, atol=1e-4)):
                    return False, f"layer {i}: KV differs from a fresh prefill"
        return True, "ok"


def cache_digest(cache: list) -> str:
    import numpy as np
    import xxhash
    from kvstore import codec
    tensors, layout = codec.encode_cache(cache)
    h = xxhash.xxh3_128()
    h.update(json.dumps(layout, sort_keys=True).encode())
    for k in sorted(tensors):
        a = tensors[k]
        if "bfloat16" in str(a.dtype):
            import mlx.core as mx
            a = a.view(mx.uint16)
        arr = np.ascontiguousarray(np.array(a))
        h.update(f"{k}:{arr.dtype}:{arr.shape}".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


# ================================================================ store inspection


def raw_entries(store: Any) -> list[tuple[bytes, dict | None, bytes | None]]:
    """(key, parsed record or None, token bytes) of every entry record, one read txn."""
    idx = store.disk.index
    db = idx._db

    def run(txn: Any) -> list:
        out = []
        for k, v in txn.cursor(db=db["entries"]):
            k = bytes(k)
            try:
                rec = json.loads(bytes(v))
                rec = rec if isinstance(rec, dict) else None
            except ValueError:
                rec = None
            t = txn.get(k, db=db["tokens"])
            out.append((k, rec, bytes(t) if t is not None else None))
        return out
    return idx.read(run)


def logical_dump(store: Any) -> dict:
    """Every key/value of every index database plus blob files (name -> xxh3): the
    store's persistent state, independent of LMDB page layout."""
    import xxhash
    idx = store.disk.index
    state: dict[str, Any] = {}

    def run(txn: Any) -> dict:
        return {name: sorted((bytes(k).hex(), xxhash.xxh3_64_hexdigest(bytes(v))) for k, v in txn.cursor(db=db))
                for name, db in idx._db.items()}
    state["index"] = idx.read(run)
    files = {}
    for p in sorted(Path(store.disk.root).rglob("*")):
        if p.is_file() and "index" not in p.relative_to(store.disk.root).parts and p.name != "file-digests.json":
            files[str(p.relative_to(store.disk.root))] = xxhash.xxh3_64_hexdigest(p.read_bytes())
    state["files"] = files
    return state


def blob_users(store: Any) -> dict[str, set[str]]:
    """blob path (relative to blobs/) -> entry keys (hex) that need it."""
    idx = store.disk.index
    users: dict[str, set[str]] = defaultdict(set)
    chunks = {}
    for k, rec in idx.chunks():
        chunks[k.hex()] = rec
    for k, rec, _ in raw_entries(store):
        if rec is None:
            continue
        if rec.get("blob"):
            users[rec["blob"]].add(k.hex())
        for ck in rec.get("chunks", []):
            c = chunks.get(ck)
            if c and c.get("blob"):
                users[c["blob"]].add(k.hex())
    return users


# ================================================================ the check


def check_store(zoo: Zoo, cache_dir: str, *, known: list | None = None, targets: set | None = None,
                committed: set | None = None, fix: bool = True, reopen: bool = True,
                max_fetch: int | None = None) -> dict:
    """Open ``cache_dir`` fresh and judge it (see the module docstring).

    ``known``: [(model, tokens)] the directory should serve (fetched too; a hit must pass);
    ``targets``: entry keys (hex) the fault damaged or legitimately removed (their misses
    are explained); ``committed``: entry keys that must still be served in full.
    """
    from kvstore import KVStore, StoreOpenError
    from kvstore import maintenance as mt
    targets = set(targets or ())
    committed = set(committed or ())
    res: dict[str, Any] = dict(open="ok", escaped=[], wrong=[], claimed=0, full=0, partial=0, miss=0,
                               unexplained=[], lost=[], verify={}, verify_after_fix=None, verify_errors=[],
                               post_fix_misses=0, logs=[], aside=False, aside_logged=None, foreign=0,
                               known_hits=0, known=0, unparsable=0)
    asides_before = set(glob.glob(os.path.join(cache_dir, "index.corrupt-*")))
    cap = LogCapture()
    with cap:
        try:
            store = KVStore(cache_dir, chunk_tokens=CHUNK, max_entries=100_000)
        except StoreOpenError as e:
            res["open"] = "open_error"
            res["open_error"] = str(e)
            res["logs"] = cap.records[-5:]
            return res
        except Exception as e:
            res["open"] = "exception"
            res["escaped"].append(exc_info("KVStore()", e))
            return res
        asides = set(glob.glob(os.path.join(cache_dir, "index.corrupt-*"))) - asides_before
        if asides:
            res["aside"] = True
            res["open"] = "recovered"
            res["aside_logged"] = cap.has("moved aside")
        if store.disk is None:
            res["open"] = "memory_only"
        try:
            _judge(zoo, store, res, known or [], targets, committed, max_fetch)
            if store.disk is not None:
                if fix:
                    try:
                        mt.verify(store.disk, fix=True, tmp_age=0, blob_age=0)
                        left = mt.verify(store.disk, tmp_age=0, blob_age=0)
                        res["verify_after_fix"] = dict(Counter(p.kind for p in left))
                        res["verify_after_fix_detail"] = [f"{p.kind} {p.key} {p.detail}" for p in left[:5]]
                    except Exception as e:
                        res["verify_errors"].append(exc_info("verify(fix=True)", e))
        finally:
            try:
                store.close()
            except Exception as e:
                res["escaped"].append(exc_info("close()", e))
        if fix and reopen and res["open"] in ("ok", "recovered") and not res["verify_errors"]:
            try:
                store = KVStore(cache_dir, chunk_tokens=CHUNK, max_entries=100_000)
            except Exception as e:
                res["escaped"].append(exc_info("KVStore() after verify --fix", e))
            else:
                try:
                    names = zoo.ident_map(store)
                    for k, rec, toks in raw_entries(store):
                        if rec is None or toks is None or rec.get("identity") not in names:
                            continue
                        tokens = _decode(toks)
                        name = names[rec["identity"]]
                        f = store.fetch(zoo.model_arg(name), tokens)
                        if f.n != len(tokens):
                            res["post_fix_misses"] += 1
                        elif f.cache is not None:
                            ok, why = zoo.check(name, tokens, f.cache, f.n)
                            if not ok:
                                res["wrong"].append({"key": k.hex(), "model": name, "n": f.n, "after_fix": True,
                                                     "detail": why})
                except Exception as e:
                    res["escaped"].append(exc_info("fetch after verify --fix", e))
                finally:
                    try:
                        store.close()
                    except Exception as e:
                        res["escaped"].append(exc_info("close()", e))
        res["logs"] = cap.records[-8:]
    return res


def _decode(b: bytes) -> list[int]:
    from kvstore.keys import decode_tokens
    return decode_tokens(b)


def _judge(zoo: Zoo, store: Any, res: dict, known: list, targets: set, committed: set,
           max_fetch: int | None) -> None:
    from kvstore import maintenance as mt
    claimed: list[tuple[str, str, list[int], dict]] = []
    problem_keys: set[str] = set()
    if store.disk is not None:
        names = zoo.ident_map(store)
        try:
            for k, rec, toks in raw_entries(store):
                if rec is None or toks is None:
                    res["unparsable"] += 1
                    continue
                name = names.get(rec.get("identity"))
                if name is None:
                    res["foreign"] += 1
                    continue
                claimed.append((k.hex(), name, _decode(toks), rec))
        except Exception as e:
            res["enumerate_error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            problems = mt.verify(store.disk, tmp_age=0, blob_age=0)
            res["verify"] = dict(Counter(p.kind for p in problems))
            problem_keys = {p.key for p in problems if p.key}
        except Exception as e:
            res["verify_errors"].append(exc_info("verify()", e))
    res["claimed"] = len(claimed)
    lengths = {c[0]: len(c[2]) for c in claimed}
    if max_fetch is not None and len(claimed) > max_fetch:
        random.Random(len(claimed)).shuffle(claimed)
        claimed = claimed[:max_fetch]
    served: dict[str, int] = {}
    for hx, name, tokens, rec in claimed:
        try:
            f = store.fetch(zoo.model_arg(name), tokens)
        except Exception as e:
            res["escaped"].append(exc_info("fetch()", e))
            continue
        n = f.n
        served[hx] = n
        if f.cache is not None and n > 0:
            ok, why = zoo.check(name, tokens, f.cache, n)
            if not ok:
                res["wrong"].append({"key": hx, "model": name, "n": n, "of": len(tokens), "source": f.source,
                                     "detail": why})
        if n == len(tokens):
            res["full"] += 1
            continue
        res["partial" if n else "miss"] += 1
        explained = hx in problem_keys or hx in targets or any(ck in problem_keys for ck in rec.get("chunks", []))
        if not explained:
            res["unexplained"].append({"key": hx, "model": name, "n": n, "of": len(tokens)})
    for hx in sorted(committed - targets):
        if hx not in lengths:
            res["lost"].append(hx)       # committed, and the index no longer names it
        elif hx in served and served[hx] != lengths[hx]:
            res["lost"].append(hx)       # named, but not served in full
    for name, tokens in known:
        res["known"] += 1
        try:
            f = store.fetch(zoo.model_arg(name), tokens)
        except Exception as e:
            res["escaped"].append(exc_info("fetch()", e))
            continue
        if f.cache is not None and f.n > 0:
            res["known_hits"] += f.n == len(tokens)
            ok, why = zoo.check(name, tokens, f.cache, f.n)
            if not ok:
                res["wrong"].append({"model": name, "n": f.n, "of": len(tokens), "source": f.source,
                                     "detail": why, "known": True})
    try:
        store.stats()
    except Exception as e:
        res["escaped"].append(exc_info("stats()", e))
    try:
        store.flush(30)
    except Exception as e:
        res["escaped"].append(exc_info("flush()", e))


# ================================================================ worker operations
# Each runs inside a worker process and returns a JSON-able dict. ``emit`` sends an event
# line to the parent at once (crash workers report progress through it).

Emit = Callable[[dict], None]


def _guard(where: str, escaped: list, fn: Callable, *a: Any, **kw: Any) -> Any:
    try:
        return fn(*a, **kw)
    except Exception as e:
        escaped.append(exc_info(where, e))
        return None


def _entry_key(store: Any, zoo: Zoo, name: str, tokens: list[int]) -> str | None:
    from kvstore.keys import encode_tokens, key_of, root_key
    ident = store.identity(zoo.model_arg(name))
    return key_of(root_key(ident.digest), encode_tokens(tokens), CHUNK).hex() if ident else None


def _pick_model(rng: random.Random, weights: tuple = (0.7, 0.22)) -> str:
    r = rng.random()
    return "llama" if r < weights[0] else "gemma" if r < weights[0] + weights[1] else "qwen"


def _prompt_for(rng: random.Random, name: str, bases: list[list[int]]) -> list[int]:
    if name == "qwen":  # the recurrent model prefills slowly on CPU: keep it short
        return random_prompt(rng, 6, 40, None)[:48]
    return random_prompt(rng, 8, 160, bases)[:220]


def damage_file(path: Path, mode: str, rng: random.Random, *, other: Path | None = None) -> str:
    """Damage one file in place; returns a description. Modes: flip (1-4 random bits),
    flip_head (a bit in the first 64 bytes), flips (8-64 random bytes), zero (a range),
    truncate, empty, delete, append, swap (replace by ``other``)."""
    data = bytearray(path.read_bytes()) if path.exists() else bytearray()
    size = len(data)
    if mode == "delete":
        path.unlink()
        return "deleted"
    if mode == "swap" and other is not None:
        shutil.copyfile(other, path)
        return f"replaced by {other.name}"
    if mode == "append":
        with open(path, "ab") as f:
            f.write(os.urandom(rng.randint(1, 64)))
        return "appended"
    if mode == "empty" or size == 0:
        path.write_bytes(b"")
        return "emptied"
    if mode == "truncate":
        n = rng.randrange(size)
        with open(path, "r+b") as f:
            f.truncate(n)
        return f"truncated to {n} of {size}"
    if mode == "zero":
        a = rng.randrange(size)
        b = min(size, a + rng.randint(1, 4096))
        data[a:b] = bytes(b - a)
        desc = f"zeroed [{a},{b})"
    elif mode == "flip_head":
        off = rng.randrange(min(size, 64))
        data[off] ^= 1 << rng.randrange(8)
        desc = f"bit flip at {off}"
    elif mode == "flips":
        offs = sorted(rng.randrange(size) for _ in range(rng.randint(8, 64)))
        for o in offs:
            data[o] ^= rng.randint(1, 255)
        desc = f"{len(offs)} byte flips in [{offs[0]},{offs[-1]}]"
    else:  # flip
        offs = sorted(rng.randrange(size) for _ in range(rng.randint(1, 4)))
        for o in offs:
            data[o] ^= 1 << rng.randrange(8)
        desc = f"bit flips at {offs}"
    with open(path, "r+b") as f:  # in place (same inode)
        f.write(data)
    return desc


def op_crash_run(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Store work for one crash trial; the parent kills this process at a random moment."""
    from kvstore import KVStore
    from kvstore import maintenance as mt

    rng = random.Random(msg["seed"])
    phase = msg["phase"]
    escaped: list[dict] = []

    def ev(kind: str, **kw: Any) -> None:
        emit(dict(ev=kind, t=time.time(), **kw))

    def flush_escapes() -> None:
        while escaped:
            ev("escaped", **escaped.pop(0))

    store = _guard("KVStore()", escaped, KVStore, msg["dir"], chunk_tokens=CHUNK, max_entries=4)
    if store is None:
        flush_escapes()
        return {"opened": False}
    ev("opened")
    bases = [list(p) for p in SYSTEM_PROMPTS]
    try:
        names = zoo.ident_map(store)
        for k, rec, toks in raw_entries(store)[:40]:
            if rec and toks and names.get(rec.get("identity")) == "llama":
                bases.append(_decode(toks))
    except Exception:
        pass

    def committed(k: str) -> bool:
        return store.disk.index.entry(bytes.fromhex(k)) is not None

    def prepare() -> tuple[str, list[int], list]:
        name = _pick_model(rng)
        toks = _prompt_for(rng, name, bases)
        if name == "llama":
            bases.append(toks)
        return name, toks, zoo.prefill(name, toks)

    def insert(i: int, flush: bool, prepared: tuple | None = None) -> str | None:
        name, toks, cache = prepared or prepare()
        k = _entry_key(store, zoo, name, toks)
        we, dropped = store._stats["write_errors"], store.writer.dropped
        ev("begin", op="insert", i=i, key=k, model=name, n=len(toks))
        _guard("insert()", escaped, store.insert, zoo.model_arg(name), toks, cache)
        if flush:
            _guard("flush()", escaped, store.flush)
            if store._stats["write_errors"] == we and store.writer.dropped == dropped and committed(k):
                ev("committed", key=k)
            else:
                ev("not_committed", key=k, write_errors=store._stats["write_errors"] - we)
        ev("end", op="insert", i=i)
        flush_escapes()
        return k

    def gc(i: int) -> None:
        # pending writes and hit bookkeeping first: a touch committed between the dry run and
        # gc would change the LRU order, and gc would rightly evict another entry
        _guard("flush()", escaped, store.flush)
        total = store.disk.index.total_bytes()
        budget = int(total * rng.uniform(0.2, 0.9))
        victims = mt.evict_to(store.disk, budget, dry_run=True)
        ev("excuse", keys=[k.hex() for k, _ in victims], why="gc victims")
        ev("begin", op="gc", i=i)
        _guard("gc()", escaped, mt.gc, store.disk, max_bytes=budget, tmp_age=0, blob_age=0)
        ev("end", op="gc", i=i)
        flush_escapes()

    def damage(n: int) -> None:
        users = blob_users(store)
        if not users:
            return
        hit: set[str] = set()
        for blob in rng.sample(sorted(users), min(n, len(users))):
            mode = rng.choice(["flip", "truncate", "delete", "zero"])
            damage_file(store.disk.blob_root / blob, mode, rng)
            hit |= users[blob]
        ev("excuse", keys=sorted(hit), why="damaged")

    def verify_fix(i: int) -> None:
        if msg.get("cli"):
            cmd = [sys.executable, "-m", "kvstore.cli", "verify", "--cache-dir", msg["dir"], "--fix",
                   "--tmp-age", "0", "--blob-age", "0"]
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            ev("begin", op="cli_verify", i=i, pid=p.pid)
            _, err = p.communicate()
            ev("end", op="cli_verify", i=i, rc=p.returncode, stderr=err.decode(errors="replace")[-800:])
            if p.returncode not in (0, 1):
                ev("escaped", where="kvstore verify --fix", type=f"exit {p.returncode}",
                   msg=err.decode(errors="replace")[-400:], tb="")
            return
        ev("begin", op="verify", i=i)
        _guard("verify(fix=True)", escaped, mt.verify, store.disk, fix=True, tmp_age=0, blob_age=0)
        ev("end", op="verify", i=i)
        flush_escapes()

    def fetch(i: int) -> None:
        name = _pick_model(rng)
        if not bases:
            return
        toks = rng.choice(bases) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 8))]
        ev("begin", op="fetch", i=i)
        f = _guard("fetch()", escaped, store.fetch, zoo.model_arg("llama"), toks)
        ev("end", op="fetch", i=i)
        if f is not None and f.cache is not None and f.n > 0:
            ok, why = zoo.check("llama", toks, f.cache, f.n)
            if not ok:
                ev("wrong", key=None, n=f.n, detail=why)
        flush_escapes()

    if phase == "insert":
        for i in range(8):
            insert(i, True)
    elif phase == "flush":  # queue several writes at once, then flush: the writer is busy
        ready = [prepare() for _ in range(6)]
        keys = [insert(i, False, ready[i]) for i in range(6)]
        ev("begin", op="flush", i=0)
        _guard("flush()", escaped, store.flush)
        ev("end", op="flush", i=0)
        for k in keys:
            if k and committed(k):
                ev("committed", key=k)
    elif phase == "gc":
        for i in range(4):
            insert(i, True)
        gc(0)
    elif phase in ("verify", "cli_verify"):
        for i in range(5):
            insert(i, True)
        damage(rng.randint(2, 5))
        verify_fix(0)
    else:  # mixed
        for i in range(10):
            op = rng.choice(["insert_flush", "insert_flush", "insert", "fetch", "gc", "verify", "flush"])
            if op == "insert_flush":
                insert(i, True)
            elif op == "insert":
                insert(i, False)
            elif op == "fetch":
                fetch(i)
            elif op == "gc":
                gc(i)
            elif op == "verify":
                _guard("flush()", escaped, store.flush)
                verify_fix(i)
            else:
                ev("begin", op="flush", i=i)
                _guard("flush()", escaped, store.flush)
                ev("end", op="flush", i=i)
    flush_escapes()
    ev("done")
    _guard("close()", escaped, store.close)
    flush_escapes()
    return {"opened": True}


TEMPLATE_MIX = (("llama", 9), ("gemma", 3), ("qwen", 1), ("syn-kv", 3), ("syn-snap", 2))


def op_build_template(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """A populated cache directory for corruption cases: chunked entries sharing prefixes and
    chunks, snapshots (RotatingKVCache, ArraysCache) and synthetic entries."""
    from kvstore import KVStore
    rng = random.Random(msg["seed"])
    store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=100)
    entries = []
    bases = [list(p) for p in SYSTEM_PROMPTS[:2]]
    for name, count in TEMPLATE_MIX:
        for _ in range(count):
            if name == "qwen":
                toks = random_prompt(rng, 20, 30)
            elif name == "gemma" and not any(e["model"] == "gemma" for e in entries):
                toks = random_prompt(rng, 12, 28)  # <= the window: a trimmable snapshot
            elif name == "gemma":
                toks = random_prompt(rng, 40, 120)
            else:
                toks = random_prompt(rng, 20, 150, bases if name != "syn-snap" else None)
                if name == "llama":
                    bases.append(toks)
            store.insert(zoo.model_arg(name), toks, zoo.make_cache(name, toks))
            store.flush()
            entries.append({"model": name, "tokens": toks, "key": _entry_key(store, zoo, name, toks)})
    users = {b: sorted(u) for b, u in blob_users(store).items()}
    stats = store.stats()
    store.close()
    data = Path(msg["dir"]) / "index" / "data.mdb"
    return {"entries": entries, "blob_users": users, "data_mdb": data.stat().st_size,
            "write_errors": stats["write_errors"], "disk_entries": stats.get("disk_entries")}


def op_check(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    return check_store(zoo, msg["dir"], known=[tuple(x) for x in msg.get("known", [])],
                       targets=set(msg.get("targets", [])), committed=set(msg.get("committed", [])),
                       fix=msg.get("fix", True), reopen=msg.get("reopen", True), max_fetch=msg.get("max_fetch"))


def op_live(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Damage index/data.mdb under an open store: it must keep serving from memory."""
    from kvstore import KVStore
    from kvstore import maintenance as mt
    rng = random.Random(msg["seed"])
    res: dict[str, Any] = dict(escaped=[], wrong=[], memory_served=0, known=0, verify_errors=[],
                               inserts_after=0, write_errors=0, writer_failed=0)
    cap = LogCapture()
    with cap:
        store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=1000)
        known = [tuple(x) for x in msg["known"]]
        for name, toks in known:  # warm the memory tier from disk
            f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is not None and f.cache is not None and f.n:
                ok, why = zoo.check(name, toks, f.cache, f.n)
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why, "phase": "before"})
        store.flush()
        baseline = {}  # what the memory tier serves before the damage (second pass: memory only)
        for name, toks in known:
            f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is not None and f.source == "memory":
                baseline[(name, tuple(toks))] = f.n
        store.flush()
        data = Path(msg["dir"]) / "index" / "data.mdb"
        size = data.stat().st_size
        fd = os.open(data, os.O_RDWR)
        descs = []
        try:
            for _ in range(rng.randint(1, 6)):
                if rng.random() < 0.3:
                    page = rng.randrange(2, max(3, size // 4096))
                    a, b = page * 4096 + rng.randrange(4096), 0
                    b = min(size, a + rng.randint(16, 1024))
                    os.pwrite(fd, bytes(b - a), a)
                    descs.append(f"zero [{a},{b})")
                else:
                    off = rng.randrange(size)
                    cur = os.pread(fd, 1, off)
                    os.pwrite(fd, bytes([cur[0] ^ (1 << rng.randrange(8))]), off)
                    descs.append(f"flip {off}")
        finally:
            os.close(fd)
        res["damage"] = descs
        for name, toks in known:
            res["known"] += 1
            f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
            if f is None:
                continue
            want = baseline.get((name, tuple(toks)), 0)
            if f.n >= want:
                res["memory_served"] += 1
            if f.cache is not None and f.n:
                ok, why = zoo.check(name, toks, f.cache, f.n)
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why, "phase": "after"})
        for i in range(2):
            toks = random_prompt(rng, 20, 90)
            n_esc = len(res["escaped"])
            _guard("insert()", res["escaped"], store.insert, zoo.model_arg("llama"), toks, zoo.prefill("llama", toks))
            if len(res["escaped"]) == n_esc:
                f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg("llama"), toks)
                if f is not None and f.n == len(toks):
                    res["inserts_after"] += 1
        _guard("flush()", res["escaped"], store.flush, 30)
        _guard("stats()", res["escaped"], store.stats)
        res["write_errors"] = store._stats["write_errors"]
        res["writer_failed"] = store.writer.failed if store.writer else 0
        try:
            mt.verify(store.disk, tmp_age=0, blob_age=0)
        except Exception as e:
            res["verify_errors"].append(exc_info("verify()", e))
        _guard("close()", res["escaped"], store.close)
    res["logs"] = cap.records[-6:]
    return res


def _fill(path: Path, nbytes: int) -> int:
    """Write up to ``nbytes`` into ``path`` (stops at ENOSPC); returns bytes written."""
    done = 0
    block = b"\xa5" * (64 << 10)
    try:
        f = open(path, "ab", buffering=0)  # unbuffered: nothing left to fail at close
    except OSError:  # not even room for the file
        return 0
    with f:
        while done < nbytes:
            try:
                n = f.write(block[: min(len(block), nbytes - done)])
            except OSError:
                break
            if not n:
                break
            done += n
    return done


def op_full_disk(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """The cache directory on a small tmpfs (mounted by the parent) that fills up."""
    import kvstore.index as kindex
    from kvstore import KVStore
    from kvstore import maintenance as mt
    rng = random.Random(msg["seed"])
    mnt = Path(msg["mnt"])
    cdir = mnt / "cache"
    filler = mnt / "filler"
    res: dict[str, Any] = dict(escaped=[], wrong=[], inserts=0, persisted=0, failed_writes=0,
                               uncounted_failures=0, memory_misses=0, verify_problems={}, reopen_misses=0,
                               reopen_checked=0, resumed=0, resume_failures=0, writer_failed=0,
                               error_messages=[], map=msg.get("small_map", False))
    saved_map = kindex._INITIAL_MAP
    if msg.get("small_map"):
        kindex._INITIAL_MAP = 64 << 10  # reach MDB_MAP_FULL (and the map growth path) on the small disk
    cap = LogCapture()
    digests: dict[str, str] = {}
    inserted: list[tuple[str, list[int], str]] = []
    import kvstore.blobs as kblobs
    real_write = kblobs.write_blob
    armed = {"on": False}

    def write_then_fill(path: Any, tensors: Any, metadata: Any) -> Any:
        """The disk fills between a blob write and the index commit (the LMDB write fails)."""
        out = real_write(path, tensors, metadata)
        if armed["on"]:
            armed["on"] = False
            _fill(mnt / "filler2", 1 << 30)
        return out

    if msg.get("fill_between"):
        kblobs.write_blob = write_then_fill
    try:
        with cap:
            store = KVStore(cdir, chunk_tokens=CHUNK, max_entries=100_000)

            def insert(toks: list[int], name: str) -> bool | None:
                cache = zoo.make_cache(name, toks)
                dg = cache_digest(cache)
                k = _entry_key(store, zoo, name, toks)
                we, failed, dropped = store._stats["write_errors"], store.writer.failed, store.writer.dropped
                n_esc = len(res["escaped"])
                _guard("insert()", res["escaped"], store.insert, zoo.model_arg(name), toks, cache)
                _guard("flush()", res["escaped"], store.flush)
                if len(res["escaped"]) != n_esc:
                    return None
                inserted.append((name, toks, dg))
                digests[k] = dg
                ok = _guard("index.entry()", res["escaped"], store.disk.index.entry, bytes.fromhex(k)) is not None
                d_we = store._stats["write_errors"] - we
                d_failed = store.writer.failed - failed
                if not ok and d_we == 0:
                    res["uncounted_failures"] += 1  # a failed write that write_errors did not count
                res["writer_failed"] += d_failed
                return ok

            for _ in range(msg.get("pre_entries", 0)):
                insert(random_prompt(rng, 30, 150), "llama")
            st = os.statvfs(mnt)
            free = st.f_bavail * st.f_frsize
            res["filler"] = _fill(filler, max(0, free - msg["leave"]))
            fails = 0
            for i in range(msg.get("max_inserts", 60)):
                armed["on"] = bool(msg.get("fill_between")) and i == 0
                r = rng.random()  # small synthetic entries fill the last bytes (the index's own pages)
                name = "llama" if r < 0.55 else "gemma" if r < 0.7 else "syn-kv"
                ok = insert(random_prompt(rng, 30, 200), name)
                res["inserts"] += 1
                if ok:
                    res["persisted"] += 1
                    fails = 0
                else:
                    res["failed_writes"] += 1
                    fails += 1
                    if fails >= 4:
                        break
            res["write_errors"] = store._stats["write_errors"]
            # serving continues from memory: every insert is still a full, correct hit
            for name, toks, dg in inserted:
                f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), toks)
                if f is None or f.n != len(toks) or f.cache is None:
                    res["memory_misses"] += 1
                elif cache_digest(f.cache) != dg:
                    ok, why = zoo.check(name, toks, f.cache, f.n)
                    if not ok:
                        res["wrong"].append({"model": name, "n": f.n, "detail": why})
            _guard("stats()", res["escaped"], store.stats)
            try:  # nothing half-written is indexed (and nothing left behind)
                probs = mt.verify(store.disk, tmp_age=0, blob_age=0)
                res["verify_problems"] = dict(Counter(p.kind for p in probs))
                res["verify_detail"] = [f"{p.kind} {p.path} {p.detail}" for p in probs[:5]]
            except Exception as e:
                res["escaped"].append(exc_info("verify()", e))
            _guard("close()", res["escaped"], store.close)
            # a fresh store serves every indexed entry in full, bit-identical to what was inserted
            store = KVStore(cdir, chunk_tokens=CHUNK, max_entries=100_000)
            names = zoo.ident_map(store)
            for k, rec, toks in raw_entries(store):
                tokens = _decode(toks)
                name = names.get(rec.get("identity"))
                f = _guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), tokens)
                res["reopen_checked"] += 1
                if f is None or f.n != len(tokens) or f.source != "disk":
                    res["reopen_misses"] += 1
                elif cache_digest(f.cache) != digests.get(k.hex()):
                    res["wrong"].append({"key": k.hex(), "detail": "disk entry differs from what was inserted"})
            # space comes back: writing resumes
            filler.unlink()
            with contextlib.suppress(FileNotFoundError):
                (mnt / "filler2").unlink()
            for i in range(msg.get("resume_inserts", 4)):
                ok = insert(random_prompt(rng, 30, 120), "llama")
                res["resumed" if ok else "resume_failures"] += 1
            res["stats"] = {k: v for k, v in (_guard("stats()", res["escaped"], store.stats) or {}).items()
                            if k in ("write_errors", "writes", "dropped_writes", "disk_entries", "disk_bytes")}
            _guard("close()", res["escaped"], store.close)
            res["error_messages"] = sorted({r for r in cap.records if "WARNING" in r or "ERROR" in r})[:8]
            res["map_grown"] = sum("map full" in r for r in cap.records)
            res["index_enospc"] = sum("mdb_txn_commit" in r for r in cap.records)
    finally:
        kindex._INITIAL_MAP = saved_map
        kblobs.write_blob = real_write
    return res


def op_open_full(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Open a store on a filesystem that is already full."""
    return _open_modes(msg["dir"])


def _open_modes(cdir: str, modes: tuple = ("raise", "memory", "lru")) -> dict:
    """Open ``cdir`` the three ways a caller can and use the store: outcome per mode."""
    from kvstore import KVStore, LRUPromptCache, StoreOpenError
    ident = syn_identity("kv")
    toks = random_prompt(random.Random(len(cdir)), 40, 90)
    out: dict[str, Any] = {}
    for mode in modes:
        r: dict[str, Any] = {"escaped": []}
        cap = LogCapture()
        with cap:
            try:
                if mode == "lru":
                    lru = LRUPromptCache(cache_dir=cdir, chunk_tokens=CHUNK)
                    store = lru.store
                else:
                    store = KVStore(cdir, chunk_tokens=CHUNK, on_disk_error=mode)
            except StoreOpenError as e:
                r["outcome"] = "StoreOpenError"
                r["message"] = str(e)
                out[mode] = r
                continue
            except Exception as e:
                r["outcome"] = "exception"
                r["escaped"].append(exc_info(f"open ({mode})", e))
                out[mode] = r
                continue
            r["outcome"] = "opened" if store.disk is not None else "memory_only"
            try:
                if mode == "lru":
                    lru.insert_cache(ident, toks, syn_cache("kv", toks))
                    cache, rest = lru.fetch_nearest_cache(ident, toks)
                    n = len(toks) - len(rest)
                else:
                    store.insert(ident, toks, syn_cache("kv", toks))
                    f = store.fetch(ident, toks)
                    cache, n = f.cache, f.n
                r["served"] = n == len(toks) and cache is not None and syn_check("kv", toks, cache, n)[0]
                store.flush(30)
                st = store.stats()
                r["write_errors"] = st["write_errors"]
                r["disk_entries"] = st.get("disk_entries")
                store.close()
            except Exception as e:
                r["escaped"].append(exc_info(f"use ({mode})", e))
            r["warned"] = [x for x in cap.records if "WARNING" in x][:3]
        out[mode] = r
    return out


def op_perm(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """One permissions/paths case (set up by the parent), possibly as ``nobody``."""
    res = _open_modes(msg["dir"])
    res["uid"] = os.getuid()
    res["exists_after"] = _isdir(Path(msg["dir"]))
    return res


def _memory_keys(store: Any) -> list:
    """Every memory-tier key with the identity of the snapshot it holds (a replaced
    snapshot under the same tokens is a change)."""
    out = []
    for lru in store.memory._lrus.values():
        for model, toks in lru:
            snap = store.memory.get(model, list(toks))
            out.append((repr(model), toks, id(snap)))
    return sorted(out)


def op_bad_input(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Bad calls: each must raise ValueError (TokenError) naming the problem or be a
    documented miss, and leave the store (index, blobs, memory tier) unchanged."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models import llama as llama_arch
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    from kvstore import KVStore
    rng = random.Random(msg["seed"])
    store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=50)
    llama, gemma = zoo.model_arg("llama"), zoo.model_arg("gemma")
    # a populated store: a few real entries on disk and in memory
    base = [random_prompt(rng, 40, 120) for _ in range(3)]
    for t in base:
        store.insert(llama, t, zoo.prefill("llama", t))
    gt = random_prompt(rng, 40, 80)
    store.insert(gemma, gt, zoo.prefill("gemma", gt))
    store.flush()
    t60 = random_prompt(rng, 60, 60)
    c60 = zoo.prefill("llama", t60)

    def odd_cache() -> list:  # right classes and layer count, wrong shapes (another model)
        out = []
        for _ in range(len(c60)):
            c = KVCache()
            c.keys = mx.zeros((1, 4, 60, 16))
            c.values = mx.zeros((1, 4, 60, 16))
            c.offset = 60
            out.append(c)
        return out

    def other_kv(like: list, heads: int, dim: int, dtype: Any = mx.float32) -> list:
        """A real mlx-lm cache with the layer classes of ``like`` (same count, same
        RotatingKVCache parameters) holding 60 positions of other KV shapes / dtype, filled
        by update_and_fetch as a model's attention would."""
        out = []
        for c in like:
            o = RotatingKVCache(max_size=c.max_size, keep=c.keep) if isinstance(c, RotatingKVCache) else KVCache()
            k = mx.random.normal((1, heads, 60, dim), key=mx.random.key(orng.randrange(1 << 30))).astype(dtype)
            o.update_and_fetch(k, k * 0.5)
            out.append(o)
        mx.eval([a for c in out for a in (c.keys, c.values)])
        return out

    def llama_variant(**changes: int) -> list:  # a real prefill of another model: tiny-llama's layers, other KV
        cfg = json.loads((Path(zoo.paths["llama"]) / "config.json").read_text())
        from tools import oracle
        return oracle.prefill(llama_arch.Model(llama_arch.ModelArgs.from_dict({**cfg, **changes})), t_other)

    orng = random.Random(msg["seed"] + 7)  # its own stream: the other cases' inputs stay as they were
    t_other = [orng.randrange(VOCAB) for _ in range(60)]
    g60 = zoo.prefill("gemma", t_other)

    def ofresh() -> list[int]:  # fresh tokens for the other-model cases
        return [orng.randrange(VOCAB) for _ in range(60)]

    def short_arrays() -> list:  # offset claims more positions than the arrays hold
        out = []
        for c in zoo.prefill("llama", t60[:40]):
            c.keys, c.values = c.keys[..., :40, :], c.values[..., :40, :]
            c.offset = 60
            out.append(c)
        return out

    def fresh(n: int = 60) -> list[int]:  # tokens nothing is stored under yet
        return [rng.randrange(VOCAB) for _ in range(n)]

    def ragged() -> list:  # layers disagree on their length
        c = zoo.prefill("llama", t60)
        c[1].offset = 50
        return c

    huge = [rng.randrange(VOCAB) for _ in range(msg.get("huge_fetch", 2_000_000))]
    c_huge = zoo.prefill("llama", huge[:60])

    def insert_huge() -> Any:  # documented: the store keeps the prefix the cache covers
        store.insert(llama, huge[: msg.get("huge_insert", 100_000)], c_huge)
        store.flush()
        return store.fetch(llama, huge[:60] + [7])

    F, I = "fetch", "insert"
    # (name, kind, call, expectation, tokens a hit must hold)
    # expectation: "error" (ValueError/TokenError, store unchanged), "miss" (store unchanged),
    # "error_or_miss", "prefix" (a correct hit of a stored prefix), "error_or_prefix",
    # "not_persisted" (an error, or kept in memory only: index and blob files unchanged)
    # "The store" is the index and the blob files (the issue's definition); a change of the
    # memory tier is reported too and must not happen for errors and misses.
    cases: list[tuple[str, str, Callable[[], Any], str, list[int] | None]] = [
        ("fetch: empty token list", F, lambda: store.fetch(llama, []), "miss", None),
        ("fetch: float tokens", F, lambda: store.fetch(llama, [1.5, 2.0, 3.0]), "error", None),
        ("fetch: numpy float array", F, lambda: store.fetch(llama, np.array([1.0, 2.0])), "error", None),
        ("fetch: string tokens", F, lambda: store.fetch(llama, ["a", "b"]), "error", None),
        ("fetch: a str", F, lambda: store.fetch(llama, "hello"), "error", None),
        ("fetch: None token", F, lambda: store.fetch(llama, [1, None, 3]), "error", None),
        ("fetch: nested lists", F, lambda: store.fetch(llama, [[1, 2], [3, 4]]), "error", None),
        ("fetch: bool tokens", F, lambda: store.fetch(llama, [True, False]), "error", None),
        ("fetch: negative token", F, lambda: store.fetch(llama, base[0][:10] + [-1]), "error", None),
        ("fetch: token 2**32", F, lambda: store.fetch(llama, [5, 2**32]), "error", None),
        ("fetch: token 2**70", F, lambda: store.fetch(llama, [5, 2**70]), "error", None),
        ("fetch: tokens=None", F, lambda: store.fetch(llama, None), "error", None),
        ("fetch: out-of-vocabulary tokens", F, lambda: store.fetch(llama, [300, 5000, 70000]), "error_or_miss", None),
        ("fetch: stored prompt + out-of-vocabulary token", F,
         lambda: store.fetch(llama, base[0] + [100000]), "error_or_prefix", base[0] + [100000]),
        (f"fetch: {len(huge)} tokens", F, lambda: store.fetch(llama, huge), "miss", None),
        (f"fetch: stored prompt + {len(huge)} tokens", F, lambda: store.fetch(llama, base[1] + huge), "prefix",
         base[1] + huge),
        ("insert: empty tokens, 60-token cache", I, lambda: store.insert(llama, [], c60), "error", None),
        ("insert: float tokens", I, lambda: store.insert(llama, [float(t) for t in t60], c60), "error", None),
        ("insert: negative token", I, lambda: store.insert(llama, t60[:-1] + [-3], c60), "error", None),
        ("insert: token 2**32", I, lambda: store.insert(llama, t60[:-1] + [2**32], c60), "error", None),
        ("insert: out-of-vocabulary token", I, lambda: store.insert(llama, t60[:-1] + [5000], c60), "error", None),
        ("insert: cache longer than its tokens", I, lambda: store.insert(llama, t60[:50], c60), "error", None),
        ("insert: layers of different lengths", I, lambda: store.insert(llama, t60, ragged()), "error", None),
        ("insert: offset beyond the arrays", I, lambda: store.insert(llama, fresh(), short_arrays()), "error", None),
        ("insert: gemma3 cache under tiny-llama", I,
         lambda: store.insert(llama, gt, zoo.prefill("gemma", gt)), "not_persisted", None),
        ("insert: tiny-llama cache under tiny-gemma3", I, lambda: store.insert(gemma, t60, c60), "not_persisted", None),
        ("insert: synthetic 2-layer cache under tiny-llama", I,
         lambda: store.insert(llama, (t := fresh()), syn_cache("kv", t)), "not_persisted", None),
        ("insert: same classes, other shapes (another model)", I,
         lambda: store.insert(llama, fresh(), odd_cache()), "not_persisted", None),
        ("insert: same classes, other KV head count (4 x 32, another model)", I,
         lambda: store.insert(llama, ofresh(), other_kv(c60, 4, 32)), "not_persisted", None),
        ("insert: same classes, other head_dim (2 x 16, another model)", I,
         lambda: store.insert(llama, ofresh(), other_kv(c60, 2, 16)), "not_persisted", None),
        ("insert: same classes and shapes, bfloat16 KV", I,
         lambda: store.insert(llama, ofresh(), other_kv(c60, 2, 32, mx.bfloat16)), "not_persisted", None),
        ("insert: prefill of tiny-llama with 4 KV heads under tiny-llama", I,
         lambda: store.insert(llama, t_other, llama_variant(num_key_value_heads=4)), "not_persisted", None),
        ("insert: prefill of tiny-llama with head_dim 16 under tiny-llama", I,
         lambda: store.insert(llama, t_other, llama_variant(head_dim=16)), "not_persisted", None),
        ("insert: tiny-gemma3 classes, other head_dim (2 x 64) under tiny-gemma3", I,
         lambda: store.insert(gemma, ofresh(), other_kv(g60, 2, 64)), "not_persisted", None),
        ("insert: cache=[]", I, lambda: store.insert(llama, t60, []), "error", None),
        ("insert: cache=None", I, lambda: store.insert(llama, t60, None), "error", None),
        ("insert: cache of ints", I, lambda: store.insert(llama, t60, [1, 2, 3]), "error", None),
        ("insert: cache_type='bogus'", I, lambda: store.insert(llama, t60, c60, cache_type="bogus"), "error", None),
        ("insert: tokens=None", I, lambda: store.insert(llama, None, c60), "error", None),
        (f"insert: {msg.get('huge_insert', 100_000)} tokens, cache of the first 60", F, insert_huge, "prefix",
         huge[:60] + [7]),
    ]
    out = []
    for name, kind, call, expect, hit_tokens in cases:
        store.flush()
        before = (logical_dump(store), _memory_keys(store))
        refused_before = store.stats()["unpersistable"]
        t0 = time.perf_counter()
        r: dict[str, Any] = {"case": name, "expect": expect}
        try:
            with LogCapture() as logs:
                got = call()
            r["refused"] = store.stats()["unpersistable"] > refused_before
            if logs.records:
                r["warning"] = logs.records[0][:300]
            r["outcome"] = "returned"
            if kind == F:
                r["n"] = got.n
                r["source"] = got.source
                if got.cache is not None and got.n:
                    ok, why = zoo.check("llama", hit_tokens or [], got.cache, got.n) if hit_tokens else (False, "unexpected hit")
                    r["restore_ok"] = ok
                    if not ok:
                        r["wrong"] = why
        except ValueError as e:
            r["outcome"] = type(e).__name__
            r["message"] = str(e)[:300]
        except Exception as e:
            r["outcome"] = "escaped"
            r["exception"] = exc_info(name, e)
            r["message"] = f"{type(e).__name__}: {e}"[:300]
        r["seconds"] = round(time.perf_counter() - t0, 3)
        store.flush()
        after = (logical_dump(store), _memory_keys(store))
        r["unchanged"] = before[0] == after[0]
        r["memory_unchanged"] = before[1] == after[1]
        if before != after:
            r["changed"] = [k for k in ("index", "files") if before[0][k] != after[0][k]] + (
                ["memory"] if before[1] != after[1] else [])
        raised = r["outcome"] in ("ValueError", "TokenError")
        miss = r["outcome"] == "returned" and kind == F and r.get("n") == 0
        prefix = r["outcome"] == "returned" and kind == F and r.get("n", 0) > 0 and bool(r.get("restore_ok"))
        ok = {"error": raised, "miss": miss, "error_or_miss": raised or miss, "prefix": prefix,
              "error_or_prefix": raised or prefix,
              "not_persisted": raised or (r["outcome"] == "returned" and r.get("refused"))}[expect]
        if expect == "not_persisted":
            same = r["unchanged"]
        else:  # a hit updates last_used / hits and promotes to memory; nothing else may change
            same = prefix or (r["unchanged"] and r["memory_unchanged"])
        r["ok"] = bool(ok and same and "wrong" not in r and r["seconds"] < 60)
        if r["seconds"] > 5:
            r["slow"] = True
        if not r["ok"] and name in LIMITATIONS:
            r["limitation"] = LIMITATIONS[name]
        out.append(r)
    store.close()
    return {"cases": out}


def op_conc(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """One of the concurrency processes: ``threads`` threads for ``seconds`` on one directory."""
    from kvstore import KVStore
    from kvstore import maintenance as mt
    seed, proc = msg["seed"], msg["proc"]
    store = KVStore(msg["dir"], chunk_tokens=CHUNK, max_entries=6, max_disk_bytes=msg.get("max_disk_bytes"))
    deadline = time.time() + msg["seconds"]
    model_lock = threading.Lock()
    stats_lock = threading.Lock()
    res: dict[str, Any] = dict(escaped=[], wrong=[], ops=Counter(), hits=Counter(), oracle_checks=0,
                               syn_checks=0, verify_kinds=Counter())
    shared = [random_prompt(random.Random(1000 + i), 30, 90) for i in range(6)]  # same in every process

    def count(key: str, n: int = 1, field: str = "ops") -> None:
        with stats_lock:
            res[field][key] += n

    def user(rng: random.Random) -> None:
        kind = "kv" if rng.random() < 0.75 else "snap"
        name = f"syn-{kind}"
        toks = random_prompt(rng, 10, 150, shared)
        q = toks + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
        f = store.fetch(zoo.model_arg(name), q)
        count("fetch")
        if f.cache is not None and f.n:
            count(f.source or "?", field="hits")
            ok, why = syn_check(kind, q, f.cache, f.n)
            with stats_lock:
                res["syn_checks"] += 1
                if not ok:
                    res["wrong"].append({"model": name, "n": f.n, "detail": why})
        if rng.random() < 0.5:
            store.insert(zoo.model_arg(name), toks, syn_cache(kind, toks))
            count("insert")
        time.sleep(rng.uniform(0, 0.01))  # let the writer keep up now and then (more disk traffic)

    def real(rng: random.Random) -> None:
        toks = random_prompt(rng, 20, 120, shared)
        f = store.fetch(zoo.model_arg("llama"), toks)
        count("fetch_real")
        if f.cache is not None and f.n:
            count("real", field="hits")
            with model_lock:
                ok, why = zoo.check("llama", toks, f.cache, f.n)
            with stats_lock:
                res["oracle_checks"] += 1
                if not ok:
                    res["wrong"].append({"model": "llama", "n": f.n, "detail": why})
        with model_lock:
            cache = zoo.prefill("llama", toks)
        store.insert(zoo.model_arg("llama"), toks, cache)
        count("insert_real")
        time.sleep(rng.uniform(0, 0.2))

    def maint(rng: random.Random) -> None:
        r = rng.random()
        if r < 0.3:
            mt.gc(store.disk, max_bytes=rng.randint(200_000, 2_000_000))
            count("gc")
        elif r < 0.55:
            probs = mt.verify(store.disk)
            count("verify")
            with stats_lock:
                res["verify_kinds"].update(p.kind for p in probs)
        elif r < 0.7:
            mt.verify(store.disk, fix=True)
            count("verify_fix")
        elif r < 0.85:
            mt.evict_to(store.disk, rng.randint(300_000, 3_000_000))
            count("evict")
        else:
            store.stats()
            store.flush(10)
            count("stats_flush")
        time.sleep(rng.uniform(0.02, 0.25))

    def loop(t: int) -> None:
        rng = random.Random(seed * 1000 + proc * 10 + t)
        role = (user, user, real, maint)[t % 4]
        while time.time() < deadline:
            try:
                role(rng)
            except Exception as e:
                with stats_lock:
                    res["escaped"].append(exc_info(f"{role.__name__} thread", e))
                    if len(res["escaped"]) > 20:
                        return

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(msg["threads"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        st = store.stats()
        res["stats"] = {k: st.get(k) for k in ("write_errors", "writes", "dropped_writes", "corrupt",
                                                 "hits_memory", "hits_disk", "misses")}
        res["writer_failed"] = store.writer.failed
        store.close()
    except Exception as e:
        res["escaped"].append(exc_info("stats/close", e))
    res["ops"], res["hits"], res["verify_kinds"] = dict(res["ops"]), dict(res["hits"]), dict(res["verify_kinds"])
    return res


def op_populate(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """A small store of synthetic entries (for the permissions cases)."""
    from kvstore import KVStore
    rng = random.Random(msg.get("seed", 0))
    store = KVStore(msg["dir"], chunk_tokens=CHUNK)
    ident = syn_identity("kv")
    for _ in range(msg.get("n", 3)):
        toks = random_prompt(rng, 40, 100)
        store.insert(ident, toks, syn_cache("kv", toks))
    store.flush()
    n = store.stats().get("disk_entries")
    store.close()
    return {"disk_entries": n}


OPS: dict[str, Callable[[Zoo, dict, Emit], dict]] = {
    "populate": op_populate,
    "crash_run": op_crash_run, "build_template": op_build_template, "check": op_check, "live": op_live,
    "full_disk": op_full_disk, "open_full": op_open_full, "perm": op_perm, "bad_input": op_bad_input,
    "conc": op_conc,
}
ROLE_MODELS = {"crash": ("llama", "gemma", "qwen"), "check": ("llama", "gemma", "qwen"), "perm": (),
               "conc": ("llama",), "misc": ("llama", "gemma")}


def worker_main(role: str) -> int:
    """Serve JSON commands on stdin; events and results go out as JSON lines on stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {role}[{os.getpid()}] %(name)s %(levelname)s %(message)s")
    lock = threading.Lock()

    def emit(obj: dict) -> None:
        line = json.dumps(obj, default=str) + "\n"
        with lock:
            proto.write(line)
            proto.flush()

    zoo = Zoo(ROLE_MODELS[role])
    for n in zoo.models:  # warm up: the first prefill compiles kernels
        zoo.prefill(n, [1, 2, 3])
    import kvstore.maintenance  # noqa: F401  (import cost paid before "ready")
    emit({"ev": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("op") == "exit":
            break
        try:
            out = OPS[msg["op"]](zoo, msg, emit)
        except Exception as e:
            out = {"harness_error": exc_info(msg["op"], e)}
        emit({"ev": "result", "result": out})
        if role == "crash":
            break
    return 0


# ================================================================ parent: workers


class WorkerDied(Exception):
    def __init__(self, worker: "Worker") -> None:
        self.returncode = worker.p.poll()
        self.stderr_tail = worker.stderr_tail()
        super().__init__(f"{worker.role} worker died (returncode {self.returncode}): {self.stderr_tail[-600:]}")


def _drop_to_nobody() -> None:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


class Worker:
    """A worker process speaking JSON lines (see ``worker_main``)."""

    _count = 0

    def __init__(self, role: str, logdir: Path, *, nobody: bool = False) -> None:
        Worker._count += 1
        self.role = role
        self.log_path = Path(logdir) / f"{role}-{Worker._count}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"  # a worker killed by SIGSEGV/SIGBUS/SIGABRT prints where
        if nobody:
            env["HOME"] = "/tmp"
        self._err = open(self.log_path, "wb")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", role]
        preexec = None
        if nobody:  # setpriv execs the interpreter even where nobody cannot search its path
            if shutil.which("setpriv"):
                cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + cmd
            else:
                preexec = _drop_to_nobody
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, cwd="/",
                                  env=env, preexec_fn=preexec, start_new_session=True)
        self.q: queue.Queue = queue.Queue()
        self.ready = False
        self.killed = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.q.put(json.loads(line))
            except ValueError:
                self.q.put({"ev": "garbage", "line": line[:200].decode(errors="replace")})
        self.q.put(None)

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode(errors="replace")

    def next(self, timeout: float) -> dict | None:
        """The next event (None at EOF); raises queue.Empty on timeout."""
        return self.q.get(timeout=max(0.0, timeout))

    def wait_ready(self, timeout: float = 600) -> None:
        if self.ready:
            return
        end = time.time() + timeout
        while True:
            ev = self.next(end - time.time())
            if ev is None:
                raise WorkerDied(self)
            if ev.get("ev") == "ready":
                self.ready = True
                return

    def send(self, msg: dict) -> None:
        try:
            assert self.p.stdin is not None
            self.p.stdin.write((json.dumps(msg) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerDied(self) from None

    def call(self, msg: dict, timeout: float = 900) -> dict:
        self.wait_ready()
        self.send(msg)
        end = time.time() + timeout
        while True:
            try:
                ev = self.next(end - time.time())
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"{self.role} worker: {msg.get('op')} took longer than {timeout}s") from None
            if ev is None:
                self.p.wait()
                raise WorkerDied(self)
            if ev.get("ev") == "result":
                return ev["result"]

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait()

    def close(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(WorkerDied):
                self.send({"op": "exit"})
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._err.close()


class Checker:
    """The checker process, respawned when a fault kills it (counted as a crash)."""

    def __init__(self, logdir: Path, role: str = "check") -> None:
        self.logdir, self.role = logdir, role
        self.w = Worker(role, logdir)

    def call(self, msg: dict, timeout: float = 900) -> dict:
        try:
            return self.w.call(msg, timeout)
        except (WorkerDied, TimeoutError) as e:
            rc = self.w.p.poll()
            tail = self.w.stderr_tail(1500)
            self.w.close()
            self.w = Worker(self.role, self.logdir)
            return {"crashed": True, "returncode": rc, "signal": _signame(rc), "error": str(e)[:300],
                    "stderr": tail[-1200:], "hang": isinstance(e, TimeoutError)}

    def close(self) -> None:
        self.w.close()


def _signame(rc: int | None) -> str | None:
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return str(rc)


# ================================================================ parent: tallies


class Tally:
    FIELDS = ("trials", "wrong_restores", "escaped_exceptions", "crashes", "entries_lost",
              "unexplained_misses", "verify_unclean", "verify_errors", "post_fix_misses", "failed_cases")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.c: dict[str, Any] = {f: 0 for f in self.FIELDS}
        self.outcomes: Counter = Counter()
        self.failures: list[dict] = []
        self.info: dict[str, Any] = {}
        self.t0 = time.time()
        self.skipped: list[str] = []

    def fail(self, what: str, **detail: Any) -> None:
        if len(self.failures) < 60:
            self.failures.append({"what": what, **detail})

    def add_check(self, res: dict, **ctx: Any) -> None:
        if res.get("crashed"):
            self.c["crashes"] += 1
            self.fail("checker process died" if not res.get("hang") else "checker hung", **ctx,
                      signal=res.get("signal"), stderr=res.get("stderr", "")[-800:])
            return
        if res.get("harness_error"):
            self.fail("harness error", **ctx, error=res["harness_error"])
            return
        for w in res.get("wrong", []):
            self.c["wrong_restores"] += 1
            self.fail("wrong restore", **ctx, detail=w)
        for e in res.get("escaped", []):
            self.c["escaped_exceptions"] += 1
            self.fail("escaped exception", **ctx, exception=e)
        for e in res.get("verify_errors", []):
            self.c["verify_errors"] += 1
            self.c["escaped_exceptions"] += 1
            self.fail("verify raised", **ctx, exception=e)
        self.c["unexplained_misses"] += len(res.get("unexplained", []))
        for u in res.get("unexplained", [])[:3]:
            self.fail("unexplained miss", **ctx, entry=u, verify=res.get("verify"))
        self.c["entries_lost"] += len(res.get("lost", []))
        if res.get("lost"):
            self.fail("entries lost", **ctx, keys=res["lost"][:5], n=len(res["lost"]), verify=res.get("verify"))
        if res.get("verify_after_fix"):
            self.c["verify_unclean"] += 1
            self.fail("verify not clean after --fix", **ctx, left=res["verify_after_fix"],
                      detail=res.get("verify_after_fix_detail"))
        self.c["post_fix_misses"] += res.get("post_fix_misses", 0)
        if res.get("post_fix_misses"):
            self.fail("entries not served after verify --fix", **ctx, n=res["post_fix_misses"])
        if res.get("aside") and not res.get("aside_logged"):
            self.fail("index moved aside without a log message", **ctx)

    def result(self) -> dict:
        out = dict(self.c)
        out["seconds"] = round(time.time() - self.t0, 1)
        out["outcomes"] = dict(sorted(self.outcomes.items()))
        out.update(self.info)
        if self.skipped:
            out["skipped"] = self.skipped
        out["failures"] = self.failures
        return out


class Ctx:
    def __init__(self, work: Path, seed: int, size: dict, verbose: bool) -> None:
        self.work, self.seed, self.size, self.verbose = work, seed, size, verbose
        self.logdir = work / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._checker: Checker | None = None
        self._misc: Checker | None = None

    @property
    def checker(self) -> Checker:
        if self._checker is None:
            self._checker = Checker(self.logdir, "check")
        return self._checker

    @property
    def misc(self) -> Checker:
        if self._misc is None:
            self._misc = Checker(self.logdir, "misc")
        return self._misc

    def say(self, msg: str) -> None:
        print(msg, flush=True)

    def debug(self, msg: str) -> None:
        if self.verbose:
            print("   " + msg, flush=True)

    def close(self) -> None:
        for c in (self._checker, self._misc):
            if c is not None:
                c.close()


def _progress(ctx: Ctx, t: Tally, i: int, n: int) -> None:
    if (i + 1) % max(1, n // 10) == 0 or i + 1 == n:
        c = t.c
        ctx.say(f"  {t.kind}: {i + 1}/{n}  wrong={c['wrong_restores']} escaped={c['escaped_exceptions']} "
                f"crashes={c['crashes']} lost={c['entries_lost']} unexplained={c['unexplained_misses']} "
                f"unclean={c['verify_unclean']}  ({time.time() - t.t0:.0f}s)")


# ================================================================ parent: crash


def cli_verify_available() -> bool:
    return (ROOT / "kvstore" / "cli" / "verify.py").exists()


class Pool:
    """Pre-started single-use workers (mlx import and model load overlap the current trial)."""

    def __init__(self, role: str, logdir: Path, spare: int = 1) -> None:
        self.role, self.logdir, self.spare = role, logdir, spare
        self.ws: list[Worker] = []

    def take(self) -> Worker:
        while len(self.ws) < 1 + self.spare:
            self.ws.append(Worker(self.role, self.logdir))
        w = self.ws.pop(0)
        self.ws.append(Worker(self.role, self.logdir))
        w.wait_ready()
        return w

    def close(self) -> None:
        for w in self.ws:
            w.kill()
            w._err.close()


def run_crash(ctx: Ctx) -> dict:
    n = ctx.size["crash"]
    lineage = ctx.size["crash_lineage"]
    t = Tally("crash")
    pool = Pool("crash", ctx.logdir, spare=1)
    est: dict[str, list[float]] = defaultdict(list)
    defaults = {"insert": 0.08, "flush": 0.3, "gc": 0.05, "verify": 0.05, "cli_verify": 2.5, "fetch": 0.02,
                "mixed": 3.0}
    committed: set[str] = set()
    excused: set[str] = set()
    base = ctx.work / "crash"
    landed = Counter()
    d = base

    def estimate(op: str) -> float:
        xs = est[op][-25:]
        return statistics.median(xs) if xs else defaults[op]

    try:
        for i in range(n):
            rng = random.Random(ctx.seed * 7919 + i)
            if i % lineage == 0:
                if d.exists() and d != base:
                    shutil.rmtree(d, ignore_errors=True)
                d = base / f"lineage-{i // lineage}"
                committed, excused = set(), set()
            phases = ["insert", "flush", "gc", "verify", "mixed"] + (["cli_verify"] if cli_verify_available() else [])
            phase = phases[i % len(phases)]
            if phase == "insert":
                target: tuple[str, int] | None = ("insert", rng.randrange(8))
            elif phase == "flush":
                target = ("flush", 0) if rng.random() < 0.7 else ("insert", rng.randrange(6))
            elif phase in ("gc", "verify", "cli_verify"):
                target = (phase, 0)
            else:
                target = None  # mixed: a uniform moment
            w = pool.take()
            w.send({"op": "crash_run", "dir": str(d), "seed": rng.randrange(1 << 30), "phase": phase,
                    "cli": phase == "cli_verify"})
            t_start = time.time()
            kill_at = t_start + rng.uniform(0.0, estimate("mixed")) if target is None else None
            begins: dict[tuple, dict] = {}
            ends: set[tuple] = set()
            events: list[dict] = []
            died_by_itself = False
            kill_pid = None
            while True:
                timeout = 300 if kill_at is None else kill_at - time.time()
                try:
                    ev = w.next(timeout)
                except queue.Empty:
                    if kill_pid is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(kill_pid, signal.SIGKILL)
                    w.kill()
                    break
                if ev is None:
                    died_by_itself = True
                    break
                events.append(ev)
                kind = ev.get("ev")
                if kind == "begin":
                    begins[(ev["op"], ev["i"])] = ev
                    if target is not None and (ev["op"], ev["i"]) == target and kill_at is None:
                        # the CLI spends most of its life importing: aim at the end of its run
                        lo = 0.75 if ev["op"] == "cli_verify" else 0.0
                        kill_at = time.time() + rng.uniform(lo, 1.05) * estimate(ev["op"])
                        kill_pid = ev.get("pid")
                elif kind == "end":
                    ends.add((ev["op"], ev["i"]))
                    b = begins.get((ev["op"], ev["i"]))
                    if b:
                        est[ev["op"]].append(ev["t"] - b["t"])
                elif kind == "done" and target is None:
                    est["mixed"].append(ev["t"] - t_start)
            # drain what the worker wrote before it died
            while True:
                try:
                    ev = w.next(5)
                except queue.Empty:
                    break
                if ev is None:
                    break
                events.append(ev)
            w.p.wait()
            rc = w.p.returncode
            if died_by_itself and rc not in (0, None) and not w.killed:
                t.c["crashes"] += 1
                t.fail("worker died by itself", trial=i, phase=phase, returncode=rc, signal=_signame(rc),
                       stderr=w.stderr_tail(1200))
            w._err.close()
            if w.killed:
                where = "inside" if target is None or (target in begins and target not in ends) else "after"
                landed[f"{phase}:{where}" if target is not None else "mixed:random"] += 1
            else:
                landed[f"{phase}:completed"] += 1
            for ev in events:
                kind = ev.get("ev")
                if kind == "committed":
                    committed.add(ev["key"])
                elif kind == "excuse":
                    excused.update(ev["keys"])
                elif kind == "escaped":
                    t.c["escaped_exceptions"] += 1
                    t.fail("escaped exception (worker)", trial=i, phase=phase, exception=ev)
                elif kind == "wrong":
                    t.c["wrong_restores"] += 1
                    t.fail("wrong restore (worker)", trial=i, phase=phase, detail=ev)
                elif kind == "end" and ev.get("op") == "cli_verify" and ev.get("rc") not in (0, 1):
                    t.fail("cli verify failed", trial=i, rc=ev.get("rc"), stderr=ev.get("stderr"))
            committed -= excused
            fix = rng.random() < 0.5
            res = ctx.checker.call({"op": "check", "dir": str(d), "committed": sorted(committed),
                                    "targets": sorted(excused), "fix": fix, "reopen": fix})
            t.add_check(res, trial=i, phase=phase, dir=str(d), seed=ctx.seed)
            if not res.get("crashed"):
                committed -= set(res.get("lost", []))
                t.outcomes[f"verify:{'+'.join(sorted(res.get('verify', {}))) or 'clean'}"] += 1
            t.c["trials"] += 1
            ctx.debug(f"crash {i} {phase} killed={w.killed} committed={len(committed)} claimed={res.get('claimed')} "
                      f"verify={res.get('verify')} lost={res.get('lost')}")
            _progress(ctx, t, i, n)
    finally:
        pool.close()
        shutil.rmtree(base, ignore_errors=True)
    t.info["kills"] = dict(sorted(landed.items()))
    t.info["median_op_seconds"] = {k: round(statistics.median(v), 4) for k, v in est.items() if v}
    t.info["cli_verify_trials"] = sum(v for k, v in landed.items() if k.startswith("cli_verify"))
    return t.result()


# ================================================================ parent: corruption

BLOB_MODES = ("flip", "flip", "flip_head", "flips", "zero", "truncate", "empty", "delete", "append", "swap",
              "rename", "stray_blob", "stray_tmp")
LMDB_MODES = ("flip", "flip", "flip", "flips", "flips", "flip_meta", "flip_page_header", "flip_page_header",
              "zero_page", "truncate", "truncate_page", "empty", "delete", "garbage", "lock_flips",
              "lock_delete", "lock_garbage", "index_dir_delete",
              "value_flip", "value_flip", "value_flip:tokens", "value_flip:entries", "value_flip:chunks")


def damage_blob_case(cdir: Path, tpl: dict, rng: random.Random, mode: str) -> tuple[str, set[str]]:
    blobs_root = cdir / "blobs"
    users = tpl["blob_users"]
    blob = rng.choice(sorted(users))
    path = blobs_root / blob
    targets = set(users[blob])
    if mode == "swap":
        other = rng.choice([b for b in sorted(users) if b != blob])
        return f"{blob}: {damage_file(path, 'swap', rng, other=blobs_root / other)}", targets
    if mode == "rename":
        new = path.with_name(path.name.split("-")[0] + "-deadbeef.safetensors")
        os.replace(path, new)
        return f"{blob}: renamed to {new.name}", targets
    if mode == "stray_blob":
        src = path
        key = "%032x" % rng.getrandbits(128)
        dst = blobs_root / key[:2] / f"{key}-{rng.getrandbits(32):08x}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        shutil.copyfile(src, dst)
        return f"orphan copy of {blob} at {dst.name}", set()
    if mode == "stray_tmp":
        where = rng.choice([cdir, blobs_root / blob.split("/")[0]])
        tmp = where / f"{path.name}.{rng.randint(100, 99999)}.abcd1234.tmp"
        tmp.write_bytes(os.urandom(rng.randint(0, 5000)))
        return f"stray temp file {tmp.relative_to(cdir)}", set()
    return f"{blob}: {damage_file(path, mode, rng)}", targets


def flip_record(idx: Path, rng: random.Random, dbname: str | None = None) -> str:
    """A bit flip inside one stored value (a record, token ids, a trie edge), written through
    LMDB: what a flip LMDB cannot detect looks like to kvstore."""
    import lmdb
    env = lmdb.open(str(idx), max_dbs=16, subdir=True)
    try:
        names = [dbname] if dbname else ["entries", "entries", "chunks", "tokens", "tokens", "bounds", "meta"]
        name = rng.choice(names)
        db = env.open_db(name.encode(), create=False)
        with env.begin(write=True) as txn:
            items = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
            if not items:
                return f"{name}: empty"
            k, v = rng.choice(items)
            if not v:
                return f"{name}: empty value"
            buf = bytearray(v)
            off = rng.randrange(len(buf))
            buf[off] ^= 1 << rng.randrange(8)
            txn.put(k, bytes(buf), db=db)
            return f"{name}[{k.hex()[:12]}] byte {off} of {len(buf)}: {v[max(0, off - 12):off + 12]!r} -> {bytes(buf[max(0, off - 12):off + 12])!r}"
    finally:
        env.close()


def damage_lmdb_case(cdir: Path, rng: random.Random, mode: str) -> str:
    idx = cdir / "index"
    data, lock = idx / "data.mdb", idx / "lock.mdb"
    size = data.stat().st_size
    pages = max(1, size // 4096)
    if mode.startswith("value_flip"):
        return flip_record(idx, rng, mode.split(":")[1] if ":" in mode else None)
    if mode == "index_dir_delete":
        shutil.rmtree(idx)
        return "index/ removed"
    if mode.startswith("lock_"):
        if not lock.exists():
            return "no lock.mdb"
        m = {"lock_flips": "flips", "lock_delete": "delete", "lock_garbage": "garbage"}[mode]
        if m == "garbage":
            lock.write_bytes(os.urandom(lock.stat().st_size))
            return "lock.mdb: random bytes"
        return "lock.mdb: " + damage_file(lock, m, rng)
    if mode == "garbage":
        data.write_bytes(os.urandom(size))
        return "data.mdb: random bytes"
    if mode == "truncate_page":
        n = rng.randrange(pages) * 4096
        os.truncate(data, n)
        return f"data.mdb truncated to page {n // 4096} of {pages}"
    if mode in ("flip_meta", "flip_page_header", "zero_page"):
        buf = bytearray(data.read_bytes())
        if mode == "flip_meta":
            off = rng.choice([0, 4096]) + rng.randrange(160)
            buf[off] ^= 1 << rng.randrange(8)
            desc = f"meta page bit flip at {off}"
        elif mode == "flip_page_header":
            page = rng.randrange(2, max(3, pages))
            off = page * 4096 + rng.randrange(16)
            if off >= len(buf):
                off = rng.randrange(len(buf))
            buf[off] ^= 1 << rng.randrange(8)
            desc = f"page header bit flip at {off} (page {off // 4096})"
        else:
            page = rng.randrange(2, max(3, pages))
            a = min(page * 4096, max(0, len(buf) - 4096))
            buf[a : a + 4096] = bytes(len(buf[a : a + 4096]))
            desc = f"page {a // 4096} zeroed"
        with open(data, "r+b") as f:
            f.write(buf)
        return "data.mdb: " + desc
    return "data.mdb: " + damage_file(data, mode, rng)


def run_corruption(ctx: Ctx) -> dict:
    size = ctx.size
    t = Tally("corruption")
    base = ctx.work / "corruption"
    shutil.rmtree(base, ignore_errors=True)
    (base / "cases").mkdir(parents=True)
    templates = []
    for j in range(size["templates"]):
        d = base / f"template-{j}"
        info = ctx.checker.call({"op": "build_template", "dir": str(d), "seed": ctx.seed * 31 + j}, timeout=900)
        if "entries" not in info:
            raise RuntimeError(f"template build failed: {info}")
        info["dir"] = d
        info["known"] = [[e["model"], e["tokens"]] for e in info["entries"]]
        info["keys"] = {e["key"] for e in info["entries"]}
        templates.append(info)
        # control: an undamaged copy must pass completely
        c = base / "cases" / "control"
        shutil.copytree(d, c)
        res = ctx.checker.call({"op": "check", "dir": str(c), "known": info["known"],
                                "committed": sorted(info["keys"]), "fix": True})
        shutil.rmtree(c, ignore_errors=True)
        t.add_check(res, case=f"control-{j}")
        if res.get("full") != len(info["entries"]):
            t.fail("control: undamaged template not served in full", template=j, full=res.get("full"),
                   claimed=res.get("claimed"))
    t.info["template"] = {"entries": len(templates[0]["entries"]), "blobs": len(templates[0]["blob_users"]),
                          "data_mdb_bytes": templates[0]["data_mdb"],
                          "models": dict(Counter(e["model"] for e in templates[0]["entries"]))}
    plan = ([("blob", i) for i in range(size["blob"])] + [("lmdb", i) for i in range(size["lmdb"])]
            + [("live", i) for i in range(size["lmdb_live"])])
    random.Random(ctx.seed).shuffle(plan)
    per_kind = Counter()
    for k, (where, i) in enumerate(plan):
        rng = random.Random(f"{ctx.seed}-{where}-{i}")
        tpl = templates[i % len(templates)]
        cdir = base / "cases" / f"{where}-{i}"
        shutil.copytree(tpl["dir"], cdir)
        ctx_info: dict[str, Any] = {"case": f"{where}-{i}", "seed": ctx.seed}
        if where == "blob":
            mode = BLOB_MODES[i % len(BLOB_MODES)]
            desc, targets = damage_blob_case(cdir, tpl, rng, mode)
            ctx_info.update(mode=mode, damage=desc)
            res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"],
                                    "targets": sorted(targets), "committed": sorted(tpl["keys"] - targets),
                                    "fix": True})
            t.add_check(res, **ctx_info)
            t.outcomes[f"blob:{mode}:{'full' if res.get('full') == len(tpl['keys']) else 'degraded'}"] += 1
        elif where == "lmdb":
            mode = LMDB_MODES[i % len(LMDB_MODES)]
            desc = damage_lmdb_case(cdir, rng, mode)
            ctx_info.update(mode=mode, damage=desc)
            res = ctx.checker.call({"op": "check", "dir": str(cdir), "known": tpl["known"],
                                    "targets": sorted(tpl["keys"]), "fix": True})
            t.add_check(res, **ctx_info)
            if res.get("crashed"):
                outcome = f"crash:{res.get('signal')}"
            elif res.get("open") != "ok":
                outcome = res.get("open")
            elif res.get("known_hits") == len(tpl["keys"]) and not res.get("verify"):
                outcome = "undetected_harmless"
            else:
                outcome = "degraded_to_misses"
            t.outcomes[f"lmdb:{outcome}"] += 1
            per_kind[f"lmdb:{mode}:{outcome}"] += 1
            if res.get("open") == "open_error" and len(t.info.setdefault("open_errors", [])) < 10:
                t.info["open_errors"].append({**ctx_info, "message": res.get("open_error")})
        else:
            res = ctx.checker.call({"op": "live", "dir": str(cdir), "known": tpl["known"],
                                    "seed": rng.randrange(1 << 30)})
            ctx_info["mode"] = "live"
            t.add_check(res, **ctx_info)
            if not res.get("crashed"):
                ctx_info["damage"] = res.get("damage")
                served = res.get("memory_served", 0) == res.get("known")
                t.outcomes[f"live:{'memory_served' if served else 'not_served'}"] += 1
                if not served:
                    t.fail("live damage: memory tier stopped serving", **ctx_info, res={
                        k: res.get(k) for k in ("memory_served", "known", "logs")})
            else:
                t.outcomes[f"live:crash:{res.get('signal')}"] += 1
        t.c["trials"] += 1
        ctx.debug(f"{ctx_info.get('case')} {ctx_info.get('mode')} {ctx_info.get('damage')} -> open={res.get('open')} "
                  f"full={res.get('full')} verify={res.get('verify')} wrong={len(res.get('wrong', []))} "
                  f"crashed={res.get('crashed')}")
        shutil.rmtree(cdir, ignore_errors=True)
        _progress(ctx, t, k, len(plan))
    t.info["cases"] = {"blob": size["blob"], "lmdb": size["lmdb"], "lmdb_live": size["lmdb_live"]}
    t.info["lmdb_outcomes_by_mode"] = dict(sorted(per_kind.items()))
    shutil.rmtree(base, ignore_errors=True)
    return t.result()


# ================================================================ parent: full disk


def _mount_tmpfs(path: Path, size: str = "4m") -> str | None:
    """Mount a tmpfs at ``path``; returns an error message if that is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: cannot mount a tmpfs"
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return None if p.returncode == 0 else f"mount failed: {p.stderr.strip()}"


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_full_disk(ctx: Ctx) -> dict:
    t = Tally("full_disk")
    base = ctx.work / "fulldisk"
    n = ctx.size["full_disk"]
    leaves = [0, 60 << 10, 200 << 10, 500 << 10, 1000 << 10, 1800 << 10, 2800 << 10]
    for i in range(n + 1):
        mnt = base / f"m{i}"
        err = _mount_tmpfs(mnt)
        if err:
            t.skipped.append(err)
            break
        rng = random.Random(f"{ctx.seed}-full-{i}")
        try:
            if i == n:  # open on a disk that is already full
                _fill(mnt / "filler", 8 << 20)
                res = ctx.misc.call({"op": "open_full", "dir": str(mnt / "cache")})
                if res.get("crashed") or res.get("harness_error"):
                    t.add_check(res, trial="open on a full disk")
                    t.c["trials"] += 1
                    continue
                t.info["open_on_full_disk"] = {m: {k: v for k, v in r.items() if k != "escaped"} for m, r in res.items()}
                for m, r in res.items():
                    for e in r.get("escaped", []):
                        t.c["escaped_exceptions"] += 1
                        t.fail("escaped exception (open on a full disk)", mode=m, exception=e)
                    if m != "raise" and not r.get("served"):
                        t.c["failed_cases"] += 1
                        t.fail("open on a full disk: memory tier did not serve", mode=m, res=r)
                t.c["trials"] += 1
                continue
            msg = {"op": "full_disk", "mnt": str(mnt), "seed": rng.randrange(1 << 30),
                   "leave": leaves[i % len(leaves)] + rng.randrange(40 << 10), "pre_entries": rng.randint(0, 3),
                   "small_map": i % 3 == 2, "fill_between": i % 3 == 1, "max_inserts": 120}
            res = ctx.misc.call(msg, timeout=1200)
        finally:
            _umount(mnt)
        ctx_info = {"trial": i, "leave": msg["leave"], "small_map": msg["small_map"]}
        if res.get("crashed") or res.get("harness_error"):
            t.add_check(res, **ctx_info)
            t.c["trials"] += 1
            continue
        for w in res["wrong"]:
            t.c["wrong_restores"] += 1
            t.fail("wrong restore", **ctx_info, detail=w)
        for e in res["escaped"]:
            t.c["escaped_exceptions"] += 1
            t.fail("escaped exception", **ctx_info, exception=e)
        bad = []
        if res["failed_writes"] == 0:
            bad.append("the disk never filled")
        if res["uncounted_failures"]:
            bad.append(f"{res['uncounted_failures']} failed writes not counted in write_errors")
        if res["memory_misses"]:
            bad.append(f"{res['memory_misses']} inserts not served from memory")
        if res["verify_problems"]:
            bad.append(f"verify after the failures: {res['verify_problems']}")
        if res["reopen_misses"]:
            bad.append(f"{res['reopen_misses']} indexed entries not served after reopening")
        if res["resume_failures"]:
            bad.append(f"{res['resume_failures']} writes failed after space was freed")
        if bad:
            t.c["failed_cases"] += 1
            t.fail("full disk: " + "; ".join(bad), **ctx_info,
                   res={k: res.get(k) for k in ("inserts", "persisted", "failed_writes", "write_errors",
                                                "writer_failed", "uncounted_failures", "verify_detail",
                                                "error_messages", "stats")})
        t.outcomes["served_from_memory" if not res["memory_misses"] else "memory_misses"] += 1
        t.outcomes["writes_resumed" if res["resumed"] and not res["resume_failures"] else "writes_not_resumed"] += 1
        t.outcomes["failures_counted" if not res["uncounted_failures"] else "failures_uncounted"] += 1
        t.info.setdefault("runs", []).append({
            "leave_bytes": msg["leave"], "small_map": msg["small_map"], "fill_between": msg["fill_between"],
            "map_grown": res.get("map_grown"), "index_enospc": res.get("index_enospc"), "inserts": res["inserts"],
            "persisted": res["persisted"], "failed_writes": res["failed_writes"],
            "write_errors": res.get("write_errors"), "writer_failed": res["writer_failed"],
            "reopen_checked": res["reopen_checked"], "resumed": res["resumed"],
            "errors": res["error_messages"][:4]})
        t.c["trials"] += 1
        _progress(ctx, t, i, n + 1)
    shutil.rmtree(base, ignore_errors=True)
    return t.result()


# ================================================================ parent: permissions


def run_permissions(ctx: Ctx) -> dict:
    t = Tally("permissions")
    base = ctx.work / "perm"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    os.chmod(base, 0o755)
    root_w = Checker(ctx.logdir, "perm")
    nobody_w: Checker | None = None
    is_root = os.geteuid() == 0
    if is_root:
        os.chmod(ctx.work, 0o755)
        nobody_w = Checker(ctx.logdir, "perm")
        nobody_w.w.close()
        nobody_w.w = Worker("perm", ctx.logdir, nobody=True)

    def populated(d: Path) -> None:
        root_w.call({"op": "populate", "dir": str(d)})

    def case_missing() -> tuple[Path, str, bool]:
        return base / "missing" / "a" / "b", "open", False

    def case_file() -> tuple[Path, str, bool]:
        f = base / "afile"
        f.write_text("not a directory")
        return f, "error", False

    def case_parent_file() -> tuple[Path, str, bool]:
        f = base / "parentfile"
        f.write_text("x")
        return f / "cache", "error", False

    def case_index_file() -> tuple[Path, str, bool]:
        d = base / "indexfile"
        d.mkdir()
        (d / "index").write_text("x")
        return d, "error", False

    def case_blobs_file() -> tuple[Path, str, bool]:
        d = base / "blobsfile"
        d.mkdir()
        (d / "blobs").write_text("x")
        return d, "error", False

    def case_dangling() -> tuple[Path, str, bool]:
        d = base / "dangling"
        os.symlink(base / "nowhere" / "x", d)
        return d, "either", False

    def case_long() -> tuple[Path, str, bool]:
        return base / ("x" * 300) / "cache", "error", False

    def case_ro_existing() -> tuple[Path, str, bool]:
        m = base / "ro-existing"
        err = _mount_tmpfs(m, "8m")
        if err:
            raise RuntimeError(err)
        populated(m / "cache")
        subprocess.run(["mount", "-o", "remount,ro", str(m)], check=True)
        return m / "cache", "error", False

    def case_ro_missing() -> tuple[Path, str, bool]:
        m = base / "ro-missing"
        err = _mount_tmpfs(m, "1m")
        if err:
            raise RuntimeError(err)
        subprocess.run(["mount", "-o", "remount,ro", str(m)], check=True)
        return m / "cache", "error", False

    def case_noperm() -> tuple[Path, str, bool]:
        d = base / "noperm"
        populated(d)
        os.chmod(d, 0o700)
        return d, "error", True

    def case_noperm_parent() -> tuple[Path, str, bool]:
        d = base / "noperm-parent"
        d.mkdir()
        os.chmod(d, 0o755)
        return d / "cache", "error", True

    def chown_tree(d: Path) -> None:
        for p in [d, *d.rglob("*")]:
            os.lchown(p, 65534, 65534)

    def case_datamdb_root() -> tuple[Path, str, bool]:
        d = base / "datamdb-root"
        populated(d)
        chown_tree(d)
        os.chown(d / "index" / "data.mdb", 0, 0)
        os.chmod(d / "index" / "data.mdb", 0o600)
        return d, "error", True

    def case_lock_root() -> tuple[Path, str, bool]:
        d = base / "lock-root"
        populated(d)
        chown_tree(d)
        os.chown(d / "index" / "lock.mdb", 0, 0)
        os.chmod(d / "index" / "lock.mdb", 0o644)
        return d, "error", True

    def case_blobs_root() -> tuple[Path, str, bool]:
        d = base / "blobs-root"
        populated(d)
        chown_tree(d)
        for p in [d / "blobs", *(d / "blobs").rglob("*")]:
            os.lchown(p, 0, 0)
        return d, "writes_fail", True

    cases: list[tuple[str, Callable[[], tuple[Path, str, bool]], bool]] = [
        ("missing directory (created)", case_missing, False),
        ("a file where the directory should be", case_file, False),
        ("a file where a parent directory should be", case_parent_file, False),
        ("index/ is a file", case_index_file, False),
        ("blobs/ is a file", case_blobs_file, False),
        ("dangling symlink", case_dangling, False),
        ("path component too long", case_long, False),
        ("read-only mount, populated store", case_ro_existing, True),
        ("read-only mount, directory missing", case_ro_missing, True),
        ("no permission (0700 root dir, run as nobody)", case_noperm, True),
        ("no permission to create (root-owned parent, run as nobody)", case_noperm_parent, True),
        ("index/data.mdb not readable (run as nobody)", case_datamdb_root, True),
        ("index/lock.mdb not writable (run as nobody)", case_lock_root, True),
        ("blobs/ not writable (run as nobody)", case_blobs_root, True),
    ]
    mounts = []
    for name, setup, needs_root in cases:
        if needs_root and not is_root:
            t.skipped.append(f"{name}: needs root")
            continue
        try:
            d, expect, as_nobody = setup()
        except Exception as e:
            t.skipped.append(f"{name}: setup failed: {e}")
            continue
        if "mount" in name:
            mounts.append(d.parent)
        before = _tree_state(d)
        w = nobody_w if as_nobody else root_w
        assert w is not None
        res = w.call({"op": "perm", "dir": str(d)})
        after = _tree_state(d)
        t.c["trials"] += 1
        if res.get("crashed"):
            t.add_check(res, case=name)
            continue
        verdict, problems = _judge_perm(res, expect, d)
        if expect == "error" and before.get("files") and before != after:
            problems.append(f"the existing store was changed: {sorted(set(before['files']) ^ set(after['files']))[:4]}")
        if _isdir(d) and list(d.glob("index.corrupt-*")):
            problems.append("the index was moved aside as corrupt (the whole cache is lost)")
        for m, r in res.items():
            if isinstance(r, dict):
                for e in r.get("escaped", []):
                    t.c["escaped_exceptions"] += 1
                    t.fail("escaped exception", case=name, mode=m, exception=e)
        if problems:
            t.c["failed_cases"] += 1
            t.fail(f"permissions: {name}", problems=problems,
                   outcomes={m: {k: r.get(k) for k in ("outcome", "message", "warned", "served", "write_errors")}
                             for m, r in res.items() if isinstance(r, dict)})
        t.outcomes[verdict] += 1
        t.info.setdefault("cases", []).append({
            "case": name, "expected": expect, "verdict": verdict, "ok": not problems,
            "raise": {k: res["raise"].get(k) for k in ("outcome", "message", "write_errors")},
            "memory": {k: res["memory"].get(k) for k in ("outcome", "served", "warned")},
            "lru": {k: res["lru"].get(k) for k in ("outcome", "served")}})
    for m in mounts:
        _umount(m)
    root_w.close()
    if nobody_w:
        nobody_w.close()
    subprocess.run(["chmod", "-R", "u+rwX", str(base)], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)
    return t.result()


def _isdir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def _tree_state(d: Path) -> dict:
    import xxhash
    files = {}
    try:
        if _isdir(d):
            for p in sorted(d.rglob("*")):
                if p.is_file() and p.name not in ("lock.mdb", "file-digests.json"):
                    files[str(p.relative_to(d))] = xxhash.xxh3_64_hexdigest(p.read_bytes())
    except OSError:
        pass
    return {"files": files}


def _judge_perm(res: dict, expect: str, d: Path) -> tuple[str, list[str]]:
    problems = []
    r, m, lru = res["raise"], res["memory"], res["lru"]
    opened = r.get("outcome") == "opened"
    if opened:
        verdict = "opened"
        if not r.get("served"):
            problems.append("opened but did not serve")
        if expect == "error":
            problems.append("expected StoreOpenError, the store opened")
        if expect == "writes_fail" and not r.get("write_errors"):
            problems.append("writes into an unwritable blobs/ were not counted as write_errors")
    elif r.get("outcome") == "StoreOpenError":
        verdict = "StoreOpenError"
        if expect == "open":
            problems.append(f"expected the store to open: {r.get('message')}")
        msg = r.get("message", "")
        if str(d) not in msg and str(d.parent) not in msg:
            problems.append(f"StoreOpenError does not name the path: {msg!r}")
    else:
        verdict = r.get("outcome", "?")
        problems.append(f"open raised something other than StoreOpenError: {r.get('escaped')}")
    for mode, x in (("memory", m), ("lru", lru)):
        if x.get("outcome") == "memory_only":
            if not x.get("served"):
                problems.append(f"{mode}: memory-only mode did not serve")
            if mode == "memory" and not x.get("warned"):
                problems.append(f"{mode}: memory-only without a warning")
        elif x.get("outcome") == "opened":
            if not x.get("served"):
                problems.append(f"{mode}: opened but did not serve")
            if verdict == "StoreOpenError":
                problems.append(f"{mode}: opened where on_disk_error='raise' failed")
        else:
            problems.append(f"{mode}: {x.get('outcome')} {x.get('message', '')}")
    return verdict, problems


# ================================================================ parent: concurrency


def run_concurrency(ctx: Ctx) -> dict:
    t = Tally("concurrency")
    size = ctx.size
    d = ctx.work / "conc"
    shutil.rmtree(d, ignore_errors=True)
    ws = [Worker("conc", ctx.logdir) for _ in range(size["conc_procs"])]
    results = []
    try:
        for w in ws:
            w.wait_ready()
        for p, w in enumerate(ws):
            w.send({"op": "conc", "dir": str(d), "seconds": size["conc_seconds"], "threads": size["conc_threads"],
                    "seed": ctx.seed, "proc": p, "max_disk_bytes": 4 << 20})
        for p, w in enumerate(ws):
            end = time.time() + size["conc_seconds"] + 300
            res = None
            while time.time() < end:
                try:
                    ev = w.next(end - time.time())
                except queue.Empty:
                    break
                if ev is None:
                    break
                if ev.get("ev") == "result":
                    res = ev["result"]
                    break
            if res is None:
                w.p.poll()
                t.c["crashes"] += 1
                t.fail("concurrency process died or hung", proc=p, returncode=w.p.returncode,
                       signal=_signame(w.p.returncode), stderr=w.stderr_tail(1500))
                continue
            results.append(res)
    finally:
        for w in ws:
            w.close()
    ops: Counter = Counter()
    hits: Counter = Counter()
    vk: Counter = Counter()
    for p, res in enumerate(results):
        if res.get("harness_error"):
            t.fail("harness error", proc=p, error=res["harness_error"])
            continue
        ops.update(res["ops"])
        hits.update(res["hits"])
        vk.update(res["verify_kinds"])
        for w in res["wrong"]:
            t.c["wrong_restores"] += 1
            t.fail("wrong restore", proc=p, detail=w)
        for e in res["escaped"]:
            t.c["escaped_exceptions"] += 1
            t.fail("escaped exception", proc=p, exception=e)
        t.info.setdefault("oracle_checks", 0)
        t.info["oracle_checks"] += res["oracle_checks"]
        t.info.setdefault("synthetic_checks", 0)
        t.info["synthetic_checks"] += res["syn_checks"]
        t.info.setdefault("process_stats", []).append(res.get("stats"))
    # the directory afterwards: every claimed entry correct, verify clean
    res = ctx.checker.call({"op": "check", "dir": str(d), "fix": True})
    t.add_check(res, phase="final check")
    t.info["final_check"] = {k: res.get(k) for k in ("claimed", "full", "partial", "miss", "verify", "verify_after_fix")}
    if res.get("verify"):
        t.fail("verify after the run (all processes exited) is not clean", verify=res.get("verify"))
        t.c["verify_unclean"] += 1
    t.c["trials"] = sum(ops.values())
    t.info.update({"processes": size["conc_procs"], "threads_per_process": size["conc_threads"],
                   "run_seconds": size["conc_seconds"], "ops": dict(ops), "hits": dict(hits),
                   "verify_kinds_seen_during_run": dict(vk)})
    shutil.rmtree(d, ignore_errors=True)
    return t.result()


# ================================================================ parent: bad input


def run_bad_input(ctx: Ctx) -> dict:
    t = Tally("bad_input")
    d = ctx.work / "badinput"
    shutil.rmtree(d, ignore_errors=True)
    res = ctx.misc.call({"op": "bad_input", "dir": str(d), "seed": ctx.seed,
                         "huge_fetch": ctx.size["huge_fetch"], "huge_insert": ctx.size["huge_insert"]}, timeout=1800)
    if res.get("crashed") or res.get("harness_error"):
        t.add_check(res, phase="bad input")
        return t.result()
    for r in res["cases"]:
        t.c["trials"] += 1
        if r["outcome"] == "escaped":
            t.c["escaped_exceptions"] += 1
        if r.get("wrong"):
            t.c["wrong_restores"] += 1
        if not r["ok"] and r.get("limitation"):
            t.info.setdefault("known_limitations", []).append({"case": r["case"], "why": r["limitation"]})
        elif not r["ok"]:
            t.c["failed_cases"] += 1
            t.fail(f"bad input: {r['case']}", **{k: v for k, v in r.items() if k not in ("case", "exception")},
                   tb=(r.get("exception") or {}).get("tb", "")[-600:])
        t.outcomes[r["outcome"]] += 1
    t.info["cases"] = [{k: v for k, v in r.items() if k != "exception"} for r in res["cases"]]
    shutil.rmtree(d, ignore_errors=True)
    return t.result()


# ================================================================ main

RUNNERS: dict[str, Callable[[Ctx], dict]] = {
    "crash": run_crash, "corruption": run_corruption, "full_disk": run_full_disk,
    "permissions": run_permissions, "concurrency": run_concurrency, "bad_input": run_bad_input,
}
TOTAL_FIELDS = ("trials", "wrong_restores", "escaped_exceptions", "crashes", "entries_lost", "unexplained_misses",
                "verify_unclean", "failed_cases")


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "root": os.geteuid() == 0}
    for mod in ("mlx", "mlx_lm", "lmdb"):
        try:
            from importlib.metadata import version
            env[mod] = version(mod)
        except Exception:
            pass
    try:
        env["kvstore_commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                               capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "kvstore"],
                               capture_output=True, text=True).stdout.strip()
        env["kvstore_dirty"] = bool(dirty)
    except Exception:
        pass
    return env


def run(size_name: str = "full", *, seed: int = 0, only: tuple[str, ...] = KINDS, work: Path | None = None,
        verbose: bool = False, keep: bool = False, sizes: dict | None = None) -> dict:
    size = dict(SIZES[size_name], **(sizes or {}))
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="kvfaults-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(work, seed, size, verbose)
    t0 = time.time()
    out: dict[str, Any] = {"command": "python tools/faults.py" + ("" if size_name == "full" else f" --{size_name}"),
                           "size": size_name, "seed": seed, "environment": environment(),
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "kinds": {}}
    try:
        for kind in only:
            ctx.say(f"== {kind}")
            try:
                out["kinds"][kind] = RUNNERS[kind](ctx)
            except Exception as e:
                out["kinds"][kind] = {"trials": 0, "harness_error": exc_info(kind, e), "failures": []}
                ctx.say(f"  harness error in {kind}: {e!r}")
                traceback.print_exc()
    finally:
        ctx.close()
        if own and not keep:
            subprocess.run(["chmod", "-R", "u+rwX", str(work)], capture_output=True)
            shutil.rmtree(work, ignore_errors=True)
    out["total"] = {f: sum(int(k.get(f, 0) or 0) for k in out["kinds"].values()) for f in TOTAL_FIELDS}
    out["total"]["harness_errors"] = sum(1 for k in out["kinds"].values() if k.get("harness_error"))
    out["seconds"] = round(time.time() - t0, 1)
    out["total"]["seconds"] = out["seconds"]
    return out


def table(out: dict) -> str:
    cols = ("trials", "wrong_restores", "escaped_exceptions", "crashes", "entries_lost", "unexplained_misses",
            "verify_unclean", "failed_cases", "seconds")
    short = ("trials", "wrong", "escaped", "crashes", "lost", "unexpl.", "unclean", "failed", "secs")
    rows = [("kind",) + short]
    for kind, k in list(out["kinds"].items()) + [("total", out["total"])]:
        rows.append((kind,) + tuple(str(k.get(c, "")) for c in cols))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in enumerate(zip(r, widths))) for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (minutes)")
    ap.add_argument("--ci", action="store_true", help="the CI subset (what tests/test_faults.py runs)")
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help=f"comma-separated fault kinds ({','.join(KINDS)})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=N",
                    help=f"override a size (keys: {', '.join(SIZES['full'])})")
    ap.add_argument("--workdir", type=Path, help="work directory (default: a temp dir, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    size_name = "ci" if args.ci else "quick" if args.quick else "full"
    only = tuple(k.strip() for k in args.only.split(",")) if args.only else KINDS
    for k in only:
        if k not in KINDS:
            ap.error(f"unknown fault kind {k!r}; known: {', '.join(KINDS)}")
    sizes = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        sizes[k] = int(v)
    out = run(size_name, seed=args.seed, only=only, work=args.workdir, verbose=args.verbose, keep=args.keep,
              sizes=sizes)
    print()
    print(table(out))
    print(f"\n{out['seconds']:.0f}s")
    for kind, k in out["kinds"].items():
        for f in k.get("failures", [])[:8]:
            print(f"  [{kind}] {f['what']}: " + json.dumps({x: y for x, y in f.items() if x != "what"}, default=str)[:400])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    bad = sum(out["total"][f] for f in ("wrong_restores", "escaped_exceptions", "crashes", "entries_lost"))
    return 1 if bad or out["total"]["harness_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
