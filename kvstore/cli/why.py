"""``kvstore why``: what the store holds for a request, where the request parts from it, and why.

The request (a text file, or an OpenAI chat-completions or Anthropic Messages body as JSON)
is rendered and tokenised as ``kvstore serve`` would (``serve.prompts.request_tokens``:
mlx_lm.server's own ``_tokenize``, the model's tokenizer and chat template; no weights are
loaded), its identity derived as the server derives it, and the index read (read-only) for
every entry of the same model directory: those of its own identity (the longest prefix the
store can serve it, and where the nearest entry parts from it) and those of other identities
of that directory (a changed chat template, tokenizer, KV quantisation...: which component
differs). The reasons are ``kvstore.misses``'s; what only the serving process knows (an entry
evicted from memory and never written, the shared tier's skips) is in its log and
``/v1/cache/stats``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import misses
from ..escape import visible
from ..options import StoreOptions
from . import common

def setup_arg_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "why", help="why a request misses: what the store holds for it, where it diverges and why",
        description="Tokenise a request as `kvstore serve` would (the model's tokenizer and chat template; "
                    "no weights are loaded) and print what the store holds for it: the identity the model "
                    "resolves to, the longest stored prefix it shares, where it diverges from the nearest "
                    "stored entry (token index and the text either side), the reason, and entries other "
                    "identities of the same model directory hold (naming the component that differs).")
    p.add_argument("request", metavar="REQUEST",
                   help="a text file (a completion's prompt), or a JSON file holding an OpenAI chat-completions "
                        "or Anthropic Messages request body; - reads stdin")
    p.add_argument("--model", required=True, metavar="DIR", help="the model directory the server serves (--model)")
    p.add_argument("--kv-bits", type=int, default=None, help="the server's --kv-bits (part of the identity)")
    p.add_argument("--kv-group-size", type=int, default=StoreOptions.kv_group_size,
                   help=f"the server's --kv-group-size (default {StoreOptions.kv_group_size})")
    p.add_argument("--chat-template", default=None, help="the server's --chat-template, if it was given one")
    p.add_argument("--chat-template-args", type=json.loads, default={}, metavar="JSON",
                   help="the server's --chat-template-args")
    p.add_argument("--sort-tools", action="store_true", help="the server runs with --sort-tools")
    p.add_argument("--keep-billing-header", action="store_true", help="the server runs with --keep-billing-header")
    p.add_argument("--stable-prefix", action="store_true",
                   help="on by default, as in kvstore serve: render the request as the server would (the cache "
                        "directory's records of the session's first values and its salt's learned spans are read, "
                        "never written) and say what moved")
    p.add_argument("--no-stable-prefix", action="store_true", help="the server runs with --no-stable-prefix")
    p.add_argument("--no-learned-spans", action="store_true", help="the server runs with --no-learned-spans")
    p.add_argument("--volatile", action="append", default=[], metavar="REGEX", help="the server's --volatile rules")
    common.add_cache_dir(p)
    common.add_json(p)
    return p


@dataclass
class Nearest:
    """The stored entry of one identity that shares the most tokens with the request."""

    key: bytes
    tokens: list[int]
    common: int    # tokens it shares with the request
    serves: int    # tokens the store could restore for the request from this identity's entries
    cut_refused: bool  # it shares more than it serves because its cache cannot be cut there


def _read_request(path: str) -> Any:
    import sys

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise common.CLIError(f"cannot read the request {path}: it is not UTF-8 text (byte {e.start}: "
                              f"{e.object[e.start:e.start + 1]!r}); save it as UTF-8") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise common.CLIError(f"cannot read the request {path}: its JSON is nested too deeply") from None
    except ValueError:
        return text
    return body if isinstance(body, dict) else text


def _nearest(request: list[int], entries: list[tuple[bytes, Any, bytes]]) -> Nearest | None:
    """Over ``(key, record, encoded tokens)`` of one identity: the nearest entry
    (``misses.rank``, the order the server's lookup picks by), and the most any of them serves (``floors.serves``: a prefix entry in full, a
    longer one cut back where it can be; a chunked one to its last whole chunk)."""
    from ..floors import serves
    from ..keys import common_tokens, decode_tokens, encode_tokens

    enc = encode_tokens(request)
    n_q = len(request)
    best: Nearest | None = None
    most = refused_at = 0
    for key, rec, toks in entries:
        c = common_tokens(enc, toks)
        cut = serves(rec.n, c, n_q, rec.trimmable)
        got = cut or 0
        if cut is None:  # its cache cannot be cut where the request parts from it
            refused_at = max(refused_at, min(c, rec.n, n_q - 1))
        if rec.chunked:  # its whole chunks serve without a cut
            got = max(got, min(c, rec.n, n_q - 1) // rec.chunk * rec.chunk)
        most = max(most, got)
        if best is None or misses.rank(c, rec.n, n_q) > misses.rank(best.common, len(best.tokens), n_q):
            best = Nearest(key, decode_tokens(toks), c, 0, False)
    if best is not None:
        best.serves, best.cut_refused = most, refused_at > most
    return best


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``why`` prints, as plain data (what --json prints)."""
    from ..cachedir import MEMO
    from ..identity import DigestMemo, model_identity
    from ..index import scan
    from ..store import local_model_dir
    from ..serve.prompts import render_request
    from ..salt import salt_of_body, salted
    from .inspect import readable

    model = local_model_dir(args.model)
    if model is None:
        raise common.CLIError(f"--model {args.model} is not a local model directory")
    try:
        body = _read_request(args.request)
    except OSError as e:
        raise common.CLIError(f"cannot read the request {args.request}: {e.strerror or e}") from None
    disk = common.open_disk(args, index_only=True)
    try:
        snap = scan(disk.index, full=True)
    finally:
        disk.close()
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from mlx_lm.utils import load_tokenizer

    extra = {"chat_template": args.chat_template} if args.chat_template else None
    tokenizer = load_tokenizer(model, tokenizer_config_extra=extra)
    stable = _stable(args, body)
    try:
        salt = salt_of_body(body) if isinstance(body, dict) else None
        rendered = render_request(tokenizer, body, sort_tools=args.sort_tools,
                                  keep_billing_header=args.keep_billing_header,
                                  chat_template_args=args.chat_template_args, stable=stable)
        request = rendered.tokens
    except RecursionError:
        raise common.CLIError("cannot render the request: it is nested too deeply") from None
    except ValueError as e:  # salt.SaltError too: the server's 400
        raise common.CLIError(f"cannot render the request: {e}") from None
    # the digests the servers of this directory remembered: the weights are not read again
    memo = DigestMemo(common.cache_dir(args) / MEMO, write=False)
    # the body's cache_salt files its entries under another identity, as the server does
    ident = salted(model_identity(model, kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, memo=memo), salt)
    assert ident is not None
    decode = readable(lambda ids: str(tokenizer.decode(ids)))
    path = ident.info.get("path")
    by_identity: dict[str, list[tuple[bytes, Any, bytes]]] = {}
    for key, rec in snap.entries.items():
        toks = snap.tokens.get(key)
        if rec is not None and toks is not None:
            by_identity.setdefault(rec.identity.hex(), []).append((key, rec, toks))
    own = _nearest(request, by_identity.get(ident.hex, []))
    others: list[dict[str, Any]] = []
    for hx, items in by_identity.items():
        info = snap.identities.get(hx)
        if hx == ident.hex or info is None or info.path != path:
            continue
        near = _nearest(request, items)
        others.append({"identity": hx, "entries": len(items), "differs": misses.differing(info.info, ident.info),
            "shared_tokens": near.common if near else 0, "serves": near.serves if near else 0,
            "nearest": common.short_id(near.key) if near else None})
    others.sort(key=lambda o: (-int(o["serves"]), len(o["differs"])))  # on a tie, the nearest identity
    out = _verdict(args, ident, request, own, others, len(by_identity.get(ident.hex, [])), decode, str(disk.root))
    out["part"] = _part(out, request, own, rendered, tokenizer)
    out["stable_prefix"] = stable.moved.as_json() if stable is not None and stable.moved is not None else None
    out["stable_prefix_said"] = stable.moved.describe() if stable is not None and stable.moved is not None else None
    learner = stable.memory.learner if stable is not None else None
    out["learned_spans"] = [x.as_json() for x in learner.learned(stable.salt_key)] if learner is not None else []
    return out


def _stable(args: argparse.Namespace, body: Any) -> Any:
    """The server's ``--stable-prefix`` for ``request_tokens`` (None when it runs without):
    the cache directory's records, read only, under the body's ``cache_salt``."""
    if args.no_stable_prefix:
        return None
    from ..serve import stable_prefix
    from ..salt import salt_key

    try:
        rules = stable_prefix.BUILTIN + stable_prefix.user_rules(args.volatile)
    except ValueError as e:
        raise common.CLIError(str(e)) from None
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return stable_prefix.Render(rules, stable_prefix.Memory(common.cache_dir(args), write=False,
                                                            learn=not args.no_learned_spans),
                                salt_key(salt) if isinstance(salt, str) and salt else None)


def _part(out: dict[str, Any], request: list[int], own: Nearest | None, rendered: Any, tokenizer: Any) -> Any:
    """Where in the request the verdict's miss starts (``kvstore.parts``), as the server
    names it: ``{"part": kind, "where": phrase}``, or None (no miss, or not a chat request)."""
    from ..serve.rendered import Rendered

    if out["reason"] is None or rendered.messages is None:
        return None
    at = out["nearest"]["shared_tokens"] if out["reason"] != misses.OTHER_IDENTITY and own is not None else 0
    miss = misses.Miss(out["reason"], len(request), out["serves"], at, len(own.tokens) if own else 0,
                       detail=out["detail"], after=tuple(own.tokens[at:at + 32]) if own else ())
    chat = Rendered(rendered.messages, rendered.tools, tokenizer, rendered.template_args, len(request),
                    tuple(request[-4:]), rendered.blocks)
    part = chat.name(request)(miss)
    return {"part": part.kind, "where": part.said()}


def _verdict(args: argparse.Namespace, ident: Any, request: list[int], own: Nearest | None,
             others: list[dict[str, Any]], n_own: int, decode: Callable[[list[int]], str], root: str) -> dict[str, Any]:
    n = len(request)
    served = own.serves if own else 0
    best_other = others[0] if others else None
    reason: str | None = None
    detail = ""
    at = own.common if own else 0
    stored = len(own.tokens) if own else 0
    if best_other is not None and best_other["serves"] > served:
        reason, detail = misses.OTHER_IDENTITY, ", ".join(best_other["differs"]) or "unknown"  # as the server says
        at, stored = best_other["shared_tokens"], best_other["shared_tokens"]
    elif own is not None and own.cut_refused:
        reason = misses.CUT_REFUSED
    elif own is not None and 0 < at < min(stored, n):
        reason = misses.DIVERGED
    out: dict[str, Any] = {
        "cache_dir": root, "model": {"name": ident.name, "path": ident.info.get("path"), "identity": ident.hex},
        "request_tokens": n, "entries": n_own, "serves": served, "reason": reason, "detail": detail,
        # what the server's log and stats count for this miss (``Miss.lost``): one computation
        "lost_tokens": misses.held_past(stored, n, served) if reason is not None else 0,
        "nearest": None, "other_identities": others,
    }
    if own is not None:
        before, now = misses.around(request, own.common, decode)
        _, held = misses.around(own.tokens, own.common, decode)
        out["nearest"] = {"entry": common.short_id(own.key), "tokens": len(own.tokens), "shared_tokens": own.common,
                          "diverges_at": own.common if own.common < min(len(own.tokens), n) else None,
                          "before": before, "request_after": now, "stored_after": held}
    return out


def run(args: argparse.Namespace) -> int:
    info = collect(args)
    if args.json:
        common.print_json(info)
        return 0
    m, n = info["model"], info["request_tokens"]
    print(f"model       {m['name']}  identity {m['identity'][:12]}  {m['path']}")
    print(f"request     {n} tokens")
    near = info["nearest"]
    if near is None:
        print("stored      nothing under this identity")
    else:
        print(f"stored      {common.plural(info['entries'], 'entry', 'entries')} under this identity; "
              f"the nearest, {near['entry']} ({near['tokens']} tokens), shares {near['shared_tokens']} tokens")
        print(f"servable    {info['serves']} of {n} tokens at most ({n - info['serves']} to prefill; from disk only "
              f"above --min-disk-hit)")
        if info["lost_tokens"]:
            print(f"recomputes  {info['lost_tokens']} tokens the stored prefix held (the server's miss_lost_tokens)")
        if near["diverges_at"] is not None:
            print(f"diverges    at token {near['diverges_at']}: \"{near['before']}\"")
            print(f"  request   then \"{near['request_after']}\"")
            print(f"  stored    then \"{near['stored_after']}\"")
    for o in info["other_identities"]:
        print(f"other       identity {o['identity'][:12]} of this model directory ({', '.join(o['differs']) or '?'} "
              f"differ{'s' if len(o['differs']) == 1 else ''}): {common.plural(o['entries'], 'entry', 'entries')}, "
              f"the nearest shares {o['shared_tokens']} tokens")
    if info.get("stable_prefix_said"):
        print(f"stable      {info['stable_prefix_said']}")
    for x in info.get("learned_spans", []):
        before, after = visible(x["before"][-60:], newlines=False), visible(x["after"][:60], newlines=False)
        print(f'learned     {x["name"]}: the lines between "{before}" and "{after}"')
    reason = info["reason"]
    if reason is None:
        why = ("the store serves all it holds of this request" if info["serves"] else
               "nothing stored shares a prefix with this request")
    else:
        why = f"{reason}: {misses.SAID[reason]}{' (' + info['detail'] + ')' if info['detail'] else ''}"
    print(f"why         {why}")
    if info.get("part"):
        print(f"part        {info['part']['where']}")
    return 0
