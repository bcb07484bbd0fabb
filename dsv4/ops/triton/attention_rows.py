"""What the sparse attention kernels share (dsv4/ops/triton/attention.py, attention_shared.py):
the log2(e) constant, the interpreter's flag and a block of slots' pool rows from a dense index table or a page table (dsv4/ops/paged.py)."""
from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Triton's interpreter multiplies the raw uint16 bits in a bf16 tl.dot: upcast there (tests only)
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _block_rows(idx_ptr, start, hi, base, pitch, BLOCK_K: tl.constexpr, PAGED: tl.constexpr,
                PER_PAGE: tl.constexpr):
    """Pool rows [BLOCK_K] int64 of slots [start, start + BLOCK_K) of one source (-1: unused).
    Dense: idx_ptr points at the token's index row. Paged: at its request's page-table row;
    slot k is item base + k, on row page[(base + k) // PER_PAGE] * pitch + (base + k) % PER_PAGE
    (the caller bounds hi by the range's length; start may be past hi: every load masked)."""
    slots = start + tl.arange(0, BLOCK_K)
    if PAGED:   # rows in int32 (fewer registers): 2^31 pool rows would not fit in GPU memory
        e = base + slots                                                        # items
        if PER_PAGE >= BLOCK_K:     # the block spans at most two pages: two scalar loads
            p0 = (base + start) // PER_PAGE
            page0 = tl.load(idx_ptr + p0, mask=start < hi, other=-1).to(tl.int32)
            page1 = tl.load(idx_ptr + p0 + 1, mask=(p0 + 1) * PER_PAGE < base + hi, other=-1).to(tl.int32)
            page = tl.where(e // PER_PAGE == p0, page0, page1)
        else:
            page = tl.load(idx_ptr + e // PER_PAGE, mask=slots < hi, other=-1).to(tl.int32)
        return tl.where(slots < hi, page * pitch + e % PER_PAGE, -1).to(tl.int64)
    return tl.load(idx_ptr + slots, mask=slots < hi, other=-1).to(tl.int64)
