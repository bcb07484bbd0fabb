"""Data-parallel attention with expert parallelism in the engine (docs/architecture.md,
"Parallelism"): `--data-parallel-size N --enable-expert-parallel`.

One scheduler, on rank 0, assigns each request to a DP rank and builds one step per rank.
Rank 0 holds, per DP rank, a `Scheduler` and a `CacheManager` (that rank's pages, slots and
request records); rank r's KV storage lives on rank r only. A step:

    rank 0:  schedule every rank ─ send DPStepMessage ─ own part ─ gather logits ─ sample ─ share_sampled
    rank r:  recv DPStepMessage  ─────────────────────  own part ─ gather logits ─────────── recv sampled

"Own part" is `ModelRunner.run_seqs` over the rank's chunks (attention on its own cache, each
MoE dispatching to the experts' ranks, parallel/expert_parallel.py), or `idle_step` when it has
none (the MoE collectives with 0 tokens). The logits rows of every rank are all-gathered
(padded to the largest rank's rows), so rank 0 samples the whole step as one batch, in the
order of the chunks it scheduled: the engine's sampling, async scheduling, stop rules and
outputs run unchanged. The sampled tokens are broadcast to every rank as under tensor
parallelism (engine/workers.py); `PendingFill.src` indexes them, so each rank fills its own rows.

With a prefix cache every rank's `CacheManager` keeps its own tree over its own pages. Its
checkpoint copies (pack after a step, unpack at admission) are made on rank 0's storage for
rank 0 and, for rank r, recorded (`RankStorage`: `RecordedCheckpoints` over no copies)
and replayed by rank r before its next part (`RankPart.checkpoint_ops`), in the order rank 0
made them, as under tensor parallelism.

Invariants: a request stays on the rank it was assigned to (its cache is there) until it ends;
a new request goes to the rank whose tree resumes the most of its prompt, among the ranks
within `hit_slack` requests of the least loaded; with no hit there, to the least loaded rank
(fewest requests running or waiting, then the lowest rank) (`assign_rank`); every rank's
chunks of a step keep the order that rank's scheduler gave them."""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from ..cache.checkpoint_log import RecordedCheckpoints, replay_checkpoint_ops
from ..cache.manager import CacheManager
from ..cache.sizing import prefix_caching
from ..config import ConfigError, EngineConfig, ModelConfig
from ..parallel.comm import Comm
from ..parallel.expert_parallel import idle_step
from .request import Request, Status
from .runner import ModelRunner, PendingFill, StepLogits, WarmupMessage, next_message, pending_fill
from .scheduler import ScheduledChunk, Scheduler


@dataclass
class RankPart:
    """One DP rank's part of a step."""
    seqs: list                      # [SeqChunk], the rank's chunks in order
    fill_dst: list[int]             # PendingFill rows (empty: none); src indexes the whole step's samples
    fill_src: list[int]
    checkpoint_ops: list            # prefix-cache copies on this rank's storage since its last part


@dataclass
class DPStepMessage:
    parts: list[RankPart]           # per DP rank
    num_sampled: int                # tokens rank 0 samples over all ranks, broadcast after the step

    def logit_rows(self) -> list[int]:
        """Per rank: the logits rows its part returns."""
        return [sum(s.logits for s in p.seqs) for p in self.parts]


class _NoCopies:
    """The checkpoint format of a storage on another rank: nothing is copied here."""

    def pack(self, *args) -> None:
        pass

    def unpack(self, *args) -> None:
        pass


class RankStorage:
    """Rank 0's stand-in for rank r's KV storage (which lives on rank r) as its CacheManager
    sees it: `checkpoints[row]` names a checkpoint row (one byte each: only its index is read),
    and every pack / unpack the manager makes is recorded (`RecordedCheckpoints`, no copy here)
    for rank r to replay before its next part."""

    def __init__(self, num_checkpoints: int):
        self.checkpoints = torch.empty(num_checkpoints, 1, dtype=torch.uint8)
        self.checkpoint_format = RecordedCheckpoints(_NoCopies(), self)


class DPCaches:
    """The cache records of every DP rank, held by rank 0: one CacheManager per rank, and the
    rank of every request in flight. The engine and the runner call it as one CacheManager; a
    request's calls go to its rank's manager."""

    tiers = None                    # no host / disk tiers under DP (config.py refuses them)

    def __init__(self, layout, plan, num_ranks: int, prefix_caching: bool = False):
        self.ranks = [CacheManager(layout, plan, prefix_caching) for _ in range(num_ranks)]
        self.rank_of: dict[str, int] = {}     # request id -> its DP rank
        # (the engine only asks whether there is a prefix cache: every rank has one or none)
        self.prefix = self.ranks[0].prefix

    def of(self, req: Request) -> CacheManager:
        return self.ranks[self.rank_of[req.request_id]]

    def bind(self, storage, tiers=None) -> None:
        """Rank 0's storage; the others' live on their ranks, so their managers get a
        `RankStorage` whose copies are recorded (`take_checkpoint_ops`)."""
        self.ranks[0].bind(storage)
        for c in self.ranks[1:]:
            c.bind(RankStorage(c.plan.num_checkpoints))

    def take_checkpoint_ops(self, rank: int) -> list:
        """The prefix-cache copies made on rank `rank`'s storage since the last call (rank >= 1;
        rank 0's are made in place)."""
        return self.ranks[rank].storage.checkpoint_format.take()

    def peek(self, req: Request) -> list[int]:
        """Per rank: the tokens its prefix tree would resume `req` from (a pure lookup)."""
        return [c.peek(req) for c in self.ranks]

    def seq(self, req):
        return self.of(req).seq(req)

    def stage(self, req, start: int, num_tokens: int) -> int:
        return self.of(req).stage(req, start, num_tokens)

    def commit(self, req) -> None:
        self.of(req).commit(req)

    def fits_ever(self, num_tokens: int, chunk: int) -> bool:
        return self.ranks[0].fits_ever(num_tokens, chunk)      # every rank has the same plan

    def reset_prefix(self) -> int:
        """Every rank's prefix cache forgotten; the pages freed over all ranks."""
        return sum(c.reset_prefix() for c in self.ranks)

    def available_pages(self) -> int:
        return sum(c.available_pages() for c in self.ranks)

    def usage(self) -> dict:
        """Every rank's usage, summed."""
        total: dict = {}
        for c in self.ranks:
            for k, v in c.usage().items():
                total[k] = total.get(k, 0) + v
        return total


def assign_rank(loads: list[int], hits: list[int], hit_slack: int) -> int:
    """The rank a new request goes to. loads: per rank, requests running or waiting; hits: per
    rank, the prompt tokens its prefix tree would resume. Among the ranks within `hit_slack`
    of the least load, the longest hit wins (ties: the lower load, then the lower rank); with no
    hit among them, the least loaded rank, then the lowest. A hot prefix therefore stays on its
    rank only while that rank is at most `hit_slack` requests busier than the idlest; past that
    it is computed, and cached, on the idlest rank too (docs/architecture.md, "Parallelism")."""
    least = min(loads)
    return max(range(len(loads)),
               key=lambda r: (hits[r] if loads[r] <= least + hit_slack else 0, -loads[r], -r))


def default_hit_slack(max_num_seqs: int) -> int:
    """How many more requests than the least loaded rank a rank may hold and still get the
    requests its prefix tree hits: a quarter of a rank's batch (at least 1)."""
    return max(1, max_num_seqs // 4)


class DPScheduler:
    """One `Scheduler` per DP rank (its own token budget and request slots, as each rank
    runs its own batch), seen by the engine as one: `schedule()` is every rank's chunks, rank
    by rank."""

    def __init__(self, caches: DPCaches, max_num_batched_tokens: int, max_num_seqs: int,
                 hit_slack: int | None = None, max_prompt_logprobs_tokens: int | None = None):
        self.caches = caches
        self.ranks = [Scheduler(c, max_num_batched_tokens, max_num_seqs, max_prompt_logprobs_tokens)
                      for c in caches.ranks]
        self.hit_slack = default_hit_slack(max_num_seqs) if hit_slack is None else hit_slack

    @property
    def prefix_queries(self) -> int:
        """Prompt tokens looked up in the prefix caches, over all ranks."""
        return sum(s.prefix_queries for s in self.ranks)

    @property
    def prefix_hits(self) -> int:
        """Of them, tokens resumed, over all ranks."""
        return sum(s.prefix_hits for s in self.ranks)

    def _of(self, req: Request) -> Scheduler:
        return self.ranks[self.caches.rank_of[req.request_id]]

    def load(self, rank: int) -> int:
        """Requests rank `rank` runs or holds waiting."""
        return sum(self.ranks[rank].counts())

    def add(self, req: Request) -> None:
        loads = [self.load(r) for r in range(len(self.ranks))]
        rank = assign_rank(loads, self.caches.peek(req), self.hit_slack)
        self.caches.rank_of[req.request_id] = rank
        self.ranks[rank].add(req)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.ranks)

    def schedule(self) -> list[ScheduledChunk]:
        return [c for s in self.ranks for c in s.schedule()]

    def advance(self, req: Request, num_tokens: int) -> None:
        self._of(req).advance(req, num_tokens)

    def advance_step(self, chunks: list[ScheduledChunk]) -> None:
        for c in chunks:
            self.advance(c.request, c.num_tokens - c.num_rejected)

    def finish(self, req: Request, status: Status = Status.FINISHED) -> None:
        self._of(req).finish(req, status)
        del self.caches.rank_of[req.request_id]

    def counts(self) -> tuple[int, int]:
        running, waiting = zip(*(s.counts() for s in self.ranks))
        return sum(running), sum(waiting)

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    @contextmanager
    def only(self, req: Request):
        """Inside: every rank's scheduler sees nothing but `req` (on its own rank)."""
        own = self._of(req)
        others = [(s, s.running, s.waiting) for s in self.ranks if s is not own]
        for s, _, _ in others:
            s.running, s.waiting = [], deque()
        try:
            with own.only(req):
                yield
        finally:
            for s, running, waiting in others:
                s.running, s.waiting = running, waiting


class DPRunner:
    """Rank 0's runner: splits a step's chunks by rank, sends every rank its part, runs its
    own and returns the whole step's logits in the order of the chunks."""

    graphs = None                   # no CUDA graphs under DP (parallel/expert_parallel.py: shapes change each step)
    batch = None                    # no persistent batch (engine/slot_state.py): SeqChunks split by rank

    def __init__(self, local: ModelRunner, caches: DPCaches, comm: Comm):
        self.local, self.caches, self.comm = local, caches, comm
        self.storage, self.h2d, self.model = local.storage, local.h2d, local.model
        self.late_compiles = local.late_compiles     # (installed by the local runner's warm-up)
        self.workers = None             # engine/workers.py's Workers, set by the engine

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], prev_tokens: torch.Tensor | None = None) -> StepLogits:
        n = self.comm.size
        ranks = [self.caches.rank_of[c.request.request_id] for c in chunks]
        seqs = [self.local.seq_chunk(c) for c in chunks]      # (the seq / stage of each request's rank)
        parts, fills = [], []
        for r in range(n):
            mine = [i for i, cr in enumerate(ranks) if cr == r]
            fill = pending_fill([chunks[i] for i in mine], [seqs[i] for i in mine], prev_tokens)
            dst, src = ([], []) if fill is None else (fill.dst.tolist(), fill.src.tolist())
            ops = self.caches.take_checkpoint_ops(r) if r else []
            parts.append(RankPart([seqs[i] for i in mine], dst, src, ops))
            fills.append(fill)
        if self.workers.checkpoints is not None:
            self.workers.checkpoints.take()     # rank 0's own copies: made in place already
        msg = DPStepMessage(parts, sum(c.completes for c in chunks))
        self.workers.send(msg)
        logits = run_part(self.local, self.comm, parts[0].seqs, fills[0], msg.logit_rows())
        return StepLogits(logits, *_rows_in_chunk_order(seqs, ranks, msg.logit_rows()))

    def warmup(self, *args) -> dict:
        """Every rank runs the same warm-up steps (`ModelRunner.warmup`: eager steps on scratch
        rows; their MoE collectives meet); no CUDA graphs to capture."""
        self.workers.send(WarmupMessage(args))
        return self.local.warmup(*args)


def check_expert_split(model_dir: str, config: EngineConfig) -> None:
    """Before any rank starts: every DP rank gets the same number of whole routed experts."""
    from ..model.random_model import is_random_spec, parse_spec
    overrides = config.model_overrides()
    cfg = parse_spec(model_dir, overrides) if is_random_spec(model_dir) else ModelConfig.from_dir(model_dir, overrides)
    E, n = cfg.n_routed_experts, config.data_parallel_size
    if E % n:
        raise ConfigError("data_parallel_size", f"{n} ranks do not split the model's {E} routed experts evenly")


def dp_engine_parts(model, layout, plan, config, workers) -> tuple[DPCaches, DPScheduler, DPRunner]:
    """Rank 0's cache records, scheduler and runner for `config.data_parallel_size` ranks."""
    caches = DPCaches(layout, plan, config.data_parallel_size, prefix_caching(config))
    scheduler = DPScheduler(caches, config.max_num_batched_tokens, config.max_num_seqs,
                            max_prompt_logprobs_tokens=config.max_prompt_logprobs_tokens)
    local = ModelRunner(model, layout, plan, caches, config.device, 0)    # no CUDA graphs (see DPRunner)
    return caches, scheduler, DPRunner(local, caches, workers.comm)


def run_part(runner: ModelRunner, comm: Comm, seqs: list, fill: PendingFill | None,
             rows: list[int]) -> torch.Tensor:
    """This rank's part of a step (every rank calls it alike) -> every rank's logits rows,
    rank by rank [sum(rows), vocab] fp32. rows: each rank's logits rows."""
    V = runner.model.cfg.vocab_size
    if seqs:
        own = runner.run_seqs(seqs, fill).logits
    else:
        idle_step(runner.model)
        own = torch.empty(0, V, dtype=torch.float32, device=runner.device)
    M = max(rows)
    if M == 0:
        return own
    every = comm.all_gather_rows(F.pad(own, (0, 0, 0, M - own.shape[0])))          # [n*M, V]
    return torch.cat([every[r * M:r * M + k] for r, k in enumerate(rows)])


def _rows_in_chunk_order(seqs: list, ranks: list[int], rows: list[int]) -> tuple[list[int], list[int]]:
    """(first_row, num_rows) per chunk in the gathered logits (rank by rank, each rank's
    chunks in order)."""
    offset = list(accumulate([0] + rows))
    first, counts = [], []
    for s, r in zip(seqs, ranks):
        first.append(offset[r] if s.logits else -1)
        counts.append(s.logits)
        offset[r] += s.logits
    return first, counts


@torch.inference_mode()
def run_dp_steps(runner: ModelRunner, comm: Comm) -> None:
    """Ranks 1..n-1: run rank 0's steps until told to stop."""
    prev = None                   # the last step's sampled tokens (all ranks'), on this rank's device
    while True:
        msg: DPStepMessage | None = next_message(runner, comm)
        if msg is None:
            return
        own = msg.parts[comm.rank]
        fill = PendingFill(torch.tensor(own.fill_dst), torch.tensor(own.fill_src), prev) if own.fill_dst else None
        replay_checkpoint_ops(runner.storage, own.checkpoint_ops)
        run_part(runner, comm, own.seqs, fill, msg.logit_rows())
        if msg.num_sampled:
            prev = comm.broadcast(torch.empty(msg.num_sampled, dtype=torch.long, device=comm.device))
