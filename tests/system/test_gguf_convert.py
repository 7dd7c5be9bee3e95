"""tools/testing/gguf_convert.py: the converted SmolLM2 directories load offline, chat sensibly,
tokenize losslessly and are byte-for-byte reproducible."""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any, Iterator

import pytest

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import mlx_lm.utils

from tools.testing.gguf_convert import convert_smollm2, smollm2_gguf_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1, and any hub download attempt fails the test."""

    def no_hub(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"hub access attempted: {args} {kwargs}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(mlx_lm.utils, "snapshot_download", no_hub)
        yield


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return convert_smollm2(tmp_path_factory.mktemp("smollm2"), quantized=False)


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return convert_smollm2(tmp_path_factory.mktemp("smollm2-q4"), quantized=True)


@pytest.fixture(scope="module")
def f32_model(f32_dir: pathlib.Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(f32_dir))


@pytest.fixture(scope="module")
def q4_model(q4_dir: pathlib.Path) -> tuple[Any, Any]:
    return mlx_lm.load(str(q4_dir))


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ask(model: Any, tok: Any) -> str:
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return mlx_lm.generate(model, tok, prompt=prompt, max_tokens=30)  # greedy by default


def test_gguf_found() -> None:
    assert smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_f32_loads_and_is_float32(f32_dir: pathlib.Path, f32_model: tuple[Any, Any]) -> None:
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    weights = mx.load(str(f32_dir / "model.safetensors"))
    assert weights and all(w.dtype == mx.float32 for w in weights.values())
    model, _ = f32_model
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules())


def test_q4_loads_quantized(q4_model: tuple[Any, Any]) -> None:
    model, _ = q4_model
    assert model.model.embed_tokens.bits == 8
    linears = [m for m in model.modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)]
    assert linears and all(isinstance(m, nn.QuantizedLinear) and m.bits == 4 for m in linears)
    assert all(m.group_size == 32 for m in linears)


def test_f32_answers_paris(f32_model: tuple[Any, Any]) -> None:
    assert "Paris" in _ask(*f32_model)


def test_q4_answers_paris(q4_model: tuple[Any, Any]) -> None:
    assert "Paris" in _ask(*q4_model)


def test_tokenizer_round_trip_and_digit_split(f32_model: tuple[Any, Any]) -> None:
    _, tok = f32_model
    text = "Hello world 12345"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[-5:] == ["1", "2", "3", "4", "5"]


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q4"])
def test_deterministic(
    quantized: bool,
    tmp_path: pathlib.Path,
    f32_dir: pathlib.Path,
    q4_dir: pathlib.Path,
) -> None:
    first = q4_dir if quantized else f32_dir
    second = convert_smollm2(tmp_path / "again", quantized=quantized)
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in second.iterdir())
    for path in first.iterdir():
        assert _sha256(path) == _sha256(second / path.name), path.name
