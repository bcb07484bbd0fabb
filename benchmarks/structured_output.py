"""Structured outputs on the GPU, one command: decode tokens/s of the demo model at batch 64 with
every request under a JSON-schema constraint against the same batch with none (target >= 0.9x;
docs/architecture.md, "Structured outputs"). CUDA graphs and async scheduling on: each step's
masks are filled on the host (a worker thread for a large batch) while the GPU runs the forward
and the main thread appends the previous step's tokens, and applied in the sampler.

    python -m benchmarks.structured_output [--batch 64] [--tokens 256] [--repeats 3]
    python -m benchmarks.structured_output --smoke        # tiny, on the CPU, in seconds
    python -m benchmarks.structured_output --host [--batch 64] [--tokens 64]   # forward stubbed

`--host` replaces the model's forward by constant logits (benchmarks/host_path.py) and reports
the same ratio over the host's work alone, with how long the main thread waited for the masks
per step: the bound on the ratio of a host-bound step. On the CPU the forward is synchronous,
so the full run shows the masks' cost against a slow forward and little of the overlap.

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


class MaskWaits:
    """Time the main thread spends in `PendingMask.result()` (waiting for the worker's fill)."""

    def __init__(self):
        from dsv4.structured import masks
        self.seconds, self.calls, self._result = 0.0, 0, masks.PendingMask.result
        timer = self

        def result(pending):
            start = time.perf_counter()
            try:
                return timer._result(pending)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1
        masks.PendingMask.result = result

    def close(self) -> None:
        from dsv4.structured import masks
        masks.PendingMask.result = self._result


def host_only(args) -> None:
    """The ratio over the host's work: the forward stubbed, the padded step run eagerly."""
    from benchmarks.host_path import stub_forward
    from dsv4.engine.cuda_graphs import StepGraphs
    engine = LLMEngine(demo_model_dir(), EngineConfig(device="cpu", async_scheduling="on", enforce_eager=True,
                                                      max_num_seqs=max(args.batch * 2, 8), num_pages=64))
    stub_forward(engine)
    stub = engine.model.forward                      # (eager prefill steps pass images and taps too)
    engine.model.forward = lambda fb, layers, *rest: stub(fb, layers)
    engine.runner.graphs = StepGraphs(engine.model, engine.runner.storage, args.batch, capture=False,
                                      h2d=engine.runner.h2d)
    run(engine, workload(engine, args.batch, 4, True, "w"))
    times = {True: [], False: []}
    waits = MaskWaits()
    try:
        for r in range(args.repeats):
            for constrained in (False, True):
                waits.seconds = waits.calls = 0
                done, dt = run(engine, workload(engine, args.batch, args.tokens, constrained, f"{int(constrained)}-{r}-"))
                assert all(len(o.token_ids) == args.tokens for o in done.values()), "a request stopped early"
                times[constrained].append((dt, waits.seconds / max(waits.calls, 1)))
    finally:
        waits.close()
    (plain, _), (cons, wait) = min(times[False]), min(times[True])
    print(f"\nhost work only (forward stubbed, CPU), batch {args.batch}, {args.tokens} tokens (best of {args.repeats})")
    print(f"ms per step: no constraint {plain / args.tokens * 1e3:.3f}, JSON schema {cons / args.tokens * 1e3:.3f}; "
          f"ratio {plain / cons:.3f}; main thread waited {wait * 1e3:.3f} ms per step for the masks")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--host", action="store_true", help="the model's forward stubbed: host work only, on the CPU")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.repeats = 4, 8, 1
    if args.host or args.smoke:
        host_only(args)
    if args.host:
        return
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
