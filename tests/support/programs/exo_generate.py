"""exo's calling pattern for its prefix cache, on the tiny models, without exo.

``request`` makes the calls exo's ``mlx_generate`` makes (exo b5375f8,
src/exo/worker/engines/mlx/generator/generate.py): ``get_kv_cache(model, all_prompt_tokens,
media_regions=...)``; prefill the remaining tokens but the last, which leaves the cache
holding all but the prompt's last two tokens and, for models with recurrent or rotating
layers, a snapshot of those layers after every prefill chunk; then ``update_kv_cache``
(a long enough hit on an entry) or ``add_kv_cache``; then decoding goes on extending the
same cache. ``exo_prefill`` reproduces exo's prefill effect on the cache: it runs two more
tokens past the prefilled ones and rolls them back (trims attention layers by two,
restores the other layers from the last snapshot), as exo's prefill does.

Run as ``python -m tests.support.programs.exo_generate JSON`` (see
``tests.support.children.run_module``): each job opens an ``ExoPrefixCache`` on a cache
directory with a shard and asks for prompts, checking every restored cache against a cold
prefill (``tools.testing.oracle``), and prints the results as JSON.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache

MIN_UPDATE = 16  # exo: max(1000, system prompt tokens); small for tiny prompts
UPDATE_RATIO = 0.5  # exo's _MIN_PREFIX_HIT_RATIO_TO_UPDATE


@dataclass
class Snapshot:
    """exo's ``CacheSnapshot``: per layer a copy of a non-trimmable layer (else None)."""

    states: list[Any]
    token_count: int


@dataclass
class Region:
    """exo's ``MediaRegion``."""

    content_hash: str
    start_pos: int
    end_pos: int


def non_trimmable(c: Any) -> bool:
    """exo's ``is_non_trimmable_cache_entry`` for the classes the tiny models use."""
    if isinstance(c, (ArraysCache, RotatingKVCache)):
        return True
    return isinstance(c, CacheList) and not c.is_trimmable()


def offset(cache: list[Any]) -> int:
    offs = [getattr(s, "offset", None) for c in cache for s in getattr(c, "caches", (c,))]
    return max((o for o in offs if isinstance(o, int)), default=0)


def _copy_rotating(c: RotatingKVCache) -> RotatingKVCache:
    """exo's snapshot of a rotating layer: its last ``max_size`` positions, in their own
    buffer exactly that long, write index at the end (the next write rotates in place)."""
    n = min(c.max_size, c.keys.shape[2])
    out = RotatingKVCache(max_size=c.max_size, keep=c.keep)
    out.keys, out.values = mx.array(c.keys[..., -n:, :]), mx.array(c.values[..., -n:, :])
    out.offset, out._idx = c.offset, n
    return out


def _snapshot(cache: list[Any]) -> Snapshot:
    states = [(_copy_rotating(c) if isinstance(c, RotatingKVCache) and c.keys is not None else copy.deepcopy(c))
              if non_trimmable(c) else None for c in cache]
    mx.eval([s.state for s in states if s is not None])
    return Snapshot(states, offset(cache))


def exo_prefill(model: Any, cache: list[Any], remaining: list[int], step: int) -> list[Snapshot]:
    """Leave ``cache`` holding all of ``remaining`` but its last two tokens, exo's way;
    the snapshots exo hands to the prefix cache (all but the last one taken)."""
    feed = remaining[:-2]
    stateful = any(non_trimmable(c) for c in cache)
    snaps: list[Snapshot] = [_snapshot(cache)] if stateful else []  # mlx-lm reports (0, total) first
    for s in range(0, len(feed), step):
        model(mx.array([feed[s : s + step]]), cache=cache)
        mx.eval([c.state for c in cache])
        if stateful:
            snaps.append(_snapshot(cache))
    for tok in remaining[-2:]:  # exo's stream_generate runs the last token and one more
        model(mx.array([[tok]]), cache=cache)
    if stateful:
        snaps.append(_snapshot(cache))
    for i, c in enumerate(cache):
        if stateful and non_trimmable(c):
            cache[i] = copy.deepcopy(snaps[-2].states[i])
        else:
            c.trim(2)
    mx.eval([c.state for c in cache])
    return snaps[:-1]


def request(pc: Any, model: Any, prompt: list[int], *, media: list[Region] | None = None, step: int = 32,
            kv: dict | None = None, reference: Any = None) -> dict[str, Any]:
    """One exo generation request's prefix-cache calls; what ``get_kv_cache`` returned (and
    the oracle's verdict on it when ``reference`` is a ``tools.testing.oracle`` cold run or True)."""
    from tools.testing import oracle

    kv = kv or {}
    all_tokens = mx.array(prompt)
    cache, remaining, index, exact = pc.get_kv_cache(model, all_tokens, media_regions=media)
    rest = [int(t) for t in remaining.tolist()]
    n = len(prompt) - len(rest)
    out: dict[str, Any] = {"n": n, "index": index, "exact": exact, "tail_ok": rest == prompt[n:]}
    if reference is not None and n > 0:
        res = oracle.check_restore(model, prompt, cache, n, n_gen=4, copy_cache=True,
                                   reference=None if reference is True else reference, **kv)
        out["oracle"], out["detail"] = res.ok, res.detail
    oracle.prefill(model, [], cache, **kv)  # exo's KV_CACHE_BITS: quantised layers
    snaps = exo_prefill(model, cache, rest, step)
    if index is not None and n >= MIN_UPDATE and n / len(prompt) >= UPDATE_RATIO:
        pc.update_kv_cache(index, all_tokens, cache, snaps or None, restore_pos=n, media_regions=media)
    else:
        pc.add_kv_cache(all_tokens, cache, snaps or None, media_regions=media)
    for tok in prompt[-2:] + [7, 11]:  # decoding goes on in the same cache objects
        model(mx.array([[tok]]), cache=cache)
        mx.eval([c.state for c in cache])
    return out


def main() -> None:
    import json
    import sys

    from kvstore.adapters.exo import ExoPrefixCache
    from tools.testing.model_builds import MODELS, load_model, model_path

    jobs = json.loads(sys.argv[1])
    out = []
    for job in jobs:
        model, _ = load_model(job["family"])
        spec = MODELS[job["family"]]
        kv = {"kv_bits": spec.kv_bits, "kv_group_size": spec.kv_group_size} if spec.kv_bits else {}
        pc = ExoPrefixCache(None, model_path=model_path(job["family"]), shard=job.get("shard"),
                            cache_dir=job["dir"], chunk_tokens=job.get("chunk", 64))
        res = []
        for q in job["queries"]:
            media = [Region(*r) for r in q.get("media", [])]
            res.append(request(pc, model, q["prompt"], media=media, kv=kv, reference=q.get("check") or None))
        res.append({"stats": {k: pc.store.stats()[k] for k in ("hits_memory", "hits_disk", "misses")}})
        pc.close()
        out.append(res)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
