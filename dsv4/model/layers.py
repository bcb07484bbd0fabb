"""Parameter holders. Weights are created uninitialised (the loader or init-random fills
them) and never require grad; the math lives in dsv4/ops."""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import rms_norm
from ..ops.quant import kept_scale_shape
from ..ops.quant_gemm import grouped_linear, fp8_dense_linear


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T, W [out, in] (no bias anywhere in V4). Kept FP8 (`keep_fp8`): W float8_e4m3fn
    with fp32 scales `scale` [cdiv(out, 128), cdiv(in, 128)] (the checkpoint's name), multiplied
    by the FP8 GEMMs of dsv4/ops/quant_gemm.py."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_fp8(self):
            return fp8_dense_linear(x, self.weight, self.scale)
        return torch.nn.functional.linear(x, self.weight)

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """Block-diagonal form (V4's o-groups): x [T, G*K] -> [T, G*N], output group g (rows
        [g*N, (g+1)*N) of W) from inputs [g*K, (g+1)*K)."""
        if is_fp8(self):
            return fp8_dense_linear(x, self.weight, self.scale, groups)
        return grouped_linear(x, self.weight, groups)

    def keep_fp8(self) -> None:
        """Hold W as float8_e4m3fn with fp32 block scales (uninitialised: the loader fills them)."""
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(kept_scale_shape(tuple(self.weight.shape), "fp8"), device=device),
                                  requires_grad=False)


def is_fp8(linear: Linear) -> bool:
    return linear.weight.dtype == torch.float8_e4m3fn


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight stays fp32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param(dim, dtype=torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fused_linear(x: torch.Tensor, linears: list[Linear]) -> tuple[torch.Tensor, ...]:
    """[l(x) for l in linears] in one GEMM per weight format: x [T, in] -> column slices
    [T, out_i] (views).

    The linears' weights are made row blocks (views) of one [sum out_i, in] tensor on first
    use, so the checkpoint names stay and no weight is held twice. Re-fused when a weight was
    replaced since (e.g. moved to another device). Kept-FP8 linears (the released checkpoints'
    wq_a and wkv) fuse among themselves, weights and scales alike, when every one but the last
    has whole 128-row scale blocks; the others fuse apart; the results come in `linears`' order."""
    fp8 = [lin for lin in linears if is_fp8(lin)]
    if not fp8:
        return _fused_plain(x, linears)
    plain = [lin for lin in linears if not is_fp8(lin)]
    out = dict(zip(map(id, plain), _fused_plain(x, plain))) if plain else {}
    if all(lin.weight.shape[0] % 128 == 0 for lin in fp8[:-1]):
        y = fp8_dense_linear(x, _fused_weight(fp8, "weight", "_fused_rows"), _fused_weight(fp8, "scale", "_fused_scales"))
        out.update(zip(map(id, fp8), y.split([lin.weight.shape[0] for lin in fp8], dim=-1)))
    else:
        out.update((id(lin), lin(x)) for lin in fp8)
    return tuple(out[id(lin)] for lin in linears)


def _fused_plain(x: torch.Tensor, linears: list[Linear]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.nn.functional.linear(x, _fused_weight(linears, "weight", "_fused_rows")).split(
        [lin.weight.shape[0] for lin in linears], dim=-1))


def _fused_weight(linears: list[Linear], attr: str, key: str) -> torch.Tensor:
    """The linears' `attr` tensors as row blocks of one tensor, cached under `key` on the first."""
    fused = linears[0].__dict__.get(key)
    tensors = [getattr(lin, attr) for lin in linears]
    if fused is not None and _are_row_blocks(fused, tensors):
        return fused
    with torch.inference_mode(False), torch.no_grad():
        fused = torch.cat(tensors)
        start = 0
        for t in tensors:
            rows = t.shape[0]
            t.data = fused[start:start + rows]
            start += rows
    linears[0].__dict__[key] = fused       # a plain attribute: not a parameter or buffer
    return fused


def _are_row_blocks(fused: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    row_bytes, start = fused.shape[1] * fused.element_size(), fused.data_ptr()
    for w in tensors:
        if w.data_ptr() != start or not w.is_contiguous() or w.dtype != fused.dtype or w.device != fused.device:
            return False
        start += w.shape[0] * row_bytes
    return start == fused.data_ptr() + fused.shape[0] * row_bytes
