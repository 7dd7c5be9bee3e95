"""tools/testing/oracle.py: the restored-equals-cold oracle passes correct caches and fails wrong ones.

For every tiny family (plain KVCache, QuantizedKVCache, RotatingKVCache+KVCache, ArraysCache+
KVCache, CacheList) and SmolLM2, with a prompt of N tokens and a split at K:
- ok, exact=True: a cache of prompt[:K] made by the same split as the cold run;
- ok, tolerance: a cache of prompt[:K] made by a different split (chunked, then one token);
- not ok: a cache of a different prefix of the same length (all different / one token);
- not ok: caches of prompt[:K+1] and prompt[:K-1] claimed to hold K tokens.
- the tolerance is far from both: correct diffs <= 1/100 of it, wrong ones >= 50 times it.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import pytest
from tests.support.models import have_smollm2
from tests.support.prompts import text_prompt

from tools.testing import model_builds
from tools.testing.oracle import (
    DEFAULT_ATOL,
    ColdRun,
    assert_restore,
    check_restore,
    cold_run,
    make_cache,
    prefill,
)

# name -> (prompt tokens N, split K, prefill chunk for the "different split" cache, n_gen)
CASES = {
    "tiny-llama": (320, 256, 64, 16),
    "tiny-llama-q": (320, 256, 64, 16),
    "tiny-gemma3": (320, 256, 64, 16),  # sliding window 32: rotated many times over
    "tiny-qwen3next": (200, 150, 64, 16),
    "tiny-cachelist": (320, 256, 64, 16),
    "smollm2": (64, 56, 16, 6),  # mlx CPU prefill of 135M float32 is ~10 tok/s here: short
}
NAMES = [n for n in CASES if have_smollm2() or not n.startswith("smollm2")]

@dataclass
class Scenario:
    name: str
    model: object
    tokenizer: object
    prompt: list[int]
    k: int
    chunk: int
    n_gen: int

    @property
    def kw(self) -> dict:
        return model_builds.MODELS[self.name].cache_kwargs

    @functools.cached_property
    def reference(self) -> ColdRun:
        """Cold run of the whole prompt in one call, shared by the tolerance checks."""
        return cold_run(self.model, self.prompt, n_gen=self.n_gen, **self.kw)

    @functools.cached_property
    def cache_k_minus_1(self) -> list:
        return prefill(self.model, self.prompt[: self.k - 1], chunk=self.chunk, **self.kw)

    @functools.cached_property
    def cache_k_split(self) -> list:
        """prompt[:K] made as chunked prompt[:K-1] + one more token: not the cold run's split."""
        cache = copy.deepcopy(self.cache_k_minus_1)
        return prefill(self.model, self.prompt[self.k - 1 : self.k], cache=cache, **self.kw)

    @functools.cached_property
    def cache_k_plus_1(self) -> list:
        cache = copy.deepcopy(self.cache_k_split)
        return prefill(self.model, self.prompt[self.k : self.k + 1], cache=cache, **self.kw)

    def check(self, cache, **kwargs):
        kwargs.setdefault("n_gen", self.n_gen)
        return check_restore(
            self.model, self.prompt, cache, self.k, copy_cache=True, **self.kw, **kwargs
        )

    @functools.cached_property
    def split_result(self):
        """The correct cache of a different split, checked against the cold run."""
        return self.check(self.cache_k_split, reference=self.reference)

    @functools.cached_property
    def one_token_result(self):
        """A cache of prompt[:K] with token 1 changed (the hard case); the byte tokenizer's
        ids are < 256."""
        one = list(self.prompt[: self.k])
        one[1] = (one[1] + 1) % 256 if self.name.startswith("tiny") else one[1] + 1
        return self.check(prefill(self.model, one, **self.kw), reference=self.reference)

    @functools.cached_property
    def plus_result(self):
        return self.check(self.cache_k_plus_1, reference=self.reference)

    @functools.cached_property
    def minus_result(self):
        return self.check(self.cache_k_minus_1, reference=self.reference)


@pytest.fixture(scope="module", params=NAMES)
def scenario(request, load_named):
    name = request.param
    n, k, chunk, n_gen = CASES[name]
    model, tokenizer = load_named(name)
    prompt = text_prompt(tokenizer, n, seed=3)
    return Scenario(name, model, tokenizer, prompt, k, chunk, n_gen)


def test_exact_same_split_is_ok(scenario):
    cache = prefill(scenario.model, scenario.prompt[: scenario.k], **scenario.kw)
    result = scenario.check(cache, exact=True)
    assert result.ok, result.detail
    assert result.logprobs_max_abs_diff == 0.0 and result.gen_logprobs_max_abs_diff == 0.0
    assert result.same_tokens and len(result.tokens_cold) == scenario.n_gen


def test_different_split_is_ok_within_tolerance(scenario):
    result = scenario.split_result
    assert result.ok, result.detail
    assert result.logprobs_max_abs_diff <= DEFAULT_ATOL
    assert result.tokens_cold == scenario.reference.tokens


def test_different_prefix_same_length_fails(scenario):
    prompt, k = scenario.prompt, scenario.k
    if scenario.name.startswith("tiny"):
        # entirely different tokens of the same length
        other = text_prompt(scenario.tokenizer, k, seed=99)
        assert other != prompt[:k]
        cache = prefill(scenario.model, other, **scenario.kw)
        result = scenario.check(cache, reference=scenario.reference)
        assert not result.ok, result.detail
    result = scenario.one_token_result  # one token changed near the start
    assert not result.ok, result.detail
    assert result.logprobs_max_abs_diff > DEFAULT_ATOL


def test_off_by_one_caches_fail(scenario):
    plus, minus = scenario.plus_result, scenario.minus_result
    assert not plus.ok, plus.detail
    assert not minus.ok, minus.detail
    assert plus.logprobs_max_abs_diff > DEFAULT_ATOL
    assert minus.logprobs_max_abs_diff > DEFAULT_ATOL
    if scenario.name.startswith("tiny"):  # exact mode fails too (one more cold run)
        assert not scenario.check(scenario.cache_k_minus_1, exact=True).ok


def test_cache_classes_used(scenario):
    """The caches the oracle handled are of the family's intended classes."""
    spec = model_builds.MODELS[scenario.name]
    cache = scenario.cache_k_split
    assert {type(c).__name__ for c in cache} == set(spec.cache_classes)
    if scenario.name == "tiny-gemma3":
        rot = [c for c in cache if type(c).__name__ == "RotatingKVCache"]
        assert rot and all(c.offset == scenario.k > 4 * c.max_size for c in rot)


def test_assert_restore_and_argument_errors(tiny_llama):
    model, tokenizer = tiny_llama
    prompt = text_prompt(tokenizer, 60, seed=5)
    good = prefill(model, prompt[:40])
    result = assert_restore(model, prompt, good, 40, n_gen=4, exact=True, copy_cache=True)
    assert result.ok and "OK" in result.detail
    with pytest.raises(AssertionError, match="MISMATCH"):
        assert_restore(model, prompt, prefill(model, prompt[:41]), 40, n_gen=4)
    with pytest.raises(ValueError):  # nothing left to feed
        check_restore(model, prompt, prefill(model, prompt), len(prompt))
    with pytest.raises(ValueError):
        check_restore(model, prompt, None, 5)
    # cache=None with n_cached=0: a cold run against itself
    assert check_restore(model, prompt, None, 0, n_gen=4, exact=True).ok
    # a reference for another split is refused
    ref = cold_run(model, prompt, n_gen=4)
    with pytest.raises(ValueError, match="reference"):
        check_restore(model, prompt, good, 40, n_gen=4, exact=True, reference=ref)
    with pytest.raises(ValueError, match="reference"):
        check_restore(model, prompt, good, 40, n_gen=5, reference=ref)
    # copy_cache=True left `good` untouched; without it the cache is advanced
    assert good[0].offset == 40
    check_restore(model, prompt, good, 40, n_gen=4, reference=ref)
    assert good[0].offset > 40


def test_float_cache_is_quantized_for_kv_bits(load_named):
    """A float KVCache handed to a kv_bits check is converted like mlx_lm does; the result
    is close to, but not bit-equal with, a cache quantised from the first token."""
    model, tokenizer = load_named("tiny-llama-q")
    prompt = text_prompt(tokenizer, 120, seed=6)
    kw = model_builds.MODELS["tiny-llama-q"].cache_kwargs
    assert {type(c).__name__ for c in make_cache(model, **kw)} == {"QuantizedKVCache"}
    float_cache = prefill(model, prompt[:100])
    result = check_restore(model, prompt, float_cache, 100, n_gen=4, **kw)
    assert {type(c).__name__ for c in float_cache} == {"QuantizedKVCache"}
    assert result.logprobs_max_abs_diff < 1.0, result.detail


def test_tolerance_is_far_from_correct_and_wrong_caches(scenario):
    """The oracle's tolerance decides by a wide margin, not by luck: every correct cache's
    last-position max|log-prob diff| is at most 1/100 of ``DEFAULT_ATOL`` and every wrong
    cache's at least 50 times it (measured values printed: pytest -s)."""
    correct = scenario.split_result.logprobs_max_abs_diff
    wrong = {"one token changed at position 1": scenario.one_token_result.logprobs_max_abs_diff,
             "cache of K+1 claimed K": scenario.plus_result.logprobs_max_abs_diff,
             "cache of K-1 claimed K": scenario.minus_result.logprobs_max_abs_diff}
    print(f"\n{scenario.name}: correct (different split) {correct:.3g}; "
          + ", ".join(f"{k} {v:.3g}" for k, v in wrong.items()))
    assert correct <= DEFAULT_ATOL / 100
    assert min(wrong.values()) >= DEFAULT_ATOL * 50, wrong
