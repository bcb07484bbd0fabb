"""GEMMs that read FP8 weights as the released checkpoints store them (float8_e4m3fn [N, K] with
fp32 power-of-two scales [cdiv(N, 128), cdiv(K, 128)], one per 128x128 block; dsv4/ops/quant.py):
the dense and attention projections kept FP8 (`load_model(keep_fp8=True)`, dsv4/model/layers.py).

Two ways, the same signature (x [..., G*K], w [G*N, K], scale) -> [..., G*N] in x's dtype:
- `fp8_linear` (W8A16): x times the weight dequantised (fp32 w * scale, rounded to x's dtype:
  what the load-time dequantisation stores). The Triton kernel converts each FP8 tile for the
  tensor cores and scales the K-block's partial product instead (exact for power-of-two scales).
- `fp8_linear_w8a8` (W8A8, as DeepSeek's inference code: act_quant + fp8_gemm): x quantised per
  token and group of 128 inputs to FP8 with a power-of-two scale (`act_quant`), then an FP8 x FP8
  product in fp32 times both scales.
`groups` = G > 1 is the grouped (block-diagonal) projection of V4's o-groups: output group g
(rows [g*N, (g+1)*N) of w) reads inputs [g*K, (g+1)*K) of x.

The torch functions here are the definitions; on CUDA (ops/backend.py) the Triton kernels in
dsv4/ops/triton/quant_gemm.py run. `FP8_DENSE_GEMM` picks what `fp8_dense_linear` (the model's
kept-FP8 Linear) runs: "w8a16", "w8a8", or "auto" (W8A8 from W8A8_MIN_TOKENS rows, where the
FP8 tensor cores pay; W8A16 below, where the weight bytes dominate). `python -m
benchmarks.quant_gemm` measures both on the H200.
"""
from __future__ import annotations

import torch

from .backend import use_triton
from .quant import FP8_MAX, dequant_fp8

ACT_GROUP = 128
FP8_DENSE_GEMM = "w8a16"        # not yet measured on an H200: benchmarks/quant_gemm.py decides
W8A8_MIN_TOKENS = 256
_E4M3_MAX_EXP = 8               # FP8_MAX = 448 = 1.75 * 2^8


def fp8_dense_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The kept-FP8 projection the model runs: W8A16 or W8A8 as FP8_DENSE_GEMM says."""
    rows = x.numel() // max(x.shape[-1], 1)
    if FP8_DENSE_GEMM == "w8a8" or (FP8_DENSE_GEMM == "auto" and rows >= W8A8_MIN_TOKENS):
        return fp8_linear_w8a8(x, w, scale, groups)
    return fp8_linear(x, w, scale, groups)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """W8A16: x [..., G*K] @ dequant(w, scale)^T per group -> [..., G*N] in x's dtype."""
    _check(x, w, scale, groups)
    if use_triton(x):
        from .triton import quant_gemm
        return quant_gemm.fp8_gemm(x, w, scale, groups=groups)
    return grouped_linear(x, dequant_fp8(w, scale).to(x.dtype), groups)


def fp8_linear_w8a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """W8A8: act_quant(x) (per token, per 128 inputs) times the FP8 weight, both scales applied to
    the fp32 product -> [..., G*N] in x's dtype."""
    _check(x, w, scale, groups)
    if use_triton(x):
        from .triton import quant_gemm
        xq, xs = quant_gemm.act_quant(x.reshape(-1, x.shape[-1]))
        return quant_gemm.fp8_gemm(xq, w, scale, groups=groups, x_scale=xs, out_dtype=x.dtype).view(
            *x.shape[:-1], w.shape[0])
    xq, xs = act_quant(x)
    xd = xq.float() * xs.repeat_interleave(ACT_GROUP, -1)[..., :x.shape[-1]]
    return grouped_linear(xd, dequant_fp8(w, scale), groups).to(x.dtype)


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., cdiv(K, 128)]): per group of 128
    inputs s = the smallest power of two with amax <= 448 s (amax floored at 1e-4, as DeepSeek's
    act_quant), codes = x / s rounded to nearest even. The scale is computed from amax's bits
    (exponent, and whether its mantissa exceeds 1.75 = 448 / 2^8), so it is exact everywhere."""
    if use_triton(x):
        from .triton import quant_gemm
        xq, xs = quant_gemm.act_quant(x.reshape(-1, x.shape[-1]))
        return xq.view(x.shape), xs.view(*x.shape[:-1], -1)
    K = x.shape[-1]
    groups = -(-K // ACT_GROUP)
    padded = torch.nn.functional.pad(x.float(), (0, groups * ACT_GROUP - K))
    amax = padded.unflatten(-1, (groups, ACT_GROUP)).abs().amax(-1).clamp(min=1e-4)
    scale = pow2_scale_bits(amax)
    inv = (254 - (scale.view(torch.int32) >> 23)).bitwise_left_shift(23).view(torch.float32)   # 1 / scale, exact
    xq = (x.float() * inv.repeat_interleave(ACT_GROUP, -1)[..., :K]).to(torch.float8_e4m3fn)
    return xq, scale


def pow2_scale_bits(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax >= 1e-4 -> the smallest power of two s with amax <= FP8_MAX * s, from the bits:
    amax = m * 2^e (m in [1, 2)) needs s = 2^(e - 8) when m <= 1.75, else 2^(e - 7)."""
    bits = amax.float().view(torch.int32)
    exponent = (bits >> 23) - _E4M3_MAX_EXP + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    assert FP8_MAX == 1.75 * 2 ** _E4M3_MAX_EXP
    return exponent.bitwise_left_shift(23).view(torch.float32)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: int) -> torch.Tensor:
    """x [..., G*K] @ w^T per group (w [G*N, K]) -> [..., G*N]."""
    if groups == 1:
        return torch.nn.functional.linear(x, w)
    grouped = x.unflatten(-1, (groups, -1))                                  # [..., G, K]
    out = torch.einsum("...gi,goi->...go", grouped, w.unflatten(0, (groups, -1)))
    return out.flatten(-2)


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int) -> None:
    N, K = w.shape
    assert w.dtype == torch.float8_e4m3fn, f"fp8 GEMM: weight dtype {w.dtype}, expected float8_e4m3fn"
    assert x.shape[-1] == groups * K and N % groups == 0, \
        f"fp8 GEMM: x [..., {x.shape[-1]}] does not fit weight [{N}, {K}] in {groups} group(s)"
    assert tuple(scale.shape) == (-(-N // 128), -(-K // 128)), \
        f"fp8 GEMM: scale shape {tuple(scale.shape)}, expected {(-(-N // 128), -(-K // 128))}"
