"""RMS normalisation (torch reference; Triton: ops/triton/norm_rope.py)."""
import torch

from .backend import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim; computed in fp32, returned in x's dtype."""
    if use_triton(x):
        from .triton.norm_rope import norm_rope
        return norm_rope(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight (V4's per-head q norm and mHC input norm)."""
    if use_triton(x):
        from .triton.norm_rope import norm_rope
        return norm_rope(x, None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
