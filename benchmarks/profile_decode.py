"""Where a batch-1 decode step of the fast path spends its time: GPU time per step (torch
profiler) against wall time, and the host side broken down by function (cProfile). With
`--prefill N`, the step profiled is instead a prefill of N new prompt tokens after `context`
tokens of synthetic history (a chunk at a deep offset).

    python -m benchmarks.profile_decode [--spec random:flash-slice:6] [--batch 1] [--context 4096 1048448 ...]
        [--kv-cache-dtype auto|fp8] [--no-host] [--prefill 2048] [--gaps 20]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch


from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.weights import load_model
from dsv4.bench import offline as bo


STEP = "dsv4.step"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--spec", default="random:flash-slice:6")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, nargs="+", default=[4096], help="one profile per context")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", type=int, default=25, help="kernels listed per profile")
    p.add_argument("--no-host", action="store_true", help="leave out the cProfile of the host side")
    p.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens instead")
    p.add_argument("--gaps", type=int, default=0, help="list this many of the longest GPU idle gaps")
    args = p.parse_args()
    if args.prefill and args.batch != 1:
        p.error("--prefill: profiles one request (leave --batch at 1)")
    model = load_model(args.spec, "cuda", torch.bfloat16)
    for context in args.context:
        profile_context(args, model, context)


def profile_context(args, model, context: int) -> None:
    new = args.prefill or 200
    eng = LLMEngine(args.spec, EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=args.batch,
                                            max_num_batched_tokens=max(256, args.prefill),
                                            max_model_len=min(context + new + 1, model.cfg.max_position_embeddings),
                                            num_pages=args.batch * ((context + new) // 256 + 2) + 8,
                                            kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False,
                                            # a prefill's request ends in its own step
                                            async_scheduling="off" if args.prefill else "auto"),
                    model=model)
    if args.prefill:
        step = lambda: deep_prefill(eng, context, args.prefill)
    else:
        bo._add_batch(eng, args.batch, context, 3 * args.steps + 10, True, "p")
        step = lambda: marked_step(eng)
    for _ in range(5):                                           # capture and warm up
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    times = [step() for _ in range(args.steps)]
    torch.cuda.synchronize()
    # a prefill's wall is its step alone (making the ~1M-id request is not the engine's step)
    wall = sum(times) / args.steps if args.prefill else (time.perf_counter() - t) / args.steps
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    # (ops' own time would count twice; STEP's range has a device-side twin spanning the step's kernels)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.name != STEP]
    gpu = sum(e.self_device_time_total for e in kernels) / args.steps / 1e3
    what = f"prefill of {args.prefill} tokens" if args.prefill else f"batch {args.batch}"
    print(f"{what}, context {context}, {args.kv_cache_dtype} KV: {wall * 1e3:.2f} ms per step wall, "
          f"{gpu:.2f} ms of GPU time per step", flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows), flush=True)
    if args.gaps:
        print(idle_gaps(prof.events(), kernels, args.steps, args.gaps), flush=True)
    if not args.no_host:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(45)
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
        print(f"host profile over {args.steps} steps:\n{out.getvalue()}")
    eng.close()
    del eng
    torch.cuda.empty_cache()


def marked_step(eng: LLMEngine) -> None:
    """eng.step() inside a profiler range named STEP (idle_gaps counts only inside it)."""
    from torch.profiler import record_function
    with record_function(STEP):
        eng.step()


def idle_gaps(events, kernels, steps: int, n: int) -> str:
    """The GPU's idle time a step: before its first kernel (from the step's start on the host),
    between kernels, after its last (to the step's end); and the n longest gaps between kernels,
    with the kernels either side and the host ops that began inside the gap (what it waited for)."""
    windows = [(e.time_range.start, e.time_range.end) for e in events
               if e.name == STEP and e.device_type == torch.autograd.DeviceType.CPU]
    host = sorted((e.time_range.start, e.name) for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    gaps, lead, tail = [], 0.0, 0.0
    for a, b in windows:
        spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels if a <= e.time_range.start < b)
        end, before = spans[0][1], spans[0][2]
        lead, tail = lead + spans[0][0] - a, tail + b - max(stop for _, stop, _ in spans)
        for start, stop, name in spans[1:]:
            if start > end:
                gaps.append((start - end, end, before, name))
            if stop > end:
                end, before = stop, name
    idle = sum(g[0] for g in gaps)
    lines = [f"GPU idle a step: {lead / steps / 1e3:.2f} ms before the first kernel, {idle / steps / 1e3:.2f} ms "
             f"between kernels ({len(gaps) / steps:.0f} gaps), {tail / steps / 1e3:.2f} ms after the last; longest:"]
    for width, at, before, after in sorted(gaps, reverse=True)[:n]:
        began = [name for t, name in host if at <= t < at + width]
        shown = ", ".join(dict.fromkeys(began[:12]))
        lines.append(f"  {width:8.1f} us  after {before[:40]}  before {after[:40]}  host: {shown[:160]}")
    return "\n".join(lines)


def deep_prefill(eng: LLMEngine, context: int, new: int) -> float:
    """One request whose first `context` prompt tokens the cache 'holds' (synthetic history):
    one step prefills its last `new` tokens and emits its only token. -> that step's seconds."""
    req = bo._add_batch(eng, 1, context + new, 1, True, f"deep{time.perf_counter_ns()}")[0]
    req.num_computed = context
    torch.cuda.synchronize()
    t = time.perf_counter()
    marked_step(eng)
    torch.cuda.synchronize()
    assert not eng.has_unfinished(), "the chunk did not fit one step"
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
