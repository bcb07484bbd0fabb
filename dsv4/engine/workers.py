"""The ranks of a parallel run (docs/architecture.md, "Parallelism").

Rank 0 is the engine's own process (the engine core, or the offline `LLM`): it schedules,
samples and talks to the API. `Workers.start` spawns ranks 1..n-1 (torch.multiprocessing,
spawn), each of which loads its shard of the model (`load_rank_model`), receives the cache
layout and plan from rank 0 and then executes every step rank 0 describes:

    rank 0:  send_step(seqs, fill) ─ forward + logits (collectives) ─ sample ─ share_sampled
    rank r:  recv step             ─ forward + logits (collectives) ─────────── recv sampled

A step description is the list of `SeqChunk`s (cache/addressing.py), the rows of tokens
still on the device (async scheduling) and the prefix-cache copies rank 0 made since the last
step (`RecordedCheckpoints`); every rank builds the same `ForwardBatch` from it and
keeps the sampled tokens rank 0 broadcasts, so `PendingFill` works on every rank.

Under data-parallel attention (`--data-parallel-size`) the step description is one part per
rank and ranks 1..n-1 run `data_parallel.run_dp_steps` instead of `run_steps`.

Failure rules: a rank that dies (or fails to start) ends rank 0's process with exit code 1
(`Workers.on_death`): the API process then fails the requests in flight with 5xx and shuts
down (serve/client.py). A worker exits when rank 0 is gone. `shutdown` gives every step a
`timeout_s` to end, then kills what is left (NCCL's teardown can hang)."""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from ..cache.checkpoint_log import RecordedCheckpoints, replay_checkpoint_ops
from ..parallel.comm import Comm, free_port, set_no_multicast_env

log = logging.getLogger("dsv4.workers")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StepMessage:
    seqs: list                      # [SeqChunk], the step's chunks in order
    fill_dst: list[int]             # PendingFill rows (empty: none)
    fill_src: list[int]
    num_sampled: int                # tokens rank 0 samples and broadcasts after the step (0: none)
    checkpoint_ops: list            # prefix-cache copies rank 0 made since the last step (RecordedCheckpoints)


def load_rank_model(model_dir: str, config, comm: Comm):
    """This rank's shard of the model: a random spec is built on the device (same seed on every
    rank, so every rank draws the same full model), a checkpoint is read on the host; then the
    parallel transform cuts it and the shard moves to the rank's device."""
    from ..model.random_model import is_random_spec
    from ..model.weights import load_model
    from ..parallel.expert_parallel import apply_dp_expert_parallel
    from ..parallel.tensor_parallel import apply_tensor_parallel
    build_on = comm.device if is_random_spec(model_dir) else "cpu"
    model = load_model(model_dir, build_on, DTYPES[config.dtype], keep_fp8=config.keep_fp8,
                       keep_mxfp4=config.keep_mxfp4, overrides=config.model_overrides())
    if config.data_parallel_size > 1:
        apply_dp_expert_parallel(model, comm)
    else:
        apply_tensor_parallel(model, comm, expert_parallel=config.enable_expert_parallel)
    return model.to(comm.device)


class Workers:
    """Rank 0's handle on the other ranks."""

    def __init__(self, procs: list, timeout_s: float = 30.0):
        self.procs, self.timeout_s = procs, timeout_s
        self.comm: Comm | None = None
        self.checkpoints: RecordedCheckpoints | None = None
        self.on_death = _exit_rank0
        self._stopping = threading.Event()
        self._death = threading.Lock()
        self._watch = threading.Thread(target=self._watchdog, name="dsv4-rank-watchdog", daemon=True)
        self._watch.start()
        atexit.register(self.shutdown)

    @classmethod
    def start(cls, model_dir: str, config) -> "Workers":
        set_no_multicast_env()
        size, port = config.world_size, free_port()
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=worker_main, name=f"dsv4-rank{r}", daemon=True,
                             args=(r, size, port, model_dir, config, os.getpid())) for r in range(1, size)]
        for p in procs:
            p.start()
        workers = cls(procs)          # watching before the rendezvous: a rank that cannot start ends rank 0
        workers.comm = Comm.init(0, size, port, config.device)
        return workers

    # ---- the steps -------------------------------------------------------------------------
    def send_cache(self, layout, plan, storage) -> None:
        """The cache every rank allocates alike; rank 0's prefix-cache copies get recorded."""
        self._guarded(self.comm.broadcast_object, (layout, plan))
        if storage.checkpoint_format is not None:
            storage.checkpoint_format = self.checkpoints = RecordedCheckpoints(storage.checkpoint_format, storage)

    def send_step(self, seqs: list, fill, num_sampled: int) -> None:
        dst, src = ([], []) if fill is None else (fill.dst.tolist(), fill.src.tolist())
        ops = self.checkpoints.take() if self.checkpoints is not None else []
        self.send(StepMessage(seqs, dst, src, num_sampled, ops))

    def send(self, message) -> None:
        """A step description to every rank (engine/data_parallel.py sends its own kind)."""
        self._guarded(self.comm.broadcast_object, message)

    def _guarded(self, fn, *args):
        """fn(*args); a collective that fails because a rank died ends this process as the
        watchdog does (whichever notices first), anything else raises."""
        try:
            return fn(*args)
        except RuntimeError:
            self.check_ranks()
            raise

    def check_ranks(self) -> None:
        """After a failed collective (a step's, or a message's): a dead rank ends this process
        as the watchdog does, so the error names the rank whichever thread sees it first."""
        for p in self.procs:
            p.join(2.0)
            if not p.is_alive():
                self._rank_died(p)

    def share_sampled(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens [N] long, to every rank (feeds their next PendingFill)."""
        self.comm.broadcast(tokens)

    # ---- health and shutdown ------------------------------------------------------------------
    def _watchdog(self) -> None:
        alive = {p.sentinel: p for p in self.procs}
        while alive and not self._stopping.is_set():
            for sentinel in multiprocessing.connection.wait(list(alive), timeout=0.5):
                if not self._stopping.is_set():
                    self._rank_died(alive[sentinel])
                return

    def _rank_died(self, p) -> None:
        """Once per run, whichever thread notices first: kill the other ranks, call on_death
        (which ends the process); a second caller waits for that end."""
        if not self._death.acquire(blocking=False):
            threading.Event().wait()
        if self._stopping.is_set():          # a shutdown in progress: ranks exiting is expected
            return
        self._stopping.set()
        self._kill_all()
        self.on_death(f"parallel rank {p.name} exited with code {p.exitcode}")

    def shutdown(self) -> None:
        """Stop every rank: the stop message, `timeout_s` for them to leave, then kill."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.comm is not None and all(p.is_alive() for p in self.procs):
            _with_timeout(lambda: self.comm.broadcast_object(None), self.timeout_s)
        deadline = time.monotonic() + self.timeout_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0))
        self._kill_all()
        if self.comm is not None:
            _with_timeout(self.comm.close, self.timeout_s)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _exit_rank0(reason: str) -> None:
    """A rank died: nothing this process computes from now on is right, and its collectives
    would wait forever. End it (the API process fails the requests in flight with 5xx)."""
    os.write(2, f"dsv4: {reason}: ending the engine\n".encode())   # unbuffered: os._exit flushes nothing
    log.error("%s: ending the engine", reason)
    os._exit(1)


def _with_timeout(fn, timeout_s: float) -> bool:
    """Run fn in a daemon thread; False when it did not return within timeout_s (left behind)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


# ---- ranks 1..n-1 ------------------------------------------------------------------------------
def worker_main(rank: int, size: int, port: int, model_dir: str, config, parent_pid: int) -> None:
    """Process entry of rank `rank`: load the shard, then run rank 0's steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the engine's process decides when ranks stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    set_no_multicast_env()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from ..ops.backend import set_backend
    set_backend(config.ops_backend)
    comm = Comm.init(rank, size, port, config.device)
    model = load_rank_model(model_dir, config, comm)
    runner = _worker_runner(model, comm, config)
    if config.data_parallel_size > 1:
        from .data_parallel import run_dp_steps
        run_dp_steps(runner, comm)
    else:
        run_steps(runner, comm)
    _with_timeout(comm.close, 30.0)


def _worker_runner(model, comm: Comm, config):
    from .runner import ModelRunner
    layout, plan = comm.broadcast_object()
    # (no CUDA graphs under data-parallel attention: the MoE's padded size changes each step)
    graphs = 0 if config.enforce_eager or config.data_parallel_size > 1 else config.cuda_graph_max_bs
    return ModelRunner(model, layout, plan, None, comm.device, graphs)


@torch.inference_mode()
def run_steps(runner, comm: Comm) -> None:
    from .runner import PendingFill, next_message
    prev = None                   # the last step's sampled tokens, on this rank's device
    while True:
        msg: StepMessage | None = next_message(runner, comm)
        if msg is None:
            return
        fill = PendingFill(torch.tensor(msg.fill_dst), torch.tensor(msg.fill_src), prev) if msg.fill_dst else None
        replay_checkpoint_ops(runner.storage, msg.checkpoint_ops)
        runner.run_seqs(msg.seqs, fill)
        if msg.num_sampled:
            prev = comm.broadcast(torch.empty(msg.num_sampled, dtype=torch.long, device=comm.device))


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
