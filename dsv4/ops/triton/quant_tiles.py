"""Dequantisation of quantised weight tiles inside Triton kernels (the decode GEMVs of moe.py,
the grouped GEMMs of moe_grouped.py); the formats are defined by dsv4/model/quant.py
(`dequant_fp8`, `dequant_fp4`).

FP8 (W8A16): float8_e4m3fn [R, C] with fp32 scales [cdiv(R, 128), cdiv(C, 128)] (QBLOCK blocks).
`_block_scale` fetches a tile's scales (one, a vector or a gather, by its alignment);
`_dequant_tile` multiplies in fp32 and rounds to the activation dtype.

MXFP4 (W4A16): e2m1 values (magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}) packed two per uint8 along
the last (input) dim, low nibble = even input: bytes [R, C/2]; one E8M0 byte b per FP4_GROUP = 32
inputs: [R, C/32], scale 2^(b - 127) (b = 255 reads as inf, as dsv4.ops.quant.e8m0_to_float).
Tiles along the packed dim are multiples of MXFP4_BLOCK.

Invariants (the tests check them bit for bit in Triton's interpreter):
- a dequantised tile equals the load-time dequantisation: fp32 w * scale rounded to the dtype;
- e2m1 and E8M0 are decoded from their bits (no tables, no transcendentals), and every
  e2m1 * 2^(b - 127) is exact in fp32 (or inf);
- for power-of-two (E8M0) FP8 scales w * s is exact too, which lets the decode GEMVs fold the
  scales into the activation vector.
"""
from __future__ import annotations

import triton
import triton.language as tl

QBLOCK = tl.constexpr(128)      # FP8 scale block (rows and columns)
FP4_GROUP = 32                  # MXFP4: inputs per E8M0 scale byte
MXFP4_BLOCK = 64                # MXFP4: tiles along the packed dim are multiples of this


@triton.jit
def _block_scale(s_ptr, stride_sr, r, c, r0, c0, R_UNIFORM: tl.constexpr, C_UNIFORM: tl.constexpr):
    """FP8 scales of a weight tile: s_ptr is the matrix's fp32 scales [cdiv(R, 128), cdiv(C, 128)]
    (row stride stride_sr); r / c are the tile's weight row / column indices, in bounds (clamped
    by the caller) and shaped to broadcast to the tile (e.g. [BR, 1] and [1, BC]); r0 / c0 the
    first of them. R_UNIFORM: every r lies in r0's 128-block (the tile's rows start at a multiple
    of a size dividing 128), C_UNIFORM the same for c; then one scale serves that axis. Returns
    the scales broadcastable to the tile."""
    if R_UNIFORM:
        base = s_ptr + (r0 // QBLOCK) * stride_sr
        if C_UNIFORM:
            sc = tl.load(base + c0 // QBLOCK)                             # one block: a scalar
        else:
            sc = tl.load(base + c // QBLOCK)
    else:
        if C_UNIFORM:
            sc = tl.load(s_ptr + (r // QBLOCK) * stride_sr + c0 // QBLOCK)
        else:
            sc = tl.load(s_ptr + (r // QBLOCK) * stride_sr + c // QBLOCK)   # a gather per element
    return sc


@triton.jit
def _dequant_tile(w, s_ptr, stride_sr, r, c, r0, c0, out_dtype: tl.constexpr,
                  R_UNIFORM: tl.constexpr, C_UNIFORM: tl.constexpr):
    """float8_e4m3fn tile w -> w * scale in fp32, rounded to out_dtype."""
    sc = _block_scale(s_ptr, stride_sr, r, c, r0, c0, R_UNIFORM, C_UNIFORM)
    return (w.to(tl.float32) * sc).to(out_dtype)


@triton.jit
def _e2m1(qi, SHIFT: tl.constexpr):
    """The e2m1 nibble at bits SHIFT..SHIFT+3 of int32 qi (SHIFT 0: low nibble, 4: high) -> its
    fp32 value, exactly. Its bits are moved into fp32 bits as they are: sign to bit 31, the
    magnitude code m = e1 e0 m0 to bits 22..24 (exponent field e1 e0, mantissa MSB m0). e2m1
    (exponent bias 1, 0.5 subnormal at exponent 0) then reads as fp32 (bias 127, subnormals at
    exponent 0) scaled by 2^-126 (m < 2: subnormal or zero), and one multiply by 2^126 gives the
    value: exact, as fp32 multiplies keep subnormal operands (the kernels are compiled without
    flush-to-zero). 2 shifts + 1-2 LOP3 + 1 FMUL an element, no selects."""
    bits = ((qi << (22 - SHIFT)) & 0x01C00000) | ((qi << (28 - SHIFT)) & -0x80000000)
    return bits.to(tl.float32, bitcast=True) * 2.0 ** 126


@triton.jit
def _e8m0(b):
    """uint8 E8M0 bytes -> fp32 2^(b - 127), exactly: b is the fp32 exponent field (b = 0, whose
    2^-127 is subnormal, set apart; 255, NaN in E8M0, gives inf as e8m0_to_float does)."""
    bi = b.to(tl.int32)
    return tl.where(bi == 0, 2.0 ** -127, (bi << 23).to(tl.float32, bitcast=True))


@triton.jit
def _mxfp4_tile(q, sb, out_dtype: tl.constexpr, AXIS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Packed MXFP4 tile -> [BLOCK_R, BLOCK_C] = e2m1 * 2^(sb - 127) in fp32, rounded to out_dtype
    (fp32: exact, no rounding). AXIS 1 (packed along columns): q [BLOCK_R, BLOCK_C/2] uint8,
    byte c holding columns 2c (low nibble) and 2c+1 (high), sb [BLOCK_R, BLOCK_C/32] E8M0 bytes;
    AXIS 0 (along rows): q [BLOCK_R/2, BLOCK_C], sb [BLOCK_R/32, BLOCK_C]. Block sizes along AXIS
    multiples of 64."""
    qi = q.to(tl.int32)
    pair = tl.join(_e2m1(qi, 0), _e2m1(qi, 4))                     # [..., 2]: (even, odd) input
    s = _e8m0(sb)
    if AXIS == 1:    # [R, C/2, 2] -> [R, C/32, 32]: groups of 32 columns
        w = tl.reshape(pair, (BLOCK_R, BLOCK_C // 32, 32)) * s[:, :, None]
    else:            # [R/2, C, 2] -> [R/2, 2, C] -> [R/32, 32, C]: groups of 32 rows
        w = tl.reshape(tl.permute(pair, (0, 2, 1)), (BLOCK_R // 32, 32, BLOCK_C)) * s[:, None, :]
    return tl.reshape(w, (BLOCK_R, BLOCK_C)).to(out_dtype)


@triton.jit
def _mxfp4_rows(base, stride_row, rows, row_ok, c0, C, s_base, stride_srow,
                out_dtype: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows `rows` [BLOCK_R] x columns [c0, c0 + BLOCK_C) of an MXFP4 matrix of C columns packed
    along them (C % 32 == 0; c0, BLOCK_C multiples of 64): bytes at base [R, C/2] (row stride
    stride_row), E8M0 bytes at s_base [R, C/32] (row stride stride_srow) -> [BLOCK_R, BLOCK_C]
    with the values of out_dtype (the load-time dequantisation), 0 where not row_ok or past C.
    For the GEMVs, whose products are fp32: a bf16 / fp32 out_dtype gets the fp32 tile, as
    rounding it to bf16 and back is the identity: every e2m1 * 2^k (<= 2 significant bits,
    k in [-127, 128]) finite in fp32 is exact in bf16 (same exponent range, subnormals down to
    2^-133 <= 0.5 * 2^-127), and inf / NaN (b = 255) stay inf / NaN. Other dtypes (fp16, narrower
    range) are rounded."""
    cp = c0 // 2 + tl.arange(0, BLOCK_C // 2)                     # packed columns
    q = tl.load(base + rows[:, None] * stride_row + cp[None, :],
                mask=row_ok[:, None] & (cp < C // 2)[None, :], other=0)
    cs = c0 // 32 + tl.arange(0, BLOCK_C // 32)                   # scale columns
    sb = tl.load(s_base + rows[:, None] * stride_srow + cs[None, :],
                 mask=row_ok[:, None] & (cs < C // 32)[None, :], other=0)
    if out_dtype == tl.bfloat16 or out_dtype == tl.float32:
        w = _mxfp4_tile(q, sb, tl.float32, 1, BLOCK_R, BLOCK_C)
    else:
        w = _mxfp4_tile(q, sb, out_dtype, 1, BLOCK_R, BLOCK_C)
    return w
