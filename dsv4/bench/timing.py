"""Timing on a CUDA device: median of CUDA-event intervals after a warm-up."""
from __future__ import annotations

import statistics
import time

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


def graph_ms(fn, device, reps: int, calls: int = 10) -> float:
    """ms per call of fn: on CUDA the median replay of a CUDA graph holding `calls` calls (fn
    run once first: compiled and warmed up; launch gaps do not count), divided by `calls`; on
    the CPU the mean wall time of `reps` calls (benchmarks' --smoke)."""
    fn()
    if torch.device(device).type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, reps) / calls
