"""The whole serving path at high concurrency with the model's forward stubbed, on any device
(docs/architecture.md, "Serving"): `dsv4 serve`'s two processes (the API process and the engine
core, whose forward and head return constants: what is left is host work) driven by
`dsv4 bench serve`, each process's CPU seconds per output token measured apart, and each
one's functions by own time (sampled, `--profile`: benchmarks/cpu_sampler.py).

    python -m benchmarks.serve_path --smoke                    # CPU, seconds
    python -m benchmarks.serve_path --device cpu --dtype float32 --concurrency 64 256
    python -m benchmarks.serve_path --profile --concurrency 256   # + the top functions per process
    python -m benchmarks.serve_path --device cuda --dtype bfloat16 --input-len 512 --concurrency 256 \
        --profile --real-model                                    # the real forward: where a GPU run's CPU goes
    python -m benchmarks.serve_path --smoke --serve-args=--api-server-count=2   # N API processes
    python -m benchmarks.serve_path --smoke --serve-args=--api-server-count=1 --serve-args=--api-server-count=2

`--serve-args` are `dsv4 serve` flags, one server each (given several times: one server after
the other); the API process count (`--api-server-count`, by default `dsv4 serve`'s) is the one
applied (the engine's flags are this benchmark's own). CPU is reported for every API process
(api0, api1, ...) and their sum (api); `--profile` samples API process 0.

The client runs in this process; the server
in a child (its engine core a grandchild); CPU seconds come from /proc (Linux).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from .cpu_sampler import Sampler
from .server_proc import server_pids, wait_ready, with_api_total

PROFILE_ENV = "DSV4_SERVE_PATH_PROFILE"      # a path prefix: each process writes <prefix>.<role>.prof
STUB_SHIFTS = 64                              # the stub's logits rows shift by one a step, cyclically


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=None, help="per concurrency (default 2x it)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=1, help="runs per concurrency; the least CPU of them is reported")
    p.add_argument("--profile", action="store_true", help="sample each process's CPU by function; print the top ones")
    p.add_argument("--top", type=int, default=18, help="functions shown per process with --profile")
    p.add_argument("--by", choices=("own", "total"), default="own", help="order the functions by own or total time")
    p.add_argument("--real-model", action="store_true",
                   help="the demo model's own forward (CUDA graphs on a GPU), as `dsv4 serve` runs it: the engine "
                        "core's CPU then includes its kernel launches and GPU waits")
    p.add_argument("--serve-args", action="append", default=None,
                   help="`dsv4 serve` flags, one string; --api-server-count applies; again: one more server")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.dtype, args.input_len, args.output_len, args.concurrency = "cpu", "float32", 16, 8, [4]
    args.api_server_counts = [api_server_count_of(x) for x in args.serve_args or [""]]
    return args


def api_server_count_of(serve_args: str) -> int:
    """The API process count `dsv4 serve` would run with `serve_args`; SystemExit
    for a flag this benchmark does not apply (its engine flags are its own)."""
    from dsv4.cli import build_parser
    from dsv4.cli.serve import api_server_count
    parser = build_parser()
    given, defaults = (vars(parser.parse_args(["serve", *shlex.split(x)])) for x in (serve_args, ""))
    others = sorted(k for k in given if given[k] != defaults[k] and k != "api_server_count")
    if others:
        raise SystemExit(f"serve_path: --serve-args: only --api-server-count applies here, not {others}")
    return api_server_count(argparse.Namespace(**given), disaggregated=False)


# ---- the server's side ---------------------------------------------------------------------
def stub_forward(engine) -> None:
    """The model's forward and head replaced by constant tensors (what is left is host work);
    the logits row of batch slot i at step k has its maximum at a plain token that depends on
    i + k, so the detokeniser and the SSE chunks see varied text."""
    import torch
    m, cfg, config = engine.model, engine.model.cfg, engine.config
    device, vocab = config.device, cfg.vocab_size
    rows = max(config.max_num_batched_tokens or 0, 2 * config.max_num_seqs) + STUB_SHIFTS
    best = 100 + (torch.arange(rows, device=device)[:, None] * 7919) % (vocab - 100)
    table = torch.zeros(rows, vocab, device=device).scatter_(1, best, 1.0)
    step = [0]

    def logits(hidden):
        step[0] = (step[0] + 1) % STUB_SHIFTS
        return table[step[0]:step[0] + hidden.shape[0]]
    m.forward = lambda fb, layers, *rest: torch.zeros(fb.num_tokens, cfg.hc_mult, cfg.hidden_size, device=device)
    m.logits = logits
    m.head_input = lambda streams: streams[:, 0]
    m.head_logits = logits


def stub_engine_core(model_dir: str, config, addresses, parent_pid: int, stub: bool = True) -> None:
    """`run_engine_core` (the engine-core process entry) with the forward stubbed (unless not
    `stub`) and its serving loop profiled when asked."""
    from dsv4.engine import core
    load, loop = core._load_engine, core.serve_loop

    def load_stubbed(model_dir, config):
        engine = load(model_dir, config)
        if stub:
            stub_forward(engine)
        return engine

    def profiled_loop(*args):
        with _profiled("engine"):
            loop(*args)
    core._load_engine, core.serve_loop = load_stubbed, profiled_loop
    core.run_engine_core(model_dir, config, addresses, parent_pid)


class _profiled:
    """Sample the enclosed block's CPU by function (cpu_sampler.py) when PROFILE_ENV is set;
    write the samples to <prefix>.<role>.json."""

    def __init__(self, role: str):
        self.path = os.environ.get(PROFILE_ENV) and f"{os.environ[PROFILE_ENV]}.{role}.json"
        self.sampler = Sampler() if self.path else None

    def __enter__(self):
        if self.sampler:
            self.sampler.start()

    def __exit__(self, *exc):
        if self.sampler:
            self.sampler.stop()
            with open(self.path, "w") as f:
                json.dump(self.sampler.state(), f)


def serve_child(args) -> int:
    """The API process: `dsv4 serve` on the demo model with the stubbed engine core (or the
    real one, `--real-model`)."""
    from functools import partial
    from dsv4.assets import demo_model_dir
    from dsv4.config import EngineConfig
    from dsv4.serve.http.server import APIServer, ServeSettings
    longest = max(args.concurrency)
    # enforce_eager: CUDA graphs captured at load would replay the real forward, not the stub
    engine = EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=longest, enable_prefix_caching=False,
                          max_model_len=args.input_len + args.output_len + 16, cache_memory_gb=4.0,
                          enforce_eager=not args.real_model)
    settings = ServeSettings(model_dir=demo_model_dir(), model_names=["demo"], engine=engine, port=0,
                             log_level="warning", api_server_count=args.api_server_counts[0])
    server = APIServer(settings, engine_target=partial(stub_engine_core, stub=not args.real_model))
    server.start_engine()

    def ready() -> None:
        pids = server.pids
        print(f"processes: api {' '.join(map(str, pids['api']))}; engine core {pids['engine'][0]}", flush=True)
        print(f"ready at {server.url}", flush=True)
    with _profiled("api"):
        return server.serve(on_ready=ready)


# ---- the client's side ---------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_once(url: str, args, concurrency: int, pids: dict[str, int]) -> dict:
    from dsv4.bench.serve import ServeBenchConfig, run_serve_benchmark
    cfg = ServeBenchConfig(base_url=url, model="demo", input_len=args.input_len, output_len=args.output_len,
                           num_prompts=args.num_prompts or 2 * concurrency, max_concurrency=concurrency,
                           vocab_size=8192, show_progress=False)
    before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    client_before = time.process_time()
    result = run_serve_benchmark(cfg)
    cpu = with_api_total({role: cpu_seconds(pid) - before[role] for role, pid in pids.items()})
    cpu["client"] = time.process_time() - client_before
    tokens = max(result["total_output_tokens"], 1)
    return {"concurrency": concurrency, "completed": result["completed"], "failed": result["failed"],
            "output_tok_s": result["output_throughput"], "median_tpot_ms": result["median_tpot_ms"],
            "duration_s": result["duration"], "output_tokens": result["total_output_tokens"],
            "cpu_s": cpu, "cpu_us_per_token": {k: v / tokens * 1e6 for k, v in cpu.items()},
            "errors": result["errors"]}


def least(runs: list[dict]) -> dict:
    """Runs of one concurrency as one: the fastest run's figures, each process's least CPU per
    token (shared cores: other jobs only ever add), every run kept under "runs"."""
    best = dict(max(runs, key=lambda r: r["output_tok_s"]))
    best["cpu_us_per_token"] = {k: min(r["cpu_us_per_token"][k] for r in runs) for k in best["cpu_us_per_token"]}
    best["failed"] = sum(r["failed"] for r in runs)
    best["runs"] = runs
    return best


def run(args, api_server_count: int) -> dict:
    """One server of `api_server_count` API processes, every concurrency; each result row
    names the count."""
    results, profiles = [], {}
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "w+") as log:
        env = dict(os.environ, **({PROFILE_ENV: os.path.join(tmp, "run")} if args.profile else {}))
        argv = [sys.executable, "-m", "benchmarks.serve_path", "--serve-child", "--device", args.device,
                "--dtype", args.dtype, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--concurrency", *map(str, args.concurrency), *(["--real-model"] if args.real_model else []),
                f"--serve-args=--api-server-count {api_server_count}"]
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = wait_ready(server, log.name, 600)
            pids = server_pids(log.name)
            sampler = Sampler().start() if args.profile else None
            for concurrency in args.concurrency:
                row = least([bench_once(url, args, concurrency, pids) for _ in range(args.repeats)])
                results.append({"api_server_count": api_server_count, **row})
            if sampler:
                sampler.stop()
        finally:
            server.terminate()
            server.wait(120)
        if args.profile:
            tokens = max(sum(x["output_tokens"] for r in results for x in r["runs"]), 1)
            for role in ("client", "api", "engine"):
                path = os.path.join(tmp, f"run.{role}.json")
                got = sampler if role == "client" else (Sampler.from_state(json.load(open(path)))
                                                         if os.path.exists(path) else None)
                cpu_role = "api0" if role == "api" else role        # (the profile is API process 0's)
                per = sum(x["cpu_s"][cpu_role] for r in results for x in r["runs"]) / tokens
                profiles[role] = got.report(args.top, per, "output token", args.by) if got else "(no profile)"
        log.seek(0)
        tail = log.read()[-2000:]
    return {"results": results, "profiles": profiles, "server_log_tail": tail}


def table(results: list[dict]) -> str:
    apis = sorted({k for r in results for k in r["cpu_us_per_token"] if k[3:].isdigit()}, key=lambda k: int(k[3:]))
    apis = apis if len(apis) > 1 else []        # (one API process: its figure is "api")
    lines = [f"{'APIs':>4} {'conc':>5} {'done':>5} {'tok/s':>9} {'TPOT ms':>8}   CPU us per output token: "
             f"{'client':>7} {'api':>7} {'engine':>7}" + "".join(f" {k:>7}" for k in apis)]
    for r in results:
        us = r["cpu_us_per_token"]
        lines.append(f"{r.get('api_server_count', 1):>4} {r['concurrency']:>5} {r['completed']:>5} "
                     f"{r['output_tok_s']:>9.0f} {r['median_tpot_ms']:>8.2f}"
                     f"   {'':>24} {us['client']:>7.1f} {us['api']:>7.1f} {us['engine']:>7.1f}"
                     + "".join(f" {us.get(k, float('nan')):>7.1f}" for k in apis))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve_child:
        return serve_child(args)
    outs = []
    for count in args.api_server_counts:
        outs.append(run(args, count))
        for role, text in outs[-1]["profiles"].items():
            name = "API process 0" if role == "api" else f"{role} process"
            print(f"==== {count} API process(es): {name}: CPU by function ====\n{text}\n")
    out = {**outs[-1], "results": [r for o in outs for r in o["results"]]}
    print(table(out["results"]))
    failed = sum(r["failed"] for r in out["results"])
    if failed:
        print(f"{failed} request(s) failed: {out['results'][-1]['errors'][:3]}\n{out['server_log_tail']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
