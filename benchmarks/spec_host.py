"""Host time of a speculative step vs a plain decode step (docs/speculative.md, "Host time of a step").

The demo model's engine with its forward, its head and its MTP block stubbed (constant
tensors: every draft is accepted, each verify emits k + 1 tokens), the uniform steps run
through the padded CUDA-graph paths eagerly (StepGraphs / DraftGraphs with capture=False, as a
GPU replays them): what is left of a step's time is host work plus a few tiny tensor ops.
For plain decode and MTP k = 1, 2, 3 at each batch: CPU µs per step (the engine thread's;
run with OMP_NUM_THREADS=1 on a CPU device so that every op runs on it), µs per emitted token, the
step's cost in plain steps; the same for its host part alone (the components below, less those
marked "device": tensor work a GPU runs); the breakdown by component; cProfile's top functions.

    python -m benchmarks.spec_host --smoke                      # CPU, seconds
    python -m benchmarks.spec_host [--batches 1 20] [--ks 1 2 3] [--steps 40] [--profile]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, seconds)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="1 20 (--smoke: 1 4)")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="1 2 3 (--smoke: 2)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=5, help="each figure is the least of them (shared hosts)")
    p.add_argument("--async-scheduling", default="off", choices=["on", "off"])
    p.add_argument("--profile", action="store_true", help="cProfile's top functions of each speculative run")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats, args.prompt_len = min(args.steps, 5), 1, 16
    args.batches = args.batches or ([1, 4] if args.smoke else [1, 20])
    args.ks = args.ks or ([2] if args.smoke else [1, 2, 3])
    return args


def stub_model(engine) -> None:
    """The model's forward and head, and its MTP blocks' forward and head, replaced by constant
    tensors: every logits row has its maximum at one fixed token, the target's and the drafter's
    alike, so every draft is accepted."""
    import torch
    m, cfg, device = engine.model, engine.model.cfg, engine.config.device
    logits = torch.zeros(4096, cfg.vocab_size, device=device)
    logits[:, 2:] = torch.arange(cfg.vocab_size - 2, device=device) % 7     # argmax: a fixed token
    m.forward = lambda fb, layers, *rest: torch.zeros(fb.num_tokens, cfg.hc_mult, cfg.hidden_size, device=device)
    m.logits = lambda hidden: logits[:hidden.shape[0]]
    m.head_input = lambda streams: streams[:, 0]
    m.head_logits = lambda head_in: logits[:head_in.shape[0]]
    for block in m.mtp:
        block.draft = lambda model, h_main, fb, kv: h_main
        block.logits = lambda model, h: logits[:h.shape[0]]


def make_engine(args, batch: int, k: int):
    from dsv4.assets import demo_model_dir
    from dsv4.config import EngineConfig
    from dsv4.engine.cuda_graphs import StepGraphs
    from dsv4.engine.engine import LLMEngine
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    tokens = args.prompt_len + (2 * args.repeats + 2) * args.steps * (k + 1) + 16
    cfg = EngineConfig(device=args.device, dtype="float32", max_num_seqs=batch, enable_prefix_caching=False,
                       enforce_eager=True, max_model_len=tokens + 8, cache_memory_gb=1.0,
                       speculative_config=spec, async_scheduling=args.async_scheduling)
    engine = LLMEngine(demo_model_dir(), cfg)
    stub_model(engine)
    runner = engine.runner        # the padded (graph) paths of a GPU, run eagerly: their host work
    max_bs = cfg.cuda_graph_max_bs
    runner.graphs = StepGraphs(engine.model, runner.storage, max_bs, capture=False, h2d=runner.h2d,
                               keep_streams=bool(k))
    if k:
        from dsv4.engine.speculative.draft_graphs import DraftGraphs
        engine.spec.proposer.graphs = DraftGraphs(engine.model, runner.storage, max_bs, k + 1, capture=False, h2d=runner.h2d)
    return engine, tokens


def run_case(args, batch: int, k: int) -> dict:
    from dsv4.sampling_params import SamplingParams
    from .host_sections import Sections, instrument, profile_steps
    engine, tokens = make_engine(args, batch, k)
    rng, vocab = random.Random(0), engine.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=tokens - args.prompt_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(2, vocab) for _ in range(args.prompt_len)], params)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()
    gc.collect()
    gc.freeze()
    best, emitted = 1e9, 0
    for _ in range(args.repeats):
        before = sum(len(r.output_token_ids) for r in engine.requests.values())
        start = time.thread_time()        # this thread's CPU time: what the host work costs, whatever
        for _ in range(args.steps):       # else shares the machine (OMP_NUM_THREADS=1: torch's ops run here)
            engine.step()
        best = min(best, (time.thread_time() - start) / args.steps)
        emitted = sum(len(r.output_token_ids) for r in engine.requests.values()) - before
    sections = Sections()
    instrument(engine, sections)
    _instrument_spec(engine, sections)
    parts: dict[str, float] = {}
    for _ in range(args.repeats):             # each component's least over the repeats
        sections.reset()
        for _ in range(args.steps):
            engine.step()
        for name, seconds in sections.seconds.items():
            parts[name] = min(parts.get(name, 1e9), seconds / args.steps * 1e6)
    parts = dict(sorted(parts.items(), key=lambda kv: -kv[1]))
    sections.restore()
    profile = None
    if args.profile:
        profile = profile_steps(engine.step, args.steps, 20)
    assert len(engine.requests) == batch, "a request finished inside the measured steps"
    gc.unfreeze()
    host = sum(us for name, us in parts.items() if not name.endswith("(device)"))
    return {"batch": batch, "k": k, "us_per_step": best * 1e6, "host_us_per_step": host,
            "tokens_per_step": emitted / args.steps,
            "breakdown_us": parts, "profile": profile}


def _instrument_spec(engine, sections) -> None:
    """The speculative step's parts (their own time) as components of their own."""
    if engine.spec is None:
        return
    spec, graphs = engine.spec, engine.spec.proposer.graphs
    parts = [(spec, "step", "spec: step bookkeeping (acceptance, read-back)"),
             (spec, "_verify", "spec: verify (sampling batch, acceptance)"),
             (spec, "_verify_greedy", "spec: verify greedy (argmax: device)"),
             (spec, "_draft", "spec: draft bookkeeping"),
             (spec.proposer, "propose", "spec: drafter"),
             (graphs, "_inputs", "spec: draft batches (build)"),
             (graphs, "_draft", "spec: draft graph body (device)")]
    for owner, name, component in parts:
        if owner is not None and hasattr(owner, name):      # (what an older tree has of them)
            sections.wrap(owner, name, component)


def report(results: list[dict]) -> str:
    plain = {r["batch"]: r["us_per_step"] for r in results if r["k"] == 0}
    host_plain = {r["batch"]: r["host_us_per_step"] for r in results if r["k"] == 0}
    lines = [f"{'batch':>5} {'k':>2} {'us/step':>9} {'tok/step':>9} {'us/token':>9} {'x plain':>8} "
             f"{'host us/step':>12} {'x plain':>8}"]
    for r in results:
        base, hbase = plain.get(r["batch"]), host_plain.get(r["batch"])
        lines.append(f"{r['batch']:>5} {r['k']:>2} {r['us_per_step']:>9.0f} {r['tokens_per_step']:>9.2f} "
                     f"{r['us_per_step'] / r['tokens_per_step']:>9.1f} "
                     f"{r['us_per_step'] / base if base else float('nan'):>8.2f} "
                     f"{r['host_us_per_step']:>12.0f} {r['host_us_per_step'] / hbase if hbase else float('nan'):>8.2f}")
    for r in results:
        lines.append(f"\nbatch {r['batch']} k {r['k']}: " + ", ".join(
            f"{name} {us:.0f}" for name, us in r["breakdown_us"].items() if us >= 1))
        if r["profile"]:
            lines.append(r["profile"])
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = [run_case(args, b, k) for b in args.batches for k in [0] + args.ks]
    for r in results:
        r["us_per_token"] = r["us_per_step"] / r["tokens_per_step"]
    print(report(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return {"results": results}


if __name__ == "__main__":
    main()
