"""Long context on one H200, one command: batch-1 decode step time at 4k .. 1M context and a
128k prefill, with model-dtype (bf16) and packed FP8 KV (`--kv-cache-dtype fp8`), peak memory,
and correctness checks on the device (docs/architecture.md, "Cache").

    python -m benchmarks.long_context --out DIR [--budget-s 220]      # H200, about 3.5 minutes
    python -m benchmarks.long_context --out DIR --smoke                # CPU, tiny, seconds

Model: `random:flash-slice:6` (V4-Flash layers 0-5: 2 sliding, 2 CSA, 2 HCA; 256 bf16 experts),
built once. Decode: batch 1 at a synthetic context of N tokens (bench/offline.py: the cache
"holds" N - 1 tokens, step cost depends on positions and page tables, not values), CUDA graphs
and async scheduling on, the mean step over --decode-tokens. Prefill: one request of 128k
random tokens in --chunk-token chunks (eager fast path), time to its first token. Peak memory:
torch.cuda.max_memory_allocated over each case (weights included).

Checks on the device, before timing: (1) the streamed indexer top-k (Triton, entries in tiles
merged into a running top-k) equals the torch reference's offsets exactly at E = 262,144 C4
entries (1M positions) with exact-sum inputs (many ties: the order is part of the contract);
(2) greedy tokens of the fast path (Triton kernels + CUDA graphs) equal the reference path's
(torch ops, eager) on a tiny fp32 model, for bf16-shaped and FP8 KV alike.

Targets printed: the issue's (1M decode within 1.25x of 4k decode; FP8 KV holds >= 1.7x the
tokens of bf16 KV in the same memory) and SGLang's published V4-Flash figure (batch-1 decode
266 -> 240 tokens/s between 4k and 900k: 1.11x).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

from dsv4.bench import offline as bo
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.weights import load_model
from dsv4.sampling_params import SamplingParams

T0 = time.perf_counter()
SPEC = "random:flash-slice:6"
MAX_POS = 1048576
GPU = dict(contexts=(4096, 16384, 131072, 524288, MAX_POS - 128), prefill=131072, chunk=16384, decode_tokens=32,
           greedy=(600, 48))
SMOKE = dict(contexts=(512, 2048, 8192), prefill=1024, chunk=256, decode_tokens=4, greedy=(100, 8))
TARGET_1M_VS_4K = 1.25
SGLANG_900K_VS_4K = 266 / 240
FP8_CAPACITY = 1.7


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def engine(spec, model, device, dtype, kv, **kw) -> LLMEngine:
    return LLMEngine(spec, EngineConfig(device=device, dtype=dtype, kv_cache_dtype=kv, enable_prefix_caching=False,
                                        **kw), model=model)


# ---- checks ---------------------------------------------------------------------------
def check_streamed_topk(device: str, entries: int) -> dict:
    """Triton streamed top-k vs the torch reference, exact, at `entries` C4 entries."""
    from dsv4.ops import backend
    from dsv4.ops import indexer as ref
    from dsv4.ops.paged import PagedRows
    g = torch.Generator().manual_seed(0)
    T, Hi, Di, k, per_page = 4, 8, 16, 512, 64          # Di 16: the 16^-0.5 scale is exact, sums too
    n_pages = entries // per_page
    pages = torch.randperm(n_pages, generator=g)[None].to(device)
    hi = torch.tensor([entries, entries - 1, entries // 3, 700], device=device)
    cand = PagedRows(pages, torch.zeros(T, dtype=torch.long, device=device), torch.zeros_like(hi), hi,
                     per_page, per_page, entries)
    q = torch.randint(-1, 2, (T, Hi, Di), generator=g).float().to(device)
    w = torch.randint(0, 2, (T, Hi), generator=g).float().to(device)
    keys = torch.randint(-1, 2, (n_pages * per_page, Di), generator=g).float().to(device)
    got = ref.indexer_topk_offsets(q, w, keys, cand, k)
    with backend.forced("reference"):
        want = ref.indexer_topk_offsets(q, w, keys, cand, k)
    ok = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    return {"entries": entries, "ok": bool(ok)}


def greedy_tokens(model, device, kv, backend_name, n_prompt, n_new) -> list[int]:
    eng = engine("random:tiny", model, device, "float32", kv, max_num_seqs=1, max_num_batched_tokens=128,
                 num_pages=16, ops_backend=backend_name, enforce_eager=backend_name == "reference")
    ids = torch.randint(2, model.cfg.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(1)).tolist()
    req = eng.add_request("g", ids, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return list(req.output_token_ids)


def check_greedy(device: str, n_prompt: int, n_new: int) -> dict:
    model = load_model("random:tiny", device, torch.float32)
    out = {}
    for kv in ("auto", "fp8"):
        fast = greedy_tokens(model, device, kv, "auto", n_prompt, n_new)
        plain = greedy_tokens(model, device, kv, "reference", n_prompt, n_new)
        out[kv] = {"equal": fast == plain, "agree": sum(a == b for a, b in zip(fast, plain)), "of": len(plain)}
    del model
    return out


# ---- timings --------------------------------------------------------------------------
def decode_case(model, device, dtype, kv, n, tokens) -> dict:
    reset_peak(device)
    eng = engine(SPEC if device != "cpu" else "random:tiny", model, device, dtype, kv, max_num_seqs=1,
                 max_num_batched_tokens=256, num_pages=n // 256 + 4, max_model_len=n + tokens + 8)
    bo.time_one(eng, 1, n, tokens, True, "warm")            # captures every graph shape the run needs
    step = bo.time_one(eng, 1, n, tokens, True, "run")["step_times"][0]
    out = {"step_ms": step * 1e3, "tok_per_s": 1 / step, "peak_gb": peak_gb(device),
           "cache_tokens": eng.plan.max_tokens, "cache_mib": eng.runner.storage.nbytes() / 2**20}
    del eng
    return out


def prefill_case(model, device, dtype, kv, n, chunk) -> dict:
    reset_peak(device)
    eng = engine(SPEC if device != "cpu" else "random:tiny", model, device, dtype, kv, max_num_seqs=1,
                 max_num_batched_tokens=chunk, num_pages=n // 256 + 4, max_model_len=n + 8,
                 async_scheduling="off", enforce_eager=True)
    ids = torch.randint(100, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    req = eng.add_request("p", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    sync(device)
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    sync(device)
    s = time.perf_counter() - t
    assert req.output_token_ids, "the prefill produced no token"
    out = {"s": s, "tok_per_s": n / s, "peak_gb": peak_gb(device)}
    del eng
    return out


def capacity(dtype: str) -> dict:
    """Tokens a 40 GiB cache holds for the slice, model-dtype vs FP8 KV (no prefix cache)."""
    from dsv4.cache.layout import CacheLayout
    from dsv4.model.random_model import parse_spec
    cfg, elem = parse_spec(SPEC), 2 if dtype == "bfloat16" else 4
    out = {}
    for kv in ("auto", "fp8"):
        layout = CacheLayout(cfg, kv_fp8=kv == "fp8")
        out[kv] = layout.plan(40 * 2**30, elem, 64, 16384).max_tokens
    out["ratio"] = out["fp8"] / out["auto"]
    return out


def run(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    sizes = SMOKE if args.smoke else GPU
    dtype = "float32" if args.smoke else "bfloat16"
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cases": {}}
    results["topk_check"] = check_streamed_topk(device, 4096 if args.smoke else MAX_POS // 4)
    log(f"streamed indexer top-k vs reference: {results['topk_check']}")
    results["greedy_check"] = check_greedy(device, *sizes["greedy"])
    log(f"greedy fast vs reference path: {results['greedy_check']}")
    results["capacity_40gib"] = capacity(dtype)
    log(f"capacity in 40 GiB: {results['capacity_40gib']}")
    model = load_model(SPEC if not args.smoke else "random:tiny", device, getattr(torch, dtype))
    log("model loaded")
    cases = [("decode", kv, n) for n in sizes["contexts"] for kv in ("auto", "fp8")]
    cases += [("prefill", kv, sizes["prefill"]) for kv in ("auto", "fp8")]
    for kind, kv, n in cases:
        if time.perf_counter() - T0 > args.budget_s:
            log(f"budget spent: {kind} {n} {kv} and later cases skipped")
            break
        if kind == "decode":
            r = decode_case(model, device, dtype, kv, n, sizes["decode_tokens"])
        else:
            r = prefill_case(model, device, dtype, kv, n, sizes["chunk"])
        results["cases"][f"{kind} {n} {kv}"] = r
        log(f"{kind} {n} kv={kv}: {r}")
    return results


def table(results: dict, sizes: dict) -> str:
    c = results["cases"]
    lines = [f"long context on {results['device']} ({SPEC}, batch 1)", "",
             "| case | bf16 KV | FP8 KV | FP8 / bf16 |", "|---|---|---|---|"]
    for n in sizes["contexts"]:
        a, f = c.get(f"decode {n} auto"), c.get(f"decode {n} fp8")
        cell = lambda r: f"{r['step_ms']:.2f} ms ({r['peak_gb'] or 0:.1f} GB)" if r else "—"
        ratio = f"{f['step_ms'] / a['step_ms']:.2f}x" if a and f else "—"
        lines.append(f"| decode ctx {n} | {cell(a)} | {cell(f)} | {ratio} |")
    n = sizes["prefill"]
    a, f = c.get(f"prefill {n} auto"), c.get(f"prefill {n} fp8")
    cell = lambda r: f"{r['tok_per_s']:,.0f} tok/s ({r['peak_gb'] or 0:.1f} GB)" if r else "—"
    lines.append(f"| prefill {n} | {cell(a)} | {cell(f)} | "
                 f"{(a['s'] / f['s']) if a and f else 0:.2f}x speed |")
    lines.append("")
    first, last = sizes["contexts"][0], sizes["contexts"][-1]
    for kv in ("auto", "fp8"):
        a, z = c.get(f"decode {first} {kv}"), c.get(f"decode {last} {kv}")
        if a and z:
            r = z["step_ms"] / a["step_ms"]
            lines.append(f"decode ctx {last} / ctx {first}, {kv} KV: {r:.2f}x (target <= {TARGET_1M_VS_4K}x: "
                         f"{'met' if r <= TARGET_1M_VS_4K else 'MISSED'}; SGLang 900k / 4k: {SGLANG_900K_VS_4K:.2f}x)")
    cap = results["capacity_40gib"]
    lines.append(f"FP8 KV capacity: {cap['ratio']:.2f}x the tokens of model-dtype KV in 40 GiB "
                 f"(target >= {FP8_CAPACITY}x: {'met' if cap['ratio'] >= FP8_CAPACITY else 'MISSED'})")
    lines.append(f"checks: streamed top-k exact at {results['topk_check']['entries']} entries: "
                 f"{results['topk_check']['ok']}; greedy fast == reference: "
                 + ", ".join(f"{kv} {r['agree']}/{r['of']}" for kv, r in results["greedy_check"].items()))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget-s", type=float, default=220.0, help="skip the remaining timings after this")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and contexts: the script itself")
    args = p.parse_args()
    results = run(args)
    text = table(results, SMOKE if args.smoke else GPU)
    print(text, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "long_context.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "long_context.txt"), "w") as f:
        f.write(text + "\n")
    ok = results["topk_check"]["ok"] and all(r["equal"] for r in results["greedy_check"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
