"""ModelRunner: one forward over a mixed batch of prefill chunks and decode tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.layout import CacheLayout, CachePlan
from ..cache.pools import KVPools
from .batch import PinnedStager, SeqChunk, build_forward_batch
from .cuda_graphs import DecodeGraphs
from .scheduler import ScheduledChunk


@dataclass
class StepLogits:
    logits: torch.Tensor            # [L, vocab] fp32 for the rows asked for
    first_row: list[int]            # per chunk: its first row in `logits` (-1: none)
    num_rows: list[int]             # per chunk: rows it has (0, 1 = last token, n = all)


class ModelRunner:
    def __init__(self, model, layout: CacheLayout, plan: CachePlan, device, cuda_graph_max_bs: int = 0):
        """cuda_graph_max_bs > 0 on a CUDA device: decode steps up to that batch replay CUDA graphs."""
        self.model, self.layout, self.plan, self.device = model, layout, plan, device
        self.pools = KVPools(layout, plan, model.dtype, device)
        self.stager = PinnedStager()
        use_graphs = cuda_graph_max_bs > 0 and torch.device(device).type == "cuda"
        self.graphs = DecodeGraphs(model, self.pools, cuda_graph_max_bs, capture=True) if use_graphs else None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepLogits:
        seqs = [self._seq_chunk(c) for c in chunks]
        if self.graphs is not None and self.graphs.accepts(seqs):
            fb = build_forward_batch(seqs, self.layout, self.pools.ring_slots, "cpu")
            return StepLogits(self.graphs.run(fb), list(range(len(seqs))), [1] * len(seqs))
        fb = build_forward_batch(seqs, self.layout, self.pools.ring_slots, self.device, self.stager)
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
        return SeqChunk(slot=req.slot, start=start, token_ids=req.all_token_ids[start:start + c.num_tokens],
                        page_table=req.pages, swa_table=req.swa_pages, logits=mode)
