"""Dequantisation of quantised weights inside Triton kernels (the decode GEMVs of moe.py, the
grouped GEMMs of moe_grouped.py); the formats are defined by dsv4/model/quant.py
(`dequant_fp8`, `dequant_fp4`).

FP8 (W8A16): float8_e4m3fn [R, C] with fp32 scales [cdiv(R, 128), cdiv(C, 128)] (QBLOCK blocks).
`_block_scale` fetches a tile's scales (one, a vector or a gather, by its alignment);
`_dequant_tile` multiplies in fp32 and rounds to the activation dtype.

MXFP4 (W4A16): e2m1 values (magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}) packed two per uint8 along
the last (input) dim, low nibble = even input: bytes [R, C/2]; one E8M0 byte b per FP4_GROUP = 32
inputs: [R, C/32], scale 2^(b - 127) (b = 255 reads as inf, as dsv4.ops.quant.e8m0_to_float).
Tiles along the packed dim are multiples of MXFP4_BLOCK.
`_mxfp4_rows_dot` (the decode GEMVs) reads the bytes as int32 words (8 inputs, 16-byte vector
loads) and never builds a dequantised tile: a word becomes 8 fp16 e2m1 * 2^-14 (inline PTX, or
its pure-Triton twin in the interpreter), converted to fp32 for the FMAs (see `_mxfp4_words_dot`).

Invariants (the tests check them bit for bit in Triton's interpreter):
- a dequantised tile equals the load-time dequantisation: fp32 w * scale rounded to the dtype;
- e2m1 and E8M0 are decoded from their bits (no tables, no transcendentals), and every
  e2m1 * 2^(b - 127) is exact in fp32 (or inf);
- for power-of-two (E8M0) FP8 scales w * s is exact too, which lets the decode GEMVs fold the
  scales into the activation vector.
"""
from __future__ import annotations

import torch
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


def word_major(v, out):
    """v [..., C] (C % 8 == 0) -> out [..., 8, C/8] fp32: v[..., 8c + j] at [..., j, c], the vector
    layout `_mxfp4_dot` reads (one torch op; exact)."""
    return torch.mul(v.unflatten(-1, (-1, 8)).transpose(-1, -2), 1.0, out=out)


@triton.jit
def _word_major_index(c, C):
    """Position of input c of a word-major vector of C inputs (`word_major`)."""
    return (c % 8) * ((C // 32) * 4) + c // 8


# `_e2m1_f16_pair` halves hold e2m1 * 2^-F16_SHIFT (the fp16 exponent bias minus e2m1's)
F16_SHIFT = tl.constexpr(14)


@triton.jit
def _e2m1_f16_pair(w, J: tl.constexpr):
    """Nibbles J and J + 4 (J < 4; inputs 8c + J and 8c + J + 4 of word c) of int32 words w -> an
    int32 whose low / high 16 bits are the fp16 bits of e2m1 * 2^-14 of nibble J / J + 4: each
    nibble's magnitude code (e1 e0 m) moved to bits 9..11 of its half (fp16 exponent field e1 e0,
    mantissa MSB m: subnormal for e = 0, as e2m1's 0.5), its sign to bit 15. Nibbles J and J + 4
    lie 16 bits apart, as the halves do, so one shift moves both magnitudes and one both signs:
    2 shifts + 2 LOP3 for two elements (J = 3: the sign shift is none)."""
    if J == 3:
        mag = w >> 3                                                # bits 12..14 -> 9..11 (sign fill masked)
    else:
        mag = w << (9 - 4 * J)
    sign = w << (12 - 4 * J)                                        # bit 4J + 3 -> 15, 4J + 19 -> 31
    return (mag & 0x0E000E00) | (sign & -0x7FFF8000)                # mask 0x80008000


@triton.jit
def _f16_halves_to_f32(d):
    """int32 d -> (fp32 of its low fp16 half, fp32 of its high half): exact (an fp16 -> fp32
    convert each)."""
    lo = d.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (d >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _mxfp4_words(wq, stride_q, s_base, stride_s, rows, row_ok, c0, c_end,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The columns [c0, c0 + BLOCK_C) of rows `rows` [BLOCK_R] of an MXFP4 matrix read as int32
    words wq [R, C/8] (row stride stride_q words; word c holds inputs 8c..8c+7, nibble j = input
    8c + j) with its E8M0 bytes s_base [R, C/32] (row stride stride_s) -> (words [BLOCK_R, G, 4]
    (a group's 4 words one 16-byte load), E8M0 bytes [BLOCK_R, G, 4] (each group's byte 4 times,
    one load: the words' shape, so the compiler keeps the scaled partial sums in the words'
    layout, no shared-memory round trip an iteration)), G = BLOCK_C / 32 groups; 0 where not
    row_ok or at columns >= c_end (a multiple of 32: no traffic there)."""
    G: tl.constexpr = BLOCK_C // 32
    g = c0 // 32 + tl.arange(0, G)                                    # groups (scale columns)
    g_ok = g < c_end // 32
    cw = (g * 4)[:, None] + tl.arange(0, 4)[None, :]                  # [G, 4] words along the row
    m = row_ok[:, None, None] & g_ok[None, :, None]
    q = tl.load(wq + rows[:, None, None] * stride_q + cw[None, :, :], mask=m, other=0)   # [BLOCK_R, G, 4]
    sb = tl.load(s_base + rows[:, None, None] * stride_s + (cw // 4)[None, :, :], mask=m, other=0)   # [BLOCK_R, G, 4]
    return q, sb


# PTX of `_e2m1_word_f32` (sm_90): the fp16 high byte s 0 0 0 e1 e0 m 0 of each nibble's e2m1 *
# 2^-14 (see `_e2m1_f16_pair`), four a register (high nibbles: sign in place, magnitude >> 3; low
# nibbles: << 4 and << 1), two bytes at a time moved into the high bytes of an fp16 pair (prmt,
# zeros below), each half converted to fp32 (cvt.f32.f16). 7 integer ops + 4 PRMT + 8 converts a
# word.
_E2M1_WORD_PTX = tl.constexpr("""{
.reg .b32 t, u, hi, lo, z, p;
.reg .b16 a, b;
mov.b32 z, 0;
shr.b32 t, $8, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 hi, $8, 0x80808080;
or.b32 hi, hi, t;
shl.b32 t, $8, 1;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, $8, 4;
and.b32 u, u, 0x80808080;
or.b32 lo, u, t;
prmt.b32 p, lo, z, 0x1404;
mov.b32 {a, b}, p;
cvt.f32.f16 $0, a;
cvt.f32.f16 $2, b;
prmt.b32 p, lo, z, 0x3424;
mov.b32 {a, b}, p;
cvt.f32.f16 $4, a;
cvt.f32.f16 $6, b;
prmt.b32 p, hi, z, 0x1404;
mov.b32 {a, b}, p;
cvt.f32.f16 $1, a;
cvt.f32.f16 $3, b;
prmt.b32 p, hi, z, 0x3424;
mov.b32 {a, b}, p;
cvt.f32.f16 $5, a;
cvt.f32.f16 $7, b;
}""")


@triton.jit
def _e2m1_word_f32(w, ASM: tl.constexpr):
    """int32 words w -> 8 fp32 tensors, nibble n (input 8c + n of word c) at position n: its e2m1
    value * 2^-14, exactly. ASM (compiled for the GPU): one inline PTX block (_E2M1_WORD_PTX);
    else its bit-identical pure-Triton twin (`_e2m1_f16_pair`, `_f16_halves_to_f32`; the
    interpreter runs no PTX)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _E2M1_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        v0, v4 = _f16_halves_to_f32(_e2m1_f16_pair(w, 0))
        v1, v5 = _f16_halves_to_f32(_e2m1_f16_pair(w, 1))
        v2, v6 = _f16_halves_to_f32(_e2m1_f16_pair(w, 2))
        v3, v7 = _f16_halves_to_f32(_e2m1_f16_pair(w, 3))
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _mxfp4_words_dot(q, sb, c0, C, v_ptr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ASM: tl.constexpr):
    """sum_c W[r, c] * v[c] over each group of 32 columns in [c0, c0 + BLOCK_C) -> fp32
    [BLOCK_R, BLOCK_C/32], from the tile's words q and E8M0 bytes sb (`_mxfp4_words`) and v_ptr,
    the vector of C inputs in `word_major` layout (fp32 [8, C/8]: nibble j of the words cw is
    the contiguous v_ptr[j, cw], 16-byte loads). Words and scale bytes past C must be 0 (as
    `_mxfp4_words` loads them).

    No dequantised tile: each word gives its 8 values as fp16 e2m1 * 2^-14 (`_e2m1_word_f32`:
    under 1.5 integer ops an element with ASM), each converted to fp32 and multiplied into v (an
    FMA); each word's sum is scaled by 2^14 and its group's E8M0 scale (powers of two: exact)
    and the group's 4 added. Differs from the dequantised dot only in the order of the fp32
    additions, and where a product |e2m1 * v| < 2^-112 (its 2^-14 copy is an fp32 subnormal:
    rounded to a multiple of 2^-149). A thread's v loads serve all the rows it holds."""
    G: tl.constexpr = BLOCK_C // 32
    g = tl.minimum(c0 // 32 + tl.arange(0, G), C // 32 - 1)         # past C: any v (unmasked), words 0 there
    cw = (g * 4)[:, None] + tl.arange(0, 4)[None, :]                  # [G, 4] words along the row
    v = _e2m1_word_f32(q, ASM)                                       # 8 x [BLOCK_R, G, 4]
    part = v[0] * tl.load(v_ptr + cw)[None, :, :]                    # a sum per word
    for j in tl.static_range(1, 8):
        part += v[j] * tl.load(v_ptr + j * ((C // 32) * 4) + cw)[None, :, :]
    return tl.sum(part * (_e8m0(sb) * 2.0 ** F16_SHIFT), axis=2)


@triton.jit
def _mxfp4_dot(wq, stride_q, s_base, stride_s, rows, row_ok, c0, C, v_ptr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ASM: tl.constexpr = False):
    """`_mxfp4_words_dot` of one tile, the columns [c0, c0 + BLOCK_C) of a matrix of C columns
    (C % 32 == 0; see `_mxfp4_words`)."""
    q, sb = _mxfp4_words(wq, stride_q, s_base, stride_s, rows, row_ok, c0, C, BLOCK_R, BLOCK_C)
    return _mxfp4_words_dot(q, sb, c0, C, v_ptr, BLOCK_R, BLOCK_C, ASM)


@triton.jit
def _mxfp4_rows_dot(wq, s_base, wq2, s_base2, stride_q, stride_s, rows, row_ok, c_lo, c_hi, C, v_ptr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TWO: tl.constexpr, ASM: tl.constexpr):
    """`_mxfp4_dot` summed over the tiles of BLOCK_C columns from c_lo while below c_hi (both
    multiples of 32; c_hi past C by less than BLOCK_C, or tiles of zeros are added) -> fp32
    [BLOCK_R, BLOCK_C/32] partial sums (add them up along axis 1), for the matrix wq / s_base
    and, TWO, a second one wq2 / s_base2 of the same strides (the same rows, v and tiles): a
    pair (acc, acc2), acc2 zeros without TWO. ASM: see `_e2m1_word_f32`. Software-pipelined in
    registers: the next tile's words are loaded before this one's are decoded, so a tile's loads
    are in flight while the previous one is computed."""
    c_end = tl.minimum(c_hi, C)
    acc = tl.zeros((BLOCK_R, BLOCK_C // 32), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, BLOCK_C // 32), dtype=tl.float32)
    q, sb = _mxfp4_words(wq, stride_q, s_base, stride_s, rows, row_ok, c_lo, c_end, BLOCK_R, BLOCK_C)
    q2, sb2 = q, sb
    if TWO:
        q2, sb2 = _mxfp4_words(wq2, stride_q, s_base2, stride_s, rows, row_ok, c_lo, c_end, BLOCK_R, BLOCK_C)
    for c0 in range(c_lo, c_hi, BLOCK_C):                           # the tiles of [c_lo, c_end)
        q_next, sb_next = _mxfp4_words(wq, stride_q, s_base, stride_s, rows, row_ok, c0 + BLOCK_C, c_end,
                                       BLOCK_R, BLOCK_C)
        q2_next, sb2_next = q_next, sb_next
        if TWO:
            q2_next, sb2_next = _mxfp4_words(wq2, stride_q, s_base2, stride_s, rows, row_ok, c0 + BLOCK_C, c_end,
                                             BLOCK_R, BLOCK_C)
        acc += _mxfp4_words_dot(q, sb, c0, C, v_ptr, BLOCK_R, BLOCK_C, ASM)
        if TWO:
            acc2 += _mxfp4_words_dot(q2, sb2, c0, C, v_ptr, BLOCK_R, BLOCK_C, ASM)
        q, sb, q2, sb2 = q_next, sb_next, q2_next, sb2_next
    return acc, acc2
