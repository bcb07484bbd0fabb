"""Decode steps replayed as CUDA graphs (DESIGN §5).

A decode-only step (every sequence adds one token and samples) is padded to fixed shapes —
batch B from BATCH_BUCKETS, causal-entry widths E4/E128 rounded up by `width_bucket` — and
run through a graph captured once per shape. The step's index tensors are copied into the
graph's static buffers before each replay, so changed page tables, SWA slots and ring rows
are picked up every step. Padding rows point at the pools' scratch page / SWA page / ring
slot (written, never read) and have no keys (all −1): their outputs are discarded.

With `capture=False` the same padded step runs eagerly: that is how the padding is tested on
machines without CUDA.
"""
from __future__ import annotations

import torch

from ..cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS
from ..config import CSA_RATIO, HCA_RATIO
from ..model.forward_batch import CompressPlan, ForwardBatch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MIN_WIDTH = 16


def batch_bucket(n: int, max_bs: int) -> int | None:
    return next((b for b in BATCH_BUCKETS if n <= b <= max_bs), None)


def width_bucket(n: int) -> int:
    """Powers of two up to 512, then multiples of 512: few shapes, little padding."""
    if n <= 512:
        return max(MIN_WIDTH, 1 << max(n - 1, 0).bit_length())
    return -(-n // 512) * 512


class DecodeGraphs:
    def __init__(self, model, pools, max_bs: int, capture: bool):
        self.model, self.pools, self.max_bs, self.capture = model, pools, max_bs, capture
        self.layout = pools.layout
        self.graphs: dict[tuple, tuple] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None

    def accepts(self, seq_chunks) -> bool:
        return (0 < len(seq_chunks) <= self.max_bs and batch_bucket(len(seq_chunks), self.max_bs) is not None
                and all(len(s.token_ids) == 1 and s.logits == "last" for s in seq_chunks))

    @torch.inference_mode()
    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """fb: the step's batch built on the CPU -> fp32 logits [R, vocab] of its R rows."""
        real = fb.num_tokens
        key = (batch_bucket(real, self.max_bs), width_bucket(fb.c4_cand.shape[1]),
               width_bucket(fb.c128_idx.shape[1]))
        padded = self._pad(fb, *key)
        if not self.capture:
            moved = _map(padded, lambda t: t.to(next(self.model.parameters()).device))
            return self._forward(moved)[:real]
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded)
        graph, static, out = self.graphs[key]
        _copy_into(static, padded)
        graph.replay()
        return out[:real]

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model.logits(self.model(fb, self.pools)[fb.logits_rows])

    def _capture(self, padded: ForwardBatch):
        device = next(self.model.parameters()).device
        static = _map(padded, lambda t: t.to(device))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):          # warm-up (allocations, autotuning); the step is idempotent
            for _ in range(2):
                self._forward(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(static)
        return graph, static, out

    # ---- padding ----------------------------------------------------------------------
    def _pad(self, fb: ForwardBatch, B: int, E4: int, E128: int) -> ForwardBatch:
        p, lay = self.pools, self.layout
        n = fb.num_tokens
        scratch_swa = p.scratch_swa_page * SWA_PAGE_TOKENS
        return ForwardBatch(
            token_ids=_pad_rows(fb.token_ids, B, 0), positions=_pad_rows(fb.positions, B, 0),
            swa_write=_pad_rows(fb.swa_write, B, scratch_swa),
            swa_idx=_pad_rows(fb.swa_idx, B, -1),
            c4_cand=_pad_rows(_pad_cols(fb.c4_cand, E4), B, -1),
            c128_idx=_pad_rows(_pad_cols(fb.c128_idx, E128), B, -1),
            csa=self._pad_plan(fb.csa, B, PAGE_TOKENS // CSA_RATIO, lay.csa_ring),
            hca=self._pad_plan(fb.hca, B, PAGE_TOKENS // HCA_RATIO, lay.hca_ring),
            logits_rows=torch.arange(B), seq_lens=fb.seq_lens + (1,) * (B - n))

    def _pad_plan(self, plan: CompressPlan, B: int, per_page: int, cap: int) -> CompressPlan:
        p = self.pools
        return CompressPlan(
            rows=_pad_rows(plan.rows, B, -1),
            entry_slot=_pad_rows(plan.entry_slot, B, p.scratch_page * per_page),
            entry_pos=_pad_rows(plan.entry_pos, B, 0),
            ring_dst=_pad_rows(plan.ring_dst, B, p.scratch_slot * cap),
            ring_src=_pad_rows(plan.ring_src, B, 0),
            ring_rows=plan.ring_rows)


def _pad_rows(t: torch.Tensor, rows: int, value: int) -> torch.Tensor:
    out = torch.full((rows, *t.shape[1:]), value, dtype=t.dtype)
    out[:t.shape[0]] = t
    return out


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    out = torch.full((t.shape[0], cols), -1, dtype=t.dtype)
    out[:, :t.shape[1]] = t
    return out


def _map(fb: ForwardBatch, fn) -> ForwardBatch:
    def plan(pl: CompressPlan) -> CompressPlan:
        return CompressPlan(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in pl.__dict__.items()})
    return ForwardBatch(**{k: (plan(v) if isinstance(v, CompressPlan) else fn(v) if isinstance(v, torch.Tensor)
                               else v) for k, v in fb.__dict__.items()})


def _copy_into(static: ForwardBatch, padded: ForwardBatch) -> None:
    def pairs(a, b):
        for k, v in a.__dict__.items():
            if isinstance(v, CompressPlan):
                yield from pairs(v, getattr(b, k))
            elif isinstance(v, torch.Tensor):
                yield v, getattr(b, k)
    for dst, src in pairs(static, padded):
        dst.copy_(src, non_blocking=True)
