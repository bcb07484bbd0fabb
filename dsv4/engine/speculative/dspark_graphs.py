"""The DSpark draft of a uniform step as one CUDA graph (docs/speculative.md, "CUDA graphs").

After a uniform verify step (every request q = k + 1 rows; the verify graph then also outputs
the taps, engine/cuda_graphs.py) of greedy requests that all draft n tokens, the whole DSpark
draft (model/dspark.py) replays as one graph per shape (batch bucket, q, n): the window keys of
the step's committed rows, the block [anchor, noise x (B - 1)] through the stages with its
head, and the Markov head's n argmaxes left to right beside the confidence head.

Its inputs are rebuilt on the host before each replay, in one numpy pass (cache/addressing.py
`swa_step_rows`, the stages read the sliding window only) and one host-to-device copy:
* per request, the positions and SWA rows of its q rows; rows past its anchor (not committed:
  the eager drafter writes nothing for them) and padding rows write the storage's scratch page;
* per request, its anchor: the token x_{t+1}, the position t and the window (t - W, t] as paged
  rows (padding rows: an empty window, so they attend to their own block only).
The step's taps are copied into a static buffer. With `capture=False` the same padded draft
runs eagerly, from the same buffers (the CPU tests).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ...cache.addressing import Scratch, SeqChunk, StepShape, swa_step_rows
from ...cache.layout import SWA_PAGE_TOKENS
from ...model.dspark import markov_drafts, run_block, write_window
from ...ops.paged import PagedRows
from ..cuda_graphs import MAX_GRAPHS, batch_bucket
from ..upload import HostToDevice
from .draft_graphs import capture_graph, copy_verify_rows, split_flat


class DSparkGraphs:
    def __init__(self, model, storage, max_bs: int, max_q: int, capture: bool, h2d: HostToDevice):
        """max_q: the most rows a request's step has in a graph (k + 1: a verify step; the draft
        after a prefill chunk runs eagerly, or every prompt length would make a graph)."""
        self.model, self.storage, self.max_bs, self.capture, self.h2d = model, storage, max_bs, capture, h2d
        self.max_q = max_q
        self.layout = storage.layout
        self.scratch = Scratch(storage.scratch_page, storage.scratch_swa_page, storage.scratch_slot)
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def accepts(self, works) -> bool:
        """A batch bucket of completing chunks of the same q <= max_q rows, at least one drafting,
        every drafting request greedy. (Requests that draft nothing, e.g. one token from their
        end, still write their window keys: they need not bar the graph.)"""
        if not works or batch_bucket(len(works), self.max_bs) is None:
            return False
        q = len(works[0].tokens)
        return (q <= self.max_q and any(w.num_drafts > 0 for w in works)
                and all(len(w.tokens) == q and w.anchor >= 0 and (w.num_drafts == 0 or w.request.params.is_greedy)
                        for w in works))

    @torch.inference_mode()
    def run(self, works, taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """works (accepted), taps [T, n_taps * H] of the verify step -> (drafts [R, n] long,
        confidence logits [R, n]) on the device, n = the most drafts a work wants: rows of the
        graph's outputs."""
        R, q, n = len(works), len(works[0].tokens), max(w.num_drafts for w in works)
        packed, shapes = self._inputs(works, q)
        key = (shapes[0].seqs, q, n)
        graph, flat, taps_in, out, static = self._graph(key, packed, shapes, taps)
        self.h2d.upload_into(flat, [torch.from_numpy(packed)])     # everything a step changes, in one copy
        copy_verify_rows(taps_in, taps, works, q, self.h2d)
        if graph is not None:
            graph.replay()
        else:                                     # capture=False: the graph's body, from the same buffers
            out = self._draft(static, taps_in, n)
        drafts, conf = out
        return drafts[:R], conf[:R]

    def _inputs(self, works, q: int) -> tuple[np.ndarray, list[StepShape]]:
        """(the packed int64 inputs a step changes, in `_bind`'s order; the two groups' shapes)."""
        B, W = batch_bucket(len(works), self.max_bs), self.layout.cfg.sliding_window
        rows = [SeqChunk(w.slot, w.start, w.tokens, w.page_table, w.swa_table, logits=q) for w in works]
        anchors = [SeqChunk(w.slot, w.start + w.anchor, [w.tokens[w.anchor]], w.page_table, w.swa_table, logits=1)
                   for w in works]
        shapes = [StepShape(B, t, 0, 0, (W + t - 2) // SWA_PAGE_TOKENS + 2) for t in (q, 1)]
        (_, pos, write, *_), (tok, t, _, pages, req, lo, hi) = swa_step_rows([rows, anchors], self.layout, shapes,
                                                                           self.scratch)
        anchor = np.array([w.anchor for w in works])
        late = np.zeros((B, q), bool)
        late[:len(works)] = np.arange(q)[None, :] > anchor[:, None]        # rows not committed
        write[late.ravel()] = self.scratch.swa_page * self.layout.swa_pitch
        return np.concatenate([pos, write, tok, t, pages.ravel(), req, lo, hi]), shapes

    def _bind(self, view: torch.Tensor, shapes: list[StepShape]):
        """The graph's static inputs as views of its flat buffer: (positions [B*q], SWA write
        rows [B*q], anchor tokens [B], anchor positions t [B], windows: PagedRows of [B] rows)."""
        (B, q), cols = (shapes[0].seqs, shapes[0].tokens), shapes[1].swa_pages
        pos, write, tok, t, pages, req, lo, hi = split_flat(view, [(B * q,), (B * q,), (B,), (B,), (B, cols),
                                                                   (B,), (B,), (B,)])
        window = PagedRows(pages, req, lo, hi, per_page=SWA_PAGE_TOKENS, pitch=self.layout.swa_pitch,
                           width=self.layout.cfg.sliding_window)
        return pos, write, tok, t, window

    def _draft(self, static, taps: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's body: window keys, block, Markov and confidence heads -> (drafts [B, n],
        confidence logits [B, n])."""
        pos, write, tok, t, window = static
        kv = self.storage.layers
        write_window(self.model, taps, pos, write, kv)
        logits, x = run_block(self.model, tok, t + 1, window.dense(), kv)
        drafts, _, conf = markov_drafts(self.model, logits, x, tok, n, self._pick)
        return drafts, conf

    def _pick(self, logits: torch.Tensor, i: int) -> tuple[torch.Tensor, None]:
        """Draft i of every row from its Markov-corrected logits [B, V]: the argmax (greedy)."""
        return logits.argmax(dim=-1), None

    def _graph(self, key: tuple, packed: np.ndarray, shapes: list[StepShape], taps: torch.Tensor):
        """(graph or None without capture, its flat input buffer, its taps buffer, its outputs or
        None, its static inputs): made on a key's first step, kept (LRU, MAX_GRAPHS) for the next."""
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        flat, (view,) = self.h2d.allocate([torch.from_numpy(packed)])
        static = self._bind(view, shapes)
        B, q, n = key
        taps_in = torch.zeros(B * q, taps.shape[1], dtype=taps.dtype, device=taps.device)
        if not self.capture:
            self.graphs[key] = (None, flat, taps_in, None, static)
        else:
            graph, out = capture_graph(lambda: self._draft(static, taps_in, n), self.mempool)
            self.graphs[key] = (graph, flat, taps_in, out, static)
        return self.graphs[key]
