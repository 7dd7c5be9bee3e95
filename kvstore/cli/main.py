"""The ``kvstore`` dispatcher (mlx-lm style: one module per command, imported lazily).

Only the module of the command being run is imported, so a command whose module is missing
or broken (``serve`` is optional) never breaks the others. ``kvstore --help`` lists every
command from the table below without importing any of them.

Exit codes: 0 fine, 1 problems found or the operation failed (the message says what to
do), 2 usage errors (argparse's), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

# command -> (module under kvstore.cli, one-line help). A module may register several
# commands (pin.py registers pin and unpin).
COMMANDS: dict[str, tuple[str, str]] = {
    "ls": ("ls", "list cached entries, grouped by model identity"),
    "stats": ("stats", "totals by identity and tier, index and blob bytes, hits, free space"),
    "inspect": ("inspect", "show one entry in full: prompt, chunks, layers, dtype, checksums"),
    "verify": ("verify", "check every record against its blobs and every blob against the index"),
    "gc": ("gc", "enforce size and age budgets, drop models, remove orphans and temp files"),
    "why": ("why", "why a request misses: what the store holds for it, where it diverges and why"),
    "warm": ("warm", "prefill a system prompt or chat into the store ahead of traffic"),
    "pin": ("pin", "exempt an entry from age eviction, and evict it last by size"),
    "unpin": ("pin", "make a pinned entry evictable again"),
    "export": ("transfer", "write an entry (a system prompt, to continue) as an mlx-lm prompt-cache file"),
    "import": ("transfer", "store an mlx-lm prompt-cache file (mlx_lm.cache_prompt) as an entry"),
    "serve": ("serve", "run an mlx-lm server backed by the store"),
    "vllm-mlx": ("vllm_mlx", "run vllm-mlx's server (any engine) backed by the store"),
}
# commands that run a model: as a process's entry point they preload OpenBLAS (kvstore.blas)
MODEL_COMMANDS = {"serve", "warm", "vllm-mlx"}

DESCRIPTION = ("Manage a kvstore cache directory: a persistent, disk-backed KV-cache tier for "
               "MLX inference. Every command works while servers are using the directory.")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("kvstore")
    except Exception:
        return "unknown"


class _Version(argparse.Action):
    """``--version``, read from the package metadata only when asked for
    (``importlib.metadata`` costs ~0.1 s of every command's start-up)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        parser.exit(message=f"kvstore {_version()}\n")


def _parser(command: str | None, module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description=DESCRIPTION)
    parser.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if module is not None:  # the command's own parser only: a parser each costs start-up
        module.setup_arg_parser(sub)
        return parser
    for name, (_mod, help_) in COMMANDS.items():  # placeholders: listed in --help, never parsed
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def _command(argv: list[str]) -> str | None:
    for a in argv:
        if a in ("-h", "--help", "--version"):
            return None
        if not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one command. ``argv=None`` means this is the process's entry point (the
    ``kvstore`` script, ``python -m kvstore.cli``): only then may ``serve`` and ``warm``
    re-execute the process with OpenBLAS preloaded."""
    entry = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    name = _command(argv)
    if entry and name in MODEL_COMMANDS and not {"-h", "--help"} & set(argv):
        from .. import blas

        blas.preload_openblas()  # returns only when there is nothing to preload
        blas.announce()
    module = None
    if name in COMMANDS:
        modname = f"{__package__}.{COMMANDS[name][0]}"
        try:
            module = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name != modname:
                raise
            print(f"kvstore: error: `kvstore {name}` is not available in this installation "
                  f"(no module {modname})", file=sys.stderr)
            return 1
    parser = _parser(name if module else None, module)
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: usage error (2) or --help / --version (0)
        return int(e.code or 0) if isinstance(e.code, int) or e.code is None else 2
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    return _run(module, args)


def _run(module: Any, args: argparse.Namespace) -> int:
    """Run a parsed command; the errors a user can act on become one line and an exit code."""
    from . import common
    from .common import CLIError, error

    from ..escape import VisibleWriter

    out = sys.stdout
    if args.command not in ("serve", "vllm-mlx") and not getattr(args, "json", False):
        sys.stdout = VisibleWriter(out)  # prompts, names, paths: stored by others, shown to an operator
    try:
        return int(module.run(args) or 0)
    except CLIError as e:
        error(str(e))
        return e.code
    except KeyboardInterrupt:
        print("kvstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvstore ls | head`
        try:
            out = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except OSError as e:  # the process or the system (out of file descriptors, EIO), not a record
        where = f" ({e.filename})" if e.filename else ""
        error(f"{e.strerror or e}{where}: stopped; no record was changed because of it")
        return 1
    except Exception as e:
        import lmdb  # a damaged index surfaces as an lmdb error from any read

        if not isinstance(e, lmdb.Error):
            raise
        error(f"cannot read the index ({type(e).__name__}: {e}): "
              f"{common.run_hint('verify', getattr(args, 'cache_dir', None))} for details")
        return 1
    finally:
        if sys.stdout is not out:
            try:
                sys.stdout.flush()
            except OSError:
                pass
        sys.stdout = out
