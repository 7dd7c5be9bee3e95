"""``kvstore serve``: see kvstore.serve.server."""

from __future__ import annotations

import argparse


def setup_arg_parser(subparsers: "argparse._SubParsersAction") -> None:
    # prefix_chars="\0": argparse's REMAINDER refuses arguments that start with "--",
    # so this parser treats none as options and hands them all to kvstore.serve.server
    p = subparsers.add_parser("serve", add_help=False, prefix_chars="\0",
                              help="mlx_lm.server with a persistent kvstore prompt cache")
    p.add_argument("args", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    from ..serve.server import main
    from .progress import Progress

    return main(args.args, progress=Progress)
