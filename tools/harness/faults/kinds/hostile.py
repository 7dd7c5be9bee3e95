"""``hostile``: a cache directory someone else put things in or around (issue 11).

Trials, on copies of a populated template (``hostile_cases``):
- crafted records written with ``lmdb`` directly: segments of 2**40 bytes or at offset
  2**40, an entry whose n or chunk list lies, another record's (verifying) segment, wrong
  tags, truncated records, lying pack records, token ids of another prompt, trie edges to
  another identity's entry, an ArraysCache of 20,000,000 arrays in a true-checksum header,
  identity descriptions nested 100,000 deep or with wrong-typed fields, and meta records
  kvstore never writes;
- planted files: blobs/, a fan-out directory or a pack file as a symlink to someone's
  files (``outside/``), FIFOs where kvstore reads its files, pack-like names in the wrong
  places, ``*.tmp`` and ``sha256-*`` files;
- swapped weights: a model's weights replaced by others of the same size under the old
  mtime: a fresh process must miss or restore what a cold run of the new weights gives;
- FIFOs in a model directory (issue 31.8: files kvstore did not write), at its config,
  tokenizer, template, weights or ``model_file``: ``kvstore import`` of a file whose
  metadata names that directory, ``import --model`` naming it, ``inspect`` decoding an
  entry recorded under it, and a fresh process fetching under it each finish in time,
  by themselves (a refusal, a miss or a store under the other model);
- foreign owners and modes (root only): a group- or world-writable cache dir, index/ or
  blobs/, a cache dir of another user: StoreOpenError naming the problem and the fix,
  memory-only with a warning (``on_disk_error="memory"``, LRUPromptCache), accepted with
  ``shared_dir=True`` where a group shares it; new files 0600 / directories 0700 under
  umask 022;
- clock skew: last_used in the future is read as now (LRU order, ``gc --max-age``); an
  orphan pack with a future mtime goes with ``gc --blob-age 0``.

For each directory: ``ls``, ``ls --json``, ``stats``, ``inspect``, ``verify``, a fetch of
every template prompt in a fresh process (RSS and time watched), ``gc --missing-models
--blob-age 0``, ``verify --fix --blob-age 0`` (as real ``kvstore`` processes for planted
files) and a final ``verify``, each bounded to 20 s; and the check on a second copy
(oracle on every hit, repairs, reopen). A trial fails if anything outside the cache dir or
any foreign file changed, a command hung, a process crashed, an exception escaped, a hit
was wrong, a refusal did not name the problem, or ``verify --fix`` left problems.

Worker half: ``op_cli`` (a command in-process), ``op_owner``, ``op_modes``, ``op_clock``,
``op_weights_populate``, ``op_weights_fetch``. Parent half: ``run_hostile``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import craft
from ..check import Tally
from ..common import CHUNK, EXTRA_TOKEN, N_GEN, ROOT, Emit, exc_info
from ..hostile_cases import DIR_CASES, Case, Crafted
from ..synth import Zoo, random_prompt, syn_cache, syn_identity
from ..worker import Checker, signame
from .permissions import open_and_use

if TYPE_CHECKING:
    from ..context import Ctx

BOUND = 20.0          # seconds any command or fetch may take
RSS_SLACK = 256 << 20  # bytes a fetch process may grow beyond twice the pack bytes


# ======================================================================= worker half


def op_cli(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """``kvstore ARGV`` run in this process (``kvstore.cli.main.main``): exit code,
    output tails, seconds, and the exception if one escaped ``main``."""
    from kvstore.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    res: dict[str, Any] = {"argv": msg["argv"]}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            res["rc"] = main(list(msg["argv"]))
    except SystemExit as e:
        res["rc"] = e.code
    except BaseException as e:
        res["rc"] = None
        res["escaped"] = exc_info("kvstore " + " ".join(msg["argv"][:2]), e)
    res.update(seconds=round(time.perf_counter() - t0, 3), stdout=out.getvalue()[-1500:],
               stderr=err.getvalue()[-1500:])
    return res


def op_owner(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Open ``msg["dir"]`` each way of ``msg["modes"]`` (raise, memory, lru, shared), use
    it, and say how each went (``permissions.open_and_use``)."""
    ident = syn_identity("kv")
    toks = random_prompt(random.Random(7), 40, 90)
    return {m: open_and_use(msg["dir"], m, ident, toks) for m in msg["modes"]}


def _modes_below(root: Path) -> dict[str, str]:
    """relative path -> ``d`` / ``f`` + octal permission bits, of ``root`` and below."""
    out = {".": f"d{os.stat(root).st_mode & 0o7777:o}"}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(d) / n
            st = os.lstat(p)
            out[str(p.relative_to(root))] = ("d" if n in dirs else "f") + f"{st.st_mode & 0o7777:o}"
    return out


def op_modes(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Under umask 022, a new private and a new shared cache directory, each used (an
    insert, a model identity, a close): the mode of everything created."""
    from kvstore import KVStore
    ident = syn_identity("kv")
    toks = random_prompt(random.Random(3), 40, 90)
    old = os.umask(0o022)
    out: dict[str, Any] = {}
    try:
        for name, shared in (("private", False), ("shared", True)):
            d = Path(msg["dir"]) / name / "cache"
            with KVStore(d, chunk_tokens=CHUNK, shared_dir=shared) as s:
                s.insert(ident, toks, syn_cache("kv", toks))
                s.identity(msg["model"])  # writes the digest memo
                s.flush()
            out[name] = _modes_below(d)
    finally:
        os.umask(old)
    return out


def op_clock(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """A directory whose entry ``msg["future"]`` was last used 10 years from now and
    ``msg["old"]`` 2 hours ago: what a scan reads, the LRU order, what ``gc --max-age 1h``
    removes, and whether ``kvstore gc --blob-age 0`` removes the orphan pack with a
    future mtime ``msg["orphan"]``."""
    from kvstore.budget import lru_order
    from kvstore.index import scan
    from kvstore.maintenance import gc
    from kvstore.store import open_disk
    disk = open_disk(Path(msg["dir"]))
    t0 = time.time()
    snap = scan(disk.index, full=False)
    t1 = time.time()
    used = {k.hex(): r.last_used for k, r in snap.entries.items() if r}
    order = [k.hex() for k, _ in lru_order((k, r) for k, r in snap.entries.items() if r)]
    removed = [r["key"] for r in gc(disk, max_age=3600, orphans=False).removed]
    disk.close()
    cli = op_cli(zoo, {"argv": ["gc", "--blob-age", "0", "--cache-dir", msg["dir"]]}, emit)
    return {"future_read": used.get(msg["future"]), "t0": t0, "t1": t1, "max_read": max(used.values()),
            "first": order[0], "last": order[-1], "removed": removed, "cli": cli,
            "orphan_left": os.path.lexists(msg["orphan"])}


def op_weights_populate(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """Insert tiny-llama caches of ``msg["prompts"]`` under the model copy ``msg["model"]``."""
    from kvstore import KVStore
    with KVStore(msg["dir"], chunk_tokens=CHUNK) as s:
        for toks in msg["prompts"]:
            s.insert(msg["model"], toks, zoo.prefill("llama", toks))
        s.flush()
        return {"disk_entries": s.stats().get("disk_entries")}


def op_weights_fetch(zoo: Zoo, msg: dict, emit: Emit) -> dict:
    """In a fresh process, fetch each prompt under the (now swapped) model copy: a hit
    must pass the oracle against a cold run of the weights now in the directory."""
    import mlx_lm

    from kvstore import KVStore
    from tools.testing import oracle
    res: dict[str, Any] = {"hits": 0, "misses": 0, "wrong": [], "escaped": []}
    model = None
    with KVStore(msg["dir"], chunk_tokens=CHUNK) as s:
        for toks in msg["prompts"]:
            f = s.fetch(msg["model"], toks)
            if f.cache is None or not f.n:
                res["misses"] += 1
                continue
            res["hits"] += 1
            model = model or mlx_lm.load(msg["model"])[0]
            prompt = list(toks[: f.n]) + [EXTRA_TOKEN]
            ref = oracle.cold_run(model, prompt, n_gen=N_GEN)
            r = oracle.check_restore(model, prompt, f.cache, f.n, n_gen=N_GEN, reference=ref)
            if not r.ok:
                res["wrong"].append({"n": f.n, "detail": r.detail})
    return res


# ======================================================================= parent half: processes

FETCH = r"""
import json, logging, resource, sys, time
a = json.loads(sys.argv[1])
from kvstore import KVStore, LRUPromptCache, StoreOpenError
from tools.harness.faults.synth import syn_identity
warn = []
class Keep(logging.Handler):
    def emit(self, r):
        warn.append(f"{r.levelname}: {r.getMessage()}"[:300])
lg = logging.getLogger("kvstore"); lg.addHandler(Keep(logging.WARNING)); lg.setLevel(logging.INFO)
def arg(name):
    return syn_identity(name[4:]) if name.startswith("syn-") else a["paths"][name]
out = {"warnings": warn}
try:
    s = KVStore(a["dir"], chunk_tokens=a["chunk"], max_entries=1000)
except StoreOpenError as e:
    out.update(open="refused", message=str(e))
    lru = LRUPromptCache(cache_dir=a["dir"], chunk_tokens=a["chunk"])
    out["lru"] = "memory_only" if lru.store.disk is None else "opened"
    lru.close()
    print(json.dumps(out)); sys.exit(0)
out["open"] = "opened" if s.disk is not None else "memory_only"
for name in sorted({m for m, _ in a["known"]}):
    s.identity(arg(name))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out["n"], out["seconds"] = [], []
for name, toks in a["known"]:
    t0 = time.time()
    out["n"].append(s.fetch(arg(name), toks).n)
    out["seconds"].append(round(time.time() - t0, 3))
out["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
st = s.stats()
out["stats"] = {k: st.get(k) for k in ("corrupt", "races", "warnings_suppressed", "hits_disk", "misses")}
s.close()
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("KVSTORE_DIR", None)
    return env


def _process(cmd: list[str], timeout: float) -> dict:
    """Run ``cmd`` with a time limit: exit code, output tails, seconds, ``hung``,
    ``signal`` (a process killed by one it did not expect)."""
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        return {"hung": True, "rc": None, "seconds": round(time.time() - t0, 1),
                "stderr": (e.stderr or b"")[-800:].decode(errors="replace") if isinstance(e.stderr, bytes) else ""}
    return {"hung": False, "rc": p.returncode, "signal": signame(p.returncode), "stdout": p.stdout[-4000:],
            "stderr": p.stderr[-1500:], "seconds": round(time.time() - t0, 2)}


def fetch_process(cache: Path, tpl: dict) -> dict:
    """Every template prompt fetched by a fresh process (its result, or what killed it)."""
    msg = {"dir": str(cache), "chunk": CHUNK, "known": tpl["known"], "paths": tpl["paths"]}
    r = _process([sys.executable, "-c", FETCH, json.dumps(msg)], 90)
    if r["rc"] == 0 and r["stdout"].strip():
        r.update(json.loads(r["stdout"].strip().splitlines()[-1]))
    return r


def read_commands(cli: Checker, cache: Path, key: str) -> list[dict]:
    """``ls``, ``ls --json``, ``stats``, ``inspect KEY`` and ``verify`` on ``cache``."""
    d = ["--cache-dir", str(cache)]
    reads = [["ls"], ["ls", "--json"], ["stats"], ["inspect", key, "--no-prompt"], ["verify"]]
    return [_in_worker(cli, a + d) for a in reads]


def write_commands(cli: Checker, cache: Path, real: bool) -> list[dict]:
    """``gc --missing-models --blob-age 0`` and ``verify --fix --blob-age 0`` (as real
    ``kvstore`` processes when ``real``), then the final ``verify``."""
    d = ["--cache-dir", str(cache)]
    writes = [["gc", "--missing-models", "--blob-age", "0"], ["verify", "--fix", "--blob-age", "0"]]
    out = [_real_cli(a + d) if real else _in_worker(cli, a + d) for a in writes]
    out.append(dict(_in_worker(cli, ["verify"] + d), final=True))
    return out


def _in_worker(cli: Checker, argv: list[str]) -> dict:
    r = cli.call({"op": "cli", "argv": argv}, timeout=BOUND)
    if r.get("crashed"):
        return {"argv": argv, "rc": None, "hung": bool(r.get("hang")), "signal": r.get("signal"),
                "stderr": r.get("stderr", "")[-800:]}
    return r


def _real_cli(argv: list[str]) -> dict:
    r = _process([sys.executable, "-m", "kvstore.cli", *argv], BOUND + 10)  # + the CLI's own start-up
    return dict(r, argv=argv)


# ======================================================================= parent half: judging


def _command_problems(t: Tally, cmds: list[dict], refuse: tuple[str, ...], ctx_info: dict) -> None:
    """Each command finished in time, by itself, without a traceback; a refused
    directory is refused by every command, naming the problem; otherwise the final
    ``verify`` (after ``verify --fix``) is clean."""
    for c in cmds:
        what = f"`kvstore {' '.join(c['argv'][:3])}`"
        if c.get("hung"):
            t.c["failed_cases"] += 1
            t.fail(f"{what} hung (over {BOUND:.0f} s)", **ctx_info)
        elif c.get("signal"):
            t.c["crashes"] += 1
            t.fail(f"{what} died by {c['signal']}", **ctx_info, stderr=c.get("stderr"))
        elif c.get("escaped") or "Traceback" in (c.get("stderr") or "") or c.get("rc") not in (0, 1):
            t.add_escaped([c.get("escaped") or {"where": what, "rc": c.get("rc"), "stderr": c.get("stderr")}],
                          **ctx_info)
        elif refuse and (c["rc"] != 1 or not all(w in c.get("stderr", "") for w in refuse)):
            t.c["failed_cases"] += 1
            t.fail(f"{what} did not refuse naming {refuse}", **ctx_info, rc=c["rc"], stderr=c.get("stderr"))
        elif c.get("final") and not refuse and c["rc"] != 0:
            t.c["verify_unclean"] += 1
            t.fail("verify after verify --fix is not clean", **ctx_info, stdout=c.get("stdout"))


def _fetch_problems(t: Tally, f: dict, tpl: dict, crafted: Crafted, ctx_info: dict) -> None:
    """The fetch process finished in time and by itself, each fetch within the bound,
    its memory within what the pack files could explain, warnings bounded; a refused
    directory was refused, and the LRUPromptCache drop-in ran memory-only with a warning."""
    if f.get("hung") or f.get("signal") or f.get("rc") != 0:
        if f.get("signal"):
            t.c["crashes"] += 1
        elif f.get("hung"):
            t.c["failed_cases"] += 1
        else:
            t.c["escaped_exceptions"] += 1
        t.fail("fetch process failed", **ctx_info, hung=f.get("hung"), signal=f.get("signal"),
               stderr=f.get("stderr"))
        return
    bad = []
    if crafted.refuse:
        if f.get("open") != "refused" or not all(w in f.get("message", "") for w in crafted.refuse):
            bad.append(f"not refused naming {crafted.refuse}: {f.get('open')} {f.get('message', '')[:200]}")
        if f.get("lru") != "memory_only" or not f.get("warnings"):
            bad.append(f"LRUPromptCache: {f.get('lru')}, warnings {f.get('warnings')}")
    else:
        if max(f.get("seconds") or [0]) > BOUND:
            bad.append(f"a fetch took {max(f['seconds'])} s")
        limit = 2 * tpl["pack_bytes"] + RSS_SLACK
        if f.get("rss_growth", 0) > limit:
            bad.append(f"fetching grew RSS by {f['rss_growth'] >> 20} MiB (limit {limit >> 20} MiB)")
        if len(f.get("warnings", [])) > 12:
            bad.append(f"{len(f['warnings'])} warnings (one per kind expected)")
    if bad:
        t.c["failed_cases"] += 1
        t.fail("fetch: " + "; ".join(bad), **ctx_info)


def _state_problems(t: Tally, before: dict, after: dict, foreign: list[str], ctx_info: dict) -> None:
    """Nothing outside the cache directory changed, and no foreign file inside."""
    changed = sorted(k for k in set(before) | set(after)
                     if (k.startswith("outside/") or k.startswith("models/") or k in foreign)
                     and before.get(k) != after.get(k))
    if changed:
        t.c["failed_cases"] += 1
        t.fail("a file kvstore did not write was changed, added or removed", **ctx_info, files=changed[:8])


def _world(case_dir: Path, tpl: dict) -> dict[str, str]:
    """``tree_state`` of the case dir (cache/ and outside/) and of the model directories
    the identities name (``models/<name>/...``)."""
    out = craft.tree_state(case_dir)
    for name, path in tpl["paths"].items():
        if not name.startswith("syn-"):
            out.update({f"models/{name}/{k}": v for k, v in craft.tree_state(Path(path)).items()})
    return out


# ======================================================================= parent half: trials


def _template(ctx: Ctx, base: Path) -> dict:
    """A populated directory (the corruption kind's template) and what the trials need
    to know of it: prompts, keys, model paths, segments and pack bytes."""
    from tools.testing.model_builds import model_path

    from ..synth import MODEL_NAMES
    d = base / "template"
    info = ctx.checker.call({"op": "build_template", "dir": str(d), "seed": ctx.seed * 17 + 5}, timeout=900)
    if "entries" not in info:
        raise RuntimeError(f"template build failed: {info}")
    info["dir"] = d
    info["known"] = [[e["model"], e["tokens"]] for e in info["entries"]]
    info["keys"] = {e["key"] for e in info["entries"]}
    info["paths"] = {m: (str(model_path(MODEL_NAMES[m])) if m in MODEL_NAMES else "")
                     for m in sorted({e["model"] for e in info["entries"]})}
    info["pack_bytes"] = sum(p.stat().st_size for p in craft.packs(d))
    return info


def _prepare(tpl: dict, case_dir: Path, case: Case, seed: int) -> Crafted:
    """A copy of the template at ``case_dir/cache``, someone's files at
    ``case_dir/outside``, then the case's setup (seeded: two copies come out alike)."""
    shutil.copytree(tpl["dir"], case_dir / "cache", symlinks=True)
    craft.user_files(case_dir / "outside" / "sentinel", [])
    return case.setup(case_dir, tpl, random.Random(seed))


def _dir_case(ctx: Ctx, t: Tally, cli: Checker, base: Path, tpl: dict, case: Case, i: int) -> None:
    """One hostile directory, twice: the commands and a fresh fetch on copy ``a``, the
    check on copy ``b``; then nothing outside either cache dir, nor any foreign file in
    it, may have changed."""
    work = base / f"case-{i:02d}"
    seed = ctx.seed * 1009 + i
    ca, cb = _prepare(tpl, work / "a", case, seed), _prepare(tpl, work / "b", case, seed)
    info = {"case": case.name, "damage": ca.desc}
    before = {x: _world(work / x, tpl) for x in "ab"}
    key = sorted(ca.targets)[0] if ca.targets else tpl["entries"][0]["key"]
    cmds = read_commands(cli, work / "a" / "cache", key)
    fetched = fetch_process(work / "a" / "cache", tpl)
    cmds += write_commands(cli, work / "a" / "cache", real=case.group == "planted")
    res = ctx.checker.call({"op": "check", "dir": str(work / "b" / "cache"), "known": tpl["known"],
                            "targets": sorted(cb.targets), "committed": sorted(tpl["keys"] - cb.targets),
                            "fix": True})
    _command_problems(t, cmds, ca.refuse, info)
    _fetch_problems(t, fetched, tpl, ca, info)
    t.add_check(res, **info)
    if ca.refuse and res.get("open") != "open_error":
        t.c["failed_cases"] += 1
        t.fail("the check opened a directory kvstore must refuse", **info, open=res.get("open"))
    for x, crafted in (("a", ca), ("b", cb)):
        _state_problems(t, before[x], _world(work / x, tpl), crafted.foreign, info)
    t.c["trials"] += 1
    t.outcomes[f"{case.group}:{'refused' if ca.refuse else 'served' if res.get('full') else 'degraded'}"] += 1
    ctx.debug(f"{case.name}: {ca.desc} -> open={res.get('open')} full={res.get('full')} verify={res.get('verify')} "
              f"fetch n={fetched.get('n')} rss={fetched.get('rss_growth')}")
    subprocess.run(["chmod", "-R", "u+rwX", str(work)], capture_output=True)
    shutil.rmtree(work, ignore_errors=True)


def _weights_trial(ctx: Ctx, t: Tally, base: Path) -> None:
    """tiny-llama's weights swapped (two k_proj tensors exchanged: same size) under the
    old mtime after a store filled up from them: a fresh process must miss, or restore
    what a cold run of the new weights gives; the model directory is never written."""
    from tools.testing.model_builds import model_path
    work = base / "weights"
    model, cache = work / "model", work / "cache"
    shutil.copytree(model_path("tiny-llama"), model)
    rng = random.Random(ctx.seed * 31 + 1)
    prompts = [random_prompt(rng, 40, 90) for _ in range(3)]
    ctx.checker.call({"op": "weights_populate", "dir": str(cache), "model": str(model), "prompts": prompts})
    craft.swap_tensors_keep_stat(model / "model.safetensors", "model.layers.0.self_attn.k_proj.weight",
                                 "model.layers.1.self_attn.k_proj.weight")
    before = craft.tree_state(model)
    fresh = Checker(ctx.logdir, "cli")
    try:
        res = fresh.call({"op": "weights_fetch", "dir": str(cache), "model": str(model), "prompts": prompts},
                         timeout=600)
    finally:
        fresh.close()
    t.c["trials"] += 1
    info = {"case": "weights swapped under the old mtime"}
    if res.get("crashed") or res.get("harness_error"):
        t.add_check(res, **info)
        return
    t.add_wrong(res["wrong"], **info)
    if craft.tree_state(model) != before:
        t.c["failed_cases"] += 1
        t.fail("the model directory was changed", **info)
    t.outcomes["weights:" + ("miss" if not res["hits"] else "hit_ok" if not res["wrong"] else "wrong")] += 1
    shutil.rmtree(work, ignore_errors=True)


MODEL_FIFOS = ("config.json", "model.safetensors", "tokenizer_config.json", "tokenizer.json",
               "chat_template.jinja", "custom.py")
FIFO_FETCH = r"""
import json, sys
from kvstore import KVStore
a = json.loads(sys.argv[1])
with KVStore(a["dir"], chunk_tokens=a["chunk"]) as s:
    got = [s.fetch(a["model"], p).n for p in a["prompts"]]
    print(json.dumps({"n": got, "memory_only": s.stats()["memory_only_reason"]}))
"""


def _model_fifo_trial(ctx: Ctx, t: Tally, base: Path) -> None:
    """A FIFO planted in a model directory kvstore reads (config, tokenizer, template,
    weights, custom ``model_file`` code) after a store was filled under it: every command
    reaching that directory (through an exported file's ``model`` metadata, ``--model``,
    the identity's recorded path, a fetch) finishes within its bound, by itself: a
    refusal, a miss or a store under the other model, never a wait on the FIFO."""
    from tools.testing.model_builds import model_path
    work = base / "model-fifo"
    model, cache = work / "model", work / "cache"
    shutil.copytree(model_path("tiny-llama"), model)
    rng = random.Random(ctx.seed * 37 + 5)
    prompts = [random_prompt(rng, 40, 90) for _ in range(2)]
    ctx.checker.call({"op": "weights_populate", "dir": str(cache), "model": str(model), "prompts": prompts})
    listed = _real_cli(["ls", "--json", "--cache-dir", str(cache)])
    try:
        key = json.loads(listed["stdout"])["identities"][0]["entries"][0]["key"]
    except (ValueError, KeyError, IndexError, TypeError):
        t.c["failed_cases"] += 1
        t.fail("model fifo: no entry to export", stderr=listed.get("stderr"))
        return
    exported = work / "entry.safetensors"
    made = _real_cli(["export", key, str(exported), "--cache-dir", str(cache)])
    names = MODEL_FIFOS if ctx.size["hostile_all"] else MODEL_FIFOS[:2]
    for name in names:
        t.c["trials"] += 1
        info = {"case": f"FIFO at {name} in the model directory"}
        target = model / name
        if name == "custom.py":
            cfg = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**cfg, "model_file": name}))
        saved = target.read_bytes() if target.is_file() else None
        target.unlink(missing_ok=True)
        os.mkfifo(target, 0o600)
        d2 = ["--cache-dir", str(work / f"import-{name}")]
        runs = {
            "import (metadata names it)": _process([sys.executable, "-m", "kvstore.cli", "import", str(exported),
                                                    "--model", str(model_path("tiny-llama")), *d2], 90),
            "import --model": _process([sys.executable, "-m", "kvstore.cli", "import", str(exported),
                                        "--model", str(model), *d2], 90),
            "inspect": _process([sys.executable, "-m", "kvstore.cli", "inspect", key, "--cache-dir", str(cache)], 90),
            "fetch": _process([sys.executable, "-c", FIFO_FETCH, json.dumps(
                {"dir": str(cache), "chunk": CHUNK, "model": str(model), "prompts": prompts})], 90),
        }
        if made.get("rc") != 0:
            runs.pop("import (metadata names it)")
            runs.pop("import --model")
        bad = {w: r for w, r in runs.items() if r.get("hung") or r.get("signal") or r.get("rc") not in (0, 1)
               or "Traceback" in (r.get("stderr") or "")}
        for w, r in bad.items():
            if r.get("signal"):
                t.c["crashes"] += 1
            elif r.get("hung"):
                t.c["failed_cases"] += 1
            else:
                t.c["escaped_exceptions"] += 1
            t.fail(f"model fifo: {w} {'hung' if r.get('hung') else 'failed'}", **info, rc=r.get("rc"),
                   signal=r.get("signal"), stderr=r.get("stderr"))
        t.outcomes["model_fifo:" + ("ok" if not bad else "failed")] += 1
        target.unlink()
        if saved is not None:
            target.write_bytes(saved)
        if name == "custom.py":
            shutil.copy(model_path("tiny-llama") / "config.json", model / "config.json")
    if made.get("rc") != 0:
        t.fail("model fifo: export failed, imports not tried", stderr=made.get("stderr"))
    shutil.rmtree(work, ignore_errors=True)


def _modes_trial(ctx: Ctx, t: Tally, cli: Checker, base: Path) -> None:
    """Under umask 022: every directory a private store creates is 0700 and every file
    0600; a shared one gives nothing to other users."""
    from tools.testing.model_builds import model_path
    d = base / "modes"
    d.mkdir()
    res = cli.call({"op": "modes", "dir": str(d), "model": str(model_path("tiny-llama"))})
    t.c["trials"] += 1
    if res.get("crashed") or res.get("harness_error"):
        t.add_check(res, case="modes")
        return
    bad = {p: m for p, m in res["private"].items() if m not in ("d700", "f600")}
    bad.update({f"shared:{p}": m for p, m in res["shared"].items() if int(m[1:], 8) & 0o007})
    if bad:
        t.c["failed_cases"] += 1
        t.fail("modes under umask 022", modes=dict(sorted(bad.items())[:10]))
    t.info["modes_private"] = dict(Counter(res["private"].values()))
    t.info["modes_shared"] = dict(Counter(res["shared"].values()))
    t.outcomes["modes:" + ("private" if not bad else "leaky")] += 1


def _skewed(cache: Path, rng: random.Random) -> tuple[str, str, Path]:
    """Every entry last used a minute ago but one two hours ago and one ten years from
    now (records written with lmdb), and an orphan pack with an mtime a year ahead."""
    from kvstore.files import pack_path
    now = time.time()
    entries = sorted((k, r) for k, r in craft.records(cache, "entries").items() if r is not None)
    (old, _), (future, _) = rng.sample(entries, 2)
    for k, r in entries:
        when = now - 7200 if k == old else now + 10 * 365 * 86400 if k == future else now - 60
        craft.put_raw(cache, "entries", k, replace(r, last_used=when).to_bytes())
    orphan = pack_path(cache / "blobs", os.urandom(16))
    orphan.parent.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(craft.packs(cache)[0], orphan)
    os.utime(orphan, (now + 365 * 86400, now + 365 * 86400))
    return old.hex(), future.hex(), orphan


def _clock_trial(ctx: Ctx, t: Tally, cli: Checker, base: Path, tpl: dict) -> None:
    """Clock skew: a last use in the future is read as now (never beyond), so it sorts
    last in LRU order and ``gc --max-age 1h`` keeps it while removing the entry used two
    hours ago; ``gc --blob-age 0`` removes an orphan pack whose mtime is in the future."""
    cache = base / "clock" / "cache"
    shutil.copytree(tpl["dir"], cache, symlinks=True)
    old, future, orphan = _skewed(cache, random.Random(ctx.seed * 13 + 2))
    r = cli.call({"op": "clock", "dir": str(cache), "old": old, "future": future, "orphan": str(orphan)})
    t.c["trials"] += 1
    if r.get("crashed") or r.get("harness_error"):
        t.add_check(r, case="clock skew")
        return
    bad = []
    if not (r["future_read"] is not None and r["t0"] - 1 <= r["future_read"] <= r["t1"] and r["max_read"] <= r["t1"]):
        bad.append(f"a future last_used read as {r['future_read']} (scan from {r['t0']} to {r['t1']})")
    if r["first"] != old or r["last"] != future:
        bad.append(f"LRU order: first {r['first'][:12]}, last {r['last'][:12]}")
    if r["removed"] != [old]:
        bad.append(f"gc --max-age 1h removed {[k[:12] for k in r['removed']]}, not the old entry only")
    if r["orphan_left"] or r["cli"].get("rc") != 0:
        bad.append(f"gc --blob-age 0 left the future-dated orphan (rc {r['cli'].get('rc')})")
    if bad:
        t.c["failed_cases"] += 1
        t.fail("clock skew: " + "; ".join(bad))
    res = ctx.checker.call({"op": "check", "dir": str(cache), "known": tpl["known"], "targets": [old],
                            "committed": sorted(tpl["keys"] - {old}), "fix": True})
    t.add_check(res, case="clock skew")
    t.outcomes["clock:" + ("ok" if not bad else "wrong")] += 1


# (name, setup of the cache dir, words the refusal names, accepted with shared_dir=True)
OWNER_CASES: list[tuple[str, Callable[[Path], None], tuple[str, ...], bool]] = [
    ("cache dir writable by its group", lambda d: os.chmod(d, 0o770), ("group", "chmod 700"), True),
    ("cache dir writable by everyone", lambda d: os.chmod(d, 0o777), ("every user", "chmod 700"), False),
    ("index/ writable by its group", lambda d: os.chmod(d / "index", 0o770), ("index", "group"), True),
    ("blobs/ writable by its group", lambda d: os.chmod(d / "blobs", 0o770), ("blobs", "group"), True),
    ("cache dir of another user", lambda d: os.chown(d, 65534, 65534), ("another user", "shared"), True),
]


def _owner_trial(ctx: Ctx, t: Tally, cli: Checker, base: Path, tpl: dict, i: int) -> None:
    """One foreign owner or mode: StoreOpenError naming the problem and its fix, a
    warning and memory-only serving (``on_disk_error="memory"`` and LRUPromptCache), the
    directory unchanged by those refusals, and ``shared_dir=True`` accepted where a group
    may share it."""
    name, setup, words, shared_ok = OWNER_CASES[i]
    d = base / f"owner-{i}" / "cache"
    shutil.copytree(tpl["dir"], d, symlinks=True)
    setup(d)
    before = craft.tree_state(d)
    r = cli.call({"op": "owner", "dir": str(d), "modes": ["raise", "memory", "lru"]})
    changed = craft.tree_state(d) != before
    r.update(cli.call({"op": "owner", "dir": str(d), "modes": ["shared"]}))
    t.c["trials"] += 1
    if r.get("crashed") or r.get("harness_error"):
        t.add_check(r, case=name)
        return
    bad = _owner_problems(r, words, shared_ok, str(d))
    if changed:
        bad.append("a refused open changed the directory")
    for m in ("raise", "memory", "lru", "shared"):
        t.add_escaped(r[m].get("escaped", []), case=name, mode=m)
    if bad:
        t.c["failed_cases"] += 1
        t.fail(f"owner / mode: {name}", problems=bad, message=r["raise"].get("message"))
    t.outcomes["owner:" + ("ok" if not bad else "wrong")] += 1
    t.info.setdefault("owner_messages", {})[name] = r["raise"].get("message")


def _owner_problems(r: dict, words: tuple[str, ...], shared_ok: bool, path: str) -> list[str]:
    """What the four opens of an owner trial did wrong (see ``_owner_trial``)."""
    bad = []
    msg = r["raise"].get("message") or ""
    if r["raise"].get("outcome") != "StoreOpenError" or not all(w in msg for w in words) or path not in msg:
        bad.append(f"raise: {r['raise'].get('outcome')} {msg[:200]!r} (must name {words} and the path)")
    for m in ("memory", "lru"):
        if r[m].get("outcome") != "memory_only" or not r[m].get("served") or not r[m].get("warned"):
            bad.append(f"{m}: {r[m].get('outcome')}, served={r[m].get('served')}, warned={r[m].get('warned')}")
    want = "opened" if shared_ok else "StoreOpenError"
    if r["shared"].get("outcome") != want or (shared_ok and not r["shared"].get("served")):
        bad.append(f"shared_dir=True: {r['shared'].get('outcome')} (expected {want})")
    return bad


def run_hostile(ctx: Ctx) -> dict:
    """The directory cases (all, or the CI subset), then swapped weights, modes, clock
    skew and, as root, foreign owners."""
    t = Tally("hostile")
    base = ctx.work / "hostile"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    tpl = _template(ctx, base)
    cli = Checker(ctx.logdir, "cli")
    cases = [c for c in DIR_CASES if ctx.size["hostile_all"] or c.ci]
    try:
        for i, case in enumerate(cases):
            _dir_case(ctx, t, cli, base, tpl, case, i)
            ctx.progress(t, i, len(cases))
        _weights_trial(ctx, t, base)
        _model_fifo_trial(ctx, t, base)
        _modes_trial(ctx, t, cli, base)
        _clock_trial(ctx, t, cli, base, tpl)
        if os.geteuid() == 0:
            for i in range(len(OWNER_CASES)):
                _owner_trial(ctx, t, cli, base, tpl, i)
        else:
            t.skipped.append("foreign owners and modes: need root (chown, and a chmod that root ignores)")
    finally:
        cli.close()
        subprocess.run(["chmod", "-R", "u+rwX", str(base)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)
    t.info["cases"] = [c.name for c in cases]
    t.info["template"] = {"entries": len(tpl["entries"]), "pack_bytes": tpl["pack_bytes"]}
    return t.result()

