"""Uniform steps replayed as CUDA graphs (docs/architecture.md, "Engine").

A uniform step — every sequence adds the same number q of tokens and wants all their logits:
q = 1 for decode, k + 1 to verify k drafts — is padded to fixed shapes (batch B from
BATCH_BUCKETS, causal-entry widths E4/E128 rounded up by `width_bucket`) and run through a
graph captured once per shape. The step's index tensors are copied into the graph's static
buffers before each replay, so changed page tables, slots and ring rows are picked up every
step. Padding rows read nothing and write to the storage's scratch units (cache/addressing.py);
their outputs are discarded.

With `capture=False` the same padded step runs eagerly: that is how the padding is tested on
machines without CUDA.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..cache.addressing import Scratch, SeqChunk, StepShape, build_step, step_widths
from ..cache.layout import SWA_PAGE_TOKENS
from ..model.forward_batch import ForwardBatch
from .upload import HostToDevice, replace_leaves, tensor_leaves

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_WIDTH = 16
MAX_GRAPHS = 48          # captured shapes kept; the least recently replayed one goes first


def batch_bucket(n: int, max_bs: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if n <= b <= max_bs), None)


def width_bucket(n: int) -> int:
    """Powers of two up to 512, then multiples of 512: few shapes, little padding (powers of
    two all the way cost ~0.2 ms of a batch-1 step at 16k context on the H200: the indexer and
    attention scan the padding)."""
    if n <= 512:
        return max(MIN_WIDTH, 1 << max(n - 1, 0).bit_length())
    return -(-n // 512) * 512


class StepGraphs:
    def __init__(self, model, storage, max_bs: int, capture: bool, h2d: HostToDevice | None = None,
                 keep_streams: bool = False):
        """keep_streams: the graphs also output the final residual streams (what a drafter reads)."""
        self.model, self.storage, self.max_bs, self.capture = model, storage, max_bs, capture
        self.keep_streams = keep_streams
        self.layout = storage.layout
        self.h2d = h2d if h2d is not None else HostToDevice(next(model.parameters()).device)
        self.graphs: OrderedDict[StepShape, tuple] = OrderedDict()   # in replay order
        self.scratch = Scratch(storage.scratch_page, storage.scratch_swa_page, storage.scratch_slot)
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def accepts(self, seqs: list[SeqChunk]) -> bool:
        q = len(seqs[0].token_ids) if seqs else 0
        return (0 < len(seqs) <= self.max_bs and batch_bucket(len(seqs), self.max_bs) is not None
                and all(len(s.token_ids) == q and s.logits == q and not s.stage for s in seqs))

    def shape(self, seqs: list[SeqChunk]) -> StepShape:
        W, q = self.layout.cfg.sliding_window, len(seqs[0].token_ids)
        e4, e128, _ = step_widths(seqs, W)
        # the SWA pages q tokens and their windows can span, at any alignment: one shape for all
        return StepShape(seqs=batch_bucket(len(seqs), self.max_bs), tokens=q, e4=width_bucket(e4),
                         e128=width_bucket(e128), swa_pages=(W + q - 2) // SWA_PAGE_TOKENS + 2)

    def run(self, seqs: list[SeqChunk], fill=None) -> torch.Tensor:
        """seqs: the step's uniform chunks -> fp32 logits [R * q, vocab] of its real rows.
        `fill` (runner.PendingFill): token rows whose ids are still on the device. The graph
        ends at the head's input [B * q, hidden]; the head GEMM runs after it (so a graph holds
        no [B * q, vocab] buffer)."""
        return self.run_with_streams(seqs, fill)[0]

    @torch.inference_mode()
    def run_with_streams(self, seqs: list[SeqChunk], fill=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run`, and the final residual streams [R * q, hc_mult, hidden] of the real rows when
        keep_streams (else None)."""
        real = len(seqs) * len(seqs[0].token_ids)
        shape = self.shape(seqs)
        padded = build_step(seqs, self.layout, self.storage.ring_slots, shape, self.scratch)
        leaves = [t for _, t in tensor_leaves(padded)]
        if not self.capture:
            static = _rebind(padded, self.h2d.allocate(leaves)[1])
            if fill is not None:
                fill.apply(static.token_ids, self.h2d)
            out = self._forward(static)
        else:
            graph, flat, static, out = self._graph(shape, padded, leaves)
            self.h2d.upload_into(flat, leaves)             # page tables, slots, rows of this step
            if fill is not None:
                fill.apply(static.token_ids, self.h2d)
            graph.replay()
        head_in, streams = out
        return self.model.head_logits(head_in[:real]), streams[:real] if streams is not None else None

    def _graph(self, shape: StepShape, padded: ForwardBatch, leaves: list[torch.Tensor]) -> tuple:
        if shape in self.graphs:
            self.graphs.move_to_end(shape)
        else:
            if len(self.graphs) >= MAX_GRAPHS:
                self.graphs.popitem(last=False)
            self.graphs[shape] = self._capture(padded, leaves)
        return self.graphs[shape]

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (head input [B * q, hidden], the streams [B * q, hc_mult, hidden] or None)."""
        streams = self.model(fb, self.storage.layers)[fb.logits_rows]
        return self.model.head_input(streams), streams if self.keep_streams else None

    def _capture(self, padded: ForwardBatch, leaves: list[torch.Tensor]):
        """The graph reads its batch from views of one flat buffer, refilled before each replay."""
        flat, views = self.h2d.allocate(leaves)
        static = _rebind(padded, views)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):          # warm-up (allocations, autotuning); the step is idempotent
            for _ in range(2):
                self._forward(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(static)
        return graph, flat, static, out


def _rebind(fb: ForwardBatch, tensors: list[torch.Tensor]) -> ForwardBatch:
    """fb with its tensors, in tensor_leaves order, replaced by `tensors`."""
    return replace_leaves(fb, dict(zip([p for p, _ in tensor_leaves(fb)], tensors)))
