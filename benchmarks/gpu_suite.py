"""The GPU suite (one device call): probe the GPU, oracle check in bf16 on a reduced slice,
dsv4 vs transformers on a V4-Flash-shaped slice, roofline ratios, and a profile.

    python -m benchmarks.gpu_suite --out DIR [--layers 6] [--budget-s 520]

Prints one table; writes suite.json, suite.txt and profile.txt into DIR.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch


from dsv4.bench import offline as bo
from dsv4.bench.roofline import BF16, BF16_FP8_EXPERTS, BF16_MXFP4_EXPERTS, H200, decode_step_cost, prefill_cost, roofline

PREFILLS = (1024, 4096, 16384)
DECODES = ((1, 1024), (8, 1024), (64, 1024), (1, 4096), (64, 4096), (1, 16384), (8, 16384), (64, 16384))
DECODE_TOKENS = 33          # per timed decode run: 32 steps after the first token
PREFILL_REPEATS = 3         # best of: the shared machine's run-to-run spread is a few percent
T0 = time.perf_counter()
DEV = "cuda"
ORACLE_SPEC, SLICE = "random:flash-slice:2:n_routed_experts=32", None


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def probe() -> dict:
    if DEV == "cpu":
        return {"copy_bandwidth": 1e10, "bf16_matmul_flops": 1e11}
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (time.perf_counter() - t)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 20 / (time.perf_counter() - t)
    del x, y, a
    return {"copy_bandwidth": bw, "bf16_matmul_flops": flops}


def oracle() -> dict:
    from dsv4.cli.check import DEFAULT_TOLERANCE, compare, within_tolerance
    r = compare(ORACLE_SPEC, 512, 1, 0, DEV, torch.bfloat16)
    r["ok"] = within_tolerance(r, torch.bfloat16, DEFAULT_TOLERANCE[torch.bfloat16])
    return r


# dsv4 paths compared: the torch reference ops run eagerly (the definition), and the
# fast path (Triton kernels where they exist + CUDA graphs for decode)
# (and, for decode only, the fast path without async scheduling: host work not overlapped)
MODES = {"reference": dict(ops_backend="reference", enforce_eager=True), "fast": dict(ops_backend="auto"),
         "fast_sync": dict(ops_backend="auto", async_scheduling="off")}


def engine_for(spec, model, mode, **kw):
    from dsv4.config import EngineConfig
    from dsv4.engine.engine import LLMEngine
    return LLMEngine(spec, EngineConfig(device=DEV, dtype="bfloat16", enable_prefix_caching=False, **MODES[mode],
                                        **kw), model=model)     # repeated prompts must be computed each time


PRECISIONS = {None: BF16, "fp8": BF16_FP8_EXPERTS, "mxfp4": BF16_MXFP4_EXPERTS}


def dsv4_runs(spec: str, gpu, budget: float, results: dict, greedy: bool = True, modes=tuple(MODES),
              experts: str | None = None, prefix: str = "") -> None:
    """Prefill and decode times per mode into results["<prefix>prefill N" / "<prefix>decode bB ctxC"];
    experts "fp8" / "mxfp4": the slice's experts kept quantised in that format (the bound counts
    their bytes, PRECISIONS)."""
    from dsv4.model.weights import load_model
    model = load_model(spec, DEV, torch.bfloat16, keep_fp8=experts == "fp8", keep_mxfp4=experts == "mxfp4")
    cfg, precision = model.cfg, PRECISIONS[experts]
    for mode in modes:
        for n in PREFILLS:
            if time.perf_counter() - T0 > budget or mode == "fast_sync":
                break
            eng = engine_for(spec, model, mode, max_num_seqs=1, max_num_batched_tokens=n, num_pages=n // 256 + 4)
            r = [bo.time_one(eng, 1, n, 2, False, f"p{n}-{i}")["ttft"] for i in range(PREFILL_REPEATS)]
            row = results.setdefault(f"{prefix}prefill {n}", {})
            row[f"{mode}_s"] = min(r)
            row["bound_s"] = roofline(prefill_cost(cfg, n, precision=precision), gpu.hbm_bandwidth, gpu.dense_flops).seconds
            log(f"dsv4 {prefix}{mode} prefill {n}: {min(r):.3f}s")
            del eng
        for batch, ctx in DECODES:
            if time.perf_counter() - T0 > budget:
                break
            eng = engine_for(spec, model, mode, max_num_seqs=batch, max_num_batched_tokens=max(batch, 256),
                             num_pages=batch * (ctx // 256 + 2) + 8, max_model_len=ctx + 64)
            # the warm-up covers the same positions, so every graph shape the run needs is captured
            bo.time_one(eng, batch, ctx, DECODE_TOKENS, True, "warm")
            step = sorted(bo.time_one(eng, batch, ctx, DECODE_TOKENS, True, "run")["step_times"])
            row = results.setdefault(f"{prefix}decode b{batch} ctx{ctx}", {})
            row[f"{mode}_s"] = step[len(step) // 2]
            row["bound_s"] = roofline(decode_step_cost(cfg, batch, ctx, precision), gpu.hbm_bandwidth,
                                      gpu.dense_flops).seconds
            log(f"dsv4 {prefix}{mode} decode b{batch} ctx{ctx}: {row[f'{mode}_s'] * 1e3:.2f} ms/step")
            del eng
    if greedy:
        results[f"{prefix}greedy"] = greedy_identity(spec, model, random_prompts(cfg.vocab_size))
    if experts is None:
        profile(spec, model)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def greedy_identity(spec, model, prompts: list[list[int]], new_tokens: int = 24,
                    modes: tuple[str, str] = ("reference", "fast")) -> dict:
    """Greedy tokens of the fast path vs the reference path on the same prompts. Where they
    part, the reference's top-2 logprob margin at that step says whether it was a near-tie."""
    from dsv4.sampling_params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    outs = {}
    for mode in modes:
        eng = engine_for(spec, model, mode, max_num_seqs=len(prompts), max_num_batched_tokens=4096,
                         num_pages=64, max_model_len=4096)
        for i, p in enumerate(prompts):
            eng.add_request(f"g{i}", p, params)
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        outs[mode] = [done[f"g{i}"] for i in range(len(prompts))]
    identical, parted = 0, []
    for r, f in zip(outs[modes[0]], outs[modes[1]]):
        k = next((i for i, (a, b) in enumerate(zip(r.token_ids, f.token_ids)) if a != b), None)
        if k is None:
            identical += 1
            continue
        lp = sorted(r.logprobs[k].values(), reverse=True)
        parted.append({"step": k, "ref_top2_margin": round(lp[0] - lp[1], 5)})
    result = {"modes": list(modes), "sequences_identical": identical, "sequences": len(prompts), "new_tokens": new_tokens,
              "first_divergences": parted}
    log(f"greedy identity ({'random' if spec.startswith('random:') else 'demo'}): {result}")
    return result


def random_prompts(vocab: int, lengths=(100, 700, 1500, 3000)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(100, vocab, (n,), generator=gen).tolist() for n in lengths]


def demo_identity(modes: tuple[str, str] = ("reference", "fast"), experts: str | None = None) -> dict:
    """The same check on the trained demo model (real margins, unlike random weights).
    experts "fp8" / "mxfp4": the demo written in the released format (FP8 projections, experts
    FP8 or MXFP4) to a temporary folder and loaded with those experts kept quantised; both
    paths then run the same weights."""
    import json
    import shutil
    import tempfile
    from dsv4.assets import DEMO_DIR
    from dsv4.model.random_init import save_checkpoint
    from dsv4.model.weights import load_model
    from dsv4.text.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(DEMO_DIR)
    with open(os.path.join(DEMO_DIR, "heldout.json")) as f:
        prompts = [tok.encode(p["prompt"]) for p in json.load(f)["prompts"]]
    path = DEMO_DIR
    if experts:
        path = tempfile.mkdtemp(prefix=f"demo-{experts}-")
        shutil.copytree(DEMO_DIR, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
        plain = load_model(DEMO_DIR)
        save_checkpoint(plain.cfg, plain.state_dict(), path, quant="fp8", expert_dtype="fp8" if experts == "fp8" else "fp4")
    model = load_model(path, DEV, torch.bfloat16, keep_fp8=experts == "fp8", keep_mxfp4=experts == "mxfp4")
    assert experts is None or model.layers[0].ffn.experts.w1.dtype != torch.bfloat16, "experts not kept quantised"
    return greedy_identity(path, model, prompts, new_tokens=48, modes=modes)


def kernel_scripts() -> dict:
    """The kernel checks/microbenchmarks (benchmarks/kernels/*.py) and the Triton tests, compiled."""
    import glob
    out = {}
    here = os.path.dirname(os.path.abspath(__file__))
    for script in sorted(glob.glob(os.path.join(here, "kernels", "*.py"))):
        name = os.path.basename(script)
        out[name] = _run([sys.executable, script], 180, os.environ)
        log(f"kernel script {name}: rc {out[name]['rc']}\n{out[name]['out'][-2500:]}")
    env = {**os.environ, "DSV4_TRITON_DEVICE": "cuda"}
    tests = os.path.join(os.path.dirname(here), "tests", "ops_triton")
    out["pytest ops_triton (cuda)"] = r = _run([sys.executable, "-m", "pytest", "-q", tests], 150, env)
    log(f"triton tests on cuda: rc {r['rc']}\n{r['out'][-1500:]}")
    return out


def _run(cmd, timeout, env) -> dict:
    import subprocess
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return {"rc": r.returncode, "out": (r.stdout + r.stderr)[-4000:]}
    except subprocess.TimeoutExpired as e:
        return {"rc": "timeout", "out": str(e.stdout or "")[-4000:]}


def profile(spec, model) -> None:
    from torch.profiler import ProfilerActivity, profile as prof
    lines = []
    for name, batch, ctx, synthetic in (("decode b1 ctx4096", 1, 4096, True), ("decode b8 ctx1024", 8, 1024, True),
                                        ("prefill 4096", 1, 4096, False)):
        eng = engine_for(spec, model, "fast", max_num_seqs=batch, max_num_batched_tokens=max(4096, batch),
                         num_pages=batch * 20 + 8, max_model_len=ctx + 64)
        bo.time_one(eng, batch, ctx, 2, synthetic, "prof-warm")   # graphs captured before profiling
        bo._add_batch(eng, batch, ctx, 2, synthetic, "prof")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
        with prof(activities=acts) as p:
            eng.step()
            bo._sync(DEV)
        while eng.has_unfinished():
            eng.step()
        lines.append(f"== {name}\n" + p.key_averages().table(sort_by="cuda_time_total" if DEV == "cuda" else "cpu_time_total", row_limit=18))
        del eng
    lines.append(host_syncs(spec, model))
    with open(os.path.join(ARGS.out, "profile.txt"), "w") as f:
        f.write("\n".join(lines))
    log("profile written")


def host_syncs(spec, model, steps: int = 6) -> str:
    """Synchronising calls torch reports (sync debug mode) in steady batch-1 decode steps
    of the fast path: with async scheduling only the deliberate event waits should remain."""
    import warnings
    eng = engine_for(spec, model, "fast", max_num_seqs=1, max_num_batched_tokens=256, num_pages=24,
                     max_model_len=4096 + 64)
    bo.time_one(eng, 1, 4096, 3, True, "sync-warm")
    bo._add_batch(eng, 1, 4096, steps + 4, True, "sync")
    eng.step(), eng.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode(1)
        for _ in range(steps):
            eng.step()
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    while eng.has_unfinished():
        eng.step()
    syncs = [w for w in caught if "prototype feature" not in str(w.message)]   # (torch's own notice)
    msgs = sorted({str(w.message).splitlines()[0][:120] for w in syncs})
    log(f"host syncs in {steps} decode steps: {len(syncs)} {msgs[:4]}")
    return f"== host syncs in {steps} steady decode steps (b1, ctx 4096): {len(syncs)}\n" + "\n".join(msgs)


def hf_runs(spec: str, budget: float, results: dict) -> None:
    from benchmarks import hf_baseline as hb
    from dsv4.model.weights import load_model
    model = load_model(spec, DEV, torch.bfloat16)
    vocab = model.cfg.vocab_size
    hf = hb.to_transformers(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    for n in PREFILLS:
        key = f"prefill {n}"
        if time.perf_counter() - T0 > budget:
            results.setdefault(key, {})["hf"] = "skipped (suite time)"
            continue
        results.setdefault(key, {})["hf_s"] = _guard(lambda: min(hb.time_prefill(hf, 1, n, vocab)[0] for _ in range(2)))
        log(f"hf prefill {n}: {results[key]['hf_s']}")
    for batch, ctx in DECODES:
        key = f"decode b{batch} ctx{ctx}"
        if time.perf_counter() - T0 > budget:
            results.setdefault(key, {})["hf_s"] = "skipped (suite time)"
            continue
        results.setdefault(key, {})["hf_s"] = _guard(lambda: hb.time_decode(hf, batch, ctx, vocab))
        log(f"hf decode b{batch} ctx{ctx}: {results[key]['hf_s']}")


def _guard(fn):
    try:
        return fn()
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return "OOM"


def table(results: dict) -> str:
    head = (f"{'case':<22}{'reference':>12}{'fast sync':>11}{'fast':>11}{'transformers':>14}{'fast/hf':>9}"
            f"{'bound':>11}{'bound/fast':>12}")
    rows = [head, "-" * len(head)]
    for key, r in results.items():
        if key.endswith("greedy"):
            continue
        ref, fast, h, b = r.get("reference_s"), r.get("fast_s"), r.get("hf_s"), r.get("bound_s")
        sync = r.get("fast_sync_s")
        fmt = (lambda s: f"{s * 1e3:.2f} ms" if isinstance(s, float) else str(s or "-"))
        speed = f"{h / fast:.1f}x" if isinstance(h, float) and fast else "-"
        eff = f"{b / fast:.3f}" if b and fast else "-"
        rows.append(f"{key:<22}{fmt(ref):>12}{fmt(sync):>11}{fmt(fast):>11}{fmt(h):>14}{speed:>9}{fmt(b):>11}"
                    f"{eff:>12}")
    return "\n".join(rows)


def quick() -> int:
    """--quick: greedy identity on the demo model, decode of the fast path with and without
    async scheduling, host syncs and the profile; no oracle, kernels, prefill or baseline."""
    os.makedirs(ARGS.out, exist_ok=True)
    info = {"probe": probe(), "greedy_demo": demo_identity(),
            "greedy_demo_async_vs_sync": demo_identity(("fast_sync", "fast"))}
    gpu = H200.measured(bandwidth=info["probe"]["copy_bandwidth"], flops=info["probe"]["bf16_matmul_flops"])
    global MODES
    MODES = {k: MODES[k] for k in ("fast_sync", "fast")}
    results: dict = {}
    dsv4_runs(SLICE or f"random:flash-slice:{ARGS.layers}", gpu, ARGS.budget_s, results, greedy=False)
    text = table(results)
    print(text)
    with open(os.path.join(ARGS.out, "suite.json"), "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    return 0


def quantised_compare() -> int:
    """--quantised: the fast path on the slice with bf16 experts, then with its experts kept
    quantised (--keep-fp8, --keep-mxfp4: the same draws, quantised), in one run; greedy identity
    of the reference path vs the fast path on each quantised model; the batch-64 / batch-1
    ratio of each."""
    global PREFILLS, DECODES
    PREFILLS, DECODES = (16384,), ((1, 1024), (1, 4096), (64, 4096), (1, 16384))
    os.makedirs(ARGS.out, exist_ok=True)
    info = probe()
    gpu = H200.measured(bandwidth=info["copy_bandwidth"], flops=info["bf16_matmul_flops"])
    results: dict = {}
    spec = SLICE or f"random:flash-slice:{ARGS.layers}"
    for experts in (None, "fp8", "mxfp4"):
        dsv4_runs(spec, gpu, ARGS.budget_s, results, greedy=experts is not None, modes=("fast",), experts=experts,
                  prefix=f"{experts or 'bf16'} ")
    for experts in ("fp8", "mxfp4"):
        info[f"greedy_demo_{experts}"] = demo_identity(experts=experts)
    for prefix in ("bf16 ", "fp8 ", "mxfp4 "):
        b1, b64 = (results.get(f"{prefix}decode b{b} ctx4096", {}).get("fast_s") for b in (1, 64))
        if b1 and b64:
            info[f"{prefix}b64/b1 tokens/s at 4k"] = round(64 * b1 / b64, 2)
    text = table(results) + "\n" + json.dumps({k: v for k, v in info.items() if "b64" in k})
    print(text)
    log(f"greedy identity: fp8 {results.get('fp8 greedy')}, mxfp4 {results.get('mxfp4 greedy')}")
    with open(os.path.join(ARGS.out, "quantised.json"), "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    return 0


def main() -> int:
    os.makedirs(ARGS.out, exist_ok=True)
    info = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    info.update(probe())
    log(f"probe: {info}")
    gpu = H200.measured(bandwidth=info["copy_bandwidth"], flops=info["bf16_matmul_flops"])
    info["oracle"] = oracle()
    log(f"oracle: {info['oracle']}")
    gc.collect()
    torch.cuda.empty_cache()
    if DEV == "cuda" and not ARGS.skip_kernels:
        info["kernels"] = kernel_scripts()
    global T0
    T0 = time.perf_counter()          # the model budget starts after the kernel checks
    log("model runs start")
    results: dict = {}
    spec = SLICE or f"random:flash-slice:{ARGS.layers}"
    info["greedy_demo"] = demo_identity()
    dsv4_runs(spec, gpu, ARGS.budget_s * 0.55, results)
    hf_runs(spec, ARGS.budget_s, results)
    text = table(results)
    print(text)
    with open(os.path.join(ARGS.out, "suite.json"), "w") as f:
        json.dump({"info": info, "results": results}, f, indent=1)
    with open(os.path.join(ARGS.out, "suite.txt"), "w") as f:
        f.write(json.dumps(info) + "\n" + text + "\n")
    return 0 if info["oracle"]["ok"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--budget-s", type=float, default=500)
    p.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on the CPU, to test the suite itself")
    p.add_argument("--quick", action="store_true", help="decode and greedy identity of the fast path only")
    p.add_argument("--quantised", action="store_true", help="bf16 vs FP8 and MXFP4 experts kept quantised "
                   "(--keep-fp8, --keep-mxfp4), fast path only, + greedy identity on each")
    p.add_argument("--skip-kernels", action="store_true", help="no kernel scripts / compiled kernel tests "
                   "(run them in a call of their own: benchmarks/kernels/*.py)")
    ARGS = p.parse_args()
    if ARGS.dry_run_cpu:
        DEV, PREFILLS, DECODES = "cpu", (256, 512), ((1, 300), (4, 600))
        ORACLE_SPEC, SLICE = "random:tiny:2:n_routed_experts=4", "random:tiny"
    sys.exit(quick() if ARGS.quick else quantised_compare() if ARGS.quantised else main())
