"""Compressor pooling (torch reference): one compressed entry per closed group.

A group of ratio m is pooled per channel with softmax(gate + ape) over its token rows.
CSA (overlap=True) pools 2m rows: the previous group's m rows contribute their first
`D` channels (Ca), the group's own m rows their last `D` channels (Cb); a missing row
(-1, e.g. before position 0) gets weight 0. HCA (overlap=False) pools the m rows' D channels.

A step's rows come from two sources, the ring (the open groups' earlier tokens) and the
step's fresh projections: row r < ring_rows is ring[r], else fresh[r - ring_rows].
"""
import torch

from .backend import use_triton
from .norm import rms_norm
from .rope import apply_rope


def compress_pool(kv_src: torch.Tensor, gate_src: torch.Tensor, rows: torch.Tensor, ape: torch.Tensor,
                  overlap: bool) -> torch.Tensor:
    """kv_src/gate_src [N, C]; rows [G, span] flat row ids (-1 = missing); ape [m, C].

    Returns pooled entries [G, D] in kv_src's dtype (D = C/2 with overlap, else C), before norm/RoPE.
    """
    num_groups, span = rows.shape
    valid = rows >= 0
    kv = kv_src[rows.clamp(min=0)]                              # [G, span, C]
    gate = gate_src[rows.clamp(min=0)].float()
    if overlap:
        m, d = span // 2, kv.shape[-1] // 2
        kv = torch.cat([kv[:, :m, :d], kv[:, m:, d:]], dim=1)
        gate = torch.cat([gate[:, :m, :d] + ape[:, :d].float(), gate[:, m:, d:] + ape[:, d:].float()], dim=1)
    else:
        gate = gate + ape.float()
    gate = gate.masked_fill(~valid[..., None], float("-inf"))
    weights = torch.softmax(gate, dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)


def close_groups(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                 rows: torch.Tensor, ring_rows: int, ape: torch.Tensor, overlap: bool,
                 norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 pool: torch.Tensor, entry_slot: torch.Tensor) -> None:
    """Close G groups: pool[entry_slot] = RoPE(rms_norm(pooled), cos, sin) in the pool's dtype.

    ring_kv/ring_gate [ring_rows, C], kv/gate [T, C] fresh projections (cast to the ring's
    dtype), rows [G, span], cos/sin [G, R] at each group's first position, entry_slot [G]."""
    if use_triton(kv):
        from .triton import compress as triton_compress
        return triton_compress.close_groups(ring_kv, ring_gate, kv, gate, rows, ring_rows, ape, overlap,
                                            norm_weight, eps, cos, sin, pool, entry_slot)
    pooled = compress_pool(torch.cat([ring_kv, kv.to(ring_kv.dtype)]),
                           torch.cat([ring_gate, gate.to(ring_gate.dtype)]), rows, ape, overlap)
    pool[entry_slot] = apply_rope(rms_norm(pooled, norm_weight, eps), cos, sin).to(pool.dtype)


def ring_write(ring_kv: torch.Tensor, ring_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
               dst: torch.Tensor, src: torch.Tensor) -> None:
    """Move fresh rows into the ring: ring_kv[dst] = kv[src], ring_gate[dst] = gate[src]."""
    if use_triton(kv):
        from .triton import compress as triton_compress
        return triton_compress.ring_write(ring_kv, ring_gate, kv, gate, dst, src)
    ring_kv[dst] = kv[src].to(ring_kv.dtype)
    ring_gate[dst] = gate[src].to(ring_gate.dtype)
