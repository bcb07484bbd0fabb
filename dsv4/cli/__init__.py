"""`dsv4` command line. Each subcommand lives in its own module, which exposes
`register(subparsers)`; this file only collects them."""
from __future__ import annotations

import argparse
import importlib
import sys

# module path -> provides register(subparsers) that adds one or more subcommands
SUBCOMMAND_MODULES = (
    "dsv4.cli.check",
    "dsv4.cli.init_random",
    "dsv4.cli.convert",
    "dsv4.cli.bench",
    "dsv4.cli.plan",
    "dsv4.cli.generate",
    "dsv4.cli.serve",
    "dsv4.cli.router",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 serving engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
