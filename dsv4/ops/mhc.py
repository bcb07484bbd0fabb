"""Manifold-constrained hyper-connections (torch reference).

Streams h [T, N, D] (N = hc_mult). A projection of the normalised, flattened streams gives
pre [T, N] (sigmoid + eps), post [T, N] (2 sigmoid) and comb [T, N, N] (row softmax + eps,
then Sinkhorn: column, then (iters-1) x row/column). The block input is sum_j pre_j h_j and
the block output is recombined as out_k = post_k F + sum_j comb[j, k] h_j.
"""
import torch
import torch.nn.functional as F

from .backend import use_triton
from .norm import rms_norm_unweighted


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, N, D] -> (collapsed [T, D] in h's dtype, post [T, N] fp32, comb [T, N, N] fp32)."""
    if use_triton(h):
        from .triton import mhc as triton_mhc
        return triton_mhc.hc_pre(h, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    n = h.shape[1]
    mixes = F.linear(rms_norm_unweighted(h.flatten(1).float(), norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
    return collapsed, post, comb


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out [T, D] (block output), h [T, N, D] -> new streams [T, N, D]."""
    if use_triton(h) and out.dtype == h.dtype:
        from .triton import mhc as triton_mhc
        return triton_mhc.hc_post(out, h, post, comb)
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """Final collapse of the streams: h [T, N, D] -> [T, D]."""
    if use_triton(h):
        from .triton import mhc as triton_mhc
        return triton_mhc.hc_head(h, fn, base, scale, norm_eps, hc_eps)
    mixes = F.linear(rms_norm_unweighted(h.flatten(1).float(), norm_eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float()[0] + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
