"""FP8 (e4m3, E8M0 scale per 128x128 block) and MXFP4 (e2m1 pairs, E8M0 scale per 32
inputs) weight formats of the released checkpoints: exact dequantisation, and quantisers
used to write test checkpoints."""
from __future__ import annotations

import torch

# e2m1 magnitudes by the low 3 bits of a nibble; bit 3 is the sign
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_BLOCK = 32
FP8_MAX = 448.0


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu, or raw exponent bytes as uint8) or a float scale -> fp32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127)
    return scale.float()


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Float scales -> E8M0 (float8_e8m0fnu) holding the same values, exactly: `e8m0_to_float`
    of the result equals `scale` bit for bit. ValueError naming the first value that is not a
    power of two in [2^-127, 2^127] (E8M0 has no sign, no mantissa and no zero)."""
    s = scale.float()
    exponent = torch.round(torch.log2(s.abs().clamp(min=2.0 ** -127))).clamp(-127, 127)
    codes = (exponent + 127).to(torch.uint8)
    bad = ~(e8m0_to_float(codes) == s)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"scale {float(s[at])!r} at {list(at)} is not a power of two in [2^-127, 2^127] "
                         f"(not representable in E8M0)")
    return codes.view(torch.float8_e8m0fnu)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """weight [out, in] float8_e4m3fn, scale [ceil(out/b0), ceil(in/b1)] -> fp32 [out, in]."""
    out, inp = weight.shape
    s = e8m0_to_float(scale).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
    return weight.float() * s


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed [out, in/2] int8 (low nibble = even input), scale [out, in/32] -> fp32 [out, in]."""
    b = packed.view(torch.uint8).to(torch.int32)
    nibbles = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)            # [out, in]
    mag = E2M1_VALUES.to(packed.device)[nibbles & 7]
    values = torch.where(nibbles & 8 != 0, -mag, mag)
    return values * e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=-1)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (E8M0-representable)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / qmax)))


def quant_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = weight.shape
    r0, r1 = -(-out // block[0]), -(-inp // block[1])
    padded = torch.zeros(r0 * block[0], r1 * block[1], device=weight.device)
    padded[:out, :inp] = weight.float()
    amax = padded.view(r0, block[0], r1, block[1]).abs().amax(dim=(1, 3))
    scale = _pow2_scale(amax, FP8_MAX)
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
    return (weight.float() / s).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quant_fp8_stacked(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., R, C] -> (float8_e4m3fn [..., R, C], fp32 scales [..., cdiv(R, 128), cdiv(C, 128)]),
    matrix by matrix (no fp32 temporary of the whole stack): the in-memory form of kept FP8
    experts (`load_model(keep_fp8=True)`)."""
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty(*weight.shape[:-2], -(-weight.shape[-2] // 128), -(-weight.shape[-1] // 128),
                         device=weight.device)
    return _quant_stacked(weight, quant_fp8, q, scales)


def quant_mxfp4_stacked(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., R, C] -> (packed uint8 [..., R, C/2], E8M0 bytes uint8 [..., R, C/32]), matrix
    by matrix: the in-memory form of kept MXFP4 experts (`load_model(keep_mxfp4=True)`)."""
    lead, cols = weight.shape[:-1], weight.shape[-1]
    q = torch.empty(*lead, cols // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(*lead, cols // FP4_BLOCK, dtype=torch.uint8, device=weight.device)
    return _quant_stacked(weight, quant_fp4, q, scales)


def _quant_stacked(weight: torch.Tensor, quant, q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill q and scales (stacks of [..., *] matrices) from weight [..., R, C] with `quant` (one
    matrix -> its codes and scales), one matrix at a time (no fp32 temporary of the stack):
    uint8 outputs take the raw bytes (packed nibbles, E8M0 exponents), others the values."""
    for qm, sm, wm in zip(q.view(-1, *q.shape[-2:]), scales.view(-1, *scales.shape[-2:]),
                          weight.reshape(-1, *weight.shape[-2:])):
        qm_, sm_ = quant(wm)
        qm.copy_(qm_.view(torch.uint8) if qm.dtype == torch.uint8 else qm_)
        sm.copy_(sm_.view(torch.uint8) if sm.dtype == torch.uint8 else sm_.float())
    return q, scales


def quant_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = weight.shape
    blocks = weight.float().view(out, inp // FP4_BLOCK, FP4_BLOCK)
    scale = _pow2_scale(blocks.abs().amax(-1), 6.0)
    x = (blocks / scale[..., None]).flatten(1)
    code = (x.abs()[..., None] - E2M1_VALUES.to(x.device)).abs().argmin(-1)   # nearest magnitude
    nib = (code | torch.where(x < 0, 8, 0)).to(torch.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def weight_format(w: torch.Tensor) -> str | None:
    """The format of a kept (quantised) weight, told by its dtype: float8_e4m3fn "fp8" (fp32
    128x128 block scales), uint8 "mxfp4" (packed e2m1 pairs, E8M0 bytes per 32 inputs), else
    None (unquantised)."""
    return {torch.float8_e4m3fn: "fp8", torch.uint8: "mxfp4"}.get(w.dtype)


def kept_scale_shape(shape: tuple[int, ...], fmt: str) -> tuple[int, ...]:
    """Scales of a kept weight stored as `shape` [..., R, C'] in format fmt (`weight_format`):
    "fp8" (C' = C) [..., cdiv(R, 128), cdiv(C, 128)]; "mxfp4" (packed: C' = C/2) [..., R, C/32]."""
    *lead, rows, cols = shape
    if fmt == "mxfp4":
        return (*lead, rows, cols * 2 // FP4_BLOCK)
    return (*lead, -(-rows // 128), -(-cols // 128))


def dequant_kept(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A kept quantised weight [..., R, C] (`weight_format`: FP8 with fp32 128x128 block scales,
    or MXFP4 packed [..., R, C/2] with E8M0 bytes [..., R, C/32]) -> fp32 [..., R, C]."""
    if weight_format(weight) == "mxfp4":
        return dequant_fp4(weight, scale)
    if weight.dim() == 2:
        return dequant_fp8(weight, scale)
    return torch.stack([dequant_kept(w, s) for w, s in zip(weight, scale)])


def unpacked_shape(w: torch.Tensor) -> tuple[int, ...]:
    """The matrix shape [..., R, C] of weight w (MXFP4: w is [..., R, C/2])."""
    return (*w.shape[:-1], w.shape[-1] * 2) if weight_format(w) == "mxfp4" else tuple(w.shape)
