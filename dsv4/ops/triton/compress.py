"""The compressor's step in Triton: closing groups (pool, then RMSNorm + RoPE + pool write) and
moving the step's tail into the ring. Definitions: close_groups / ring_write in dsv4/ops/compress.py.

`_pool_kernel`, one program per (group, block of channels): gathers the group's rows straight
from the two sources (row r < ring_rows is ring[r], else fresh[r - ring_rows]; -1 = missing),
so cat(ring, fresh) is never materialised, and writes the pooled entry [G, D]. The norm and
RoPE are the fused row kernel of ops/triton/norm_rope.py, which scatters into the pool.

Rounding follows the reference (in the ring's dtype; fresh rows are cast to it first): the
softmax weights are rounded before they multiply kv, each product is rounded (torch's
`kv * weights`), the fp32 sum of the products is rounded once.
"""
import torch
import triton
import triton.language as tl

from .norm_rope import norm_rope
from .rounding import EMULATE, round_to

TILE = 2048         # elements of one [span, channels] tile of kv (and of gate)


@triton.jit
def _pool_block(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, valid, from_ring,
                offs_r, offs_c, c_ok, m, D, ring_rows,
                stride_rkv, stride_rg, stride_kv, stride_g, stride_ape,
                OVERLAP: tl.constexpr, RNE: tl.constexpr):
    """Pooled channels offs_c [BLOCK_C] of one group, rounded to the source dtype, in fp32.

    rows/valid/from_ring/offs_r [SPAN_P]: the group's row ids, whether present, whether in the ring.
    """
    src_dtype = ring_kv_ptr.dtype.element_ty
    if OVERLAP:     # rows [0, m) carry channels [0, D), rows [m, 2m) channels [D, 2D)
        second = (offs_r >= m).to(tl.int64)                                   # [SPAN_P]
        col = offs_c[None, :] + (second * D)[:, None]                         # [SPAN_P, BLOCK_C]
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
    kv = tl.where(ring_ok, kv_ring.to(tl.float32), round_to(kv_fresh.to(tl.float32), src_dtype, RNE))
    g_ring = tl.load(ring_gate_ptr + ring_row * stride_rg + col, mask=ring_ok, other=0.0)
    g_fresh = tl.load(gate_ptr + fresh_row * stride_g + col, mask=fresh_ok, other=0.0)
    gate = tl.where(ring_ok, g_ring.to(tl.float32),
                    round_to(g_fresh.to(tl.float32), ring_gate_ptr.dtype.element_ty, RNE))
    ape = tl.load(ape_ptr + ape_row[:, None] * stride_ape + col, mask=ok, other=0.0)

    score = tl.where(valid[:, None], gate + ape.to(tl.float32), float("-inf"))
    p = tl.exp(score - tl.max(score, axis=0)[None, :])                        # missing rows: 0
    w = round_to(p / tl.sum(p, axis=0)[None, :], src_dtype, RNE)
    return round_to(tl.sum(round_to(kv * w, src_dtype, RNE), axis=0), src_dtype, RNE)   # [BLOCK_C]


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("ring_rows",))
def _pool_kernel(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, rows_ptr, ape_ptr, out_ptr,
                 span, m, D, ring_rows,
                 stride_rkv, stride_rg, stride_kv, stride_g, stride_rows, stride_ape, stride_out,
                 OVERLAP: tl.constexpr, SPAN_P: tl.constexpr, BLOCK_C: tl.constexpr, RNE: tl.constexpr):
    # program (g, c): channels [c*BLOCK_C, (c+1)*BLOCK_C) of group g's pooled entry -> out [G, D]
    g = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, SPAN_P)                                             # [SPAN_P]
    rows = tl.load(rows_ptr + g * stride_rows + offs_r, mask=offs_r < span, other=-1).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)               # [BLOCK_C]
    c_ok = offs_c < D
    pooled = _pool_block(ring_kv_ptr, ring_gate_ptr, kv_ptr, gate_ptr, ape_ptr, rows, rows >= 0,
                         rows < ring_rows, offs_r, offs_c, c_ok, m, D, ring_rows,
                         stride_rkv, stride_rg, stride_kv, stride_g, stride_ape, OVERLAP, RNE)
    tl.store(out_ptr + g * stride_out + offs_c, pooled.to(out_ptr.dtype.element_ty), mask=c_ok)


@triton.jit
def _ring_write_kernel(kv_ptr, gate_ptr, ring_kv_ptr, ring_gate_ptr, dst_ptr, src_ptr, C,
                       stride_kv, stride_g, stride_rkv, stride_rg, BLOCK_C: tl.constexpr, RNE: tl.constexpr):
    # program (i, c): ring_kv[dst[i]] = kv[src[i]] and ring_gate[dst[i]] = gate[src[i]], channels of block c
    i = tl.program_id(0)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    src = tl.load(src_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    kv_t = ring_kv_ptr.dtype.element_ty          # (one per line: Triton 3.6 cannot unpack dtypes)
    gate_t = ring_gate_ptr.dtype.element_ty
    kv = tl.load(kv_ptr + src * stride_kv + offs, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + src * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(ring_kv_ptr + dst * stride_rkv + offs, round_to(kv, kv_t, RNE).to(kv_t), mask=ok)
    tl.store(ring_gate_ptr + dst * stride_rg + offs, round_to(gate, gate_t, RNE).to(gate_t), mask=ok)


def _rows_ok(*tensors):
    for t in tensors:
        assert t.dim() == 2 and t.stride(-1) == 1, "rows with contiguous channels expected"


def pool_groups(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                rows: torch.Tensor, ring_rows: int, ape: torch.Tensor, overlap: bool, tile: int = TILE) -> torch.Tensor:
    """compress_pool over cat(ring, fresh) without the cat -> pooled [G, D] in the ring's dtype.

    ring_kv/ring_gate [ring_rows, C], kv/gate [T, C] (any row stride), rows [G, span] (-1 =
    missing), ape [m, C]; C = 2D, span = 2m with overlap (CSA); C = D, span = m without."""
    _rows_ok(ring_kv, ring_gate, kv, gate, ape, rows)
    num_groups, span = rows.shape
    m, C = ape.shape
    D = C // 2 if overlap else C
    assert span == (2 * m if overlap else m) and kv.shape[1] == C and ring_kv.shape[1] == C
    out = torch.empty(num_groups, D, dtype=ring_kv.dtype, device=ring_kv.device)
    if num_groups == 0:
        return out
    span_p = triton.next_power_of_2(span)
    block_c = max(16, min(triton.next_power_of_2(D), tile // span_p))
    _pool_kernel[(num_groups, triton.cdiv(D, block_c))](
        ring_kv, ring_gate, kv, gate, rows, ape, out, span, m, D, ring_rows,
        ring_kv.stride(0), ring_gate.stride(0), kv.stride(0), gate.stride(0), rows.stride(0),
        ape.stride(0), out.stride(0),
        OVERLAP=overlap, SPAN_P=span_p, BLOCK_C=block_c, RNE=EMULATE, num_warps=4)
    return out


def close_groups(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                 rows: torch.Tensor, ring_rows: int, ape: torch.Tensor, overlap: bool,
                 norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 pool: torch.Tensor, entry_slot: torch.Tensor, tile: int = TILE) -> None:
    """pool[entry_slot] = RoPE(rms_norm(pooled)) at cos/sin [G, R]: two kernels (see the module doc)."""
    if rows.shape[0] == 0:
        return
    pooled = pool_groups(ring_kv, ring_gate, kv, gate, rows, ring_rows, ape, overlap, tile)
    norm_rope(pooled, norm_weight, eps, cos=cos, sin=sin, out=pool, rows=entry_slot)


def ring_write(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
               dst: torch.Tensor, src: torch.Tensor, block_c: int = 512) -> None:
    """ring_kv[dst] = kv[src], ring_gate[dst] = gate[src] (cast to the rings' dtypes), one kernel."""
    _rows_ok(ring_kv, ring_gate, kv, gate)
    C = kv.shape[1]
    if dst.shape[0] == 0:
        return
    block_c = min(block_c, triton.next_power_of_2(C))
    _ring_write_kernel[(dst.shape[0], triton.cdiv(C, block_c))](
        kv, gate, ring_kv, ring_gate, dst, src, C,
        kv.stride(0), gate.stride(0), ring_kv.stride(0), ring_gate.stride(0),
        BLOCK_C=block_c, RNE=EMULATE, num_warps=4)
