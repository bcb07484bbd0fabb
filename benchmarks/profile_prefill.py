"""Where a long prefill of the fast path spends its GPU time (torch profiler), and its wall
time with each grouped-GEMM implementation of the routed experts.

    python -m benchmarks.profile_prefill [--spec random:flash-slice:6] [--tokens 16384]
"""
from __future__ import annotations

import argparse
import os
import time

import torch


from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.weights import load_model
from dsv4.ops import moe
from dsv4.bench import offline as bo


def prefill_once(eng, n: int, tag: str) -> float:
    t = time.perf_counter()
    bo.time_one(eng, 1, n, 1, False, tag)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", default="random:flash-slice:6")
    p.add_argument("--tokens", type=int, default=16384)
    args = p.parse_args()
    n = args.tokens
    model = load_model(args.spec, "cuda", torch.bfloat16)
    eng = LLMEngine(args.spec, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=1, max_num_batched_tokens=n,
                                            num_pages=n // 256 + 4, enable_prefix_caching=False), model=model)
    for impl in ("torch", "triton"):
        moe.GROUPED_GEMM = impl
        prefill_once(eng, n, f"warm-{impl}")
        print(f"prefill {n}, grouped GEMM {impl}: {min(prefill_once(eng, n, f'{impl}{i}') for i in range(2)) * 1e3:.1f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_once(eng, n, "prof")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))


if __name__ == "__main__":
    main()
