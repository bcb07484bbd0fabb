"""RoPE inverse frequencies: "main" (θ = rope_theta, sliding layers and MTP) and
"compress" (θ = compress_rope_theta with YaRN, CSA/HCA layers, compressor entries, indexer)."""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig, YarnScaling


def inv_freq(theta: float, dim: int, yarn: YarnScaling | None = None) -> torch.Tensor:
    """[dim // 2] fp32. YaRN blends interpolated and extrapolated frequencies with a linear
    ramp between the correction dims of beta_fast / beta_slow; V4 applies no mscale."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / base
    if yarn is None:
        return extrapolated
    interpolated = 1.0 / (yarn.factor * base)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the extrapolated (original) frequency
    return interpolated * (1 - keep) + extrapolated * keep


def main_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    return inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim)


def compress_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    return inv_freq(cfg.compress_rope_theta, cfg.qk_rope_head_dim, cfg.yarn)
