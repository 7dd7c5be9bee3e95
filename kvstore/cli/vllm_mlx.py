"""``kvstore vllm-mlx serve MODEL [vllm-mlx flags] [kvstore flags]``: vllm-mlx's own CLI and
server, with kvstore installed in whichever engine its flags select.

- ``--continuous-batching``: the batched engine's ``MemoryAwarePrefixCache`` gets kvstore's
  disk tier (kvstore.adapters.vllm_mlx_batched); ``--use-paged-cache`` is refused;
- otherwise SimpleEngine: ``--prefix-trie-cache`` gets kvstore's prompt cache
  (kvstore.adapters.vllm_mlx), and its system-prompt KV slots persist
  (kvstore.adapters.vllm_mlx_system).

kvstore's own flags are taken out before vllm-mlx parses the rest, unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from ..options import StoreOptions
from ..units import parse_size

# kvstore's flags: a store option each (``kvstore.options``), spelt --with-dashes, and its parser
KV_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--" + name.replace("_", "-"): (name, conv) for name, conv in (
        ("cache_dir", str), ("max_disk_bytes", parse_size), ("persist", str), ("max_write_bytes_per_day", parse_size))
}
USAGE = ("usage: kvstore vllm-mlx serve MODEL [vllm-mlx serve flags] [--cache-dir DIR] "
         "[--max-disk-bytes SIZE] [--persist {all,system,reused}] [--max-write-bytes-per-day SIZE]")
KV_HELP = """kvstore's flags (taken out before vllm-mlx parses the rest):
  --cache-dir DIR       where the disk tier stores entries (default: $KVSTORE_DIR, else the
                        user cache dir's kvstore/cache)
  --max-disk-bytes SIZE disk budget, e.g. 20G (LRU eviction; default: none)
  --persist {all,system,reused}
                        what is written to disk: every new prefix (all, the default), system
                        prompts only (system), or a prefix seen a second time (reused)
  --max-write-bytes-per-day SIZE
                        stop writing to disk once this much was written today (UTC), e.g. 50G

vllm-mlx's flags follow (`vllm-mlx serve --help`)."""


def setup_arg_parser(subparsers: "argparse._SubParsersAction") -> None:
    # every argument goes to vllm-mlx's parser (see serve.py for why prefix_chars="\0")
    p = subparsers.add_parser("vllm-mlx", add_help=False, prefix_chars="\0",
                              help="vllm-mlx's server (its CLI, any engine) with kvstore's disk tier")
    p.add_argument("args", nargs=argparse.REMAINDER)


def split_args(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """(the store options kvstore's flags set, the arguments left for vllm-mlx): what
    ``install_all`` takes, each engine's defaults under it. Raises ValueError naming a
    kvstore flag without a value or with a bad one."""
    options: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in KV_FLAGS:
            key, conv = KV_FLAGS[name]
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} needs a value")
                val, i = argv[i + 1], i + 1
            try:
                options[key] = conv(val)
            except (ValueError, argparse.ArgumentTypeError) as e:  # sizes: units.parse_size, e.g. 20G
                raise ValueError(f"{name}: not a valid value: {val!r} ({e})") from None
        else:
            rest.append(a)
        i += 1
    if "persist" in options and options["persist"] not in ("all", "system", "reused"):
        raise ValueError(f"--persist must be one of all, system, reused (got {options['persist']!r})")
    return options, rest


def run(args: argparse.Namespace) -> int:
    argv = list(args.args)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + KV_HELP, file=sys.stderr)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"kvstore vllm-mlx: error: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        options, rest = split_args(argv[1:])
    except ValueError as e:
        print(f"kvstore vllm-mlx: error: {e}\n{USAGE}", file=sys.stderr)
        return 2
    if "--use-paged-cache" in rest:
        from ..adapters.vllm_mlx_batched import PAGED_REFUSAL

        print(f"kvstore vllm-mlx: error: {PAGED_REFUSAL}", file=sys.stderr)
        return 2
    helping = "-h" in rest or "--help" in rest
    if helping:  # ours first, then vllm-mlx's own (its parser prints them and exits)
        print(USAGE + "\n\n" + KV_HELP + "\n", flush=True)
    from ..adapters import vllm_mlx as kv_vllm

    try:
        kv_vllm.install_all(**options)
    except ModuleNotFoundError as e:
        print(f"kvstore vllm-mlx: error: {e}", file=sys.stderr)
        return 1
    if not helping:
        print(f"kvstore vllm-mlx: {disk_tier_line(options, rest)}", file=sys.stderr, flush=True)
    from vllm_mlx.cli import main as vllm_main

    sys.argv = ["vllm-mlx", "serve", *rest]
    try:
        vllm_main()
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def disk_tier_line(options: dict[str, Any], rest: list[str]) -> str:
    """What the start says of the disk tier: on, where, its budget, and in which engine."""
    from ..cachedir import default_cache_dir

    o = StoreOptions().but(**options)
    where, budget = o.cache_dir or default_cache_dir(), o.max_disk_bytes
    engine = ("the batched engine's prefix cache (--continuous-batching)" if "--continuous-batching" in rest
              else "SimpleEngine's system-prompt KV slots" + (" and its --prefix-trie-cache"
                                                              if "--prefix-trie-cache" in rest else ""))
    return (f"disk tier on: entries in {where} ({f'at most {budget:,} bytes' if budget else 'no disk budget'}, "
            f"--persist {o.persist}), under {engine}")
