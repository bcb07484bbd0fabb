"""One GPU vs two (docs/architecture.md, "Parallelism"): `random:flash-slice:6` on one GPU, with
tensor parallelism 2 (the engine over two ranks: CUDA graphs and async scheduling on) and with
data-parallel attention + expert parallelism 2 (the engine over two DP ranks,
engine/data_parallel.py; and, for the MoE dispatch times, one engine per rank in lockstep).

    python -m benchmarks.multi_gpu            # nvidia-h200-x2, about 3 minutes
    python -m benchmarks.multi_gpu --smoke    # CPU, gloo, the tiny model, seconds

Measures decode step time at batch 1 and 64, a 16k-token prefill, greedy tokens against one GPU,
the all-reduce (8 KB eager and inside a CUDA graph, 256 MB) and the MoE dispatch of DP+EP
(all-gather + reduce-scatter vs all-to-all) at decode sizes. Exit code 1 when TP 2's greedy
tokens differ from one GPU's where the one-GPU top-2 margin is clear (bf16 sums in another order
can flip a near-tie). Every process has NVLink multicast off (dsv4/parallel/comm.py)."""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch

from dsv4.parallel.comm import set_no_multicast_env

T0 = time.perf_counter()
CLEAR_MARGIN = 0.05          # bf16 logits: a top-2 gap above this must not flip


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def settings(smoke: bool) -> dict:
    if smoke:
        return dict(model="random:tiny", device="cpu", dtype="float32", batches=[1, 4], prefill=256, steps=3,
                    prompt=40, greedy_tokens=6, sizes=[8 << 10, 1 << 20], cache_gb=0.25)
    return dict(model="random:flash-slice:6", device="cuda", dtype="bfloat16", batches=[1, 64], prefill=16384,
                steps=20, prompt=128, greedy_tokens=16, sizes=[8 << 10, 256 << 20], cache_gb=24)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


# ---- one engine (rank 0 of TP n, or one GPU) ---------------------------------------------------------
def engine_config(s: dict, **extra):
    from dsv4.config import EngineConfig
    base = dict(device=s["device"], dtype=s["dtype"], max_num_batched_tokens=s["prefill"], max_num_seqs=64,
                max_model_len=s["prefill"] + 64, cache_memory_gb=s["cache_gb"], enable_prefix_caching=False)
    return EngineConfig(**{**base, **extra})


def decode_ms(engine, s: dict, batch: int, seed: int) -> float:
    """ms per decode step of `batch` requests (after their prefill), averaged over s["steps"]."""
    from dsv4.sampling_params import SamplingParams
    vocab = engine.cfg.vocab_size
    ids = [f"d{seed}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts(batch, s["prompt"], vocab, seed)):
        engine.add_request(rid, p, SamplingParams(max_tokens=s["steps"] * 2 + 8, temperature=0.0, ignore_eos=True))
    while any(not engine.requests[r].output_token_ids for r in ids):
        engine.step()
    sync(s["device"])
    t = time.perf_counter()
    for _ in range(s["steps"]):
        engine.step()
    sync(s["device"])
    ms = (time.perf_counter() - t) * 1e3 / s["steps"]
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return ms


def prefill_ms(engine, s: dict) -> float:
    from dsv4.sampling_params import SamplingParams
    engine.add_request("prefill", prompts(1, s["prefill"], engine.cfg.vocab_size, 7)[0],
                       SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(s["device"])
    t = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync(s["device"])
    return (time.perf_counter() - t) * 1e3


def greedy(engine, s: dict, work: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens of each prompt and the top-2 logprob gap at each token."""
    from dsv4.sampling_params import SamplingParams
    for i, p in enumerate(work):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=s["greedy_tokens"], temperature=0.0,
                                                      ignore_eos=True, logprobs=2))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [done[f"g{i}"] for i in range(len(work))]
    gaps = [[_gap(entry) for entry in o.logprobs] for o in outs]
    return [o.token_ids for o in outs], gaps


def _gap(entry: dict) -> float:
    top = sorted(entry.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def run_engine(s: dict, name: str, work, **parallel) -> dict:
    """The engine with `parallel` settings (none: one GPU)."""
    from dsv4.engine.engine import LLMEngine
    log(f"engine, {name}: loading {s['model']}")
    engine = LLMEngine(s["model"], engine_config(s, **parallel))
    try:
        out = {"decode": {b: decode_ms(engine, s, b, seed=b) for b in s["batches"]}}
        out["prefill"] = prefill_ms(engine, s)
        out["tokens"], out["gaps"] = greedy(engine, s, work)
        log(f"  {name}: {out['decode']} ms/step decode, prefill {out['prefill']:.1f} ms, async "
            f"{engine.async_scheduling}, graphs {engine.runner.graphs is not None}")
        return out
    finally:
        engine.close()
        del engine
        gc.collect()
        if s["device"] == "cuda":
            torch.cuda.empty_cache()


# ---- the two-rank job: collectives and DP attention + EP ------------------------------------------
def rank_job(rank: int, s: dict, port: int, work, out_dir: str) -> None:
    from dsv4.parallel.comm import Comm
    set_no_multicast_env()
    comm = Comm.init(rank, 2, port, s["device"])
    out = {"all_reduce": {f"{n}": all_reduce_us(comm, n, graph=False) for n in s["sizes"]}}
    if comm.device.type == "cuda":
        out["all_reduce_graph"] = {f"{s['sizes'][0]}": all_reduce_us(comm, s["sizes"][0], graph=True)}
    out.update(dp_ep(comm, s, work))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    comm.close()


def all_reduce_us(comm, nbytes: int, graph: bool, iters: int = 50) -> float:
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=comm.device)
    iters = iters if nbytes < (16 << 20) else 10
    if not graph:
        for _ in range(3):
            comm.all_reduce(x)
        sync(str(comm.device))
        t = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x)
        sync(str(comm.device))
        return (time.perf_counter() - t) * 1e6 / iters
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            comm.all_reduce(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            comm.all_reduce(x)
    g.replay()
    sync("cuda")
    t = time.perf_counter()
    g.replay()
    sync("cuda")
    return (time.perf_counter() - t) * 1e6 / iters


def dp_ep(comm, s: dict, work) -> dict:
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.weights import load_model
    from dsv4.parallel.expert_parallel import apply_dp_expert_parallel, idle_step, use_dispatch
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[s["dtype"]]
    model = apply_dp_expert_parallel(load_model(s["model"], comm.device, dtype), comm, "gather")
    engine = LLMEngine(s["model"], engine_config(s, device=str(comm.device), enforce_eager=True,
                                                 async_scheduling="off"), model=model)
    out = {"dispatch_us": {}, "decode": {}}
    for dispatch in ("gather", "all_to_all"):
        use_dispatch(model, comm, dispatch)
        out["dispatch_us"][dispatch] = {b: moe_us(model, comm, b // 2 if b > 1 else 1 - comm.rank)
                                        for b in s["batches"]}
    use_dispatch(model, comm, "gather")

    def lockstep(steps: int | None = None, until_idle: bool = False) -> None:
        n = 0
        while (steps is None or n < steps) and (not until_idle or any(comm.all_gather_ints(engine.has_unfinished()))):
            engine.step() if engine.has_unfinished() else idle_step(model)
            n += 1

    from dsv4.sampling_params import SamplingParams
    for b in s["batches"]:            # rank r runs its half of the batch (batch 1: rank 1 idles)
        mine = (b + 1 - comm.rank) // 2
        ids = [f"d{b}-{i}" for i in range(mine)]
        for rid, p in zip(ids, prompts(mine, s["prompt"], engine.cfg.vocab_size, b * 2 + comm.rank)):
            engine.add_request(rid, p, SamplingParams(max_tokens=s["steps"] * 2 + 8, temperature=0.0, ignore_eos=True))
        while any(comm.all_gather_ints(any(not engine.requests[r].output_token_ids for r in ids))):
            lockstep(1)
        sync(s["device"])
        t = time.perf_counter()
        lockstep(s["steps"])
        sync(s["device"])
        out["decode"][b] = (time.perf_counter() - t) * 1e3 / s["steps"]
        for rid in ids:
            engine.abort(rid)
        lockstep(until_idle=True)
    if comm.rank == 0:
        engine.add_request("prefill", prompts(1, s["prefill"], engine.cfg.vocab_size, 7)[0],
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sync(s["device"])
    t = time.perf_counter()
    lockstep(until_idle=True)
    sync(s["device"])
    out["prefill"] = (time.perf_counter() - t) * 1e3
    half = work[comm.rank::2]
    for i, p in enumerate(half):
        engine.add_request(f"g{i}", p, SamplingParams(max_tokens=s["greedy_tokens"], temperature=0.0, ignore_eos=True))
    done = {}
    while any(comm.all_gather_ints(engine.has_unfinished())):
        if engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        else:
            idle_step(model)
    out["tokens"] = [done[f"g{i}"] for i in range(len(half))]
    return out


def moe_us(model, comm, tokens: int, iters: int = 20) -> float:
    """One MoE layer of DP+EP with `tokens` on this rank (all ranks call it alike)."""
    moe = next(m for m in model.modules() if type(m).__name__ == "MoE")
    x = torch.randn(tokens, model.cfg.hidden_size, dtype=model.dtype, device=comm.device)
    ids = torch.randint(0, model.cfg.vocab_size, (tokens,), device=comm.device)
    model.dp_step.begin(tokens)
    with torch.inference_mode():
        for _ in range(3):
            moe(x, ids)
        sync(str(comm.device))
        t = time.perf_counter()
        for _ in range(iters):
            moe(x, ids)
        sync(str(comm.device))
    return (time.perf_counter() - t) * 1e6 / iters


def run_rank_job(s: dict, work) -> list[dict]:
    import torch.multiprocessing as mp
    from dsv4.parallel.comm import free_port
    log("two-rank job: all-reduce, DP attention + EP")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_job, args=(s, free_port(), work, out_dir), nprocs=2, join=True)
        return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]


# ---- the report ---------------------------------------------------------------------------------
def first_clear_difference(ours, ref, gaps) -> str | None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return None if gaps[i][j] <= CLEAR_MARGIN else f"prompt {i} token {j} (top-2 gap {gaps[i][j]:.3f})"
    return None


def agreement(ours, ref) -> str:
    same = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b))
    return f"{same}/{sum(len(b) for b in ref)}"


def report(s: dict, one: dict, tp: dict, dp_engine: dict, ranks: list[dict], num_layers: int) -> tuple[str, bool]:
    dp = {"decode": {int(b): max(r["decode"][str(b)] if str(b) in r["decode"] else r["decode"][b] for r in ranks)
                     for b in s["batches"]},
          "prefill": max(r["prefill"] for r in ranks),
          "tokens": [t for pair in zip(*[r["tokens"] for r in ranks]) for t in pair]}
    b1, bN = s["batches"]
    lines = [f"model {s['model']} ({num_layers} layers), {s['dtype']}, {s['device']}",
             f"{'':22} {'decode b' + str(b1):>12} {'decode b' + str(bN):>12} {'prefill ' + str(s['prefill']):>14}"
             f" {'greedy = 1 GPU':>15}"]
    tp_bad = first_clear_difference(tp["tokens"], one["tokens"], one["gaps"])
    rows = (("1 GPU", one, "-"), ("TP 2", tp, agreement(tp["tokens"], one["tokens"])),
            ("DP+EP 2", dp_engine, agreement(dp_engine["tokens"], one["tokens"])),
            ("DP+EP lockstep", dp, agreement(dp["tokens"], one["tokens"])))
    for name, r, agree in rows:
        lines.append(f"{name:22} {r['decode'][b1]:10.2f}ms {r['decode'][bN]:10.2f}ms {r['prefill']:12.1f}ms {agree:>15}")
    for name, r, _ in rows[1:]:
        lines.append(f"{name + ' / 1 GPU':22} {r['decode'][b1] / one['decode'][b1]:11.2f}x "
                     f"{r['decode'][bN] / one['decode'][bN]:11.2f}x {r['prefill'] / one['prefill']:13.2f}x")
    ar = ranks[0]["all_reduce"]
    small, big = str(s["sizes"][0]), str(s["sizes"][1])
    graph = ranks[0].get("all_reduce_graph", {}).get(small)
    lines.append(f"all-reduce bf16 {int(small) >> 10} KB: {ar[small]:.1f} us eager"
                 + (f", {graph:.1f} us in a CUDA graph" if graph is not None else " (no CUDA graph on the CPU)"))
    bus = 2 * (2 - 1) / 2 * int(big) / (ar[big] * 1e-6) / 1e9
    lines.append(f"all-reduce bf16 {int(big) >> 20} MB: {ar[big] / 1e3:.2f} ms, {bus:.0f} GB/s bus bandwidth")
    per_token = graph if graph is not None else ar[small]
    lines.append(f"TP 2 collectives per batch-1 decode token: (2 x {num_layers} layers + 2) x {per_token:.1f} us = "
                 f"{(2 * num_layers + 2) * per_token / 1e3:.3f} ms; at 43 layers {(88 * per_token) / 1e3:.3f} ms "
                 f"(target <= 0.5 ms)")
    for d, per in ranks[0]["dispatch_us"].items():
        lines.append(f"DP+EP MoE layer, {d:10} dispatch: " + ", ".join(
            f"batch {b}: {max(r['dispatch_us'][d][str(b)] for r in ranks):.0f} us" for b in s["batches"]))
    lines.append("TP 2 greedy tokens: " + ("equal to 1 GPU where the margin is clear" if tp_bad is None
                                             else f"DIFFER at {tp_bad}"))
    return "\n".join(lines), tp_bad is None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, the tiny model, a few steps")
    args = p.parse_args(argv)
    set_no_multicast_env()
    s = settings(args.smoke)
    if s["device"] == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("benchmarks.multi_gpu needs two GPUs (nvidia-h200-x2); --smoke runs on the CPU")
    from dsv4.model.weights import model_config
    cfg = model_config(s["model"])
    work = prompts(4, s["prompt"], cfg.vocab_size, seed=99)
    one = run_engine(s, "1 GPU", work)
    tp = run_engine(s, "TP 2", work, tensor_parallel_size=2)
    dp_engine = run_engine(s, "DP+EP 2", work, data_parallel_size=2, enable_expert_parallel=True)
    ranks = run_rank_job(s, work)
    text, ok = report(s, one, tp, dp_engine, ranks, cfg.num_hidden_layers)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
