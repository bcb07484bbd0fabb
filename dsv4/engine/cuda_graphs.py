"""Uniform steps replayed as CUDA graphs (docs/architecture.md, "Engine").

A uniform step — every sequence adds the same number q of tokens and wants all their logits:
q = 1 for decode, k + 1 to verify k drafts — is padded to fixed shapes (batch B from
BATCH_BUCKETS, causal-entry widths E4/E128 rounded up by `width_bucket`) and run through a
graph captured once per shape. `warmup` captures every shape the configuration can produce
(`graph_shapes`) before the engine reports READY; captured graphs are kept for the engine's
life (a shape first seen later is captured then, and counted in `late_captures`). The step's
index tensors are copied into the graph's static
buffers before each replay, so changed page tables, slots and ring rows are picked up every
step. Padding rows read nothing and write to the storage's scratch units (cache/addressing.py);
their outputs are discarded.

With `capture=False` the same padded step runs eagerly, from the same per-shape buffers (made
on a shape's first step, refilled by the later ones): that is how the padding is tested on
machines without CUDA.
"""
from __future__ import annotations

import logging
import math

import torch

from ..cache.addressing import Scratch, SeqChunk, StepShape, build_step, padded_leaf_shapes
from ..cache.layout import SWA_PAGE_TOKENS
from ..cache.step_rows import StepRows, as_rows
from ..config import CSA_RATIO, HCA_RATIO
from ..model.forward_batch import ForwardBatch
from .upload import HostToDevice, leaf_tensors, packed_bytes, replace_leaves, tensor_leaves

log = logging.getLogger("dsv4.engine")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_WIDTH = 16
MAX_GRAPHS = 48          # the draft graphs' LRU bound (engine/speculative/draft_graphs.py, dspark_graphs.py)


def batch_bucket(n: int, max_bs: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if n <= b <= max_bs), None)


def width_bucket(n: int) -> int:
    """Powers of two up to 512, then multiples of 512: few shapes, little padding (powers of
    two all the way cost ~0.2 ms of a batch-1 step at 16k context on the H200: the indexer and
    attention scan the padding)."""
    if n <= 512:
        return max(MIN_WIDTH, 1 << max(n - 1, 0).bit_length())
    if n <= 8192:
        return -(-n // 512) * 512
    step = (1 << ((n - 1).bit_length() - 1)) // 16  # past 8192: 16 buckets an octave (<= 6.25% padding)
    return -(-n // step) * step


def graph_shapes(max_bs: int, max_seqs: int, max_model_len: int, q: int, window: int) -> list[StepShape]:
    """Every StepShape a uniform step of q tokens a sequence can take: each batch bucket up to
    max_bs, times each (E4, E128) width pair of a batch whose furthest sequence ends at some
    position <= max_model_len, for steps of at most max_seqs sequences. Largest batches first
    (their graphs take the most memory)."""
    top = batch_bucket(max_seqs, max_bs) or max_bs
    widths = end_widths(q, max_model_len)
    swa = (window + q - 2) // SWA_PAGE_TOKENS + 2
    return [StepShape(seqs=b, tokens=q, e4=e4, e128=e128, swa_pages=swa)
            for b in sorted((b for b in BATCH_BUCKETS if b <= top), reverse=True) for e4, e128 in widths]


def static_bytes(shape: StepShape) -> int:
    """Bytes of the device buffer a shape's graph reads its batch from (`StepGraphs._static`:
    the padded batch's int64 leaves packed as HostToDevice.allocate packs them)."""
    return packed_bytes([8 * math.prod(s) for s in padded_leaf_shapes(shape)])


def end_widths(first: int, last: int) -> list[tuple[int, int]]:
    """The distinct (E4, E128) width pairs of sequences ending at any position in [first, last],
    in order: one per run of ends with the same pair (a width bucket b covers the entry counts
    up to b, so the pair changes only where end // 4 or end // 128 passes its bucket), not one
    per position."""
    widths, end = [], first
    while end <= last:
        e4, e128 = width_bucket(end // CSA_RATIO), width_bucket(end // HCA_RATIO)
        widths.append((e4, e128))
        end = min(CSA_RATIO * (e4 + 1), HCA_RATIO * (e128 + 1))
    return widths


def warmup_seqs(shape: StepShape, scratch: Scratch, max_end: int) -> list[SeqChunk]:
    """A batch of `shape`: shape.seqs sequences of shape.tokens tokens, ending at the furthest
    position <= max_end whose widths round up to shape's, every page and slot the scratch one
    (the step writes only there)."""
    end = min(4 * shape.e4 + 3, 128 * shape.e128 + 127, max_end)
    while width_bucket(end // 4) != shape.e4 or width_bucket(end // 128) != shape.e128:
        end -= 1
    return [scratch_chunk(scratch, end - shape.tokens, shape.tokens, logits=shape.tokens)] * shape.seqs


def scratch_chunk(scratch: Scratch, start: int, n: int, logits: int = 1) -> SeqChunk:
    """n tokens at positions [start, start + n) whose pages and slot are all scratch."""
    end = start + n
    return SeqChunk(slot=scratch.slot, start=start, token_ids=[0] * n, page_table=[scratch.page] * (end // 256 + 1),
                    swa_table=[scratch.swa_page] * ((end - 1) // 128 + 1), logits=logits)


class StepGraphs:
    def __init__(self, model, storage, max_bs: int, capture: bool, h2d: HostToDevice | None = None,
                 keep_streams: bool = False, keep_taps: bool = False):
        """keep_streams: the graphs also output the final residual streams (what the MTP drafter
        reads); keep_taps: and the DSpark target layers' taps (what the DSpark drafter reads)."""
        self.model, self.storage, self.max_bs, self.capture = model, storage, max_bs, capture
        self.keep_streams, self.keep_taps = keep_streams, keep_taps
        self.layout = storage.layout
        self.h2d = h2d if h2d is not None else HostToDevice(next(model.parameters()).device)
        self.graphs: dict[StepShape, tuple] = {}     # kept for the engine's life (see warmup)
        self.buffers: dict[StepShape, tuple] = {}    # shape -> (flat device buffer, batch of its views)
        self.warmed: set[StepShape] = set()           # shapes run by warmup
        self.late: set[StepShape] = set()             # shapes first run after warmup
        self.tables = None        # the runner's PersistentTables (synced with the step's slots), or None
        self.scratch = Scratch(storage.scratch_page, storage.scratch_swa_page, storage.scratch_slot)
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def accepts(self, seqs: list[SeqChunk] | StepRows) -> bool:
        rows = as_rows(seqs)
        if not 0 < len(rows) <= self.max_bs or batch_bucket(len(rows), self.max_bs) is None:
            return False
        q = rows.lens[0]
        return bool((rows.lens == q).all() and (rows.logits == q).all()) and rows.stage is None

    def shape(self, seqs: list[SeqChunk] | StepRows) -> StepShape:
        rows = as_rows(seqs)
        W, q = self.layout.cfg.sliding_window, int(rows.lens[0])
        end = int(rows.starts.max()) + q       # (step_widths' E4 and E128; its SWA columns are not needed)
        # the SWA pages q tokens and their windows can span, at any alignment: one shape for all
        return StepShape(seqs=batch_bucket(len(rows), self.max_bs), tokens=q, e4=width_bucket(end // CSA_RATIO),
                         e128=width_bucket(end // HCA_RATIO), swa_pages=(W + q - 2) // SWA_PAGE_TOKENS + 2)

    def run(self, seqs: list[SeqChunk] | StepRows, fill=None) -> torch.Tensor:
        """seqs: the step's uniform chunks -> fp32 logits [R * q, vocab] of its real rows.
        `fill` (runner.PendingFill): token rows whose ids are still on the device. The graph
        ends at the head's input [B * q, hidden]; the head GEMM runs after it (so a graph holds
        no [B * q, vocab] buffer)."""
        return self.run_with_streams(seqs, fill)[0]

    @torch.inference_mode()
    def run_with_streams(self, seqs: list[SeqChunk] | StepRows, fill=None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                                    torch.Tensor | None]:
        """`run`, and of the real rows the final residual streams [R * q, hc_mult, hidden] when
        keep_streams and the taps [R * q, n_taps * hidden] (runner.StepLogits.taps) when keep_taps
        (else None)."""
        seqs = as_rows(seqs)
        real = seqs.num_tokens
        shape = self.shape(seqs)
        if self.warmed and shape not in self.warmed and shape not in self.late:
            self.late.add(shape)
            log.warning("a CUDA-graph shape warm-up did not run: %s (%d so far)", shape, len(self.late))
        padded = build_step(seqs, self.layout, self.storage.ring_slots, shape, self.scratch, self.tables)
        leaves = leaf_tensors(padded)
        flat, static = self._static(shape, padded, leaves)
        self.h2d.upload_into(flat, leaves)             # page tables, slots, rows of this step
        if fill is not None:
            fill.apply(static.token_ids, self.h2d)
        if not self.capture:
            out = self._forward(static)
        else:
            graph, out = self._graph(shape, static)
            graph.replay()
        head_in, streams, taps = out
        return (self.model.head_logits(head_in[:real]), streams[:real] if streams is not None else None,
                taps[:real] if taps is not None else None)

    def warmup(self, max_model_len: int, max_seqs: int, q: int = 1) -> list[StepShape]:
        """Run one step of every shape uniform steps of q tokens can take (batches up to
        min(max_bs, max_seqs), sequences up to max_model_len tokens): with capture, each graph
        is captured (kernels compiled on the way) and replayed once. Returns the shapes."""
        shapes = graph_shapes(self.max_bs, max_seqs, max_model_len, q, self.layout.cfg.sliding_window)
        self.warmed.update(shapes)
        for shape in shapes:
            seqs = warmup_seqs(shape, self.scratch, max_model_len)
            if self.tables is not None:
                self.tables.sync(self.scratch.slot, seqs[0].page_table, seqs[0].swa_table)
            assert self.shape(seqs) == shape, (shape, self.shape(seqs))
            self.run(seqs)
        return shapes

    def _static(self, shape: StepShape, padded: ForwardBatch,
                leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ForwardBatch]:
        """The shape's device buffer and the batch of its views, made once per shape (every step
        of a shape has the same leaf shapes and dtypes) and refilled before each step."""
        if shape not in self.buffers:
            flat, views = self.h2d.allocate(leaves)
            self.buffers[shape] = flat, _rebind(padded, views)
        return self.buffers[shape]

    def _graph(self, shape: StepShape, static: ForwardBatch) -> tuple:
        """(graph, its outputs): captured on the shape's first step, reading `static`."""
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(static)
        return self.graphs[shape]

    def _forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> (head input [B * q, hidden], the streams [B * q, hc_mult, hidden] or None, the taps
        [B * q, n_taps * hidden] or None). A padded step keeps every row's logits (its logits_rows
        are all B * q rows, cache/addressing.py): the streams are taken whole, not gathered by row."""
        assert fb.logits_rows.shape[0] == fb.num_tokens, (fb.logits_rows.shape, fb.num_tokens)
        taps = [] if self.keep_taps else None
        streams = self.model(fb, self.storage.layers, None, taps)
        return (self.model.head_input(streams), streams if self.keep_streams else None,
                torch.cat(taps, -1) if self.keep_taps else None)

    def _capture(self, static: ForwardBatch):
        """The graph reads its batch from `static`, views of one flat buffer refilled before each replay."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):          # warm-up (allocations, autotuning); the step is idempotent
            for _ in range(2):
                self._forward(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(static)
        return graph, out


def _rebind(fb: ForwardBatch, tensors: list[torch.Tensor]) -> ForwardBatch:
    """fb with its tensors, in tensor_leaves order, replaced by `tensors`."""
    return replace_leaves(fb, dict(zip([p for p, _ in tensor_leaves(fb)], tensors)))
