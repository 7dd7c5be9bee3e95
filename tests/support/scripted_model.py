"""A real mlx-lm model that answers every chat prompt with one given tool call.

tiny-llama (mlx-lm's llama class, its byte-level tokenizer) with:
- one added (non-special) token whose text is the whole tool call, e.g.
  ``<tool_call>\\n{"name": "Read", "arguments": {...}}\\n</tool_call>``;
- the chat template ``benchmarks.agent_session.TOOL_TEMPLATE`` (so mlx-lm infers its
  ``json_tools`` parser, and tools / tool calls / tool responses are rendered);
- weights that make it a bigram model: every layer's attention and MLP output projections
  are zero (the residual stream stays the last token's embedding), and the only non-zero
  rows of the LM head map the last token of the generation prompt (``\\n``) to the call
  token and the call token to ``<|im_end|>`` (EOS).

So greedy decoding after any chat prompt emits exactly the call, then stops: what a model
that decided to call a tool does, through mlx-lm's real generation, text state machine and
tool parser.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EOS = 258  # tiny-llama's <|im_end|>
SCALE = 30.0


def build(dst: Path, call: str) -> Path:
    import mlx.core as mx

    from benchmarks.agent_session import TOOL_TEMPLATE
    from tools.testing.model_builds import model_path

    src = model_path("tiny-llama")
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    call_id = config["vocab_size"]
    config["vocab_size"] = call_id + 1
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    added = {"id": call_id, "content": call, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": False}
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["added_tokens"].append(added)
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    tcfg = json.loads((dst / "tokenizer_config.json").read_text())
    tcfg["added_tokens_decoder"][str(call_id)] = {k: v for k, v in added.items() if k != "id"}
    tcfg["chat_template"] = TOOL_TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))

    from transformers import AutoTokenizer

    newline = AutoTokenizer.from_pretrained(str(dst)).encode("\n", add_special_tokens=False)
    assert len(newline) == 1, newline

    w = dict(mx.load(str(src / "model.safetensors")))
    for k in list(w):
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            w[k] = mx.zeros_like(w[k])
    embed = w["model.embed_tokens.weight"]
    row = mx.random.normal((1, embed.shape[1]), key=mx.random.key(7))
    embed = mx.concatenate([embed, row])
    w["model.embed_tokens.weight"] = embed
    norm = w["model.norm.weight"]

    def hidden(t: int) -> mx.array:  # the final norm's output when token t is last
        x = embed[t]
        return x * mx.rsqrt(mx.mean(x * x) + config["rms_norm_eps"]) * norm

    head = mx.zeros((call_id + 1, embed.shape[1]))
    for src_tok, dst_tok in ((newline[0], call_id), (call_id, EOS)):
        h = hidden(src_tok)
        head[dst_tok] = SCALE * h / mx.sum(h * h)
    w["lm_head.weight"] = head
    mx.save_safetensors(str(dst / "model.safetensors"), w)
    return dst
