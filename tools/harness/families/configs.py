"""Tiny configs for every model family of the installed mlx-lm, from each family's own
``ModelArgs``.

mlx-lm's ``BaseModelArgs.from_dict`` keeps only the keys a family's ``ModelArgs`` takes, so
one superset of small, mutually consistent values (``COMMON``: hidden 64, 4 heads of 16,
2 KV heads, 4 layers, a sliding window and an attention chunk of 8, SSM state 16...) fits
most families as it is; ``OVERRIDES`` sets what a family names or shapes its own way,
with every cache-relevant option on (sliding windows, chunked attention, SSM / linear
layers mixed with attention) so that its special cache is built. A required field the
superset does not name gets a small value of its annotated type (``_filler``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from typing import Any

VOCAB = 259  # tools.testing.model_builds.TINY_VOCAB: bytes + 3 special tokens
LAYERS = 4
H, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
WINDOW = 8

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": H, "d_model": H, "n_embd": H, "dim": H, "model_dim": H,
    "embed_dim": H, "block_dim": H, "hidden_dim": 128,
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS,
    "num_transformer_layers": LAYERS,
    "intermediate_size": 128, "ffn_hidden_size": 128, "mlp_hidden_size": 128, "n_inner": 128,
    "block_ff_dim": 128, "ff_intermediate_size": 128, "intermediate_size_mlp": 128,
    "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "num_attention_groups": KV_HEADS,
    "head_dim": HEAD_DIM, "kv_channels": HEAD_DIM,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000.0, "rotary_emb_base": 10000, "swa_rope_theta": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "model_max_length": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_qkv_bias": False,
    "use_conv_bias": True, "conv_bias": True,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "num_shared_expert": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_dense_layers": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "use_expert_bias": False,
    "zero_expert_num": 0, "zero_expert_type": "identity",
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
    "partial_rotary_factor": 0.5, "rotary_pct": 0.5, "rotary_dim": 8,
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    "attention_chunk_size": WINDOW, "sliding_window_pattern": 2,
    "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2),
    "use_qk_norm": True, "qk_norm": True,
    "logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0, "logits_soft_cap": 30.0,
    "conv_kernel": 4, "conv_L_cache": 3, "conv_window": 2, "conv1d_width": 4, "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "full_attention_interval": 2,
    "state_size": 16, "ssm_state_size": 16, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_n_heads": 8, "mamba_d_head": 16,
    "mamba_n_groups": 1, "n_groups": 1, "expand": 2, "time_step_rank": 8,
    "time_step_limit": [0.0, float("inf")], "mamba_proj_bias": False, "chunk_size": 16,
    "block_size": 16, "group_norm_size": 1, "layer_group_size": 2,
    "a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8,
    "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
    "dim_model_base": H, "scale_depth": 1.0, "scale_emb": 1.0,
    "hidden_act": "silu", "torch_dtype": "float32", "eos_token_id": VOCAB - 1,
}

# family -> what it names or shapes its own way (merged over COMMON; text_config too)
_ROPE_TYPES = {"full_attention": {"rope_theta": 10000.0, "rope_type": "default"},
               "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0, "alpha": 1.0}
_LLAMA4_SCALING = {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 4096,
                   "rope_type": "default"}
_MAMBA_ATTN = ["mamba", "attention", "mamba", "attention"]

OVERRIDES: dict[str, dict[str, Any]] = {
    "baichuan_m1": {"sliding_window_layers": [0], "num_swa_attention_heads": HEADS,
                    "num_swa_key_value_heads": KV_HEADS},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": KV_HEADS, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    "deepseek_v2": {"rope_scaling": _YARN},
    "minicpm3": {"rope_scaling": _YARN},
    "hunyuan": {"rope_scaling": _YARN},
    "exaone4": {"sliding_window_pattern": "LG"},
    "exaone_moe": {"is_moe_layer": [False, True, True, True]},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_chunk_size": 16},
    "gemma4": {"text_config": {"model_type": "gemma4_text", "num_kv_shared_layers": 0,
                               "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
                               "global_head_dim": HEAD_DIM, "rope_parameters": None}},
    "gemma4_text": {"num_kv_shared_layers": 0, "vocab_size_per_layer_input": VOCAB,
                    "hidden_size_per_layer_input": 16, "global_head_dim": HEAD_DIM, "rope_parameters": None},
    "gemma3": {"text_config": {"model_type": "gemma3_text", "query_pre_attn_scalar": HEAD_DIM}},
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "granitemoehybrid": {"layer_types": _MAMBA_ATTN},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "layer_types": None},
    "kimi_k3": {"hidden_act": "situ", "moe_router_activation_func": "sigmoid", "num_experts_per_token": 2,
                "linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 16,
                                       "num_heads": HEADS, "short_conv_kernel_size": 4}},
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"] * (LAYERS // 2)},
    "spark2_5": {"hidden_act": "gelu", "rope_parameters": _ROPE_TYPES},
    "prism_hadamard_qwen35": {"tensor_namespace": "mlx-vlm-qwen3_5"},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "head_dim": 16,
                                           "num_heads": HEADS, "short_conv_kernel_size": 4}},
    "llama4": {"text_config": {"model_type": "llama4_text", "interleave_moe_layer_step": 2, "num_experts_per_tok": 1,
                               "intermediate_size_mlp": 128, "rope_scaling": None}},
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0], "interleave_moe_layer_step": 2},
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "mellum": {"rope_parameters": _ROPE_TYPES},
    "mimo_v2_flash": {"moe_layer_freq": [0, 1, 1, 1], "hybrid_layer_pattern": [1, 0, 1, 0],
                      "swa_head_dim": HEAD_DIM, "swa_v_head_dim": HEAD_DIM, "swa_num_attention_heads": HEADS,
                      "swa_num_key_value_heads": KV_HEADS},
    "minimax_m3_vl": {"moe_layer_freq": [0, 1, 1, 1]},
    "ministral3": {"rope_parameters": _LLAMA4_SCALING},
    "mistral4": {"rope_parameters": _LLAMA4_SCALING},
    "mistral3": {"text_config": {"model_type": "ministral3", "rope_parameters": _LLAMA4_SCALING}},
    "pixtral": {"text_config": {"model_type": "mistral"}},
    "lfm2-vl": {"text_config": {"model_type": "lfm2", "full_attn_idxs": [1, 3]}},
    "qwen2_vl": {"text_config": {"model_type": "qwen2"}},
    "qwen3_vl": {"text_config": {"model_type": "qwen3"}},
    "qwen3_vl_moe": {"text_config": {"model_type": "qwen3_moe"}},
    "muse_spark": {"text_config": {"post_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0},
                                   "mlp_layer_types": ["sparse"] * LAYERS,
                                   "layer_rope_theta": [10000.0] * LAYERS, "final_logit_softcapping": 30.0,
                                   "output_multiplier": 1.0, "moe_hidden_size": 32, "num_shared_experts": 0}},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}}] * LAYERS},
    "nemotron_h": {"layer_types": None, "hybrid_override_pattern": ["M", "*", "M", "*"]},
    "openelm": {"num_query_heads": [HEADS] * LAYERS, "num_kv_heads": [KV_HEADS] * LAYERS,
                "ffn_multipliers": [1.0] * LAYERS, "ffn_dim_divisor": 16},
    "plamo": {"n_shared_head": 2},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": WINDOW,
                        "lru_width": H},
    "step3p5": {"moe_num_experts": 4, "moe_top_k": 2},
    "gemma3n": {"text_config": {"model_type": "gemma3n_text", "num_kv_shared_layers": 0,
                                "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
                                "rope_local_base_freq": 10000.0, "laurel_rank": 8, "altup_num_inputs": 2,
                                "altup_active_idx": 0, "altup_coef_clip": 120.0, "altup_correct_scale": True,
                                "activation_sparsity_pattern": [0.0] * LAYERS, "final_logit_softcapping": 30.0,
                                "query_pre_attn_scalar": HEAD_DIM}},
}


def families() -> list[str]:
    """Every module of ``mlx_lm.models`` that defines ``Model`` and ``ModelArgs`` (by
    source text: importing some needs optional packages)."""
    import mlx_lm.models as mlx_models

    out = []
    for m in pkgutil.iter_modules(mlx_models.__path__):
        src = (importlib.util.find_spec(f"mlx_lm.models.{m.name}").origin or "")
        try:
            text = open(src).read()
        except OSError:
            continue
        if "class Model(" in text and "class ModelArgs" in text:
            out.append(m.name)
    return sorted(out)


def _filler(field: dataclasses.Field) -> Any:
    t = str(field.type)
    if "bool" in t:
        return False
    if "int" in t and "List" not in t and "list" not in t:
        return 2
    if "float" in t:
        return 1.0
    if "str" in t:
        return ""
    return None


def tiny_config(family: str) -> dict[str, Any]:
    """config.json of a tiny ``family`` model: COMMON, a nested ``text_config`` of the same
    values where the family takes one, the family's OVERRIDES, and a small value for every
    other required field of its ModelArgs. Raises whatever importing the family raises."""
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    over = OVERRIDES.get(family, {})
    cfg: dict[str, Any] = {**COMMON, "model_type": family}
    for f in dataclasses.fields(mod.ModelArgs):
        if f.name not in cfg and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            cfg[f.name] = _filler(f)
    if any(f.name == "text_config" for f in dataclasses.fields(mod.ModelArgs)):
        top = {k: v for k, v in over.items() if k != "text_config"}
        cfg["text_config"] = {**COMMON, "model_type": family, **top, **over.get("text_config", {})}
    cfg.update({k: v for k, v in over.items() if k != "text_config"})
    return cfg
