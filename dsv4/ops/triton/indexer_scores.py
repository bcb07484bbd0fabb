"""The lightning indexer's scores of one tile of candidates (the selection around them:
dsv4/ops/triton/indexer.py), by one of two kernels:

score(t, j) = sum_h w[t, h] * ReLU(q[t, h] . keys[cand[t, j]]) * Di^-0.5   (fp32)
            = -inf where cand[t, j] < 0.

* per token (`_scores_kernel`, decode): one program = one token x BLOCK_E candidates, the dot
  [Hi, Di] x [Di, BLOCK_E] summed over the heads. Every key row is read once per token.
* tiled (`_scores_gemm_kernel`, prefill-sized T >= GEMM_MIN_TOKENS): one program = BLOCK_T
  tokens x BLOCK_E candidates. When the block's tokens read the same key row in each column
  (a prefill chunk: one request, one lo, causal limits hi), the key tile [BLOCK_E, Di] is
  loaded once and each head adds w[t, h] * ReLU(q[:, h] . k^T) to a [BLOCK_T, BLOCK_E] fp32
  accumulator (a tensor-core dot [BLOCK_T, Di] x [Di, BLOCK_E] per head); each token then masks
  the columns past its own limit. A block whose tokens do not share their rows (several
  requests, windows starting at different lo) scores its tokens one by one with the per-token
  code, inside the same program: the check is made on the device, so the launch depends only on
  T and the width (CUDA-graph safe, no host sync). Sums run over the heads in another order than
  the per-token kernel's: the same scores up to fp32 rounding (bit for bit where sums are exact).

cand may be a PagedRows (dsv4/ops/paged.py; E = its width): the kernels compute the rows from
the page table (PER_PAGE constexpr: a shift and a mask for a power of two); tokens share rows
when they share (req, lo). For a dense cand [T, E] they share when every column holds one row
or -1.

Packed FP8 keys (Di e4m3 bytes + an fp32 scale, dsv4/ops/kv_fp8.py) are read as int32 words and
unpacked to q's dtype (exact), so they take q's tensor-core dot like model-dtype keys; each key's
scale (> 0) multiplies its dot (per token) or its sum over the heads (tiled: it commutes with
the ReLU and the weighted sum).
"""
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..paged import PagedRows, index_width
from .fp8_words import fp8_words_to

# candidates per program of the per-token kernel (best measured on an H200 for E >= 1k:
# benchmarks/kernels/indexer.py)
BLOCK_E = 128
NUM_WARPS = 4


@dataclass(frozen=True)
class GemmTiles:
    """Launch shape of the tiled kernel (benchmarks/kernels/indexer_gemm.py sweeps them)."""
    # defaults: GEMM_TILES_FP8's (below for model-dtype keys), the best of the H200 sweep for FP8 keys
    # (`python -m benchmarks.kernels.indexer_gemm`): 1.96 ms a 32,768-entry tile of a 2,048-token
    # chunk at 900k (per token 8.56 ms)
    block_t: int = 64       # tokens per program (>= 16: tl.dot)
    block_e: int = 128      # candidates per program (>= 16)
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = None     # registers a thread (128 at 8 warps: two programs an SM); None: ptxas's choice


# model-dtype keys: 1.93 ms a tile against 2.02 for GemmTiles() (57.6% of the bf16 peak; the same
# order in two calls of the twelfth session, docs/benchmarks.md); packed FP8 keys: GemmTiles(),
# 1.96 ms against 2.04 for this one
GEMM_TILES = GemmTiles(num_stages=2, maxnreg=168)
GEMM_TILES_FP8 = GemmTiles()
GEMM_MIN_TOKENS = 256   # steps of at least this many tokens take the tiled kernel (decode: per token)


@triton.jit
def _token_scores(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, t, offs_e, E, HI, DI, scale, pitch,
                  stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn, stride_kd, stride_ct, stride_ce,
                  HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_E: tl.constexpr, FP32_DOT: tl.constexpr,
                  PAGED: tl.constexpr, PER_PAGE: tl.constexpr, PACKED: tl.constexpr):
    """Scores [BLOCK_E] fp32 of token t (int64) at candidates offs_e ([BLOCK_E], -inf where absent
    or >= E). Dense: cand_ptr is cand [T, E]. Paged: the page table [R, P], candidate j of token
    t is item lo[t] + j of request req[t] (req/lo/hi unused when dense)."""
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
        k, row_scale = _key_tile(keys_ptr, rows, stride_kn, stride_kd, DI, q.dtype, DI_P, BLOCK_E, PACKED)
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
    return scores


@triton.jit
def _key_tile(keys_ptr, rows, stride_kn, stride_kd, DI, dtype: tl.constexpr, DI_P: tl.constexpr,
              BLOCK_E: tl.constexpr, PACKED: tl.constexpr):
    """The key rows `rows` ([BLOCK_E] int64, -1 = none: zeros) -> ([BLOCK_E, DI_P] keys in
    `dtype` when packed (exact) else the pool's dtype, [BLOCK_E] fp32 scales: packed only, else 1)."""
    valid = rows >= 0
    if PACKED:      # FP8 row: DI e4m3 bytes (DI / 4 int32 words), then an fp32 scale (dsv4/ops/kv_fp8.py)
        row = keys_ptr.to(tl.pointer_type(tl.int32)) + rows * (stride_kn // 4)           # [BLOCK_E] word rows
        offs_w = tl.arange(0, DI_P // 4)
        raw = tl.load(row[:, None] + offs_w[None, :], mask=valid[:, None] & (offs_w < DI // 4)[None, :], other=0)
        row_scale = tl.load((row + DI // 4).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        k = tl.reshape(fp8_words_to(raw, dtype), (BLOCK_E, DI_P))           # e4m3 -> q's dtype: exact
    else:
        offs_d = tl.arange(0, DI_P)
        k = tl.load(keys_ptr + rows[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=valid[:, None] & (offs_d < DI)[None, :], other=0.0)  # [BLOCK_E, DI_P]
        row_scale = tl.full([BLOCK_E], 1.0, tl.float32)
    return k, row_scale


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
    pid = tl.program_id(0).to(tl.int64)
    t = pid // n_eblk
    offs_e = E0 + (pid % n_eblk) * BLOCK_E + tl.arange(0, BLOCK_E)            # [BLOCK_E]
    scores = _token_scores(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, t, offs_e, E, HI, DI, scale,
                           pitch, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn, stride_kd,
                           stride_ct, stride_ce, HI_P, DI_P, BLOCK_E, FP32_DOT, PAGED, PER_PAGE, PACKED)
    tl.store(out_ptr + t * stride_ot + (offs_e - E0), scores, mask=offs_e < E)


@triton.jit
def _block_rows(cand_ptr, req_ptr, lo_ptr, hi_ptr, offs_t, offs_e, t_ok, e_ok, pitch, stride_ct, stride_ce,
                PAGED: tl.constexpr, PER_PAGE: tl.constexpr):
    """Whether the tokens offs_t read the same row in each column offs_e (or none), and those
    rows: (rows [BLOCK_E] int64, -1 = none (or not shared), shared)."""
    if PAGED:       # shared: every token with a non-empty range has the same (req, lo)
        req = tl.load(req_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
        lo = tl.load(lo_ptr + offs_t, mask=t_ok, other=0).to(tl.int32)
        span = tl.where(t_ok, tl.load(hi_ptr + offs_t, mask=t_ok, other=0).to(tl.int32) - lo, 0)   # [BLOCK_T]
        active = span > 0
        req0 = tl.max(tl.where(active, req, -1), axis=0)
        lo0 = tl.max(tl.where(active, lo, -1), axis=0)
        shared = tl.sum((active & ((req != req0) | (lo != lo0))).to(tl.int32), axis=0) == 0
        widest = tl.where(shared, tl.max(span, axis=0), 0)                   # (not shared: no rows read)
        in_range = e_ok & (offs_e < widest)
        item = lo0 + offs_e.to(tl.int32)
        page = tl.load(cand_ptr + req0 * stride_ct + (item // PER_PAGE) * stride_ce,
                       mask=in_range, other=-1).to(tl.int64)
        rows = tl.where(in_range, page * pitch + item % PER_PAGE, -1)         # [BLOCK_E]
    else:           # shared: every column holds one row or -1
        c = tl.load(cand_ptr + offs_t[:, None] * stride_ct + offs_e[None, :] * stride_ce,
                    mask=t_ok[:, None] & e_ok[None, :], other=-1).to(tl.int64)   # [BLOCK_T, BLOCK_E]
        rows = tl.max(c, axis=0)
        shared = tl.sum(tl.sum(((c >= 0) & (c != rows[None, :])).to(tl.int32), axis=1), axis=0) == 0
    return rows, shared


@triton.jit
def _block_valid(cand_ptr, lo_ptr, hi_ptr, offs_t, offs_e, t_ok, e_ok, rows, stride_ct, stride_ce,
                 PAGED: tl.constexpr):
    """[BLOCK_T, BLOCK_E]: token t scores column e, for a block whose tokens share `rows`
    (_block_rows): the row exists and e is within the token's own range (its causal limit)."""
    if PAGED:
        lo = tl.load(lo_ptr + offs_t, mask=t_ok, other=0).to(tl.int32)
        span = tl.load(hi_ptr + offs_t, mask=t_ok, other=0).to(tl.int32) - lo                       # [BLOCK_T]
        valid = (rows >= 0)[None, :] & (offs_e.to(tl.int32)[None, :] < span[:, None])
    else:
        valid = tl.load(cand_ptr + offs_t[:, None] * stride_ct + offs_e[None, :] * stride_ce,
                        mask=t_ok[:, None] & e_ok[None, :], other=-1) >= 0
    return valid


@triton.jit
def _tokens_one_by_one(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr, t0, T, offs_e, e_ok, E0, E,
                       HI, DI, scale, pitch, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn, stride_kd,
                       stride_ct, stride_ce, stride_ot, HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_E: tl.constexpr, FP32_DOT: tl.constexpr, PAGED: tl.constexpr, PER_PAGE: tl.constexpr,
                       PACKED: tl.constexpr):
    """A tiled block whose tokens do not share their rows: tokens [t0, t0 + BLOCK_T) (< T)
    scored one by one by the per-token code, stored at columns offs_e - E0 of out."""
    for i in range(0, BLOCK_T):
        t = (t0 + i).to(tl.int64)
        if t < T:
            s = _token_scores(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, t, offs_e, E, HI, DI, scale,
                              pitch, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn, stride_kd,
                              stride_ct, stride_ce, HI_P, DI_P, BLOCK_E, FP32_DOT, PAGED, PER_PAGE, PACKED)
            tl.store(out_ptr + t * stride_ot + (offs_e - E0), s, mask=e_ok)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T", "E0", "E", "n_eblk", "pitch", "stride_ct", "stride_ce", "stride_ot"))
def _scores_gemm_kernel(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr,
                        T, E0, E, HI, DI, n_eblk, scale, pitch,
                        stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
                        stride_kn, stride_kd, stride_ct, stride_ce, stride_ot,
                        HI_P: tl.constexpr, DI_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        FP32_DOT: tl.constexpr, PAGED: tl.constexpr, PER_PAGE: tl.constexpr,
                        PACKED: tl.constexpr, EVEN_D: tl.constexpr):
    # One program = tokens [t0, t0 + BLOCK_T) x candidates [e0, e0 + BLOCK_E) of the tile
    # [E0, E), written to columns e0 - E0 of out. The candidate blocks of one token block are
    # adjacent program ids: its q (BLOCK_T x Hi x Di) is served by L2 after the first.
    pid = tl.program_id(0).to(tl.int64)
    t0 = (pid // n_eblk) * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)                                       # [BLOCK_T]
    offs_e = E0 + (pid % n_eblk) * BLOCK_E + tl.arange(0, BLOCK_E)            # [BLOCK_E]
    t_ok, e_ok = offs_t < T, offs_e < E
    rows, shared = _block_rows(cand_ptr, req_ptr, lo_ptr, hi_ptr, offs_t, offs_e, t_ok, e_ok, pitch, stride_ct,
                               stride_ce, PAGED, PER_PAGE)
    if shared:
        scores = tl.full([BLOCK_T, BLOCK_E], float("-inf"), tl.float32)
        # A block wholly past every token's limit (the causal -1 tail) does no dots.
        if tl.max(rows, axis=0) >= 0:
            k, row_scale = _key_tile(keys_ptr, rows, stride_kn, stride_kd, DI, q_ptr.dtype.element_ty, DI_P,
                                     BLOCK_E, PACKED)                         # [BLOCK_E, DI_P], read once
            if FP32_DOT:        # fp32 or mixed inputs: exact fp32 products (no tf32)
                k = k.to(tl.float32)
            k = tl.trans(k)                                                   # [DI_P, BLOCK_E]
            # Rows past T read token T - 1 (stored nowhere): q's loads need no mask along the
            # tokens, nor along Di when EVEN_D (fewer registers, whole vectors, pipelined).
            q_rows = q_ptr + tl.minimum(offs_t, T - 1)[:, None] * stride_qt
            w_rows = w_ptr + tl.minimum(offs_t, T - 1) * stride_wt
            offs_d = tl.arange(0, DI_P)
            acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
            for h in range(0, HI):
                if EVEN_D:
                    q = tl.load(q_rows + h * stride_qh + offs_d[None, :] * stride_qd)
                else:
                    q = tl.load(q_rows + h * stride_qh + offs_d[None, :] * stride_qd, mask=(offs_d < DI)[None, :],
                                other=0.0)                                    # [BLOCK_T, DI_P]
                if FP32_DOT:
                    q = q.to(tl.float32)
                w = tl.load(w_rows + h * stride_wh).to(tl.float32) * scale   # [BLOCK_T]
                # bf16 x bf16 products are exact in fp32 and accumulate in fp32, like the reference.
                dots = tl.dot(q, k, input_precision="ieee")                  # [BLOCK_T, BLOCK_E]
                acc += tl.maximum(dots, 0.0) * w[:, None]
            if PACKED:          # a key's scale (> 0) commutes with the ReLU and the sum over heads
                acc = acc * row_scale[None, :]
            valid = _block_valid(cand_ptr, lo_ptr, hi_ptr, offs_t, offs_e, t_ok, e_ok, rows, stride_ct, stride_ce,
                                 PAGED)
            scores = tl.where(valid, acc, float("-inf"))
        tl.store(out_ptr + offs_t[:, None] * stride_ot + (offs_e - E0)[None, :], scores,
                 mask=t_ok[:, None] & e_ok[None, :])
    else:                   # tokens of different rows (requests, windows): one by one
        _tokens_one_by_one(q_ptr, w_ptr, keys_ptr, cand_ptr, req_ptr, lo_ptr, hi_ptr, out_ptr, t0, T, offs_e, e_ok, E0,
                           E, HI, DI, scale, pitch, stride_qt, stride_qh, stride_qd, stride_wt, stride_wh, stride_kn,
                           stride_kd, stride_ct, stride_ce, stride_ot, HI_P, DI_P, BLOCK_T, BLOCK_E, FP32_DOT, PAGED,
                           PER_PAGE, PACKED)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor | PagedRows,
                   block_e: int = BLOCK_E, weight_scale: float = 1.0, e0: int = 0, e1: int | None = None,
                   tiles: GemmTiles | None | str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] (x weight_scale), keys [N, Di] (or packed FP8: uint8
    [N, Di + 4]), cand [T, E] (-1 = absent) or a PagedRows of width E -> [T, e1 - e0] fp32: the
    scores of candidates [e0, e1) (all E by default), written into `out` when given (see
    scores_out). tiles: the tiled kernel's launch shape,
    None for the per-token kernel (block_e candidates a program), "auto": GEMM_TILES from
    GEMM_MIN_TOKENS tokens on (GEMM_TILES_FP8 for packed keys), else None (a function of T only:
    CUDA-graph safe)."""
    T, Hi, Di = q.shape
    packed = keys.dtype == torch.uint8          # FP8 keys [N, Di + 4] (dsv4/ops/kv_fp8.py)
    if packed and not _words_ok(keys, Di):
        raise ValueError("indexer_scores: packed FP8 keys need Di % 4 == 0 and 4-byte aligned contiguous rows")
    if tiles == "auto":
        tiles = (GEMM_TILES_FP8 if packed else GEMM_TILES) if T >= GEMM_MIN_TOKENS else None
    e1 = index_width(cand) if e1 is None else e1
    scores = scores_out(out, T, e1 - e0, q.device)
    if T == 0 or e1 <= e0:
        return scores
    if isinstance(cand, PagedRows):
        table, req, lo, hi = cand.pages, cand.req.contiguous(), cand.lo.contiguous(), cand.hi.contiguous()
        paged, per_page, pitch = True, cand.per_page, cand.pitch
    else:
        table = req = lo = hi = cand
        paged, per_page, pitch = False, 1, 1
    # tl.dot needs every dimension >= 16 on the GPU; the padding is masked.
    hi_p = max(16, triton.next_power_of_2(Hi))
    di_p = max(16, triton.next_power_of_2(Di))
    # Tensor-core dot for bf16/fp16 pairs; fp32 otherwise. Triton's CPU interpreter multiplies
    # the raw bits of 16-bit floats in tl.dot, so there both sides go up to fp32 first (the same
    # products: 16-bit x 16-bit is exact in fp32).
    # FP8 keys are unpacked to q's dtype in the kernel (exact), so they take q's dot.
    fp32_dot = ((q.dtype != keys.dtype and not packed) or q.dtype not in (torch.bfloat16, torch.float16)
                or os.environ.get("TRITON_INTERPRET") == "1")
    args = (q, weights, keys, table, req, lo, hi, scores)
    strides = (q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
               keys.stride(0), keys.stride(1), table.stride(0), table.stride(1), scores.stride(0))
    consts = dict(HI_P=hi_p, DI_P=di_p, FP32_DOT=fp32_dot, PAGED=paged, PER_PAGE=per_page, PACKED=packed)
    scale = Di ** -0.5 * weight_scale
    if tiles is None:
        n_eblk = triton.cdiv(e1 - e0, block_e)
        _scores_kernel[(T * n_eblk,)](*args, e0, e1, Hi, Di, n_eblk, scale, pitch, *strides, BLOCK_E=block_e,
                                      **consts, num_warps=NUM_WARPS)
    else:
        n_eblk = triton.cdiv(e1 - e0, tiles.block_e)
        _scores_gemm_kernel[(triton.cdiv(T, tiles.block_t) * n_eblk,)](
            *args, T, e0, e1, Hi, Di, n_eblk, scale, pitch, *strides, BLOCK_T=tiles.block_t,
            BLOCK_E=tiles.block_e, EVEN_D=Di == di_p, **consts, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, **({} if tiles.maxnreg is None else {"maxnreg": tiles.maxnreg}))
    return scores


def scores_out(out: torch.Tensor | None, T: int, n: int, device) -> torch.Tensor:
    """`out` if it is a [T, n] fp32 tensor with unit column stride (any row stride: the
    kernels write rows at out.stride(0)), else a ValueError; None: a new [T, n] tensor."""
    if out is None:
        return torch.empty((T, n), dtype=torch.float32, device=device)
    if out.shape != (T, n) or out.dtype != torch.float32 or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"indexer scores: out must be [{T}, {n}] float32 with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    return out


def _words_ok(keys: torch.Tensor, di: int) -> bool:
    """Packed rows the kernel reads as int32 words: whole words, 4-byte aligned (the cache's
    pools always are: rows of Di + 4 bytes from an aligned base)."""
    return (di % 4 == 0 and keys.shape[1] == di + 4 and keys.stride(1) == 1 and keys.stride(0) % 4 == 0
            and keys.data_ptr() % 4 == 0)
