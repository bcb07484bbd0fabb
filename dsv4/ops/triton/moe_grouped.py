"""Triton grouped GEMMs for the routed experts at prefill sizes (many (token, expert) pairs);
the definition is `routed_experts_loop` in dsv4/ops/moe.py.

The P = T*k pairs are sorted by expert: sorted row r is pair order[r], token order[r] // k; one
expert's rows are contiguous and an M-tile never spans two experts. No host sync: grids depend
on P, E and the tiles only (CUDA-graph safe).

1. `schedule` (moe_schedule.py, one launch): order [P] and, per tile slot s < S = cdiv(P,
   BLOCK_M) + min(E, P), the (expert, first row, end row) of one M-tile; spare slots have
   first >= end and return at once.
2. `_up_gate_kernel`, one program per (slot, tile of I), x rows gathered through order:
     h[r] = silu(min(x[tok] @ w1[e]^T, L)) * clamp(x[tok] @ w3[e]^T, -L, L)   x's dtype, sorted
3. `_down_kernel`, one program per (slot, tile of H), rows scattered back (each written once):
     y[order[r]] = weights[order[r]] * (h[r] @ w2[e]^T)                       x's dtype, pair order
4. out[t] = sum_j y[t*k + j] in fp32, cast once (no atomics anywhere: deterministic).

bf16 tl.dot, fp32 accumulation; rounding differs from the definition only by bf16 steps (it
rounds gate, up, h and each expert output; here h and each weighted output). FP8 (`scales=`):
each weight tile times its 128x128 block scales in fp32, rounded to x's dtype, then tl.dot.
MXFP4: packed bytes [BLOCK_K/2, BLOCK_N] + E8M0 bytes [BLOCK_K/32, BLOCK_N], decoded along K
(axis 0); BLOCK_K a multiple of MXFP4_BLOCK. Both dequantise in quant_tiles.
Grouped program order (GROUP_M slots, then the next N tile) keeps an expert's weight tiles and
the group's x rows in L2 while reused. Expert offsets are int64 (e * I * H overflows int32).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .moe import expert_shapes, weight_format
from .moe_schedule import schedule
from .quant_tiles import MXFP4_BLOCK, QBLOCK, _dequant_tile, _mxfp4_tile

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of (up-gate, down) by the mean rows per
# expert P / E (1.5 at a batch-64 decode step, 12 at 512 tokens, 96 at 4k, 384 at 16k at
# V4-Flash shapes); the best of `benchmarks/kernels/moe.py --part prefill --tune` on the H200
SMALL_M_TILES = ((64, 128, 64, 8, 4), (64, 128, 64, 4, 5))
MID_M_TILES = ((128, 128, 64, 8, 4), (64, 256, 64, 8, 3))
LARGE_M_TILES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3))
MID_M_ROWS = 32             # P / E from which MID_M_TILES apply
LARGE_M_ROWS = 256          # P / E from which LARGE_M_TILES apply
GROUP_M = 8                 # M-tile slots per program group (L2 reuse of weights and x rows)
GROUP_M_MANY_ROWS = 16      # ... from MID_M_ROWS rows per expert (faster at 4k tokens, docs/benchmarks.md)
# Triton's interpreter multiplies the raw uint16 bits in a bf16 tl.dot: upcast there (tests only)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile(sched_ptr, S, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (expert, first row, end row, columns [BLOCK_N]) in grouped order."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(S - first, GROUP_M)
    slot = first + (pid % per_group) % size
    cols = (pid % per_group) // size * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(sched_ptr + slot).to(tl.int64)
    return e, tl.load(sched_ptr + S + slot), tl.load(sched_ptr + 2 * S + slot), cols


@triton.jit
def _load_k(ptrs, k0, K, kk, K_AXIS: tl.constexpr, EVEN_K: tl.constexpr):
    """A tile at depth k0 whose axis K_AXIS runs along K; rows/cols out of range were clamped
    in bounds by the caller (their results are never stored), so only the K tail is masked."""
    if EVEN_K:
        tile = tl.load(ptrs)
    elif K_AXIS == 1:
        tile = tl.load(ptrs, mask=(k0 + kk < K)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs, mask=(k0 + kk < K)[:, None], other=0.0)
    return tile


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b: bf16 tensor-core dot with fp32 accumulation, or an exact fp32 dot."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mxfp4_k_tile(w_ptrs, k0, K, kk, s_ptr, stride_sr, n_rows, EVEN_K: tl.constexpr, out_dtype: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """MXFP4 weight tile [BLOCK_K, BLOCK_N] at depth k0 (K along axis 0, packed along it) in
    out_dtype: w_ptrs point at its packed bytes [BLOCK_K/2, BLOCK_N] (kk = arange(BLOCK_K/2)),
    s_ptr at the expert's E8M0 bytes [N, K/32] (n_rows [1, BLOCK_N] the weight rows, clamped in
    bounds); dequantised by quant_tiles._mxfp4_tile."""
    q = _load_k(w_ptrs, k0 // 2, K // 2, kk, 0, EVEN_K)
    ks = tl.arange(0, BLOCK_K // 32)                                    # scale rows along K
    sb = _load_k(s_ptr + n_rows * stride_sr + (k0 // 32 + ks)[:, None], k0 // 32, K // 32, ks, 0, EVEN_K)
    return _mxfp4_tile(q, sb, out_dtype, 0, BLOCK_K, BLOCK_N)


@triton.jit
def _dot_w(a, w_ptrs, acc, k0, K, kk, s_ptr, stride_sr, n_rows, n0, FP8: tl.constexpr, EVEN_K: tl.constexpr,
           FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr = False):
    """acc + a @ W for the weight tile W [BLOCK_K, BLOCK_N] at depth k0 (K along axis 0). FP8: W
    dequantised with the expert's scales s_ptr ([cdiv(N, 128), cdiv(K, 128)], n_rows [1, BLOCK_N]
    the weight rows, clamped in bounds, n0 the first) and rounded to a's dtype. MXFP4: likewise
    (`_mxfp4_k_tile`; w_ptrs at its packed bytes, kk = arange(BLOCK_K/2))."""
    if MXFP4:
        w = _mxfp4_k_tile(w_ptrs, k0, K, kk, s_ptr, stride_sr, n_rows, EVEN_K, a.dtype, BLOCK_N, BLOCK_K)
    else:
        w = _load_k(w_ptrs, k0, K, kk, 0, EVEN_K)
        if FP8:
            w = _dequant_tile(w, s_ptr, stride_sr, n_rows, tl.minimum(k0 + kk, K - 1)[:, None], n0, k0, a.dtype,
                              QBLOCK % BLOCK_N == 0, QBLOCK % BLOCK_K == 0)
    return _dot(a, w, acc, FP32_DOT)


@triton.jit
def _weight_tile(cols, col_ok, stride_w, kk, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr):
    """Where the weight tiles [BLOCK_K, BLOCK_N] of output columns `cols` lie in an expert's
    matrix [N, K] (row stride stride_w, K contiguous) -> (kw: the K offsets of a tile's rows,
    kk = arange(BLOCK_K) or MXFP4 arange(BLOCK_K/2) (packed bytes, two inputs each); w_off
    [BK, BN] int32 offsets of the first tile (< N*K); n_rows [1, BN] the weight rows, clamped in
    bounds; n0 the first column of the tile)."""
    kw = kk
    if MXFP4:
        kw = tl.arange(0, BLOCK_K // 2)
    n_rows = tl.where(col_ok, cols, 0)[None, :]
    return kw, n_rows * stride_w + kw[:, None], n_rows, tl.min(cols, axis=0)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("S", "KP"))
def _up_gate_kernel(x_ptr, order_ptr, sched_ptr, w1_ptr, w3_ptr, h_ptr, S, KP, H, I,
                    stride_we, stride_wi, limit, s1_ptr, s3_ptr, stride_se, stride_sr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
                    FP8: tl.constexpr = False, MXFP4: tl.constexpr = False):
    # x [T, H]; order [P] int32 (pair of each sorted row); w1/w3 [E, I, H] (last dim contiguous)
    # -> h [P, I] in x's dtype, rows in sorted order. FP8: w1/w3 float8_e4m3fn, fp32 scales
    # s1/s3 [E, cdiv(I, 128), cdiv(H, 128)] (strides stride_se, stride_sr, last dim contiguous).
    # MXFP4: w1/w3 packed uint8 [E, I, H/2] (row stride stride_wi), E8M0 bytes s1/s3 [E, I, H/32]
    e, r0, r1, cols = _tile(sched_ptr, S, I, BLOCK_N, GROUP_M)
    if r0 >= r1:
        return
    rows = r0 + tl.arange(0, BLOCK_M)                                  # [BLOCK_M] sorted rows
    row_ok = rows < r1
    col_ok = cols < I
    tok = tl.load(order_ptr + tl.where(row_ok, rows, r0)) // KP         # token of each row
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * H + kk[None, :]                 # [BM, BK]
    w1_ptr += e * stride_we                                             # expert e's [I, H]
    w3_ptr += e * stride_we
    kw, w_off, n_rows, n0 = _weight_tile(cols, col_ok, stride_wi, kk, BLOCK_K, MXFP4)
    s1_ptr += e * stride_se                                             # expert e's scales
    s3_ptr += e * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = _load_k(a_ptrs, k0, H, kk, 1, EVEN_K)
        gate = _dot_w(a, w1_ptr + w_off, gate, k0, H, kw, s1_ptr, stride_sr, n_rows, n0, FP8, EVEN_K,
                      FP32_DOT, BLOCK_N, BLOCK_K, MXFP4)
        up = _dot_w(a, w3_ptr + w_off, up, k0, H, kw, s3_ptr, stride_sr, n_rows, n0, FP8, EVEN_K,
                    FP32_DOT, BLOCK_N, BLOCK_K, MXFP4)
        a_ptrs += BLOCK_K
        w_off += kw.shape[0]
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up                               # silu(gate) * up
    out = h_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("S",))
def _down_kernel(h_ptr, order_ptr, wt_ptr, sched_ptr, w2_ptr, y_ptr, S, H, I,
                 stride_we, stride_wh, s2_ptr, stride_se, stride_sr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr,
                 FP8: tl.constexpr = False, MXFP4: tl.constexpr = False):
    # h [P, I] sorted rows; order [P] int32; weights [P] fp32 in pair order; w2 [E, H, I]
    # (last dim contiguous) -> y [P, H] in x's dtype, rows in pair order. FP8: w2 float8_e4m3fn,
    # fp32 scales s2 [E, cdiv(H, 128), cdiv(I, 128)]. MXFP4: w2 packed uint8 [E, H, I/2], E8M0
    # bytes s2 [E, H, I/32]
    e, r0, r1, cols = _tile(sched_ptr, S, H, BLOCK_N, GROUP_M)
    if r0 >= r1:
        return
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    col_ok = cols < H
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + tl.where(row_ok, rows, r0).to(tl.int64)[:, None] * I + kk[None, :]   # [BM, BK]
    w2_ptr += e * stride_we                                             # expert e's [H, I]
    kw, w_off, n_rows, n0 = _weight_tile(cols, col_ok, stride_wh, kk, BLOCK_K, MXFP4)
    s2_ptr += e * stride_se                                             # expert e's scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = _load_k(a_ptrs, k0, I, kk, 1, EVEN_K)
        acc = _dot_w(a, w2_ptr + w_off, acc, k0, I, kw, s2_ptr, stride_sr, n_rows, n0, FP8, EVEN_K,
                     FP32_DOT, BLOCK_N, BLOCK_K, MXFP4)
        a_ptrs += BLOCK_K
        w_off += kw.shape[0]
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    wt = tl.load(wt_ptr + pair, mask=row_ok, other=0.0)                 # fp32 routing weight
    out = y_ptr + pair.to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(out, (acc * wt[:, None]).to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def default_tiles(P: int, E: int, dtype: torch.dtype, mxfp4: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(up-gate, down) tiles for P pairs over E experts; shapes only (no host sync). fp32 inputs
    halve BLOCK_K (not below MXFP4_BLOCK for MXFP4 weights) and keep <= 3 stages (their tiles
    take twice the shared memory)."""
    tiles = (LARGE_M_TILES if P >= LARGE_M_ROWS * E else MID_M_TILES if P >= MID_M_ROWS * E
             else SMALL_M_TILES)
    if dtype == torch.float32:
        min_k = MXFP4_BLOCK if mxfp4 else 1
        tiles = tuple((bm, bn, max(bk // 2, min_k), nw, min(ns, 3)) for bm, bn, bk, nw, ns in tiles)
    return tiles


def routed_experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                           w2: torch.Tensor, w3: torch.Tensor, limit: float, *,
                           up_tiles: tuple[int, ...] | None = None,
                           down_tiles: tuple[int, ...] | None = None,
                           group_m: int | None = None,
                           scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Same semantics as dsv4.ops.moe.routed_experts_loop. x [T, H]; weights [T, k] fp32;
    ids [T, k]; w1/w3 [E, I, H]; w2 [E, H, I] -> [T, H] in x's dtype.

    up_tiles / down_tiles = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) override the
    `default_tiles` (tuning); BLOCK_* >= 16 on the GPU (tl.dot). scales: fp32 block scales of
    FP8 (float8_e4m3fn) weights or E8M0 bytes of MXFP4 (packed uint8) ones (moe.check_scales),
    dequantised tile by tile in the kernels (MXFP4: BLOCK_K a multiple of MXFP4_BLOCK)."""
    T, H, k, E, I = expert_shapes(x, ids, w1, w2, w3, scales)
    fp8, mxfp4 = weight_format(w1) == "fp8", weight_format(w1) == "mxfp4"
    quant = scales is not None
    s1, s2, s3 = scales if quant else (x, x, x)        # unused without
    if T == 0 or k == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    P = T * k
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()
    flat_w = weights.reshape(-1).to(torch.float32).contiguous()        # [P], pair order
    fp32_dot = x.dtype == torch.float32 or INTERPRETING
    default_up, default_down = default_tiles(P, E, x.dtype, mxfp4)
    up_tiles, down_tiles = up_tiles or default_up, down_tiles or default_down
    assert not mxfp4 or up_tiles[2] % MXFP4_BLOCK == down_tiles[2] % MXFP4_BLOCK == 0, \
        f"MXFP4: BLOCK_K (along the packed dim) must be a multiple of {MXFP4_BLOCK}"
    group_m = group_m or (GROUP_M_MANY_ROWS if P >= MID_M_ROWS * E else GROUP_M)

    bm, bn, bk, nw, ns = up_tiles
    order, sched = schedule(flat_ids, E, bm)
    S = sched.shape[1]
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)           # sorted rows
    _up_gate_kernel[(S * triton.cdiv(I, bn),)](
        x, order, sched, w1, w3, h, S, k, H, I, w1.stride(0), w1.stride(1), float(limit),
        s1, s3, s1.stride(0) if quant else 0, s1.stride(1) if quant else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, EVEN_K=H % bk == 0, FP32_DOT=fp32_dot,
        FP8=fp8, MXFP4=mxfp4, num_warps=nw, num_stages=ns)

    bm_down, bn, bk, nw, ns = down_tiles
    if bm_down != bm:
        order, sched = schedule(flat_ids, E, bm_down)
        S = sched.shape[1]
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)           # pair order
    _down_kernel[(S * triton.cdiv(H, bn),)](
        h, order, flat_w, sched, w2, y, S, H, I, w2.stride(0), w2.stride(1),
        s2, s2.stride(0) if quant else 0, s2.stride(1) if quant else 0,
        BLOCK_M=bm_down, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, EVEN_K=I % bk == 0, FP32_DOT=fp32_dot,
        FP8=fp8, MXFP4=mxfp4, num_warps=nw, num_stages=ns)
    return y.view(T, k, H).sum(1, dtype=torch.float32).to(x.dtype)
