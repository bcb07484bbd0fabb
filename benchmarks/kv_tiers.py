"""Host and disk KV tiers on the GPU (docs/architecture.md, "Host and disk tiers").

One run, on `random:flash-slice:6` (random weights, no files) by default:
  * PCIe (pinned host <-> device, 256 MiB each way) and disk (write + fsync, read with the page
    cache dropped) bandwidth, measured here;
  * TTFT of a 32k-token prompt: cold (no prefix cache), cold with the tiers storing as it
    prefills, from the GPU prefix cache, from the host tier (GPU cache emptied) and from disk
    (GPU cache and host tier emptied, the files' page cache dropped); each resend generates
    the greedy tokens of the cold run (checked: exit 1 otherwise) and reports its cached tokens;
  * offload and restore bytes/s of the tiers' own copies (a burst of pages);
  * decode tokens/s of 16 running requests with and without GPU -> host offloads of the 32k
    prefix's pages in flight all the time (target: within 5%), and the host time the offloads
    take on the step's thread, with the mover's launches issued by its own thread (as served)
    and, for comparison, by the step's thread;
  * decode tokens/s of the same 16 requests while the 32k prompt is restored from disk beside
    them (files read by the disk thread into host entries, uploaded on the side stream), the
    steps that ran meanwhile, and the restored request's greedy tokens against the cold run's.

    python -m benchmarks.kv_tiers            # one H200, about 2 minutes
    python -m benchmarks.kv_tiers --smoke    # CPU, tiny sizes, seconds
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from dsv4.cache.tiers.executors import make_executor
from dsv4.cache.tiers.movers import Mover
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams

from .prefix_check import parting_margin


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pcie_bandwidth(device: str, mib: int) -> tuple[float, float]:
    """(host to device, device to host) GB/s of one pinned copy of `mib` MiB."""
    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        sync(device)
        t = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        sync(device)
        out.append(3 * n / (time.perf_counter() - t) / 1e9)
    return out[0], out[1]


def drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_bandwidth(folder: str, mib: int) -> tuple[float, float]:
    """(write + fsync, read after dropping the page cache) GB/s of one `mib` MiB file."""
    path, data = os.path.join(folder, "bandwidth.bin"), os.urandom(mib << 20)
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write = len(data) / (time.perf_counter() - t) / 1e9
    drop_page_cache(path)
    t = time.perf_counter()
    with open(path, "rb") as f:
        f.read()
    read = len(data) / (time.perf_counter() - t) / 1e9
    os.remove(path)
    return write, read


def ttft(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int):
    """(seconds to the first token, the finished output (greedy tokens with their top-2
    logprobs), cached tokens)."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                   logprobs=2))
    start, first, final, cached = time.perf_counter(), None, None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            cached = out.num_cached_tokens or cached
            if out.finished:
                final = out
    return first, final, cached


def decode_rate(engine: LLMEngine, steps: int, offload=None) -> tuple[float, float]:
    """(tokens/s of the running decodes over `steps` steps, host seconds spent in `offload()`,
    called before each step)."""
    sync(engine.config.device)
    t, n, host = time.perf_counter(), 0, 0.0
    for _ in range(steps):
        if offload is not None:
            h = time.perf_counter()
            offload()
            host += time.perf_counter() - h
        n += sum(len(o.new_token_ids) for o in engine.step())
    sync(engine.config.device)
    return n / (time.perf_counter() - t), host


def decode_beside_disk_restore(eng: LLMEngine, prompt: list[int], want, folder: str, steps: int):
    """The running decodes go on while `prompt` is restored from disk (GPU cache and host tier
    emptied, the files' page cache dropped): (their tokens/s over the steps while the restore
    was pending, those steps, seconds to the restored request's first token, parting margin of
    its greedy tokens against the cold run's or None)."""
    tiers = eng.cache.tiers
    tiers.drain()
    eng.reset_prefix_cache()
    tiers.drop_host()
    for name in os.listdir(folder):
        drop_page_cache(os.path.join(folder, name))
    eng.add_request("beside", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2))
    sync(eng.config.device)
    start, pending, n, first, final, span = time.perf_counter(), 0, 0, None, None, 0.0
    for _ in range(100 * steps):
        waiting = any(r.request_id == "beside" for r in eng.scheduler.waiting)
        outs = eng.step()
        if waiting:
            pending += 1
            n += sum(len(o.new_token_ids) for o in outs if o.request_id != "beside")
            span = time.perf_counter() - start
        for o in outs:
            if o.request_id == "beside":
                first = first or time.perf_counter() - start
                final = o if o.finished else final
        if final is not None:
            break
    sync(eng.config.device)
    margin = float("inf") if final is None else parting_margin(final, want)
    return n / span if span else 0.0, pending, first or float("nan"), margin


def burst(tiers, pages: list[int], device: str) -> tuple[float, float]:
    """(offload, restore) GB/s of the tiers' mover on `pages` (host rows overwritten: run last)."""
    hp = tiers.host.pages
    n = min(len(pages), hp.capacity)
    slots, pages = list(range(n)), pages[:n]
    tail_row = tiers.host.tails.rows[0]
    nbytes = n * tiers.page_bytes + tiers.tail_bytes
    rates = []
    for _ in range(2):                      # the first of each warms up
        sync(device)
        t = time.perf_counter()
        tiers.mover.store(pages, hp.rows, slots, tiers.storage.checkpoints[0], tail_row).wait()
        store = nbytes / (time.perf_counter() - t) / 1e9
        scratch = [tiers.storage.scratch_page] * n          # written by nothing that is read
        sync(device)
        t = time.perf_counter()
        tiers.mover.load(hp.rows, slots, scratch, tail_row).wait()
        rates = [store, nbytes / (time.perf_counter() - t) / 1e9]
    return rates[0], rates[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:flash-slice:6")
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--host-gb", type=float, default=8.0)
    p.add_argument("--disk-dir", default=None, help="default: a fresh folder under the temp dir")
    p.add_argument("--smoke", action="store_true", help="CPU, random:tiny, a 1.2k-token prompt")
    p.add_argument("--tie-margin", type=float, default=0.1,
                   help="bfloat16: largest cold top-2 logprob margin at a parting that counts as a near-tie "
                        "(float32, --smoke: any parting fails)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.prompt_len, args.host_gb = "random:tiny", 1200, 0.05
    device = "cpu" if args.smoke else "cuda"
    folder = args.disk_dir or tempfile.mkdtemp(prefix="dsv4-kv-tiers-")
    os.makedirs(folder, exist_ok=True)
    base = dict(device=device, dtype="float32" if args.smoke else "bfloat16", max_num_batched_tokens=8192,
                max_num_seqs=32, cache_memory_gb=0.5 if args.smoke else 8)
    t_all = time.perf_counter()
    eng = LLMEngine(args.model, EngineConfig(**base, host_cache_gb=args.host_gb, disk_cache_dir=folder,
                                             disk_cache_gb=4 * args.host_gb))
    plain = LLMEngine(args.model, EngineConfig(**base, enable_prefix_caching=False), model=eng.model)
    tiers = eng.cache.tiers
    if args.smoke:                          # the disk and the mover on their threads, as on a GPU
        tiers.executor = tiers.disk.executor = make_executor(True)
        tiers.mover = Mover(tiers.mover.streams, tiers.codec, make_executor(True, "dsv4-kv-mover"))
    vocab = min(eng.cfg.vocab_size, 8000)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (args.prompt_len,), generator=gen).tolist()
    mib = 16 if args.smoke else 256
    h2d, d2h = pcie_bandwidth(device, mib)
    dw, dr = disk_bandwidth(folder, mib)
    for e in (plain, eng):                  # warm-up: kernels, graphs
        ttft(e, "warm", torch.randint(100, vocab, (600,), generator=gen).tolist(), 4)
    eng.reset_prefix_cache()
    tiers.drain()
    tiers.drop_host()
    rows, failures = [], 0
    cold_s, want, _ = ttft(plain, "cold", prompt, 16)
    rows.append(("cold (no prefix cache)", cold_s, 0, None))

    def case(name, rid):
        nonlocal failures
        s, got, cached = ttft(eng, rid, prompt, 16)
        margin = parting_margin(got, want)
        failures += margin is not None and (margin > args.tie_margin or args.smoke)
        rows.append((name, s, cached, margin))
    case("cold, tiers storing", "store")
    tiers.drain()
    case("GPU prefix cache", "gpu")
    eng.reset_prefix_cache()
    case("host tier", "host")
    tiers.drain()
    eng.reset_prefix_cache()
    tiers.drop_host()
    for name in os.listdir(folder):
        drop_page_cache(os.path.join(folder, name))
    case("disk tier", "disk")

    # decode of 16 running requests, without and with offloads in flight all the time
    for i in range(16):
        eng.add_request(f"d{i}", torch.randint(100, vocab, (300,), generator=gen).tolist(),
                        SamplingParams(temperature=0.0, max_tokens=2000 if not args.smoke else 120, ignore_eos=True))
    for _ in range(5):
        eng.step()
    tiers.drain()
    path = eng.cache.prefix.path_nodes(prompt, args.prompt_len // 256)
    gpu_pages = [n.page for n in path]
    if not gpu_pages:
        print("the prompt's pages are not in the GPU prefix cache: no offload to measure")
        return 1
    n_pages = len(gpu_pages)
    prefixes = []                           # new prefixes over the same GPU pages, keys hashed beforehand
    for i in range(90 if args.smoke else 700):  # (as a request's commits hash each page once)
        tokens = [(i * 7919 + j) % (vocab - 100) + 100 for j in range(n_pages * 256)]
        tiers.keys(tokens, n_pages, owner=f"bench{i}")
        prefixes.append((f"bench{i}", tokens))
    fake = iter(prefixes)
    offloaded = tiers.stats.bytes["gpu_to_host"]

    started = {"thread": 0, "inline": 0}
    movers = {"thread": tiers.mover if isinstance(tiers.mover.executor, ThreadPoolExecutor) else None}
    movers["thread"] = movers["thread"] or Mover(tiers.mover.streams, tiers.codec, make_executor(True, "dsv4-kv-mover"))
    movers["inline"] = Mover(tiers.mover.streams, tiers.codec, make_executor(False))
    serving = tiers.mover

    def offload():                          # one store in flight all the time
        if not tiers.stores:
            started[mode] += 1
            owner, tokens = next(fake)
            tiers.offload(tokens, gpu_pages, n_pages * 256, eng.runner.storage.checkpoints[0], owner)
            tiers.forget(owner)
    disk, tiers.disk = tiers.disk, None     # GPU -> host offload only (no disk backlog to wait for)
    steps = 10 if args.smoke else 150
    rates = {"no offload": [], "thread": [], "inline": []}   # the mover's launches on its thread / the step's
    host = {"thread": 0.0, "inline": 0.0}
    for _ in range(2):
        rates["no offload"].append(decode_rate(eng, steps)[0])
        for mode in ("thread", "inline"):
            tiers.mover = movers[mode]
            rate, spent = decode_rate(eng, steps, offload)
            tiers.drain()
            rates[mode].append(rate)
            host[mode] += spent
    tiers.mover = serving
    offloaded = tiers.stats.bytes["gpu_to_host"] - offloaded
    tiers.disk = disk
    beside = decode_beside_disk_restore(eng, prompt, want, folder, steps)
    failures += beside[3] is not None and (beside[3] > args.tie_margin or args.smoke)
    for i in range(16):
        eng.abort(f"d{i}")
    tiers.drain()
    st, sr = burst(tiers, gpu_pages, device)

    print(f"model {args.model}, prompt {args.prompt_len} tokens, device {device}")
    print(f"{'case':<26}{'TTFT s':>10}{'vs cold':>9}{'cached':>9}  tokens")
    for name, s, cached, margin in rows:
        tokens = ("(reference)" if name.startswith("cold (") else "same" if margin is None else
                  f"DIFFER, cold top-2 logprob margin {margin:.4f} at the first parting "
                  f"({'a near-tie' if margin <= args.tie_margin and not args.smoke else 'NOT a tie'})")
        print(f"{name:<26}{s:>10.3f}{cold_s / s:>8.1f}x{cached:>9}  {tokens}")
    print(f"{'bandwidth GB/s':<26}{'measured':>10}{'tiers':>9}")
    print(f"{'PCIe host->device':<26}{h2d:>10.2f}{sr:>9.2f}  (restore burst, {len(gpu_pages)} pages + tail)")
    print(f"{'PCIe device->host':<26}{d2h:>10.2f}{st:>9.2f}  (offload burst)")
    print(f"{'disk write (fsync)':<26}{dw:>10.2f}")
    print(f"{'disk read (uncached)':<26}{dr:>10.2f}")
    off = max(rates["no offload"])
    for mode, where in (("thread", "the mover's thread issues the copies"), ("inline", "the step's thread does")):
        on = max(rates[mode])
        print(f"decode tok/s, 16 requests, {where}: no offload {off:.1f}, offloading {on:.1f} ({on / off:.3f}x; "
              f"target >= 0.95: {'met' if on / off >= 0.95 else 'MISSED'}); offload on the step's thread: "
              f"{1e3 * host[mode] / (2 * steps):.3f} ms per step, {1e3 * host[mode] / max(started[mode], 1):.3f} ms "
              f"per offload of {n_pages} pages + tail ({started[mode]} offloads)")
    print(f"offloaded {offloaded / 2**20:.1f} MiB while decoding")
    rate, pending, restore_s, margin = beside
    print(f"decode tok/s, 16 requests, while the prompt is restored from disk: {rate:.1f} "
          f"({rate / off:.3f}x of no offload; {pending} steps ran during the restore of {restore_s:.3f} s); "
          f"its tokens: {'same' if margin is None else f'DIFFER, cold top-2 margin {margin:.4f}'}")
    print(f"tier stats: {tiers.stats.hit_tokens}, bytes {tiers.stats.bytes}")
    print(f"{failures} mismatch(es); {time.perf_counter() - t_all:.1f} s in all")
    tiers.close()
    if not args.disk_dir:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
