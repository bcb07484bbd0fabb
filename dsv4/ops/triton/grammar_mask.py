"""A grammar mask applied to the sampler's logits in one launch (docs/architecture.md,
"Structured outputs"). The torch definition is `engine/sampler.py::apply_grammar_mask` (three
kernels and, for a subset of rows, a gather and a scatter); this kernel reads each row's bitmask
words (ANDed with `keep`) and writes -inf over the denied tokens in place, nothing else.
`masked_copy` is the sampler's fp32 copy of the logits and that mask in one launch, when every
row has a mask (bitmask row r for logits row r).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048                  # tokens a program (64 bitmask words)


@triton.jit
def _grammar_mask_kernel(logits_ptr, stride_l, rows_ptr, bitmask_ptr, stride_b, keep_ptr, V,
                         HAS_ROWS: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < V
    row = tl.load(rows_ptr + r).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    word = tl.load(bitmask_ptr + r.to(tl.int64) * stride_b + t // 32, mask=inside, other=0)
    if HAS_KEEP:
        word = word & tl.load(keep_ptr + t // 32, mask=inside, other=0)
    denied = ((word >> (t % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_l + t, float("-inf"), mask=inside & denied)


@triton.jit
def _masked_copy_kernel(logits_ptr, stride_l, out_ptr, bitmask_ptr, stride_b, keep_ptr, V,
                        HAS_KEEP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = t < V
    word = tl.load(bitmask_ptr + r * stride_b + t // 32, mask=inside, other=0)
    if HAS_KEEP:
        word = word & tl.load(keep_ptr + t // 32, mask=inside, other=0)
    x = tl.load(logits_ptr + r * stride_l + t, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * V + t, tl.where(((word >> (t % 32)) & 1) == 0, float("-inf"), x), mask=inside)


def masked_copy(logits: torch.Tensor, bitmask: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """logits [B, V] (any float dtype, unit column stride) -> a new fp32 [B, V]: the logits with
    -inf over the tokens bitmask [B, W] int32 row r denies for row r (keep [W] ANDed in)."""
    B, V = logits.shape
    assert bitmask.shape[0] == B and bitmask.shape[1] * 32 >= V, "masked_copy: a bitmask row a logits row"
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "masked_copy: unit column strides"
    out = torch.empty((B, V), dtype=torch.float32, device=logits.device)
    if B:
        _masked_copy_kernel[(B, triton.cdiv(V, BLOCK_V))](
            logits, logits.stride(0), out, bitmask, bitmask.stride(0), keep if keep is not None else bitmask, V,
            HAS_KEEP=keep is not None, BLOCK=BLOCK_V)
    return out


def apply_grammar_mask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor,
                       keep: torch.Tensor | None, covers_all: bool) -> None:
    """logits [B, V] fp32 (unit column stride), in place; rows [R] long: the logits row of each
    bitmask row (unused when covers_all and R == B: row r is logits row r); bitmask [R, W] int32,
    W >= ceil(V / 32), bit t % 32 of word t // 32 = token t allowed; keep [W] int32 or None."""
    R, V = bitmask.shape[0], logits.shape[1]
    if R == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "grammar mask: unit column strides"
    assert bitmask.shape[1] * 32 >= V, f"grammar mask: {bitmask.shape[1]} words cannot cover {V} tokens"
    has_rows = not (covers_all and R == logits.shape[0])
    _grammar_mask_kernel[(R, triton.cdiv(V, BLOCK_V))](
        logits, logits.stride(0), rows if has_rows else bitmask, bitmask, bitmask.stride(0),
        keep if keep is not None else bitmask, V, HAS_ROWS=has_rows, HAS_KEEP=keep is not None, BLOCK=BLOCK_V)
