"""Prefill/decode disaggregation vs colocated engines (docs/architecture.md, "Disaggregation").

Two setups on the same two GPUs, the same workload:
  * PD: `dsv4 serve --role prefill` on GPU 0, `--role decode` on GPU 1, `dsv4 router` in front;
  * colocated: one plain `dsv4 serve` per GPU, requests alternated between them.
Workload: `--streams` requests with short prompts decoding `--decode-tokens` tokens each
(greedy, ignore_eos), while long prompts (`--prompt-tokens`) arrive every `--interval` seconds
(max_tokens 4). Reported: TPOT p50/p99 of the decode streams (gaps between their tokens), TTFT
p50/p99 of the long prompts, the state transfer's bytes and bandwidth (decode engine's
/disagg/info), against the target TPOT p99 <= 1.2 x p50 under PD. Correctness first: greedy
tokens through the router equal a colocated engine's for prompts ending at several offsets.

    python -m benchmarks.disagg            # two H200s, ~3 min
    python -m benchmarks.disagg --smoke    # CPU, tiny model, seconds
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from dsv4.assets import demo_model_dir

READY = re.compile(r"ready at (http://\S+)")


def start(args: list[str], env: dict, log) -> tuple[subprocess.Popen, str]:
    return ready(launch(args, env, log), log)


def launch(args: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsv4.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **env})


def ready(proc: subprocess.Popen, log) -> tuple[subprocess.Popen, str]:
    args = proc.args[3:]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        found = READY.search(open(log.name).read())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"{args[:2]} exited:\n{open(log.name).read()[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"{args[:2]} not ready")


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(n)]


async def stream(client, url: str, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of each token-bearing event, from the request's start."""
    t0, times = time.monotonic(), []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic() - t0)
    return times


async def workload(urls: list[str], a, model: str) -> dict:
    async with httpx.AsyncClient(timeout=None, trust_env=False,
                                 limits=httpx.Limits(max_connections=1000)) as client:
        decodes = [asyncio.create_task(stream(client, urls[i % len(urls)], model, ids(a.short_tokens, i),
                                              a.decode_tokens)) for i in range(a.streams)]
        longs = []
        for j in range(a.long_prompts):
            await asyncio.sleep(a.interval)
            longs.append(asyncio.create_task(stream(client, urls[j % len(urls)], model,
                                                    ids(a.prompt_tokens, 10_000 + j), 4)))
        dec, lng = await asyncio.gather(*decodes), await asyncio.gather(*longs)
    gaps = sorted(g for t in dec for g in (b - a_ for a_, b in zip(t[1:], t[2:])))
    ttft = sorted(t[0] for t in lng)
    return {"tpot_p50": pct(gaps, 50), "tpot_p99": pct(gaps, 99), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99)}


def gpu_to_gpu_gb_s() -> float | None:
    """cuda:0 -> cuda:1 copy bandwidth of 1 GiB (None without two GPUs)."""
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return None
    src, dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0"), torch.empty(1 << 30, dtype=torch.uint8,
                                                                                   device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    return 5 * (1 << 30) / (time.perf_counter() - t0) / 1e9


def warmup(a) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(a), "decode_tokens": 8, "long_prompts": 2, "interval": 0.0})


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))] if xs else float("nan")


def check_greedy(router: str, colocated: str, model: str, lengths: list[int]) -> None:
    with httpx.Client(timeout=600, trust_env=False) as c:
        for n in lengths:
            body = {"model": model, "prompt": ids(n, n), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            got, want = (c.post(f"{u}/v1/completions", json=body).json()["choices"][0]["text"]
                         for u in (router, colocated))
            if got != want:
                raise AssertionError(f"prompt of {n} tokens: PD {got!r} != colocated {want!r}")
    print(f"greedy outputs equal to colocated for prompt lengths {lengths}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, tiny sizes")
    p.add_argument("--model", default="random:flash-slice:6:vocab_size=8192")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--short-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--long-prompts", type=int, default=12)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--transport", choices=("tcp", "nixl"), default="tcp", help="state transport (nixl: needs nixl-cu12/13)")
    a = p.parse_args()
    engine = ["--dtype", "bfloat16", "--max-model-len", "16384", "--max-num-seqs", "96"]
    gpus = [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    if a.smoke:
        a.model, a.streams, a.decode_tokens, a.short_tokens = "random:tiny::vocab_size=8192", 3, 6, 8
        a.prompt_tokens, a.long_prompts, a.interval = 300, 2, 0.05
        engine, gpus = ["--num-pages", "40", "--max-model-len", "2048", "--device", "cpu"], [{}, {}]
    common = ["--model", a.model, "--tokenizer", demo_model_dir(), "--port", "0", "--log-level", "warning", *engine]
    link = None if a.smoke else gpu_to_gpu_gb_s()
    results, logs = {}, [tempfile.NamedTemporaryFile("w+", suffix=".log") for _ in range(5)]
    procs = []
    try:
        kv = json.dumps({"transport": a.transport})
        pre = launch(["serve", *common, "--role", "prefill", "--kv-transfer", kv], gpus[0], logs[0])   # both load at once
        dec = launch(["serve", *common, "--role", "decode", "--kv-transfer",
                      json.dumps({"timeout": 300, "transport": a.transport})], gpus[1], logs[1])
        procs += [pre, dec]
        (_, pre_url), (_, dec_url) = ready(pre, logs[0]), ready(dec, logs[1])
        rt, rt_url = start(["router", "--prefill", pre_url, "--decode", dec_url, "--port", "0",
                            "--log-level", "warning"], {}, logs[2])
        procs.append(rt)
        check_greedy(rt_url, dec_url, a.model, [5, 131, 257, 258, 387] + ([] if a.smoke else [a.prompt_tokens]))
        asyncio.run(workload([rt_url], warmup(a), a.model))          # compiles and graphs out of the figures
        results["pd"] = asyncio.run(workload([rt_url], a, a.model))
        with httpx.Client(trust_env=False) as c:
            info = c.get(f"{dec_url}/disagg/info").json()
        results["pd"]["transfer_gb_s"] = info["kv_transfer_bytes"] / max(info["kv_transfer_seconds"], 1e-9) / 1e9
        results["pd"]["transfer_mb_per_req"] = info["kv_transfer_bytes"] / max(info["kv_transfers"], 1) / 1e6
        stop(procs)
        procs = []
        launched = [launch(["serve", *common], gpu, logs[3 + i]) for i, gpu in enumerate(gpus)]
        procs += launched
        colo = [ready(c, logs[3 + i]) for i, c in enumerate(launched)]
        asyncio.run(workload([u for _, u in colo], warmup(a), a.model))
        results["colocated"] = asyncio.run(workload([u for _, u in colo], a, a.model))
    finally:
        stop(procs)
    print(f"\n{'setup':<10} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12} {'p99/p50':>8} {'TTFT p50 s':>11} {'TTFT p99 s':>11}")
    for name, r in results.items():
        print(f"{name:<10} {r['tpot_p50'] * 1e3:12.2f} {r['tpot_p99'] * 1e3:12.2f} {r['tpot_p99'] / r['tpot_p50']:8.2f} "
              f"{r['ttft_p50']:11.3f} {r['ttft_p99']:11.3f}")
    pd = results["pd"]
    print(f"transfer ({a.transport}): {pd['transfer_mb_per_req']:.1f} MB per request, {pd['transfer_gb_s']:.2f} GB/s "
          f"(packed to host memory; reservation to install, prefill compute included; compare with the GPU-to-GPU "
          f"bandwidth: {'n/a' if link is None else f'{link:.1f} GB/s'})")
    ratio = pd["tpot_p99"] / pd["tpot_p50"]
    print(f"target PD TPOT p99 <= 1.2 x p50: {ratio:.2f} -> {'MET' if ratio <= 1.2 else 'MISSED'}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
