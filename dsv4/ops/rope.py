"""Interleaved partial RoPE (torch reference; Triton: ops/triton/norm_rope.py).

V4 rotates adjacent channel pairs (2i, 2i+1) of the *last* `2 * cos.shape[-1]` channels of
each head and leaves the leading channels untouched. The attention output is rotated back
with the conjugate rotation (`inverse=True`, i.e. position -t).
"""
import torch

from .backend import use_triton
from .norm import rms_norm, rms_norm_unweighted


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (int) -> cos, sin [..., rope_dim // 2] in fp32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    return freqs.cos(), freqs.sin()


def _triton_rows(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """The kernel takes x [T, D] / [T, H, D] with cos/sin [T, R]."""
    return use_triton(x) and x.dim() in (2, 3) and cos.dim() == 2 and cos.shape[0] == x.shape[0]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, (H,) D]; cos/sin [T, R/2] broadcast over heads. Returns x with its last R dims rotated."""
    if _triton_rows(x, cos):
        from .triton.norm_rope import norm_rope as triton_norm_rope
        return triton_norm_rope(x, norm=False, cos=cos, sin=sin, inverse=inverse)
    half = cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    pairs = rope.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """apply_rope(rms_norm(x)) (rms_norm_unweighted when weight is None); x [T, (H,) D].

    With `out`/`rows`: written to out[rows] (rows [T] long) in out's dtype, returns out."""
    if _triton_rows(x, cos):
        from .triton.norm_rope import norm_rope as triton_norm_rope
        return triton_norm_rope(x, weight, eps, cos=cos, sin=sin, out=out, rows=rows)
    y = apply_rope(rms_norm(x, weight, eps) if weight is not None else rms_norm_unweighted(x, eps), cos, sin)
    if out is None:
        return y
    out[rows] = y.to(out.dtype)
    return out
