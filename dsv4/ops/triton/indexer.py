"""Lightning indexer in Triton: scores of one tile of entries in one kernel, the tile's top k
by radix select (dsv4/ops/triton/radix_topk.py: many programs per row), merged into a running
top-k (dsv4/ops/stream_topk.py: score desc, ties to the lower offset, the reference's order),
tile after tile; a single tile (every decode step up to SCORE_TILE / T entries) needs no merge.

The reference (dsv4/ops/indexer.py, the definition) gathers key tiles in torch; here each
program reads its key rows straight from the pool by index. A tile holds at most SCORE_TILE
scores (or T x k), so a step's memory is O(T * k + tile) at any context length; a decode
step up to SCORE_TILE / T entries is one tile.

score(t, j) = sum_h w[t, h] * ReLU(q[t, h] . keys[cand[t, j]]) * Di^-0.5   (fp32)
            = -inf where cand[t, j] < 0.

cand may be a PagedRows (dsv4/ops/paged.py; E = its width): the kernel then computes the rows
from the page table (PER_PAGE constexpr: a shift and a mask for a power of two), and one more
kernel turns the chosen positions into rows (PagedRows.rows_at where the score is finite, in one
pass instead of a dozen torch ops), so scores and selection are bit-identical to those of its
dense form. `indexer_topk_offsets` has the same kernel also write the chosen positions
(offsets into each token's range, IndexCache's raw top-k: dsv4/ops/translate.py).
The tiling depends only on T, k and the width, never on the data (CUDA-graph safe).

Packed FP8 keys (Di e4m3 bytes + an fp32 scale, dsv4/ops/kv_fp8.py) are read as int32 words and
unpacked to q's dtype (exact), so they take q's tensor-core dot like model-dtype keys; each key's
scale (> 0) multiplies its dot afterwards (it commutes with the ReLU).
"""
import os

import torch
import triton
import triton.language as tl

from ..paged import PagedRows, index_width
from ..stream_topk import RunningTopk
from .fp8_words import fp8_words_to
from .radix_topk import radix_topk
from .row_topk import RowTopk

BLOCK_E = 128       # candidates per program (best measured on an H200 for E >= 1k: benchmarks/kernels/indexer.py)
NUM_WARPS = 4
ROWS_BLOCK = 1024   # chosen positions per program of the paged rows kernel (top-k 512: one a token)
# scores of one tile: 64M fp32 (256 MiB transient, whatever the context; its top k by radix select
# needs O(T * k) more); a decode step of T <= 256 tokens at 1M context (262,144 C4 entries) is one tile
SCORE_TILE = 1 << 26
ROWS_MIN = 256      # rows from which a program per row (row_topk) fills an H200's 132 SMs twice


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("E0", "E", "n_eblk", "pitch", "stride_ct", "stride_ce", "stride_ot"))
def _scores_kernel(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr,
                   E0, E, HI, DI, n_eblk, scale, pitch,
                   stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
                   stride_kn, stride_kd, stride_ct, stride_ce, stride_ot,
                   HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_E: tl.constexpr,
                   FP32_DOT: tl.constexpr, PAGED: tl.constexpr, PER_PAGE: tl.constexpr,
                   PACKED: tl.constexpr):
    # One program = token t x candidates [e0, e0 + BLOCK_E) of the tile [E0, E), written to
    # column e0 - E0 of out. The blocks of one token are adjacent program ids, so q[t] is read
    # from DRAM once and then served by L2.
    # Dense: cand_ptr is cand [T, E]. Paged: the page table [R, P], candidate j of token t is
    # item lo[t] + j of request req[t] (req/lo/hi unused when dense).
    pid = tl.program_id(0).to(tl.int64)
    t = pid // n_eblk
    offs_e = E0 + (pid % n_eblk) * BLOCK_E + tl.arange(0, BLOCK_E)            # [BLOCK_E]
    offs_h = tl.arange(0, HI_P)                                               # [HI_P]
    offs_d = tl.arange(0, DI_P)                                               # [DI_P]
    h_ok, d_ok, e_ok = offs_h < HI, offs_d < DI, offs_e < E

    if PAGED:
        base = tl.load(lo_ptr + t).to(tl.int32)
        in_range = e_ok & (offs_e < tl.load(hi_ptr + t).to(tl.int32) - base)
        item = base + offs_e.to(tl.int32)
        page = tl.load(cand_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_ct + (item // PER_PAGE) * stride_ce,
                       mask=in_range, other=-1).to(tl.int64)
        rows = tl.where(in_range, page * pitch + item % PER_PAGE, -1)
    else:
        rows = tl.load(cand_ptr + t * stride_ct + offs_e * stride_ce, mask=e_ok, other=-1)
        rows = rows.to(tl.int64)                                              # [BLOCK_E]
    valid = rows >= 0
    scores = tl.full([BLOCK_E], float("-inf"), tl.float32)
    # Candidates past the causal limit are a -1 tail: a block of only -1 does no work.
    if tl.max(rows, axis=0) >= 0:
        q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)            # [HI_P, DI_P]
        if PACKED:      # FP8 row: DI e4m3 bytes (DI / 4 int32 words), then an fp32 scale (dsv4/ops/kv_fp8.py)
            row = keys_ptr.to(tl.pointer_type(tl.int32)) + rows * (stride_kn // 4)           # [BLOCK_E] word rows
            offs_w = tl.arange(0, DI_P // 4)
            raw = tl.load(row[:, None] + offs_w[None, :], mask=valid[:, None] & (offs_w < DI // 4)[None, :], other=0)
            row_scale = tl.load((row + DI // 4).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
            k = tl.reshape(fp8_words_to(raw, q.dtype), (BLOCK_E, DI_P))    # e4m3 -> q's dtype: exact
        else:
            k = tl.load(keys_ptr + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        mask=valid[:, None] & d_ok[None, :], other=0.0)      # [BLOCK_E, DI_P]
        if FP32_DOT:            # fp32 or mixed inputs: exact fp32 products (no tf32)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        # bf16 x bf16 products are exact in fp32 and accumulate in fp32, like the reference.
        dots = tl.dot(q, tl.trans(k), input_precision="ieee")               # [HI_P, BLOCK_E]
        if PACKED:              # a key's one scale (> 0) factors out of its dot and commutes with the ReLU
            dots = dots * row_scale[None, :]
        # Padded heads have q = 0 and w = 0: they add nothing.
        w = tl.load(w_ptr + t * stride_wt + offs_h * stride_wh, mask=h_ok, other=0.0)
        w = w.to(tl.float32) * scale                                          # [HI_P]
        s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)                # [BLOCK_E]
        scores = tl.where(valid, s, float("-inf"))
    tl.store(out_ptr + t * stride_ot + (offs_e - E0), scores, mask=e_ok)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("K", "n_kblk", "pitch", "stride_pr"))
def _chosen_rows_kernel(pos_ptr, pages_ptr, req_ptr, lo_ptr, out_ptr, K, n_kblk, pitch,
                        stride_pr, stride_pc, PER_PAGE: tl.constexpr, BLOCK: tl.constexpr):
    # positions/out [T, K] contiguous: out = the pool row of item lo[t] + pos where pos >= 0 (a
    # chosen entry, so pos < hi - lo: the rest scored -inf), else -1.
    pid = tl.program_id(0).to(tl.int64)
    t = pid // n_kblk
    offs = t * K + (pid % n_kblk) * BLOCK + tl.arange(0, BLOCK)
    ok = (pid % n_kblk) * BLOCK + tl.arange(0, BLOCK) < K
    pos = tl.load(pos_ptr + offs, mask=ok, other=-1)
    chosen = ok & (pos >= 0)
    item = tl.load(lo_ptr + t).to(tl.int32) + pos.to(tl.int32)
    page = tl.load(pages_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_pr + (item // PER_PAGE) * stride_pc,
                   mask=chosen, other=-1).to(tl.int64)
    tl.store(out_ptr + offs, tl.where(chosen, page * pitch + item % PER_PAGE, -1), mask=ok)


def _chosen_rows(cand: PagedRows, offsets: torch.Tensor) -> torch.Tensor:
    """cand.rows_at(offsets) for chosen offsets ([T, k] long, -1 = none) in one kernel."""
    T, k = offsets.shape
    out = torch.empty((T, k), dtype=torch.long, device=offsets.device)
    block = min(ROWS_BLOCK, triton.next_power_of_2(k))
    n_kblk = triton.cdiv(k, block)
    _chosen_rows_kernel[(T * n_kblk,)](
        offsets.contiguous(), cand.pages, cand.req.contiguous(), cand.lo.contiguous(), out, k, n_kblk,
        cand.pitch, cand.pages.stride(0), cand.pages.stride(1), PER_PAGE=cand.per_page, BLOCK=block, num_warps=4)
    return out


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor | PagedRows,
                   block_e: int = BLOCK_E, weight_scale: float = 1.0, e0: int = 0,
                   e1: int | None = None) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] (x weight_scale), keys [N, Di], cand [T, E] (-1 = absent)
    or a PagedRows of width E -> [T, e1 - e0] fp32 (keys may be packed FP8: uint8 [N, Di + 4]): the scores of candidates [e0, e1) (all E
    by default)."""
    T, Hi, Di = q.shape
    packed = keys.dtype == torch.uint8          # FP8 keys [N, Di + 4] (dsv4/ops/kv_fp8.py)
    if packed and not _words_ok(keys, Di):
        raise ValueError("indexer_scores: packed FP8 keys need Di % 4 == 0 and 4-byte aligned contiguous rows")
    e1 = index_width(cand) if e1 is None else e1
    scores = torch.empty((T, e1 - e0), dtype=torch.float32, device=q.device)
    if T == 0 or e1 <= e0:
        return scores
    if isinstance(cand, PagedRows):
        table, req, lo, hi = cand.pages, cand.req.contiguous(), cand.lo.contiguous(), cand.hi.contiguous()
        paged, per_page, pitch = True, cand.per_page, cand.pitch
    else:
        table = req = lo = hi = cand
        paged, per_page, pitch = False, 1, 1
    n_eblk = triton.cdiv(e1 - e0, block_e)
    # tl.dot needs every dimension >= 16 on the GPU; the padding is masked.
    hi_p = max(16, triton.next_power_of_2(Hi))
    di_p = max(16, triton.next_power_of_2(Di))
    # Tensor-core dot for bf16/fp16 pairs; fp32 otherwise. Triton's CPU interpreter multiplies
    # the raw bits of 16-bit floats in tl.dot, so there both sides go up to fp32 first (the same
    # products: 16-bit x 16-bit is exact in fp32).
    # FP8 keys are unpacked to q's dtype in the kernel (exact), so they take q's dot.
    fp32_dot = ((q.dtype != keys.dtype and not packed) or q.dtype not in (torch.bfloat16, torch.float16)
                or os.environ.get("TRITON_INTERPRET") == "1")
    _scores_kernel[(T * n_eblk,)](
        q, weights, keys, table, req, lo, hi, scores,
        e0, e1, Hi, Di, n_eblk, Di ** -0.5 * weight_scale, pitch,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        keys.stride(0), keys.stride(1), table.stride(0), table.stride(1), scores.stride(0),
        HI_P=hi_p, DI_P=di_p, BLOCK_E=block_e, FP32_DOT=fp32_dot, PAGED=paged, PER_PAGE=per_page,
        PACKED=packed, num_warps=NUM_WARPS)
    return scores


def _words_ok(keys: torch.Tensor, di: int) -> bool:
    """Packed rows the kernel reads as int32 words: whole words, 4-byte aligned (the cache's
    pools always are: rows of Di + 4 bytes from an aligned base)."""
    return (di % 4 == 0 and keys.shape[1] == di + 4 and keys.stride(1) == 1 and keys.stride(0) % 4 == 0
            and keys.data_ptr() % 4 == 0)


def tile_width(T: int, k: int, block_e: int = BLOCK_E) -> int:
    """Entries per tile: SCORE_TILE / T, at least k, a multiple of block_e."""
    width = max(k, SCORE_TILE // max(T, 1), 1)
    return triton.cdiv(width, block_e) * block_e


def _topk_offsets(q, weights, keys, cand, k, weight_scale) -> torch.Tensor:
    """[T, k] chosen offsets (-1 = none). Many rows (prefill): a program per row merges each
    tile into a running set (dsv4/ops/triton/row_topk.py). Few rows (decode): each tile's top k
    by radix select, many programs per row (dsv4/ops/triton/radix_topk.py); with several tiles,
    merged into a running top-k."""
    T, E = q.shape[0], index_width(cand)
    width = tile_width(T, k)
    if T >= ROWS_MIN:
        rows = RowTopk(k)
        for e0 in range(0, E, width):
            scores = indexer_scores(q, weights, keys, cand, weight_scale=weight_scale, e0=e0, e1=min(e0 + width, E))
            rows.add(scores, e0)
        return rows.offsets()
    if E <= width:      # one tile (every decode step up to SCORE_TILE / T entries)
        return radix_topk(indexer_scores(q, weights, keys, cand, weight_scale=weight_scale), k)[1]
    running = RunningTopk(T, k, q.device)
    for e0 in range(0, E, width):
        scores = indexer_scores(q, weights, keys, cand, weight_scale=weight_scale, e0=e0, e1=min(e0 + width, E))
        running.merge(radix_topk(scores, k, e0)[0])
    return running.offsets()


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor | PagedRows,
                 topk: int, weight_scale: float = 1.0) -> torch.Tensor:
    """Same contract as dsv4.ops.indexer.indexer_topk: [T, min(topk, E)] flat rows of the
    chosen entries, -1 where fewer are valid (long for a PagedRows, as its dense form)."""
    paged = isinstance(cand, PagedRows)
    T, k = q.shape[0], min(topk, index_width(cand))
    if T == 0 or k == 0:
        return torch.full((T, k), -1, dtype=torch.long if paged else cand.dtype, device=q.device)
    offsets = _topk_offsets(q, weights, keys, cand, k, weight_scale)
    if paged:
        return _chosen_rows(cand, offsets)
    return torch.where(offsets >= 0, cand.gather(1, offsets.clamp(min=0)), -1)


def indexer_topk_offsets(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: PagedRows, topk: int,
                         weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as dsv4.ops.indexer.indexer_topk_offsets: (rows, offsets) [T, min(topk, E)]
    long."""
    T, k = q.shape[0], min(topk, cand.width)
    if T == 0 or k == 0:
        return (torch.full((T, k), -1, dtype=torch.long, device=q.device),
                torch.full((T, k), -1, dtype=torch.long, device=q.device))
    offsets = _topk_offsets(q, weights, keys, cand, k, weight_scale)
    return _chosen_rows(cand, offsets), offsets
