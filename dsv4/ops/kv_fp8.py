"""The FP8 KV cache rows (`--kv-cache-dtype fp8`): DeepSeek's released packed layout.

An attention entry (SWA key, C4 or C128 entry) of D = nope + R channels, the last R of them
RoPE'd, is one row of bytes:

    [0, nope)                     nope FP8 e4m3 values, x / scale of their 64-channel block
    [nope, nope + 2R)             the R RoPE channels as bf16
    [nope + 2R, + ceil(nope/64))  one UE8M0 scale byte per 64-channel block (2^(byte - 127))
    then zero padding to a multiple of 8 bytes

(V4: 448 + 128 + 7 + 1 = 584 bytes instead of 1024 in bf16). A block's scale is the smallest
power of two s with amax / s <= 448 (amax clamped at 1e-4, so an all-zero block has a finite
scale). An indexer key of Di channels is Di FP8 e4m3 values then one fp32 scale
(amax / 448, amax clamped at 1e-4): Di + 4 bytes (V4: 132).

Quantisation happens where rows are written (pack_*), the readers dequantise the rows they
gather (unpack_*; exact in bf16: an e4m3 value times a power of two). Rows are uint8 tensors;
a uint8 pool is a packed pool.
"""
from __future__ import annotations

import torch

from .backend import use_triton
from .kv_fp8_layout import AMAX_FLOOR, FP8_MAX, KV_BLOCK, entry_bytes, index_key_bytes  # noqa: F401
from .paged import PagedRows


def is_packed(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.uint8


def pack_entries(x: torch.Tensor, rope: int) -> torch.Tensor:
    """x [N, D] float -> [N, entry_bytes(D, rope)] uint8."""
    N, D = x.shape
    nope, blocks = D - rope, -(-(D - rope) // KV_BLOCK)
    values = torch.zeros(N, blocks * KV_BLOCK, dtype=torch.float32, device=x.device)
    values[:, :nope] = x[:, :nope].float()
    values = values.view(N, blocks, KV_BLOCK)
    amax = values.abs().amax(-1).clamp(min=AMAX_FLOOR)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX))                       # [N, blocks]
    q = (values / torch.exp2(exponent)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.zeros(N, entry_bytes(D, rope), dtype=torch.uint8, device=x.device)
    out[:, :nope] = q.view(N, -1)[:, :nope].view(torch.uint8)
    out[:, nope:nope + 2 * rope] = x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[:, nope + 2 * rope:nope + 2 * rope + blocks] = (exponent + 127).to(torch.uint8)
    return out


def unpack_entries(rows: torch.Tensor, dim: int, rope: int) -> torch.Tensor:
    """rows [..., entry_bytes(dim, rope)] uint8 -> [..., dim] fp32."""
    nope, blocks = dim - rope, -(-(dim - rope) // KV_BLOCK)
    values = rows[..., :nope].contiguous().view(torch.float8_e4m3fn).float()
    scales = torch.exp2(rows[..., nope + 2 * rope:nope + 2 * rope + blocks].float() - 127)
    values = values * scales.repeat_interleave(KV_BLOCK, dim=-1)[..., :nope]
    roped = rows[..., nope:nope + 2 * rope].contiguous().view(torch.bfloat16).float()
    return torch.cat([values, roped], dim=-1)


def pack_index_keys(x: torch.Tensor) -> torch.Tensor:
    """x [N, Di] float -> [N, Di + 4] uint8."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX          # [N, 1]
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def unpack_index_keys(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., Di + 4] uint8 -> [..., Di] fp32."""
    values = rows[..., :-4].contiguous().view(torch.float8_e4m3fn).float()
    return values * rows[..., -4:].contiguous().view(torch.float32)


def write_entries(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, rope: int) -> None:
    """pool[rows] = x: packed for a packed pool (one Triton kernel where it runs), else cast to
    the pool's dtype."""
    if is_packed(pool) and use_triton(x):
        from .triton import kv_pack
        if kv_pack.supports_entries(pool, rows, x, rope):
            return kv_pack.write_entries(pool, rows, x, rope)
    pool[rows] = pack_entries(x, rope) if is_packed(pool) else x.to(pool.dtype)


def write_index_keys(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    if is_packed(pool) and use_triton(x):
        from .triton import kv_pack
        if kv_pack.supports_index_keys(pool, rows, x):
            return kv_pack.write_index_keys(pool, rows, x)
    pool[rows] = pack_index_keys(x) if is_packed(pool) else x.to(pool.dtype)


def dequantized_source(pool: torch.Tensor, idx: torch.Tensor | PagedRows, dim: int, rope: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | PagedRows]:
    """A packed attention source as an unpacked one holding only the rows idx can address:
    a dense idx [T, K] -> rows [T * K, dim] and idx' = position (-1 kept); a PagedRows -> the
    pages of its table, one after the other (pitch = per_page). O(T * K) or O(table) rows,
    never the pool; the values are exactly unpack_entries of the rows idx reads."""
    if isinstance(idx, PagedRows):
        R, P = idx.pages.shape
        slots = torch.arange(idx.per_page, device=idx.pages.device)
        rows = idx.pages[..., None] * idx.pitch + slots                      # [R, P, per_page]
        kv = unpack_entries(pool[rows.clamp(min=0).flatten()], dim, rope).to(dtype)
        local = torch.arange(R * P, device=idx.pages.device).view(R, P)
        pages = torch.where(idx.pages >= 0, local, -1)
        return kv, PagedRows(pages, idx.req, idx.lo, idx.hi, idx.per_page, idx.per_page, idx.width)
    kv = unpack_entries(pool[idx.clamp(min=0).flatten()], dim, rope).to(dtype)
    local = torch.arange(idx.numel(), device=idx.device).view(idx.shape)
    return kv, torch.where(idx >= 0, local, -1)
