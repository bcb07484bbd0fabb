"""Argument types shared by the subcommands (argparse `type=` callables)."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number (or inf), got {text}")
    return value


def add_connection_timeouts(group) -> None:
    """--header-timeout and --body-timeout (dsv4/serve/http/connection.py) of `dsv4 serve` and
    `dsv4 router`: seconds > 0 (inf: no limit)."""
    group.add_argument("--header-timeout", type=positive_float, default=60.0, metavar="S",
                       help="seconds a request's line and headers may take to arrive; a slower client gets "
                            "408 and its connection is closed (default: 60)")
    group.add_argument("--body-timeout", type=positive_float, default=60.0, metavar="S",
                       help="seconds a request's body may go without a byte arriving; then 408 and the "
                            "connection is closed (default: 60)")
