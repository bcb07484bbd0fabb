"""Sparse shared-KV attention with per-head sinks (torch reference).

Each query token t attends over key rows gathered from one or more sources: for a source
(kv [N, D], idx [T, K]), `idx[t, k]` is a row of kv, -1 marks an unused slot. idx may also be a
PagedRows (dsv4/ops/paged.py) of width K, which means its dense form. K and V are the
same vector (V4's single shared head). exp(sink_h) joins the softmax denominator only.
"""
from __future__ import annotations

import torch

from .backend import use_triton
from .kv_fp8 import dequantized_source, is_packed
from .paged import PagedRows, dense_index

QUERY_BLOCK = 1024  # queries per block; bounds the gathered [block, K, D] tensor


def sparse_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor | PagedRows]],
                     sinks: torch.Tensor, scale: float, rope_dims: int = 0) -> torch.Tensor:
    """q [T, H, D]; sources [(kv [N, D], idx [T, K] or PagedRows)]; sinks [H] -> out [T, H, D].
    A kv may be a packed FP8 pool (uint8 [N, entry bytes], dsv4/ops/kv_fp8.py; its last
    `rope_dims` channels RoPE'd): the Triton kernel reads the packed rows in place; the reference
    dequantises the rows its idx addresses first."""
    if use_triton(q):
        from .triton import attention as triton_attention
        if triton_attention.supports(q, sources, sinks, rope_dims):     # packed rows read in the kernel
            return triton_attention.sparse_attention(q, sources, sinks, scale, rope_dims=rope_dims)
    if any(is_packed(kv) for kv, _ in sources):
        sources = [dequantized_source(kv, idx, q.shape[-1], rope_dims, q.dtype) if is_packed(kv) else (kv, idx)
                   for kv, idx in sources]
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, q.shape[0])
        keys, valid = _gather([(kv, dense_index(idx, start, stop)) for kv, idx in sources])
        out[start:stop] = _attend(q[start:stop], keys, valid, sinks, scale)
    return out


def _gather(sources):
    keys = torch.cat([kv[idx.clamp(min=0)] for kv, idx in sources], dim=1).float()   # [T, K, D]
    valid = torch.cat([idx >= 0 for _, idx in sources], dim=1)
    return keys, valid


def _attend(q, keys, valid, sinks, scale):
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)
    logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)
