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


def fused_linear(x: torch.Tensor, linears: list[Linear]) -> tuple[torch.Tensor, ...]:
    """[l(x) for l in linears] in one GEMM: x [T, in] -> column slices [T, out_i] (views).

    The linears' weights are made row blocks (views) of one [sum out_i, in] tensor on first
    use, so the checkpoint names stay and no weight is held twice. Re-fused when a weight was
    replaced since (e.g. moved to another device)."""
    return tuple(torch.nn.functional.linear(x, _fused_weight(linears)).split(
        [lin.weight.shape[0] for lin in linears], dim=-1))


def _fused_weight(linears: list[Linear]) -> torch.Tensor:
    fused = linears[0].__dict__.get("_fused_rows")
    if fused is not None and _are_row_blocks(fused, linears):
        return fused
    with torch.inference_mode(False), torch.no_grad():
        fused = torch.cat([lin.weight for lin in linears])
        start = 0
        for lin in linears:
            rows = lin.weight.shape[0]
            lin.weight.data = fused[start:start + rows]
            start += rows
    linears[0].__dict__["_fused_rows"] = fused       # a plain attribute: not a parameter or buffer
    return fused


def _are_row_blocks(fused: torch.Tensor, linears: list[Linear]) -> bool:
    row_bytes, start = fused.shape[1] * fused.element_size(), fused.data_ptr()
    for lin in linears:
        w = lin.weight
        if w.data_ptr() != start or not w.is_contiguous() or w.dtype != fused.dtype or w.device != fused.device:
            return False
        start += w.shape[0] * row_bytes
    return start == fused.data_ptr() + fused.shape[0] * row_bytes
