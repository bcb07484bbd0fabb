"""Sparse shared-KV attention over paged ranges with key tiles shared by several tokens (Triton):
the kernel for a prefill chunk over a long slot list (an HCA layer deep in a prompt, docs/
architecture.md "A step's addressing"). Same contract as `dsv4.ops.attention.sparse_attention` (the
definition) for sources that are all PagedRows over pools of q's dtype.

Every token of a chunk of one request sees the same C128 entries [0, hi_t) (hi_t grows by one
every 128 positions) and a window of 128 consecutive positions, so BLOCK_T consecutive tokens
read nearly the same pool rows. One program takes BLOCK_T tokens x H_BLOCK heads as the
M = BLOCK_T * H_BLOCK rows of its dots (row r: token r // H_BLOCK, head r % H_BLOCK) and walks
the union of their item ranges once a source: items [min lo, max end) of the tokens of one
request, a row masked where the item is outside its own token's [lo_t, end_t), end_t = lo_t +
min(hi_t - lo_t, width) (PagedRows' dense form). Tokens of another request than token j's
first occurrence form their own group (its own page-table row, its own walk); in a prefill
chunk a block holds one group, two at a request boundary.

D_PARTS = 2 splits the output channels across two programs: each holds acc [M, D / 2] (half
the registers) and computes the full S = q k^T over all D channels itself (as its own channels
plus the other half's: 1.5x the FLOPs of one program). K = V: the same rows give both dots.
The sink joins the denominator only (m starts at the sink: always finite; a row with no valid
key gets 0). One program does every slot (no split: the programs are many at chunk sizes).
With `lazy`, m moves (and acc, l are rescaled) only when some row's block max exceeds it by more
than SLACK: otherwise p = exp2(s - m) <= 2^SLACK, exact in fp32 and bf16, and a step skips the
[M, BLOCK_DV] multiply (a fifth of its instructions on sm_90).

On sm_90 (Triton 3.6) every dot is a wgmma: q (loop-invariant) in shared memory, the key rows
gathered into shared memory by cp.async, num_stages - 1 blocks in flight. The next block's pool
rows are read from the page table one step ahead into registers: read inside the step, the page
gather became a copy of its own that every step waited for with the keys (no pipelining).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..paged import PagedRows
from .attention_rows import INTERPRETING, LOG2E, _block_rows

class SharedTiles(NamedTuple):
    """A tile of the kernel: block_t tokens x h_block heads a program (the M rows of its dots),
    block_k keys a step, the output channels in d_parts programs, num_warps, num_stages (key
    blocks in flight); q_regs: this program's q channels in registers (the scores' A operand)
    instead of shared memory; lazy: rescale acc only when a row's max rises past m + SLACK."""
    block_t: int
    h_block: int
    block_k: int
    d_parts: int
    num_warps: int
    num_stages: int
    q_regs: bool
    lazy: bool


# 2 tokens x 64 heads = 128 rows, acc [128, 256] fp32, 32 keys a step, 3 stages (sm_90, Triton
# 3.6: every dot a wgmma, the keys by cp.async; 255 registers, 24 B spilled outside the key loops,
# 224 KB of shared memory). Eager rescaling: 7.24 ms an HCA layer of the 2,048-token chunk at 900k
# on the H200, against 7.85 ms lazy and 9.54 ms for the per-token kernel (docs/benchmarks.md,
# twelfth session). `python -m benchmarks.kernels.attention --variants` times the others.
SHARED_TILES = SharedTiles(2, 64, 32, 2, 8, 3, q_regs=False, lazy=False)
# fp32 (checks only): 16-row tiles, 2 tokens x 8 heads, 16 keys
CHECK_TILES = SharedTiles(2, 8, 16, 2, 4, 1, q_regs=False, lazy=True)
EMPTY = tl.constexpr(2**30)     # a group's range start when it has no row (an empty walk)
SLACK = tl.constexpr(8.0)       # lazy rescaling: a row's m trails its max by <= 8 (log2 units)


@triton.jit
def _walk(q_a, q_b, m, l, acc, kv_ptr, pages_ptr, req_ptr, lo_ptr, hi_ptr, t0, T, W, stride_kv,
          stride_p, pitch, qk_scale, row_tok, row_ok, col_a, col_b, ca_ok, cb_ok,
          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAGE: tl.constexpr, D_PARTS: tl.constexpr,
          FP32_DOT: tl.constexpr, LAZY: tl.constexpr):
    """One source's keys for the program's rows: q_a [M, BLOCK_DV] (the program's channels
    col_a), q_b (the other part's channels col_b; unused when D_PARTS = 1); running m, l [M]
    (log2 units) and acc [M, BLOCK_DV] fp32 -> (m, l, acc)."""
    prec: tl.constexpr = "ieee" if FP32_DOT else "tf32"
    tok = t0 + row_tok                                                              # [M] token of each row
    req = tl.load(req_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    lo = tl.load(lo_ptr + tok, mask=row_ok, other=0).to(tl.int32)
    end = lo + tl.minimum(tl.maximum(tl.load(hi_ptr + tok, mask=row_ok, other=0).to(tl.int32) - lo, 0), W)
    # group of a row: the first token of the block with its request (rows of one group share pages)
    js = tl.arange(0, BLOCK_T)
    blk_req = tl.load(req_ptr + t0 + js, mask=t0 + js < T, other=-1).to(tl.int32)             # [BLOCK_T]
    same = (req[:, None] == blk_req[None, :]) & (t0 + js < T)[None, :]
    group = tl.min(tl.where(same, js[None, :], BLOCK_T), axis=1)                    # [M]
    for j in range(BLOCK_T):
        member = row_ok & (group == j)
        span = tl.where(member, end - lo, 0).to(tl.uint32)      # a row's items: lo + [0, span)
        first = tl.min(tl.where(member, lo, EMPTY), axis=0)
        last = tl.max(tl.where(member, end, 0), axis=0)
        page_row = pages_ptr + tl.load(req_ptr + t0 + j, mask=t0 + j < T, other=0).to(tl.int64) * stride_p
        # the next block's rows are read one step ahead into registers (a plain load: the
        # pipeliner then only stages the key rows, and never waits on a page read)
        rows = _block_rows(page_row, first, last, 0, pitch, BLOCK_K, True, PER_PAGE)    # [BLOCK_K] items
        for start in range(first, last, BLOCK_K):
            rows_next = _block_rows(page_row, start + BLOCK_K, last, 0, pitch, BLOCK_K, True, PER_PAGE)
            key_ok = rows >= 0
            item = start + tl.arange(0, BLOCK_K)
            k_a = tl.load(kv_ptr + rows[:, None] * stride_kv + col_a[None, :],
                          mask=key_ok[:, None] & ca_ok[None, :], other=0.0)        # [BLOCK_K, BLOCK_DV]
            if FP32_DOT:
                k_a = k_a.to(tl.float32)
            s = tl.dot(q_a, tl.trans(k_a), input_precision=prec)                    # [M, BLOCK_K]
            if D_PARTS == 2:
                k_b = tl.load(kv_ptr + rows[:, None] * stride_kv + col_b[None, :],
                              mask=key_ok[:, None] & cb_ok[None, :], other=0.0)
                if FP32_DOT:
                    k_b = k_b.to(tl.float32)
                s = tl.dot(q_b, tl.trans(k_b), acc=s, input_precision=prec)
            # unsigned: an item below lo wraps past every span
            valid = key_ok[None, :] & ((item[None, :] - lo[:, None]).to(tl.uint32) < span[:, None])
            if LAZY:    # scores scaled inside exp2's argument (one fma a score); qk_scale > 0
                s = tl.where(valid, s, float("-inf"))
                m_blk = tl.max(s, axis=1) * qk_scale
            else:
                s = tl.where(valid, s * qk_scale, float("-inf"))
                m_blk = tl.max(s, axis=1)
            if LAZY:    # rescale only when some row's max rose past m + SLACK: else p <= 2^SLACK
                if tl.max(m_blk - m, axis=0) > SLACK:
                    m_new = tl.maximum(m, m_blk)
                    alpha = tl.exp2(m - m_new)
                    l = l * alpha
                    acc = acc * alpha[:, None]
                    m = m_new
                p = tl.exp2(s * qk_scale - m[:, None])                              # masked: 0
                l = l + tl.sum(p, axis=1)
                acc = tl.dot(p.to(k_a.dtype), k_a, acc=acc, input_precision=prec)
            else:
                m_new = tl.maximum(m, m_blk)
                alpha = tl.exp2(m - m_new)
                p = tl.exp2(s - m_new[:, None])                                     # masked: 0
                l = l * alpha + tl.sum(p, axis=1)
                m = m_new
                acc = acc * alpha[:, None] + tl.dot(p.to(k_a.dtype), k_a, input_precision=prec)
            rows = rows_next
    return m, l, acc


@triton.jit
def _tile_rows(T, H, BLOCK_T: tl.constexpr, H_BLOCK: tl.constexpr, tile):
    """Row tile `tile` (token blocks outer, head blocks inner) -> first token, rows' token
    offset, heads, validity [M]."""
    n_hb = tl.cdiv(H, H_BLOCK)
    t0 = tile // n_hb * BLOCK_T
    r = tl.arange(0, BLOCK_T * H_BLOCK)
    row_tok = r // H_BLOCK
    heads = tile % n_hb * H_BLOCK + r % H_BLOCK
    return t0, row_tok, heads, (t0 + row_tok < T) & (heads < H)


@triton.jit
def _store_rows(out_ptr, acc, m, l, sink, t0, row_tok, heads, row_ok, col, col_ok, stride_ot, stride_oh):
    """out[token, head, col] of the tile's rows <- acc / (l + exp2(sink - m)) (the sink in the
    denominator only)."""
    out = acc / (l + tl.exp2(sink - m))[:, None]
    o_row = out_ptr + (t0 + row_tok).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(o_row + col[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T", "W0", "W1", "stride_p0", "stride_p1", "pitch0", "pitch1"))
def _shared_attn_kernel(
        q_ptr, sink_ptr, out_ptr,                          # q [T, H, D], sinks [H], out [T, H, D]
        kv0_ptr, pages0_ptr, req0_ptr, lo0_ptr, hi0_ptr,  # pools [N, D] (row stride); pages [R, P]
        kv1_ptr, pages1_ptr, req1_ptr, lo1_ptr, hi1_ptr,  # (last dim contiguous), req/lo/hi [T]
        T, H, W0, W1, qk_scale,                            # grid: cdiv(T, BLOCK_T) * cdiv(H, H_BLOCK) * D_PARTS
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv0, stride_p0, pitch0, stride_kv1, stride_p1, pitch1,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_T: tl.constexpr,
        H_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, D_PARTS: tl.constexpr, TWO: tl.constexpr,
        PER_PAGE0: tl.constexpr, PER_PAGE1: tl.constexpr, FP32_DOT: tl.constexpr, Q_REGS: tl.constexpr,
        LAZY: tl.constexpr):
    pid = tl.program_id(0)          # parts, then head blocks of one token block adjacent (L2 reuse)
    part = pid % D_PARTS
    t0, row_tok, heads, row_ok = _tile_rows(T, H, BLOCK_T, H_BLOCK, pid // D_PARTS)
    c = tl.arange(0, BLOCK_DV)
    ca_ok = c < DV
    col_a = part * DV + c                                    # this program's channels
    col_b = (1 - part) * DV + c                              # the other part's (D_PARTS = 2)
    cb_ok = ca_ok & (D_PARTS == 2)
    q_row = q_ptr + (t0 + row_tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_a = tl.load(q_row + col_a[None, :], mask=row_ok[:, None] & ca_ok[None, :], other=0.0)
    q_b = tl.load(q_row + col_b[None, :], mask=row_ok[:, None] & cb_ok[None, :], other=0.0)
    if FP32_DOT:
        q_a, q_b = q_a.to(tl.float32), q_b.to(tl.float32)
    if Q_REGS:      # times a runtime 1 (T >= 1 in every launch): no longer a load, so the scores'
        q_a = q_a * (T > 0).to(q_a.dtype)   # wgmma reads q_a from registers, not shared memory
    sink = tl.load(sink_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    m = sink                                                 # [M] running max (log2 units), >= sink
    l = tl.zeros([BLOCK_T * H_BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * H_BLOCK, BLOCK_DV], dtype=tl.float32)
    m, l, acc = _walk(q_a, q_b, m, l, acc, kv0_ptr, pages0_ptr, req0_ptr, lo0_ptr, hi0_ptr, t0, T, W0,
                      stride_kv0, stride_p0, pitch0, qk_scale, row_tok, row_ok, col_a, col_b, ca_ok, cb_ok,
                      BLOCK_T, BLOCK_K, PER_PAGE0, D_PARTS, FP32_DOT, LAZY)
    if TWO:
        m, l, acc = _walk(q_a, q_b, m, l, acc, kv1_ptr, pages1_ptr, req1_ptr, lo1_ptr, hi1_ptr, t0, T, W1,
                          stride_kv1, stride_p1, pitch1, qk_scale, row_tok, row_ok, col_a, col_b, ca_ok, cb_ok,
                          BLOCK_T, BLOCK_K, PER_PAGE1, D_PARTS, FP32_DOT, LAZY)
    _store_rows(out_ptr, acc, m, l, sink, t0, row_tok, heads, row_ok, col_a, ca_ok, stride_ot, stride_oh)


def supports_shared(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor | PagedRows]],
                    sinks: torch.Tensor) -> bool:
    """Inputs this kernel takes: one or two PagedRows sources over pools of q's dtype and width
    (rows contiguous), q [T, H, D] fp32/fp16/bf16, sinks [H]."""
    return (q.dim() == 3 and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and 1 <= len(sources) <= 2 and sinks.shape == (q.shape[1],)
            and all(isinstance(idx, PagedRows) and idx.pages.dim() == 2 and idx.per_page >= 1 and idx.width >= 0
                    and all(v.dim() == 1 and v.shape[0] == q.shape[0] for v in (idx.req, idx.lo, idx.hi))
                    and kv.dim() == 2 and kv.stride(1) == 1 and kv.dtype == q.dtype and kv.shape[1] == q.shape[2]
                    for kv, idx in sources))


def tile_heads(block_t: int, h_block: int, H: int) -> int:
    """h_block of a tile of block_t tokens: at most H's power of two, at least 16 rows (tl.dot)."""
    assert block_t & (block_t - 1) == 0, "block_t: a power of two"
    return max(min(h_block, triton.next_power_of_2(H)), triton.cdiv(16, block_t))


def paged_args(kv: torch.Tensor, idx: PagedRows) -> tuple:
    """A source's kernel arguments: kv, pages (last dim contiguous), req, lo, hi (contiguous)."""
    pages = idx.pages if idx.pages.stride(1) == 1 else idx.pages.contiguous()
    req, lo, hi = (v.contiguous() for v in (idx.req, idx.lo, idx.hi))
    return kv, pages, req, lo, hi


def shared_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, PagedRows]], sinks: torch.Tensor,
                     scale: float, **knobs) -> torch.Tensor:
    """q [T, H, D]; sources [(kv [N, D], PagedRows)] (one or two); sinks [H] -> out [T, H, D]
    in q's dtype, as `dsv4.ops.attention.sparse_attention`. Keyword arguments: SharedTiles
    fields overriding SHARED_TILES (CHECK_TILES for fp32). No host sync (CUDA graphs)."""
    assert supports_shared(q, sources, sinks), "shared_attention (triton): unsupported inputs"
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    tiles = (SHARED_TILES if q.dtype != torch.float32 else CHECK_TILES)._replace(
        **{name: value for name, value in knobs.items() if value is not None})
    block_t, h_block, block_k, d_parts, num_warps, num_stages, q_regs, lazy = tiles
    assert d_parts in (1, 2) and D % d_parts == 0, "shared_attention: d_parts is 1 or 2 and divides D"
    assert block_k >= 16, "shared_attention: block_k >= 16"
    assert scale > 0, "shared_attention: scale > 0 (the block max of the raw scores is the scaled one's)"
    h_block = tile_heads(block_t, h_block, H)
    q = q if q.stride(2) == 1 else q.contiguous()
    kv0, pages0, req0, lo0, hi0 = paged_args(*sources[0])
    kv1, pages1, req1, lo1, hi1 = paged_args(*sources[-1])
    idx0, idx1 = sources[0][1], sources[-1][1]
    dv = D // d_parts
    grid = (triton.cdiv(T, block_t) * triton.cdiv(H, h_block) * d_parts,)
    _shared_attn_kernel[grid](
        q, sinks.contiguous(), out, kv0, pages0, req0, lo0, hi0, kv1, pages1, req1, lo1, hi1,
        T, H, idx0.width, idx1.width, scale * LOG2E.value,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv0.stride(0), pages0.stride(0), idx0.pitch, kv1.stride(0), pages1.stride(0), idx1.pitch,
        D=D, DV=dv, BLOCK_DV=triton.next_power_of_2(dv), BLOCK_T=block_t, H_BLOCK=h_block, BLOCK_K=block_k,
        D_PARTS=d_parts, TWO=len(sources) == 2, PER_PAGE0=idx0.per_page, PER_PAGE1=idx1.per_page,
        FP32_DOT=q.dtype == torch.float32 or INTERPRETING, Q_REGS=bool(q_regs), LAZY=bool(lazy),
        num_warps=num_warps, num_stages=num_stages)
    return out
