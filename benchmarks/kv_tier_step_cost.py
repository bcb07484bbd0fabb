"""What the host tier costs the step's thread (docs/architecture.md, "Host and disk tiers").

Eight requests decode while a long prompt prefills in chunks, its commits offloading each page
boundary to the host tier; the CPU time the step's thread spends inside the tiers (`offload`,
`poll`, `fetch`: `time.thread_time`, so another thread's work and waits for a core are not
counted) is reported per step, with the mover's copies issued by its own thread (as when
serving) and by the step's thread. Then the offload alone, per checkpoint, as one request's
prefix grows to 1024 pages one page at a time (a decode's checkpoints) and 32 at a time (a
prefill's), so what grows with the context shows.

    python -m benchmarks.kv_tier_step_cost            # CPU, random:tiny, about a minute
    python -m benchmarks.kv_tier_step_cost --smoke    # CPU, smaller, seconds
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv4.cache.tiers.executors import make_executor
from dsv4.cache.tiers.movers import Mover
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams


def engine(host_gb: float, threaded: bool) -> LLMEngine:
    eng = LLMEngine("random:tiny", EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=512,
                                                max_num_seqs=16, cache_memory_gb=0.5, host_cache_gb=host_gb))
    tiers = eng.cache.tiers
    if tiers is not None:
        tiers.mover = Mover(tiers.mover.streams, tiers.codec, make_executor(threaded, "dsv4-kv-mover"))
    return eng


def timed(tiers, names=("offload", "poll", "fetch")) -> list[float]:
    """Wrap the tiers' entry points; the list collects their step-thread CPU seconds."""
    spent = [0.0]
    for name in names:
        def wrap(*args, _f=getattr(tiers, name), **kwargs):
            t = time.thread_time()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[0] += time.thread_time() - t
        setattr(tiers, name, wrap)
    return spent


def workload(host_gb: float, threaded: bool, prompt_len: int) -> str:
    eng = engine(host_gb, threaded)
    spent = timed(eng.cache.tiers) if eng.cache.tiers is not None else [0.0]
    gen = torch.Generator().manual_seed(0)
    vocab = eng.cfg.vocab_size
    for i in range(8):
        eng.add_request(f"d{i}", torch.randint(0, vocab, (300,), generator=gen).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=prompt_len // 256 + 100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.add_request("long", torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    steps, t = 0, time.thread_time()
    while any(r.request_id == "long" for r in [*eng.scheduler.running, *eng.scheduler.waiting]):
        eng.step()
        steps += 1
    step_cpu = (time.thread_time() - t) / steps
    if eng.cache.tiers is not None:
        eng.cache.tiers.close()
    mover = "off" if not host_gb else "mover's thread" if threaded else "step's thread"
    return (f"tiers {mover:>14}: {steps} steps, step-thread CPU {1e3 * step_cpu:8.2f} ms/step, in the tiers "
            f"{1e3 * spent[0] / steps:.3f} ms/step")


def offload_growth(threaded: bool, total: int) -> list[str]:
    eng = engine(2.0, threaded)
    tiers, gpu = eng.cache.tiers, eng.cache.pages.allocate(8)
    out = []
    for step in (1, 32):
        tokens = torch.randint(0, 500, (total * 256,), generator=torch.Generator().manual_seed(step)).tolist()
        tiers.keys(tokens, total, owner="r")           # hashed beforehand, as a request's commits do
        times = {}
        for k in range(step, total + 1, step):
            t = time.thread_time()
            tiers.offload(tokens, [gpu[i % 8] for i in range(k)], 256 * k, eng.runner.storage.checkpoints[0], "r")
            times[k] = time.thread_time() - t
        tiers.drain()
        tiers.forget("r")
        tiers.drop_host()
        quarter = [times[k] for k in times if k <= total // 4]
        last = [times[k] for k in times if k > 3 * total // 4]
        out.append(f"  +{step:2d} pages a checkpoint: median {1e6 * statistics.median(quarter):7.1f} us over the first "
                   f"{total // 4} pages, {1e6 * statistics.median(last):7.1f} us over the last {total // 4}")
    tiers.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="a 2k-token prompt, prefixes of 256 pages")
    p.add_argument("--prompt-len", type=int, default=16384)
    args = p.parse_args(argv)
    prompt_len, total = (2048, 256) if args.smoke else (args.prompt_len, 1024)
    print(f"8 decoding requests while a {prompt_len}-token prompt prefills (random:tiny, CPU):")
    for host_gb, threaded in ((0.0, False), (0.5, False), (0.5, True)):
        print(workload(host_gb, threaded, prompt_len))
    for threaded in (False, True):
        print(f"offload of one request's growing prefix to {total} pages, step-thread CPU per offload, "
              f"copies issued by the {'mover' if threaded else 'step'}'s thread:")
        print("\n".join(offload_growth(threaded, total)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
