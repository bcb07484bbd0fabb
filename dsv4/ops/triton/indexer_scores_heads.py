"""The lightning indexer's tiled scores kernel for a prefill chunk's paged candidates
(dsv4/ops/triton/indexer.py TILED_SCORES "heads", at HEAD_TILES), and variants of its loop over
the index heads for measuring (benchmarks/kernels/indexer_gemm.py --variants); the scores of
indexer_scores' `_scores_gemm_kernel` (dsv4/ops/triton/indexer_scores.py), the same up to fp32
rounding (the same sums in the same order: bit for bit in every measured tile).

Same contract: paged candidates (a PagedRows), the causal limit per token, the -1 tail, the
per-token fallback when a block's tokens do not share their rows. Model-dtype keys only (packed
FP8 keys and dense cand take `indexer_scores`' kernels). A program = BLOCK_T tokens x BLOCK_E
candidates, the key tile [BLOCK_E, Di] loaded once, then per head h:

    dots = q_h [BLOCK_T, Di] @ k^T [Di, BLOCK_E]; acc += ReLU(dots) * w_h[:, None]

q_h is read by pointers or as one TMA box of q viewed as [T, Hi * Di] (q_tma). Measured and left
out (docs/benchmarks.md, fourteenth session): keys as the dot's A operand, and a Gluon kernel with
the previous head's epilogue under the next head's dot. (tl.range's warp_specialize is not
offered: Triton 3.6 leaves a loop inside the block's ifs unspecialised for sm_90, and a top-level
one needs TMA for every load, keys included.)
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..paged import PagedRows, index_width
from .indexer_scores import (GEMM_TILES, _block_rows, _block_valid, _key_tile, _tokens_one_by_one, indexer_scores,
                             scores_out)


@dataclass(frozen=True)
class HeadLoopTiles:
    """Launch shape and head loop of `_scores_heads_kernel` (module docstring)."""
    block_t: int = 64           # tokens per program (>= 16)
    block_e: int = 128          # candidates per program (>= 16)
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # registers a thread; None: ptxas's choice
    q_tma: bool = False         # q_h as a TMA box (needs q[t] contiguous: stride(1) == Di, stride(2) == 1)


# the default tile: q_h a TMA box, 3 stages, ptxas's registers: 1.74 ms a 32,768-entry tile of a
# 2,048-token chunk at 900k against 2.08 for GEMM_TILES and 1.89 for this loop by pointers at 168
# registers (H100, benchmarks/kernels/indexer_gemm.py --variants, docs/benchmarks.md)
HEAD_TILES = HeadLoopTiles(64, 128, 4, 3, q_tma=True)


def heads_ok(q: torch.Tensor, keys: torch.Tensor, cand, tiles: HeadLoopTiles) -> bool:
    """Inputs the kernel takes at `tiles`: paged candidates, keys of q's dtype, Di a power of two
    >= 16, and for q by TMA q[t] contiguous ([T, Hi * Di] rows) with 16-byte aligned rows."""
    Di = q.shape[2]
    tma_ok = (q.stride(2) == 1 and q.stride(1) == Di and q.data_ptr() % 16 == 0
              and (q.stride(0) * q.element_size()) % 16 == 0)
    return (isinstance(cand, PagedRows) and keys.dtype == q.dtype and Di >= 16 and Di & (Di - 1) == 0
            and (not tiles.q_tma or tma_ok))


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T", "E0", "E", "n_eblk", "pitch", "stride_ct", "stride_ce", "stride_ot"))
def _scores_heads_kernel(q_ptr, q_desc, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr,
                         T, E0, E, HI, DI, n_eblk, scale, pitch,
                         stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
                         stride_kn, stride_kd, stride_ct, stride_ce, stride_ot,
                         HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         FP32_DOT: tl.constexpr, PER_PAGE: tl.constexpr, Q_TMA: tl.constexpr):
    # One program = tokens [t0, t0 + BLOCK_T) x candidates [e0, e0 + BLOCK_E) of the tile
    # [E0, E), written to columns e0 - E0 of out; Di == DI_P (a power of two >= 16).
    pid = tl.program_id(0)
    t0 = (pid // n_eblk) * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)                                       # [BLOCK_T]
    offs_e = E0 + (pid % n_eblk) * BLOCK_E + tl.arange(0, BLOCK_E)            # [BLOCK_E]
    t_ok, e_ok = offs_t < T, offs_e < E
    rows, shared = _block_rows(cand_ptr, req_ptr, lo_ptr, hi_ptr, offs_t.to(tl.int64), offs_e, t_ok, e_ok, pitch,
                               stride_ct, stride_ce, True, PER_PAGE)
    if shared:
        scores = tl.full([BLOCK_T, BLOCK_E], float("-inf"), tl.float32)
        # A block wholly past every token's limit (the causal -1 tail) does no dots.
        if tl.max(rows, axis=0) >= 0:
            k, _ = _key_tile(keys_ptr, rows, stride_kn, stride_kd, DI, q_ptr.dtype.element_ty, DI_P, BLOCK_E,
                             False)                                           # [BLOCK_E, DI_P], read once
            if FP32_DOT:        # fp32 or the interpreter: exact fp32 products (no tf32)
                k = k.to(tl.float32)
            kt = tl.trans(k)                                                  # [DI_P, BLOCK_E]
            # Rows past T read token T - 1 (pointers) or zeros (TMA): stored nowhere.
            t_in = tl.minimum(offs_t, T - 1).to(tl.int64)
            q_rows = q_ptr + t_in[:, None] * stride_qt + tl.arange(0, DI_P)[None, :] * stride_qd
            w_rows = w_ptr + t_in * stride_wt
            acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
            for h in range(0, HI):
                if Q_TMA:
                    q = q_desc.load([t0, h * DI])                              # [BLOCK_T, DI_P]
                else:
                    q = tl.load(q_rows + h * stride_qh)                        # [BLOCK_T, DI_P]
                if FP32_DOT:
                    q = q.to(tl.float32)
                w = tl.load(w_rows + h * stride_wh).to(tl.float32) * scale    # [BLOCK_T]
                # bf16 x bf16 products are exact in fp32 and accumulate in fp32, like the reference.
                dots = tl.dot(q, kt, input_precision="ieee")                 # [BLOCK_T, BLOCK_E]
                acc += tl.maximum(dots, 0.0) * w[:, None]
            valid = _block_valid(cand_ptr, lo_ptr, hi_ptr, offs_t, offs_e, t_ok, e_ok, rows, stride_ct, stride_ce,
                                 True)
            scores = tl.where(valid, acc, float("-inf"))
        tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_ot + (offs_e - E0)[None, :], scores,
                 mask=t_ok[:, None] & e_ok[None, :])
    else:                   # tokens of different rows (requests, windows): one by one
        _tokens_one_by_one(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr, t0, T, offs_e, e_ok, E0,
                           E, HI, DI, scale, pitch, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn,
                           stride_kd, stride_ct, stride_ce, stride_ot, HI_P, DI_P, BLOCK_T, BLOCK_E, FP32_DOT, True,
                           PER_PAGE, False)


def indexer_scores_heads(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: PagedRows,
                         tiles: HeadLoopTiles, weight_scale: float = 1.0, e0: int = 0,
                         e1: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """indexer_scores(q, weights, keys, cand, weight_scale=, e0=, e1=, out=) by
    `_scores_heads_kernel` at `tiles`: [T, e1 - e0] fp32. Inputs it does not take (heads_ok) take
    indexer_scores' tiled kernel (GEMM_TILES)."""
    import os
    T, Hi, Di = q.shape
    e1 = index_width(cand) if e1 is None else e1
    if not heads_ok(q, keys, cand, tiles):
        return indexer_scores(q, weights, keys, cand, weight_scale=weight_scale, e0=e0, e1=e1, tiles=GEMM_TILES,
                              out=out)
    scores = scores_out(out, T, e1 - e0, q.device)
    if T == 0 or e1 <= e0:
        return scores
    req, lo, hi = cand.req.contiguous(), cand.lo.contiguous(), cand.hi.contiguous()
    # q viewed as [T, Hi * Di]: head h of tokens t0.. is the box at [t0, h * Di].
    q_desc = TensorDescriptor(q, [T, Hi * Di], [q.stride(0), 1], [tiles.block_t, Di]) if tiles.q_tma else None
    fp32_dot = q.dtype not in (torch.bfloat16, torch.float16) or os.environ.get("TRITON_INTERPRET") == "1"
    n_eblk = triton.cdiv(e1 - e0, tiles.block_e)
    table = cand.pages
    _scores_heads_kernel[(triton.cdiv(T, tiles.block_t) * n_eblk,)](
        q, q_desc, weights, keys, table, req, lo, hi, scores, T, e0, e1, Hi, Di, n_eblk,
        Di ** -0.5 * weight_scale, cand.pitch, q.stride(0), q.stride(1), q.stride(2), weights.stride(0),
        weights.stride(1), keys.stride(0), keys.stride(1), table.stride(0), table.stride(1), scores.stride(0),
        HI_P=max(16, triton.next_power_of_2(Hi)), DI_P=Di, BLOCK_T=tiles.block_t, BLOCK_E=tiles.block_e,
        FP32_DOT=fp32_dot, PER_PAGE=cand.per_page, Q_TMA=tiles.q_tma, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **({} if tiles.maxnreg is None else {"maxnreg": tiles.maxnreg}))
    return scores
