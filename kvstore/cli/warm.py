"""``kvstore warm``: prefill a prompt into the store ahead of traffic."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from ..options import StoreOptions
from . import common


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "warm", help="prefill a system prompt or chat into the store ahead of traffic",
        description="Tokenize a system prompt (or a list of chat messages) with the model's chat "
                    "template, prefill it and store the KV cache, so the first real request "
                    "with that prefix is a hit. Reuses whatever prefix the store already holds. "
                    "Creates the cache directory if needed.")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="the mlx-lm model directory the servers load (the store's identity is "
                        "derived from its files)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--system-file", type=Path, metavar="FILE",
                     help="a text file holding the system prompt (stored as mlx_lm.server caches it: with the "
                        "header of the user turn that follows)")
    src.add_argument("--messages-file", type=Path, metavar="FILE",
                     help='a JSON file holding a list of {"role": ..., "content": ...} messages')
    p.add_argument("--step", type=int, default=512, metavar="TOKENS",
                   help="prefill step size (default 512)")
    p.add_argument("--chunk-tokens", type=int, default=StoreOptions.chunk_tokens, metavar="TOKENS",
                   help=f"chunk size for a NEW cache directory (default {StoreOptions.chunk_tokens}, the KVStore "
                        "default); an existing directory keeps the chunk size it was created with")
    p.add_argument("--kv-bits", type=int, default=None,
                   help="warm for a server run with mlx_lm.server's --kv-bits (its own identity)")
    p.add_argument("--kv-group-size", type=int, default=StoreOptions.kv_group_size,
                   help=f"with --kv-bits (default {StoreOptions.kv_group_size})")
    p.add_argument("--quantized-kv-start", type=int, default=5000,
                   help="with --kv-bits: position where the server starts quantising (mlx-lm default 5000)")
    common.add_cache_dir(p)
    return p


def _messages(args: argparse.Namespace) -> list[dict[str, str]]:
    if args.system_file is not None:
        try:
            text = args.system_file.read_text()
        except OSError as e:
            raise common.CLIError(f"cannot read --system-file {args.system_file}: {e.strerror or e}") from None
        return [{"role": "system", "content": text}]
    try:
        msgs = json.loads(args.messages_file.read_text())
    except OSError as e:
        raise common.CLIError(f"cannot read --messages-file {args.messages_file}: {e.strerror or e}") from None
    except ValueError as e:
        raise common.CLIError(f"--messages-file {args.messages_file} is not valid JSON: {e}") from None
    if isinstance(msgs, dict) and isinstance(msgs.get("messages"), list):
        msgs = msgs["messages"]  # an OpenAI request body works too
    if (not isinstance(msgs, list) or not msgs
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in msgs)):
        raise common.CLIError(f"--messages-file {args.messages_file} must hold a non-empty JSON list of "
                              '{"role": ..., "content": ...} objects')
    return msgs


def _model_dir(model: str) -> Path:
    from ..store import local_model_dir

    got = local_model_dir(model)
    if got is None:
        raise common.CLIError(f"model {model!r} is not a directory (nor a repo in the local Hugging Face "
                              "cache): pass --model DIR, the model directory your servers load")
    return got


def tokenize(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> list[int]:
    if not getattr(tokenizer, "chat_template", None) and not getattr(tokenizer, "has_chat_template", False):
        raise common.CLIError("the model's tokenizer has no chat template, so the prompt a server would "
                              "build is unknown: add a chat template to the model directory")
    toks = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(toks, dict) or hasattr(toks, "input_ids"):  # transformers BatchEncoding
        toks = toks["input_ids"]
    toks = list(toks)
    if toks and isinstance(toks[0], (list, tuple)):
        toks = list(toks[0])
    return [int(t) for t in toks]


def server_system_prefix(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """System messages as mlx_lm.server caches them (its "system" segment): rendered up to
    where a user turn's text starts, so with the user turn's header. That boundary is the
    server's own rule: the first token where the template of the system messages plus an
    empty user turn differs from a real prompt. A restarted server that has exactly this
    in memory (``--preload``) prefills a new question and nothing else. Falls back to the
    plain rendering of ``messages`` when the template gives no such boundary."""
    plain = tokenize(tokenizer, messages)
    empty = tokenize(tokenizer, messages + [{"role": "user", "content": ""}])
    probe = tokenize(tokenizer, messages + [{"role": "user", "content": "Hello"}], generation_prompt=True)
    end = next((i for i, (a, b) in enumerate(zip(empty, probe)) if a != b), 0)
    return probe[:end] if len(plain) <= end < len(probe) and probe[: len(plain)] == plain else plain


def run(args: argparse.Namespace) -> int:
    if args.step < 1:
        raise common.CLIError(f"--step must be >= 1, got {args.step}", 2)
    if args.chunk_tokens < 1:
        raise common.CLIError(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}", 2)
    messages = _messages(args)
    model_dir = _model_dir(args.model)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    t0 = time.perf_counter()
    model, tokenizer = _load(model_dir)
    tokens = server_system_prefix(tokenizer, messages) if args.system_file is not None else tokenize(tokenizer, messages)
    if not tokens:
        raise common.CLIError("the chat template produced no tokens")
    store = _open_store(args)
    try:
        ident = store.identity(model_dir)
        key = common.entry_key(store, model_dir, tokens)
        if store.disk.index.entry(key) is not None:
            print(f"already warm: {len(tokens)} tokens for {ident.name} (identity {ident.hex[:12]}), "
                  f"entry {common.short_id(key)}")
            return 0
        start = _prefill_and_store(args, store, model, model_dir, tokens)
        stats = store.stats()
        stored = store.disk.index.entry(key) is not None
    finally:
        store.close()
    if not stored:
        why = ("the write failed" if stats.get("write_errors") else
               "the write queue dropped it" if stats.get("dropped_writes") else
               "the cache could not be persisted" if stats.get("unpersistable") else "unknown reason")
        raise common.CLIError(f"prefilled {len(tokens)} tokens but the entry is not on disk ({why}); "
                              "see the log above")
    reused = f", reused {start} stored tokens" if start else ""
    print(f"warmed {len(tokens)} tokens for {ident.name} (identity {ident.hex[:12]}) in "
          f"{time.perf_counter() - t0:.1f}s{reused}: entry {common.short_id(key)}")
    return 0


def _load(model_dir: Path) -> tuple[Any, Any]:
    import mlx_lm

    from .progress import Progress

    from ..files import special_files

    odd = special_files(model_dir)  # mlx-lm would block on a FIFO there
    if odd:
        raise common.CLIError(f"cannot load model {model_dir}: {odd[0]} is not a regular file")
    try:
        with Progress(f"load model {model_dir}"):
            loaded = mlx_lm.load(str(model_dir))
            return loaded[0], loaded[1]
    except Exception as e:
        raise common.CLIError(f"cannot load model {model_dir}: {e}") from None


def _open_store(args: argparse.Namespace) -> Any:
    from ..floors import MIN_DISK_HIT
    from ..store import KVStore, StoreOpenError

    try:  # MIN_DISK_HIT: a new prompt version sharing only a template header with an old one is prefilled whole
        return KVStore(common.cache_dir(args), chunk_tokens=args.chunk_tokens, max_entries=1, min_disk_hit=MIN_DISK_HIT,
                       kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                       shared_dir=getattr(args, "shared_dir", False))
    except StoreOpenError as e:
        raise common.CLIError(str(e)) from None


def _prefill_and_store(args: argparse.Namespace, store: Any, model: Any, model_dir: Path, tokens: list[int]) -> int:
    """Prefill ``tokens`` (from the longest stored prefix, say an older prompt version),
    insert the cache and wait until it is on disk; returns the tokens reused."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .progress import PromptSteps, write_behind

    with PromptSteps(len(tokens)) as steps:
        got = store.fetch(model_dir, tokens)
        cache, start = (got.cache, got.n) if got.cache is not None and got.n < len(tokens) else (make_prompt_cache(model), 0)
        steps("restore", start, len(tokens))
        for i in range(start, len(tokens), args.step):
            piece = tokens[i : i + args.step]
            model(mx.array([piece]), cache=cache)
            mx.eval([c.state for c in cache])
            steps("prefill", i + len(piece), len(tokens))
    if args.kv_bits is not None:  # what mlx-lm's generate_step does to the server's cache
        from mlx_lm.generate import maybe_quantize_kv_cache
        maybe_quantize_kv_cache(cache, args.quantized_kv_start, args.kv_group_size, args.kv_bits)
    with write_behind(len(tokens)):
        store.insert(model_dir, tokens, cache, cache_type="system")
        store.flush()
    return start
