"""kvstore as exo's prefix cache (``exo.worker.engines.mlx.cache.KVPrefixCache``).

exo keeps each node's prompt caches in memory only, so a restarted node prefills every
conversation again. ``ExoPrefixCache`` has the methods, arguments and returns exo's runner
uses (exo at b5375f8: ``get_kv_cache``, ``add_kv_cache``, ``update_kv_cache``, ``clear``,
``prefill_tps[index]``, ``get_memory_used_percentage``) over a ``KVStore``: entries live in
kvstore's memory tier (fresh cache objects on every hit, no deep copy) and are written
behind to its disk tier, where a restarted node finds them.

What exo's cache does, this one does too:
- a hit leaves at least one prompt token to run (exo's generation needs one); a cache that
  holds the whole prompt is trimmed by one, or, when it cannot be trimmed (recurrent or
  rotating layers), the nearest stored position before it is restored;
- models with recurrent / rotating layers restore to the nearest snapshot at or before the
  match: every ``CacheSnapshot`` exo hands over (the recurrent layers' state at a chunk
  boundary) is stored as a whole cache at its position (attention layers trimmed there);
- media: the token key of a prompt carries each media region's content hash (``media_key``),
  so a region whose image differs cuts the match at the region's start, and nothing past an
  image is ever reused for another image;
- exo's eviction: when memory use is above exo's threshold (``EXO_MEMORY_THRESHOLD``, the
  maximum over the node group) the least recently used entries leave memory (not the disk).

An entry's identity is the model directory's (weights, config, tokenizer, cache layout,
code) plus the node's shard (``shard_components``): the layer range, the sharding kind,
the device rank and world size. A node never restores another shard's KV; a restarted
node with the same shard finds its own. With a group, every node restores the same number
of tokens (``_agree``), as exo's pipeline needs.

Usage (exo is not on PyPI; see docs/adapters.md, exo)::

    from kvstore.adapters import exo as kv_exo

    if __name__ == "__main__":  # exo spawns its runners: each imports this file again
        kv_exo.install(cache_dir="~/.cache/kvstore")  # in exo's main process, before it starts
        from exo.main import main
        main()                                         # runners (spawned) install it themselves

``ExoPrefixCache(group, model_path=..., shard=...)`` can also be built directly; without a
``model_path`` it runs memory-only (no identity for the disk), and says so once in the log
and in ``stats()["memory_only_reason"]``: built outside ``install()``, or by an exo whose
builder the patch does not reach, every prompt is prefilled again after a restart. exo's own prefix-cache tests
(at b5375f8) pass against this class, with hits from memory and from disk.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import gc
import os
from pathlib import Path
from typing import Any, Sequence, cast

import mlx.core as mx
import numpy as np
import xxhash

from .. import codec
from ..identity import Identity, model_identity
from ..options import EXO, StoreOptions
from ..salt import check_salt, salted
from ..store import KVStore
from ..escape import logger

log = logger("kvstore")

MEDIA_BIT = 1 << 31  # key ids of media positions: no tokenizer's vocabulary reaches 2**31
_EXO_CACHE = "exo.worker.engines.mlx.cache"
_BUILDER = "exo.worker.engines.mlx.builder"
INSTALL_HINT = ("exo is not on PyPI: install it from its git repository, "
                "git clone https://github.com/exo-explore/exo && cd exo && uv sync "
                "(or pip install -e . in a Python 3.13 environment); see docs/adapters.md, exo")
NO_MODEL_PATH = ("ExoPrefixCache was built without a model path (outside kvstore.adapters.exo.install(), or by "
                 "an exo version whose builder the patch misses): no identity, nothing reaches disk, and after a "
                 "restart every prompt is prefilled again")
# What ``install`` hands to caches built while exo's builder runs: options, model, shard.
_BUILD: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("kvstore_exo", default=None)


def media_key(tokens: Sequence[int], regions: Sequence[Any] | None) -> np.ndarray:
    """The key a prompt is stored under: its token ids, with every position of a media
    region (exo's ``MediaRegion``: ``content_hash``, ``start_pos``, ``end_pos``) replaced
    by an id at or above 2**31 drawn from the region's content hash and the position in
    it. Prompts that differ only by an image share their key up to that region's start and
    nothing after it; a region without a hash gets ids no other prompt has."""
    key = np.asarray([int(t) for t in tokens], dtype=np.int64)
    for r in regions or ():
        lo, hi = max(0, int(r.start_pos)), min(len(key), int(r.end_pos))
        seed = (r.content_hash or os.urandom(16).hex()).encode()
        for p in range(lo, hi):
            key[p] = MEDIA_BIT | (xxhash.xxh3_64_intdigest(b"%d:" % (p - lo) + seed) & (MEDIA_BIT - 1))
    return key


def shard_components(shard: Any) -> dict[str, Any] | None:
    """What makes one exo node's KV differ from another's for the same model weights: the
    shard kind (its metadata class: a pipeline shard holds whole layers, a tensor shard a
    slice of every layer's heads), the model id, the layer range ``[start_layer,
    end_layer)`` of ``n_layers``, the device rank and world size (and a CFG shard's
    branch). ``shard``: exo's ``ShardMetadata`` or a dict of those fields; None: unsharded."""
    if shard is None:
        return None
    get = shard.get if isinstance(shard, dict) else (lambda k: getattr(shard, k, None))
    card = get("model_card")
    out: dict[str, Any] = {
        "kind": get("kind") or type(shard).__name__,
        "model_id": str(get("model_id") or getattr(card, "model_id", "") or ""),
    }
    for k in ("start_layer", "end_layer", "n_layers", "device_rank", "world_size",
              "cfg_rank", "cfg_world_size", "pipeline_rank", "pipeline_world_size"):
        v = get(k)
        if v is not None:
            out[k] = int(v)
    return out


def exo_identity(model_path: str | Path, shard: Any, cache: list[Any], memo: Any = None) -> Identity:
    """The identity of one exo node's caches: the model directory's components, with the
    layout of the cache this node builds (its layers only) and ``shard_components``."""
    layout = codec.encode_cache(cache)[1].signature()
    base = model_identity(model_path, layout=layout, memo=memo)
    comps = {k: v for k, v in base.info["components"].items() if k != "format"}
    comps["shard"] = shard_components(shard)
    s = comps["shard"] or {}
    where = s and f"layers {s.get('start_layer', '?')}-{s.get('end_layer', '?')} of {s.get('n_layers', '?')}"
    # no "path": the store's vocabulary check would refuse media key ids
    return Identity.from_components(
        comps, name=f"{base.name} [{where}]" if where else base.name, model_dir=str(Path(model_path).resolve()),
        model_type=base.info.get("model_type"), shard=comps["shard"], versions=base.info.get("versions"))


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _exo(name: str) -> Any:
    """exo's module ``name``, or None when exo is not importable."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _pressure() -> float:
    """This machine's memory use (0..1) as exo measures it (exo's function when importable,
    so what patches it applies here too), else psutil's; 0 without either."""
    mod = _exo(_EXO_CACHE)
    if mod is not None:
        return float(mod.get_memory_used_percentage())
    try:
        import psutil
    except ImportError:
        return 0.0
    return float(psutil.virtual_memory().percent / 100)


def memory_threshold() -> float:
    """exo's eviction threshold: exo's own value when importable, else
    ``$EXO_MEMORY_THRESHOLD``, else exo's default by machine size (0.70 below 32 GB ...
    0.85 from 128 GB)."""
    mod = _exo(_EXO_CACHE)
    if mod is not None and hasattr(mod, "_MEMORY_THRESHOLD"):
        return float(mod._MEMORY_THRESHOLD)
    if os.environ.get("EXO_MEMORY_THRESHOLD"):
        return float(os.environ["EXO_MEMORY_THRESHOLD"])
    try:
        import psutil
        gb = psutil.virtual_memory().total / 2**30
    except ImportError:
        gb = 0
    return next((t for size, t in ((128, 0.85), (64, 0.80), (32, 0.75)) if gb >= size), 0.70)


def make_kv_cache(model: Any) -> list[Any]:
    """A fresh cache for ``model``, built as exo builds it (exo's ``make_kv_cache`` when
    importable, else mlx-lm's ``make_prompt_cache``)."""
    mod = _exo(_EXO_CACHE)
    if mod is not None:
        return mod.make_kv_cache(model)
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def _ids(tokens: Any) -> list[int]:
    return np.asarray(tokens).reshape(-1).astype(np.int64).tolist()


def _fresh_layer(layer: Any, trim: int) -> Any:
    """A copy of one trimmable layer sharing no mutable state, ``trim`` positions shorter."""
    out = codec.decode_layer(*codec.encode_layer(layer))
    if trim:
        out.trim(trim)
    return out


def compose(cache: list[Any], held: int, snapshot: Any) -> list[Any] | None:
    """The whole cache at ``snapshot.token_count``: the snapshot's states where it has them
    (recurrent / rotating layers), the other layers trimmed back to its position; None when
    a layer can be neither (nothing is stored for that snapshot then)."""
    t = int(snapshot.token_count)
    states = list(snapshot.states)
    out = []
    try:
        for i, layer in enumerate(cache):
            state = states[i] if i < len(states) else None
            if state is not None:
                out.append(state)
            elif layer.is_trimmable():
                out.append(_fresh_layer(layer, held - t))
            else:
                return None
    except codec.Unsupported:
        return None
    return out


class ExoPrefixCache:
    """exo's ``KVPrefixCache`` over a ``KVStore`` (memory tier, then disk).

    Entries are indexed as exo's are (``prompts``, ``prefill_tps``, ``_media_regions``,
    ``_last_used`` are parallel lists; ``get_kv_cache`` returns an index into them). Each
    entry owns the store entries it wrote: its cache at the length it holds and one per
    snapshot; ``clear`` and eviction take those out of memory, never off the disk.
    The store's settings: ``options`` (default: ``install``'s, else ``options.EXO``) with
    ``store_keywords`` (``cache_dir``, ``max_disk_bytes``, ``chunk_tokens``, ...); memory only
    without a model path.
    ``salt``: this cache's entries are filed under the salted identity (``kvstore.salt``):
    shared only with caches of the same salt, in every tier.
    """

    def __init__(self, group: Any = None, *, model_path: str | Path | None = None, shard: Any = None,
                 store: KVStore | None = None, threshold: float | None = None, salt: str | bytes | None = None,
                 options: StoreOptions | None = None, **store_keywords: Any) -> None:
        ctx = _BUILD.get() or {}
        self.salt = check_salt(salt if salt is not None else ctx.get("salt"), "salt")
        self._group = group
        self.model_path = model_path if model_path is not None else ctx.get("model_path")
        self.shard = shard if shard is not None else ctx.get("shard")
        self.threshold = threshold if threshold is not None else ctx.get("threshold")
        opts = (options or ctx.get("store") or EXO).but(**store_keywords)  # TypeError naming no option
        self.store = store or KVStore(options=opts.but(memory_only=True) if self.model_path is None else opts)
        if self.model_path is None:
            self.store.note_memory_only("exo", NO_MODEL_PATH)
        self._ident: Identity | None = None
        self.prompts: list[mx.array] = []
        self.prefill_tps: list[float] = []
        self._media_regions: list[list[Any]] = []
        self._last_used: list[float] = []
        self._keys: list[np.ndarray] = []
        self._owned: list[set[int]] = []  # lengths of the store entries each entry wrote
        self._access_counter = 0

    # -- exo's interface ---------------------------------------------------------------

    @property
    def caches(self) -> list[list[Any] | None]:
        """Each entry's cache as stored (fresh objects; None if it left memory)."""
        out = []
        for key, owned in zip(self._keys, self._owned):
            snap = self.store.memory.get(self._ident.digest, key[: max(owned)].tolist()) \
                if self._ident is not None and owned else None
            out.append(snap.materialize() if snap is not None else None)
        return out

    def clear(self) -> None:
        """Forget every entry (they leave memory; what is on disk stays)."""
        keys, owned = self._keys, self._owned
        self._keys, self._owned = [], []
        for lst in (self.prompts, self.prefill_tps, self._media_regions, self._last_used):
            lst.clear()
        for key, lengths in zip(keys, owned):
            self._release(key, lengths)

    def add_kv_cache(self, prompt_tokens: mx.array, cache: list[Any], ssm_snapshots: list[Any] | None = None,
                     media_regions: list[Any] | None = None, prefill_tps: float = 0.0) -> None:
        """Keep ``cache`` (and its snapshots) for ``prompt_tokens``; evicts first, as exo does."""
        self._evict_if_needed()
        key = media_key(_ids(prompt_tokens), media_regions)
        owned = self._store_entry(key, cache, ssm_snapshots)
        self.prompts.append(prompt_tokens)
        self._keys.append(key)
        self._owned.append(owned)
        self._media_regions.append(list(media_regions or []))
        self.prefill_tps.append(prefill_tps)
        self._access_counter += 1
        self._last_used.append(self._access_counter)

    def update_kv_cache(self, index: int, prompt_tokens: mx.array, cache: list[Any], snapshots: list[Any] | None,
                        restore_pos: int, media_regions: list[Any] | None = None,
                        prefill_tps: float = 0.0) -> None:
        """Replace entry ``index`` (exo: a conversation that grew); its snapshots at or
        before ``restore_pos`` stay, the rest of the old entry leaves memory."""
        key = media_key(_ids(prompt_tokens), media_regions)
        owned = self._store_entry(key, cache, snapshots)
        old_key, old = self._keys[index], self._owned[index]
        kept = {t for t in old if t <= restore_pos and _common(old_key, key) >= t}
        self.prompts[index] = prompt_tokens
        self._keys[index] = key
        self._owned[index] = owned | kept
        self._media_regions[index] = list(media_regions or [])
        self.prefill_tps[index] = prefill_tps
        self._access_counter += 1
        self._last_used[index] = self._access_counter
        self._release(old_key, old - kept)

    def get_kv_cache(self, model: Any, prompt_tokens: mx.array,
                     media_regions: list[Any] | None = None) -> tuple[list[Any], mx.array, int | None, bool]:
        """(cache, tokens still to prefill, matched entry index or None, exact): the longest
        reusable prefix in memory or on disk, at least one token left to run."""
        key = media_key(_ids(prompt_tokens), media_regions)
        fresh = make_kv_cache(model)
        ident = self._identity(fresh)
        cache, n = self._fetch(ident, key)
        cache, n = self._agree(ident, key, cache, n)
        if cache is None:
            return fresh, prompt_tokens, None, False
        index, exact = self._match(key, n)
        if index is not None:
            self._access_counter += 1
            self._last_used[index] = self._access_counter
        return cache, prompt_tokens[n:], index, exact

    def get_memory_used_percentage(self) -> float:
        """Memory use as exo's eviction sees it: the maximum over the node group."""
        local = _pressure()
        if self._group is None:
            return local
        got = mx.distributed.all_gather(mx.array([local], dtype=mx.float32), group=self._group)
        return float(cast(float, mx.max(got).item()))  # a float32 scalar (mlx types item() as any scalar)

    def _evict_if_needed(self) -> None:
        """exo's rule: while memory use is above the threshold, the least recently used
        entry leaves memory (it stays on disk)."""
        evicted = False
        limit = self.threshold if self.threshold is not None else memory_threshold()
        while self.prompts and self.get_memory_used_percentage() > limit:
            self._drop(self._last_used.index(min(self._last_used)))
            evicted = True
        if evicted:
            gc.collect()
            mx.clear_cache()

    def prepare(self, model: Any) -> None:
        """Derive this node's identity now (the first time hashes the model's weight files),
        so the first request does not wait for it; ``install`` calls it when exo builds."""
        self._identity(make_kv_cache(model))

    def stats(self) -> dict[str, Any]:
        """The store's counters; ``memory_only_reason`` says why this node's caches are
        kept in memory only, when they are."""
        return self.store.stats()

    def close(self) -> None:
        """Flush pending disk writes and release the index (exo never calls it; the store
        also flushes at interpreter exit)."""
        self.store.close()

    # -- internals ---------------------------------------------------------------------

    def _identity(self, cache: list[Any]) -> Identity:
        """This node's identity, derived once from the first cache seen (its layout is the
        same for every cache of this node); memory-only without a model directory."""
        if self._ident is None:
            ident, why = None, None
            if self.model_path is not None:
                try:
                    ident = exo_identity(self.model_path, self.shard, cache, self.store.memo)
                except Exception as e:  # an unusable model dir costs the disk tier, never a request
                    why = f"no identity for exo model {self.model_path} ({e})"
            if ident is None:  # a throwaway identity, in a store that never writes to disk
                ident = Identity.from_components({"exo-memory-only": os.urandom(16).hex()}, name="exo (memory only)")
                if self.store.disk is not None:
                    self.store.close()
                    self.store = KVStore(memory_only=True, max_entries=self.store.memory.max_entries,
                                         max_bytes=self.store.memory.max_bytes)
                if why is not None:
                    self.store.note_memory_only("exo", why)
            self._ident = salted(ident, self.salt) or ident
            self.store.register(self._ident.digest, self._ident)
        return self._ident

    def _insert(self, ident: Identity, tokens: np.ndarray, cache: list[Any]) -> bool:
        """Store one cache. exo goes on extending its own cache objects, and writes some
        in place (``RotatingKVCache`` assigns into its buffer, which changes that array
        object): the store gets new objects over views of the arrays (no copy), or a
        deep copy of what kvstore cannot encode. False (logged) when the store refuses it."""
        try:
            cache = codec.decode_cache(*codec.encode_cache(cache))
        except codec.Unsupported:
            cache = copy.deepcopy(cache)
        try:
            self.store.insert(ident, tokens.tolist(), cache)
        except ValueError as e:  # exo must go on generating: a refused entry is a future miss
            log.warning("kvstore: exo cache not kept (%s)", e)
            return False
        return True

    def _store_entry(self, key: np.ndarray, cache: list[Any], snapshots: list[Any] | None) -> set[int]:
        """Store ``cache`` at the length it holds and each snapshot at its position; the
        lengths stored."""
        ident = self._identity(cache)
        held = codec.held(cache)
        owned: set[int] = set()
        if held is None or held <= 0 or held > len(key):
            return owned
        if self._insert(ident, key[:held], cache):
            owned.add(held)
        for snap in snapshots or ():
            t = int(snap.token_count)
            whole = compose(cache, held, snap) if 0 < t < held else None
            if whole is not None and self._insert(ident, key[:t], whole):
                owned.add(t)
        return owned

    def _fetch(self, ident: Identity, key: np.ndarray) -> tuple[list[Any] | None, int]:
        """The store's longest prefix of ``key``, leaving at least one token to run."""
        tokens = key.tolist()
        got = self.store.fetch(ident, tokens)
        cache, n = got.cache, got.n
        if cache is not None and n >= len(tokens):
            if codec.trimmable(cache):
                for c in cache:
                    c.trim(n - len(tokens) + 1)
                n = len(tokens) - 1
            else:
                got = self.store.fetch(ident, tokens[:-1])
                cache, n = got.cache, got.n
        return (cache, n) if cache is not None and n > 0 else (None, 0)

    def _agree(self, ident: Identity, key: np.ndarray, cache: list[Any] | None,
               n: int) -> tuple[list[Any] | None, int]:
        """With a node group, every node restores the same number of tokens: the ones
        above the group's minimum go back to it (trim, or their nearest stored position),
        until all agree. Every node makes the same number of rounds."""
        if self._group is None or self._group.size() < 2:
            return cache, n
        while True:
            ns = cast(list[int], mx.distributed.all_gather(mx.array([n], dtype=mx.int32), group=self._group).tolist())
            low = min(ns)
            if low == max(ns):
                return cache, n
            if n > low:
                if cache is not None and low > 0 and codec.trimmable(cache):
                    for c in cache:
                        c.trim(n - low)
                    n = low
                else:
                    cache, n = self._fetch(ident, key[: low + 1]) if low > 0 else (None, 0)

    def _match(self, key: np.ndarray, n: int) -> tuple[int | None, bool]:
        """(index, exact) of the entry a hit of ``n`` tokens belongs to, exo's way (the
        longest common prefix; exact when it covers all but at most one token). A hit no
        entry covers (from disk) has no index: exo then adds the request as a new entry,
        and the restored copy leaves memory, so memory holds only what entries own."""
        best, length = -1, 0
        for i, k in enumerate(self._keys):
            m = _common(key, k)
            if m > length:
                best, length = i, m
            if m >= len(key) - 1:
                break
        if best < 0 or length < n:
            self._release(key, {n})
            return None, False
        self._owned[best].add(n)  # a disk hit promoted under this entry's prefix
        return best, length >= len(key) - 1

    def _drop(self, index: int) -> None:
        """Remove entry ``index`` and take what only it used out of memory."""
        key, owned = self._keys.pop(index), self._owned.pop(index)
        for lst in (self.prompts, self.prefill_tps, self._media_regions, self._last_used):
            lst.pop(index)
        self._release(key, owned)

    def _release(self, key: np.ndarray, lengths: set[int]) -> None:
        """Take the store entries ``key[:t]`` (t in ``lengths``) out of memory, except those
        another entry owns."""
        if self._ident is None:
            return
        for t in lengths:
            if not any(t in o and _common(key, k) >= t for k, o in zip(self._keys, self._owned)):
                self.store.discard(self._ident, key[:t].tolist())


# -- install -------------------------------------------------------------------------------


_ORIGINALS_ATTR = "_kvstore_originals"


def install(*, threshold: float | None = None, options: StoreOptions | None = None, **store_keywords: Any) -> None:
    """Make exo's runner build ``ExoPrefixCache`` instead of its ``KVPrefixCache``.

    Patches exo's ``MlxBuilder``: ``load`` remembers the node's bound instance, and
    ``build`` constructs the prefix cache with the node's model directory and shard, so
    every runner built from now on uses kvstore: in this process, and in the runner
    processes exo's supervisor spawns (their entry point installs the adapter first).
    Calling again updates the options. ``options`` / ``store_keywords``: the store's
    settings (default ``options.EXO``; TypeError naming a keyword that is none). Raises
    ModuleNotFoundError saying how to get exo when it is not importable.
    """
    store = (options or EXO).but(**store_keywords)
    builder = _builder_module()
    cls = builder.MlxBuilder
    settings = {"threshold": threshold, "store": store}
    if _ORIGINALS_ATTR not in cls.__dict__:
        _patch(builder, cls)
    cls._kvstore_options = settings
    supervisor = _exo("exo.worker.runner.supervisor")
    if supervisor is not None:  # exo spawns runners: a fresh interpreter, nothing patched
        target = getattr(supervisor.entrypoint, "args", (None, None))[1] or supervisor.entrypoint
        supervisor.entrypoint = functools.partial(runner_entrypoint, settings, target)


def runner_entrypoint(settings: dict[str, Any], target: Any, *args: Any, **kwargs: Any) -> Any:
    """A spawned runner's entry point: ``install`` with ``settings`` (``install``'s: the
    threshold and the store's options), then exo's ``target``."""
    install(threshold=settings["threshold"], options=settings["store"])
    return target(*args, **kwargs)


def uninstall() -> None:
    """Undo ``install``: runners built afterwards use exo's own ``KVPrefixCache`` again."""
    builder = _builder_module()
    cls = builder.MlxBuilder
    originals = cls.__dict__.get(_ORIGINALS_ATTR)
    if originals is None:
        return
    for name in ("load", "build"):
        setattr(cls, name, originals[name])
    builder.KVPrefixCache = originals["KVPrefixCache"]
    delattr(cls, _ORIGINALS_ATTR)
    supervisor = _exo("exo.worker.runner.supervisor")
    if supervisor is not None and isinstance(supervisor.entrypoint, functools.partial):
        supervisor.entrypoint = supervisor.entrypoint.args[1]


def _builder_module() -> Any:
    """exo's builder module; a ModuleNotFoundError naming how to get exo (or the module
    exo lacks) when it cannot be imported."""
    import importlib

    try:
        return importlib.import_module(_BUILDER)
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "exo":
            raise ModuleNotFoundError(f"kvstore.adapters.exo needs exo, which is not installed: {INSTALL_HINT}",
                                      name=e.name) from None
        raise ModuleNotFoundError(f"exo is installed but cannot be imported: the module {e.name!r} it "
                                  f"imports is missing ({INSTALL_HINT})", name=e.name) from e


def node_context(bound_instance: Any, options: dict[str, Any]) -> dict[str, Any]:
    """What a node's cache is built with: ``options`` plus the model directory exo loads
    the bound shard from and the shard itself."""
    shard = bound_instance.bound_shard
    download = _exo("exo.download.download_utils")
    path = download.build_model_path(shard.model_card.model_id) if download is not None else None
    return dict(options, model_path=path, shard=shard)


def _patch(builder: Any, cls: Any) -> None:  # exo's runner class: untyped here, its methods are replaced
    load, build = cls.load, cls.build

    @functools.wraps(load)
    def _load(self: Any, bound_instance: Any) -> Any:  # exo's load is a generator: returned as is
        self._kvstore_bound = bound_instance
        return load(self, bound_instance)

    @functools.wraps(build)
    def _build(self: Any) -> Any:
        bound = getattr(self, "_kvstore_bound", None)
        options = getattr(type(self), "_kvstore_options", {})
        token = _BUILD.set(node_context(bound, options) if bound is not None else dict(options))
        try:
            engine = build(self)
        finally:
            _BUILD.reset(token)
        pc = getattr(engine, "kv_prefix_cache", None)
        if isinstance(pc, ExoPrefixCache) and getattr(self, "inference_model", None) is not None:
            pc.prepare(self.inference_model)  # hash the weights while exo is still loading
        return engine

    setattr(cls, _ORIGINALS_ATTR, {"load": load, "build": build, "KVPrefixCache": builder.KVPrefixCache})
    cls.load, cls.build = _load, _build
    builder.KVPrefixCache = ExoPrefixCache
