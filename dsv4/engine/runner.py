"""ModelRunner: one forward over a mixed batch of prefill chunks and decode tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.layout import CacheLayout, CachePlan
from ..cache.pools import KVPools
from .batch import SeqChunk, build_forward_batch
from .cuda_graphs import DecodeGraphs
from .scheduler import ScheduledChunk
from .upload import HostToDevice


@dataclass
class StepLogits:
    logits: torch.Tensor            # [L, vocab] fp32 for the rows asked for
    first_row: list[int]            # per chunk: its first row in `logits` (-1: none)
    num_rows: list[int]             # per chunk: rows it has (0, 1 = last token, n = all)


@dataclass
class PendingFill:
    """Tokens still on the device: token row dst[i] of this step takes prev[src[i]], the
    token the step in flight sampled (DESIGN §5, async scheduling)."""
    dst: torch.Tensor               # [P] long, CPU
    src: torch.Tensor               # [P] long, CPU
    prev: torch.Tensor              # [N] long on the device: the step in flight's sampled tokens

    def apply(self, token_ids: torch.Tensor, h2d: HostToDevice) -> None:
        dst, src = h2d.upload([self.dst, self.src])
        token_ids[dst] = self.prev[src]


class ModelRunner:
    def __init__(self, model, layout: CacheLayout, plan: CachePlan, device, cuda_graph_max_bs: int = 0):
        """cuda_graph_max_bs > 0 on a CUDA device: decode steps up to that batch replay CUDA graphs."""
        self.model, self.layout, self.plan, self.device = model, layout, plan, device
        self.pools = KVPools(layout, plan, model.dtype, device)
        self.h2d = HostToDevice(device)
        use_graphs = cuda_graph_max_bs > 0 and torch.device(device).type == "cuda"
        self.graphs = DecodeGraphs(model, self.pools, cuda_graph_max_bs, capture=True, h2d=self.h2d) \
            if use_graphs else None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], prev_tokens: torch.Tensor | None = None) -> StepLogits:
        """`prev_tokens`: the sampled tokens of the step in flight, for requests whose last
        token is still pending (Request.num_pending)."""
        seqs = [self._seq_chunk(c) for c in chunks]
        fill = _pending_fill(chunks, seqs, prev_tokens)
        if self.graphs is not None and self.graphs.accepts(seqs):
            return StepLogits(self.graphs.run(seqs, fill), list(range(len(seqs))), [1] * len(seqs))
        fb = build_forward_batch(seqs, self.layout, self.pools.ring_slots, self.device, self.h2d)
        if fill is not None:
            fill.apply(fb.token_ids, self.h2d)
        hidden = self.model(fb, self.pools)
        logits = self.model.logits(hidden[fb.logits_rows])
        first, counts, row = [], [], 0
        for s in seqs:
            n = {"all": len(s.token_ids), "last": 1, "none": 0}[s.logits]
            first.append(row if n else -1)
            counts.append(n)
            row += n
        return StepLogits(logits, first, counts)

    @staticmethod
    def _seq_chunk(c: ScheduledChunk) -> SeqChunk:
        req = c.request
        start = req.num_computed
        in_prompt = start < len(req.prompt_token_ids)
        mode = "all" if req.wants_prompt_logprobs and in_prompt else ("last" if c.completes else "none")
        known = req.known_tokens(start, c.num_tokens)
        missing = c.num_tokens - len(known)              # the pending token, still on the device
        return SeqChunk(slot=req.slot, start=start, token_ids=known + [0] * missing,
                        page_table=req.pages, swa_table=req.swa_pages, logits=mode)


def _pending_fill(chunks: list[ScheduledChunk], seqs: list[SeqChunk],
                  prev_tokens: torch.Tensor | None) -> PendingFill | None:
    dst, src, row = [], [], 0
    for c, s in zip(chunks, seqs):
        req = c.request
        last = s.start + len(s.token_ids)                 # one past the chunk's last position
        known = len(req.prompt_token_ids) + len(req.output_token_ids)
        if last > known:
            if req.num_pending != 1 or last != known + 1 or prev_tokens is None:
                raise RuntimeError(f"request {req.request_id}: tokens up to {last} scheduled, "
                                   f"{known} known and {req.num_pending} pending")
            dst.append(row + len(s.token_ids) - 1)
            src.append(req.pending_row)
        row += len(s.token_ids)
    if not dst:
        return None
    return PendingFill(torch.tensor(dst), torch.tensor(src), prev_tokens)
