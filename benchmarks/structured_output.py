"""Structured outputs on the GPU, one command: decode tokens/s of the demo model at batch 64 with
every request under a JSON-schema constraint against the same batch with none (target >= 0.9x;
docs/architecture.md, "Structured outputs"). CUDA graphs and async scheduling on: each step's
masks are filled on the host (fill threads for a large batch) while the GPU runs the forward
and the main thread appends the previous step's tokens and schedules the next step (the step is
sampled after that schedule), and applied in the sampler.

    python -m benchmarks.structured_output [--batch 64] [--tokens 256] [--repeats 3] [--fill-threads 1,4] [--no-process]
    python -m benchmarks.structured_output --smoke        # tiny, on the CPU, in seconds
    python -m benchmarks.structured_output --host [--batch 64] [--tokens 64]   # forward stubbed

Each repeat runs every variant once, in an order that rotates from repeat to repeat. The target's
line is the median over the repeats of the ratio of that repeat's two runs (no constraint / the
default path): the host's speed drifts within a call, and pairs taken close together cancel
most of the drift (best-of-N against best-of-N is printed too). --default-only runs just those
two variants. A second table splits the main thread's time per step into `LLMEngine.step`'s
phases for every run.

In turn: no constraint; JSON with the masks filled on the
fill threads, once per count in --fill-threads (structured/masks.py: persistent threads, a slice
of the rows each); JSON with them filled inline on the main thread; JSON with the matchers in the
grammar worker process (structured/remote.py; once per --worker-fill-threads count, 0: the worker's fill inline;
--no-process leaves it out; --worker-thread adds the same worker's loop on a thread of the
engine's process). Each constrained row
reports the main thread's ms per step in `LLMEngine._advance_grammars` (`advance`: the rows'
(grammar, token) pairs, then the start of the next mask: for the threads, `MaskFiller.start`
(`start`: the gates taking the previous step's tokens, then the hand-off to the threads, whose
matchers accept those tokens before the hand-off ends, or the whole inline accept and fill) and
`PendingMask.result` (`result`: waiting for the threads); for the process, the post
(`post`: `WorkerGrammars.step_masks`) and `PendingRemote.result` (`wait`: the reply)), and in
the mask's upload, and how many of the slices handed to the threads no thread had begun by
`result()` (filled there: a hand-off that failed).

`--host` replaces the model's forward by constant logits (benchmarks/host_path.py) and reports
the same over the host's work alone: the bound on the ratio of a host-bound step. On the CPU the
masked fill itself is host work too (on a GPU it is three kernels), and the forward is
synchronous, so the full CPU run shows the masks against a slow forward and little overlap.

The schema forces a long JSON string (minLength), so every request decodes exactly --tokens
tokens either way. Checks: every constrained output is accepted token by token by a fresh
matcher of the same grammar; unconstrained greedy requests batched with constrained ones give
the tokens of a run without them (invariant 5)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from dsv4.assets import demo_model_dir
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.sampling_params import SamplingParams, StructuredOutputs
from dsv4.structured.masks import FILL_THREADS, THREAD_MIN_ROWS

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


class MaskTimer:
    """Main-thread time per step in the masks: `start` (the gates taking the previous step's
    tokens, then the hand-off to the fill threads, which accept and fill, or the whole accept and
    fill for a small batch), of it `gates` (the gates, and the matchers' accept when a stop token
    is among the tokens) and `hand-off` (waiting for the threads to begin), `result` (waiting for
    the threads), `upload` (the mask to the device) and of it `pack` (its bytes into the pinned
    buffer, with the wait for that buffer's last copy), and `apply` (the sampler's launches of
    the masked fill); `cpu`: the main thread's CPU time in the outermost of these calls but `apply` (the
    work itself, without the waits for a core or the GIL: on a busy host the wall times are
    mostly those). Only calls on the main thread count (not a worker thread's fills).
    """

    def __init__(self):
        from dsv4.engine import sampler
        from dsv4.engine.sampling_inputs import SamplingInputs
        from dsv4.engine.upload import HostToDevice
        from dsv4.structured import fill_threads, masks, remote
        self.seconds = {"advance": 0.0, "start": 0.0, "gates": 0.0, "hand-off": 0.0, "result": 0.0, "post": 0.0,
                        "wait": 0.0, "upload": 0.0, "pack": 0.0, "apply": 0.0, "cpu": 0.0}
        self.cpu: dict[str, float] = {}     # the outermost calls' CPU time by call
        self.steps = 0
        timed = {"advance": (LLMEngine, "_advance_grammars"),
                 "start": (masks.MaskFiller, "start"), "gates": (masks, "owed_tokens"),
                 "hand-off": (fill_threads.FillThreads, "submit"), "result": (masks.PendingMask, "result"),
                 "post": (remote.WorkerGrammars, "step_masks"), "wait": (remote.PendingRemote, "result"),
                 "upload": (SamplingInputs, "_upload_mask"), "pack": (HostToDevice, "_pack"),
                 "apply": (sampler, "apply_grammar_mask")}
        self._inside: set[str] = set()     # the timed calls running now ("pack" counts inside "upload" only)
        self._saved = [(owner, attr, getattr(owner, attr)) for owner, attr in timed.values()]
        for key, (owner, attr, fn) in zip(timed, self._saved):
            setattr(owner, attr, self._timed(key, fn, within="upload" if key == "pack" else None))
        # every run: `LLMEngine.step`'s phases (`launch` holds `execute`, the forward's launch, which
        # holds a deferred `sample`; `complete` holds `readback`, the wait for the sampled tokens)
        from dsv4.engine.inflight import HostCopy
        from dsv4.engine.runner import ModelRunner
        from dsv4.engine.scheduler import Scheduler
        phases = {"step": (LLMEngine, "step"), "schedule": (Scheduler, "schedule"), "launch": (LLMEngine, "_launch"),
                  "execute": (ModelRunner, "execute"), "sample": (LLMEngine, "_sample"), "complete": (LLMEngine, "_complete"), "readback": (HostCopy, "get")}
        self.phases = dict.fromkeys(phases, 0.0)
        self.phase_steps = 0
        for key, (owner, attr) in phases.items():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._phase(key, fn))

    def _phase(self, name, fn):
        main = threading.main_thread()

        def timed(*a, **kw):
            if threading.current_thread() is not main:
                return fn(*a, **kw)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.phases[name] += time.perf_counter() - start
                self.phase_steps += name == "step"
        return timed

    def _timed(self, name, fn, within: str | None = None):
        main = threading.main_thread()

        def timed(*a, **kw):
            if (within is not None and within not in self._inside) or threading.current_thread() is not main:
                return fn(*a, **kw)
            outermost = not self._inside
            start, cpu = time.perf_counter(), time.thread_time()
            self._inside.add(name)
            try:
                return fn(*a, **kw)
            finally:
                self._inside.discard(name)
                self.seconds[name] += time.perf_counter() - start
                if outermost and name != "apply":
                    self.seconds["cpu"] += time.thread_time() - cpu
                    self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - cpu
                self.steps += name in ("result", "wait")
        return timed

    def phases_ms(self) -> str:
        """The main thread's wall ms per step in each phase of `LLMEngine.step` (every run)."""
        n = max(self.phase_steps, 1)
        return ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in self.phases.items())

    def per_step_ms(self) -> str:
        """The parts timed in this run (a part of the other path's reads 0 and is left out)."""
        n = max(self.steps, 1)
        return (", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in self.seconds.items() if v)
                + " (" + ", ".join(f"{k} {v / n * 1e3:.3f}" for k, v in self.cpu.items()) + ")")

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.phases, self.phase_steps = dict.fromkeys(self.phases, 0.0), 0
        self.cpu, self.steps = {}, 0

    def close(self) -> None:
        for owner, attr, fn in self._saved:
            setattr(owner, attr, fn)


def variants(args) -> list[tuple[str, int | tuple | None]]:
    """(name, path): no constraint (None), JSON on each --fill-threads count (n), JSON inline
    (0), JSON in the grammar worker process with each --worker-fill-threads count ("process", n;
    0: its fill inline, None: its default) and with the worker's loop on a thread ("thread",
    None; --worker-thread)."""
    def fills(n):
        return "" if n is None else f", {n} fill threads" if n else ", fill inline"
    if args.default_only:       # (with the worker process variants of explicit --worker-fill-threads counts)
        default = ("process", None) if args.default_process else FILL_THREADS
        return ([("no constraint", None), ("JSON, default path", default)]
                + [(f"JSON, worker process{fills(n)}", ("process", n)) for n in args.worker_fill_threads
                   if n is not None])
    return ([("no constraint", None)] + [(f"JSON, {n} fill thread{'s' * (n > 1)}", n) for n in args.fill_threads]
            + [("JSON, fill inline", 0)]
            + ([] if args.no_process else [(f"JSON, worker process{fills(n)}", ("process", n))
                                           for n in args.worker_fill_threads])
            + ([("JSON, worker thread", ("thread", None))] if args.worker_thread else []))


def default_variant(config: EngineConfig, args) -> str | None:
    """The variant an engine of `config` takes (grammar_worker auto on this machine's cores,
    masks.FILL_THREADS), or None when it was not run."""
    path = ("process", None) if config.grammar_process else FILL_THREADS
    return next((name for name, p in variants(args) if p == path), None)


class Paths:
    """Both grammar paths of one engine, swapped in between runs (each empty then): the
    in-process `Grammars` and the worker process's `WorkerGrammars`."""

    def __init__(self, engine, args):
        from dsv4.structured.registry import Grammars
        from dsv4.structured.remote import WorkerGrammars
        if engine.grammars is not None:
            engine.grammars.close()
        options, args = args, (engine.tokenizer, engine.cfg.vocab_size, engine.eos_token_id)
        self.inproc = Grammars(*args)
        self.workers = {}
        for _, path in variants(options):
            if isinstance(path, tuple):     # started, the schema compiled: not timed in the first run
                self.workers[path] = worker = WorkerGrammars(*args, engine.config.max_num_seqs, fill_threads=path[1],
                                                             in_thread=path[0] == "thread",
                                                             page_lock=engine.runner.h2d.on_cuda)   # as the engine's
                worker.add("warm", StructuredOutputs(json=json.dumps(SCHEMA)))
                assert worker.ping(), worker.error
                worker.drop("warm")

    def use(self, engine, threads: int | tuple | None) -> None:
        """The engine's grammars for `threads` (a tuple: a worker's; 0: every fill inline; None:
        the default fill threads)."""
        from dsv4.structured.masks import MaskFiller
        if threads in self.workers:
            engine.grammars = self.workers[threads]
            return
        engine.grammars = grammars = self.inproc
        grammars.masks.close()
        grammars.masks = MaskFiller(engine.cfg.vocab_size, grammars.keep, threads=threads or None)
        if threads == 0:
            grammars.masks.thread_min_rows = 1 << 30

    def close(self) -> None:
        self.inproc.close()
        for worker in self.workers.values():
            worker.close()


def measure(engine, args) -> dict:
    """Best time of each variant over args.repeats, with the main thread's ms per step in the
    masks and the share of fill slices no thread had begun by `result()`; the outputs of the
    last constrained runs."""
    best, outs, times, timer, paths = {}, {}, {}, MaskTimer(), Paths(engine, args)
    runs = variants(args)
    try:
        for r in range(args.repeats):      # the order rotates: no variant always runs after the same one
            for name, threads in runs[r % len(runs):] + runs[:r % len(runs)]:
                if threads is not None:
                    paths.use(engine, threads)
                timer.reset()
                done, dt = run(engine, workload(engine, args.batch, args.tokens, threads is not None, f"{name}-{r}-"))
                assert all(len(o.token_ids) == args.tokens for o in done.values()), "a request stopped early"
                notes = timer.per_step_ms() + (taken_back(engine) if isinstance(threads, int) and threads else "")
                times.setdefault(name, []).append(dt)
                if name not in best or dt < best[name][0]:
                    best[name] = (dt, notes, timer.phases_ms())
                if threads is not None:
                    outs[name] = done
    finally:
        timer.close()
        paths.use(engine, None)
        paths.close()
        engine.grammars = None
    return {"best": best, "outs": outs, "times": times}


def taken_back(engine) -> str:
    filler = engine.grammars.masks
    return f", slices taken back {filler.taken_back}/{filler.slices}"


def table(title: str, args, best: dict) -> None:
    total, plain = args.batch * args.tokens, best["no constraint"][0]
    print(f"\n{title}, batch {args.batch}, {args.tokens} decode tokens each (best of {args.repeats}); "
          f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable")
    w = max(len(name) for name, _ in variants(args)) + 2
    print(f"{'run':<{w}}{'seconds':>10}{'tokens/s':>12}{'ratio':>8}   main thread's ms per step in the masks")
    for name, _ in variants(args):
        dt, masks_ms, _ = best[name]
        print(f"{name:<{w}}{dt:>10.3f}{total / dt:>12.0f}{plain / dt:>8.3f}   {masks_ms if name != 'no constraint' else ''}")
    print(f"{'run':<{w}}main thread's ms per step in LLMEngine.step's phases")
    for name, _ in variants(args):
        print(f"{name:<{w}}{best[name][2]}")
    if args.batch < THREAD_MIN_ROWS:
        print(f"(batch < THREAD_MIN_ROWS = {THREAD_MIN_ROWS}: every constrained run fills inline)")


def host_only(args) -> None:
    """The ratio over the host's work: the forward stubbed, the padded step run eagerly."""
    from benchmarks.serve_path import stub_forward
    from dsv4.engine.cuda_graphs import StepGraphs
    engine = LLMEngine(demo_model_dir(), EngineConfig(device="cpu", async_scheduling="on", enforce_eager=True,
                                                      max_num_seqs=max(args.batch * 2, 8), num_pages=64))
    args.default_process = engine.config.grammar_process
    stub_forward(engine)
    stub = engine.model.forward                      # (eager prefill steps pass images and taps too)
    engine.model.forward = lambda fb, layers, *rest: stub(fb, layers)
    engine.runner.graphs = StepGraphs(engine.model, engine.runner.storage, args.batch, capture=False,
                                      h2d=engine.runner.h2d)
    run(engine, workload(engine, args.batch, 4, True, "w"))
    table("host work only (forward stubbed, CPU)", args, measure(engine, args)["best"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fill-threads", type=lambda v: [int(n) for n in v.split(",")], default=[1, FILL_THREADS],
                    help="comma-separated fill-thread counts to run (structured/masks.py FILL_THREADS)")
    ap.add_argument("--no-process", action="store_true", help="leave the grammar worker process variant out")
    ap.add_argument("--worker-fill-threads", type=lambda v: [int(n) for n in v.split(",")], default=[None],
                    help="comma-separated fill-thread counts of the grammar worker process, one run each (0: its "
                         "fill inline; default: masks.FILL_THREADS)")
    ap.add_argument("--worker-thread", action="store_true",
                    help="also the grammar worker's loop on a thread of the engine's process (its GIL shared)")
    ap.add_argument("--default-only", action="store_true",
                    help="only no constraint and the default path (grammar_worker auto): more repeats in the time")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--host", action="store_true", help="the model's forward stubbed: host work only, on the CPU")
    args = ap.parse_args()
    if any(n < 1 for n in args.fill_threads):
        ap.error("--fill-threads: counts must be 1 or more (the inline fill always runs)")
    args.fill_threads = sorted(set(args.fill_threads))
    if args.smoke:       # two slices of THREAD_MIN_ROWS rows on two threads
        args.batch, args.tokens, args.repeats, args.fill_threads = 2 * THREAD_MIN_ROWS, 8, 1, [1, 2]
        args.worker_thread, args.worker_fill_threads = True, [0, 2]
    if args.host or args.smoke:
        host_only(args)
    if args.host:
        return
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    engine = LLMEngine(demo_model_dir(), EngineConfig(device=device, async_scheduling="on",
                                                      max_num_seqs=max(args.batch * 2, 8), num_pages=512 if device == "cuda" else 64))
    args.default_process = engine.config.grammar_process
    # warm-up: CUDA graphs, xgrammar's import and compilation
    run(engine, workload(engine, args.batch, 4, True, "w"))
    run(engine, workload(engine, args.batch, 4, False, "v"))
    result = measure(engine, args)
    # correctness 1: a fresh matcher accepts every constrained output
    from dsv4.structured.compiler import GrammarCache
    import xgrammar
    cache = GrammarCache(engine.tokenizer, engine.cfg.vocab_size, engine.eos_token_id)
    compiled = cache.get(StructuredOutputs(json=json.dumps(SCHEMA)))
    for done in result["outs"].values():
        for o in done.values():
            m = xgrammar.GrammarMatcher(compiled)
            assert all(m.accept_token(t) for t in o.token_ids), f"{o.request_id}: output leaves the grammar"
    # correctness 2 (invariant 5): unconstrained tokens unchanged by constrained neighbours
    # (the same batch shape both times: the twins run 32 tokens with or without the constraint)
    plain_twins = {**workload(engine, 8, 32, False, "a"), **workload(engine, 8, 32, False, "t")}
    alone, _ = run(engine, plain_twins)
    mixed = {**workload(engine, 8, 32, False, "m"), **workload(engine, 8, 32, True, "c")}
    both, _ = run(engine, mixed)
    same = all(both[f"m{i}"].token_ids == alone[f"a{i}"].token_ids for i in range(8))
    best = result["best"]
    table(f"structured outputs, demo model on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}",
          args, best)
    ratio = best["no constraint"][0] / min(dt for name, (dt, *_) in best.items() if name != "no constraint")
    print(f"best constrained ratio {ratio:.3f}")
    name = default_variant(engine.config, args)
    if name is None:
        print("the default path (grammar_worker auto) is not among the variants run")
    else:
        print(f"the default path ({name}), best of {args.repeats} against best of {args.repeats}: "
              f"{best['no constraint'][0] / best[name][0]:.3f}")
        paired = sorted(p / c for p, c in zip(result["times"]["no constraint"], result["times"][name]))
        ratio = statistics.median(paired)
        verdict = ('MET' if ratio >= TARGET else 'MISSED') if device == "cuda" else "not judged on the CPU"
        print(f"the default path ({name}) ratio, median of the {len(paired)} repeats' ratios "
              f"(range {paired[0]:.3f}-{paired[-1]:.3f}): {ratio:.3f} (target >= {TARGET}, on the GPU): {verdict}")
    print(f"grammar outputs accepted by a fresh matcher: yes; unconstrained tokens unchanged: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
