"""RMSNorm (weighted, unweighted or none) + interleaved partial RoPE + store, one kernel.

The definitions are the torch references: rms_norm / rms_norm_unweighted (dsv4/ops/norm.py)
then apply_rope (dsv4/ops/rope.py), cast to the output's dtype. One program handles the rows
x[t, h, :D] of a block of heads h of one token t (H = 1 for plain rows), each held as its even
and odd channels ([D/2] each), so the RoPE pair (2i, 2i+1) is elementwise between the two
halves; pairs i >= D/2 - R are rotated by (cos, sin)[t, i - (D/2 - R)] (the last 2R channels).

Rounding follows the reference, in x's dtype `dt`:
  NORM 1 (unweighted): y = x * rsqrt(mean(x^2) + eps).to(dt), a dt product;
  NORM 2 (weighted):   y = (w * (x * rsqrt(mean(x^2) + eps))).to(dt), fp32 inside;
  RoPE:                out = rotate(y.float()).to(dt) on the rotated channels, y elsewhere;
then the store casts to the output's dtype. With `rows`, row t goes to out[rows[t], h].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import EMULATE, round_to

ROW_TILE = 4096     # pairs a program holds: heads of a token are grouped up to this


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("R",))
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows_ptr,
                      H, D, R, eps, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
                      NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                      SCATTER: tl.constexpr, BLOCK_H: tl.constexpr, HALF_P: tl.constexpr, RNE: tl.constexpr):
    # program (t, hb): rows x[t, hb*BLOCK_H + k] for k < BLOCK_H, loaded whole ([BLOCK_H, 2*HALF_P],
    # coalesced) and split into even / odd channels a, b [BLOCK_H, HALF_P]
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                   # [BLOCK_H] heads
    i = tl.arange(0, HALF_P)                                                  # [HALF_P] pairs
    c = tl.arange(0, 2 * HALF_P)                                              # [2*HALF_P] channels
    dt = x_ptr.dtype.element_ty
    ok = (h < H)[:, None] & (c < D)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h.to(tl.int64)[:, None] * stride_xh + c[None, :], mask=ok, other=0.0)
    a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, HALF_P, 2)))

    if NORM != 0:
        r = 1.0 / tl.sqrt(tl.sum(a * a + b * b, axis=1) / D + eps)[:, None]   # [BLOCK_H, 1]
        if NORM == 1:
            r = round_to(r, dt, RNE)
            a = round_to(a * r, dt, RNE)
            b = round_to(b * r, dt, RNE)
        else:
            w_a = tl.load(w_ptr + 2 * i, mask=i < D // 2, other=0.0).to(tl.float32)[None, :]
            w_b = tl.load(w_ptr + 2 * i + 1, mask=i < D // 2, other=0.0).to(tl.float32)[None, :]
            a = round_to(w_a * (a * r), dt, RNE)
            b = round_to(w_b * (b * r), dt, RNE)

    if ROPE:
        j = i - (D // 2 - R)                                                  # rotated pair index
        is_rope = (i < D // 2) & (j >= 0)
        j = tl.where(is_rope, j, 0)
        cos = tl.load(cos_ptr + t * stride_cs + j, mask=is_rope, other=1.0)[None, :]
        sin = tl.load(sin_ptr + t * stride_cs + j, mask=is_rope, other=0.0)[None, :]
        if INVERSE:
            sin = -sin
        a_rot = a * cos - b * sin
        b_rot = b * cos + a * sin
        a = tl.where(is_rope[None, :], a_rot, a)
        b = tl.where(is_rope[None, :], b_rot, b)

    if SCATTER:
        t = tl.load(rows_ptr + t).to(tl.int64)
    odt = out_ptr.dtype.element_ty
    y = tl.reshape(tl.join(round_to(round_to(a, dt, RNE), odt, RNE), round_to(round_to(b, dt, RNE), odt, RNE)),
                   (BLOCK_H, 2 * HALF_P))
    tl.store(out_ptr + t * stride_ot + h.to(tl.int64)[:, None] * stride_oh + c[None, :], y.to(odt), mask=ok)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [T, H, D] with unit channel stride (a view where possible)."""
    if x.dim() == 2:
        x = x[:, None, :]
    elif x.dim() != 3:
        x = x.reshape(-1, 1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0, norm: bool = True,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, inverse: bool = False,
              out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] or [T, H, D] (any row strides) -> normalised (weighted when `weight` [D] is given,
    no norm when `norm` is False) and rotated by cos/sin [T, R] (none when cos is None).

    Writes a new tensor shaped like x, or `out` [N, D] / [N, H, D] at rows `rows` [T] (long)."""
    x3 = _as_rows(x)
    T, H, D = x3.shape
    assert D % 2 == 0
    scatter = rows is not None
    if out is None:
        out3 = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
        out = out3.view(x.shape)
    else:
        out3 = out[:, None, :] if out.dim() == 2 else out
    assert out3.stride(-1) == 1 and tuple(out3.shape[1:]) == (H, D)
    if T == 0:
        return out
    rope = cos is not None
    R = cos.shape[-1] if rope else 0
    assert 2 * R <= D
    if rope:
        cos, sin = (c if c.stride(-1) == 1 else c.contiguous() for c in (cos, sin))
        assert cos.stride() == sin.stride()
    mode = 0 if not norm else (2 if weight is not None else 1)
    half_p = max(16, triton.next_power_of_2(D // 2))
    block_h = min(triton.next_power_of_2(H), max(1, ROW_TILE // half_p))
    _norm_rope_kernel[(T, triton.cdiv(H, block_h))](
        x3, weight if weight is not None else x3, cos if rope else x3, sin if rope else x3, out3,
        rows if scatter else x3,
        H, D, R, float(eps), x3.stride(0), x3.stride(1), out3.stride(0), out3.stride(1),
        cos.stride(0) if rope else 0,
        NORM=mode, ROPE=rope, INVERSE=inverse, SCATTER=scatter,
        BLOCK_H=block_h, HALF_P=half_p, RNE=EMULATE, num_warps=4 if block_h * half_p <= 2048 else 8)
    return out
