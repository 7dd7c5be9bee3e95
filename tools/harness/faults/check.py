"""Judging a store after a fault: the check, store inspection and the per-kind tally."""

from __future__ import annotations

import glob
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .common import CHUNK, Emit, LogCapture, decode, exc_info, guard
from .damage import segment_target

if TYPE_CHECKING:
    from kvstore.index import Reader
    from kvstore.records import EntryRecord

    from .synth import Zoo


def raw_entries(store: Any) -> list[tuple[bytes, EntryRecord | None, bytes | None]]:
    """(key, record or None if kvstore did not write it, token ids) of every entry record,
    read in one transaction through the index's public reader."""
    from kvstore.records import RecordError

    def run(r: Reader) -> list[tuple[bytes, EntryRecord | None, bytes | None]]:
        out = []
        for k in r.keys("entries"):
            try:
                rec = r.entry(k)
            except RecordError:
                rec = None
            out.append((k, rec, r.tokens(k)))
        return out
    return store.disk.index.view(run)


def logical_dump(store: Any) -> dict:
    """Every key/value of every index database plus the files under the cache directory
    (name -> xxh3): the store's persistent state, independent of LMDB page layout."""
    import xxhash
    from kvstore.index import DBS

    def run(r: Reader) -> dict:
        return {name: sorted((k.hex(), xxhash.xxh3_64_hexdigest(r.raw(name, k) or b"")) for k in r.keys(name))
                for name in DBS}
    state: dict[str, Any] = {"index": store.disk.index.view(run)}
    root = Path(store.disk.root)
    state["files"] = dict(file_digests(root, lambda p: "index" in p.relative_to(root).parts
                                       or p.name == "file-digests.json"))
    return state


def file_digests(root: Path, skip: Callable[[Path], bool]) -> Iterator[tuple[str, str]]:
    """(path relative to ``root``, xxh3) of every regular file below ``root`` that ``skip``
    does not exclude, in path order (symlinks are not followed, FIFOs not opened)."""
    import stat

    import xxhash
    found = []
    for d, _dirs, files in os.walk(root):  # never descends into a symlinked directory
        found += [Path(d) / f for f in files]
    for p in sorted(found):
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and not skip(p):
            yield str(p.relative_to(root)), xxhash.xxh3_64_hexdigest(p.read_bytes())


def segment_users(store: Any) -> list[dict]:
    """Every segment the readable entry records read (their chunks' and their own), with
    the entry keys (hex) that need it: ``{"pack": path relative to the cache directory,
    "offset", "length", "users": [key hex]}``, in (pack, offset) order."""
    from kvstore import files
    from kvstore.index import scan
    snap = scan(store.disk.index, full=False)
    root = Path(store.disk.root)
    segs: dict[tuple[bytes, int], dict] = {}
    for key, rec in snap.entries.items():
        if rec is None:
            continue
        mine = list(rec.segments) + [snap.chunks[c].segment for c in rec.chunks if snap.chunks.get(c)]
        for s in mine:
            path = files.pack_path(store.disk.blob_root, s.pack).relative_to(root)
            d = segs.setdefault((s.pack, s.offset), {"pack": str(path), "offset": s.offset, "length": s.length,
                                                     "users": set()})
            d["users"].add(key.hex())
    return [dict(d, users=sorted(d["users"])) for _, d in sorted(segs.items())]


def entry_key(store: Any, zoo: Zoo, name: str, tokens: list[int]) -> str | None:
    """The key (hex) the store files ``tokens`` of model ``name`` under (None: no identity)."""
    from kvstore.keys import encode_tokens, key_of, root_key
    ident = store.identity(zoo.model_arg(name))
    return key_of(root_key(ident.digest), encode_tokens(tokens), CHUNK).hex() if ident else None


def check_store(zoo: Zoo, cache_dir: str, *, known: list | None = None, targets: set | None = None,
                committed: set | None = None, fix: bool = True, reopen: bool = True,
                max_fetch: int | None = None, keep: dict[str, str] | None = None) -> dict:
    """Open ``cache_dir`` fresh and judge it (see the package docstring).

    ``known``: [(model, tokens)] the directory should serve (fetched too; a hit must pass);
    ``targets``: entry keys (hex) the fault damaged or legitimately removed (their misses
    are explained), and damaged segments (``damage.segment_target``: every entry using one
    when the check runs is explained, one a later persist built on it included); ``committed``: entry keys that must still be served in full;
    ``keep``: files kvstore did not write (path relative to ``cache_dir`` -> xxh3) that
    must still be there, unchanged, after the check (``res["foreign_changed"]`` otherwise).
    """
    targets = set(targets or ())
    committed = set(committed or ())
    segments = {x for x in targets if x.startswith("segment:")}  # damage.segment_target
    res: dict[str, Any] = dict(open="ok", escaped=[], wrong=[], claimed=0, full=0, partial=0, miss=0,
                               unexplained=[], lost=[], verify={}, verify_after_fix=None, verify_errors=[],
                               post_fix_misses=0, logs=[], aside=False, aside_logged=None, foreign=0,
                               known_hits=0, known=0, unparsable=0)
    cap = LogCapture()
    with cap:
        store = _open_judged(cache_dir, res, cap)
        if store is None:
            return res
        try:
            if segments and store.disk is not None:  # every entry using a damaged segment now
                targets |= {u for seg in segment_users(store) if segment_target(seg) in segments for u in seg["users"]}
            _judge(zoo, store, res, known or [], targets, committed, max_fetch)
            if store.disk is not None and fix:
                _verify_fix(store, res)
        finally:
            guard("close()", res["escaped"], store.close)
        if fix and reopen and res["open"] in ("ok", "recovered") and not res["verify_errors"]:
            _check_after_fix(zoo, cache_dir, res)
        res["logs"] = cap.records[-8:]
    res["foreign_changed"] = changed_files(Path(cache_dir), keep or {})
    return res


def changed_files(root: Path, keep: dict[str, str]) -> list[str]:
    """The files of ``keep`` (path relative to ``root`` -> xxh3) that are gone or changed."""
    now = dict(file_digests(root, lambda p: str(p.relative_to(root)) not in keep)) if keep else {}
    return sorted(rel for rel, digest in keep.items() if now.get(rel) != digest)


def _open_judged(cache_dir: str, res: dict, cap: LogCapture) -> Any:
    """Open the store for the check and record how it opened in ``res["open"]`` (ok,
    recovered: the index was moved aside, memory_only, open_error, exception); None when
    it did not open."""
    from kvstore import KVStore, StoreOpenError
    asides_before = set(glob.glob(os.path.join(cache_dir, "index.corrupt-*")))
    try:
        store = KVStore(cache_dir, chunk_tokens=CHUNK, max_entries=100_000)
    except StoreOpenError as e:
        res["open"] = "open_error"
        res["open_error"] = str(e)
        res["logs"] = cap.records[-5:]
        return None
    except Exception as e:
        res["open"] = "exception"
        res["escaped"].append(exc_info("KVStore()", e))
        return None
    asides = set(glob.glob(os.path.join(cache_dir, "index.corrupt-*"))) - asides_before
    if asides:
        res["aside"] = True
        res["open"] = "recovered"
        res["aside_logged"] = cap.has("moved aside")
    if store.disk is None:
        res["open"] = "memory_only"
    return store


def _verify_fix(store: Any, res: dict) -> None:
    """``verify(fix=True)``, then ``verify`` again: what is left (but files kvstore did not
    write, which it reports and never touches) goes to ``res["verify_after_fix"]``."""
    from kvstore import maintenance as mt
    try:
        mt.verify(store.disk, fix=True, blob_age=0)
        left = [p for p in mt.verify(store.disk, blob_age=0) if p.kind not in mt.NOT_OURS]
        res["verify_after_fix"] = dict(Counter(p.kind for p in left))
        res["verify_after_fix_detail"] = [f"{p.kind} {p.key} {p.detail}" for p in left[:5]]
    except Exception as e:
        res["verify_errors"].append(exc_info("verify(fix=True)", e))


def _check_after_fix(zoo: Zoo, cache_dir: str, res: dict) -> None:
    """Reopened after ``verify --fix``, the store serves every entry it names in full
    (``post_fix_misses`` otherwise), and correctly."""
    from kvstore import KVStore
    try:
        store = KVStore(cache_dir, chunk_tokens=CHUNK, max_entries=100_000)
    except Exception as e:
        res["escaped"].append(exc_info("KVStore() after verify --fix", e))
        return
    try:
        for hx, name, tokens, _ in known_entries(store, zoo.ident_map(store)):
            f = store.fetch(zoo.model_arg(name), tokens)
            if f.n != len(tokens):
                res["post_fix_misses"] += 1
                continue
            why = hit_problem(zoo, name, tokens, f)
            if why is not None:
                res["wrong"].append({"key": hx, "model": name, "n": f.n, "after_fix": True, "detail": why})
    except Exception as e:
        res["escaped"].append(exc_info("fetch after verify --fix", e))
    finally:
        guard("close()", res["escaped"], store.close)


def known_entries(store: Any, names: dict[str, str], res: dict | None = None,
                  ) -> Iterator[tuple[str, str, list[int], EntryRecord]]:
    """(key hex, model name, tokens, record) of each entry record whose identity is in
    ``names`` (``Zoo.ident_map``); the others are counted in ``res["unparsable"]`` (no
    record or token ids) and ``res["foreign"]`` (another identity) when ``res`` is given."""
    for k, rec, toks in raw_entries(store):
        if rec is None or toks is None:
            if res is not None:
                res["unparsable"] += 1
            continue
        name = names.get(rec.identity.hex())
        if name is None:
            if res is not None:
                res["foreign"] += 1
            continue
        yield k.hex(), name, decode(toks), rec


def hit_problem(zoo: Zoo, name: str, tokens: list[int], f: Any) -> str | None:
    """Why the hit of a fetch result ``f`` for ``tokens`` is wrong (``Zoo.check``); None
    for a correct hit, a miss, or no result at all."""
    if f is None or f.cache is None or not f.n:
        return None
    ok, why = zoo.check(name, tokens, f.cache, f.n)
    return None if ok else why


def _judge(zoo: Zoo, store: Any, res: dict, known: list, targets: set, committed: set,
           max_fetch: int | None) -> None:
    """Fetch every claimed entry (at most ``max_fetch``) and every ``known`` prompt: hits
    must pass, misses must be explained, committed entries must be served in full."""
    claimed, problem_keys = _claimed(zoo, store, res)
    res["claimed"] = len(claimed)
    lengths = {c[0]: len(c[2]) for c in claimed}
    if max_fetch is not None and len(claimed) > max_fetch:
        random.Random(len(claimed)).shuffle(claimed)
        claimed = claimed[:max_fetch]
    served = _fetch_claimed(zoo, store, res, claimed, problem_keys, targets)
    for hx in sorted(committed - targets):
        if hx not in lengths:
            res["lost"].append(hx)       # committed, and the index no longer names it
            res.setdefault("lost_detail", []).append({"key": hx, "named": False})
        elif hx in served and served[hx] != lengths[hx]:
            res["lost"].append(hx)       # named, but not served in full
            res.setdefault("lost_detail", []).append({"key": hx, "served": served[hx], "of": lengths[hx]})
    _fetch_known(zoo, store, res, known)
    guard("stats()", res["escaped"], store.stats)
    guard("flush()", res["escaped"], store.flush, 30)


def _claimed(zoo: Zoo, store: Any, res: dict) -> tuple[list[tuple[str, str, list[int], EntryRecord]], set[str]]:
    """The entries the index claims and the keys ``verify`` reports (``res["verify"]``)."""
    from kvstore import maintenance as mt
    claimed: list[tuple[str, str, list[int], EntryRecord]] = []
    problem_keys: set[str] = set()
    if store.disk is None:
        return claimed, problem_keys
    names = zoo.ident_map(store)
    try:
        for entry in known_entries(store, names, res):
            claimed.append(entry)
    except Exception as e:
        res["enumerate_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        problems = mt.verify(store.disk, blob_age=0)
        res["verify"] = dict(Counter(p.kind for p in problems))
        problem_keys = {p.key for p in problems if p.key}
        res["verify_keys"] = [f"{p.kind} {p.record} {p.key}" for p in problems if p.key][:40]
    except Exception as e:
        res["verify_errors"].append(exc_info("verify()", e))
    return claimed, problem_keys


def _fetch_claimed(zoo: Zoo, store: Any, res: dict, claimed: list, problem_keys: set[str],
                   targets: set[str]) -> dict[str, int]:
    """Fetch each claimed entry: a hit must pass, a miss or partial hit must be explained
    (verify reports the entry or one of its chunks, or the fault targeted the entry).
    Returns key -> tokens served."""
    served: dict[str, int] = {}
    for hx, name, tokens, rec in claimed:
        f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), tokens)
        if f is None:
            continue
        n = f.n
        served[hx] = n
        why = hit_problem(zoo, name, tokens, f)
        if why is not None:
            res["wrong"].append({"key": hx, "model": name, "n": n, "of": len(tokens), "source": f.source,
                                 "detail": why})
        if n == len(tokens):
            res["full"] += 1
            continue
        res["partial" if n else "miss"] += 1
        explained = hx in problem_keys or hx in targets or any(ck.hex() in problem_keys for ck in rec.chunks)
        if not explained:
            res["unexplained"].append({"key": hx, "model": name, "n": n, "of": len(tokens)})
    return served


def _fetch_known(zoo: Zoo, store: Any, res: dict, known: list) -> None:
    """Fetch each prompt the directory should serve: a hit must pass (``known_hits``
    counts the full ones)."""
    for name, tokens in known:
        res["known"] += 1
        f = guard("fetch()", res["escaped"], store.fetch, zoo.model_arg(name), tokens)
        if f is None:
            continue
        if f.cache is not None and f.n > 0:
            res["known_hits"] += f.n == len(tokens)
        why = hit_problem(zoo, name, tokens, f)
        if why is not None:
            res["wrong"].append({"model": name, "n": f.n, "of": len(tokens), "source": f.source,
                                 "detail": why, "known": True})


def op_check(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Worker command ``check``: ``check_store`` on ``msg["dir"]``."""
    return check_store(zoo, msg["dir"], known=[tuple(x) for x in msg.get("known", [])],
                       targets=set(msg.get("targets", [])), committed=set(msg.get("committed", [])),
                       fix=msg.get("fix", True), reopen=msg.get("reopen", True), max_fetch=msg.get("max_fetch"),
                       keep=msg.get("keep"))


class Tally:
    """The figures of one fault kind: counters (``FIELDS``), outcomes, up to 60 failures
    with their context, extra ``info``, and what was skipped."""

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

    def add_wrong(self, wrong: list, what: str = "wrong restore", **ctx: Any) -> None:
        """Count each wrong restore and record it as a failure."""
        for w in wrong:
            self.c["wrong_restores"] += 1
            self.fail(what, **ctx, detail=w)

    def add_escaped(self, escaped: list, what: str = "escaped exception", **ctx: Any) -> None:
        """Count each exception that reached a caller and record it as a failure."""
        for e in escaped:
            self.c["escaped_exceptions"] += 1
            self.fail(what, **ctx, exception=e)

    def add_check(self, res: dict, **ctx: Any) -> None:
        """Count what a check (``check_store``, or a worker that died) found."""
        if res.get("crashed"):
            self.c["crashes"] += 1
            self.fail("checker process died" if not res.get("hang") else "checker hung", **ctx,
                      signal=res.get("signal"), stderr=res.get("stderr", "")[-800:])
            return
        if res.get("harness_error"):
            self.fail("harness error", **ctx, error=res["harness_error"])
            return
        self.add_wrong(res.get("wrong", []), **ctx)
        self.add_escaped(res.get("escaped", []), **ctx)
        for e in res.get("verify_errors", []):
            self.c["verify_errors"] += 1
            self.c["escaped_exceptions"] += 1
            self.fail("verify raised", **ctx, exception=e)
        self.c["unexplained_misses"] += len(res.get("unexplained", []))
        for u in res.get("unexplained", [])[:3]:
            self.fail("unexplained miss", **ctx, entry=u, verify=res.get("verify"))
        self.c["entries_lost"] += len(res.get("lost", []))
        if res.get("lost"):
            self.fail("entries lost", **ctx, keys=res["lost"][:5], n=len(res["lost"]), verify=res.get("verify"),
                      detail=res.get("lost_detail", [])[:5], verify_keys=res.get("verify_keys", [])[:12])
        if res.get("verify_after_fix"):
            self.c["verify_unclean"] += 1
            self.fail("verify not clean after --fix", **ctx, left=res["verify_after_fix"],
                      detail=res.get("verify_after_fix_detail"))
        self.c["post_fix_misses"] += res.get("post_fix_misses", 0)
        if res.get("post_fix_misses"):
            self.fail("entries not served after verify --fix", **ctx, n=res["post_fix_misses"])
        if res.get("foreign_changed"):
            self.c["failed_cases"] += 1
            self.fail("a file kvstore did not write was changed or removed", **ctx, files=res["foreign_changed"][:5])
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
