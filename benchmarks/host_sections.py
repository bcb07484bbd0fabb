"""Where the host time of an engine step goes, by component (benchmarks/host_path.py's breakdown).

`Sections` wraps named callables of a live engine with timers that charge each call's own time
(its time minus that of the wrapped calls inside it) to the component it belongs to, so the
components add up to the wall time of the wrapped top-level calls. `instrument` installs them
on an `LLMEngine` (docs/architecture.md, "Engine"); `ServePath` runs what the serving path does
with each step's outputs after the engine: the engine core's `TokenOutput`s and msgpack frame
(dsv4/engine/core.py, ipc.py), then the API process's decode, dispatch, detokenisation with
stop-string holdback and SSE chunk (dsv4/serve/client.py, serve/http/textstream.py).

Components marked "device" are tensor work that a GPU runs (here the stubbed forward, or the
sampler's kernels on a CPU device); they are reported apart from the host total.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict

DEVICE = ("forward stub (device)", "sampler kernels (device)")


class Sections:
    def __init__(self, clock=time.thread_time):
        """clock: the engine thread's CPU time by default (what the host work costs, whatever
        else shares the machine's cores); time.perf_counter for wall time."""
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self._children: list[float] = []     # per open wrapped call: time spent in wrapped calls inside
        self._undo: list[tuple[object, str, object]] = []

    def time_gc(self) -> None:
        """Charge Python's garbage collections to their own component (not to the call they
        interrupt)."""
        import gc
        started = []

        def on_gc(phase, info):
            if phase == "start":
                started.append(self.clock())
            elif started:
                spent = self.clock() - started.pop()
                self.seconds[f"gc (generation {info['generation']})"] += spent
                if self._children:
                    self._children[-1] += spent
        gc.callbacks.append(on_gc)
        self._undo.append((gc.callbacks, on_gc, None))

    def wrap(self, owner, attr: str, component: str) -> None:
        """Replace owner.attr (a callable) by a timed one charging its own time to `component`."""
        inner = getattr(owner, attr)
        sections = self

        def timed(*args, **kwargs):
            start = sections.clock()
            sections._children.append(0.0)
            try:
                return inner(*args, **kwargs)
            finally:
                spent = sections.clock() - start
                sections.seconds[component] += spent - sections._children.pop()
                if sections._children:
                    sections._children[-1] += spent
        self._undo.append((owner, attr, vars(owner).get(attr)))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, old in reversed(self._undo):
            if isinstance(owner, list):
                owner.remove(attr)
            elif old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self._undo.clear()

    def reset(self) -> None:
        self.seconds.clear()


def instrument(engine, sections: Sections) -> None:
    """Time the engine step's parts: scheduling, step inputs, batch tables and step building,
    the upload, the (stubbed) forward, sampling inputs and kernels, launch bookkeeping, cache
    advance and output processing."""
    from dsv4.engine import cuda_graphs, runner as runner_module
    runner, model = engine.runner, engine.model
    w = sections.wrap
    w(engine, "step", "engine step (rest)")
    w(engine.scheduler, "schedule", "scheduler")
    w(runner, "execute", "step inputs (runner.execute)")
    w(runner, "run_seqs", "batch tables + step build")
    if runner.graphs is not None:
        w(runner.graphs, "run_with_streams", "batch tables + step build")
    w(cuda_graphs, "build_step", "batch tables + step build")
    w(runner_module, "build_step", "batch tables + step build")
    for name in ("upload", "upload_into", "allocate"):
        w(runner.h2d, name, "upload (pack + copy)")
    for name in ("forward", "logits", "head_input", "head_logits"):
        w(model, name, "forward stub (device)")
    w(engine, "_launch", "launch bookkeeping")
    w(engine, "_sample", "sampling inputs")
    w(engine, "sampler", "sampler kernels (device)")
    w(engine.scheduler, "advance", "cache advance (commit, trim)")
    w(engine.scheduler, "advance_step", "cache advance (commit, trim)")
    w(engine, "_complete", "output processing")


class ServePath:
    """The outputs of each step through the engine core, the wire and the API process's client
    (its `_dispatch`, stop-string watches included), then each request's text stream."""

    def __init__(self, engine, sections: Sections):
        from dsv4.engine import ipc
        from dsv4.engine.core import EngineCore
        from dsv4.serve.client import EngineClient
        self.engine, self.ipc = engine, ipc
        self.core = EngineCore(engine)
        engine.check_stop_strings = False          # as in the engine-core process
        self.client = EngineClient("", None)       # sockets bound, no process started
        self.client.tokenizer = engine.tokenizer
        self.streams: dict = {}
        w = sections.wrap
        w(self.core, "step", "engine core: outputs")
        w(self, "_send", "ipc: encode")
        w(self.client, "_dispatch", "api: decode + dispatch")
        w(self, "_stream", "api: detokenise + SSE chunk")

    def add(self, request_id: str, prompt: list[int], params) -> None:
        from dsv4.serve.client import RequestGroup
        from dsv4.serve.http.completions import PLAIN_CHOICE
        from dsv4.serve.http.streaming import ChunkFormat
        from dsv4.serve.http.textstream import TextStream
        self.core.handle(self.ipc.AddRequest(request_id, prompt, params))
        group = self.client.groups[request_id] = RequestGroup(self.client, [request_id])
        head = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": 0, "model": "demo"}
        self.streams[request_id] = (group, TextStream(self.engine.tokenizer, prompt, params),
                                    ChunkFormat(head, {"usage": None}, PLAIN_CHOICE))

    def step(self) -> int:
        """One engine step and its outputs all the way to SSE text; returns the chunks made."""
        self.client._dispatch(self.ipc.decode_output(self._send(self.core.step())))
        return self._stream()

    def close(self) -> None:
        self.client.close()

    def _send(self, outputs) -> bytes:
        return self.ipc.encode(self.ipc.StepOutputs(outputs, self.core.take_failures(), self.core.stats()))

    def _stream(self) -> int:
        """Each stream's waiting outputs as one write of SSE events (serve/http/completions.py)."""
        made = 0
        for group, stream, chunks in self.streams.values():
            events = []
            while not group.queue.empty():
                _, out = group.queue.get_nowait()
                events.append(chunks.event({"index": 0, "text": stream.push(out), "logprobs": None,
                                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}))
            made += len(events)
            "".join(events)
        return made


def breakdown(seconds: dict[str, float], steps: int, concurrency: int) -> tuple[list[tuple[str, float]], dict]:
    """[(component, us per request per step)] largest first, and the host totals (device parts
    out): all, the engine-core process's (whose loop paces the steps) and the API process's
    (which runs beside it)."""
    rows = sorted(((k, v / steps / concurrency * 1e6) for k, v in seconds.items()), key=lambda r: -r[1])
    api = sum(v for k, v in rows if k.startswith("api:"))
    host = sum(v for k, v in rows if k not in DEVICE)
    return rows, {"all": host, "engine_core": host - api, "api": api}


def profile_steps(step, steps: int, top: int) -> str:
    """cProfile's `top` functions by own time over `steps` calls of `step`, as text."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()
