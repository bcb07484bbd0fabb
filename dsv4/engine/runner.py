"""ModelRunner: one forward over a mixed batch of prefill chunks, decode tokens and verify
tokens (docs/architecture.md, "Engine")."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..cache.addressing import SeqChunk, build_step
from ..cache.layout import CacheLayout, CachePlan
from ..cache.manager import CacheManager
from ..cache.storage import KVStorage
from .cuda_graphs import StepGraphs
from .scheduler import ScheduledChunk
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


@dataclass
class PendingFill:
    """Tokens still on the device: token row dst[i] of this step takes prev[src[i]], the
    token the step in flight sampled (async scheduling, docs/architecture.md "Engine")."""
    dst: torch.Tensor               # [P] long, CPU
    src: torch.Tensor               # [P] long, CPU
    prev: torch.Tensor              # [N] long on the device: the step in flight's sampled tokens

    def apply(self, token_ids: torch.Tensor, h2d: HostToDevice) -> None:
        dst, src = h2d.upload([self.dst, self.src])
        token_ids[dst] = self.prev[src]


class ModelRunner:
    def __init__(self, model, layout: CacheLayout, plan: CachePlan, cache: CacheManager, device,
                 cuda_graph_max_bs: int = 0, keep_hidden: bool = False, keep_taps: bool = False):
        """cuda_graph_max_bs > 0 on a CUDA device: uniform steps (every request the same number
        of tokens, all with logits) up to that batch replay CUDA graphs. keep_hidden: every step
        also returns its final residual streams (StepLogits.hidden); keep_taps: and the DSpark
        target layers' streams (StepLogits.taps; such steps run eagerly)."""
        self.model, self.layout, self.cache, self.device = model, layout, cache, device
        self.keep_hidden, self.keep_taps = keep_hidden, keep_taps
        self.storage = KVStorage(layout, plan, model.dtype, device)
        self.h2d = HostToDevice(device)
        use_graphs = cuda_graph_max_bs > 0 and torch.device(device).type == "cuda" and not keep_taps
        self.graphs = StepGraphs(model, self.storage, cuda_graph_max_bs, capture=True, h2d=self.h2d,
                                 keep_streams=keep_hidden) if use_graphs else None

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], prev_tokens: torch.Tensor | None = None) -> StepLogits:
        """`prev_tokens`: the sampled tokens of the step in flight, for requests whose last
        token is still pending (Request.num_pending)."""
        seqs = [self._seq_chunk(c) for c in chunks]
        fill = _pending_fill(chunks, seqs, prev_tokens)
        counts = [s.logits for s in seqs]
        first = [row if n else -1 for row, n in zip(accumulate([0] + counts), counts)]
        if self.graphs is not None and self.graphs.accepts(seqs):
            if self.keep_hidden:
                logits, streams = self.graphs.run_with_streams(seqs, fill)
                return StepLogits(logits, first, counts, streams)
            return StepLogits(self.graphs.run(seqs, fill), first, counts)
        fb = upload_tree(build_step(seqs, self.layout, self.storage.ring_slots), self.h2d)
        if fill is not None:
            fill.apply(fb.token_ids, self.h2d)
        taps = [] if self.keep_taps else None
        hidden = self.model(fb, self.storage.layers, taps)
        return StepLogits(self.model.logits(hidden[fb.logits_rows]), first, counts,
                          hidden if self.keep_hidden else None, torch.cat(taps, -1) if taps else None)

    def _seq_chunk(self, c: ScheduledChunk) -> SeqChunk:
        req, held = c.request, self.cache.seq(c.request)
        start = req.num_computed
        if req.wants_prompt_logprobs and start < len(req.prompt_token_ids):
            logits = c.num_tokens
        else:
            logits = min(max(c.num_logits or 0, 1 if c.completes else 0), c.num_tokens)
        known = req.known_tokens(start, c.num_tokens)
        known += req.spec_token_ids[:c.num_tokens - len(known)] if c.num_logits else []   # drafts to verify
        missing = c.num_tokens - len(known)              # the pending token, still on the device
        return SeqChunk(slot=held.slot, start=start, token_ids=known + [0] * missing,
                        page_table=held.pages, swa_table=held.swa_pages, logits=logits,
                        stage=self.cache.stage(req, start, c.num_tokens))


def _pending_fill(chunks: list[ScheduledChunk], seqs: list[SeqChunk],
                  prev_tokens: torch.Tensor | None) -> PendingFill | None:
    """Rows whose token the step in flight sampled: position `known` (the first unknown one)
    of each request whose chunk reaches past its known tokens."""
    dst, src, row = [], [], 0
    for c, s in zip(chunks, seqs):
        req = c.request
        last = s.start + len(s.token_ids)                 # one past the chunk's last position
        known = len(req.prompt_token_ids) + len(req.output_token_ids) + len(req.spec_token_ids)
        if last > known:
            if req.num_pending != 1 or last != known + 1 or prev_tokens is None:
                raise RuntimeError(f"request {req.request_id}: tokens up to {last} scheduled, "
                                   f"{known} known and {req.num_pending} pending")
            dst.append(row + known - s.start)
            src.append(req.pending_row)
        row += len(s.token_ids)
    if not dst:
        return None
    return PendingFill(torch.tensor(dst), torch.tensor(src), prev_tokens)
