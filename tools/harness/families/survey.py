"""The families survey: every model family of the installed mlx-lm, persisted through
kvstore and restored in a new process, compared with mlx-lm itself and a cold prefill.

Per family (``build``, in this process): a tiny seeded model from ``configs.tiny_config``
(weights ``tools.testing.model_builds.seeded_weights``, written to a model directory so kvstore derives a
real identity); a prompt ``P`` of ``N_PROMPT`` tokens; a cache of ``P[:N_PREFIX]``
prefilled in steps of ``STEP`` tokens (so chunked caches drop keys and sliding windows
wrap). That cache is saved with mlx-lm's own ``save_prompt_cache`` and inserted into a
kvstore directory; a second directory gets the cache of ``P[:N_PREFIX]`` followed by
``N_JUNK`` other tokens fed one at a time, as generation leaves a cache (a query for ``P``
must cut it back: for an attention chunk of 8 that cut lands inside the chunk of the first
key kept, the cut mlx-lm gets wrong).

Then ONE new process (``restore_all``) loads every family and, against references it
computes itself: mlx-lm's file (``load_prompt_cache``) and kvstore's prefix entry must give
bit-identical log-probs and tokens to the same cache rebuilt live (``tools.testing.oracle`` exact
mode: prefill ``P[:N_PREFIX]`` in the same steps, then the rest); kvstore's cut entry must
give the tokens of a cold prefill of ``P`` (tolerance mode) or be a miss (a refused cut),
never anything else. ``verdict`` sums a row up; a row is "wrong" when kvstore handed out a
cache that continues differently, or missed where mlx-lm's own round trip works.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import subprocess
import sys
import traceback
from typing import Any

N_PROMPT, N_PREFIX, N_JUNK, STEP, N_GEN, CHUNK_TOKENS = 48, 38, 8, 7, 8, 16
SEED = 1234


def prompt() -> list[int]:
    """The survey prompt: ``N_PROMPT`` seeded byte tokens (no special token)."""
    import random

    rng = random.Random(SEED)
    return [rng.randrange(3, 256) for _ in range(N_PROMPT)]


def junk() -> list[int]:
    """Tokens that continue ``P[:N_PREFIX]`` differently from ``P``."""
    p = prompt()
    return [(t + 7) % 253 + 3 for t in p[N_PREFIX : N_PREFIX + N_JUNK]]


def _why(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({pathlib.Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}{where}"


def load(family_dir: pathlib.Path) -> Any:
    """The family's model from its directory: its own ``Model(ModelArgs)`` with the saved
    weights (no ``sanitize``: the weights are in mlx-lm's layout already)."""
    import importlib

    import mlx.core as mx

    cfg = json.loads((family_dir / "config.json").read_text())
    mod = importlib.import_module(f"mlx_lm.models.{cfg['kvstore_family']}")
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.load_weights(str(family_dir / "model.safetensors"))
    mx.eval(model.parameters())
    return model


def cache_classes(cache: list[Any]) -> list[str]:
    """Class names of a prompt cache, CacheList members as ``CacheList(A,B)``."""
    out = []
    for c in cache:
        subs = getattr(c, "caches", None)
        out.append(f"{type(c).__name__}({','.join(cache_classes(list(subs)))})" if subs else type(c).__name__)
    return sorted(set(out))


def build(family: str, root: pathlib.Path) -> dict[str, Any]:
    """Make the family's model, caches, mlx-lm file and kvstore directories under
    ``root/family``; the row so far (``built`` False with ``why`` when it cannot)."""
    row: dict[str, Any] = {"family": family, "built": False}
    d = root / family
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    try:
        model = _make_model(family, d)
    except BaseException as e:  # noqa: BLE001 - any failure of a family is its row
        row["why"] = _why(e)
        return row
    try:
        _fill(row, model, d)
    except BaseException as e:  # noqa: BLE001
        row["why"] = "running it: " + _why(e)
    return row


def _make_model(family: str, d: pathlib.Path) -> Any:
    import mlx.core as mx

    from tools.harness.families.configs import tiny_config
    from tools.testing.model_builds import TINY_EMBED_STD, TINY_GAIN, seeded_weights

    cfg = tiny_config(family)
    embed_std = 64**-0.5 if "gemma" in family else TINY_EMBED_STD
    weights = seeded_weights(family, cfg, SEED, gain=TINY_GAIN, embed_std=embed_std)
    mx.save_safetensors(str(d / "model.safetensors"), {k: weights[k] for k in sorted(weights)}, {"format": "mlx"})
    (d / "config.json").write_text(json.dumps({**cfg, "kvstore_family": family, "kvstore_seed": SEED},
                                              sort_keys=True, default=str))
    return load(d)


def _fill(row: dict[str, Any], model: Any, d: pathlib.Path) -> None:
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    from kvstore import KVStore
    from tools.testing.oracle import prefill

    p = prompt()
    row["classes"] = cache_classes(make_prompt_cache(model))
    cache = prefill(model, p[:N_PREFIX], chunk=STEP)
    longer = prefill(model, p[:N_PREFIX], chunk=STEP)
    for t in junk():  # one at a time, as generated tokens are
        prefill(model, [t], longer)
    row["built"] = True
    try:
        save_prompt_cache(str(d / "mlx-cache.safetensors"), cache)
        row["mlx_save"] = "ok"
    except BaseException as e:  # noqa: BLE001
        row["mlx_save"] = _why(e)
    for sub, toks, c in (("kv-prefix", p[:N_PREFIX], cache), ("kv-cut", p[:N_PREFIX] + junk(), longer)):
        with KVStore(d / sub, chunk_tokens=CHUNK_TOKENS) as s:
            s.insert(str(d), toks, c)
            s.flush(120)
            st = s.stats()
        if sub == "kv-prefix":
            row["memory_only_reason"] = "; ".join((st.get("memory_only_reason") or {}).values()) or None
            row["persisted"] = bool(st.get("disk_entries"))


def _stage(family: str, stage: str) -> None:
    """Say what the restoring process is about to do: if it dies there, the parent knows
    whether kvstore was involved."""
    print(json.dumps({"family": family, "stage": stage}), flush=True)


def restore_one(family: str, d: pathlib.Path) -> dict[str, Any]:
    """In the restoring process: mlx-lm's round trip and kvstore's two entries, each
    continued greedily and compared (see the module docstring)."""
    from kvstore import KVStore
    from tools.testing.oracle import check_restore, cold_run

    _stage(family, "cold")  # the model alone, no kvstore
    model = load(d)
    p = prompt()
    live = cold_run(model, p, n_gen=N_GEN, split=N_PREFIX, chunk=STEP)  # the cache as it was made
    cold = cold_run(model, p, n_gen=N_GEN)
    _stage(family, "restore")
    out: dict[str, Any] = {"tokens": cold.tokens}
    if (d / "mlx-cache.safetensors").exists():
        out["mlx_roundtrip"] = _mlx_roundtrip(model, d, p, live)
    for sub in ("kv-prefix", "kv-cut"):
        with KVStore(d / sub, chunk_tokens=CHUNK_TOKENS) as s:
            plan = s.disk.plan(s.identity(str(d)), p) if s.disk is not None and s.identity(str(d)) else None
            f = s.fetch(str(d), p)
            res: dict[str, Any] = {"n": f.n, "chunked": plan.chunked if plan is not None else None}
            if f.cache is not None:
                exact = sub == "kv-prefix"
                r = check_restore(model, p, f.cache, f.n, n_gen=N_GEN, exact=exact, chunk=STEP if exact else None,
                                  reference=live if exact else cold)
                res.update(ok=bool(r.ok), same_tokens=bool(r.same_tokens), detail=r.detail)
            res["corrupt"] = s.stats()["corrupt"]
        out[sub] = res
    return out


def _mlx_roundtrip(model: Any, d: pathlib.Path, p: list[int], live: Any) -> str:
    from mlx_lm.models.cache import load_prompt_cache

    from tools.testing.oracle import check_restore

    try:
        cache = load_prompt_cache(str(d / "mlx-cache.safetensors"))
        r = check_restore(model, p, cache, N_PREFIX, n_gen=N_GEN, exact=True, chunk=STEP, reference=live)
    except BaseException as e:  # noqa: BLE001
        return "load failed: " + _why(e)
    return "identical" if r.ok else ("same tokens, not bit-identical" if r.same_tokens else "different")


def restore_all(root: pathlib.Path, families: list[str]) -> None:
    """``restore_one`` for each family, in this process (the new one): one JSON line per
    family on stdout, flushed, so a crash loses only the family it happened in."""
    for fam in families:
        try:
            res = restore_one(fam, root / fam)
        except BaseException as e:  # noqa: BLE001
            res = {"error": _why(e)}
        print(json.dumps({"family": fam, "result": res}), flush=True)


def _restore_in_children(root: pathlib.Path, families: list[str], python: str) -> dict[str, Any]:
    """Run ``restore_all`` in new processes until every family has a result: a process
    that dies (a family crashing the interpreter) blames the family it was on, and a
    new process takes the rest."""
    out: dict[str, Any] = {}
    stage: dict[str, str] = {}
    todo = list(families)
    while todo:
        proc = subprocess.run([python, "-m", "tools.harness.families.survey", str(root), json.dumps(todo)],
                              capture_output=True, text=True, timeout=3600)
        for line in proc.stdout.splitlines():
            try:
                got = json.loads(line)
                if "stage" in got:
                    stage[got["family"]] = got["stage"]
                else:
                    out[got["family"]] = got["result"]
            except (ValueError, KeyError, TypeError):
                continue
        todo = [f for f in todo if f not in out]
        if todo:
            fam = todo.pop(0)
            out[fam] = {"error": f"the restoring process died ({proc.returncode}): {proc.stderr.strip()[-200:]}",
                        "stage": stage.get(fam, "cold")}
    return out


def verdict(row: dict[str, Any]) -> str:
    """One word for a row: "not built", "not runnable" (the model alone fails in a new
    process), "identical" (kvstore restores its prefix entry
    bit-identically and cuts only where the result equals a cold prefill), "memory only"
    (kvstore refused to persist it, with a reason), or "WRONG: ..." (a restored cache that
    continues differently, a miss where mlx-lm round-trips, a damaged-entry drop)."""
    if not row.get("built"):
        return "not built"
    r = row.get("restore") or {}
    if "error" in r and r.get("stage") == "cold":
        return "not runnable: a cold prefill of the model alone (no kvstore) failed: " + r["error"]
    if "error" in r:
        return "WRONG: restore crashed: " + r["error"]
    pre, cut = r.get("kv-prefix", {}), r.get("kv-cut", {})
    bad = [f"{k} {v['detail']}" for k, v in (("prefix", pre), ("cut", cut)) if v.get("ok") is False]
    bad += [f"{k} dropped as damaged" for k, v in (("prefix", pre), ("cut", cut)) if v.get("corrupt")]
    if bad:
        return "WRONG: " + "; ".join(bad)
    if not row.get("persisted"):
        if r.get("mlx_roundtrip") == "identical":
            return "WRONG: memory only, but mlx-lm round-trips it"
        return "memory only"
    if pre.get("ok") is not True:
        return "WRONG: persisted but not restored"
    return "identical"


def run(families: list[str], root: pathlib.Path, *, python: str = sys.executable) -> list[dict[str, Any]]:
    """Build every family here, restore them all in one new process; the rows."""
    quiet = logging.getLogger("kvstore")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the survey's own process only: restored below (a test runs it in-process)
    try:
        rows = [build(f, root) for f in families]
    finally:
        quiet.setLevel(level)
    built = [r["family"] for r in rows if r["built"]]
    restored = _restore_in_children(root, built, python)
    for r in rows:
        if r["built"]:
            r["restore"] = restored[r["family"]]
        r["verdict"] = verdict(r)
    return rows


if __name__ == "__main__":  # the restoring process
    import os

    logging.getLogger("kvstore").setLevel(logging.ERROR)
    restore_all(pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]))
    os._exit(0)  # some families' modules crash the interpreter's exit (seen: a segfault); the answer is out
