"""kvstore.serve.gen_args: the generation fields mlx_lm.server leaves unchecked, refused
with a 400 naming the field (MLX-free: plain bodies; the real server in
tests/system/test_fuzz_routes.py)."""

from __future__ import annotations

import types

import pytest

from kvstore.serve.gen_args import check, vocab_size
from kvstore.serve.http import BodyError

CHAT = "/v1/chat/completions"
M = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": ["a"]}, "prompt"),
    (CHAT, {"messages": M, "stop": [1]}, "stop"),
    (CHAT, {"messages": M, "stop": {"a": 1}}, "stop"),
    (CHAT, {"messages": M, "seed": -1}, "seed"),
    (CHAT, {"messages": M, "seed": 1 << 64}, "seed"),
    (CHAT, {"messages": M, "top_k": 100}, "top_k"),
    (CHAT, {"messages": M, "top_k": 1 << 31}, "top_k"),
    (CHAT, {"messages": M, "repetition_context_size": 1 << 31}, "repetition_context_size"),
    (CHAT, {"messages": M, "max_tokens": 1 << 40}, "max_tokens"),
    (CHAT, {"messages": M, "logit_bias": {"100": 1.0}}, "logit_bias"),
    (CHAT, {"messages": M, "logit_bias": {"-1": 1.0}}, "logit_bias"),
    (CHAT, {"messages": M, "logit_bias": {"1" + "0" * 20: 1.0}}, "logit_bias"),
    (CHAT, {"messages": M, "logit_bias": {"3": float("inf")}}, "logit_bias"),
])
def test_each_value_the_generation_thread_cannot_run_is_a_400_naming_its_field(path: str, body: dict, param: str) -> None:
    with pytest.raises(BodyError) as e:
        check(path, body, vocab=100)
    assert e.value.status == 400 and e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("body", [
    {"messages": M}, {"messages": M, "stop": "x"}, {"messages": M, "stop": ["x", ""]}, {"messages": M, "seed": 0},
    {"messages": M, "seed": (1 << 64) - 1}, {"messages": M, "top_k": 99}, {"messages": M, "logit_bias": {"99": -100}},
    {"messages": M, "logit_bias": {"a": 1}},  # mlx_lm.server's own 400
    {"messages": M, "top_k": "x", "seed": "y", "stop": None}, "not a dict",
])
def test_what_mlx_lm_can_run_or_checks_itself_passes(body: object) -> None:
    check(CHAT, body, vocab=100)


def test_without_a_known_vocabulary_only_the_fixed_bounds_apply() -> None:
    check(CHAT, {"messages": M, "top_k": 5000, "logit_bias": {"5000": 1}}, vocab=None)
    with pytest.raises(BodyError):
        check(CHAT, {"messages": M, "logit_bias": {str(1 << 31): 1}}, vocab=None)


def test_vocab_size_reads_the_models_config() -> None:
    def provider(args: object) -> object:
        return types.SimpleNamespace(model=types.SimpleNamespace(args=args))

    assert vocab_size(provider(types.SimpleNamespace(vocab_size=259))) == 259
    assert vocab_size(provider(types.SimpleNamespace(text_config=types.SimpleNamespace(vocab_size=7)))) == 7
    assert vocab_size(types.SimpleNamespace(model=None)) is None
