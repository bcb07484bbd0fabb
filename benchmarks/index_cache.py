"""IndexCache on the GPU, one command: prefill throughput and batch-1 decode step time at
index_topk_freq 1, 2, 4 on a V4-Flash-shaped slice with at least 8 CSA layers, and the demo
model's held-out perplexity at the same freqs (docs/architecture.md, "Model").

    python -m benchmarks.index_cache --out DIR [--layers 18] [--routed-experts 64]
        [--contexts 16384,131072,524288] [--freqs 1,2,4] [--chunk 16384] [--experts bf16|fp8|mxfp4]
        [--skip-decode] [--skip-ppl] [--skip-identity]
    python -m benchmarks.index_cache --out DIR --dry-run-cpu       # the script itself, tiny, CPU

The slice (`random:flash-slice:LAYERS:n_routed_experts=R`, V4-Flash's layer order: layers 2,
4, ... are CSA, 18 layers hold 8; R = 64 bf16 experts a layer fit 18 layers on one H200 with
the same expert FLOPs per token as 256) is built once; each freq switches its pattern (`set_index_topk_pattern`: no
weight changes) and gets a fresh engine. Prefill: one request of N random tokens in chunks of
--chunk tokens (eager, fast path), the time to its first token, best of --repeats (one run for
N > 131072). Decode: batch 1 at a synthetic context of N tokens (bench/offline.py), CUDA graphs
and async scheduling on, the mean step over --decode-tokens. Perplexity: the demo model over
its held-out texts concatenated (the demo has 2 CSA layers: freq 2 and 4 are the same there).
Identity: on the demo model at each freq > 1, greedy tokens of the fast path (Triton kernels,
CUDA-graph decode: the producer's offsets are a tensor of the graph's pool) against the
reference path (torch ops, eager), as benchmarks/gpu_suite.py checks them at freq 1.
Writes index_cache.json and index_cache.txt into DIR; the target checked in the table is
>= 15% prefill throughput at 512k with freq 4.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch

from dsv4.bench import offline as bo
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.weights import load_model, model_config
from dsv4.sampling_params import SamplingParams

T0 = time.perf_counter()
TARGET = ("prefill", 524288, 4, 1.15)    # (kind, context, freq, speed-up over freq 1)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine(spec: str, model, device: str, **kw) -> LLMEngine:
    return LLMEngine(spec, EngineConfig(device=device, dtype="bfloat16" if device != "cpu" else "float32", **kw),
                     model=model)


def prefill_seconds(eng: LLMEngine, n: int, tag: str) -> float:
    """One request of n random tokens, chunked by the scheduler: seconds to its first token."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(100, eng.cfg.vocab_size, (n,), generator=gen).tolist()
    req = eng.add_request(tag, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    sync(eng.config.device)
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    sync(eng.config.device)
    assert req.output_token_ids, "the prefill produced no token"
    return time.perf_counter() - t


def prefill_case(spec, model, device, n, chunk, repeats) -> float:
    eng = engine(spec, model, device, max_num_seqs=1, max_num_batched_tokens=min(chunk, n), num_pages=n // 256 + 4,
                 max_model_len=n + 8, async_scheduling="off", enforce_eager=True)
    runs = [prefill_seconds(eng, n, f"p{n}-{i}") for i in range(repeats if n <= 131072 else 1)]
    del eng
    return min(runs)


def decode_case(spec, model, device, n, tokens) -> float:
    eng = engine(spec, model, device, max_num_seqs=1, max_num_batched_tokens=256, num_pages=n // 256 + 4,
                 max_model_len=n + tokens + 8)
    bo.time_one(eng, 1, n, tokens, True, "warm")        # captures every graph shape the run needs
    step = bo.time_one(eng, 1, n, tokens, True, "run")["step_times"][0]
    del eng
    return step


def patterns(spec: str, freqs: list[int]) -> dict[int, str]:
    return {f: model_config(spec, {"index_topk_freq": f}).index_topk_pattern for f in freqs}


def slice_runs(args, device: str, results: dict) -> None:
    spec = args.spec or f"random:flash-slice:{args.layers}:n_routed_experts={args.routed_experts}"
    pats = patterns(spec, args.freqs)
    log(f"{spec}: {model_config(spec).num_csa_layers} CSA layers; patterns {pats}")
    model = load_model(spec, device, torch.bfloat16 if device != "cpu" else torch.float32,
                       keep_mxfp4=args.experts == "mxfp4", keep_fp8=args.experts == "fp8")
    prefill_case(spec, model, device, min(args.contexts), args.chunk, 1)      # compile every kernel once
    for n in args.contexts:
        for f in args.freqs:
            if time.perf_counter() - T0 > args.budget_s:
                log(f"budget spent: prefill {n} freq {f} and later cases skipped")
                return
            model.set_index_topk_pattern(pats[f])
            s = prefill_case(spec, model, device, n, args.chunk, args.repeats)
            results.setdefault(f"prefill {n}", {})[f] = {"s": s, "tok_per_s": n / s}
            log(f"prefill {n} freq {f}: {s:.3f} s, {n / s:,.0f} tok/s")
            gc.collect()
    for n in [] if args.skip_decode else args.contexts:
        for f in args.freqs:
            if time.perf_counter() - T0 > args.budget_s:
                log(f"budget spent: decode {n} freq {f} and later cases skipped")
                return
            model.set_index_topk_pattern(pats[f])
            s = decode_case(spec, model, device, n, args.decode_tokens)
            results.setdefault(f"decode b1 ctx{n}", {})[f] = {"s": s, "tok_per_s": 1 / s}
            log(f"decode b1 ctx{n} freq {f}: {s * 1e3:.2f} ms/step")
    del model
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def heldout_ids(model_dir: str) -> list[int]:
    from dsv4.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    with open(os.path.join(model_dir, "heldout.json"), encoding="utf-8") as f:
        return [t for p in json.load(f)["prompts"] for t in tok.encode(p["prompt"] + p["reference_completion"])]


@torch.no_grad()
def perplexities(device: str, freqs: list[int]) -> dict:
    """The demo model's perplexity over its held-out texts (one sequence), per freq; also over
    the positions past 4 * index_topk only, where the top-k discards entries."""
    from dsv4.assets import DEMO_DIR
    from dsv4.engine.oneshot import full_logits
    ids = heldout_ids(DEMO_DIR)
    out = {"tokens": len(ids)}
    for f in freqs:
        model = load_model(DEMO_DIR, device, torch.float32, overrides={"index_topk_freq": f})
        logits = full_logits(model, ids)
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:], device=logits.device),
                                                reduction="none")
        far = 4 * model.cfg.index_topk
        out[f] = {"pattern": model.cfg.index_topk_pattern or "all F", "ppl": math.exp(float(nll.mean())),
                  f"ppl_past_{far}": math.exp(float(nll[far:].mean())) if len(nll) > far else None}
        log(f"demo held-out perplexity freq {f}: {out[f]}")
    return out


def identities(device: str, freqs: list[int]) -> dict:
    """Greedy identity, fast path vs reference path, on the demo model at each freq > 1."""
    from benchmarks import gpu_suite
    from dsv4.assets import DEMO_DIR
    from dsv4.text.tokenizer import Tokenizer
    gpu_suite.DEV = device
    tok = Tokenizer.from_dir(DEMO_DIR)
    with open(os.path.join(DEMO_DIR, "heldout.json"), encoding="utf-8") as f:
        prompts = [tok.encode(p["prompt"]) for p in json.load(f)["prompts"]]
    out = {}
    for f in freqs:
        if f == 1:
            continue
        model = load_model(DEMO_DIR, device, torch.bfloat16 if device != "cpu" else torch.float32,
                           overrides={"index_topk_freq": f})
        out[f] = gpu_suite.greedy_identity(DEMO_DIR, model, prompts, new_tokens=48)
        log(f"greedy identity freq {f}: {out[f]['sequences_identical']} of {out[f]['sequences']}")
    return out


def table(results: dict, freqs: list[int]) -> str:
    head = f"{'case':<22}" + "".join(f"{'freq ' + str(f):>16}" for f in freqs) + "".join(
        f"{'x' + str(f) + '/x1':>9}" for f in freqs if f != 1)
    rows = [head, "-" * len(head)]
    for case, r in results.items():
        if case in ("perplexity", "identity"):
            continue
        cells = "".join(f"{r[f]['tok_per_s']:>12,.1f} t/s" if f in r else f"{'-':>16}" for f in freqs)
        gains = "".join(f"{r[f]['tok_per_s'] / r[1]['tok_per_s']:>9.3f}" if f in r and 1 in r else f"{'-':>9}"
                        for f in freqs if f != 1)
        rows.append(f"{case:<22}{cells}{gains}")
    kind, n, f, want = TARGET
    r = results.get(f"{kind} {n}", {})
    if f in r and 1 in r:
        got = r[f]["tok_per_s"] / r[1]["tok_per_s"]
        rows.append(f"target: {kind} {n} freq {f} >= {want:.2f}x freq 1: {got:.3f}x "
                    f"({'met' if got >= want else 'NOT met'})")
    ppl = results.get("perplexity")
    if ppl:
        rows.append("demo held-out perplexity: " + ", ".join(
            f"freq {f} ({ppl[f]['pattern']}) {ppl[f]['ppl']:.4f}" for f in freqs if f in ppl) +
            f" over {ppl['tokens']} tokens")
    for f, r in results.get("identity", {}).items():
        rows.append(f"demo greedy identity freq {f}, fast vs reference path: {r['sequences_identical']} of "
                    f"{r['sequences']} sequences identical; first divergences {r['first_divergences']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--spec", default=None, help="model spec (default: random:flash-slice:LAYERS:n_routed_experts=R)")
    p.add_argument("--layers", type=int, default=18, help="slice layers (18: 8 CSA layers)")
    p.add_argument("--contexts", default="16384,131072,524288")
    p.add_argument("--freqs", default="1,2,4")
    p.add_argument("--chunk", type=int, default=16384, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--repeats", type=int, default=2, help="prefill runs per case up to 128k (best of)")
    p.add_argument("--decode-tokens", type=int, default=33)
    p.add_argument("--routed-experts", type=int, default=64, help="routed experts a layer of the slice")
    p.add_argument("--experts", choices=("bf16", "fp8", "mxfp4"), default="bf16",
                   help="the slice's experts: bf16, or kept FP8 / MXFP4 (--keep-fp8 / --keep-mxfp4)")
    p.add_argument("--budget-s", type=float, default=3000)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-ppl", action="store_true")
    p.add_argument("--skip-identity", action="store_true")
    p.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on the CPU, to test the script itself")
    args = p.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    args.freqs = [int(x) for x in args.freqs.split(",")]
    device = "cpu" if args.dry_run_cpu else "cuda"
    if args.dry_run_cpu:
        args.spec, args.contexts, args.chunk, args.decode_tokens = "random:tiny:8", [300, 600], 256, 4
        args.experts = "bf16"
    if 1 not in args.freqs:
        args.freqs = [1] + args.freqs
    os.makedirs(args.out, exist_ok=True)
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    results: dict = {}
    slice_runs(args, device, results)
    if not args.skip_ppl:
        results["perplexity"] = perplexities(device, args.freqs)
    if not args.skip_identity:
        results["identity"] = identities(device, args.freqs)
    text = table(results, args.freqs)
    print(text)
    with open(os.path.join(args.out, "index_cache.json"), "w") as f:
        json.dump({"info": info, "results": {k: {str(f): v for f, v in r.items()} for k, r in results.items()}},
                  f, indent=1)
    with open(os.path.join(args.out, "index_cache.txt"), "w") as f:
        f.write(json.dumps(info) + "\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
