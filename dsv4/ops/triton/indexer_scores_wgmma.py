"""The lightning indexer's tiled scores with the head loop written in Gluon for Hopper
(sm_90): the same scores as `_scores_gemm_kernel` (dsv4/ops/triton/indexer_scores.py), the
tensor cores kept busy during the per-head epilogue. For measuring on the GPU
(benchmarks/kernels/indexer_gemm.py --variants); indexer_scores' GEMM_TILES stays the default.

A program = BLOCK_T tokens x BLOCK_E candidates whose tokens share their key rows (one
request's chunk: the same (req, lo)) and whose candidates start on a page (lo + e0 a multiple
of PER_PAGE = 64, C4's index keys a page): the key tile is BLOCK_E / 64 TMA boxes of 64 pool
rows (a page's keys are contiguous rows), q_h a TMA box [BLOCK_T, Di] of q viewed as
[T, Hi * Di], STAGES heads ahead. Per head the dot q_h @ k^T [BLOCK_T, BLOCK_E] is issued
asynchronously (wgmma) and the previous head's ReLU(dots) * w is added while it runs (at most
one dot in flight: `warpgroup_mma_wait(1)`), in rounds of ROUND heads with none in flight at a
round's end (a dot in flight across the loop's back edge makes ptxas serialise every dot).

Every other block (tokens of several requests or windows, candidates off a page boundary, the
causal -1 tail) is left to a second launch: `_scores_heads_kernel` (indexer_scores_heads.py)
with SKIP_WGMMA, which makes the same choice (`wgmma_block`) and scores the rest as
`_scores_gemm_kernel` does. Both launches depend on T and the width only (CUDA-graph safe).
Gluon does not run in Triton's interpreter: this kernel is checked on the GPU only (the
benchmark's check against GEMM_TILES); the second launch's choice runs in the interpreter.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..paged import PagedRows
from .indexer_scores import GEMM_TILES, indexer_scores
from .indexer_scores_heads import HeadLoopTiles, indexer_scores_heads

KEY_PAGE = 64               # pool rows a TMA box of keys: one C4 page of index keys
BLOCK_T, BLOCK_E = 64, 128


@gluon.jit
def _block_choice(req_ptr, lo_ptr, hi_ptr, t0, eb0, T, BLOCK_T: gl.constexpr, PER_PAGE: gl.constexpr,
                  num_warps: gl.constexpr):
    """(fast, req0, lo0, widest): fast = the tokens [t0, t0 + BLOCK_T) share (req, lo), some
    column from eb0 on is within the widest range, and lo + eb0 starts a page (wgmma_block)."""
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    offs_t = t0 + gl.arange(0, BLOCK_T, layout=vec)
    t_ok = offs_t < T
    req = gl.load(req_ptr + offs_t, mask=t_ok, other=0)
    lo = gl.load(lo_ptr + offs_t, mask=t_ok, other=0).to(gl.int32)
    span = gl.where(t_ok, gl.load(hi_ptr + offs_t, mask=t_ok, other=0).to(gl.int32) - lo, 0)
    active = span > 0
    req0 = gl.max(gl.where(active, req, -1), axis=0)
    lo0 = gl.max(gl.where(active, lo, -1), axis=0)
    shared = gl.sum((active & ((req != req0) | (lo != lo0))).to(gl.int32), axis=0) == 0
    widest = gl.max(span, axis=0)
    fast = shared & (widest > eb0) & ((lo0 + eb0) % PER_PAGE == 0)
    return fast, req0, lo0, widest


@gluon.jit
def _issue(q_smem, bars, kt, dots, h, STAGES: gl.constexpr):
    """Head h's dots q_h @ k^T issued asynchronously into the registers of `dots` once q_h is in."""
    mbarrier.wait(bars.index(h % STAGES), (h // STAGES) & 1)
    return warpgroup_mma(q_smem.index(h % STAGES), kt, dots, use_acc=False, is_async=True)


@gluon.jit
def _refill(q_desc, q_smem, bars, t0, done, STAGES: gl.constexpr, HI, DI: gl.constexpr, q_bytes: gl.constexpr):
    """Head `done`'s dots are done: its stage takes q of head done + STAGES (if any)."""
    h = done + STAGES
    stage = done % STAGES
    mbarrier.expect(bars.index(stage), q_bytes, pred=h < HI)
    tma.async_copy_global_to_shared(q_desc, [t0, h * DI], bars.index(stage), q_smem.index(stage), pred=h < HI)


@gluon.jit
def _head_terms(dots, w_rows, h, stride_wh, scale):
    """ReLU(dots) * w[:, h] * scale ([BLOCK_T, BLOCK_E] fp32): head h's terms of the scores."""
    w = gl.load(w_rows + h * stride_wh).to(gl.float32) * scale
    # ReLU as a volatile asm: the compiler keeps it before the next dot into these registers
    # (else it copies them out while that dot runs, and ptxas serialises the dots)
    relu = gl.inline_asm_elementwise("max.f32 $0, $1, 0f00000000;", "=f,f", [dots], dtype=gl.float32, is_pure=False,
                                     pack=1)
    return relu * w[:, None]


# per-step sizes are not specialised: one compiled variant for every step shape
@gluon.jit(do_not_specialize=("T", "E0", "E", "n_eblk", "pitch", "stride_ct", "stride_ce", "stride_ot"))
def _scores_wgmma_kernel(q_desc, k_desc, w_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr,
                         T, E0, E, HI, n_eblk, scale, pitch, stride_wt, stride_wh, stride_ct, stride_ce, stride_ot,
                         BLOCK_T: gl.constexpr, BLOCK_E: gl.constexpr, DI: gl.constexpr, PER_PAGE: gl.constexpr,
                         STAGES: gl.constexpr, ROUND: gl.constexpr, num_warps: gl.constexpr):
    # One program = tokens [t0, t0 + BLOCK_T) x candidates [eb0, eb0 + BLOCK_E) of the tile
    # [E0, E), written to columns eb0 - E0 of out, when the block is fast (_block_choice).
    pid = gl.program_id(0)
    t0 = (pid // n_eblk) * BLOCK_T
    eb0 = E0 + (pid % n_eblk) * BLOCK_E
    fast, req0, lo0, widest = _block_choice(req_ptr, lo_ptr, hi_ptr, t0, eb0, T, BLOCK_T, PER_PAGE, num_warps)
    if fast:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, BLOCK_E, 16])
        rows_l: gl.constexpr = gl.SliceLayout(1, mma)                       # [BLOCK_T] vectors
        cols_l: gl.constexpr = gl.SliceLayout(0, mma)                       # [BLOCK_E] vectors
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_T, DI], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_E, DI], k_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES + 1):
            mbarrier.init(bars.index(i), count=1)
        # keys: page p of the block is pool rows page * pitch .. + PER_PAGE (zeros past the table: masked below)
        key_bar = bars.index(STAGES)
        mbarrier.expect(key_bar, BLOCK_E * DI * 2)
        first = (lo0 + eb0) // PER_PAGE
        for p in gl.static_range(BLOCK_E // PER_PAGE):
            page = gl.load(cand_ptr + req0 * stride_ct + (first + p) * stride_ce, mask=eb0 + p * PER_PAGE < widest,
                           other=0)
            row = (gl.maximum(page, 0) * pitch).to(gl.int32)
            tma.async_copy_global_to_shared(k_desc, [row, 0], key_bar, k_smem.slice(p * PER_PAGE, PER_PAGE))
        q_bytes: gl.constexpr = BLOCK_T * DI * 2
        for i in gl.static_range(STAGES):               # heads 0 .. STAGES - 1 (HI >= STAGES)
            mbarrier.expect(bars.index(i), q_bytes)
            tma.async_copy_global_to_shared(q_desc, [t0, i * DI], bars.index(i), q_smem.index(i))
        offs_tw = t0 + gl.arange(0, BLOCK_T, layout=rows_l)
        w_rows = w_ptr + gl.minimum(offs_tw, T - 1).to(gl.int64) * stride_wt
        kt = k_smem.permute((1, 0))                                           # [DI, BLOCK_E]
        # Two register sets for the dots, a (even heads) and b (odd heads), each dot in place
        # (use_acc=False): one is in flight while the other's epilogue runs. ptxas serialises
        # every dot when a dot's registers may be in flight across a loop's back edge, so the
        # runtime loop runs rounds of ROUND heads unrolled, none in flight at a round's end.
        mbarrier.wait(key_bar, 0)
        acc = gl.zeros([BLOCK_T, BLOCK_E], gl.float32, mma)
        dots_a = gl.zeros([BLOCK_T, BLOCK_E], gl.float32, mma)
        dots_b = gl.zeros([BLOCK_T, BLOCK_E], gl.float32, mma)
        for r in range(0, HI, ROUND):    # HI a multiple of ROUND (even)
            dots_a = _issue(q_smem, bars, kt, dots_a, r, STAGES)
            for j in gl.static_range(1, ROUND):
                if j % 2 == 1:
                    dots_b = _issue(q_smem, bars, kt, dots_b, r + j, STAGES)
                    dots_a = warpgroup_mma_wait(num_outstanding=1, deps=(dots_a, ))      # head r + j - 1
                    _refill(q_desc, q_smem, bars, t0, r + j - 1, STAGES, HI, DI, q_bytes)
                    acc += _head_terms(dots_a, w_rows, r + j - 1, stride_wh, scale)
                else:
                    dots_a = _issue(q_smem, bars, kt, dots_a, r + j, STAGES)
                    dots_b = warpgroup_mma_wait(num_outstanding=1, deps=(dots_b, ))      # head r + j - 1
                    _refill(q_desc, q_smem, bars, t0, r + j - 1, STAGES, HI, DI, q_bytes)
                    acc += _head_terms(dots_b, w_rows, r + j - 1, stride_wh, scale)
            dots_b = warpgroup_mma_wait(num_outstanding=0, deps=(dots_b, ))              # head r + ROUND - 1
            _refill(q_desc, q_smem, bars, t0, r + ROUND - 1, STAGES, HI, DI, q_bytes)
            acc += _head_terms(dots_b, w_rows, r + ROUND - 1, stride_wh, scale)
        for i in gl.static_range(STAGES + 1):
            mbarrier.invalidate(bars.index(i))
        # token t scores column e: its row exists (e within the widest range, a page) and e < its own limit
        offs_e = eb0 + gl.arange(0, BLOCK_E, layout=cols_l)
        e_ok = offs_e < E
        in_range = e_ok & (offs_e < widest)
        page = gl.load(cand_ptr + req0 * stride_ct + ((lo0 + offs_e) // PER_PAGE) * stride_ce, mask=in_range,
                       other=-1)
        t_ok = offs_tw < T
        lo = gl.load(lo_ptr + offs_tw, mask=t_ok, other=0).to(gl.int32)
        span = gl.load(hi_ptr + offs_tw, mask=t_ok, other=0).to(gl.int32) - lo
        valid = ((page >= 0) & in_range)[None, :] & (offs_e[None, :] < span[:, None])
        scores = gl.where(valid, acc, float("-inf"))
        gl.store(out_ptr + offs_tw.to(gl.int64)[:, None] * stride_ot + (offs_e - E0)[None, :], scores,
                 mask=t_ok[:, None] & e_ok[None, :])


# the second launch's tiles (the blocks this kernel leaves): the tiled kernel's loop
REST_TILES = HeadLoopTiles(BLOCK_T, BLOCK_E, 4, 2, 168)


def wgmma_ok(q: torch.Tensor, keys: torch.Tensor, cand, head_round: int) -> bool:
    """Inputs the Gluon kernel takes: paged candidates of 64-entry pages, bf16/fp16 q and keys
    of one dtype, Di 64, 128 or 256, heads a multiple of head_round (even), q[t] contiguous,
    key rows 16-byte aligned."""
    T, Hi, Di = q.shape
    return (isinstance(cand, PagedRows) and head_round % 2 == 0 and Hi % head_round == 0
            and cand.per_page == KEY_PAGE and q.dtype in (torch.bfloat16, torch.float16) and keys.dtype == q.dtype and Di in (64, 128, 256) and Hi >= 4 and q.stride(2) == 1
            and q.stride(1) == Di and (q.stride(0) * 2) % 16 == 0 and keys.stride(1) == 1
            and (keys.stride(0) * 2) % 16 == 0 and q.data_ptr() % 16 == 0 and keys.data_ptr() % 16 == 0)


def indexer_scores_wgmma(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: PagedRows,
                         weight_scale: float = 1.0, e0: int = 0, e1: int | None = None, stages: int = 3,
                         head_round: int = 2) -> torch.Tensor:
    """indexer_scores(q, weights, keys, cand, weight_scale=, e0=, e1=) by the Gluon kernel and
    the second launch (module docstring): [T, e1 - e0] fp32. stages: q's TMA buffers (heads
    ahead); head_round: heads a round of the head loop (unrolled; 2: 220 registers, 4 spills
    for sm_90). Inputs it does not take (wgmma_ok) go to indexer_scores' tiled kernel (GEMM_TILES)."""
    if not wgmma_ok(q, keys, cand, head_round):
        return indexer_scores(q, weights, keys, cand, weight_scale=weight_scale, e0=e0, e1=e1, tiles=GEMM_TILES)
    T, Hi, Di = q.shape
    e1 = cand.width if e1 is None else e1
    scores = torch.empty((T, e1 - e0), dtype=torch.float32, device=q.device)
    if T == 0 or e1 <= e0:
        return scores
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_desc = TensorDescriptor(q, [T, Hi * Di], [q.stride(0), 1], [BLOCK_T, Di],
                              gl.NVMMASharedLayout.get_default_for([BLOCK_T, Di], gdt))
    k_desc = TensorDescriptor(keys, list(keys.shape), [keys.stride(0), 1], [KEY_PAGE, Di],
                              gl.NVMMASharedLayout.get_default_for([KEY_PAGE, Di], gdt))
    req, lo, hi = cand.req.contiguous(), cand.lo.contiguous(), cand.hi.contiguous()
    n_eblk = triton.cdiv(e1 - e0, BLOCK_E)
    _scores_wgmma_kernel[(triton.cdiv(T, BLOCK_T) * n_eblk,)](
        q_desc, k_desc, weights, cand.pages, req, lo, hi, scores, T, e0, e1, Hi, n_eblk, Di ** -0.5 * weight_scale,
        cand.pitch, weights.stride(0), weights.stride(1), cand.pages.stride(0), cand.pages.stride(1),
        scores.stride(0), BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, DI=Di, PER_PAGE=KEY_PAGE, STAGES=min(stages, Hi),
        ROUND=head_round, num_warps=4)
    indexer_scores_heads(q, weights, keys, cand, REST_TILES, weight_scale=weight_scale, e0=e0, e1=e1, out=scores,
                         skip_wgmma=True)
    return scores
