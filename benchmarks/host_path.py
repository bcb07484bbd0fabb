"""The host path at high concurrency, one command (docs/architecture.md, "Engine").

1. Host profile: the engine's own work per step and request, the model forward stubbed (zeros
   for the streams, logits rows with a varied maximum: serve_path.stub_forward), each step's outputs taken on through the engine core,
   the wire and the API process (benchmarks/host_sections.py), at each concurrency of
   --profile-concurrency: wall time, the breakdown by component, and the functions that take
   the most time (cProfile, own time) at the largest.
2. Server: `dsv4 serve` on the demo model (start-up time from its log), `dsv4 bench serve`
   (--input-len-token prompts, --output-len tokens, --num-prompts requests) cold at
   concurrency 1, then warm at --concurrency (with each process's CPU per output token: the
   client, the API process, the engine core); then `dsv4 bench throughput` on the same
   workload (offline LLM); greedy tokens of the server equal the offline LLM's on a few prompts.
3. A table against the targets: cold p99 TTFT at c1 <= 2x the warm median; median TPOT at
   c256 <= 6 ms; output tok/s >= 3 x 6,438; offline tok/s >= the server's.

    python -m benchmarks.host_path                 # H200, ~3 min
    python -m benchmarks.host_path --smoke         # CPU, tiny sizes, seconds
    python -m benchmarks.host_path --only-profile  # the host profile alone (c64, c256)
    python -m benchmarks.host_path --skip-profile  # the server and offline parts alone
    python -m benchmarks.host_path --only-profile --device cpu --dtype float32   # the same, no GPU
    python -m benchmarks.host_path --skip-profile --serve-args=--api-server-count=2   # N API processes
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from .server_proc import wait_ready

BASELINE_TOK_S, TPOT_TARGET_MS, HOST_TARGET_US = 6438.0, 6.0, 25.0
STARTUP = re.compile(r"engine core ready in ([0-9.]+) s")
WARMUP = re.compile(r"warm-up: .*")
LATE_COMPILE = re.compile(r"Triton compiles (\S+) after the warm-up.*")     # engine/late_compiles.py


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048, help="the server's (bounds the warm-up shapes)")
    p.add_argument("--profile-concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--profile-repeats", type=int, default=3,
                   help="timed runs of --profile-steps steps; each figure is the least of them (shared hosts)")
    p.add_argument("--only-profile", action="store_true", help="the host profile alone (no server)")
    p.add_argument("--skip-profile", action="store_true", help="the server and offline parts alone (no host profile)")
    p.add_argument("--serve-args", default="", help="extra `dsv4 serve` flags, one string (e.g. \"--max-num-batched-tokens 8192\")")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype = "cpu", "float32"
        args.input_len, args.output_len, args.num_prompts, args.concurrency = 32, 8, 8, 4
        args.max_model_len, args.profile_concurrency, args.profile_steps = 256, [8, 32], 5
    return args


# ---- 1. host profile -------------------------------------------------------------------------
def host_profile(args, concurrency: int) -> dict:
    """The engine at `concurrency` decoding requests, its forward stubbed, each step's outputs
    taken through the engine core, the wire and the API process (host_sections.ServePath):
    wall time per step, the breakdown by component, and cProfile's top functions."""
    import torch
    from dsv4.assets import demo_model_dir
    from dsv4.config import EngineConfig
    from dsv4.engine.cuda_graphs import StepGraphs
    from dsv4.engine.engine import LLMEngine
    from dsv4.sampling_params import SamplingParams
    from .host_sections import Sections, ServePath, breakdown, instrument, profile_steps
    from .serve_path import stub_forward
    cfg = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=concurrency, enable_prefix_caching=False,
                       max_num_batched_tokens=max(2048, args.input_len * 4), enforce_eager=True,
                       max_model_len=args.input_len + args.output_len + (args.profile_repeats * 3 + 1) * args.profile_steps + 16,
                       cache_memory_gb=4.0)      # (the server started after this needs the rest)
    engine = LLMEngine(demo_model_dir(), cfg)
    stub_forward(engine)
    runner = engine.runner         # the padded (graph) step of a GPU, run eagerly: its host work
    runner.graphs = StepGraphs(engine.model, runner.storage, concurrency, capture=False, h2d=runner.h2d)
    sections = Sections()
    serve = ServePath(engine, sections)
    gc.freeze()                    # as the engine-core process does once it is loaded (engine/core.py)
    rng = random.Random(0)
    vocab = engine.cfg.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len + (args.profile_repeats * 3 + 1) * args.profile_steps + 8, ignore_eos=True)
    for i in range(concurrency):
        serve.add(str(i), [rng.randrange(2, vocab) for _ in range(args.input_len)], params)
    while any(r.num_computed < args.input_len for r in engine.requests.values()):
        serve.step()
    for _ in range(3):
        serve.step()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    walls, cpus = {}, {}
    for _ in range(args.profile_repeats):
        for name, step in (("engine", engine.step), ("serve", serve.step)):
            sync()
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.profile_steps):
                step()
            sync()
            walls[name] = min(walls.get(name, 1e9), (time.perf_counter() - start) / args.profile_steps)
            cpus[name] = min(cpus.get(name, 1e9), (time.thread_time() - cpu) / args.profile_steps)
    instrument(engine, sections)
    sections.time_gc()
    least: dict[str, float] = {}
    for _ in range(args.profile_repeats):
        sections.reset()
        for _ in range(args.profile_steps):
            serve.step()
        for name, seconds in sections.seconds.items():       # (collections are rare: their mean)
            least[name] = (least.get(name, 0) + seconds / args.profile_repeats if name.startswith("gc")
                           else min(least.get(name, 1e9), seconds))
    rows, host = breakdown(least, args.profile_steps, concurrency)
    sections.restore()
    profile = profile_steps(serve.step, args.profile_steps, 25)
    assert len(engine.requests) == concurrency, "a request finished inside the measured steps"
    serve.close()
    del engine, runner, serve
    gc.unfreeze()
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"concurrency": concurrency, "ms_per_step": walls["serve"] * 1e3,
            "us_per_request_step": walls["serve"] / concurrency * 1e6,
            "cpu_us_per_request_step": cpus["serve"] / concurrency * 1e6,
            "engine_cpu_us_per_request_step": cpus["engine"] / concurrency * 1e6,
            "host_us_per_request_step": host["all"], "engine_core_us_per_request_step": host["engine_core"],
            "api_us_per_request_step": host["api"], "breakdown_us": rows, "profile": profile}


# ---- 2. server and offline -------------------------------------------------------------------
def serve_and_bench(args) -> dict:
    from dsv4.assets import demo_model_dir
    from dsv4.bench.serve import ServeBenchConfig, run_serve_benchmark
    from .serve_path import cpu_seconds
    from .server_proc import server_pids, with_api_total
    model = demo_model_dir()
    flags = ["--model", model, "--port", "0", "--device", args.device, "--dtype", args.dtype,
             "--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.max_model_len),
             "--no-enable-prefix-caching", "--log-level", "info", *args.serve_args.split()]
    out = {}
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log_file:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "serve", *flags], stdout=log_file,
                                stderr=subprocess.STDOUT)
        try:
            url = wait_ready(proc, log_file.name, 400)
            text = open(log_file.name, errors="replace").read()
            out["ready_s"] = time.perf_counter() - t0
            found = STARTUP.search(text)
            out["engine_startup_s"] = float(found.group(1)) if found else None
            found = WARMUP.search(text)
            out["warmup"] = found.group(0) if found else None

            pids = server_pids(log_file.name)       # api0, api1, ... (--api-server-count), engine

            def bench(concurrency, n):
                """The run's figures, and each process's CPU µs per output token (`cpu_us_per_token`)."""
                cfg = ServeBenchConfig(base_url=url, model=model, input_len=args.input_len, output_len=args.output_len,
                                       num_prompts=n, max_concurrency=concurrency, vocab_size=8192,
                                       show_progress=False)
                before, client = {k: cpu_seconds(pid) for k, pid in pids.items()}, time.process_time()
                result = run_serve_benchmark(cfg)
                cpu = with_api_total({k: cpu_seconds(pid) - before[k] for k, pid in pids.items()})
                cpu["client"] = time.process_time() - client
                tokens = max(result["total_output_tokens"], 1)
                return {**result, "cpu_us_per_token": {k: v / tokens * 1e6 for k, v in cpu.items()}}
            out["cold_c1"] = bench(1, 16 if not args.smoke else 2)
            out["warm_c1"] = bench(1, 16 if not args.smoke else 2)
            out["warm_c"] = bench(args.concurrency, args.num_prompts)
            out["server_texts"] = greedy_texts(url, model, args)
        finally:
            proc.terminate()
            proc.wait(60)
            text = open(log_file.name, errors="replace").read()
            out["server_log_tail"] = "".join(text.splitlines(keepends=True)[-15:])
            late = [m.group(0) for m in LATE_COMPILE.finditer(text)]
            out["late_compiles"] = {"count": len(late), "first": late[:8]}
    out["offline"] = offline(args)
    return out


def check_prompts(args) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 8192) for _ in range(n)] for n in (args.input_len, 37, 300 % args.input_len + 5)]


def greedy_texts(url: str, model: str, args) -> list[str]:
    """The server's greedy completions of the check prompts (token-id prompts)."""
    texts = []
    for prompt in check_prompts(args):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            texts.append(json.loads(resp.read())["choices"][0]["text"])
    return texts


def offline(args) -> dict:
    from dsv4.assets import demo_model_dir
    from dsv4.bench.offline import run_throughput
    from dsv4.engine.llm import LLM
    from dsv4.sampling_params import SamplingParams
    result = run_throughput(demo_model_dir(), args.device, args.dtype, args.num_prompts, args.input_len,
                            args.output_len, args.concurrency)
    gc.collect()
    if args.device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()
    llm = LLM(device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=False)
    outs = llm.generate(prompt_token_ids=check_prompts(args), use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    result["texts"] = [o.text for o in outs]
    return result


# ---- 3. the table ----------------------------------------------------------------------------
def table(profiles: list[dict], serve: dict | None, concurrency: int) -> tuple[str, bool]:
    lines = ["host work per step (model forward stubbed; us per running request per step):"]
    for p in profiles:
        lines.append(f"  c{p['concurrency']:<4} wall {p['ms_per_step']:7.2f} ms/step = {p['us_per_request_step']:6.1f} us; "
                     f"CPU {p['cpu_us_per_request_step']:6.1f} us (engine.step alone {p['engine_cpu_us_per_request_step']:6.1f}); "
                     f"host parts {p['host_us_per_request_step']:6.1f} us: engine-core process "
                     f"{p['engine_core_us_per_request_step']:6.1f} (target <= {HOST_TARGET_US:g}), API process "
                     f"{p['api_us_per_request_step']:6.1f}; by part (CPU us):")
        lines += [f"      {name:<34} {us:7.2f}" for name, us in p["breakdown_us"]]
    ok = True
    if serve is not None:
        cold, warm1, warm = serve["cold_c1"], serve["warm_c1"], serve["warm_c"]
        off = serve["offline"]["output_tokens_per_s"]
        same = serve["server_texts"] == serve["offline"]["texts"]
        rows = [("start-up (engine core, s)", serve["engine_startup_s"], None, None),
                ("cold c1 p99 TTFT / warm median (x)", cold["p99_ttft_ms"] / max(warm1["median_ttft_ms"], 1e-9), 2.0, "<="),
                (f"c{concurrency} median TPOT (ms)",
                 warm["median_tpot_ms"], TPOT_TARGET_MS, "<="),
                ("output tok/s / 6,438 (x)", warm["output_throughput"] / BASELINE_TOK_S, 3.0, ">="),
                ("offline tok/s / server tok/s (x)", off / max(warm["output_throughput"], 1e-9), 1.0, ">="),
                ("greedy tokens server == offline", float(same), 1.0, ">=")]
        lines += [serve.get("warmup") or "", f"{'metric':<38} {'value':>10} {'target':>10}  met"]
        for name, value, target, op in rows:
            met = "" if target is None else ("yes" if (value <= target if op == "<=" else value >= target) else "NO")
            ok &= met != "NO"
            lines.append(f"{name:<38} {value if value is not None else float('nan'):>10.3f} "
                         f"{'' if target is None else f'{op} {target:g}':>10}  {met}")
        late = serve.get("late_compiles") or {"count": 0, "first": []}
        lines.append(f"Triton compiles after the warm-up (while serving): {late['count']}")
        lines += [f"  {line[:400]}" for line in late["first"]]
        us = warm["cpu_us_per_token"]
        apis = sorted((k for k in us if k[3:].isdigit()), key=lambda k: int(k[3:]))
        each = f" = {' + '.join(f'{us[k]:.1f}' for k in apis)} ({len(apis)} API processes)" if len(apis) > 1 else ""
        lines.append(f"warm c{concurrency}, CPU µs per output token by process: client {us['client']:.1f}, "
                     f"API {us['api']:.1f}{each}, engine core {us['engine']:.1f} (its GPU waits included)")
        lines.append(f"cold c1: first request's TTFT {cold.get('first_ttft_ms') or float('nan'):.1f} ms, "
                     f"median {cold['median_ttft_ms']:.1f} ms, p99 {cold['p99_ttft_ms']:.1f} ms; "
                     f"warm c{concurrency}: {warm['output_throughput']:.0f} out tok/s, {warm['completed']} done; "
                     f"offline {off:.0f} out tok/s")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    args = parse_args(argv)
    profiles = [] if args.skip_profile else [host_profile(args, c) for c in args.profile_concurrency]
    if profiles:
        print(profiles[-1]["profile"])
    serve = None if args.only_profile else serve_and_bench(args)
    text, ok = table(profiles, serve, args.concurrency)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"profiles": profiles, "serve": serve}, f, indent=2, default=str)
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
