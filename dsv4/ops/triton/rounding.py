"""Rounding an fp32 value to a storage dtype inside a kernel, as torch rounds (to nearest even).

Triton's CPU interpreter truncates fp32 -> bf16 casts (the GPU rounds to nearest even), so
under the interpreter (the tests) the rounding is done on the bits; compiled kernels cast.
"""
import os

import triton
import triton.language as tl

EMULATE = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to(v, dt: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 v -> v rounded to dtype dt, returned in fp32."""
    if EMULATE_RNE:
        if dt == tl.bfloat16:
            bits = v.to(tl.int32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits & -65536).to(tl.float32, bitcast=True)
    return v.to(dt).to(tl.float32)
