"""Parameter holders. Weights are created uninitialised (the loader or init-random fills
them) and never require grad; the math lives in dsv4/ops."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import rms_norm


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T, W [out, in] (no bias anywhere in V4)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight stays fp32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
