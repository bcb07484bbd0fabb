"""Writing packed FP8 KV rows (dsv4/ops/kv_fp8.py, the definition: pack_entries,
pack_index_keys) in one kernel: quantise, pack and scatter pool[rows[i]] = pack(x[i]).

The torch definition is about twenty small ops a write (a decode step writes every layer's SWA
key and its closed compressor entries); here one program packs one row. The scale exponent is
read off amax's bits (the smallest power of two s with amax / s <= 448: 448 = 1.75 * 2^8, as in
quant_gemm's activation quantiser), which is the definition's ceil(log2(amax / 448)) whenever
amax / 448 is exact in fp32 (every bf16 row); values and scales are then bit-identical.
Index keys take the definition's fp32 divisions, rounded to nearest (div_rn).
"""
import os

import torch
import triton
import triton.language as tl

from ..kv_fp8_layout import AMAX_FLOOR, FP8_MAX, KV_BLOCK, entry_bytes, index_key_bytes
from .quant_gemm import _round_e4m3
from .rounding import round_to

# Triton's interpreter truncates fp32 -> e4m3 / bf16 casts: there the rounding is done on the bits
EMULATE_RNE = os.environ.get("TRITON_INTERPRET") == "1"
AMAX_FLOOR_C, FP8_MAX_C = tl.constexpr(AMAX_FLOOR), tl.constexpr(FP8_MAX)


@triton.jit
def _to_e4m3_bytes(q, EMULATE: tl.constexpr):
    """fp32 q (|q| <= 448) -> its e4m3 bytes (uint8), rounded to nearest even."""
    if EMULATE:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _pack_entries_kernel(x_ptr, rows_ptr, pool_ptr, stride_x, stride_pool,
                         NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCKS: tl.constexpr, BLOCKS_P: tl.constexpr,
                         ROPE_P: tl.constexpr, PAD: tl.constexpr, EMULATE: tl.constexpr):
    # program i: x[i] [NOPE + ROPE] -> pool row rows[i]: NOPE e4m3 bytes (BLOCKS blocks of 64
    # channels, one UE8M0 scale each), ROPE bf16 values, the BLOCKS scale bytes, PAD zero bytes
    i = tl.program_id(0).to(tl.int64)
    src = x_ptr + i * stride_x
    dst = pool_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_pool
    b = tl.arange(0, BLOCKS_P)
    ch = b[:, None] * 64 + tl.arange(0, 64)[None, :]                                  # [BLOCKS_P, 64]
    ok = ch < NOPE
    v = tl.load(src + ch, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), AMAX_FLOOR_C)                        # [BLOCKS_P]
    bits = amax.to(tl.int32, bitcast=True)
    code = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)            # scale 2^(code - 127)
    inv = ((254 - code) << 23).to(tl.float32, bitcast=True)                          # 1 / scale, exact
    q = tl.minimum(tl.maximum(v * inv[:, None], -FP8_MAX_C), FP8_MAX_C)
    tl.store(dst + ch, _to_e4m3_bytes(q, EMULATE), mask=ok)
    r = tl.arange(0, ROPE_P)
    roped = round_to(tl.load(src + NOPE + r, mask=r < ROPE, other=0.0).to(tl.float32), tl.bfloat16, EMULATE)
    tl.store((dst + NOPE).to(tl.pointer_type(tl.bfloat16)) + r, roped.to(tl.bfloat16), mask=r < ROPE)
    tl.store(dst + NOPE + 2 * ROPE + b, code.to(tl.uint8), mask=b < BLOCKS)
    p = tl.arange(0, 8)
    tl.store(dst + NOPE + 2 * ROPE + BLOCKS + p, tl.zeros([8], dtype=tl.uint8), mask=p < PAD)


@triton.jit
def _pack_index_keys_kernel(x_ptr, rows_ptr, pool_ptr, stride_x, stride_pool,
                            DI: tl.constexpr, DI_P: tl.constexpr, EMULATE: tl.constexpr):
    # program i: x[i] [DI] -> pool row rows[i]: DI e4m3 bytes of x / scale, then scale (fp32)
    i = tl.program_id(0).to(tl.int64)
    dst = pool_ptr + tl.load(rows_ptr + i).to(tl.int64) * stride_pool
    d = tl.arange(0, DI_P)
    v = tl.load(x_ptr + i * stride_x + d, mask=d < DI, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), AMAX_FLOOR_C), FP8_MAX_C)
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX_C), FP8_MAX_C)
    tl.store(dst + d, _to_e4m3_bytes(q, EMULATE), mask=d < DI)
    tl.store((dst + DI).to(tl.pointer_type(tl.float32)), scale)



def _rows_ok(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, width: int) -> bool:
    return (pool.dtype == torch.uint8 and pool.dim() == 2 and pool.stride(1) == 1 and pool.shape[1] == width
            and x.dim() == 2 and rows.dim() == 1 and rows.shape[0] == x.shape[0]
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def supports_entries(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, rope: int) -> bool:
    """Packed attention rows of x's width with 0 < rope < width (the definition's layout)."""
    return 0 < rope < x.shape[-1] and _rows_ok(pool, rows, x, entry_bytes(x.shape[-1], rope))


def supports_index_keys(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> bool:
    """Packed index keys with a 4-byte aligned fp32 scale (Di, the row stride and the base)."""
    return (_rows_ok(pool, rows, x, index_key_bytes(x.shape[-1])) and x.shape[-1] % 4 == 0
            and pool.stride(0) % 4 == 0 and pool.data_ptr() % 4 == 0)


def write_entries(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, rope: int) -> None:
    """pool[rows] = pack_entries(x, rope): x [N, D], rows [N] (distinct, in the pool)."""
    assert supports_entries(pool, rows, x, rope), "kv_pack.write_entries (triton): unsupported inputs"
    N, D = x.shape
    if N == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    nope = D - rope
    blocks = triton.cdiv(nope, KV_BLOCK)
    _pack_entries_kernel[(N,)](x, rows.contiguous(), pool, x.stride(0), pool.stride(0), NOPE=nope, ROPE=rope,
                               BLOCKS=blocks, BLOCKS_P=triton.next_power_of_2(blocks),
                               ROPE_P=triton.next_power_of_2(rope),
                               PAD=entry_bytes(D, rope) - (nope + 2 * rope + blocks), EMULATE=EMULATE_RNE,
                               num_warps=4)


def write_index_keys(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """pool[rows] = pack_index_keys(x): x [N, Di], rows [N] (distinct, in the pool)."""
    assert supports_index_keys(pool, rows, x), "kv_pack.write_index_keys (triton): unsupported inputs"
    N, Di = x.shape
    if N == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    _pack_index_keys_kernel[(N,)](x, rows.contiguous(), pool, x.stride(0), pool.stride(0), DI=Di,
                                  DI_P=triton.next_power_of_2(Di), EMULATE=EMULATE_RNE, num_warps=1)
