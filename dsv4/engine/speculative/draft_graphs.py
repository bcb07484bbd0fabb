"""The MTP draft of a uniform step as one CUDA graph (docs/architecture.md, "Speculative decoding").

After a uniform verify step (every request q = k + 1 rows: engine/cuda_graphs.py) of greedy
requests that all draft n tokens, the whole draft — the catch-up over the q positions, the
gather of each request's anchor row, n argmaxes and the n - 1 chained one-token steps, each
feeding its argmax to the next inside the graph — replays as one graph per shape (batch
bucket, q, n). Its inputs are rebuilt on the host before each replay, in one numpy pass and
one host-to-device copy: the padded sliding-window addressing of the catch-up and of every
chain step (positions depend on how many drafts each request accepted; the MTP blocks read no
compressed entries, cache/addressing.py `swa_step_rows`) and the anchor rows; the target
streams are copied into a static buffer. Padding rows read nothing and write to the storage's scratch units, as in the
verify graphs. Requests that sample (drafts drawn from q, with their generators) take the
eager path. With `capture=False` the same padded draft runs eagerly (the CPU tests).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import torch

from ...cache.addressing import Scratch, SeqChunk, StepShape, swa_batch, swa_step_rows
from ...cache.layout import SWA_PAGE_TOKENS
from ...model.forward_batch import ForwardBatch
from ..cuda_graphs import MAX_GRAPHS, batch_bucket
from ..upload import HostToDevice, upload_tree


class DraftGraphs:
    def __init__(self, model, storage, max_bs: int, max_q: int, capture: bool, h2d: HostToDevice):
        """max_q: the most catch-up rows a request has in a graph (k + 1: a verify step; the
        draft after a prefill chunk runs eagerly, or every prompt length would make a graph)."""
        self.model, self.storage, self.max_bs, self.capture, self.h2d = model, storage, max_bs, capture, h2d
        self.max_q = max_q
        self.layout, self.blocks = storage.layout, list(model.mtp)
        self.scratch = Scratch(storage.scratch_page, storage.scratch_swa_page, storage.scratch_slot)
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def accepts(self, works) -> bool:
        return uniform_greedy(works, self.max_bs) and len(works[0].tokens) <= self.max_q

    @torch.inference_mode()
    def run(self, works, hidden: torch.Tensor) -> list[tuple[torch.Tensor, None]]:
        """-> per work, (drafts [n] long on the device, None): rows of one [B, n] tensor."""
        R, q, n = len(works), len(works[0].tokens), works[0].num_drafts
        rows, anchors, shapes = self._inputs(works, q, n)
        key = (shapes[0].seqs, q, n)
        packed = torch.from_numpy(np.concatenate([a.ravel() for group in rows for a in group] + [anchors]))
        graph, flat, streams, drafts, static = self._graph(key, rows, anchors, shapes, packed, hidden)
        self.h2d.upload_into(flat, [packed])      # everything a step changes, in one copy
        copy_verify_rows(streams, hidden, works, q, self.h2d)
        if graph is not None:
            graph.replay()
        else:                                     # capture=False: the graph's body, from the same buffers
            drafts = self._draft(static, streams)
        return [(drafts[i], None) for i in range(R)]

    def _inputs(self, works, q: int, n: int):
        """(swa_step_rows of the catch-up and of each chain step, anchor rows [B], their shapes),
        padded to the graph's batch bucket B. The batches address the sliding window only (the
        MTP blocks read nothing else): their shapes do not depend on the context length."""
        B, W = batch_bucket(len(works), self.max_bs), self.layout.cfg.sliding_window
        catch = [SeqChunk(w.slot, w.start, w.tokens, w.page_table, w.swa_table, logits=q) for w in works]
        chains = [[SeqChunk(w.slot, w.start + w.anchor + j, [0], w.page_table, w.swa_table, logits=1) for w in works]
                  for j in range(1, n)]
        shapes = [StepShape(B, t, 0, 0, (W + t - 2) // SWA_PAGE_TOKENS + 2) for t in [q] + [1] * len(chains)]
        anchors = np.zeros(B, np.int64)
        anchors[:len(works)] = [i * q + w.anchor for i, w in enumerate(works)]
        return swa_step_rows([catch, *chains], self.layout, shapes, self.scratch), anchors, shapes

    def _draft(self, static, streams: torch.Tensor) -> torch.Tensor:
        """The graph's body: catch-up, anchors, n argmaxes and n - 1 chain steps -> drafts [B, n]."""
        catch, chains, anchors = static
        kv, model = self.storage.layers, self.model
        h = self.blocks[0].draft(model, streams, catch, kv)[anchors]
        drafts = [self.blocks[0].logits(model, h).argmax(dim=-1)]
        for j, fb in enumerate(chains, 1):
            block = self.blocks[j % len(self.blocks)]
            fb.token_ids.copy_(drafts[-1])
            h = block.draft(model, h, fb, kv)
            drafts.append(block.logits(model, h).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def _graph(self, key: tuple, rows, anchors: np.ndarray, shapes, packed: torch.Tensor, hidden: torch.Tensor):
        """(graph or None without capture, its flat input buffer, its streams buffer, its drafts
        [B, n] or None, its static inputs): made on a key's first step, kept (LRU, MAX_GRAPHS)
        for the next ones. The static inputs' parts that a step changes are views of the flat
        buffer (`packed`'s layout); the rest, the same for every step of the key, is uploaded once."""
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key]
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        flat, (view,) = self.h2d.allocate([packed])
        batches = upload_tree(tuple(swa_batch(r, shape, self.layout) for r, shape in zip(rows, shapes)), self.h2d)
        static = _rebind(batches, split_flat(view, [a.shape for group in rows for a in group]), view[-len(anchors):])
        streams = torch.zeros(key[0] * key[1], *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
        if not self.capture:
            self.graphs[key] = (None, flat, streams, None, static)
            return self.graphs[key]
        graph, drafts = capture_graph(lambda: self._draft(static, streams), self.mempool)
        self.graphs[key] = (graph, flat, streams, drafts, static)
        return self.graphs[key]


def uniform_greedy(works, max_bs: int) -> bool:
    """Works a draft graph replays: a batch bucket of greedy requests, each with the same number
    of catch-up rows (a uniform verify step's q) and the same number n > 0 of drafts."""
    if not works or batch_bucket(len(works), max_bs) is None:
        return False
    q, n = len(works[0].tokens), works[0].num_drafts
    return n > 0 and all(len(w.tokens) == q and w.num_drafts == n and w.request.params.is_greedy for w in works)


def copy_verify_rows(dst: torch.Tensor, src: torch.Tensor, works, q: int, h2d: HostToDevice) -> None:
    """dst[:R * q] = the q rows of each work in the verify step's output src (a graph's static
    input buffer); one plain copy when the works' rows are src's first R * q, in order."""
    R = len(works)
    if all(w.hidden_row == i * q for i, w in enumerate(works)):
        dst[:R * q].copy_(src[:R * q])
    else:
        rows = h2d.upload([torch.tensor([w.hidden_row + i for w in works for i in range(q)])])[0]
        dst[:R * q].copy_(src[rows])


def capture_graph(body, pool):
    """(graph, body's outputs): `body` run twice on a side stream (allocations, autotuning; a
    draft's writes are idempotent), then captured reading and writing the same buffers."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


def split_flat(flat: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
    """Consecutive views of `flat` with these shapes."""
    out, at = [], 0
    for shape in shapes:
        n = int(np.prod(shape))
        out.append(flat[at:at + n].view(shape))
        at += n
    return out


def _rebind(batches: list[ForwardBatch], views: list[torch.Tensor], anchors: torch.Tensor):
    """(catch-up batch, chain batches, anchor rows): `batches` with the parts a step changes —
    swa_step_rows' seven per batch, in its order — replaced by `views`."""
    def one(fb: ForwardBatch, v: list[torch.Tensor]) -> ForwardBatch:
        return dataclasses.replace(fb, token_ids=v[0], positions=v[1], swa_write=v[2],
                                   swa=dataclasses.replace(fb.swa, pages=v[3], req=v[4], lo=v[5], hi=v[6]))
    bound = [one(fb, views[7 * i:7 * i + 7]) for i, fb in enumerate(batches)]
    return bound[0], tuple(bound[1:]), anchors
