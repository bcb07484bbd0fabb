"""Engine flags for every command that runs the engine, generated from `EngineConfig`."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from ..config import ConfigError, EngineConfig

HELP = {
    "device": "cpu, cuda or cuda:N",
    "dtype": "weights and cache dtype (float32 or bfloat16)",
    "max_num_batched_tokens": "tokens per step across all sequences",
    "max_num_seqs": "sequences per step",
    "max_model_len": "prompt + output tokens of one request (default: model max or what the cache holds)",
    "num_pages": "256-token history pages in the KV cache (default: from the memory budget)",
    "cache_memory_gb": "KV cache budget in GiB (default: 1 on CPU, 90%% of free GPU memory)",
    "spec_slots": "speculative tokens the private cache state can roll back",
    "seed": "engine seed for unseeded sampling",
    "ops_backend": "auto (Triton kernels on CUDA) or reference (torch ops only)",
    "enforce_eager": "run decode steps eagerly (no CUDA graphs)",
    "cuda_graph_max_bs": "largest decode batch replayed as a CUDA graph",
    "async_scheduling": "on, off or auto (on for CUDA): launch the next step before reading this one's tokens",
    "keep_fp8": "keep FP8 (128x128 block-scaled) routed and shared expert weights FP8 on the device, dequantised "
                "inside the MoE kernels (W8A16); other weights and MXFP4 experts are dequantised at load",
    "keep_mxfp4": "keep MXFP4 routed expert weights (e2m1 pairs + an E8M0 scale per 32 inputs, the released V4 "
                  "format) packed on the device, dequantised inside the MoE kernels (W4A16); the shared expert and "
                  "other weights are dequantised at load",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' "
                          "(off by default; --spec-slots defaults to num_speculative_tokens)",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = hints[f.name]
        if kind is bool:
            group.add_argument("--" + f.name.replace("_", "-"), action="store_true", help=HELP.get(f.name))
            continue
        conv = int if kind in (int, int | None) else float if kind in (float, float | None) else str
        group.add_argument("--" + f.name.replace("_", "-"), type=conv, default=f.default, help=HELP.get(f.name))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    try:
        return EngineConfig(**values)
    except ConfigError as e:
        raise SystemExit(f"--{e.field.replace('_', '-')}: {e}") from None
