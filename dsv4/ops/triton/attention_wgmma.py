"""Sparse shared-KV attention over paged ranges written in Gluon for Hopper (sm_90): the kernel
for a prefill chunk over a long slot list (an HCA layer deep in a prompt, docs/architecture.md
"A step's addressing"). Same contract as `dsv4.ops.attention.sparse_attention` (the definition)
for one or two PagedRows sources over bf16/fp16 pools, D = 512, heads a multiple of 64.

A program = one token x 64 heads: the M = 64 rows of both dots, two warp groups (8 warps). Per
block of BLOCK_K keys (K = V: the same pool rows give both dots):
  S = q k^T [64, BLOCK_K]: each warp group computes half the key columns over all D channels;
  the online softmax's row max and sum join the two halves (the compiler's cross-warp reduce);
  P (bf16) goes to shared memory; O += P V [64, 512]: each warp group owns half the output
  channels (acc [64, 256] fp32 a warp group: 128 registers a thread).
So no FLOP is computed twice (attention_shared.py's D_PARTS = 2 computes S twice: 1.5x).
q lives in shared memory (64 KB); the key rows are gathered by cp.async into STAGES buffers, the
next block's copy issued before this block's dots (its buffer was freed by the barrier that
starts the block; its rows read from the page table a block earlier). The sink joins the
denominator only (m starts at the sink).

Gluon does not run in Triton's interpreter: the kernel is checked on the GPU
(tests/ops_triton/test_attention_wgmma.py, benchmarks/kernels/attention.py --variants); on the
CPU `supports_wgmma` is False and the callers keep attention_shared.py's kernel.
"""
from __future__ import annotations

import torch

from ..paged import PagedRows

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
    HAVE_GLUON = True
except ImportError:                                     # an older Triton: the kernel is never picked
    HAVE_GLUON = False

HEADS = 64              # heads a program: the M rows of one warp group's wgmma
DIM = 512               # channels of q and the pool rows (the kernel's layouts are built for it)
LOG2E = 1.4426950408889634
if HAVE_GLUON:
    HEADS_C = gl.constexpr(HEADS)


if HAVE_GLUON:
    @gluon.jit
    def _rows(page_row, lo, span, start, offs, PER_PAGE: gl.constexpr, pitch):
        """Pool rows (int32) of slots start + offs of one token's range (-1: outside it or no page)."""
        slot = start + offs
        inside = slot < span
        e = lo + slot
        page = gl.load(page_row + e // PER_PAGE, mask=inside, other=-1).to(gl.int32)
        return gl.where(inside & (page >= 0), page * pitch + e % PER_PAGE, -1)

    @gluon.jit
    def _copy_block(buf, kv_ptr, stride_kv, rows, D: gl.constexpr, ld: gl.constexpr):
        """cp.async of pool rows `rows` [BLOCK_K] (SliceLayout(1, ld)) into buf [BLOCK_K, D]
        (zeros where a row is -1), as one commit group."""
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        ptrs = kv_ptr + gl.maximum(rows, 0).to(gl.int64)[:, None] * stride_kv + cols[None, :]
        async_copy.async_copy_global_to_shared(buf, ptrs, mask=(rows >= 0)[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _walk(q_smem, kv_smem, p_smem, m, l, acc, kv_ptr, stride_kv, page_row, lo, span, pitch, qk_scale,
              PER_PAGE: gl.constexpr, BLOCK_K: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              SUMS_AT_END: gl.constexpr, COPY_AT: gl.constexpr, s_l: gl.constexpr, o_l: gl.constexpr,
              ld: gl.constexpr):
        """One source's slots [0, span) of the program's token: running m [64] (log2 units, s_l
        rows), l (the row sums [64], or with SUMS_AT_END their terms [64, BLOCK_K] in s_l, summed
        at the end) and acc [64, D] fp32 (o_l) -> (m, l, acc). The next block's copy is issued
        (COPY_AT) 0: before q k^T (its rows read from the page table a block earlier), 1: after
        q k^T, 2: after P's fence (under P V only); the page-table reads of 1 and 2 and of the
        block's mask are issued before q k^T and used after it (their latency under the dot)."""
        offs_ld = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, ld))
        cols_s = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_l))
        for i in gl.static_range(STAGES - 1):
            _copy_block(kv_smem.index(i), kv_ptr, stride_kv,
                        _rows(page_row, lo, span, i * BLOCK_K, offs_ld, PER_PAGE, pitch), D, ld)
        rows_next = _rows(page_row, lo, span, (STAGES - 1) * BLOCK_K, offs_ld, PER_PAGE, pitch)
        n_blocks = (span + BLOCK_K - 1) // BLOCK_K
        for j in range(n_blocks):
            async_copy.wait_group(STAGES - 2)           # block j's rows are in (this thread's copies)
            gl.thread_barrier()                         # every thread's copies; block j - 1's dots done
            fence_async_shared()                        # cp.async's writes before the wgmma reads
            ahead = j + STAGES - 1                      # copied into the buffer block j - 1 used
            if COPY_AT == 0:
                _copy_block(kv_smem.index(ahead % STAGES), kv_ptr, stride_kv, rows_next, D, ld)
                rows_next = _rows(page_row, lo, span, (ahead + 1) * BLOCK_K, offs_ld, PER_PAGE, pitch)
            else:
                rows_ahead = _rows(page_row, lo, span, ahead * BLOCK_K, offs_ld, PER_PAGE, pitch)
            valid = _rows(page_row, lo, span, j * BLOCK_K, cols_s, PER_PAGE, pitch) >= 0
            kv = kv_smem.index(j % STAGES)
            s = warpgroup_mma(q_smem, kv.permute((1, 0)), gl.zeros([HEADS_C, BLOCK_K], gl.float32, s_l),
                              use_acc=False)
            if COPY_AT == 1:
                _copy_block(kv_smem.index(ahead % STAGES), kv_ptr, stride_kv, rows_ahead, D, ld)
            s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = gl.maximum(m, gl.max(s, axis=1))
            alpha = gl.exp2(m - m_new)
            p = gl.exp2(s - m_new[:, None])                                     # masked: 0
            if SUMS_AT_END:                             # no cross-warp sum a block
                l = l * alpha[:, None] + p
            else:
                l = l * alpha + gl.sum(p, axis=1)
            m = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            p_smem.store(p.to(q_smem.dtype))
            fence_async_shared()
            gl.thread_barrier()                         # both warp groups' columns of p
            if COPY_AT == 2:
                _copy_block(kv_smem.index(ahead % STAGES), kv_ptr, stride_kv, rows_ahead, D, ld)
            acc = warpgroup_mma(p_smem, kv, acc)
        async_copy.wait_group(0)                        # the copies issued past the last block
        gl.thread_barrier()
        return m, l, acc

    @gluon.jit
    def _source(q_smem, kv_smem, p_smem, m, l, acc, t, kv_ptr, pages_ptr, req_ptr, lo_ptr, hi_ptr, W, stride_kv,
                stride_p, pitch, qk_scale, PER_PAGE: gl.constexpr, BLOCK_K: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, SUMS_AT_END: gl.constexpr, COPY_AT: gl.constexpr, s_l: gl.constexpr,
                o_l: gl.constexpr, ld: gl.constexpr):
        """_walk over token t's range of one source (its items lo + [0, min(hi - lo, W)))."""
        lo = gl.load(lo_ptr + t).to(gl.int32)
        span = gl.minimum(gl.maximum(gl.load(hi_ptr + t).to(gl.int32) - lo, 0), W)
        page_row = pages_ptr + gl.load(req_ptr + t) * stride_p
        return _walk(q_smem, kv_smem, p_smem, m, l, acc, kv_ptr, stride_kv, page_row, lo, span, pitch, qk_scale,
                     PER_PAGE, BLOCK_K, D, STAGES, SUMS_AT_END, COPY_AT, s_l, o_l, ld)

    # per-step sizes are not specialised: one compiled variant for every step shape
    @gluon.jit(do_not_specialize=("T", "W0", "W1", "stride_p0", "stride_p1", "pitch0", "pitch1"))
    def _wgmma_attn_kernel(q_ptr, sink_ptr, out_ptr,
                           kv0_ptr, pages0_ptr, req0_ptr, lo0_ptr, hi0_ptr,
                           kv1_ptr, pages1_ptr, req1_ptr, lo1_ptr, hi1_ptr,
                           T, H, W0, W1, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
                           stride_kv0, stride_p0, pitch0, stride_kv1, stride_p1, pitch1,
                           D: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, TWO: gl.constexpr,
                           PER_PAGE0: gl.constexpr, PER_PAGE1: gl.constexpr, SUMS_AT_END: gl.constexpr,
                           COPY_AT: gl.constexpr, num_warps: gl.constexpr):
        # program = token t, heads [h0, h0 + 64); warps [4, 2]: a warp group's 64 rows, the
        # columns (keys of S, channels of O) split between the two warp groups
        pid = gl.program_id(0)
        n_hb = H // HEADS_C
        t = pid // n_hb
        h0 = (pid % n_hb) * HEADS_C
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_K // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, D // 2, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        dt = q_ptr.dtype.element_ty
        q_smem = gl.allocate_shared_memory(dt, [HEADS_C, D], gl.NVMMASharedLayout.get_default_for([HEADS_C, D], dt))
        kv_smem = gl.allocate_shared_memory(dt, [STAGES, BLOCK_K, D],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], dt))
        p_smem = gl.allocate_shared_memory(dt, [HEADS_C, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([HEADS_C, BLOCK_K], dt))
        heads_ld = h0 + gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, ld))
        cols_ld = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q_rows = q_ptr + t.to(gl.int64) * stride_qt + heads_ld.to(gl.int64)[:, None] * stride_qh
        q_smem.store(gl.load(q_rows + cols_ld[None, :]))
        fence_async_shared()
        heads_s = h0 + gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, s_l))
        sink = gl.load(sink_ptr + heads_s).to(gl.float32) * 1.4426950408889634
        m = sink                                        # [64] running max (log2 units), >= sink
        if SUMS_AT_END:                                 # each thread's terms of the row sums
            l = gl.zeros([HEADS_C, BLOCK_K], gl.float32, s_l)
        else:
            l = gl.zeros([HEADS_C], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([HEADS_C, D], gl.float32, o_l)
        m, l, acc = _source(q_smem, kv_smem, p_smem, m, l, acc, t, kv0_ptr, pages0_ptr, req0_ptr, lo0_ptr, hi0_ptr,
                            W0, stride_kv0, stride_p0, pitch0, qk_scale, PER_PAGE0, BLOCK_K, D, STAGES, SUMS_AT_END,
                            COPY_AT, s_l, o_l, ld)
        if TWO:
            m, l, acc = _source(q_smem, kv_smem, p_smem, m, l, acc, t, kv1_ptr, pages1_ptr, req1_ptr, lo1_ptr,
                                hi1_ptr, W1, stride_kv1, stride_p1, pitch1, qk_scale, PER_PAGE1, BLOCK_K, D, STAGES,
                                SUMS_AT_END, COPY_AT, s_l, o_l, ld)
        if SUMS_AT_END:
            l = gl.sum(l, axis=1)
        denom = gl.convert_layout(l + gl.exp2(sink - m), gl.SliceLayout(1, o_l))
        out = (acc / denom[:, None]).to(dt)
        heads_o = h0 + gl.arange(0, HEADS_C, layout=gl.SliceLayout(1, o_l))
        cols_o = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
        o_rows = out_ptr + t.to(gl.int64) * stride_ot + heads_o.to(gl.int64)[:, None] * stride_oh
        gl.store(o_rows + cols_o[None, :], out)


def supports_wgmma(q: torch.Tensor, sources: list, sinks: torch.Tensor) -> bool:
    """Inputs this kernel takes: CUDA sm_90 with Gluon, q [T, H, 512] bf16/fp16 (last dim
    contiguous) with H a multiple of 64, one or two PagedRows sources over pools of q's dtype and
    width (rows contiguous, 16-byte aligned), sinks [H]."""
    from .attention_shared import supports_shared
    return (HAVE_GLUON and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
            and q.dtype in (torch.bfloat16, torch.float16) and q.dim() == 3 and q.shape[2] == DIM
            and q.shape[1] % HEADS == 0 and q.stride(2) == 1 and supports_shared(q, sources, sinks)
            and all(kv.stride(0) % 8 == 0 and kv.data_ptr() % 16 == 0 for kv, _ in sources))


def wgmma_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, PagedRows]], sinks: torch.Tensor,
                    scale: float, block_k: int = 64, stages: int = 2, sums_at_end: bool = False,
                    copy_at: int = 0) -> torch.Tensor:
    """q [T, H, 512]; sources [(kv [N, 512], PagedRows)] (one or two); sinks [H] -> out [T, H, 512]
    in q's dtype, as `dsv4.ops.attention.sparse_attention` (supports_wgmma's inputs). block_k: keys
    a block (64: 200 KB of shared memory with 2 stages); stages: key blocks in shared memory;
    sums_at_end: the softmax's row sums kept as each thread's terms and summed once at the end
    (no cross-warp sum a block; 16 more registers); copy_at: where the next block's copy is
    issued (0: before q k^T, 1: after it, 2: after P's fence; _walk). No host sync (CUDA graphs)."""
    from .attention_shared import paged_args
    assert supports_wgmma(q, sources, sinks), "wgmma_attention: unsupported inputs"
    assert stages >= 2 and block_k in (32, 64) and copy_at in (0, 1, 2), \
        "wgmma_attention: stages >= 2, block_k 32 or 64, copy_at 0, 1 or 2"
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    kv0, pages0, req0, lo0, hi0 = paged_args(*sources[0])
    kv1, pages1, req1, lo1, hi1 = paged_args(*sources[-1])
    idx0, idx1 = sources[0][1], sources[-1][1]
    _wgmma_attn_kernel[(T * (H // HEADS),)](
        q, sinks.float().contiguous(), out, kv0, pages0, req0, lo0, hi0, kv1, pages1, req1, lo1, hi1,
        T, H, idx0.width, idx1.width, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv0.stride(0), pages0.stride(0), idx0.pitch, kv1.stride(0), pages1.stride(0), idx1.pitch,
        D=D, BLOCK_K=block_k, STAGES=stages, TWO=len(sources) == 2, PER_PAGE0=idx0.per_page,
        PER_PAGE1=idx1.per_page, SUMS_AT_END=sums_at_end, COPY_AT=copy_at,
        num_warps=8)
    return out
