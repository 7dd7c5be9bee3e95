"""``permissions``: a missing directory, a file in the way, read-only mounts, no permission
(a worker running as ``nobody``), unusable ``index/`` or ``blobs/``: a clear
``StoreOpenError`` naming the problem, or (``on_disk_error="memory"``, and the
LRUPromptCache drop-in) a warning and memory-only serving.

Worker half: ``op_perm`` (``open_modes``, shared with the full-disk kind) and
``op_populate``. Parent half: ``run_permissions`` sets up each case of ``CASES`` and
judges the three outcomes (``_judge_perm``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..check import Tally, file_digests
from ..common import CHUNK, ROOT, Emit, LogCapture, exc_info
from ..damage import mount_tmpfs, umount
from ..synth import Zoo, random_prompt, syn_cache, syn_check, syn_identity
from ..worker import Checker, Worker

if TYPE_CHECKING:
    from ..context import Ctx


def open_modes(cdir: str, modes: tuple = ("raise", "memory", "lru")) -> dict:
    """Open ``cdir`` the three ways a caller can and use the store: outcome per mode."""
    ident = syn_identity("kv")
    toks = random_prompt(random.Random(len(cdir)), 40, 90)
    return {mode: open_and_use(cdir, mode, ident, toks) for mode in modes}


def open_and_use(cdir: str, mode: str, ident: Any, toks: list[int]) -> dict:
    """Open ``cdir`` as ``mode`` says (``on_disk_error`` raise or memory, ``shared``:
    raise with ``shared_dir=True``, or the LRUPromptCache drop-in), insert a synthetic
    cache and fetch it back: the outcome of the open, whether the fetch ``served`` it,
    write errors and the warnings logged."""
    from kvstore import KVStore, LRUPromptCache, StoreOpenError
    r: dict[str, Any] = {"escaped": []}
    cap = LogCapture()
    with cap:
        try:
            if mode == "lru":
                lru = LRUPromptCache(cache_dir=cdir, chunk_tokens=CHUNK)
                store = lru.store
            else:  # "shared": a directory a group shares on purpose (errors raise)
                store = KVStore(cdir, chunk_tokens=CHUNK, on_disk_error="raise" if mode == "shared" else mode,
                                shared_dir=mode == "shared")
        except StoreOpenError as e:
            r["outcome"] = "StoreOpenError"
            r["message"] = str(e)
            return r
        except Exception as e:
            r["outcome"] = "exception"
            r["escaped"].append(exc_info(f"open ({mode})", e))
            return r
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
    return r


def op_perm(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """One permissions/paths case (set up by the parent), possibly as ``nobody``."""
    res = open_modes(msg["dir"])
    res["uid"] = os.getuid()
    res["exists_after"] = _isdir(Path(msg["dir"]))
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


# ======================================================================= parent half
# Each case makes its directory under ``base`` (``populate`` fills one with a few entries,
# as root) and returns (the cache directory, what opening it must do, run as nobody?).
# Expected: "open" (it opens), "error" (StoreOpenError, or a warning and memory-only
# serving), "either", "writes_fail" (it opens; writes fail and are counted).

Setup = Callable[[Path, Callable[[Path], None]], tuple[Path, str, bool]]


def case_missing(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    return base / "missing" / "a" / "b", "open", False


def case_file(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    f = base / "afile"
    f.write_text("not a directory")
    return f, "error", False


def case_parent_file(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    f = base / "parentfile"
    f.write_text("x")
    return f / "cache", "error", False


def case_index_file(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "indexfile"
    d.mkdir()
    (d / "index").write_text("x")
    return d, "error", False


def case_blobs_file(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "blobsfile"
    d.mkdir()
    (d / "blobs").write_text("x")
    return d, "error", False


def case_dangling(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "dangling"
    os.symlink(base / "nowhere" / "x", d)
    return d, "either", False


def case_long(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    return base / ("x" * 300) / "cache", "error", False


def _read_only_mount(m: Path, size: str, populate: Callable[[Path], None] | None = None) -> None:
    """A tmpfs at ``m`` (populated at ``m/cache`` first, if asked), remounted read-only."""
    err = mount_tmpfs(m, size)
    if err:
        raise RuntimeError(err)
    if populate is not None:
        populate(m / "cache")
    subprocess.run(["mount", "-o", "remount,ro", str(m)], check=True)


def case_ro_existing(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    m = base / "ro-existing"
    _read_only_mount(m, "8m", populate)
    return m / "cache", "error", False


def case_ro_missing(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    m = base / "ro-missing"
    _read_only_mount(m, "1m")
    return m / "cache", "error", False


def case_noperm(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "noperm"
    populate(d)
    os.chmod(d, 0o700)
    return d, "error", True


def case_noperm_parent(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "noperm-parent"
    d.mkdir()
    os.chmod(d, 0o755)
    return d / "cache", "error", True


def _chown_tree(d: Path) -> None:
    for p in [d, *d.rglob("*")]:
        os.lchown(p, 65534, 65534)


def _nobody_store_root_file(d: Path, name: str, mode: int, populate: Callable[[Path], None]) -> None:
    """A populated store owned by nobody but for ``index/<name>``: root's, with ``mode``."""
    populate(d)
    _chown_tree(d)
    os.chown(d / "index" / name, 0, 0)
    os.chmod(d / "index" / name, mode)


def case_datamdb_root(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "datamdb-root"
    _nobody_store_root_file(d, "data.mdb", 0o600, populate)
    return d, "error", True


def case_lock_root(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    d = base / "lock-root"
    _nobody_store_root_file(d, "lock.mdb", 0o644, populate)
    return d, "error", True


def case_blobs_root(base: Path, populate: Callable[[Path], None]) -> tuple[Path, str, bool]:
    """blobs/ belongs to another user (root): refused at open (another user could plant
    pack files), not merely failing writes."""
    d = base / "blobs-root"
    populate(d)
    _chown_tree(d)
    for p in [d / "blobs", *(d / "blobs").rglob("*")]:
        os.lchown(p, 0, 0)
    return d, "error", True


# (name, setup, needs root)
CASES: list[tuple[str, Setup, bool]] = [
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
    ("blobs/ owned by another user (run as nobody)", case_blobs_root, True),
]


def run_permissions(ctx: Ctx) -> dict:
    """Each case of ``CASES`` opened the three ways by a worker (as nobody where the case says)."""
    t = Tally("permissions")
    base = ctx.work / "perm"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    os.chmod(base, 0o755)
    is_root = os.geteuid() == 0
    root_w = Checker(ctx.logdir, "perm")
    nobody_w: Checker | None = None
    opened: list[tuple[Path, int]] = []
    if is_root:
        # the other uids reach the work directory too (pytest's base temp dir is 0700)
        opened = searchable_by_others([ROOT, Path(sys.prefix), Path(sys.base_prefix), ctx.work])
        nobody_w = Checker(ctx.logdir, "perm")
        nobody_w.w.close()
        nobody_w.w = Worker("perm", ctx.logdir, nobody=True)

    def populate(d: Path) -> None:
        root_w.call({"op": "populate", "dir": str(d)})

    mounts: list[Path] = []
    for name, setup, needs_root in CASES:
        if needs_root and not is_root:
            t.skipped.append(f"{name}: needs root")
            continue
        try:
            d, expect, as_nobody = setup(base, populate)
        except Exception as e:
            t.skipped.append(f"{name}: setup failed: {e}")
            continue
        if "mount" in name:
            mounts.append(d.parent)
        w = nobody_w if as_nobody else root_w
        assert w is not None
        _perm_case(t, w, name, d, expect)
    for m in mounts:
        umount(m)
    if is_root:
        run_group(ctx, t, base, 4 if ctx.size.get("crash", 0) <= 24 else 12)
    else:
        t.skipped.append("two uids of one group: needs root")
    root_w.close()
    if nobody_w:
        nobody_w.close()
    for d, mode in reversed(opened):
        os.chmod(d, mode)
    subprocess.run(["chmod", "-R", "u+rwX", str(base)], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)
    return t.result()


# ----------------------------------------------------------------------- a group sharing a directory

GROUP, MEMBERS = 47000, (47001, 47002)  # a group and two unprivileged users of it (no passwd entry needed)
_MEMBER = """
import json, logging, os, random, sys
a = json.loads(sys.argv[1])
os.umask(0o022)  # a member's own umask must not lock the others out
warned = []
logging.getLogger("kvstore").addHandler(
    type("H", (logging.Handler,), {"emit": lambda s, r: warned.append(r.getMessage())})(logging.WARNING))
from kvstore import KVStore
from tools.harness.faults.synth import syn_cache, syn_check, syn_identity
ident = syn_identity("kv")
out = {"uid": os.getuid(), "wrong": [], "missed": 0}
with KVStore(a["cache"], chunk_tokens=a["chunk"], shared_dir=True, on_disk_error="memory") as s:
    out["disk"] = s.disk is not None
    for t in a["fetch"]:
        f = s.fetch(ident, t)
        if f.n != len(t):
            out["missed"] += 1
        elif not syn_check("kv", t, f.cache, f.n)[0]:
            out["wrong"].append(len(t))
    for t in a["insert"]:
        s.insert(ident, t, syn_cache("kv", t))
        s.flush()
    if a.get("rebuild") and s.disk is not None:
        from kvstore.maintenance.fsck import rebuild_index
        out["rebuild"] = rebuild_index(s.disk)
out["warned"] = warned
print(json.dumps(out))
"""


def member_preexec(uid: int, gid: int = GROUP) -> Callable[[], None]:
    """preexec_fn: run a child as ``uid`` with ``gid`` as its group and only group."""
    def drop() -> None:
        os.setgroups([gid])
        os.setgid(gid)
        os.setuid(uid)
    return drop


def _as_member(uid: int, payload: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", _MEMBER, json.dumps(payload)], capture_output=True,
                       text=True, timeout=300, cwd="/", preexec_fn=member_preexec(uid),
                       env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": "/tmp"})
    if p.returncode != 0:
        return {"crashed": p.returncode, "stderr": p.stderr[-1200:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _shared_modes(d: Path) -> dict[str, tuple[str, int]]:
    """Files and directories under ``d`` whose mode or group is not the shared one."""
    bad = {}
    for p in d.rglob("*"):
        st = os.lstat(p)
        want = 0o2770 if stat.S_ISDIR(st.st_mode) else 0o660
        if (stat.S_IMODE(st.st_mode), st.st_gid) != (want, GROUP):
            bad[str(p.relative_to(d))] = (oct(stat.S_IMODE(st.st_mode)), st.st_gid)
    return bad


def run_group(ctx: Ctx, t: Tally, base: Path, rounds: int) -> None:
    """Two uids of one group, each with umask 022, take turns on one ``--shared-dir``
    directory: each round a member fetches every entry stored so far (a miss or a wrong
    restore is counted), stores new ones, and every third round rebuilds the index (what
    ``verify --fix`` does). No warning, no memory-only fallback; every file 0660 and
    every directory 2770 of the group; a file of another user in it is left alone."""
    d = base / "group"
    d.mkdir()
    os.chown(d, 0, GROUP)
    os.chmod(d, 0o2770)
    (d / "someone-else.txt").write_text("not kvstore's")
    rng = random.Random(ctx.seed)
    stored: list[list[int]] = []
    for i in range(rounds):
        new = [random_prompt(rng, 40, 100) for _ in range(2)]
        r = _as_member(MEMBERS[i % 2], {"cache": str(d), "chunk": CHUNK, "fetch": stored, "insert": new,
                                        "rebuild": i % 3 == 2})
        t.c["trials"] += 1
        if "crashed" in r:
            t.c["crashes"] += 1
            t.fail("group member process failed", round=i, **r)
            continue
        t.c["wrong_restores"] += len(r["wrong"])
        t.c["unexplained_misses"] += r["missed"]
        if r["wrong"] or r["missed"] or not r["disk"] or r["warned"]:
            t.fail("group member could not use the shared directory", round=i, result=r)
        t.outcomes[f"group member uid {r['uid']}"] += 1
        stored += new
    bad = {k: v for k, v in _shared_modes(d).items() if k != "someone-else.txt"}
    if bad:
        t.c["failed_cases"] += 1
        t.fail("files or directories not shared with the group", files=dict(list(bad.items())[:5]))
    if (d / "someone-else.txt").read_text() != "not kvstore's":
        t.c["failed_cases"] += 1
        t.fail("a file kvstore did not write was changed")
    t.info["group"] = {"rounds": rounds, "entries": len(stored)}


def searchable_by_others(paths: list[Path]) -> list[tuple[Path, int]]:
    """The nobody worker imports kvstore and tools from this checkout with its venv's
    interpreter, so each of them must be listable and every directory above them
    searchable by others: add o+rx / o+x where it is missing (a checkout cloned into a
    0700 ``mktemp -d``). Returns (directory, old mode) to restore, in the order changed."""
    changed: list[tuple[Path, int]] = []
    seen: set[Path] = set()
    for p in paths:
        top = p.resolve()
        for d in [top, *top.parents]:
            if d in seen:
                continue
            seen.add(d)
            mode = stat.S_IMODE(os.stat(d).st_mode)
            need = stat.S_IXOTH | (stat.S_IROTH if d == top else 0)
            if mode & need != need:
                os.chmod(d, mode | need)
                changed.append((d, mode))
    return changed


def _perm_case(t: Tally, w: Checker, name: str, d: Path, expect: str) -> None:
    """Run one case in worker ``w`` and tally it: where opening must fail, an existing
    store is left as it was, and the index is never moved aside as corrupt."""
    before = _tree_state(d)
    res = w.call({"op": "perm", "dir": str(d)})
    after = _tree_state(d)
    t.c["trials"] += 1
    if res.get("crashed"):
        t.add_check(res, case=name)
        return
    verdict, problems = _judge_perm(res, expect, d)
    if expect == "error" and before.get("files") and before != after:
        problems.append(f"the existing store was changed: {sorted(set(before['files']) ^ set(after['files']))[:4]}")
    if _isdir(d) and list(d.glob("index.corrupt-*")):
        problems.append("the index was moved aside as corrupt (the whole cache is lost)")
    for m, r in res.items():
        if isinstance(r, dict):
            t.add_escaped(r.get("escaped", []), case=name, mode=m)
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


def _isdir(p: Path) -> bool:
    try:
        return p.is_dir()
    except OSError:
        return False


def _tree_state(d: Path) -> dict:
    """Digest of every file below ``d`` but lock.mdb (what opening a store may change)."""
    files = {}
    try:
        if _isdir(d):
            for rel, digest in file_digests(d, lambda p: p.name in ("lock.mdb", "file-digests.json")):
                files[rel] = digest
    except OSError:
        pass
    return {"files": files}


def _judge_perm(res: dict, expect: str, d: Path) -> tuple[str, list[str]]:
    """The verdict on how the raise mode opened (opened, StoreOpenError, ...) and every
    problem with the three modes' outcomes against ``expect``."""
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
