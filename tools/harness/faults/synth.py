"""Synthetic caches and identities, prompts, and the tiny models with their oracle (``Zoo``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import EXTRA_TOKEN, N_GEN, VOCAB

if TYPE_CHECKING:
    import numpy as np

    from kvstore.identity import Identity

M64 = (1 << 64) - 1


def cache_digest(cache: list) -> str:
    """xxh3-128 of a cache's encoded arrays and layout: equal digests, bit-identical caches."""
    import numpy as np
    import xxhash
    from kvstore import codec
    tensors, layout = codec.encode_cache(cache)
    h = xxhash.xxh3_128()
    h.update(json.dumps(layout.to_json(), sort_keys=True).encode())
    for k in sorted(tensors):
        a = tensors[k]
        if "bfloat16" in str(a.dtype):
            import mlx.core as mx
            a = a.view(mx.uint16)
        arr = np.ascontiguousarray(np.array(a))
        h.update(f"{k}:{arr.dtype}:{arr.shape}".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def _splitmix(x: int) -> int:
    """splitmix64: a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


# ================================================================ synthetic caches
# Values are a pure function of the token prefix (a rolling splitmix hash), so any restore
# can be checked bit for bit against a regeneration, without running a model.

SYN_LAYERS, SYN_HEADS, SYN_DIM = 2, 2, 8


def _prefix_hashes(tokens: list[int]) -> np.ndarray:
    """uint64 array: element i hashes ``tokens[:i + 1]`` (a rolling hash)."""
    import numpy as np
    out = np.empty(len(tokens), dtype=np.uint64)
    h = 0x243F6A8885A308D3
    for i, t in enumerate(tokens):
        h = _splitmix(h ^ (int(t) * 0x9E3779B1 + i))
        out[i] = h
    return out


def _syn_values(tokens: list[int]) -> np.ndarray:
    """float32 array (SYN_LAYERS, 2, 1, SYN_HEADS, n, SYN_DIM): exact 16-bit fractions."""
    import numpy as np
    n = len(tokens)
    H = _prefix_hashes(tokens)
    idx = np.arange(SYN_LAYERS * 2 * SYN_HEADS * SYN_DIM, dtype=np.uint64)
    shifts = (idx * np.uint64(7)) % np.uint64(49)
    bits = (H[:, None] >> shifts[None, :]) & np.uint64(0xFFFF)
    vals = (bits.astype(np.float32) / np.float32(65536.0)).reshape(n, SYN_LAYERS, 2, SYN_HEADS, SYN_DIM)
    return np.ascontiguousarray(vals.transpose(1, 2, 3, 0, 4)[:, :, None])


def _syn_state(tokens: list[int]) -> np.ndarray:
    """The synthetic recurrent state (1 x 4 float32) after ``tokens``."""
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


def syn_identity(kind: str) -> Identity:
    """The store identity of synthetic caches of ``kind`` (``kv`` or ``snap``)."""
    from kvstore.identity import Identity
    from kvstore.model_layout import layout_of
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


def random_prompt(rng: random.Random, lo: int = 8, hi: int = 160, bases: list[list[int]] | None = None) -> list[int]:
    """Byte tokens; shares prefixes with ``bases`` (system prompts, earlier turns) often."""
    if bases and rng.random() < 0.6:
        base = rng.choice(bases)
        cut = len(base) if rng.random() < 0.5 else rng.randint(1, len(base))
        return base[:cut] + [rng.randrange(VOCAB) for _ in range(rng.randint(max(1, lo // 2), max(2, hi // 2)))]
    return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]


SYSTEM_PROMPTS = [[(i * 37 + 11 * s) % VOCAB for i in range(n)] for s, n in ((1, 40), (2, 70), (3, 33))]


MODEL_NAMES = {"llama": "tiny-llama", "gemma": "tiny-gemma3", "qwen": "tiny-qwen3next"}


class Zoo:
    """Tiny models, their identities and the oracle, with a memo of verified caches."""

    def __init__(self, names: tuple[str, ...] = ("llama", "gemma", "qwen")) -> None:
        from tools.testing.model_builds import load_model, model_path
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
        from tools.testing import oracle
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
        from tools.testing import oracle
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
