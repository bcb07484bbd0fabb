"""The fused RMSNorm + RoPE row kernel (dsv4/ops/triton/norm_rope.py) against its torch
definition (rms_norm_unweighted / rms_norm then apply_rope) at V4-Flash shapes, bf16.

    python -m benchmarks.kernels.norm_rope        # needs CUDA; seconds

Checks first (exit 1 on a mismatch beyond one bf16 ulp of the RoPE pair's magnitude: the
rotation mixes the two channels of a pair, so a channel that cancels to ~0 carries the
rounding of its pair); then times both
(CUDA events, median) and prints GB/s for the bytes the op must move (x read, out written)
against 4.2 TB/s.
"""
import sys


import torch

from dsv4.ops import backend, norm, rope
from dsv4.ops.triton.norm_rope import norm_rope
from dsv4.bench.timing import median_ms

HBM_BPS, EPS, R = 4.2e12, 1e-6, 32          # R: rotated pairs (qk_rope_head_dim 64)
# (name, T, H, D, mode): q = per-head unweighted norm + RoPE, o = inverse RoPE only,
# kv = weighted norm + RoPE
CASES = [("q", 1, 64, 512, "q"), ("q", 4096, 64, 512, "q"), ("q", 16384, 64, 512, "q"),
         ("o", 16384, 64, 512, "o"), ("kv", 16384, 1, 512, "kv"), ("kv", 1, 1, 512, "kv")]


def reference(x, w, cos, sin, mode):
    with backend.forced("reference"):
        if mode == "q":
            return rope.apply_rope(norm.rms_norm_unweighted(x, EPS), cos, sin)
        if mode == "o":
            return rope.apply_rope(x, cos, sin, inverse=True)
        return rope.apply_rope(norm.rms_norm(x, w, EPS), cos, sin)


def fused(x, w, cos, sin, mode):
    if mode == "q":
        return norm_rope(x, None, EPS, True, cos, sin)
    if mode == "o":
        return norm_rope(x, None, 0.0, False, cos, sin, inverse=True)
    return norm_rope(x, w, EPS, True, cos, sin)


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    print(f"{'case':<6}{'T':>7}{'H':>4}{'D':>5}{'torch ms':>10}{'triton ms':>11}{'speed-up':>10}{'GB/s':>8}"
          f"{'of HBM':>8}{'max err/ulp':>13}")
    for name, T, H, D, mode in CASES:
        x = torch.randn(T, H, D, generator=gen, device="cuda").to(torch.bfloat16).squeeze(1)
        w = (1 + 0.1 * torch.randn(D, generator=gen, device="cuda")).to(torch.bfloat16)
        ang = torch.rand(T, R, generator=gen, device="cuda") * 6.28
        cos, sin = ang.cos(), ang.sin()
        want, got = reference(x, w, cos, sin, mode), fused(x, w, cos, sin, mode)
        pair = want.float().view(*want.shape[:-1], D // 2, 2).norm(dim=-1, keepdim=True)
        ulp = (pair.expand(*want.shape[:-1], D // 2, 2).reshape(want.shape) * 2 ** -7).clamp_min(1e-6)
        err = float(((got.float() - want.float()).abs() / ulp).max())
        ok &= err <= 1.0
        t_ref = median_ms(lambda: reference(x, w, cos, sin, mode))
        t_tri = median_ms(lambda: fused(x, w, cos, sin, mode))
        gbs = 2 * x.numel() * 2 / (t_tri * 1e-3) / 1e9
        print(f"{name:<6}{T:>7}{H:>4}{D:>5}{t_ref:>10.3f}{t_tri:>11.3f}{t_ref / t_tri:>9.1f}x{gbs:>8.0f}"
              f"{gbs * 1e9 / HBM_BPS:>8.0%}{err:>13.2f}")
    print("OK: the kernel agrees with the reference" if ok else "MISMATCH beyond one bf16 ulp")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
