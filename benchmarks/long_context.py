"""Long context on one H200: batch-1 decode step time at 4k .. 1M context beside its roofline
bound, batch-64 decode at 4k and 32k, prefill of 128k, 512k and 1M tokens, with model-dtype
(bf16) and packed FP8 KV (`--kv-cache-dtype fp8`), peak memory, and correctness checks on the
device (docs/architecture.md, "Cache").

    python -m benchmarks.long_context --out DIR [--budget-s 220] [--cases decode,batch,prefill,chunk]   # H200
    python -m benchmarks.long_context --out DIR --cases decode --contexts 4096,1048192 --kv auto   # one pair
    python -m benchmarks.long_context --out DIR --smoke                # CPU, tiny, under a minute

The batch-1 decode part takes about 3.5 minutes on an H200; batch and prefill (the 512k and 1M
prompts) need more than one device call's time after it: run them as their own call
(`--cases batch,prefill --budget-s 540`). Cases past --budget-s are skipped and named.

Model: `random:flash-slice:6` (V4-Flash layers 0-5: 2 sliding, 2 CSA, 2 HCA; 256 bf16 experts),
built once. Decode: batch 1 at a synthetic context of N tokens (bench/offline.py: the cache
"holds" N - 1 tokens, step cost depends on positions and page tables, not values), CUDA graphs
and async scheduling on, the mean step over --decode-tokens. Prefill: one request of N random
tokens in 16k-token chunks (eager fast path), time to its first token. Chunk: one 2,048-token
prefill chunk (the last of its prompt: one step, eager) at position 0 and at ~900k (the cache
"holds" the 900k tokens before it, synthetic as for decode), each the median of --chunk-repeats
runs (3) after a warm-up chunk at the same position; printed with their ratio and the ratio less the indexer's O(E) roofline term
(dsv4/bench/roofline.py indexer_cost: the later chunk's scoring of ~225k C4 entries per token,
which the chunk at 0 does not have). Peak memory:
torch.cuda.max_memory_allocated over each case (weights included).

Checks on the device, before timing: (1) the streamed indexer top-k (Triton, entries in tiles
merged into a running top-k) equals the torch reference's offsets exactly at E = 262,144 C4
entries (1M positions) with exact-sum inputs (many ties: the order is part of the contract);
(2) greedy tokens of the fast path (Triton kernels + CUDA graphs) equal the reference path's
(torch ops, eager) on a tiny fp32 model, for bf16-shaped and FP8 KV alike.

Each decode time is printed beside its roofline bound (dsv4/bench/roofline.py: weights, the
SWA keys, the top-k CSA entries, every HCA entry and the indexer's O(E) reads of all c // 4
indexer keys, at the KV dtype's bytes). Batch 64: decode of 64 requests at a synthetic 4k and
32k context, FP8 and model-dtype KV, in tokens/s.

Targets printed: the issue's (1M decode within 1.25x of 4k decode; FP8 KV holds >= 1.7x the
tokens of bf16 KV in the same memory; 1M prefill completes; a 2k chunk at 900k within 1.5x of
the chunk at 0 plus the indexer's O(E) term) and SGLang's published V4-Flash
figure (batch-1 decode 266 -> 240 tokens/s between 4k and 900k: 1.11x).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time

import torch

from dsv4.bench import offline as bo
from dsv4.bench.roofline import Precision, bound_seconds, decode_step_cost, indexer_cost
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.weights import load_model
from dsv4.sampling_params import SamplingParams

T0 = time.perf_counter()
SPEC = "random:flash-slice:6"
MAX_POS = 1048576
# decode cases of 256 tokens: their mean step is the steady one (with 32, a 1M request's start and
# end weighed on it: 1.35-1.49x of 4k against 1.10-1.12x over 256, docs/benchmarks.md)
GPU = dict(contexts=(4096, 16384, 131072, 524288, MAX_POS - 384), prefill=(131072, 524288, MAX_POS - 16),
           chunk=16384, decode_tokens=256, greedy=(600, 48), batch=64, batch_contexts=(4096, 32768),
           chunk_at=(0, 900_000), chunk_tokens=2048)
SMOKE = dict(contexts=(512, 2048, 8192), prefill=(1024, 2048), chunk=256, decode_tokens=4, greedy=(100, 8),
             batch=4, batch_contexts=(512, 2048), chunk_at=(0, 4096), chunk_tokens=64)
CASES = ("decode", "batch", "prefill", "chunk")
TARGET_CHUNK_900K_VS_0 = 1.5
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
def kv_precision(dtype: str, kv: str) -> Precision:
    """Bytes per stored element for the roofline: the model dtype's everywhere, or with the
    packed FP8 KV rows (584 B per 512-dim vector, indexer keys 132 B per 128-dim key)."""
    elem = 2.0 if dtype == "bfloat16" else 4.0
    base = Precision.uniform(elem, elem)
    return base if kv == "auto" else dataclasses.replace(base, kv_bytes=584 / 512, index_kv_bytes=132 / 128)


def decode_case(model, device, dtype, kv, n, tokens, batch: int = 1) -> dict:
    """`batch` requests decoding at a synthetic context of n tokens: the mean step, tokens/s
    (batch / step), and the roofline bound of that step (indexer O(E) reads included)."""
    reset_peak(device)
    eng = engine(SPEC if device != "cpu" else "random:tiny", model, device, dtype, kv, max_num_seqs=batch,
                 max_num_batched_tokens=max(256, batch), num_pages=batch * (n // 256 + 2) + 4,
                 max_model_len=n + tokens + 8)
    bo.time_one(eng, batch, n, tokens, True, "warm")            # captures every graph shape the run needs
    step = bo.time_one(eng, batch, n, tokens, True, "run")["step_times"][0]
    bound = bound_seconds(decode_step_cost(model.cfg, batch, n + tokens // 2, kv_precision(dtype, kv)))
    out = {"batch": batch, "step_ms": step * 1e3, "tok_per_s": batch / step, "bound_ms": bound * 1e3,
           "of_roofline": bound / step, "peak_gb": peak_gb(device),
           "cache_tokens": eng.plan.max_tokens, "cache_mib": eng.runner.storage.nbytes() / 2**20}
    eng.close()     # (its late-compile watcher off: the next engine's warm-up is not late)
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
    eng.close()     # (its late-compile watcher off: the next engine's warm-up is not late)
    del eng
    return out


def chunk_case(model, device, dtype, kv, start, tokens, repeats: int = 1, ends: bool = True) -> dict:
    """One `tokens`-token prefill chunk at position `start` (the cache "holds" the tokens
    before it, synthetic as for decode: bench/offline.py), after a warm-up chunk at the same
    position: its time (the median of `repeats` runs, each a new request), and the indexer's
    O(E) roofline term (indexer_cost) in it. The chunk's step samples the request's first token;
    `ends`: the request ends there too (its pages and prompt freed inside the timed step), else
    it goes on and is aborted after the timing (a chunk in the middle of a long prompt)."""
    reset_peak(device)
    eng = engine(SPEC if device != "cpu" else "random:tiny", model, device, dtype, kv, max_num_seqs=1,
                 max_num_batched_tokens=tokens, num_pages=(start + tokens) // 256 + 4, max_model_len=start + tokens + 8,
                 async_scheduling="off", enforce_eager=True)
    gen = torch.Generator().manual_seed(start)
    runs = []
    for tag in ["warm"] + [f"run{i}" for i in range(repeats)]:
        ids = torch.randint(100, model.cfg.vocab_size, (start + tokens,), generator=gen).tolist()
        req = eng.add_request(f"chunk-{tag}", ids, SamplingParams(temperature=0, max_tokens=1 if ends else 2,
                                                                  ignore_eos=True))
        req.num_computed = start                   # the cache "holds" the tokens before the chunk
        if start and not eng.cache.reserve(req, 0):
            raise RuntimeError(f"chunk at {start}: the cache cannot hold the context")
        eng.scheduler.run_now(req)
        sync(device)
        t = time.perf_counter()
        eng.step()                                 # the chunk, then its first token
        sync(device)
        runs.append(time.perf_counter() - t)
        assert req.output_token_ids and eng.has_unfinished() != ends, "the chunk was not one step"
        if not ends:
            eng.abort(req.request_id)
            while eng.has_unfinished():
                eng.step()
    s = statistics.median(runs[1:])
    term = bound_seconds(indexer_cost(model.cfg, tokens, start, kv_precision(dtype, kv)))
    out = {"start": start, "tokens": tokens, "ms": s * 1e3, "runs_ms": [round(r * 1e3, 2) for r in runs[1:]],
           "indexer_bound_ms": term * 1e3, "peak_gb": peak_gb(device)}
    eng.close()     # (its late-compile watcher off: the next engine's warm-up is not late)
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
    sizes = sizes_of(args)
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
    for kind, kv, n in planned_cases(sizes, args.cases, args.kv):
        if time.perf_counter() - T0 > args.budget_s:
            log(f"budget spent: {kind} {n} {kv} and later cases skipped")
            break
        if kind == "decode":
            r = decode_case(model, device, dtype, kv, n, sizes["decode_tokens"])
        elif kind == "batch":
            r = decode_case(model, device, dtype, kv, n, sizes["decode_tokens"], sizes["batch"])
        elif kind == "chunk":
            r = chunk_case(model, device, dtype, kv, n, sizes["chunk_tokens"], args.chunk_repeats)
        else:
            r = prefill_case(model, device, dtype, kv, n, sizes["chunk"])
        results["cases"][f"{kind} {n} {kv}"] = r
        log(f"{kind} {n} kv={kv}: {r}")
    return results


def planned_cases(sizes: dict, kinds: tuple[str, ...],
                  kvs: tuple[str, ...] = ("auto", "fp8")) -> list[tuple[str, str, int]]:
    """(kind, kv, tokens) in running order: batch-1 decode by context, batch decode (FP8 KV
    first: the issue's case), prefill by length, a chunk at 0 then at ~900k; KV dtypes `kvs`."""
    cases = {"decode": [("decode", kv, n) for n in sizes["contexts"] for kv in ("auto", "fp8")],
             "batch": [("batch", kv, n) for kv in ("fp8", "auto") for n in sizes["batch_contexts"]],
             "prefill": [("prefill", kv, n) for n in sizes["prefill"] for kv in ("auto", "fp8")],
             "chunk": [("chunk", kv, n) for kv in ("auto", "fp8") for n in sizes["chunk_at"]]}
    return [c for kind in CASES if kind in kinds for c in cases[kind] if c[1] in kvs]


def table(results: dict, sizes: dict) -> str:
    c = results["cases"]
    lines = [f"long context on {results['device']} ({SPEC}; decode at batch 1 unless named; roofline bound: "
             f"H200 HBM and tensor cores, indexer O(E) reads counted)", "",
             "| case | bf16 KV | FP8 KV | FP8 / bf16 |", "|---|---|---|---|"]
    decode = lambda r: (f"{r['step_ms']:.2f} ms, bound {r['bound_ms']:.3g} ms = {100 * r['of_roofline']:.3g}% of "
                        f"roofline ({r['peak_gb'] or 0:.1f} GB)") if r else "—"
    for n in sizes["contexts"]:
        a, f = c.get(f"decode {n} auto"), c.get(f"decode {n} fp8")
        ratio = f"{f['step_ms'] / a['step_ms']:.2f}x" if a and f else "—"
        lines.append(f"| decode ctx {n} | {decode(a)} | {decode(f)} | {ratio} |")
    batch = lambda r: f"{r['tok_per_s']:,.0f} tok/s, {decode(r)}" if r else "—"
    for n in sizes["batch_contexts"]:
        a, f = c.get(f"batch {n} auto"), c.get(f"batch {n} fp8")
        ratio = f"{f['tok_per_s'] / a['tok_per_s']:.2f}x" if a and f else "—"
        lines.append(f"| batch {sizes['batch']} decode ctx {n} | {batch(a)} | {batch(f)} | {ratio} speed |")
    prefill = lambda r: f"{r['s']:.1f} s, {r['tok_per_s']:,.0f} tok/s ({r['peak_gb'] or 0:.1f} GB)" if r else "—"
    for n in sizes["prefill"]:
        a, f = c.get(f"prefill {n} auto"), c.get(f"prefill {n} fp8")
        ratio = f"{a['s'] / f['s']:.2f}x speed" if a and f else "—"
        lines.append(f"| prefill {n} | {prefill(a)} | {prefill(f)} | {ratio} |")
    lines.append("")
    lo, hi = sizes["batch_contexts"][0], sizes["batch_contexts"][-1]
    for kv in ("fp8", "auto"):
        a, z = c.get(f"batch {lo} {kv}"), c.get(f"batch {hi} {kv}")
        if a and z:
            lines.append(f"batch {sizes['batch']}, {kv} KV: {z['tok_per_s']:,.0f} tok/s at ctx {hi} vs "
                         f"{a['tok_per_s']:,.0f} at ctx {lo} ({z['tok_per_s'] / a['tok_per_s']:.2f}x)")
    longest = sizes["prefill"][-1]
    for kv in ("auto", "fp8"):
        done = f"prefill {longest} {kv}" in c
        lines.append(f"prefill of {longest} tokens, {kv} KV: {'completed' if done else 'NOT RUN (budget or error)'}")
    first, last = sizes["contexts"][0], sizes["contexts"][-1]
    for kv in ("auto", "fp8"):
        a, z = c.get(f"decode {first} {kv}"), c.get(f"decode {last} {kv}")
        if a and z:
            r = z["step_ms"] / a["step_ms"]
            lines.append(f"decode ctx {last} / ctx {first}, {kv} KV: {r:.2f}x (target <= {TARGET_1M_VS_4K}x: "
                         f"{'met' if r <= TARGET_1M_VS_4K else 'MISSED'}; SGLang 900k / 4k: {SGLANG_900K_VS_4K:.2f}x)")
    lines += chunk_lines(c, sizes)
    cap = results["capacity_40gib"]
    lines.append(f"FP8 KV capacity: {cap['ratio']:.2f}x the tokens of model-dtype KV in 40 GiB "
                 f"(target >= {FP8_CAPACITY}x: {'met' if cap['ratio'] >= FP8_CAPACITY else 'MISSED'})")
    lines.append(f"checks: streamed top-k exact at {results['topk_check']['entries']} entries: "
                 f"{results['topk_check']['ok']}; greedy fast == reference: "
                 + ", ".join(f"{kv} {r['agree']}/{r['of']}" for kv, r in results["greedy_check"].items()))
    return "\n".join(lines)


def chunk_lines(c: dict, sizes: dict) -> list[str]:
    """The chunk target: time at ~900k / time at 0, raw and less the indexer's O(E) bound."""
    lines = []
    first, last = sizes["chunk_at"][0], sizes["chunk_at"][-1]
    for kv in ("auto", "fp8"):
        a, z = c.get(f"chunk {first} {kv}"), c.get(f"chunk {last} {kv}")
        if a and z:
            raw = z["ms"] / a["ms"]
            net = (z["ms"] - z["indexer_bound_ms"]) / (a["ms"] - a["indexer_bound_ms"])
            lines.append(f"{sizes['chunk_tokens']}-token chunk at {last} / at {first}, {kv} KV: {z['ms']:.1f} ms / "
                         f"{a['ms']:.1f} ms = {raw:.2f}x; less the indexer's O(E) bound ({z['indexer_bound_ms']:.2f} / "
                         f"{a['indexer_bound_ms']:.2f} ms): {net:.2f}x (target <= {TARGET_CHUNK_900K_VS_0}x: "
                         f"{'met' if net <= TARGET_CHUNK_900K_VS_0 else 'MISSED'})")
    return lines


def sizes_of(args) -> dict:
    """The sizes of a run: the GPU's or --smoke's, --contexts replacing the decode contexts."""
    sizes = dict(SMOKE if args.smoke else GPU)
    if args.contexts:
        sizes["contexts"] = args.contexts
    if args.decode_tokens:
        sizes["decode_tokens"] = args.decode_tokens
    return sizes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--budget-s", type=float, default=220.0, help="skip the remaining timings after this")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model and contexts: the script itself")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated parts to time, in this order: {', '.join(CASES)} (default: all)")
    p.add_argument("--contexts", default="", help="comma-separated batch-1 decode contexts (default: 4k .. 1M)")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="tokens a decode case generates (its mean step is over all but the first; default 256)")
    p.add_argument("--chunk-repeats", type=int, default=3, help="chunk cases: the median of this many runs")
    p.add_argument("--kv", default="auto,fp8", help="comma-separated KV dtypes to time: auto, fp8 (default: both)")
    args = p.parse_args()
    args.cases = tuple(k.strip() for k in args.cases.split(",") if k.strip())
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        p.error(f"--cases: unknown part(s) {unknown}; known: {', '.join(CASES)}")
    args.kv = tuple(k.strip() for k in args.kv.split(",") if k.strip())
    if not args.kv or set(args.kv) - {"auto", "fp8"}:
        p.error(f"--kv: expected auto and/or fp8, got {args.kv}")
    try:
        args.contexts = tuple(int(n) for n in args.contexts.split(",") if n.strip())
    except ValueError:
        p.error(f"--contexts: expected comma-separated token counts, got {args.contexts!r}")
    if any(n < 2 or n > MAX_POS for n in args.contexts):
        p.error(f"--contexts: each must be in [2, {MAX_POS}]")
    results = run(args)
    text = table(results, sizes_of(args))
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
