"""Speculative decoding benchmark (one device call, docs/speculative.md):

1. demo model, the 20 held-out prompts, greedy, 128 new tokens each: plain decode vs MTP with
   k = 1, 2, 3 and (with its trained drafter, dsv4/assets/demo/dspark) DSpark with k = 3, 4 —
   decode tokens/s at batch 1 (one prompt at a time, time after the first
   token) and with all 20 prompts at once, mean acceptance length, per-position acceptance,
   drafted vs accepted tokens, and how many sequences equal plain decode's (bf16 on the GPU:
   a verify step's k + 1 rows are summed in another order than k + 1 decode steps, so a
   near-tie can part them; the CPU tests assert identity in fp32); before it, greedy identity in
   fp32 on the GPU, plain vs MTP max(ks) and vs DSpark (the first of dspark-ks), 64 tokens;
2. `random:flash-slice:6` (bf16): the main model's cost of a verify step of q = k + 1 tokens
   per request vs a decode step (q = 1) at batch 1, 8 and 64, context 1024, both through CUDA
   graphs; cost(q) / cost(1) is the acceptance length at which verifying pays for itself
   (the drafter's own cost not included: the slice has no MTP block);
3. DSpark (random weights, so acceptance is not meaningful): greedy sequences equal to plain
   decode in fp32 on `random:tiny-dspark`, and on `random:flash-slice-dspark::n_routed_experts=32`
   (the slice + Flash-0731's drafter shape; 32 experts to fit beside part 2's model) in bf16
   the drafter's cost per step (window keys + block + Markov / confidence heads, eager) beside the
   step's, at batch 1 and 8 (the figure a trained drafter's acceptance must pay for).

    python -m benchmarks.spec_suite --out DIR [--max-tokens 128] [--ks 1,2,3] [--dspark-ks 3,4]
    python -m benchmarks.spec_suite --out DIR --cpu     # part 1's acceptance on the CPU, fp32
    python -m benchmarks.spec_suite --out DIR --smoke   # tiny sizes on the CPU, to test the suite itself

Part 1's speculative rows run the CUDA graphs (verify graphs; the MTP or DSpark draft graph of
uniform greedy steps): each row reports `graph_drafts` of `draft_steps` (the draft steps that
replayed a draft graph) and the draft graph shapes captured. `--smoke` runs every part at tiny
sizes on the CPU, part 1 through the same padded graph paths run eagerly (capture=False).

`--cpu`: part 1 only, in fp32 on the CPU, all prompts at once (no batch-1 pass): acceptance
length, per-position acceptance and identity with plain decode are properties of the models and
come out as on the GPU (bar bf16 near-ties); the tokens/s of a CPU run mean nothing.

Prints one table; writes spec_suite.json and spec_suite.txt into DIR.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- 1. demo model: plain vs MTP ------------------------------------------------------------
def demo_prompts() -> tuple[str, list[list[int]]]:
    from dsv4.assets import DEMO_DIR
    from dsv4.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO_DIR)
    with open(os.path.join(DEMO_DIR, "heldout.json"), encoding="utf-8") as f:
        return DEMO_DIR, [tok.encode(p["prompt"]) for p in json.load(f)["prompts"]]


def demo_methods(ks: list[int], dspark_ks: list[int]) -> dict[str, dict | None]:
    """Row name -> speculative config: plain, MTP k, and DSpark k when the demo has its drafter."""
    from dsv4.assets import DEMO_DIR
    from dsv4.engine.speculative import DSPARK_DRAFT_DIR
    out = {"plain": None} | {f"mtp k={k}": {"method": "mtp", "num_speculative_tokens": k} for k in ks}
    if os.path.isdir(os.path.join(DEMO_DIR, DSPARK_DRAFT_DIR)):
        out |= {f"dspark k={k}": {"method": "dspark", "num_speculative_tokens": k} for k in dspark_ks}
    return out


def demo_engine(path, model, device, dtype, spec: dict | int | None, batch: int, padded: bool = False):
    """padded (--smoke, on the CPU): the graph paths, run eagerly (`_padded_graphs`)."""
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    if isinstance(spec, int):
        spec = {"method": "mtp", "num_speculative_tokens": spec} if spec else None
    eng = LLMEngine(path, EngineConfig(device=device, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=4096,
                                       num_pages=batch * 4 + 8, max_model_len=1024, speculative_config=spec),
                    model=model)
    if padded and eng.runner.graphs is None:
        _padded_graphs(eng, batch)
    return eng


def _padded_graphs(eng, max_bs: int) -> None:
    """The CUDA-graph paths without capture (as the CPU tests run them): verify steps through the
    padded StepGraphs, drafts through the padded MTP or DSpark draft graph."""
    from dsv4.engine.cuda_graphs import StepGraphs
    from dsv4.engine.speculative.draft_graphs import DraftGraphs
    from dsv4.engine.speculative.dspark_graphs import DSparkGraphs
    runner = eng.runner
    runner.graphs = StepGraphs(eng.model, runner.storage, max_bs, capture=False, h2d=runner.h2d,
                               keep_streams=runner.keep_hidden, keep_taps=runner.keep_taps)
    if eng.spec is not None and eng.spec.dspark:
        eng.spec.proposer.graphs = DSparkGraphs(eng.model, runner.storage, max_bs, eng.spec.k + 1, capture=False,
                                                h2d=runner.h2d)
    elif eng.spec is not None:
        eng.spec.proposer.graphs = DraftGraphs(eng.model, runner.storage, max_bs, eng.spec.k + 1, capture=False, h2d=runner.h2d)


def count_draft_paths(eng) -> dict:
    """Count the engine's draft steps from now on, and those that replayed a draft graph."""
    counts = {"draft_steps": 0, "graph_drafts": 0}
    proposer = eng.spec.proposer
    for obj, method, key in ((proposer, "propose", "draft_steps"), (proposer.graphs, "run", "graph_drafts")):
        if obj is None:
            continue
        original = getattr(obj, method)

        def counted(*a, _original=original, _key=key):
            counts[_key] += 1
            return _original(*a)
        setattr(obj, method, counted)
    return counts


def spec_summary(eng, paths: dict) -> dict:
    """Acceptance figures and the draft paths taken (graph drafts of draft steps, shapes captured)."""
    graphs = eng.spec.proposer.graphs
    return eng.spec.stats.summary() | paths | {"draft_graph_shapes": len(graphs.graphs) if graphs is not None else 0}


def generate(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[dict, float, float]:
    """All prompts at once (one prefill step: the budget holds them) -> (token ids by prompt
    index, seconds of the first step, seconds of the steps after it)."""
    from dsv4.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    device, done = str(engine.config.device), {}

    def step():
        for o in engine.step():
            if o.finished:
                done[int(o.request_id[len(tag):])] = o.token_ids
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    t1 = time.perf_counter()
    while engine.has_unfinished():
        step()
    _sync(device)
    return done, t1 - t0, time.perf_counter() - t1


def demo_runs(device: str, dtype: str, methods: dict[str, dict | None], max_tokens: int, n_prompts: int,
              batch1: bool = True, padded: bool = False) -> dict:
    from dsv4.model.weights import load_model
    path, prompts = demo_prompts()
    prompts = prompts[:n_prompts]
    shared = load_model(path, device, getattr(torch, dtype))
    out, plain, plain_batch = {}, None, None
    for name, spec in methods.items():
        row = out[name] = {}
        # DSpark replaces the model's MTP layer by its stages (speculative.check_speculative): a model of its own
        model = load_model(path, device, getattr(torch, dtype)) if spec and spec["method"] == "dspark" else shared
        if batch1:      # one prompt at a time; decode time after each prompt's first token
            eng = demo_engine(path, model, device, dtype, spec, 1, padded)
            generate(eng, prompts[:1], max_tokens, "warm")         # graph shapes captured before timing
            if eng.spec is not None:
                eng.spec.stats = type(eng.spec.stats)()
                paths = count_draft_paths(eng)
            tokens, decode_s, outs = 0, 0.0, {}
            for i, p in enumerate(prompts):
                done, _, after = generate(eng, [p], max_tokens, f"b1-{i}-")
                outs[i] = done[0]
                tokens += len(done[0]) - 1
                decode_s += after
            row["b1_decode_tokens_per_s"] = tokens / decode_s
            if eng.spec is not None:
                row.update(spec_summary(eng, paths))
        # every prompt at once
        eng = demo_engine(path, model, device, dtype, spec, len(prompts), padded)
        if batch1:
            generate(eng, prompts, max_tokens, "warm")
        if eng.spec is not None:
            eng.spec.stats = type(eng.spec.stats)()
            paths = count_draft_paths(eng)
        done, _, after = generate(eng, prompts, max_tokens, "all-")
        batch = f"b{len(prompts)}"
        if not batch1:
            outs = done
        row[f"{batch}_decode_tokens_per_s"] = sum(len(t) - 1 for t in done.values()) / after
        if eng.spec is not None:
            summary = spec_summary(eng, paths)
            if batch1:      # the batch-1 figures stay the row's own; the batch's go beside them
                row.update({f"{batch}_{k}": summary[k] for k in ("spec_mean_acceptance_length", "draft_steps",
                                                                 "graph_drafts", "draft_graph_shapes")})
            else:
                row.update(summary)
        if plain is None:
            plain, plain_batch = outs, done
        row["sequences_equal_plain"] = sum(outs[i] == plain[i] for i in outs)
        row[f"{batch}_sequences_equal_plain"] = sum(done[i] == plain_batch[i] for i in done)
        log(f"demo {name}: {row}")
    if batch1:
        base = out["plain"]["b1_decode_tokens_per_s"]
        for row in out.values():
            row["b1_speedup"] = row["b1_decode_tokens_per_s"] / base
    return out


def fp32_identity(device: str, spec: dict, max_tokens: int, n_prompts: int, padded: bool = False) -> dict:
    """Greedy tokens of plain decode and of `spec` (MTP or DSpark, k drafts) in fp32, all prompts
    at once (both through CUDA graphs: verify and draft graphs): sequences identical, and where
    one parts, the plain run's top-2 margin there; the draft steps that replayed a draft graph."""
    from dsv4.model.weights import load_model
    from dsv4.sampling_params import SamplingParams
    path, prompts = demo_prompts()
    prompts = prompts[:n_prompts]
    name, k = f"{spec['method']} k={spec['num_speculative_tokens']}", spec["num_speculative_tokens"]
    outs = {}
    for run in (None, spec):
        model = load_model(path, device, torch.float32)     # (DSpark replaces the model's MTP layer)
        eng = demo_engine(path, model, device, "float32", run, len(prompts), padded)
        paths = count_draft_paths(eng) if run else {}
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, params)
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        outs[name if run else "plain"] = [done[str(i)] for i in range(len(prompts))]
    parted = []
    for a, b in zip(outs["plain"], outs[name]):
        j = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if j is not None:
            lp = sorted(a.logprobs[j].values(), reverse=True)
            parted.append({"step": j, "plain_top2_margin": round(lp[0] - lp[1], 5)})
    result = {"method": spec["method"], "k": k, "sequences": len(prompts), "identical": len(prompts) - len(parted),
              "parted": parted} | spec_summary(eng, paths)
    log(f"fp32 greedy identity plain vs {name}: {result}")
    return result


# ---- 3. DSpark: identity and drafter cost ------------------------------------------------------
def dspark_runs(device: str, spec: str, k: int, batches: list[int], max_tokens: int) -> dict:
    """Plain vs DSpark k on random DSpark models: fp32 greedy identity on `random:tiny-dspark`
    (batch max(batches)), then on `spec` in bf16 seconds per step and per draft at each batch."""
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.random_model import build_random_model
    g = torch.Generator().manual_seed(0)
    out = {}
    for dtype, model_spec in (("float32", "random:tiny-dspark"), ("bfloat16", spec)):
        model = build_random_model(model_spec, device, getattr(torch, dtype))
        vocab = model.cfg.vocab_size
        for batch in (batches[-1:] if dtype == "float32" else batches):
            prompts = [torch.randint(2, vocab - 1, (64,), generator=g).tolist() for _ in range(batch)]
            seqs, row = {}, {}
            for kk in (0, k):
                cfg = EngineConfig(device=device, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=4096,
                                   num_pages=batch * 2 + 8, max_model_len=1024, enforce_eager=True,
                                   speculative_config={"method": "dspark", "num_speculative_tokens": kk} if kk
                                   else None)
                eng = LLMEngine(model_spec, cfg, model=model)
                draft_s = _time_drafts(eng, device)
                generate(eng, prompts[:1], 4, "warm")
                draft_s[0] = 0.0
                steps0 = _count_steps(eng)
                done, _, after = generate(eng, prompts, max_tokens, f"d{kk}-")
                seqs[kk] = done
                name = "dspark" if kk else "plain"
                row[f"{name}_ms_per_step"] = 1e3 * after / max(1, steps0[0] - 1)
                row[f"{name}_tokens_per_s"] = sum(len(t) - 1 for t in done.values()) / after
                if kk:
                    row["draft_ms_per_step"] = 1e3 * draft_s[0] / max(1, steps0[0] - 1)
                    row.update(eng.spec.stats.summary())
            row["sequences_equal_plain"] = sum(seqs[0][i] == seqs[k][i] for i in seqs[0])
            out[f"{dtype} b{batch}"] = row
            log(f"dspark {model_spec} {dtype} batch {batch}: {row}")
        del model
    return out


def _time_drafts(eng, device: str) -> list[float]:
    """Accumulate the seconds the DSpark drafter takes (a one-element list, reset by the caller)."""
    total = [0.0]
    if eng.spec is None:
        return total
    propose = eng.spec.proposer.propose

    def timed(*a):
        _sync(device)
        t0 = time.perf_counter()
        r = propose(*a)
        _sync(device)
        total[0] += time.perf_counter() - t0
        return r
    eng.spec.proposer.propose = timed
    return total


def _count_steps(eng) -> list[int]:
    """Count the engine's steps from now on (a one-element list)."""
    n, step = [0], eng.step

    def counted():
        n[0] += 1
        return step()
    eng.step = counted
    return n


# ---- 2. slice: verify step cost ----------------------------------------------------------------
def verify_cost(device: str, spec: str, batches: list[int], qs: list[int], ctx: int, reps: int) -> dict:
    """Median seconds of the runner's step (CUDA graph) with q tokens per request, all rows with
    logits, at `ctx` tokens of synthetic context (cache contents arbitrary: cost depends on
    positions and page tables, not on values)."""
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.engine.request import Status
    from dsv4.engine.scheduler import ScheduledChunk
    from dsv4.model.weights import load_model
    from dsv4.sampling_params import SamplingParams
    model = load_model(spec, device, torch.bfloat16)
    out = {}
    for batch in batches:
        eng = LLMEngine(spec, EngineConfig(device=device, dtype="bfloat16", max_num_seqs=batch,
                                           max_num_batched_tokens=max(256, batch * max(qs)), spec_slots=max(qs),
                                           num_pages=batch * (ctx // 256 + 2) + 8, max_model_len=ctx + 64), model=model)
        gen = torch.Generator().manual_seed(0)
        reqs = []
        for i in range(batch):
            ids = torch.randint(100, model.cfg.vocab_size, (ctx,), generator=gen).tolist()
            req = eng.add_request(f"v{i}", ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
            eng.scheduler.waiting.remove(req)
            req.num_computed, req.status = ctx - 1, Status.RUNNING
            req.spec_token_ids = ids[:max(qs) - 1]          # stand-in drafts
            assert eng.cache.reserve(req, max(qs)), "cache too small"
            reqs.append(req)
        row = out[f"b{batch}"] = {}
        for q in qs:
            chunks = [ScheduledChunk(r, q, num_logits=q) for r in reqs]
            for _ in range(3):                                  # capture, warm up
                eng.runner.execute(chunks)
            _sync(device)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                eng.runner.execute(chunks)
                _sync(device)
                times.append(time.perf_counter() - t)
            row[f"q{q}_ms"] = statistics.median(times) * 1e3
        for q in qs:
            row[f"q{q}_vs_q1"] = row[f"q{q}_ms"] / row["q1_ms"]
        log(f"verify cost b{batch}: {row}")
        del eng
    return out


def table(result: dict) -> str:
    lines = []
    for key in ("fp32_identity", "fp32_identity_dspark"):
        if key in result:
            r = result[key]
            lines.append(f"== demo fp32, greedy plain vs {r['method']} k={r['k']}: {r['identical']}/{r['sequences']} "
                         f"identical {r['parted']}, graph drafts {r['graph_drafts']}/{r['draft_steps']}")
    lines.append("== demo model, greedy: decode tokens/s and acceptance")
    for name, row in result.get("demo", {}).items():
        acc = (f"  accept len {row['spec_mean_acceptance_length']:.2f}  per pos {row['spec_acceptance_rate_per_pos']}"
               f"  drafted {row['spec_draft_tokens']} accepted {row['spec_accepted_tokens']}"
               if "spec_mean_acceptance_length" in row else "")
        batch_key = next(k for k in row if k.endswith("_decode_tokens_per_s") and not k.startswith("b1_"))
        b1 = (f"b1 {row['b1_decode_tokens_per_s']:8.1f} tok/s ({row['b1_speedup']:.2f}x)  "
              if "b1_speedup" in row else "")
        batch = batch_key.split('_')[0]
        graphs = (f"  graph drafts {row['graph_drafts']}/{row['draft_steps']} ({row['draft_graph_shapes']} shapes)"
                  if "draft_steps" in row else "")
        at_batch = (f"  [{batch}: accept len {row[f'{batch}_spec_mean_acceptance_length']:.2f}, graph drafts "
                    f"{row[f'{batch}_graph_drafts']}/{row[f'{batch}_draft_steps']}]"
                    if f"{batch}_draft_steps" in row else "")
        lines.append(f"{name:<11} {b1}{batch} {row[batch_key]:8.1f} tok/s  "
                     f"equal {row['sequences_equal_plain']} ({batch}: {row[f'{batch}_sequences_equal_plain']})"
                     + acc + graphs + at_batch)
    lines.append("== slice: verify step of q tokens per request vs decode (q = 1), ms and ratio")
    for name, row in result.get("verify", {}).items():
        qs = sorted(int(k[1:-3]) for k in row if k.endswith("_ms"))
        lines.append(f"{name:<5} " + "  ".join(f"q{q} {row[f'q{q}_ms']:.3f} ms ({row[f'q{q}_vs_q1']:.2f}x)"
                                               for q in qs))
    if "dspark" in result:
        lines.append("== DSpark (random drafter weights): greedy identity and drafter cost per step (eager)")
        for name, row in result["dspark"].items():
            lines.append(f"{name:<14} plain {row['plain_ms_per_step']:.2f} ms/step  "
                         f"dspark {row['dspark_ms_per_step']:.2f} ms/step of which draft {row['draft_ms_per_step']:.2f} ms  equal "
                         f"{row['sequences_equal_plain']}  accept len {row.get('spec_mean_acceptance_length', 0):.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ks", default="1,2,3", help="numbers of speculative tokens to compare with plain decode")
    p.add_argument("--dspark-ks", default="3,4", help="numbers of DSpark drafts (demo with its drafter); '' for none")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--slice", default="random:flash-slice:6")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-slice", action="store_true")
    p.add_argument("--dspark", default="random:flash-slice-dspark::n_routed_experts=32",
                   help="the DSpark model of part 3's cost")
    p.add_argument("--skip-dspark", action="store_true")
    p.add_argument("--smoke", "--dry-run-cpu", dest="smoke", action="store_true",
                   help="tiny sizes on the CPU, part 1 through the padded graph paths: to test the suite itself")
    p.add_argument("--cpu", action="store_true", help="part 1's acceptance and identity on the CPU in fp32")
    args = p.parse_args(argv)
    device, dtype = ("cpu", "float32") if args.smoke or args.cpu else ("cuda", "bfloat16")
    if args.cpu:
        args.skip_slice = args.skip_dspark = True
    if args.smoke:
        args.max_tokens, args.prompts, args.batches, args.ctx, args.reps = 12, 2, "1,2", 300, 2
        args.slice, args.dspark = "random:tiny", "random:tiny-dspark"
    ks = [int(k) for k in args.ks.split(",")]
    methods = demo_methods(ks, [int(k) for k in args.dspark_ks.split(",") if k])     # "": no DSpark rows
    os.makedirs(args.out, exist_ok=True)
    result = {"info": {"device": torch.cuda.get_device_name() if device == "cuda" else
                       "cpu, fp32" if args.cpu else "cpu (dry run)",
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "max_tokens": args.max_tokens}}
    if not args.skip_demo:
        if not args.cpu:            # on the CPU part 1 itself runs in fp32
            n = min(args.max_tokens, 64)
            result["fp32_identity"] = fp32_identity(device, {"method": "mtp", "num_speculative_tokens": max(ks)}, n,
                                                    args.prompts, args.smoke)
            dspark = [m for m in methods.values() if m and m["method"] == "dspark"]
            if dspark:
                result["fp32_identity_dspark"] = fp32_identity(device, dspark[0], n, args.prompts, args.smoke)
        result["demo"] = demo_runs(device, dtype, methods, args.max_tokens, args.prompts, batch1=not args.cpu,
                                   padded=args.smoke)
    if not args.skip_slice:
        result["verify"] = verify_cost(device, args.slice, [int(b) for b in args.batches.split(",")],
                                       [1] + [k + 1 for k in ks], args.ctx, args.reps)
    if not args.skip_dspark:
        result["dspark"] = dspark_runs(device, args.dspark, 4, [int(b) for b in args.batches.split(",")][:2],
                                       min(args.max_tokens, 64))
    text = table(result)
    print(text)
    with open(os.path.join(args.out, "spec_suite.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "spec_suite.txt"), "w") as f:
        f.write(json.dumps(result["info"]) + "\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
