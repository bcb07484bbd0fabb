"""Prefix caching on vs off on multi-turn chats, one command (docs/architecture.md, "Cache").

For each model: `dsv4 serve` with prefix caching on, `dsv4 bench serve --dataset multiturn`
against it, the same server with `--no-enable-prefix-caching`, the same conversations again;
then one table: mean TTFT (all turns and per turn), throughputs, hit rate, and TTFT on / off
(target: <= 1/4 on 8 turns of ~2k-token turns).

Each server first runs a warm-up pass (the same workload shape, other conversations, two
turns), then `POST /reset_prefix_cache`, then the measured pass: the comparison is of caching
at steady state, not of the first requests' lazy compilation and graph capture (which the
warm-up before READY addresses; its cost is printed as "warm-up").

    python -m benchmarks.prefix_cache --out benchmarks/results/prefix_cache.json

Defaults: the H200 (cuda, bfloat16), `random:flash-slice:6` (its vocabulary cut to the demo
tokenizer's, so every sampled token is text) served with the demo tokenizer, then the demo
model; 8 conversations of 8 turns of 1600 words (about 2k demo tokens) and 128-token answers.
On the CPU: `--device cpu --dtype float32 --models demo --turns 2 --turn-words 100 ...`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from dsv4.bench.serve import ServeBenchConfig, run_serve_benchmark
from .server_proc import wait_ready

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for model in args.models:
        for caching in (True, False):
            results.append(run_one(args, model, caching))
            write(args.out, results)
    print(table(results))
    return 0 if all(r.get("completed") for r in results) else 1


def parse_args(argv):
    from dsv4.assets import demo_model_dir
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["random:flash-slice:6:vocab_size=8192", "demo"],
                   help="random:... specs (served with --tokenizer) or checkpoint folders; 'demo' = the bundled one")
    p.add_argument("--tokenizer", default=demo_model_dir(), help="tokenizer folder for random: specs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-words", type=int, default=1600, help="new user words per turn (~1.28 demo tokens each)")
    p.add_argument("--prefix-words", type=int, default=0, help="a system prompt all conversations share")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--serve-args", default="", help="more `dsv4 serve` flags, one string")
    p.add_argument("--ready-timeout", type=float, default=400.0)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "prefix_cache.json"))
    args = p.parse_args(argv)
    args.models = [demo_model_dir() if m == "demo" else m for m in args.models]
    return args


def run_one(args, model: str, caching: bool) -> dict:
    label = f"{model} prefix caching {'on' if caching else 'off'}"
    log(f"{label}: starting the server")
    flags = ["--model", model, "--port", "0", "--device", args.device, "--dtype", args.dtype,
             "--log-level", "warning", *args.serve_args.split()]
    if model.startswith("random:"):
        flags += ["--tokenizer", args.tokenizer]
    if not caching:
        flags.append("--no-enable-prefix-caching")
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as server_log:
        proc = subprocess.Popen([sys.executable, "-m", "dsv4.cli", "serve", *flags], stdout=server_log,
                                stderr=subprocess.STDOUT)
        try:
            url = wait_ready(proc, server_log.name, args.ready_timeout)
            log(f"{label}: ready at {url}; running {args.conversations} x {args.turns} turns")
            cfg = ServeBenchConfig(base_url=url, model=model, dataset="multiturn", endpoint="/v1/chat/completions",
                                   num_prompts=args.conversations, num_turns=args.turns, input_len=args.turn_words,
                                   prefix_len=args.prefix_words, output_len=args.output_len,
                                   max_concurrency=args.max_concurrency, show_progress=False)
            t0 = time.perf_counter()
            run_serve_benchmark(dataclasses.replace(cfg, seed=cfg.seed + 1, num_turns=min(2, args.turns)))
            post(url + "/reset_prefix_cache")
            log(f"{label}: warm-up pass {time.perf_counter() - t0:.1f} s")
            result = run_serve_benchmark(cfg)
        except RuntimeError as e:
            result = {"error": str(e), "server_log": tail(server_log.name)}
        finally:
            proc.terminate()
            proc.wait(60)
    log(f"{label}: done")
    return {"model": model, "prefix_caching": caching, **result}


def post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=60) as r:
        r.read()


def tail(path: str, n: int = 40) -> str:
    return "".join(open(path, errors="replace").readlines()[-n:])


def write(path: str, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")


def table(results: list[dict]) -> str:
    lines = [f"{'model':<44} {'cache':>5} {'ok':>4} {'fail':>4} {'TTFT ms':>9} {'out tok/s':>9} "
             f"{'tot tok/s':>9} {'hit rate':>8}  TTFT per turn (ms)"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['model'][-44:]:<44} {'on' if r['prefix_caching'] else 'off':>5}  ERROR {r['error']}")
            continue
        turns = " ".join(f"{t:.0f}" for t in r["mean_ttft_ms_by_turn"])
        lines.append(f"{r['model'][-44:]:<44} {'on' if r['prefix_caching'] else 'off':>5} {r['completed']:>4} "
                     f"{r['failed']:>4} {r['mean_ttft_ms']:>9.1f} {r['output_throughput']:>9.1f} "
                     f"{r['total_token_throughput']:>9.1f} {r['prefix_cache_hit_rate']:>8.3f}  {turns}")
    for on, off in zip(results[::2], results[1::2]):
        if "error" not in on and "error" not in off and off["mean_ttft_ms"]:
            ratio = on["mean_ttft_ms"] / off["mean_ttft_ms"]
            lines.append(f"{on['model'][-44:]}: mean TTFT on / off = {ratio:.3f} (target <= 0.25: "
                         f"{'met' if ratio <= 0.25 else 'NOT met'})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
