"""Unpacking the packed FP8 KV rows (dsv4/ops/kv_fp8.py) inside a kernel from 32-bit words.

The readers load a row as int32 words (4 bytes a load, 8 where the row's alignment is hinted)
instead of one byte a load, and split the words in registers. A word holds bytes b0..b3 of
the row little-endian: channel 4w + j of a run of e4m3 values is byte j of word w, channel
2w + j of a run of bf16 values is half j of word w. The unpackings are exact in fp32 and bf16
(an e4m3 value also in fp16), and so is an e4m3 value times its UE8M0 scale in either.
"""
import triton
import triton.language as tl


@triton.jit
def fp8_words_to(words, dtype: tl.constexpr):
    """words [R, W] int32 -> [R, W, 4] dtype: the e4m3 values of the bytes (byte j of word w at
    [., w, j]; reshaped to [R, 4 * W] it is channel 4w + j)."""
    shifts = 8 * tl.arange(0, 4)
    code = (words[:, :, None] >> shifts[None, None, :]).to(tl.uint8)               # [R, W, 4] low bytes
    return code.to(tl.float8e4nv, bitcast=True).to(dtype)


@triton.jit
def bf16_words_to(words, dtype: tl.constexpr):
    """words [R, W] int32 -> [R, 2 * W] dtype: the bf16 values of the halves, channel 2w + j."""
    shifts = 16 * tl.arange(0, 2)
    bits = (words[:, :, None] >> shifts[None, None, :]).to(tl.uint16)               # [R, W, 2] low halves
    vals = bits.to(tl.bfloat16, bitcast=True).to(dtype)
    return tl.reshape(vals, (words.shape[0], 2 * words.shape[1]))


@triton.jit
def ue8m0_to(code, dtype: tl.constexpr):
    """UE8M0 scale bytes (uint8, 1..254) -> 2^(code - 127) in dtype (fp32 or bf16: exact, the
    exponent field; the packer's codes are >= 105, dsv4/ops/kv_fp8.py)."""
    return (code.to(tl.int32) << 23).to(tl.float32, bitcast=True).to(dtype)
