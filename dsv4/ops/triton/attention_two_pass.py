"""Sparse shared-KV attention in two passes through a probability buffer (Triton): a prefill
chunk over a long slot list (an HCA layer deep in a prompt, docs/architecture.md "A step's
addressing"). Same contract as `dsv4.ops.attention.sparse_attention` (the definition) for
sources that are all PagedRows over pools of q's dtype.

Rows are (token, head) pairs, BLOCK_T tokens x H_BLOCK heads a tile; a row's slot k is item
lo_t + k of its request (PagedRows' dense form, k < n_t = min(hi_t - lo_t, width)). The tokens
of a tile that share (request, lo) form a group and read the same pool rows for the same slots
(every token of a chunk on the history: one group; on the window, a group a token); a tile does
one pass a group.
  1. scores, a launch a source (grid: slot tiles of BLOCK_N x row tiles): S = q k^T over D in
     BLOCK_D steps (a plain GEMM: no [rows, D] accumulator), then per row and slot tile the max
     m_j, the sum l_j of exp2(s - m_j) and P = exp2(s - m_j) in q's dtype into the source's
     buffer [T, H, slots];
  2. values (grid: row tiles x D_PARTS channel parts): the online softmax over every source's
     slot tiles with their (m_j, l_j), acc += exp2(m_j - m) P K (K = V: the part's channels
     only), the sink in the denominator, out normalised.
Every S element is computed once (no 1.5x of a channel split: pass 2 reads P instead), and q
is never held whole; the price is P's round trip (2 bytes a row and slot). Tokens go
TOKENS_PER_PASS at a time, which bounds the buffers (at 900k: 512 tokens x 64 heads x 7,168
slots x 2 bytes = 470 MB for the history).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged import PagedRows
from .attention_rows import INTERPRETING, LOG2E
from .attention_shared import _store_rows, _tile_rows, paged_args, supports_shared, tile_heads

# (block_t, h_block, block_n, block_d, warps, stages) of pass 1; (block_t, h_block, block_n,
# d_parts, warps, stages) of pass 2 (its own row tiles: P is by row; its block_n divides pass
# 1's); tokens a pass. sm_90 (Triton 3.6): 255 registers, no spills, 96 KB; 255, none, 81 KB.
# Guesses, unmeasured on the H200 when written: `python -m benchmarks.kernels.attention --variants`.
SCORE_TILES = (2, 64, 128, 64, 8, 3)
VALUE_TILES = (2, 64, 64, 2, 8, 3)
TOKENS_PER_PASS = 512


@triton.jit
def _slot_rows(page_row, start, n, lo, pitch, BLOCK: tl.constexpr, PER_PAGE: tl.constexpr):
    """Pool rows [BLOCK] int64 of slots start + [0, BLOCK) (items lo + slot) of one request's
    page-table row, -1 past n or on a -1 page; every load masked (start may be past n)."""
    slot = start + tl.arange(0, BLOCK)
    e = lo + slot
    page = tl.load(page_row + e // PER_PAGE, mask=slot < n, other=-1).to(tl.int32)
    return tl.where((slot < n) & (page >= 0), page * pitch + e % PER_PAGE, -1).to(tl.int64)


@triton.jit
def _groups(req_ptr, lo_ptr, hi_ptr, t0, T, W, row_ok, row_tok, BLOCK_T: tl.constexpr):
    """Per row: its token's lo, slot count n (<= W) and group (the first token of the tile with
    the same request and lo)."""
    tok = t0 + row_tok
    req = tl.load(req_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    lo = tl.load(lo_ptr + tok, mask=row_ok, other=0).to(tl.int32)
    n = tl.minimum(tl.maximum(tl.load(hi_ptr + tok, mask=row_ok, other=0).to(tl.int32) - lo, 0), W)
    js = tl.arange(0, BLOCK_T)
    js_ok = t0 + js < T
    blk_req = tl.load(req_ptr + t0 + js, mask=js_ok, other=-1).to(tl.int32)
    blk_lo = tl.load(lo_ptr + t0 + js, mask=js_ok, other=0).to(tl.int32)
    same = (req[:, None] == blk_req[None, :]) & (lo[:, None] == blk_lo[None, :]) & js_ok[None, :]
    return lo, n, tl.min(tl.where(same, js[None, :], BLOCK_T), axis=1)


# per-step sizes are not specialised: one compiled variant for every step shape (P's row length
# is tiles * BLOCK_N in the kernel: a known multiple of BLOCK_N, so its rows keep 16-byte accesses)
@triton.jit(do_not_specialize=("T", "W", "stride_p", "pitch", "tiles"))
def _scores_kernel(q_ptr, kv_ptr, pages_ptr, req_ptr, lo_ptr, hi_ptr, p_ptr, m_ptr, l_ptr,
                   T, H, W, qk_scale, stride_qt, stride_qh, stride_kv, stride_p, pitch,
                   tiles,                            # P [T, H, tiles * BLOCK_N], m, l [T, H, tiles]
                   D: tl.constexpr, BLOCK_T: tl.constexpr, H_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PER_PAGE: tl.constexpr, FP32_DOT: tl.constexpr):
    j = tl.program_id(0)                             # slot tile (fastest: a row tile's q stays in L2)
    t0, row_tok, heads, row_ok = _tile_rows(T, H, BLOCK_T, H_BLOCK, tl.program_id(1))
    lo, n, group = _groups(req_ptr, lo_ptr, hi_ptr, t0, T, W, row_ok, row_tok, BLOCK_T)
    slot = j * BLOCK_N + tl.arange(0, BLOCK_N)
    q_row = q_ptr + (t0 + row_tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    out_row = (t0 + row_tok).to(tl.int64) * H + heads                               # [M] rows of [T, H]
    slots = tiles * BLOCK_N
    d = tl.arange(0, BLOCK_D)
    for g in range(BLOCK_T):        # one group a pass (one [M, BLOCK_N] tile live); its rows stored
        member = row_ok & (group == g)
        n_g = tl.max(tl.where(member, n, 0), axis=0)
        if j * BLOCK_N < n_g:       # the group has slots here (pass 2 reads no other (row, tile))
            lo_g = tl.load(lo_ptr + t0 + g, mask=t0 + g < T, other=0).to(tl.int32)
            page_row = pages_ptr + tl.load(req_ptr + t0 + g, mask=t0 + g < T, other=0).to(tl.int64) * stride_p
            rows = _slot_rows(page_row, j * BLOCK_N, n_g, lo_g, pitch, BLOCK_N, PER_PAGE)           # [BLOCK_N]
            key_ok = rows >= 0
            s = tl.zeros([BLOCK_T * H_BLOCK, BLOCK_N], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                qd = tl.load(q_row + d0 + d[None, :], mask=member[:, None] & (d0 + d < D)[None, :], other=0.0)
                kd = tl.load(kv_ptr + rows[:, None] * stride_kv + d0 + d[None, :],
                             mask=key_ok[:, None] & (d0 + d < D)[None, :], other=0.0)
                if FP32_DOT:
                    qd, kd = qd.to(tl.float32), kd.to(tl.float32)
                s = tl.dot(qd, tl.trans(kd), acc=s, input_precision="ieee" if FP32_DOT else "tf32")
            s = tl.where(key_ok[None, :] & (slot[None, :] < n[:, None]), s * qk_scale, float("-inf"))
            m = tl.max(s, axis=1)                                                       # -inf: no slot
            p = tl.exp2(s - tl.where(m == float("-inf"), 0.0, m)[:, None])              # masked: 0
            # the whole tile (0 past a row's n): a row-only mask keeps the stores vectorised
            tl.store(p_ptr + out_row[:, None] * slots + slot[None, :], p.to(p_ptr.dtype.element_ty),
                     mask=member[:, None])
            tl.store(m_ptr + out_row * tiles + j, m, mask=member)
            tl.store(l_ptr + out_row * tiles + j, tl.sum(p, axis=1), mask=member)


@triton.jit
def _values_source(m, l, acc, p_ptr, m_ptr, l_ptr, tiles, kv_ptr, pages_ptr, req_ptr, lo_ptr, hi_ptr, t0, T, H,
                   W, stride_kv, stride_p, pitch, row_tok, row_ok, heads, col, col_ok, BLOCK_T: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr, PER_PAGE: tl.constexpr, FP32_DOT: tl.constexpr):
    """One source's pass 2 for the program's rows: its P [T, H, tiles * BLOCK_N] and per-tile m,
    l [T, H, tiles] from pass 1, BLOCK_NB slots a step, into the running m, l [M] and acc
    [M, BLOCK_DV] (channels col of the pool rows) -> (m, l, acc)."""
    lo, n, group = _groups(req_ptr, lo_ptr, hi_ptr, t0, T, W, row_ok, row_tok, BLOCK_T)
    out_row = (t0 + row_tok).to(tl.int64) * H + heads
    slots = tiles * BLOCK_N                          # P's row length: a known multiple of BLOCK_N
    for g in range(BLOCK_T):
        member = row_ok & (group == g)
        n_g = tl.max(tl.where(member, n, 0), axis=0)
        lo_g = tl.load(lo_ptr + t0 + g, mask=t0 + g < T, other=0).to(tl.int32)
        page_row = pages_ptr + tl.load(req_ptr + t0 + g, mask=t0 + g < T, other=0).to(tl.int64) * stride_p
        for j in range(0, tl.cdiv(n_g, BLOCK_NB)):     # steps of BLOCK_NB slots within pass 1's tiles
            slot = j * BLOCK_NB + tl.arange(0, BLOCK_NB)
            rows = _slot_rows(page_row, j * BLOCK_NB, n_g, lo_g, pitch, BLOCK_NB, PER_PAGE)
            k = tl.load(kv_ptr + rows[:, None] * stride_kv + col[None, :],
                        mask=(rows >= 0)[:, None] & col_ok[None, :], other=0.0)     # [BLOCK_NB, BLOCK_DV]
            tile = j * BLOCK_NB // BLOCK_N
            written = member & (tile * BLOCK_N < n)      # by pass 1, whole (0 past n): a row-only mask
            p = tl.load(p_ptr + out_row[:, None] * slots + slot[None, :], mask=written[:, None], other=0.0)
            m_j = tl.load(m_ptr + out_row * tiles + tile, mask=written, other=float("-inf"))
            l_j = tl.load(l_ptr + out_row * tiles + tile, mask=written & (j * BLOCK_NB % BLOCK_N == 0),
                          other=0.0)                                                # once a tile
            m_new = tl.maximum(m, m_j)
            alpha = tl.exp2(m - m_new)
            beta = tl.exp2(m_j - m_new)                                             # -inf (no slot): 0
            l = l * alpha + beta * l_j
            # P rescaled to the running max before the dot (exp2(s - m), as a one-pass kernel's):
            # the dot then accumulates into acc, no second [M, BLOCK_DV] fp32 tile
            p = (p.to(tl.float32) * beta[:, None]).to(tl.float32 if FP32_DOT else k.dtype)
            if FP32_DOT:
                k = k.to(tl.float32)
            acc = tl.dot(p, k, acc=acc * alpha[:, None], input_precision="ieee" if FP32_DOT else "tf32")
            m = m_new
    return m, l, acc


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T", "W0", "W1", "stride_p0", "stride_p1", "pitch0", "pitch1", "tiles0", "tiles1"))
def _values_kernel(sink_ptr, out_ptr, p0_ptr, m0_ptr, l0_ptr, p1_ptr, m1_ptr, l1_ptr,  # pass 1's, a source
                   kv0_ptr, pages0_ptr, req0_ptr, lo0_ptr, hi0_ptr,   # source 0 (TWO: else unused)
                   kv1_ptr, pages1_ptr, req1_ptr, lo1_ptr, hi1_ptr,
                   T, H, W0, W1, tiles0, tiles1, stride_ot, stride_oh,
                   stride_kv0, stride_p0, pitch0, stride_kv1, stride_p1, pitch1,
                   DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr, H_BLOCK: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_NB: tl.constexpr, D_PARTS: tl.constexpr, TWO: tl.constexpr,
                   PER_PAGE0: tl.constexpr, PER_PAGE1: tl.constexpr, FP32_DOT: tl.constexpr):
    pid = tl.program_id(0)                           # parts of a row tile adjacent (P read twice from L2)
    t0, row_tok, heads, row_ok = _tile_rows(T, H, BLOCK_T, H_BLOCK, pid // D_PARTS)
    c = tl.arange(0, BLOCK_DV)
    col_ok = c < DV
    col = pid % D_PARTS * DV + c                     # this program's channels
    sink = tl.load(sink_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    m = sink                                         # [M] running max (log2 units), >= sink
    l = tl.zeros([BLOCK_T * H_BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * H_BLOCK, BLOCK_DV], dtype=tl.float32)
    if TWO:
        m, l, acc = _values_source(m, l, acc, p0_ptr, m0_ptr, l0_ptr, tiles0, kv0_ptr, pages0_ptr, req0_ptr,
                                   lo0_ptr, hi0_ptr, t0, T, H, W0, stride_kv0, stride_p0, pitch0, row_tok, row_ok,
                                   heads, col, col_ok, BLOCK_T, BLOCK_N, BLOCK_NB, PER_PAGE0, FP32_DOT)
    m, l, acc = _values_source(m, l, acc, p1_ptr, m1_ptr, l1_ptr, tiles1, kv1_ptr, pages1_ptr, req1_ptr,
                               lo1_ptr, hi1_ptr, t0, T, H, W1, stride_kv1, stride_p1, pitch1, row_tok, row_ok,
                               heads, col, col_ok, BLOCK_T, BLOCK_N, BLOCK_NB, PER_PAGE1, FP32_DOT)
    _store_rows(out_ptr, acc, m, l, sink, t0, row_tok, heads, row_ok, col, col_ok, stride_ot, stride_oh)


def two_pass_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, PagedRows]], sinks: torch.Tensor,
                       scale: float, *, score_tiles: tuple | None = None, value_tiles: tuple | None = None,
                       tokens_per_pass: int | None = None) -> torch.Tensor:
    """q [T, H, D]; sources [(kv [N, D], PagedRows)] (one or two, each through its own buffer);
    sinks [H] -> out [T, H, D] in q's dtype, as `dsv4.ops.attention.sparse_attention`. Tiles:
    SCORE_TILES / VALUE_TILES / TOKENS_PER_PASS by default (fp32, checks only: 16-row tiles).
    No host sync (CUDA graphs)."""
    assert supports_shared(q, sources, sinks), "two_pass_attention (triton): unsupported inputs"
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    small = q.dtype == torch.float32
    block_t, h_block, block_n, block_d, warps_a, stages_a = score_tiles or (
        (2, 8, 16, 16, 4, 1) if small else SCORE_TILES)
    block_tb, h_block_b, block_nb, d_parts, warps_b, stages_b = value_tiles or (
        (2, 8, 16, 2, 4, 1) if small else VALUE_TILES)
    assert d_parts in (1, 2) and D % d_parts == 0 and block_nb >= 16 and block_n % block_nb == 0
    h_block, h_block_b = tile_heads(block_t, h_block, H), tile_heads(block_tb, h_block_b, H)
    q = q if q.stride(2) == 1 else q.contiguous()
    sinks = sinks.contiguous()
    chunk = min(tokens_per_pass or TOKENS_PER_PASS, T)
    paged = [paged_args(kv, idx) for kv, idx in sources]
    tiles = [max(1, triton.cdiv(idx.width, block_n)) for _, idx in sources]     # slot tiles a row
    buffers = [(torch.empty((chunk, H, n * block_n), device=q.device, dtype=q.dtype),
                *torch.empty((2, chunk, H, n), device=q.device, dtype=torch.float32)) for n in tiles]
    for a in range(0, T, chunk):        # token views: the kernels index tokens from the view's 0
        b = min(a + chunk, T)
        views = [(kv, pages, req[a:b], lo[a:b], hi[a:b]) for kv, pages, req, lo, hi in paged]
        for (kv, pages, req, lo, hi), (_, idx), n, (p, m, l) in zip(views, sources, tiles, buffers):
            _scores_kernel[(n, triton.cdiv(b - a, block_t) * triton.cdiv(H, h_block))](
                q[a:b], kv, pages, req, lo, hi, p, m, l, b - a, H, idx.width, scale * LOG2E.value,
                q.stride(0), q.stride(1), kv.stride(0), pages.stride(0), idx.pitch, n,
                D=D, BLOCK_T=block_t, H_BLOCK=h_block, BLOCK_N=block_n, BLOCK_D=block_d, PER_PAGE=idx.per_page,
                FP32_DOT=small or INTERPRETING, num_warps=warps_a, num_stages=stages_a)
        (kv0, pages0, req0, lo0, hi0), (kv1, pages1, req1, lo1, hi1) = views[0], views[-1]
        (w0, w1), (n0, n1), (b0, b1) = (sources[0][1], sources[-1][1]), (tiles[0], tiles[-1]), (buffers[0], buffers[-1])
        _values_kernel[(triton.cdiv(b - a, block_tb) * triton.cdiv(H, h_block_b) * d_parts,)](
            sinks, out[a:b], *b0, *b1, kv0, pages0, req0, lo0, hi0, kv1, pages1, req1, lo1, hi1,
            b - a, H, w0.width, w1.width, n0, n1, out.stride(0), out.stride(1),
            kv0.stride(0), pages0.stride(0), w0.pitch, kv1.stride(0), pages1.stride(0), w1.pitch,
            DV=D // d_parts, BLOCK_DV=triton.next_power_of_2(D // d_parts), BLOCK_T=block_tb, H_BLOCK=h_block_b,
            BLOCK_N=block_n, BLOCK_NB=block_nb, D_PARTS=d_parts, TWO=len(sources) == 2, PER_PAGE0=w0.per_page,
            PER_PAGE1=w1.per_page, FP32_DOT=small or INTERPRETING, num_warps=warps_b, num_stages=stages_b)
    return out
