"""``kvstore export ENTRY FILE`` / ``kvstore import FILE --model M``: mlx-lm prompt-cache files.

The file format is mlx-lm's own (``mlx_lm.models.cache.save_prompt_cache``: a safetensors
file of the cache states, with the user metadata ``model`` and ``tokenizer_config`` that
``mlx_lm.generate --prompt-cache-file`` requires). An exported file is one that
``mlx_lm.generate`` uses as it is; kvstore adds the entry's token ids (``kvstore_tokens``,
a JSON list) and identity (``kvstore_identity``) to the same user metadata, so that the
file can come back without its prompt. A file made by ``mlx_lm.cache_prompt`` carries no
token ids: ``--prompt-file`` re-tokenises its prompt as ``cache_prompt`` did.

Guarantees: import stores nothing unless the token ids match the cache's length, the
model (its identity, when the file names one, its layer layout and every array's whole
shape but the token axis, batch included) matches ``--model``, and the ids are in the
model's vocabulary; export writes the file under a temporary
name (mode 0600: a cache holds the prompt) and renames it into place, so a reader never
sees half a file, and never replaces an existing file without ``--force``. mlx is
imported inside the commands only, so the other commands never load it.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from . import common

TOKENS_KEY = "kvstore_tokens"  # mlx-lm user-metadata key holding the entry's token ids (JSON list)
IDENTITY_KEY = "kvstore_identity"  # the identity (hex) the entry was stored under


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="write an entry (a system prompt, to continue) as an mlx-lm prompt-cache file",
        description="Write one entry as a prompt-cache file that `mlx_lm.generate --prompt-cache-file FILE` "
                    "uses as it is. The file holds the KV cache of the entry's whole prompt, exactly as "
                    "stored; mlx_lm.generate appends its --prompt after those tokens, whatever they end "
                    "with. So export a prefix meant to be continued: a system prompt (TYPE system in "
                    "`kvstore ls`, as `kvstore warm --system-file` stores it). A conversation entry "
                    "(user / assistant) ends inside a chat, often in an open assistant turn: the model "
                    "then answers that conversation, not the new prompt. The token ids go into the "
                    "file's metadata, so `kvstore import` can bring it back without the prompt.")
    p.add_argument("entry", metavar="ENTRY", help="entry id or any unique hex prefix of it (see `kvstore ls`)")
    p.add_argument("file", metavar="FILE", type=Path, help="the file to write (must end in .safetensors)")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    common.add_cache_dir(p)
    q = subparsers.add_parser(
        "import", help="store an mlx-lm prompt-cache file (mlx_lm.cache_prompt) as an entry",
        description="Store a prompt-cache file made by `mlx_lm.cache_prompt` (or `kvstore export`). Its "
                    "token ids come from kvstore's metadata in the file, else from re-tokenising "
                    "--prompt-file as mlx_lm.cache_prompt does. Nothing is stored unless they match the "
                    "cache's length and the cache fits --model. Creates the cache directory if needed.")
    q.add_argument("file", metavar="FILE", type=Path, help="the .safetensors prompt-cache file")
    q.add_argument("--model", required=True, metavar="DIR", help="the mlx-lm model directory the cache was made with")
    q.add_argument("--prompt-file", type=Path, metavar="P",
                   help="a text file holding the prompt given to mlx_lm.cache_prompt (for files without "
                        "kvstore's token ids)")
    common.add_cache_dir(q)
    return q


def run(args: argparse.Namespace) -> int:
    return export(args) if args.command == "export" else import_file(args)


# ----------------------------------------------------------------------------- export


def export(args: argparse.Namespace) -> int:
    path = _target(args.file, args.force)
    disk = common.open_disk(args)
    try:
        key, rec = common.resolve_entry(disk, args.entry)
        info = disk.index.identities().get(rec.identity.hex())
        cache, tokens = _restore(disk, key, rec, dict(info.info) if info is not None else {})
    finally:
        disk.close()
    model = info.get("path") if info is not None else None
    if not model:
        raise common.CLIError(f"entry {common.short_id(key)}'s identity records no model path, which "
                              "mlx_lm.generate needs in the file: nothing written")
    meta = {"model": str(model), "tokenizer_config": "{}",
            TOKENS_KEY: json.dumps(tokens), IDENTITY_KEY: rec.identity.hex()}
    _write(path, cache, meta)
    if not Path(model).is_dir():
        common.warn(f"model directory {model} no longer exists: mlx_lm.generate needs it to use the file")
    print(f"exported {common.short_id(key)} ({len(tokens)} tokens, {common.identity_name(rec.identity.hex(), info)}) "
          f"to {path}")
    print(f"it holds the KV of this entry's whole prompt ({rec.cache_type} entry): "
          f"`mlx_lm.generate --prompt-cache-file {path} --prompt ...` appends the new prompt after it")
    if rec.cache_type != "system":
        common.warn(f"a {rec.cache_type} entry ends inside a conversation (often an open assistant turn): "
                    "a new prompt appended after it gets an answer to that conversation; export a system "
                    "prompt entry (TYPE system in `kvstore ls`, as `kvstore warm --system-file` stores it) "
                    "to reuse a prefix")
    return 0


def _target(path: Path, force: bool) -> Path:
    if path.suffix != ".safetensors":  # mx.save_safetensors would append it, mlx_lm.generate needs it
        raise common.CLIError(f"FILE must end in .safetensors (mlx-lm's prompt-cache format), got {path}", 2)
    if path.exists() and not force:
        raise common.CLIError(f"{path} exists: pass --force to replace it")
    if not path.parent.is_dir():
        raise common.CLIError(f"directory {path.parent} does not exist")
    return path


def _restore(disk: Any, key: bytes, rec: Any, info: dict[str, Any]) -> tuple[list[Any], list[int]]:
    """The entry's live cache (read and checked as a fetch reads it) and its token ids."""
    from ..files import BlobError
    from ..codec import Unsupported
    from ..identity import Identity
    from ..keys import TOKEN_BYTES, decode_tokens

    raw = disk.index.tokens(key)
    if raw is None or len(raw) != rec.n * TOKEN_BYTES:
        raise common.CLIError(f"entry {common.short_id(key)} has no token ids stored: {common.run_hint('verify --fix', disk.root)}")
    ident = Identity(rec.identity, info)
    try:
        plan = disk.plan(ident, bytes(raw))
        if plan is None or plan.n != rec.n:
            raise common.CLIError(f"entry {common.short_id(key)} cannot be read whole: {common.run_hint('verify', disk.root)}")
        got = disk.restore(plan, ident)
    except (BlobError, Unsupported, KeyError, ValueError) as e:
        raise common.CLIError(f"entry {common.short_id(key)} is damaged ({e}): {common.run_hint('verify --fix', disk.root)}") from None
    return got.cache, decode_tokens(bytes(raw))


def _write(path: Path, cache: list[Any], meta: dict[str, str]) -> None:
    """``save_prompt_cache`` into a 0600 temporary file beside ``path``, then rename."""
    from mlx_lm.models.cache import save_prompt_cache

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        save_prompt_cache(tmp, cache, meta)
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, (ValueError, OSError)):
            raise common.CLIError(f"cannot write {path}: {e}") from None
        raise


# ----------------------------------------------------------------------------- import


def import_file(args: argparse.Namespace) -> int:
    from ..store import local_model_dir

    from ..files import special_files

    model_dir = local_model_dir(args.model)
    if model_dir is None:
        raise common.CLIError(f"model {args.model!r} is not a directory (nor a repo in the local Hugging Face cache)")
    odd = special_files(model_dir)  # mlx-lm and the tokenizer would block on a FIFO there
    if odd:
        raise common.CLIError(f"--model {model_dir}: {odd[0]} is not a regular file; nothing stored")
    cache, meta = _load(args.file)
    held = _held(cache)
    tokens = _tokens(meta, args, model_dir)
    if len(tokens) != held:
        raise common.CLIError(f"{args.file} holds {held} positions but its prompt is {len(tokens)} tokens: "
                              "not the prompt this cache was made from (wrong --prompt-file or model?); "
                              "nothing stored")
    store = _open_store(args, cache)
    try:
        ident = _check_identity(store, model_dir, meta)
        _check_fits(ident, cache, args.file)
        key = common.entry_key(store, model_dir, tokens)
        try:
            store.insert(model_dir, tokens, cache, cache_type="system")
        except ValueError as e:
            raise common.CLIError(f"{args.file}: {e}; nothing stored") from None
        store.flush()
        stats, stored = store.stats(), store.disk.index.entry(key) is not None
    finally:
        store.close()
    if not stored:
        why = ("the cache does not fit the model's layers" if stats.get("unpersistable") else
               "the write failed" if stats.get("write_errors") else "see the log above")
        raise common.CLIError(f"{args.file} was not stored ({why})")
    print(f"imported {len(tokens)} tokens for {ident.name} (identity {ident.hex[:12]}): entry {common.short_id(key)}")
    return 0


def _load(path: Path) -> tuple[list[Any], dict[str, str]]:
    from mlx_lm.models.cache import load_prompt_cache

    if not path.is_file():
        raise common.CLIError(f"{path} is not a file")
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:  # mlx-lm raises whatever its parsing hits on a foreign file
        raise common.CLIError(f"{path} is not an mlx-lm prompt-cache file ({type(e).__name__}: {e})") from None
    if not isinstance(cache, list) or not cache or not isinstance(meta, dict):
        raise common.CLIError(f"{path} holds no prompt cache")
    return cache, meta


def _held(cache: list[Any]) -> int:
    from ..codec import check_holds, held

    n, why = held(cache), check_holds(cache)
    if n is None or why:
        raise common.CLIError(f"the file's cache is inconsistent ({why or 'no layer has a length'}); nothing stored")
    return n


def _tokens(meta: dict[str, str], args: argparse.Namespace, model_dir: Path) -> list[int]:
    """The file's token ids: kvstore's metadata, else the re-tokenised ``--prompt-file``."""
    stored = meta.get(TOKENS_KEY)
    if stored is not None:
        try:
            tokens = json.loads(stored)
        except ValueError:
            tokens = None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise common.CLIError(f"{args.file}: metadata {TOKENS_KEY} is not a list of token ids; nothing stored")
        return tokens
    if args.prompt_file is None:
        raise common.CLIError(f"{args.file} holds no token ids (it was not made by `kvstore export`): pass "
                              "--prompt-file with the prompt given to mlx_lm.cache_prompt", 2)
    try:
        text = args.prompt_file.read_text()
    except OSError as e:
        raise common.CLIError(f"cannot read --prompt-file {args.prompt_file}: {e.strerror or e}") from None
    return cache_prompt_tokens(_tokenizer(model_dir), text)


def cache_prompt_tokens(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids ``mlx_lm.cache_prompt`` prefills for ``prompt`` (its own rule: a user
    turn left open when the model has a chat template, else the plain encoding)."""
    if getattr(tokenizer, "has_chat_template", False):
        toks = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=False, continue_final_message=True)
    else:
        toks = tokenizer.encode(prompt)
    return [int(t) for t in toks]


def _tokenizer(model_dir: Path) -> Any:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from mlx_lm.utils import load_tokenizer

        return load_tokenizer(model_dir)
    except Exception as e:
        raise common.CLIError(f"cannot load the tokenizer of {model_dir}: {e}") from None


def _open_store(args: argparse.Namespace, cache: list[Any]) -> Any:
    """A store whose identities carry the file's KV quantisation (mlx-lm's QuantizedKVCache)."""
    from ..layout import facts
    from ..store import KVStore, StoreOpenError

    quant = next((c for c in cache if facts(type(c).__name__).quantized), None)
    bits = (int(quant.bits), int(quant.group_size)) if quant is not None else (None, 64)
    try:
        return KVStore(common.cache_dir(args), max_entries=1, kv_bits=bits[0], kv_group_size=bits[1],
                       shared_dir=getattr(args, "shared_dir", False))
    except StoreOpenError as e:
        raise common.CLIError(str(e)) from None


def _check_fits(ident: Any, cache: list[Any], path: Path) -> None:
    """Refuse a cache whose layers or arrays are not what ``ident``'s model makes (every
    array's whole shape but the token axis, its dtype: ``fit.layout_problem``), before
    anything is stored: a batch of 2 or a fifth axis kills mlx_lm.server's generation
    thread at the first request that restores it."""
    from ..codec import Unsupported, encode_cache
    from ..fit import layout_problem

    try:
        why = layout_problem(ident, *encode_cache(cache))
    except Unsupported as e:
        why = str(e)
    if why:
        raise common.CLIError(f"{path} does not fit --model: {why}; nothing stored")


def _check_identity(store: Any, model_dir: Path, meta: dict[str, str]) -> Any:
    """``--model``'s identity, refused when the file names another one (its kvstore identity,
    or an mlx-lm ``model`` directory present here): only the same model reuses a cache."""
    from ..store import local_model_dir

    ident = store.identity(model_dir)
    if ident is None or store.disk is None:
        raise common.CLIError(f"cannot derive a store identity for {model_dir}")
    named = meta.get(IDENTITY_KEY)
    if named is None and meta.get("model"):
        there = local_model_dir(meta["model"])
        other = store.identity(there) if there is not None else None
        named = other.hex if other is not None else None
    if named is not None and named != ident.hex:
        raise common.CLIError(f"the file was made with another model (identity {named[:12]}, "
                              f"{meta.get('model', '?')}) than --model {model_dir} (identity {ident.hex[:12]}); "
                              "nothing stored")
    return ident
