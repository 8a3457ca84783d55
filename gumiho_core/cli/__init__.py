"""Command line: `python launch.py [serve]`, `generate`, `bench`, `train-data`, `train`, `export-heads`.

The top of the house: each subcommand module here turns flags into calls of the library
(gumiho_core, app); nothing below imports this package. Errors the user can fix print one
line (`error: ...`) and exit with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import GumihoError
from . import bench, generate, serve, train

SUBCOMMANDS = (serve, generate, bench, train)  # each adds its subparsers, in this order in --help


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="launch.py", description="gumiho-chat: local chat with Gumiho decoding")
    sub = parser.add_subparsers(dest="command")
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]  # `python launch.py` serves the chat
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except GumihoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
