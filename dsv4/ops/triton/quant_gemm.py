"""Triton GEMMs over FP8 weights with 128x128 block scales; the definitions are `fp8_linear`,
`fp8_linear_w8a8` and `act_quant` in dsv4/ops/quant_gemm.py.

`_fp8_gemm_kernel`, one program per (M-tile, N-tile, K-split): the K loop walks 128-input
blocks (BLOCK_K = 128, the scale block), so a weight tile [128, BLOCK_N] (BLOCK_N dividing 128)
has one scale. Per block:
  W8A16: part = a @ bf16(w)   (the FP8 codes converted for the tensor cores, exactly)
  W8A8:  part = a8 @ w        (FP8 x FP8 tensor-core product; a8, its scales xs [M, K/128])
  acc += part * scale (* xs[row] for W8A8)                                  fp32
Power-of-two scales make `part * scale` the product with the dequantised weight (up to the
order of the fp32 sums). SPLIT > 1 writes fp32 partials [SPLIT, M, N] summed in a fixed order
(deterministic; small M has too few tiles to stream the weight at HBM speed otherwise).
Grids and tiles depend on shapes only (CUDA-graph safe). Groups (o-groups, block-diagonal):
output columns [g*N_G, (g+1)*N_G) read x columns [g*K, (g+1)*K); a tile never spans groups.

`_act_quant_kernel`: per row and 128-input group, the power-of-two scale from amax's bits and
the codes x * (1 / s) rounded to e4m3 (exact scaling; one rounding, as the reference).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

ACT_GROUP = 128
TARGET_PROGRAMS = 264       # about two waves of the H200's 132 SMs: split K until a GEMM has them
# Triton's interpreter multiplies the raw bits in a bf16 / fp8 tl.dot: upcast there (tests only)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("M", "kb_per_split"))
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, N_G, K, stride_xm, stride_xsm,
                     stride_wsn, kb_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     A_FP8: tl.constexpr, FP32_DOT: tl.constexpr, PARTIAL: tl.constexpr):
    # x [M, G*K] (row stride stride_xm; A_FP8: float8_e4m3fn with scales xs [M, G*K/128]);
    # w [N, K] float8_e4m3fn contiguous, ws [cdiv(N, 128), cdiv(K, 128)] fp32 (row stride
    # stride_wsn) -> out [M, N] (x's dtype), or PARTIAL: fp32 [SPLIT, M, N]
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n0 = pid_n * BLOCK_N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    g = n0 // N_G                                                     # the tile's group
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_xm + g * K
    w_cols = w_ptr + tl.where(col_ok, cols, 0).to(tl.int64)[None, :] * K        # [1, BN]
    ws_row = ws_ptr + (n0 // 128) * stride_wsn
    xs_rows = xs_ptr + tl.where(row_ok, rows, 0).to(tl.int64) * stride_xsm + g * tl.cdiv(K, BLOCK_K)
    n_kb = tl.cdiv(K, BLOCK_K)
    kb_lo = pid_s * kb_per_split
    kb_hi = tl.minimum(kb_lo + kb_per_split, n_kb)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        k = kb * BLOCK_K + kk
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)   # [BM, BK]
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None], other=0.0)                    # [BK, BN] fp8
        if FP32_DOT:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif A_FP8:
            part = tl.dot(a, b)
        else:
            part = tl.dot(a, b.to(a.dtype))
        scale = tl.load(ws_row + kb)
        if A_FP8:
            acc += part * (tl.load(xs_rows + kb, mask=row_ok, other=0.0)[:, None] * scale)
        else:
            acc += part * scale
    if PARTIAL:
        out = out_ptr + (pid_s * M + rows).to(tl.int64)[:, None] * N + cols[None, :]
    else:
        out = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _round_e4m3(v):
    """fp32 v (|v| <= 448) rounded to nearest even on the e4m3 grid, in fp32: 3 mantissa bits
    for normals (|v| >= 2^-6), multiples of 2^-9 below (adding 2^14 rounds there, fp32 RNE)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    a = tl.abs(v)
    sub = (a + 16384.0) - 16384.0
    return tl.where(a >= 2.0 ** -6, normal, tl.where(v < 0, -sub, sub))


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("M",))
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, n_groups,
                      BLOCK_M: tl.constexpr, GROUP: tl.constexpr, EMULATE_RNE: tl.constexpr):
    # x [M, K] (row stride stride_xm) -> q [M, K] float8_e4m3fn, s [M, n_groups] fp32
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    k = g * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (k < K)[None, :]
    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)                  # [BM]
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)   # 448 = 1.75 * 2^8
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)               # 1 / scale, exact
    q = v * inv[:, None]
    if EMULATE_RNE:     # the interpreter truncates fp32 -> e4m3 casts: round on the grid first
        q = _round_e4m3(q)
    q = q.to(tl.float8e4nv)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * K + k[None, :], q, mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * n_groups + g, scale, mask=rows < M)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, cdiv(K, 128)])."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(K, ACT_GROUP)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, groups), dtype=torch.float32, device=x.device)
    if M:
        bm = 16
        _act_quant_kernel[(triton.cdiv(M, bm), groups)](x, q, s, M, K, x.stride(0), groups,
                                                          BLOCK_M=bm, GROUP=ACT_GROUP,
                                                          EMULATE_RNE=INTERPRETING, num_warps=4)
    return q, s


def default_tiles(M: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by the rows M: weight-streaming tiles at decode
    sizes, 128 x 128 from 65 rows. BLOCK_N divides 128 (one weight scale per tile)."""
    if M <= 64:
        return max(16, triton.next_power_of_2(M)), 64, 4, 4
    return 128, 128, 8, 3


def default_split(M: int, N: int, K: int, block_m: int, block_n: int) -> int:
    """K-splits giving about TARGET_PROGRAMS programs (at most one per 128-input block)."""
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return max(1, min(triton.cdiv(K, ACT_GROUP), triton.cdiv(TARGET_PROGRAMS, tiles)))


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, groups: int = 1,
             x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             tiles: tuple[int, int, int, int] | None = None, split: int | None = None) -> torch.Tensor:
    """x [..., G*K] (bf16 / fp32: W8A16; float8_e4m3fn with x_scale [..., G*K/128]: W8A8) times
    w [N, K] float8_e4m3fn with fp32 128x128 block scales, per group -> [..., N] in out_dtype
    (default x's dtype). tiles = (BLOCK_M, BLOCK_N, num_warps, num_stages) and split override
    `default_tiles` / `default_split` (tuning)."""
    N, K = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    a_fp8 = x_scale is not None
    out_dtype = out_dtype or x.dtype
    assert w.is_contiguous() and scale.stride(1) == 1, "fp8_gemm: contiguous weight and scales"
    assert groups == 1 or K % ACT_GROUP == 0, "fp8_gemm: groups need K a multiple of 128"
    assert not a_fp8 or x2.dtype == torch.float8_e4m3fn, "fp8_gemm: x_scale needs FP8 activations"
    bm, bn, nw, ns = tiles or default_tiles(M)
    n_g = N // groups
    if tiles is None:
        bn = math.gcd(bn, n_g)            # a tile within one group (V4: 1024-row groups)
    assert 128 % bn == 0 and n_g % bn == 0, f"fp8_gemm: BLOCK_N {bn} must divide 128 and each group's {n_g} rows"
    n_kb = triton.cdiv(K, ACT_GROUP)
    split = split or default_split(M, N, K, bm, bn)
    per_split = triton.cdiv(n_kb, split)
    split = triton.cdiv(n_kb, per_split)
    out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return out.view(*lead, N)
    xs = x_scale.reshape(M, -1) if a_fp8 else scale                     # unused without
    part = out if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    fp32_dot = INTERPRETING or x2.dtype == torch.float32
    _fp8_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
        x2, xs, w, scale, part, M, N, n_g, K, x2.stride(0), xs.stride(0), scale.stride(0), per_split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=ACT_GROUP, A_FP8=a_fp8, FP32_DOT=fp32_dot, PARTIAL=split > 1,
        num_warps=nw, num_stages=ns)
    if split > 1:
        torch.sum(part, dim=0, out=out) if out_dtype == torch.float32 else out.copy_(part.sum(0))
    return out.view(*lead, N)
