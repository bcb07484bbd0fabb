"""`dsv4 bench latency` and `dsv4 bench throughput` (in-process engine benchmarks)."""
from __future__ import annotations

import argparse
import json

from .args import positive_int


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder or random:PRESET[:LAYERS][:k=v,...]")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=32)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line last")
    parser.add_argument("--speculative-config", default=None,
                        help="speculative decoding as JSON, e.g. "
                             "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'; the result adds acceptance "
                             "length, per-position acceptance, drafted and accepted tokens")


def _spec(args: argparse.Namespace):
    """The --speculative-config value parsed, or SystemExit naming the flag."""
    from ..config import ConfigError, SpeculativeConfig
    try:
        return SpeculativeConfig.parse(args.speculative_config)
    except ConfigError as e:
        raise SystemExit(f"--speculative-config: {e}") from None


def configure_latency(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--num-iters", type=positive_int, default=3)
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--synthetic-context", action="store_true",
                        help="skip the prefill: time decode as if the cache held --input-len tokens")
    parser.add_argument("--bandwidth", type=float, default=None, help="measured memory bandwidth, B/s")
    parser.add_argument("--peak-flops", type=float, default=None, help="measured bf16 matmul rate, FLOP/s")


def run_latency(args: argparse.Namespace) -> int:
    from ..bench import offline as b
    result = b.run_latency(args.model, args.device, args.dtype, args.batch_size, args.input_len, args.output_len,
                           args.num_iters, args.num_warmup, args.synthetic_context,
                           args.bandwidth or b.DEFAULT_BANDWIDTH, args.peak_flops or b.DEFAULT_PEAK, _spec(args))
    print(b.format_table(result))
    if args.json:
        print(json.dumps(result))
    return 0


def configure_throughput(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=16)
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)


def run_throughput(args: argparse.Namespace) -> int:
    from ..bench import offline as b
    result = b.run_throughput(args.model, args.device, args.dtype, args.num_prompts, args.input_len,
                              args.output_len, args.max_num_seqs, _spec(args))
    print(b.format_table(result))
    if args.json:
        print(json.dumps(result))
    return 0
