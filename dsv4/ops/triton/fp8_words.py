"""Unpacking the packed FP8 KV rows (dsv4/ops/kv_fp8.py) inside a kernel from 32-bit words.

The readers load a row as int32 words (4 bytes a load, 8 where the row's alignment is hinted)
instead of one byte a load, and split the words in registers. A word holds bytes b0..b3 of
the row little-endian: channel 4w + j of a run of e4m3 values is byte j of word w, channel
2w + j of a run of bf16 values is half j of word w. Both unpackings are exact (an e4m3 or bf16
value is exact in fp32, bf16 and fp16).
"""
import triton
import triton.language as tl


@triton.jit
def fp8_words_to_float(words):
    """words [R, W] int32 -> [R, 4 * W] fp32: the e4m3 values of the bytes, channel 4w + j."""
    shifts = 8 * tl.arange(0, 4)
    code = (words[:, :, None] >> shifts[None, None, :]).to(tl.uint8)               # [R, W, 4] low bytes
    vals = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.reshape(vals, (words.shape[0], 4 * words.shape[1]))


@triton.jit
def bf16_words_to_float(words):
    """words [R, W] int32 -> [R, 2 * W] fp32: the bf16 values of the halves, channel 2w + j."""
    shifts = 16 * tl.arange(0, 2)
    bits = (words[:, :, None] >> shifts[None, None, :]).to(tl.uint16)               # [R, W, 2] low halves
    vals = bits.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return tl.reshape(vals, (words.shape[0], 2 * words.shape[1]))


@triton.jit
def ue8m0_to_float(code):
    """UE8M0 scale bytes (uint8, 1..254) -> 2^(code - 127) fp32, exactly (the exponent field)."""
    return (code.to(tl.int32) << 23).to(tl.float32, bitcast=True)
