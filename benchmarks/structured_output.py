"""Structured outputs on the GPU, one command: decode tokens/s of the demo model at batch 64 with
every request under a JSON-schema constraint against the same batch with none (target >= 0.9x;
docs/architecture.md, "Structured outputs"). CUDA graphs and async scheduling on: each step's
masks are computed on the host while the GPU runs the forward, and applied in the sampler.

    python -m benchmarks.structured_output [--batch 64] [--tokens 256] [--repeats 3]
    python -m benchmarks.structured_output --smoke        # tiny, on the CPU, in seconds

The schema forces a long JSON string (minLength), so every request decodes exactly --tokens
tokens either way. Checks: every constrained output is accepted token by token by a fresh
matcher of the same grammar; unconstrained greedy requests batched with constrained ones give
the tokens of a run without them (invariant 5)."""
from __future__ import annotations

import argparse
import json
import time

import torch

from dsv4.assets import demo_model_dir
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}
TARGET = 0.9


def run(engine: LLMEngine, requests: dict) -> tuple[dict, float]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    done, start = {}, time.perf_counter()
    while len(done) < len(requests):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return done, time.perf_counter() - start


def workload(engine, batch: int, tokens: int, constrained: bool, tag: str) -> dict:
    spec = StructuredOutputs(json=json.dumps(SCHEMA)) if constrained else None
    return {f"{tag}{i}": (engine.tokenizer.encode(f"Story {i}:"), SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=not constrained, structured=spec)) for i in range(batch)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.repeats = 4, 8, 1
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    engine = LLMEngine(demo_model_dir(), EngineConfig(device=device, async_scheduling="on",
                                                      max_num_seqs=max(args.batch * 2, 8), num_pages=512 if device == "cuda" else 64))
    # warm-up: CUDA graphs, xgrammar's import and compilation
    run(engine, workload(engine, args.batch, 4, True, "w"))
    run(engine, workload(engine, args.batch, 4, False, "v"))
    times = {True: [], False: []}
    outs = {}
    for r in range(args.repeats):
        for constrained in (False, True):
            done, dt = run(engine, workload(engine, args.batch, args.tokens, constrained, f"{int(constrained)}-{r}-"))
            assert all(len(o.token_ids) == args.tokens for o in done.values()), "a request stopped early"
            times[constrained].append(dt)
            outs[constrained] = done
    # correctness 1: a fresh matcher accepts every constrained output
    from dsv4.structured.compiler import GrammarCache
    import xgrammar
    cache = GrammarCache(engine.tokenizer, engine.cfg.vocab_size, engine.eos_token_id)
    compiled = cache.get(StructuredOutputs(json=json.dumps(SCHEMA)))
    for o in outs[True].values():
        m = xgrammar.GrammarMatcher(compiled)
        assert all(m.accept_token(t) for t in o.token_ids), f"{o.request_id}: output leaves the grammar"
    # correctness 2 (invariant 5): unconstrained tokens unchanged by constrained neighbours
    # (the same batch shape both times: the twins run 32 tokens with or without the constraint)
    plain_twins = {**workload(engine, 8, 32, False, "a"), **workload(engine, 8, 32, False, "t")}
    alone, _ = run(engine, plain_twins)
    mixed = {**workload(engine, 8, 32, False, "m"), **workload(engine, 8, 32, True, "c")}
    both, _ = run(engine, mixed)
    same = all(both[f"m{i}"].token_ids == alone[f"a{i}"].token_ids for i in range(8))
    total = args.batch * args.tokens
    plain, cons = min(times[False]), min(times[True])
    ratio = plain / cons
    print(f"\nstructured outputs, demo model on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"batch {args.batch}, {args.tokens} decode tokens each (best of {args.repeats})")
    print(f"{'run':<24}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'no constraint':<24}{plain:>10.3f}{total / plain:>12.0f}")
    print(f"{'JSON schema (all rows)':<24}{cons:>10.3f}{total / cons:>12.0f}")
    print(f"ratio {ratio:.3f} (target >= {TARGET}): {'MET' if ratio >= TARGET else 'MISSED'}")
    print(f"grammar outputs accepted by a fresh matcher: yes; unconstrained tokens unchanged: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
