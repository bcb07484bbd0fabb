"""IndexCache's translation in Triton: offsets into each token's PagedRows range -> pool rows
(dsv4/ops/translate.py, the definition), one program per BLOCK offsets of one token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..paged import PagedRows

BLOCK = 1024     # offsets per program (top-k 512: one program a token)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("K", "n_kblk", "pitch", "stride_ot", "stride_pr"))
def _translate_kernel(off_ptr, pages_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr, K, n_kblk, pitch,
                      stride_ot, stride_ok, stride_pr, stride_pc,
                      PER_PAGE: tl.constexpr, BLOCK: tl.constexpr):
    # out [T, K] contiguous; offsets [T, K] at any strides. Only in-range offsets read the
    # page table, so -1 and out-of-range values never address memory.
    pid = tl.program_id(0).to(tl.int64)
    t = pid // n_kblk
    offs_k = (pid % n_kblk) * BLOCK + tl.arange(0, BLOCK)
    ok = offs_k < K
    off = tl.load(off_ptr + t * stride_ot + offs_k * stride_ok, mask=ok, other=-1).to(tl.int64)
    lo = tl.load(lo_ptr + t).to(tl.int64)
    valid = ok & (off >= 0) & (off < tl.load(hi_ptr + t).to(tl.int64) - lo)
    item = lo + off
    page = tl.load(pages_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_pr + (item // PER_PAGE) * stride_pc,
                   mask=valid, other=-1).to(tl.int64)
    tl.store(out_ptr + t * K + offs_k, tl.where(valid, page * pitch + item % PER_PAGE, -1), mask=ok)


def translate_topk(paged: PagedRows, offsets: torch.Tensor) -> torch.Tensor:
    """Same contract as dsv4.ops.translate.translate_topk."""
    T, K = offsets.shape
    out = torch.empty((T, K), dtype=torch.long, device=offsets.device)
    if T == 0 or K == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(K))
    n_kblk = triton.cdiv(K, block)
    _translate_kernel[(T * n_kblk,)](
        offsets, paged.pages, paged.req.contiguous(), paged.lo.contiguous(), paged.hi.contiguous(), out,
        K, n_kblk, paged.pitch, offsets.stride(0), offsets.stride(1), paged.pages.stride(0), paged.pages.stride(1),
        PER_PAGE=paged.per_page, BLOCK=block, num_warps=4)
    return out
