"""Triton kernels for the routed experts at decode sizes (few (token, expert) pairs); the
definition is `routed_experts_loop` in dsv4/ops/moe.py.

At decode the op is a set of matrix-vector products that must stream each selected expert's
weights once; a grouped GEMM over all E groups costs far more than that. Two launches, no weight
copies, no host synchronisation (grids depend only on T and k, so the op is CUDA-graph safe):

1. `_up_gate_kernel`, one program per (pair p = t*k + j, tile of I):
     e = ids[p];  gate = w1[e] @ x[t],  up = w3[e] @ x[t]           (fp32 accumulation)
     h[p, i] = silu(min(gate, L)) * clamp(up, -L, L)                  stored in x's dtype
   Storing h in x's dtype matches the reference, which rounds h to x's dtype before the down
   projection (its gate/up/silu are bf16 ops in bf16; here they stay fp32 until h).
2. `_down_kernel`, one program per (token t, tile of H), summing its k experts in registers
   (no atomics):  out[t, n] = sum_j weights[t, j] * (w2[ids[t, j]] @ h[t*k + j])[n]  (fp32),
   written in x's dtype.

Both are GEMVs done as fp32 elementwise products + tl.sum (bandwidth-bound; no tl.dot, which
also keeps Triton's interpreter exact in bf16). Weight rows are read along their contiguous
last dimension. Expert offsets use the int64 ids (e * I * H exceeds int32 at V4 sizes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# tile defaults (tuned by benchmarks/kernels/moe.py on an H200 at V4-Flash shapes)
UP_BLOCK_I, UP_BLOCK_H, UP_WARPS = 16, 256, 4
DOWN_BLOCK_H, DOWN_BLOCK_I, DOWN_WARPS = 8, 256, 8   # best measured on an H200 (benchmarks/kernels/moe.py)


@triton.jit
def _up_gate_kernel(x_ptr, ids_ptr, w1_ptr, w3_ptr, h_ptr, K, H, I,
                    stride_we, stride_wi, limit,
                    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    # x [T, H]; ids [T*k] int64; w1/w3 [E, I, H] (last dim contiguous) -> h [T*k, I] (x's dtype)
    p = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)       # [BLOCK_I]
    i_ok = i < I
    e = tl.load(ids_ptr + p)                                      # int64 scalar
    t = p // K
    x_row = x_ptr + t.to(tl.int64) * H
    w_off = e * stride_we + i[:, None] * stride_wi                # [BLOCK_I, 1]
    gate = tl.zeros((BLOCK_I,), dtype=tl.float32)
    up = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)                           # [BLOCK_H]
        h_ok = hh < H
        xv = tl.load(x_row + hh, mask=h_ok, other=0.0).to(tl.float32)[None, :]   # [1, BLOCK_H]
        m = i_ok[:, None] & h_ok[None, :]
        w1 = tl.load(w1_ptr + w_off + hh[None, :], mask=m, other=0.0).to(tl.float32)  # [BLOCK_I, BLOCK_H]
        w3 = tl.load(w3_ptr + w_off + hh[None, :], mask=m, other=0.0).to(tl.float32)
        gate += tl.sum(w1 * xv, axis=1)
        up += tl.sum(w3 * xv, axis=1)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up                         # silu(gate) * up
    tl.store(h_ptr + p.to(tl.int64) * I + i, h.to(h_ptr.dtype.element_ty), mask=i_ok)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, wt_ptr, w2_ptr, out_ptr, K, H, I,
                 stride_we, stride_wh,
                 BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
    # h [T*k, I]; ids [T*k] int64; weights [T*k] fp32; w2 [E, H, I] (last dim contiguous)
    # -> out [T, H] (x's dtype)
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)       # [BLOCK_H] output features
    n_ok = n < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(K):
        p = t * K + j
        e = tl.load(ids_ptr + p)                                  # int64 scalar
        wt = tl.load(wt_ptr + p)                                  # fp32 routing weight
        w_off = e * stride_we + n[:, None] * stride_wh            # [BLOCK_H, 1]
        h_row = h_ptr + p.to(tl.int64) * I
        y = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for i0 in range(0, I, BLOCK_I):
            ii = i0 + tl.arange(0, BLOCK_I)                       # [BLOCK_I]
            i_ok = ii < I
            hv = tl.load(h_row + ii, mask=i_ok, other=0.0).to(tl.float32)[None, :]   # [1, BLOCK_I]
            w2 = tl.load(w2_ptr + w_off + ii[None, :], mask=n_ok[:, None] & i_ok[None, :],
                         other=0.0).to(tl.float32)                # [BLOCK_H, BLOCK_I]
            y += tl.sum(w2 * hv, axis=1)
        acc += wt * y
    tl.store(out_ptr + t.to(tl.int64) * H + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, limit: float, *,
                   up_tiles: tuple[int, int, int] | None = None,
                   down_tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Same semantics as dsv4.ops.moe.routed_experts_loop. x [T, H]; weights [T, k] fp32;
    ids [T, k]; w1/w3 [E, I, H]; w2 [E, H, I] -> [T, H] in x's dtype.

    up_tiles = (BLOCK_I, BLOCK_H, num_warps) and down_tiles = (BLOCK_H, BLOCK_I, num_warps)
    override the defaults (tuning)."""
    T, H = x.shape
    k = ids.shape[1]
    E, I, _ = w1.shape
    assert w1.shape == w3.shape == (E, I, H) and w2.shape == (E, H, I), "expert weight shapes"
    assert w1.stride() == w3.stride() and w1.stride(2) == 1 and w2.stride(2) == 1, \
        "w1/w3 must share strides; the last dim of w1/w2/w3 must be contiguous"
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0 or k == 0:
        return out.zero_()
    x = x.contiguous()
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()                   # [T*k]
    flat_w = weights.reshape(-1).to(torch.float32).contiguous()               # [T*k]
    h = torch.empty((T * k, I), dtype=x.dtype, device=x.device)              # swiglu, x's dtype

    bi, bh, nw = up_tiles or (UP_BLOCK_I, UP_BLOCK_H, UP_WARPS)
    _up_gate_kernel[(T * k, triton.cdiv(I, bi))](
        x, flat_ids, w1, w3, h, k, H, I, w1.stride(0), w1.stride(1), float(limit),
        BLOCK_I=bi, BLOCK_H=bh, num_warps=nw)
    bh, bi, nw = down_tiles or (DOWN_BLOCK_H, DOWN_BLOCK_I, DOWN_WARPS)
    _down_kernel[(T, triton.cdiv(H, bh))](
        h, flat_ids, flat_w, w2, out, k, H, I, w2.stride(0), w2.stride(1),
        BLOCK_H=bh, BLOCK_I=bi, num_warps=nw)
    return out
