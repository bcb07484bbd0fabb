"""Triton kernels for the routed experts at decode sizes (few (token, expert) pairs); the
definition is `routed_experts_loop` in dsv4/ops/moe.py.

GEMVs that stream each selected expert's weights once (a grouped GEMM costs far more here);
2-3 launches, no weight copies, no host sync: grids depend on T and k only (CUDA-graph safe).

1. `_up_gate_kernel`, one program per (pair p = t*k + j, tile of I), e = ids[p]:
     h[p] = silu(min(w1[e] @ x[t], L)) * clamp(w3[e] @ x[t], -L, L)   fp32, stored in x's dtype
   (as the reference rounds h before the down projection).
2. `_down_kernel`, one program per (token t, tile of H, split s), summing a contiguous share of
   the k * cdiv(I, BLOCK_I) (expert j, I-block) units in registers (no atomics):
     part[s, t] = sum_{units of s} weights[t, j] * (w2[ids[t, j]] @ h[t*k + j])          fp32
   SPLIT 1 writes out [T, H] in x's dtype; SPLIT > 1 writes fp32 partials [SPLIT, T, H] that
   `_sum_splits_kernel` adds in a fixed order (deterministic). Split because at T = 1 one split
   gives too few programs (512 at V4 sizes) to reach HBM bandwidth.

Shared expert (`shared=`): pair j == k of every token (p = t*(k+1) + j, h [T*(k+1), I]), weights
sw1/sw3 [I, H], sw2 [H, I], routing weight 1, chosen by pointer select (`_pair`, `_expert_matrix`),
summed with the routed experts in the down kernel's fp32 accumulator.

FP8 (W8A16, `scales=`): float8_e4m3fn tiles. A tile whose rows lie in one 128-row scale block
(the default tiles) has its scales folded into the activation vector (one convert + one FMA per
weight keeps the GEMV bandwidth-bound); other tiles are dequantised (quant_tiles). Both give the
load-time dequantised product exactly for power-of-two (E8M0) scales, as in released checkpoints.

MXFP4 (W4A16, uint8 weights + `scales=`): w1/w3 [E, I, H/2] + E8M0 bytes [E, I, H/32], w2
[E, H, I/2] + [E, H, I/32], read as int32 words (8 inputs, 16-byte loads) and never dequantised
into a tile: quant_tiles `_mxfp4_rows_dot` decodes each word into 8 fp32 e2m1 * 2^-14 (inline
PTX: fp16 bytes built four at a time, paired by prmt, converted; with the FMA 3.4 instructions
an element, 4.7-4.9 with the loop's loads and sums: `python -m scripts.sass_loops`) and
multiplies them with the activation, which comes in its `word_major` layout (fp32 [8, C/8],
nibble j of a run of words contiguous): x made so by one torch op, h stored so by the up-gate
kernel (its values rounded to x's dtype first, as the reference rounds h). Partial sums per
group of 32 inputs (one scale each) are added up once after the loop; the next tile's words are
loaded before the current one is decoded. The shared expert stays unquantised, read in a branch
of its own (`_mxfp4_pair_dot`). Tiles along the packed dim (BLOCK_H of up-gate, BLOCK_I of down)
are multiples of MXFP4_BLOCK; MXFP4 has its own defaults (MXFP4_UP_TILES, MXFP4_DOWN_TILES).

No tl.dot: fp32 products + tl.sum (bandwidth-bound anyway; keeps Triton's interpreter exact in
bf16). Expert offsets are int64 (e * I * H overflows int32 at V4 sizes). Figures:
docs/benchmarks.md.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..quant import kept_scale_shape, unpacked_shape, weight_format
from .quant_tiles import (FP4_GROUP, MXFP4_BLOCK, QBLOCK, _block_scale, _dequant_tile, _mxfp4_rows_dot,
                          _word_major_index, word_major)

# tile defaults: among the fastest at T = 1 and 8 in benchmarks/kernels/moe.py's H200 scan (docs/benchmarks.md)
UP_BLOCK_I, UP_BLOCK_H, UP_WARPS = 16, 128, 8
DOWN_BLOCK_H, DOWN_BLOCK_I, DOWN_WARPS = 16, 512, 4
# default SPLIT: the fewest giving >= this many down programs (V4 sizes: 2 at T = 1, else 1; the scan's best)
DOWN_MIN_PROGRAMS = 512
# FP8 down tiles and programs (split 8 at T = 1, 1 at T = 8): fastest in `benchmarks/kernels/moe_fp8.py
# --tune` on the H200 (docs/benchmarks.md); up-gate keeps the bf16 tiles, also fastest for FP8
FP8_DOWN_BLOCK_H, FP8_DOWN_BLOCK_I, FP8_DOWN_WARPS = 32, 128, 4
FP8_DOWN_MIN_PROGRAMS = 1024
# MXFP4 tiles (not yet scanned on the H200: `benchmarks/kernels/moe_mxfp4.py --tune`): 16 rows an
# iteration, 64 inputs a thread (two 16-byte word loads, as many prefetched): up-gate 256 columns of
# w1 and w3 (72 registers on sm_90: 7 programs an SM, T = 1's 768 in one wave), down 512 (104)
MXFP4_UP_TILES = (16, 256, 4)
MXFP4_DOWN_TILES = (16, 512, 4)
SUM_BLOCK = 1024
# the MXFP4 word decode's inline PTX only compiled (quant_tiles `_e2m1_word_f32`; its twin in the interpreter)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _pair(ids_ptr, p, K, SHARED: tl.constexpr):
    # pair p = t * (K + SHARED) + j of token t: j < K the routed expert e = ids[t*K + j],
    # j == K (SHARED only) the shared expert -> (t, index t*K + j into ids/weights, routed?, e)
    t = p // (K + SHARED)
    j = p % (K + SHARED)
    routed = j < K
    e = tl.load(ids_ptr + t * K + j, mask=routed, other=0)       # int64 scalar (0 for shared)
    return t, t * K + j, routed, e


@triton.jit
def _expert_matrix(w_ptr, sw_ptr, routed, e, stride_we, stride_row, stride_srow, SHARED: tl.constexpr):
    # -> (base pointer, row stride) of expert e's matrix in w [E, R, C], or of the shared
    # expert's sw [R, C] when not routed
    base = w_ptr + e * stride_we
    stride = stride_row
    if SHARED:
        base = tl.where(routed, base, sw_ptr)
        stride = tl.where(routed, stride_row, stride_srow)
    return base, stride


@triton.jit
def _dense_rows_dot(sw_base, stride_sw, rows, row_ok, c_lo, c_hi, C, v_ptr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """sum_c W[rows, c] * v[c] over the columns [c_lo, c_hi) of an unquantised matrix sw_base
    [R, C] (row stride stride_sw), v word-major (gathered back to input order) -> fp32
    [BLOCK_R, BLOCK_C/32], the sums in column 0 (the layout of `_mxfp4_rows_dot`)."""
    acc = tl.zeros((BLOCK_R, BLOCK_C // 32), dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        dense = tl.load(sw_base + rows[:, None] * stride_sw + cc[None, :], mask=row_ok[:, None] & (cc < C)[None, :],
                        other=0.0)
        v = tl.load(v_ptr + _word_major_index(cc, C), mask=cc < C, other=0.0)
        dot = tl.sum(dense.to(tl.float32) * v[None, :], axis=1)
        acc += tl.where(tl.arange(0, BLOCK_C // 32)[None, :] == 0, dot[:, None], 0.0)
    return acc


@triton.jit
def _mxfp4_pair_dot(base, s_base, sw_base, base2, s_base2, sw_base2, stride_row, stride_srow, stride_sw, rows,
                    row_ok, c_lo, c_hi, C, v_ptr, routed, SHARED: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr):
    """sum_c W[rows, c] * v[c] over the columns [c_lo, c_hi) (tiles of BLOCK_C) -> fp32
    [BLOCK_R, BLOCK_C/32] partial sums (to be added up along axis 1), for W and, TWO, a second
    matrix W2 (a pair of them; see quant_tiles `_mxfp4_rows_dot`): W a routed expert's MXFP4
    matrix (base at its int32 words [R, C/8], s_base at its E8M0 bytes; v_ptr at the word-major
    vector); SHARED: when the pair is the shared expert's (not routed), its unquantised matrix
    sw_base [R, C] (row stride stride_sw) instead (`_dense_rows_dot`). A branch on the pair's
    kind (uniform over the program): only one of the two is read."""
    if SHARED:
        if routed:
            acc, acc2 = _mxfp4_rows_dot(base, s_base, base2, s_base2, stride_row, stride_srow, rows, row_ok,
                                        c_lo, c_hi, C, v_ptr, BLOCK_R, BLOCK_C, TWO, ASM)
        else:
            acc = _dense_rows_dot(sw_base, stride_sw, rows, row_ok, c_lo, c_hi, C, v_ptr, BLOCK_R, BLOCK_C)
            acc2 = acc
            if TWO:
                acc2 = _dense_rows_dot(sw_base2, stride_sw, rows, row_ok, c_lo, c_hi, C, v_ptr, BLOCK_R, BLOCK_C)
    else:
        acc, acc2 = _mxfp4_rows_dot(base, s_base, base2, s_base2, stride_row, stride_srow, rows, row_ok,
                                    c_lo, c_hi, C, v_ptr, BLOCK_R, BLOCK_C, TWO, ASM)
    return acc, acc2


@triton.jit
def _up_gate_kernel(x_ptr, ids_ptr, w1_ptr, w3_ptr, sw1_ptr, sw3_ptr, h_ptr, K, H, I,
                    stride_we, stride_wi, stride_si, limit,
                    s1_ptr, s3_ptr, ss1_ptr, ss3_ptr, stride_se, stride_sr,
                    SHARED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    FP8: tl.constexpr = False, MXFP4: tl.constexpr = False, H_DTYPE: tl.constexpr = None,
                    ASM: tl.constexpr = False):
    # x [T, H]; ids [T*k] int64; w1/w3 [E, I, H], shared sw1/sw3 [I, H] (last dims contiguous)
    # -> h [T*(k+SHARED), I] (x's dtype), row p = pair p (see _pair). FP8: w1/w3/sw1/sw3 are
    # float8_e4m3fn with fp32 scales s1/s3 [E, cdiv(I, 128), cdiv(H, 128)] (strides stride_se,
    # stride_sr, last dim contiguous), ss1/ss3 the shared expert's [cdiv(I, 128), cdiv(H, 128)].
    # MXFP4: w1/w3 int32 words of the packed bytes [E, I, H/8] (row stride stride_wi words), E8M0
    # bytes s1/s3 [E, I, H/32]; sw1/sw3 unquantised; BLOCK_H a multiple of 64; x and h fp32 in
    # quant_tiles.word_major layout ([T, 8, H/8], [T*(k+SHARED), 8, I/8]), h's values those of
    # H_DTYPE (x's dtype: rounded as the reference rounds h)
    p = tl.program_id(0)
    i0 = tl.program_id(1) * BLOCK_I
    i = i0 + tl.arange(0, BLOCK_I)                                # [BLOCK_I]
    i_ok = i < I
    t, _, routed, e = _pair(ids_ptr, p, K, SHARED)
    if MXFP4:    # the routed expert's bytes and scales (expert 0's for the shared pair: unread)
        w1_base, stride_i = _expert_matrix(w1_ptr, sw1_ptr, routed, e, stride_we, stride_wi, stride_si, False)
        w3_base, _ = _expert_matrix(w3_ptr, sw3_ptr, routed, e, stride_we, stride_wi, stride_si, False)
        s1_base, _ = _expert_matrix(s1_ptr, ss1_ptr, routed, e, stride_se, stride_sr, stride_sr, False)
        s3_base, _ = _expert_matrix(s3_ptr, ss3_ptr, routed, e, stride_se, stride_sr, stride_sr, False)
    else:
        w1_base, stride_i = _expert_matrix(w1_ptr, sw1_ptr, routed, e, stride_we, stride_wi, stride_si, SHARED)
        w3_base, _ = _expert_matrix(w3_ptr, sw3_ptr, routed, e, stride_we, stride_wi, stride_si, SHARED)
    if FP8:
        s1_base, _ = _expert_matrix(s1_ptr, ss1_ptr, routed, e, stride_se, stride_sr, stride_sr, SHARED)
        s3_base, _ = _expert_matrix(s3_ptr, ss3_ptr, routed, e, stride_se, stride_sr, stride_sr, SHARED)
        si = tl.minimum(i, I - 1)[:, None]                        # scale rows in bounds
    x_row = x_ptr + t.to(tl.int64) * H
    w_off = i[:, None] * stride_i                                 # [BLOCK_I, 1]
    if MXFP4:    # partial sums per 32-column group of a tile, added up once after the loop
        gate_g, up_g = _mxfp4_pair_dot(w1_base, s1_base, sw1_ptr, w3_base, s3_base, sw3_ptr, stride_i, stride_sr,
                                       stride_si, i, i_ok, 0, H, H, x_row, routed, SHARED, BLOCK_I, BLOCK_H, True,
                                       ASM)
        gate, up = tl.sum(gate_g, axis=1), tl.sum(up_g, axis=1)
    else:
        gate = tl.zeros((BLOCK_I,), dtype=tl.float32)
        up = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)                       # [BLOCK_H]
            h_ok = hh < H
            xv = tl.load(x_row + hh, mask=h_ok, other=0.0).to(tl.float32)[None, :]   # [1, BLOCK_H]
            m = i_ok[:, None] & h_ok[None, :]
            w1 = tl.load(w1_base + w_off + hh[None, :], mask=m, other=0.0)   # [BLOCK_I, BLOCK_H]
            w3 = tl.load(w3_base + w_off + hh[None, :], mask=m, other=0.0)
            x1, x3 = xv, xv
            if FP8:
                sh = tl.minimum(hh, H - 1)[None, :]
                if QBLOCK % BLOCK_I == 0:       # the tile's rows share their scales: fold them into x
                    x1 = xv * _block_scale(s1_base, stride_sr, si, sh, i0, h0, True, QBLOCK % BLOCK_H == 0)
                    x3 = xv * _block_scale(s3_base, stride_sr, si, sh, i0, h0, True, QBLOCK % BLOCK_H == 0)
                else:
                    w1 = _dequant_tile(w1, s1_base, stride_sr, si, sh, i0, h0, h_ptr.dtype.element_ty,
                                       False, QBLOCK % BLOCK_H == 0)
                    w3 = _dequant_tile(w3, s3_base, stride_sr, si, sh, i0, h0, h_ptr.dtype.element_ty,
                                       False, QBLOCK % BLOCK_H == 0)
            gate += tl.sum(w1.to(tl.float32) * x1, axis=1)
            up += tl.sum(w3.to(tl.float32) * x3, axis=1)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up                         # silu(gate) * up
    if MXFP4:    # the down kernel's word-major vector
        tl.store(h_ptr + p.to(tl.int64) * I + _word_major_index(i, I),
                 h.to(H_DTYPE).to(tl.float32), mask=i_ok)
    else:
        tl.store(h_ptr + p.to(tl.int64) * I + i, h.to(h_ptr.dtype.element_ty), mask=i_ok)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, wt_ptr, w2_ptr, sw2_ptr, out_ptr, K, H, I,
                 stride_we, stride_wh, stride_sh, s2_ptr, ss2_ptr, stride_se, stride_sr,
                 SHARED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                 FP8: tl.constexpr = False, MXFP4: tl.constexpr = False, ASM: tl.constexpr = False):
    # h [T*KS, I], KS = k + SHARED pairs per token; ids [T*k] int64; weights [T*k] fp32;
    # w2 [E, H, I], shared sw2 [H, I] (last dims contiguous)
    # -> out [SPLIT, T, H]: x's dtype when SPLIT == 1 (the result), else fp32 partials.
    # FP8: w2/sw2 float8_e4m3fn, scales s2 [E, cdiv(H, 128), cdiv(I, 128)], ss2 without E.
    # MXFP4: w2 int32 words of the packed bytes [E, H, I/8], E8M0 bytes s2 [E, H, I/32]; sw2
    # unquantised in x's dtype; BLOCK_I a multiple of 64; h fp32, word-major (see _up_gate_kernel)
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_H
    n = n0 + tl.arange(0, BLOCK_H)                                # [BLOCK_H] output features
    n_ok = n < H
    s = tl.program_id(2)
    T = tl.num_programs(0)
    SPLIT = tl.num_programs(2)
    KS = K + SHARED
    n_blocks = tl.cdiv(I, BLOCK_I)                                # I-blocks per expert
    u_lo = s * (KS * n_blocks) // SPLIT                           # this split's units [u_lo, u_hi),
    u_hi = (s + 1) * (KS * n_blocks) // SPLIT                     # unit u = (j, block) = divmod(u, n_blocks)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(u_lo // n_blocks, tl.cdiv(u_hi, n_blocks)):    # experts this split touches
        p = t * KS + j
        _, q, routed, e = _pair(ids_ptr, p, K, SHARED)
        wt = tl.load(wt_ptr + q, mask=routed, other=1.0)         # fp32 routing weight (shared: 1)
        if MXFP4:    # the routed expert's bytes and scales (expert 0's for the shared pair: unread)
            w2_base, stride_h = _expert_matrix(w2_ptr, sw2_ptr, routed, e, stride_we, stride_wh, stride_sh, False)
            s2_base, _ = _expert_matrix(s2_ptr, ss2_ptr, routed, e, stride_se, stride_sr, stride_sr, False)
        else:
            w2_base, stride_h = _expert_matrix(w2_ptr, sw2_ptr, routed, e, stride_we, stride_wh, stride_sh, SHARED)
        if FP8:
            s2_base, _ = _expert_matrix(s2_ptr, ss2_ptr, routed, e, stride_se, stride_sr, stride_sr, SHARED)
        w_off = n[:, None] * stride_h                             # [BLOCK_H, 1]
        h_row = h_ptr + p.to(tl.int64) * I
        b_lo = tl.maximum(u_lo - j * n_blocks, 0)                # this split's I-blocks of expert j
        b_hi = tl.minimum(u_hi - j * n_blocks, n_blocks)
        if MXFP4:    # per 32-column group, added up once
            y_g, _ = _mxfp4_pair_dot(w2_base, s2_base, sw2_ptr, w2_base, s2_base, sw2_ptr, stride_h, stride_sr,
                                     stride_sh, n, n_ok, b_lo * BLOCK_I, b_hi * BLOCK_I, I, h_row, routed, SHARED,
                                     BLOCK_H, BLOCK_I, False, ASM)
            y = tl.sum(y_g, axis=1)
        else:
            y = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for b in range(b_lo, b_hi):
                ii = b * BLOCK_I + tl.arange(0, BLOCK_I)          # [BLOCK_I]
                i_ok = ii < I
                hv = tl.load(h_row + ii, mask=i_ok, other=0.0).to(tl.float32)[None, :]   # [1, BLOCK_I]
                w2 = tl.load(w2_base + w_off + ii[None, :], mask=n_ok[:, None] & i_ok[None, :],
                             other=0.0)                           # [BLOCK_H, BLOCK_I]
                if FP8:
                    sn, si = tl.minimum(n, H - 1)[:, None], tl.minimum(ii, I - 1)[None, :]
                    if QBLOCK % BLOCK_H == 0:   # the tile's rows share their scales: fold them into h
                        hv = hv * _block_scale(s2_base, stride_sr, sn, si, n0, b * BLOCK_I, True,
                                               QBLOCK % BLOCK_I == 0)
                    else:
                        w2 = _dequant_tile(w2, s2_base, stride_sr, sn, si, n0, b * BLOCK_I, h_ptr.dtype.element_ty,
                                           False, QBLOCK % BLOCK_I == 0)
                y += tl.sum(w2.to(tl.float32) * hv, axis=1)
        acc += wt * y
    row = (s * T + t).to(tl.int64) * H
    tl.store(out_ptr + row + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("N", "SPLIT"))
def _sum_splits_kernel(part_ptr, out_ptr, N, SPLIT, BLOCK: tl.constexpr):
    # part [SPLIT, N] fp32 -> out [N] (x's dtype), summed in split order
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * N + i, mask=ok, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def default_down_split(T: int, k: int, H: int, I: int, block_h: int = DOWN_BLOCK_H,
                       block_i: int = DOWN_BLOCK_I, min_programs: int = DOWN_MIN_PROGRAMS) -> int:
    """SPLIT for the down kernel: the fewest that gives >= min_programs programs, at most one
    (expert, I-block) unit per split. Depends on shapes only (no host sync, CUDA-graph safe)."""
    units = k * triton.cdiv(I, block_i)
    return max(1, min(units, triton.cdiv(min_programs, T * triton.cdiv(H, block_h))))


def expert_shapes(x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  w3: torch.Tensor, scales=None) -> tuple[int, int, int, int, int]:
    """(T, H, k, E, I) of x [T, H], ids [T, k], w1/w3 [E, I, H], w2 [E, H, I] (MXFP4: packed,
    see `unpacked_shape`), checked for the layout the kernels read: w1/w3 with equal strides,
    every last dim contiguous; with scales, see `check_scales`."""
    T, H = x.shape
    k = ids.shape[1]
    E, I, _ = w1.shape
    assert unpacked_shape(w1) == unpacked_shape(w3) == (E, I, H) and unpacked_shape(w2) == (E, H, I), \
        "expert weight shapes"
    assert w1.stride() == w3.stride() and w1.stride(2) == 1 and w2.stride(2) == 1, \
        "w1/w3 must share strides; the last dim of w1/w2/w3 must be contiguous"
    check_scales((w1, w2, w3), scales)
    return T, H, k, E, I


def scale_shape(w: torch.Tensor) -> tuple[int, ...]:
    """Shape of the scales of kept quantised w (dsv4.ops.quant.kept_scale_shape)."""
    return kept_scale_shape(tuple(w.shape), weight_format(w))


def scales_fit(ws, scales) -> bool:
    """Scales of weights ws: contiguous, of `scale_shape`, fp32 (FP8) or uint8 (MXFP4, whose
    unpacked columns are a multiple of 32)."""
    dtype = torch.uint8 if weight_format(ws[0]) == "mxfp4" else torch.float32
    return all(s.dtype == dtype and s.is_contiguous() and tuple(s.shape) == scale_shape(w)
               and (dtype != torch.uint8 or w.shape[-1] % (FP4_GROUP // 2) == 0) for w, s in zip(ws, scales))


def check_scales(ws, scales) -> None:
    """ws = (w1, w2, w3) all FP8 or all MXFP4 (`weight_format`) with scales that fit
    (`scales_fit`); or not quantised and scales None."""
    fmts = {weight_format(w) for w in ws}
    if scales is None:
        assert fmts == {None}, "quantised (FP8 / MXFP4) expert weights need their scales"
        return
    assert len(fmts) == 1 and None not in fmts, "scales given for weights that are not all FP8 or all MXFP4"
    assert scales_fit(ws, scales), \
        f"{fmts.pop()} scales: contiguous {[scale_shape(w) for w in ws]} " \
        f"(fp32 for FP8, uint8 for MXFP4), got {[(s.dtype, tuple(s.shape)) for s in scales]}"


def fusable_shared(w1: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   scales=None, shared_scales=None) -> bool:
    """Whether the shared expert (sw1/sw3 [I, H], sw2 [H, I]) can run as one more pair of the
    routed kernels: the routed experts' I and H, last dims contiguous, sw1/sw3 same strides, and
    the same dtype as the routed experts, FP8 both or neither (scales / shared_scales) with the
    scales of one layout (see check_scales); with MXFP4 routed experts, unquantised (x's dtype,
    shared_scales None)."""
    sw1, sw2, sw3 = shared
    _, I, H = unpacked_shape(w1)
    ok = (sw1.shape == sw3.shape == (I, H) and sw2.shape == (H, I) and sw1.dtype == sw2.dtype == sw3.dtype
          and sw1.stride() == sw3.stride() and sw1.stride(1) == 1 and sw2.stride(1) == 1)
    if weight_format(w1) == "mxfp4":
        return ok and weight_format(sw1) is None and shared_scales is None
    ok = ok and sw1.dtype == w1.dtype and (scales is None) == (shared_scales is None)
    return ok and (scales is None or scales_fit(shared, shared_scales))


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, limit: float, *,
                   shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   shared_scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   up_tiles: tuple[int, int, int] | None = None,
                   down_tiles: tuple[int, int, int] | None = None,
                   down_split: int | None = None) -> torch.Tensor:
    """Same semantics as dsv4.ops.moe.routed_experts_loop. x [T, H]; weights [T, k] fp32;
    ids [T, k]; w1/w3 [E, I, H]; w2 [E, H, I] -> [T, H] in x's dtype.

    shared = (sw1, sw2, sw3) adds the shared expert (dsv4.ops.moe.dense_swiglu, see
    `fusable_shared`) as a (k+1)-th pair of every token with weight 1: same two launches (+ the
    split sum), its output summed with the routed ones in fp32 and rounded once.
    scales / shared_scales: fp32 block scales of FP8 (float8_e4m3fn) weights, or the E8M0 bytes
    of MXFP4 (packed uint8) routed weights (`check_scales`; the shared expert then unquantised),
    dequantised tile by tile in the kernels.
    up_tiles = (BLOCK_I, BLOCK_H, num_warps) and down_tiles = (BLOCK_H, BLOCK_I, num_warps)
    override the defaults (tuning); down_split (>= 1) overrides `default_down_split`."""
    T, H, k, E, I = expert_shapes(x, ids, w1, w2, w3, scales)
    assert shared is None or fusable_shared(w1, shared, scales, shared_scales), "shared expert: see fusable_shared"
    has_shared = shared is not None
    sw1, sw2, sw3 = shared if has_shared else (w1, w2, w3)                  # unused without
    fp8, mxfp4 = weight_format(w1) == "fp8", weight_format(w1) == "mxfp4"
    assert not (mxfp4 and has_shared) or sw1.dtype == x.dtype, "MXFP4: the shared expert in x's dtype"
    quant = scales is not None
    s1, s2, s3 = scales if quant else (x, x, x)                            # unused without
    ss1, ss2, ss3 = shared_scales if fp8 and has_shared else (s1, s2, s3)
    ks = k + has_shared                                                     # pairs per token
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0 or ks == 0:
        return out.zero_()
    x = x.contiguous()
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()                   # [T*k]
    flat_w = weights.reshape(-1).to(torch.float32).contiguous()               # [T*k]
    h = torch.empty((T * ks, I), dtype=torch.float32 if mxfp4 else x.dtype, device=x.device)   # swiglu

    bi, bh, nw = up_tiles or (MXFP4_UP_TILES if mxfp4 else (UP_BLOCK_I, UP_BLOCK_H, UP_WARPS))
    dh, di, dnw = down_tiles or ((FP8_DOWN_BLOCK_H, FP8_DOWN_BLOCK_I, FP8_DOWN_WARPS) if fp8
                                 else MXFP4_DOWN_TILES if mxfp4 else (DOWN_BLOCK_H, DOWN_BLOCK_I, DOWN_WARPS))
    x_in = x
    if mxfp4:    # the kernels read the packed bytes as int32 words (8 inputs each; H, I % 32 == 0)
        w1, w2, w3 = (w.view(torch.int32) for w in (w1, w2, w3))
        x_in = word_major(x, torch.empty((T, 8, H // 8), dtype=torch.float32, device=x.device))
    assert not mxfp4 or bh % MXFP4_BLOCK == di % MXFP4_BLOCK == 0, \
        f"MXFP4: BLOCK_H of up-gate and BLOCK_I of down (the packed dims) must be multiples of {MXFP4_BLOCK}"
    _up_gate_kernel[(T * ks, triton.cdiv(I, bi))](
        x_in, flat_ids, w1, w3, sw1, sw3, h, k, H, I, w1.stride(0), w1.stride(1), sw1.stride(0), float(limit),
        s1, s3, ss1, ss3, s1.stride(0) if quant else 0, s1.stride(1) if quant else 0,
        SHARED=has_shared, BLOCK_I=bi, BLOCK_H=bh, FP8=fp8, MXFP4=mxfp4, H_DTYPE=TL_DTYPES.get(x.dtype),
        ASM=mxfp4 and not INTERPRETING, num_warps=nw)
    split = down_split or default_down_split(T, ks, H, I, dh, di, FP8_DOWN_MIN_PROGRAMS if fp8 else DOWN_MIN_PROGRAMS)
    part = out if split == 1 else torch.empty((split, T, H), dtype=torch.float32, device=x.device)
    _down_kernel[(T, triton.cdiv(H, dh), split)](
        h, flat_ids, flat_w, w2, sw2, part, k, H, I, w2.stride(0), w2.stride(1), sw2.stride(0),
        s2, ss2, s2.stride(0) if quant else 0, s2.stride(1) if quant else 0,
        SHARED=has_shared, BLOCK_H=dh, BLOCK_I=di, FP8=fp8, MXFP4=mxfp4, ASM=mxfp4 and not INTERPRETING,
        num_warps=dnw)
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(T * H, SUM_BLOCK),)](part, out, T * H, split, BLOCK=SUM_BLOCK)
    return out
