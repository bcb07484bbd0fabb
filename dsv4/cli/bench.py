"""`dsv4 bench MODE ...`: benchmarks. Each mode is one nested subcommand, declared with

    add_mode(name, help, configure_fn, run_fn)

at import time of this module (below): `configure_fn(parser)` adds the mode's flags and
`run_fn(args) -> int` runs it and returns the exit code.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

from . import bench_offline
from .args import positive_float, positive_int

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class BenchMode:
    name: str
    help: str
    configure: Configure
    run: Run


MODES: dict[str, BenchMode] = {}  # in the order `dsv4 bench --help` lists them


def add_mode(name: str, help: str, configure: Configure, run: Run) -> None:
    if name in MODES:
        raise ValueError(f"bench mode {name!r} is already registered")
    MODES[name] = BenchMode(name, help, configure, run)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks", description="Benchmarks. Pick a mode.")
    modes = bench.add_subparsers(dest="bench_mode", required=True, metavar="MODE")
    for mode in MODES.values():
        parser = modes.add_parser(mode.name, help=mode.help, description=mode.help)
        mode.configure(parser)
        parser.set_defaults(func=mode.run)


# ---- serve ---------------------------------------------------------------------------
def configure_serve(parser: argparse.ArgumentParser) -> None:
    from dsv4.bench.random_prompts import DEEPSEEK_PLAIN_VOCAB, FIRST_PLAIN_TOKEN_ID
    from dsv4.bench.sse_client import COMPLETIONS, ENDPOINTS
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="model name sent in each request")
    parser.add_argument("--endpoint", default=COMPLETIONS, choices=ENDPOINTS)
    parser.add_argument("--dataset", default="random", choices=("random", "multiturn"),
                        help="random: independent prompts; multiturn: --num-prompts conversations of --num-turns "
                             "turns, each resending the whole history")
    parser.add_argument("--input-len", type=positive_int, default=1024,
                        help="prompt tokens per request (multiturn: new user words per turn)")
    parser.add_argument("--output-len", type=positive_int, default=128, help="generated tokens per request")
    parser.add_argument("--num-prompts", type=positive_int, default=100, help="requests (multiturn: conversations)")
    parser.add_argument("--num-turns", type=positive_int, default=None, help="multiturn: turns per conversation "
                                                                             "(default 4)")
    parser.add_argument("--prefix-len", type=int, default=None,
                        help="multiturn: words of a system prompt every conversation shares (default 0)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None,
                        help="requests in flight at most (default: no limit)")
    parser.add_argument("--request-rate", type=positive_float, default=math.inf,
                        help="Poisson arrivals per second (default inf: all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=positive_int, default=DEEPSEEK_PLAIN_VOCAB,
                        help=f"completions prompts are token ids in [{FIRST_PLAIN_TOKEN_ID}, vocab-size)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--request-timeout", type=positive_float, default=3600.0,
                        help="seconds without progress before a request fails")
    parser.add_argument("--save-result", metavar="FILE", help="write the result JSON here")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_serve(args: argparse.Namespace) -> int:
    """Exit code 0 when at least one request succeeded, 1 when all failed, 2 on bad flags."""
    from dsv4.bench.serve import ServeBenchConfig, run_serve_benchmark, save_result
    from dsv4.bench.serve_metrics import format_table
    try:
        cfg = ServeBenchConfig(
            base_url=args.base_url, model=args.model, input_len=args.input_len, output_len=args.output_len,
            num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
            request_rate=args.request_rate, endpoint=args.endpoint, dataset=args.dataset, seed=args.seed,
            vocab_size=args.vocab_size, api_key=args.api_key, request_timeout=args.request_timeout,
            show_progress=not args.disable_tqdm, **_multiturn_settings(args))
    except ValueError as e:
        print(f"dsv4 bench serve: {e}", file=sys.stderr)
        return 2
    result = run_serve_benchmark(cfg)
    print(format_table(result))
    if args.save_result:
        save_result(args.save_result, result)
    if args.json:
        print(json.dumps(result))
    return 0 if result["completed"] else 1


def _multiturn_settings(args: argparse.Namespace) -> dict:
    """--num-turns / --prefix-len for the multiturn dataset (defaults 4 / 0); given with another
    dataset they are refused by ServeBenchConfig."""
    if args.dataset != "multiturn":
        return {k: v for k, v in (("num_turns", args.num_turns), ("prefix_len", args.prefix_len)) if v is not None}
    return {"num_turns": args.num_turns or 4, "prefix_len": args.prefix_len or 0}


add_mode("serve", "online serving benchmark against an OpenAI-compatible server",
         configure_serve, run_serve)


add_mode("latency", "time prefill (TTFT) and decode steps of one batch, beside the roofline bound",
         bench_offline.configure_latency, bench_offline.run_latency)
add_mode("throughput", "requests and tokens per second through continuous batching",
         bench_offline.configure_throughput, bench_offline.run_throughput)
