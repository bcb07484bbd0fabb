"""`dsv4 bench latency|throughput`: the engine in-process, timed step by step.

latency: B requests of I prompt tokens prefilled in one step (TTFT), then O-1 decode steps
(time per output token). With --synthetic-context the prefill is skipped: each request's
cache is marked as holding I tokens (contents arbitrary: step cost depends on positions and
page tables, not on values) so decode at long contexts can be timed without a long prefill.
throughput: N requests through continuous batching; requests/s and tokens/s.
Every figure is printed beside its roofline bound (dsv4.bench.roofline).
"""
from __future__ import annotations

import statistics
import time

import torch
from tqdm import tqdm

from ..config import EngineConfig
from ..engine.engine import LLMEngine
from ..sampling_params import SamplingParams
from .roofline import H200, StepCost, decode_step_cost, prefill_cost, roofline


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_engine(model: str, device: str, dtype: str, batch: int, input_len: int, output_len: int,
                speculative_config=None) -> LLMEngine:
    """Without the prefix cache: every run sends the same prompts, each must be computed."""
    cfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=max(batch * input_len, 256),
                       max_model_len=input_len + output_len + 8, enable_prefix_caching=False,
                       speculative_config=speculative_config)
    return LLMEngine(model, cfg)


def _add_batch(engine: LLMEngine, batch: int, input_len: int, output_len: int, synthetic: bool, tag: str):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    reqs = []
    for i in range(batch):
        ids = torch.randint(100, engine.cfg.vocab_size, (input_len,), generator=gen).tolist()
        req = engine.add_request(f"{tag}-{i}", ids, params)
        if synthetic:
            req.num_computed = input_len - 1           # cache "holds" all but the last prompt token
            if not engine.cache.reserve(req, 0):
                raise RuntimeError("--synthetic-context: the cache cannot hold the batch")
            engine.scheduler.run_now(req)
        reqs.append(req)
    return reqs


def time_one(engine: LLMEngine, batch: int, input_len: int, output_len: int, synthetic: bool, tag: str) -> dict:
    device = engine.config.device
    _add_batch(engine, batch, input_len, output_len, synthetic, tag)
    _sync(device)
    t0 = time.perf_counter()
    engine.step()                                  # prefill (or first decode) + first token
    _sync(device)
    ttft = time.perf_counter() - t0
    # decode: no sync between steps (async scheduling overlaps host and GPU); time per
    # output token after the first
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync(device)
    decode_steps = output_len - 1
    return {"ttft": ttft, "step_times": [(time.perf_counter() - t) / decode_steps] if decode_steps > 0 else []}


def run_latency(model: str, device: str, dtype: str, batch: int, input_len: int, output_len: int,
                iters: int, warmup: int, synthetic: bool, bandwidth: float, peak: float,
                speculative_config=None) -> dict:
    engine = make_engine(model, device, dtype, batch, input_len, output_len, speculative_config)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for w in range(warmup):
        time_one(engine, batch, input_len, min(output_len, 4), synthetic, f"warm{w}")
    if engine.spec is not None:
        engine.spec.stats = type(engine.spec.stats)()     # count the timed runs only
    runs = [time_one(engine, batch, input_len, output_len, synthetic, f"run{i}")
            for i in tqdm(range(iters), desc="iterations", disable=iters < 2)]
    return summarize(engine, runs, batch, input_len, output_len, synthetic, bandwidth, peak)


def summarize(engine, runs, batch, input_len, output_len, synthetic, bandwidth, peak) -> dict:
    cfg = engine.cfg
    ttfts = [r["ttft"] for r in runs]
    tpot = [statistics.median(r["step_times"]) for r in runs if r["step_times"]]
    one = prefill_cost(cfg, input_len)
    prefill = StepCost(one.bytes_weights, one.bytes_history * batch, one.bytes_written * batch, one.flops * batch)
    decode = decode_step_cost(cfg, batch, input_len + output_len // 2)
    out = {"batch": batch, "input_len": input_len, "output_len": output_len, "synthetic_context": synthetic,
           "ttft_s": statistics.median(ttfts), "ttft_spread_s": max(ttfts) - min(ttfts),
           "decode_step_s": statistics.median(tpot) if tpot else None,
           "decode_step_spread_s": (max(tpot) - min(tpot)) if tpot else None,
           "decode_bound_s": roofline(decode, bandwidth, peak).seconds}
    if not synthetic:
        out["prefill_tokens_per_s"] = batch * input_len / out["ttft_s"]
        out["prefill_bound_s"] = roofline(prefill, bandwidth, peak).seconds
        out["prefill_vs_bound"] = out["prefill_bound_s"] / out["ttft_s"]
    if out["decode_step_s"]:
        out["decode_tokens_per_s"] = batch / out["decode_step_s"]
        out["decode_vs_bound"] = out["decode_bound_s"] / out["decode_step_s"]
    if str(engine.config.device).startswith("cuda"):
        out["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out | spec_summary(engine)


def spec_summary(engine) -> dict:
    """Acceptance figures of a speculative engine (engine/speculative/stats.py); {} without."""
    if engine.spec is None:
        return {}
    return {"speculative": engine.config.speculative_config.method,
            "num_speculative_tokens": engine.config.speculative_config.num_speculative_tokens,
            **engine.spec.stats.summary()}


def run_throughput(model: str, device: str, dtype: str, num_prompts: int, input_len: int, output_len: int,
                   max_num_seqs: int, speculative_config=None) -> dict:
    cfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                       max_model_len=input_len + output_len + 8, enable_prefix_caching=False,
                       speculative_config=speculative_config)
    engine = LLMEngine(model, cfg)
    _add_batch(engine, num_prompts, input_len, output_len, False, "tp")
    _sync(device)
    t0 = time.perf_counter()
    with tqdm(total=num_prompts, desc="requests") as bar:
        while engine.has_unfinished():
            bar.update(sum(o.finished for o in engine.step()))
    _sync(device)
    elapsed = time.perf_counter() - t0
    return {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "elapsed_s": elapsed,
            "requests_per_s": num_prompts / elapsed, "output_tokens_per_s": num_prompts * output_len / elapsed,
            "total_tokens_per_s": num_prompts * (input_len + output_len) / elapsed} | spec_summary(engine)


def format_table(result: dict) -> str:
    rows = []
    for key, value in result.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)   # (lists as they print)
        rows.append(f"{key:<24} {text}")
    return "\n".join(rows)


DEFAULT_BANDWIDTH, DEFAULT_PEAK = H200.hbm_bandwidth, H200.dense_flops
