"""Timing on a CUDA device: median of CUDA-event intervals after a warm-up."""
from __future__ import annotations

import statistics

import torch


def median_ms(fn, reps: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` over `reps` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)
