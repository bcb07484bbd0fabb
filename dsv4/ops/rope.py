"""Interleaved partial RoPE (torch reference).

V4 rotates adjacent channel pairs (2i, 2i+1) of the *last* `2 * cos.shape[-1]` channels of
each head and leaves the leading channels untouched. The attention output is rotated back
with the conjugate rotation (`inverse=True`, i.e. position -t).
"""
import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (int) -> cos, sin [..., rope_dim // 2] in fp32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device, torch.float32)
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [T, (H,) D]; cos/sin [T, R/2] broadcast over heads. Returns x with its last R dims rotated."""
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
