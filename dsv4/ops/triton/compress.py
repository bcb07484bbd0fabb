"""Closing a step's compressor groups in Triton: pool + RMSNorm + RoPE + pool write, one kernel.

The definition is the torch composition in dsv4/model/compressor.py: compress_pool over
cat(ring, fresh) (dsv4/ops/compress.py), rms_norm, apply_rope at the group's position, cast
to the pool's dtype and written to its slot. Here one program closes one group: it gathers
the group's rows straight from the two sources (row r < ring_rows is ring[r], else fresh
[r - ring_rows]; -1 = missing), so cat(ring, fresh) is never materialised.

The RMSNorm needs all D channels of the entry, so the program walks the channel blocks twice:
pass 1 pools each block and sums the squares, pass 2 pools it again (from cache), normalises,
rotates and stores. A channel block is held as its even and odd channels ([span, BLOCK/2]
each), so the interleaved RoPE pairs (2i, 2i+1) are elementwise between the two halves.

Rounding follows the reference: the softmax weights are rounded to the source dtype before
they multiply kv, and the pooled entry, the normalised entry and the rotated entry are each
rounded to the source dtype (the ring's dtype; fresh rows are cast to it first).
"""
import torch
import triton
import triton.language as tl

from ..rope import rope_cos_sin

TILE = 4096         # elements of one [span, channels] tile of kv (and of gate), 32 a thread


@triton.jit
def _pool_block(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
                offs_r, offs_c, c_ok, m, D, ring_rows,
                stride_rkv, stride_rg, stride_kv, stride_g, stride_ape,
                OVERLAP: tl.constexpr):
    """Pooled channels offs_c [BLOCK_H] of one group, rounded to the source dtype, in fp32.

    rows/valid/from_ring/offs_r [SPAN_P]: the group's row ids, whether present, whether in the ring.
    """
    src_dtype = ring_kv_ptr.dtype.element_ty
    if OVERLAP:     # rows [0, m) carry channels [0, D), rows [m, 2m) channels [D, 2D)
        second = (offs_r >= m).to(tl.int64)                                   # [SPAN_P]
        col = offs_c[None, :] + (second * D)[:, None]                         # [SPAN_P, BLOCK_H]
        ape_row = offs_r - second * m
    else:
        col = offs_c[None, :] + tl.zeros_like(offs_r)[:, None]
        ape_row = offs_r
    ok = valid[:, None] & c_ok[None, :]
    ring_ok = ok & from_ring[:, None]
    fresh_ok = ok & ~from_ring[:, None]
    ring_row = rows[:, None]
    fresh_row = rows[:, None] - ring_rows

    kv_ring = tl.load(ring_kv_ptr + ring_row * stride_rkv + col, mask=ring_ok, other=0.0)
    kv_fresh = tl.load(kv_ptr + fresh_row * stride_kv + col, mask=fresh_ok, other=0.0)
    kv = tl.where(ring_ok, kv_ring, kv_fresh.to(src_dtype)).to(tl.float32)  # [SPAN_P, BLOCK_H]
    g_ring = tl.load(ring_gate_ptr + ring_row * stride_rg + col, mask=ring_ok, other=0.0)
    g_fresh = tl.load(gate_ptr + fresh_row * stride_g + col, mask=fresh_ok, other=0.0)
    gate = tl.where(ring_ok, g_ring.to(tl.float32),
                    g_fresh.to(ring_gate_ptr.dtype.element_ty).to(tl.float32))
    ape = tl.load(ape_ptr + ape_row[:, None] * stride_ape + col, mask=ok, other=0.0)

    score = tl.where(valid[:, None], gate + ape.to(tl.float32), float("-inf"))
    p = tl.exp(score - tl.max(score, axis=0)[None, :])                        # missing rows: 0
    w = (p / tl.sum(p, axis=0)[None, :]).to(src_dtype).to(tl.float32)
    return tl.sum(kv * w, axis=0).to(src_dtype).to(tl.float32)               # [BLOCK_H]


@triton.jit
def _pool_pair(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
               offs_r, even, c_ok, m, D, ring_rows,
               stride_rkv, stride_rg, stride_kv, stride_g, stride_ape, OVERLAP: tl.constexpr):
    """Pooled even and odd channels of one block: [BLOCK_H] each (one RoPE pair per lane)."""
    a = _pool_block(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
                    offs_r, even, c_ok, m, D, ring_rows,
                    stride_rkv, stride_rg, stride_kv, stride_g, stride_ape, OVERLAP)
    b = _pool_block(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
                    offs_r, even + 1, c_ok, m, D, ring_rows,
                    stride_rkv, stride_rg, stride_kv, stride_g, stride_ape, OVERLAP)
    return a, b


@triton.jit
def _close_groups_kernel(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, rows_ptr, ape_ptr,
                         norm_w_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr,
                         span, m, D, R, ring_rows, eps,
                         stride_rkv, stride_rg, stride_kv, stride_g, stride_rows, stride_ape,
                         stride_pool,
                         OVERLAP: tl.constexpr, SPAN_P: tl.constexpr, BLOCK_H: tl.constexpr):
    # One program = one group; BLOCK_H even + BLOCK_H odd channels per block.
    g = tl.program_id(0).to(tl.int64)
    src_dtype = ring_kv_ptr.dtype.element_ty
    offs_r = tl.arange(0, SPAN_P)                                             # [SPAN_P]
    rows = tl.load(rows_ptr + g * stride_rows + offs_r, mask=offs_r < span, other=-1).to(tl.int64)
    valid = rows >= 0
    from_ring = rows < ring_rows
    offs_h = tl.arange(0, BLOCK_H)                                            # [BLOCK_H]

    # Pass 1: sum of squares of the pooled entry (fp32, over the D channels).
    sumsq = tl.zeros([BLOCK_H], dtype=tl.float32)
    for c0 in range(0, D, 2 * BLOCK_H):
        even = c0 + 2 * offs_h
        c_ok = even < D
        a, b = _pool_pair(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
                          offs_r, even, c_ok, m, D, ring_rows,
                          stride_rkv, stride_rg, stride_kv, stride_g, stride_ape, OVERLAP)
        sumsq += a * a + b * b
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=0) / D + eps)

    # Pass 2: normalise, rotate the last 2R channels at the group's position, store.
    slot = tl.load(slot_ptr + g).to(tl.int64)
    rope0 = D - 2 * R                                                         # first rotated channel
    for c0 in range(0, D, 2 * BLOCK_H):
        even = c0 + 2 * offs_h
        c_ok = even < D
        a, b = _pool_pair(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
                          offs_r, even, c_ok, m, D, ring_rows,
                          stride_rkv, stride_rg, stride_kv, stride_g, stride_ape, OVERLAP)
        w_a = tl.load(norm_w_ptr + even, mask=c_ok, other=0.0).to(tl.float32)
        w_b = tl.load(norm_w_ptr + even + 1, mask=c_ok, other=0.0).to(tl.float32)
        a = (w_a * (a * rstd)).to(src_dtype).to(tl.float32)
        b = (w_b * (b * rstd)).to(src_dtype).to(tl.float32)
        is_rope = c_ok & (even >= rope0)
        pair = tl.where(is_rope, (even - rope0) // 2, 0)
        # cos/sin come from torch (as in the reference): Triton's tl.cos/tl.sin are fast
        # approximations that lose accuracy at the large angles of long contexts.
        cos = tl.load(cos_ptr + g * R + pair, mask=is_rope, other=1.0)
        sin = tl.load(sin_ptr + g * R + pair, mask=is_rope, other=0.0)
        a_out = tl.where(is_rope, a * cos - b * sin, a).to(src_dtype)
        b_out = tl.where(is_rope, b * cos + a * sin, b).to(src_dtype)
        out_ptr = pool_ptr + slot * stride_pool + even
        tl.store(out_ptr, a_out.to(pool_ptr.dtype.element_ty), mask=c_ok)
        tl.store(out_ptr + 1, b_out.to(pool_ptr.dtype.element_ty), mask=c_ok)


def close_groups(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                 rows: torch.Tensor, ring_rows: int, ape: torch.Tensor, overlap: bool,
                 norm_weight: torch.Tensor, eps: float, entry_pos: torch.Tensor, inv_freq: torch.Tensor,
                 pool: torch.Tensor, entry_slot: torch.Tensor, tile: int = TILE) -> None:
    """Close G groups into `pool` (same result as the reference composition; see the module doc).

    ring_kv/ring_gate [ring_rows, C] and kv/gate [T, C] (fresh) are the two row sources;
    rows [G, span] (-1 = missing); ape [m, C]; norm_weight [D]; entry_pos/entry_slot [G];
    inv_freq [R]; pool [N, D]. C = 2D, span = 2m with overlap (CSA); C = D, span = m without.
    """
    num_groups, span = rows.shape
    if num_groups == 0:
        return
    m, C = ape.shape
    D = pool.shape[-1]
    assert C == (2 * D if overlap else D) and span == (2 * m if overlap else m)
    assert D % 2 == 0 and 2 * inv_freq.shape[0] <= D
    for t in (ring_kv, ring_gate, kv, gate, ape, pool, norm_weight, inv_freq, rows):
        assert t.stride(-1) == 1, "channels must be contiguous"
    span_p = triton.next_power_of_2(span)
    block_h = max(16, min(triton.next_power_of_2(D) // 2, tile // span_p // 2))
    cos, sin = rope_cos_sin(entry_pos, inv_freq)                              # [G, R] fp32 each
    _close_groups_kernel[(num_groups,)](
        ring_kv, ring_gate, kv, gate, rows, ape, norm_weight, cos.contiguous(), sin.contiguous(), pool, entry_slot,
        span, m, D, inv_freq.shape[0], ring_rows, eps,
        ring_kv.stride(0), ring_gate.stride(0), kv.stride(0), gate.stride(0), rows.stride(0),
        ape.stride(0), pool.stride(0),
        OVERLAP=overlap, SPAN_P=span_p, BLOCK_H=block_h, num_warps=max(1, tile // 1024))
