"""ModelRunner: one forward over a mixed batch of prefill chunks, decode tokens and verify
tokens (docs/architecture.md, "Engine")."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from ..cache.addressing import Scratch, SeqChunk, build_step
from ..cache.batch_tables import PersistentTables
from ..cache.layout import CacheLayout, CachePlan
from ..cache.manager import CacheManager
from ..cache.step_rows import StepRows, as_rows
from ..cache.storage import KVStorage
from ..model.vision.encoder import VisionEncoder
from ..model.vision.step import ChunkImages, ImageRows, step_image_rows
from ..model.vision.visibility import blocks_in_chunk
from .cuda_graphs import StepGraphs, scratch_chunk
from .decode_rows import GATHER_MIN_ROWS, gather_rows, pending_of
from .late_compiles import LateCompiles
from .scheduler import ScheduledChunk
from .slot_state import SlotState, StepSlots
from .upload import HostToDevice, upload_tree


@dataclass
class StepLogits:
    logits: torch.Tensor            # [L, vocab] fp32 for the rows asked for
    first_row: list[int]            # per chunk: its first row in `logits` (-1: none)
    num_rows: list[int]             # per chunk: rows it has (its last num_rows tokens)
    hidden: torch.Tensor | None = None   # [T, hc_mult, hidden] final residual streams of every token
                                         # row, chunks in order (keep_hidden: what drafters read)
    taps: torch.Tensor | None = None     # [T, n_taps * hidden] the DSpark target layers' input
                                         # streams, hc-averaged, concatenated (keep_taps)
    slots: StepSlots | None = None       # the chunks' rows of the persistent batch when the step
                                         # was built from it (the engine then calls its `launched`)


@dataclass
class PendingFill:
    """Tokens still on the device: token row dst[i] of this step takes prev[src[i]], the
    token the step in flight sampled (async scheduling, docs/architecture.md "Engine")."""
    dst: torch.Tensor               # [P] long, CPU
    src: torch.Tensor               # [P] long, CPU
    prev: torch.Tensor | Callable[[], torch.Tensor]   # [N] long on the device: the step in flight's
                                    # sampled tokens (a callable: asked for, and so sampled, here)
    in_order: bool = False          # dst == src == range(P): row i takes prev[i] (a decode step of
                                    # the requests the step in flight sampled, in its order)

    def apply(self, token_ids: torch.Tensor, h2d: HostToDevice) -> None:
        prev = self.prev() if callable(self.prev) else self.prev
        if self.in_order:               # one device copy, nothing uploaded
            token_ids[:len(self.dst)] = prev[:len(self.dst)]
            return
        dst, src = h2d.upload([self.dst, self.src])
        token_ids[dst] = prev[src]


class Fills(list):
    """Several PendingFills of one step's token rows, applied as one."""

    def apply(self, token_ids: torch.Tensor, h2d: HostToDevice) -> None:
        for fill in self:
            fill.apply(token_ids, h2d)


@dataclass
class WarmupMessage:
    """Rank 0 to the other ranks of a parallel run: run `ModelRunner.warmup(*args)` now, as
    rank 0 does (their collectives meet; engine/workers.py)."""
    args: tuple


def next_message(runner: "ModelRunner", comm):
    """Ranks 1..n-1: rank 0's next step message (None: stop), running warm-ups on the way."""
    while True:
        msg = comm.broadcast_object()
        if not isinstance(msg, WarmupMessage):
            return msg
        runner.warmup(*msg.args)


class ModelRunner:
    def __init__(self, model, layout: CacheLayout, plan: CachePlan, cache: CacheManager, device,
                 cuda_graph_max_bs: int = 0, keep_hidden: bool = False, keep_taps: bool = False):
        """cuda_graph_max_bs > 0 on a CUDA device: uniform steps (every request the same number
        of tokens, all with logits) up to that batch replay CUDA graphs. keep_hidden: every step
        also returns its final residual streams (StepLogits.hidden); keep_taps: and the DSpark
        target layers' streams (StepLogits.taps; the graphs output them too)."""
        self.model, self.layout, self.cache, self.device = model, layout, cache, device
        self.keep_hidden, self.keep_taps = keep_hidden, keep_taps
        self.storage = KVStorage(layout, plan, model.dtype, device)
        self.h2d = HostToDevice(device)
        self.tables = PersistentTables(self.storage.ring_slots)   # page tables by slot, kept between steps
        use_graphs = cuda_graph_max_bs > 0 and torch.device(device).type == "cuda"
        self.graphs = StepGraphs(model, self.storage, cuda_graph_max_bs, capture=True, h2d=self.h2d,
                                 keep_streams=keep_hidden, keep_taps=keep_taps) if use_graphs else None
        self.vision = VisionEncoder(model) if model.cfg.vision is not None else None
        self.workers = None     # rank 0 of a parallel run: engine/workers.py's Workers (same steps on every rank)
        self.late_compiles = LateCompiles()     # Triton compiles after the warm-up (installed by it on CUDA)
        # the persistent batch (engine/slot_state.py), set by an engine of one process that
        # keeps it up to date (SlotState.launched / completed after every step): decode rows are
        # read from it (engine/decode_rows.py) in steps of at least gather_min_rows chunks; else
        # (None, smaller steps, vision models) a SeqChunk per chunk, the same step
        self.batch: SlotState | None = None
        self.gather_min_rows = GATHER_MIN_ROWS

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], prev_tokens: torch.Tensor | None = None,
                draft_fills: list[PendingFill] = ()) -> StepLogits:
        """`prev_tokens`: the sampled tokens of the step in flight, for requests whose last
        token is still pending (Request.num_pending). `draft_fills`: token rows of drafts still
        on the device (speculative/device_drafts.py; one process only: speculation refuses
        parallel runs)."""
        seqs, fill, slots = self.step_inputs(chunks, prev_tokens)
        if draft_fills:
            fill = Fills([f for f in (fill, *draft_fills) if f is not None])
        if self.workers is not None:
            self.workers.send_step(seqs, fill, num_sampled=sum(c.completes for c in chunks))
        out = self.run_seqs(seqs, fill, self._images(chunks, seqs))
        out.slots = slots
        return out

    def step_inputs(self, chunks: list[ScheduledChunk], prev_tokens: torch.Tensor | None
                    ) -> tuple[list[SeqChunk] | StepRows, PendingFill | None, StepSlots | None]:
        """The step's sequences, the token rows still on the device, and the chunks' rows of the
        persistent batch when it was used (else None): decode rows read from it into StepRows
        (engine/decode_rows.py) when there are any, else a SeqChunk per chunk."""
        batch = self.batch
        if batch is None or len(chunks) < self.gather_min_rows or self.workers is not None or self.vision is not None:
            if batch is not None:
                batch.forget(chunks)        # their fields change this step without the batch following
            seqs = [self.seq_chunk(c) for c in chunks]
            return seqs, pending_fill(chunks, seqs, prev_tokens), None
        rows = batch.step_slots(chunks, self.cache.seqs)
        gathered = gather_rows(chunks, rows, batch, self.seq_chunk)
        if gathered is None:
            seqs = [self.seq_chunk(c) for c in chunks]
            return seqs, pending_fill(chunks, seqs, prev_tokens), rows
        step, dst, src = gathered
        if not len(dst):
            return step, None, rows
        if prev_tokens is None:
            raise RuntimeError(f"{len(dst)} scheduled tokens are pending with no step in flight")
        in_order = bool(dst[-1] == len(dst) - 1 and (src == dst).all())    # (dst: distinct, ascending)
        return step, PendingFill(torch.from_numpy(dst), torch.from_numpy(src), prev_tokens, in_order), rows

    @torch.inference_mode()
    def run_seqs(self, seqs: list[SeqChunk] | StepRows, fill: PendingFill | None = None,
                 images: ImageRows | None = None) -> StepLogits:
        """The step of `seqs` (what every rank of a parallel run executes alike; images: one
        process only, `EngineConfig` refuses vision with tensor parallelism)."""
        seqs = as_rows(seqs)
        ends = np.cumsum(seqs.logits)
        counts, first = seqs.logits.tolist(), np.where(seqs.logits > 0, ends - seqs.logits, -1).tolist()
        self.tables.sync_rows(seqs)     # the persistent tables follow the chunks (on every rank)
        if images is None and self.graphs is not None and self.graphs.accepts(seqs):
            self.graphs.tables = self.tables      # (graphs a test installs read them too)
            if self.keep_hidden or self.keep_taps:
                logits, streams, taps = self.graphs.run_with_streams(seqs, fill)
                return StepLogits(logits, first, counts, streams, taps)
            return StepLogits(self.graphs.run(seqs, fill), first, counts)
        fb = upload_tree(build_step(seqs, self.layout, self.storage.ring_slots, tables=self.tables), self.h2d)
        if fill is not None:
            fill.apply(fb.token_ids, self.h2d)
        taps = [] if self.keep_taps else None
        hidden = self.model(fb, self.storage.layers, images, taps)
        return StepLogits(self.model.logits(hidden[fb.logits_rows]), first, counts,
                          hidden if self.keep_hidden else None, torch.cat(taps, -1) if taps else None)

    def _images(self, chunks: list[ScheduledChunk], seqs: list[SeqChunk]) -> ImageRows | None:
        """The step's image block rows (docs/vision.md), the images it needs encoded together."""
        if self.vision is None or not any(c.request.images for c in chunks):
            return None
        parts = [ChunkImages(c.request.images, s.start, len(s.token_ids), row)
                 for c, s, row in zip(chunks, seqs, accumulate([0] + [len(s.token_ids) for s in seqs]))]
        self.vision.prepare([i for p in parts for i in p.spans if i.start < p.start + p.n and i.end > p.start])
        return step_image_rows(parts, self.vision.block, sum(len(s.token_ids) for s in seqs), self.device)

    @torch.inference_mode()
    def warmup(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
               uniform_tokens: tuple[int, ...] = (1,)) -> dict:
        """Before the first request: compile the kernels of eager steps (`eager_warmup_steps`:
        library kernels are chosen, and loaded, by size; Triton variants by size-derived tiles)
        and run every CUDA-graph shape of uniform steps of `uniform_tokens` tokens (capturing
        it). Every step reads and writes only the storage's scratch units, so no request's state
        changes. Then Triton compiles are watched (`late_compiles`). Returns what ran. Rank 0 of
        a parallel run has every rank run it alongside."""
        if self.workers is not None:
            self.workers.send(WarmupMessage((max_model_len, max_num_seqs, max_num_batched_tokens, uniform_tokens)))
        scratch = Scratch(self.storage.scratch_page, self.storage.scratch_swa_page, self.storage.scratch_slot)
        steps = eager_warmup_steps(scratch, max_model_len, max_num_seqs, max_num_batched_tokens)
        for seqs in steps:
            fb = upload_tree(build_step(seqs, self.layout, self.storage.ring_slots), self.h2d)
            self.model.logits(self.model(fb, self.storage.layers)[fb.logits_rows])
        shapes = []
        if self.graphs is not None:
            self.graphs.tables = self.tables
            for q in uniform_tokens:
                shapes += self.graphs.warmup(max_model_len, max_num_seqs, q)
        if torch.device(self.device).type == "cuda":
            self.late_compiles.install()
        return {"eager_steps": len(steps), "graph_shapes": len(shapes)}

    def seq_chunk(self, c: ScheduledChunk) -> SeqChunk:
        """What every rank needs of chunk `c` (its request's records in `self.cache`)."""
        req, held, n = c.request, self.cache.seq(c.request), c.num_tokens
        start = req.num_computed
        if req.params.prompt_logprobs is not None and start < len(req.prompt_token_ids):
            logits = n                                  # (every row: the prompt's logprobs)
        elif c.num_logits:
            logits = min(c.num_logits, n)
        else:
            logits = 1 if n and start + n >= req.num_tokens else 0     # (c.completes, inlined)
        known = req.known_tokens(start, n)
        if c.num_logits:
            known += req.spec_token_ids[:n - len(known)]     # drafts to verify
        if len(known) < n:
            known += [0] * (n - len(known))             # the pending token, still on the device
        return SeqChunk(slot=held.slot, start=start, token_ids=known,
                        page_table=held.pages, swa_table=held.swa_pages, logits=logits,
                        stage=self.cache.stage(req, start, n) if self.cache.prefix is not None else 0,
                        images=blocks_in_chunk(req.images, start, n) if req.images else ())


ODD_FROM = 32      # warm-up sizes from which a prefill of one token less runs too (eager_warmup_steps)


def eager_warmup_steps(scratch: Scratch, max_model_len: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> list[list[SeqChunk]]:
    """The warm-up's eager steps: for every n in 1, 2, 4, ... and the token budget, a prefill
    step of n tokens (chunks from position 0 of at most max_model_len - 1 tokens, as many as
    needed: a budget past max_model_len mixes several prompts' chunks) and, where there is room
    for both, a mixed step of n tokens: d <= n // 2 decode rows at the furthest position (the
    widest cache reads) beside prefill chunks of the other n - d. At most max_num_seqs sequences
    a step. Sizes in powers of two meet every tile chosen from a power of two of a step's size
    (tokens, pairs, top-k width); from ODD_FROM on, a prefill of n - 1 tokens too: Triton
    specialises integer arguments by divisibility by 16, and a real prompt's token count and
    entry widths are rarely multiples of it (a row top-k compiled for the first such prompt on
    an H200 otherwise). From ODD_FROM on, where a chunk of n fits twice in max_model_len, a
    prefill chunk of n tokens ending there too (a long prompt's last chunk: the long-list kernels
    of deep steps, ops/triton/attention.py `LONG_KERNEL`, and the indexer's tiles). Every page and
    slot is the scratch one."""
    top = max(1, min(max_num_batched_tokens, max_model_len - 1))
    budget = max(1, min(max_num_batched_tokens, top * max_num_seqs))
    sizes = sorted({budget, *(1 << i for i in range(budget.bit_length()) if 1 << i < budget)})

    def prefill(n: int) -> list[SeqChunk]:
        return [scratch_chunk(scratch, 0, min(top, n - i)) for i in range(0, n, top)]

    steps = []
    for n in sizes:
        steps.append(prefill(n))
        if n >= ODD_FROM:
            steps.append(prefill(n - 1))
            if n <= top and 2 * n <= max_model_len:
                steps.append([scratch_chunk(scratch, max_model_len - n, n)])
        d = min(n // 2, max_num_seqs - -(-n // top))
        if d > 0 and max_model_len > 1:
            steps.append([scratch_chunk(scratch, max_model_len - 1, 1)] * d + prefill(n - d))
    return steps


def pending_fill(chunks: list[ScheduledChunk], seqs: list[SeqChunk],
                  prev_tokens: torch.Tensor | None) -> PendingFill | None:
    """Rows whose token the step in flight sampled: position `known` (the first unknown one)
    of each request whose chunk reaches past its known tokens (decode_rows.pending_of)."""
    dst, src, row = [], [], 0
    for c, s in zip(chunks, seqs):
        fill = pending_of(c, s, row)
        if fill is not None:
            if prev_tokens is None:
                raise RuntimeError(f"request {c.request.request_id}: its token at {fill[0] - row + s.start} "
                                   f"is pending with no step in flight")
            dst.append(fill[0])
            src.append(fill[1])
        row += len(s.token_ids)
    if not dst:
        return None
    return PendingFill(torch.tensor(dst), torch.tensor(src), prev_tokens)
