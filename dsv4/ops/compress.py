"""Compressor pooling (torch reference): one compressed entry per closed group.

A group of ratio m is pooled per channel with softmax(gate + ape) over its token rows.
CSA (overlap=True) pools 2m rows: the previous group's m rows contribute their first
`D` channels (Ca), the group's own m rows their last `D` channels (Cb); a missing row
(-1, e.g. before position 0) gets weight 0. HCA (overlap=False) pools the m rows' D channels.
"""
import torch


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
