"""``kvstore inspect ENTRY``: one entry in full."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

from . import common


HEAD_TOKENS = 32  # tokens of the prompt shown by default: prompts are the sensitive part of a cache


def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect", help="show one entry in full: token counts, prompt start, chunks, layers, dtype, blob sizes",
        description="Show one entry: token counts, the text of its first "
                    f"{HEAD_TOKENS} tokens decoded with the model's tokenizer (when its directory "
                    "still exists; --prompt for the whole prompt), its chunks and tail, cache "
                    "layers and classes, KV dtype, bytes, and whether every blob is there at "
                    "the size the index says (exit 1 if one is not). Reads headers and records "
                    "only, so it stays fast on a long entry; --verify also reads every byte and "
                    "checks each segment's checksum (as `kvstore verify` does).")
    p.add_argument("entry", metavar="ENTRY", help="entry id or any unique hex prefix of it (see `kvstore ls`)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--prompt", action="store_true",
                       help="print the whole prompt (and put it in --json), not just its start")
    shown.add_argument("--no-prompt", action="store_true", help="do not load the tokenizer to decode the prompt")
    p.add_argument("--tokens", action="store_true", help="also print the token ids")
    p.add_argument("--verify", action="store_true",
                   help="also read every segment and check its checksum (reads the whole entry)")
    common.add_cache_dir(p)
    common.add_json(p)
    return p


def load_decoder(model_path: str | None) -> tuple[Callable[[list[int]], str] | None, str | None]:
    """(decode, None), or (None, why not). Never raises: a tokenizer that cannot be found or
    loaded only costs the decoded prompt. transformers' tokenizer first (what mlx-lm's
    tokenizer wrapper decodes with, without importing MLX); mlx-lm's loader (which imports
    MLX) only for a directory transformers cannot load."""
    if not model_path:
        return None, "the identity records no model path"
    if not Path(model_path).is_dir():
        return None, f"model directory {model_path} no longer exists"
    from ..files import special_files

    odd = special_files(Path(model_path))  # a tokenizer library would block on a FIFO there
    if odd:
        return None, f"{odd[0]} is not a regular file"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    errors = []
    fast = tokenizer_json_decoder(Path(model_path))
    if fast is not None:
        return readable(fast), None
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        return readable(lambda ids: str(hf.decode(ids))), None
    except Exception as e:
        errors.append(f"transformers: {e}")
    try:
        try:  # mlx-lm 0.32: mlx_lm.utils.load_tokenizer; 0.31: tokenizer_utils.load_tokenizer
            from mlx_lm.utils import load_tokenizer
        except ImportError:
            from mlx_lm.tokenizer_utils import load_tokenizer  # type: ignore[no-redef, attr-defined]
        tok = load_tokenizer(Path(model_path))
        return readable(lambda ids: str(tok.decode(ids))), None
    except Exception as e:
        errors.append(f"mlx_lm: {e}")
    return None, f"could not load a tokenizer from {model_path} ({'; '.join(errors)})"


def tokenizer_json_decoder(model_dir: Path) -> Callable[[list[int]], str] | None:
    """The model's ``tokenizer.json`` decoding as transformers' fast tokenizer does (the
    same Rust ``tokenizers`` object underneath), in ~0.05 s instead of importing
    transformers (2-6 s); None when there is no such file, it does not load, or the
    tokenizer config asks for transformers' space clean-up on decode."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        import json

        config = model_dir / "tokenizer_config.json"
        if config.is_file() and json.loads(config.read_text()).get("clean_up_tokenization_spaces"):
            return None
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception:
        return None
    return lambda ids: str(tok.decode(ids, skip_special_tokens=False))


_DECODABLE = range(0, 1 << 31)  # ids every tokenizer's decode takes (a Rust u32 / C int); others are shown as ids


def readable(decode: Callable[[list[int]], str]) -> Callable[[list[int]], str]:
    """``decode`` for any stored ids: an entry holds signed 64-bit ids (format 4), such as
    mlx_lm.server's negative image ids, which a tokenizer refuses (OverflowError). Those,
    and any id its decode refuses, are shown as ``[id N]`` (a run of one id as
    ``[id N xCOUNT]``: an image's patches) between the decoded text of the others."""
    def text(ids: list[int]) -> str:  # ids in _DECODABLE
        try:
            return decode(ids)
        except Exception:  # an id out of this tokenizer's range: the others still decode
            return f"[id {ids[0]}]" if len(ids) == 1 else "".join(text([t]) for t in ids)

    def run(ids: list[int]) -> str:
        out, i = [], 0
        while i < len(ids):
            ok, j = ids[i] in _DECODABLE, i + 1
            while j < len(ids) and (ids[j] in _DECODABLE if ok else ids[j] == ids[i]):
                j += 1
            out.append(text(ids[i:j]) if ok else f"[id {ids[i]}{f' x{j - i}' if j > i + 1 else ''}]")
            i = j
        return "".join(out)
    return run


def _pieces(disk, key: bytes, rec: Any, check: Any) -> list[dict[str, Any]]:
    """The entry's chunks and own segment, each with its state (as verify checks it)."""
    from ..records import RecordError

    C = rec.chunk
    pieces = []
    for i, ck in enumerate(rec.chunks):
        piece: dict[str, Any] = {"piece": "chunk", "key": ck.hex(), "tokens": [i * C, (i + 1) * C]}
        try:
            crec = disk.index.chunk(ck)
        except RecordError as e:
            crec, piece["detail"] = None, str(e)
        if crec is None:
            piece.update(bytes=0, refs=None, pack=None, state="missing_chunk",
                         detail=piece.get("detail") or "chunk record does not exist")
        else:
            pieces.append(piece)
            piece.update(_segment_state(check, crec.segment), refs=crec.refs)
            continue
        pieces.append(piece)
    for seg in rec.segments:
        k0 = len(rec.chunks) * C if rec.chunked else 0
        pieces.append({"piece": "tail" if rec.chunked else "snapshot", "key": key.hex(), "tokens": [k0, rec.n],
                       "refs": None, **_segment_state(check, seg)})
    return pieces


def _segment_state(check: Any, seg: Any) -> dict[str, Any]:
    bad = check.problem(seg)
    return {"bytes": seg.length, "pack": seg.pack.hex(), "offset": seg.offset, "checksum": seg.checksum.hex(),
            "state": bad[0] if bad else "ok", "detail": bad[1] if bad else None}


def collect(disk, key: bytes, rec: Any, *, prompt: str = "head", with_tokens: bool = False,
            verify: bool = False) -> dict[str, Any]:
    """Everything about one entry. ``prompt``: "head" decodes the first HEAD_TOKENS tokens
    (``prompt_head``), "full" the whole prompt too (``prompt``; None otherwise), "none"
    loads no tokenizer. Each piece's pack is checked to be there at its recorded size;
    ``verify`` also hashes every segment (``checksums_ok``, None without it): a long
    entry is gigabytes, which took seconds to read for a look at it (issue 47)."""
    from ..keys import decode_tokens
    from ..maintenance import SegmentCheck

    info = disk.index.identities().get(rec.identity.hex())
    raw = disk.index.tokens(key)
    tokens = decode_tokens(bytes(raw)) if raw is not None else None
    packs = {s.pack: disk.index.pack(s.pack) for s in rec.segments}
    for ck in rec.chunks:
        c = disk.index.chunk(ck)
        if c is not None:
            packs[c.segment.pack] = disk.index.pack(c.segment.pack)
    with SegmentCheck(disk, packs, checksums=verify) as check:
        pieces = _pieces(disk, key, rec, check)
    seg = common.first_segment(disk, rec)
    header = common.segment_header(disk, seg) if seg is not None else None
    tensors = {k: {"dtype": st, "shape": list(shape)} for k, (st, shape) in (header.specs if header else {}).items()}
    head = text = None
    why: str | None = "not requested (--no-prompt)"
    if tokens is None:
        why = "no token ids stored for this entry"
    elif prompt != "none":
        decode, why = load_decoder(info.path if info else None)
        if decode is not None:
            head = decode(tokens[:HEAD_TOKENS])
            text = decode(tokens) if prompt == "full" else None
    layers = [{"index": i, **m} for i, m in enumerate(common.header_layout(header))]
    out = {
        "id": common.short_id(key), "key": key.hex(), "identity": rec.identity.hex(),
        "model": {"name": info.name if info else None, "path": info.path if info else None,
                  "model_type": info.get("model_type") if info else None,
                  "present": common.model_present(info), "versions": info.get("versions") if info else None},
        "tokens": rec.n, "kind": "chunked" if rec.chunked else "snapshot", "cache_type": rec.cache_type,
        "chunk_tokens": rec.chunk, "trimmable": rec.trimmable,
        "created": rec.created, "last_used": rec.last_used, "hits": rec.hits, "pinned": rec.pinned,
        "bytes": sum(p["bytes"] for p in pieces), "own_bytes": sum(s.length for s in rec.segments),
        "kv_dtype": common.kv_dtype(header), "tensors": tensors,
        "layers": layers, "pieces": pieces,
        "blobs_ok": all(p["state"] == "ok" for p in pieces), "checksums_checked": verify,
        "checksums_ok": all(p["state"] == "ok" for p in pieces) if verify else None,
        "prompt_head": head, "prompt_head_tokens": min(HEAD_TOKENS, len(tokens)) if head is not None and tokens is not None else 0,
        "prompt": text, "prompt_error": why,
    }
    if with_tokens:
        out["token_ids"] = tokens
    return out


def _layer_summary(layers: list[dict]) -> list[str]:
    """Consecutive layers of the same class and parameters, as ``"0-27  KVCache"``."""
    def sig(m: dict) -> str:
        params = {k: v for k, v in m.items() if k not in ("index", "class", "offset", "sub", "idx", "start")}
        s = m["class"] + (" " + " ".join(f"{k}={v}" for k, v in sorted(params.items())) if params else "")
        if m.get("sub"):
            s += " [" + ", ".join(sig(x) for x in m["sub"]) + "]"
        return s
    out, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or sig(layers[i]) != sig(layers[start]):
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{rng:>7}  {sig(layers[start])}")
            start = i
    return out


def run(args: argparse.Namespace) -> int:
    disk = common.open_disk(args)
    try:
        key, rec = common.resolve_entry(disk, args.entry)
        shown = "none" if args.no_prompt else "full" if args.prompt else "head"
        info = collect(disk, key, rec, prompt=shown, with_tokens=args.tokens, verify=args.verify)
    finally:
        disk.close()
    if args.json:
        common.print_json(info)
        return 0 if info["blobs_ok"] else 1
    hb = common.human_bytes
    m = info["model"]
    print(f"entry       {info['key']}  (id {info['id']})")
    print(f"model       {m['name'] or '?'}  identity {info['identity'][:12]}  "
          f"{m['path'] or ''}{'  (missing)' if m['present'] is False else ''}")
    print(f"tokens      {info['tokens']}  ({info['kind']}, {info['cache_type']}, "
          f"{'trimmable' if info['trimmable'] else 'not trimmable'}, chunk_tokens={info['chunk_tokens']})")
    print(f"kv dtype    {info['kv_dtype'] or '?'}")
    print(f"bytes       {hb(info['bytes'])}  ({info['bytes']} B; own blob {hb(info['own_bytes'])})")
    print(f"created     {common.iso(info['created'])}")
    print(f"last used   {common.iso(info['last_used'])} ({common.ago(info['last_used'])}), "
          f"{common.plural(info['hits'], 'hit')}{', PINNED' if info['pinned'] else ''}")
    print(f"layers      {len(info['layers'])}")
    for line in _layer_summary(info["layers"]):
        print(f"  {line}")
    ok = "all sizes and checksums match" if args.verify else "all there at their sizes (checksums not read: --verify)"
    print(f"blobs       {ok if info['blobs_ok'] else 'PROBLEMS (' + common.run_hint('verify --fix', args.cache_dir) + ')'}")
    rows = [[p["piece"], f"{p['tokens'][0]}-{p['tokens'][1]}", common.short_id(p["key"]), hb(p["bytes"]),
             "" if p["refs"] is None else p["refs"], p["state"] + (f": {p['detail']}" if p.get("detail") else "")]
            for p in info["pieces"]]
    print(common.table(rows, ["PIECE", "TOKENS", "KEY", "BYTES", "REFS", "CHECKSUM" if args.verify else "BLOB"],
                       right=(3, 4), indent="  "))
    n, shown = info["tokens"], info["prompt_head_tokens"]
    if info["prompt"] is not None:
        print(f"prompt      all {n} tokens:")
        print(info["prompt"])
    elif info["prompt_head"] is not None:
        rest = f"; `--prompt` prints all {n}" if shown < (n or 0) else ""
        print(f"prompt      first {shown} of {n} tokens{rest}:")
        print(info["prompt_head"] + (" [...]" if shown < (n or 0) else ""))
    else:
        print(f"prompt      {n} tokens (not decoded: {info['prompt_error']})")
    if args.tokens:
        print(f"token ids   {info['token_ids']}")
    return 0 if info["blobs_ok"] else 1
