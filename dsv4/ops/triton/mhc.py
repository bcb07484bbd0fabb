"""Triton kernels for the manifold-constrained hyper-connections (mHC); the definition is the
torch reference in dsv4/ops/mhc.py, matched to fp32 rounding. hc_pre / hc_head take two
launches, hc_post one (the reference's Sinkhorn alone is 2 x iters launches per site).

1. `_mix_partials_kernel`, split-K over x = h.view(T, K), K = N*D (h read once, in its dtype):
     part[s, t, m] = sum_{k in split s} x[t, k] * fn[m, k],   sq[s, t] = sum_{k in s} x[t, k]^2
   fp32-accurate on tf32 tensor cores: fn is split into hi + lo, each exact in tf32
   (`_split_tf32`), and tf32 products are exact in the fp32 accumulator; 16-bit x is exact in
   tf32 (2 dots), fp32 x is split too (3 dots, x_lo * w_lo dropped). The RMS norm is applied
   after: mixes = (x @ fn^T) * rsqrt(mean(x^2) + eps).
2. `_mix_epilogue_kernel`, one program per (token, slice of D): sums the splits, scale + base,
   sigmoid (pre, post), row softmax + Sinkhorn on the N x N comb in registers; writes post/comb
   (first slice only) and the collapse sum_j pre_j h_j.
3. `_hc_post_kernel`, one program per (token, D tile): new_k = post_k out + sum_j comb[j, k] h_j.

N (hc_mult, a constexpr; 4 at V4) may be any small integer: tiles are padded to a power of two
and masked.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _split_tf32(v):
    """fp32 tile -> (hi, lo), both exact in tf32 (10 stored mantissa bits): hi + lo == v to
    ~2^-21 relative."""
    hi = (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)  # drop the low 13 bits
    lo = v - hi  # exact in fp32
    lo = (lo.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, lo


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T", "K_SPLIT"))
def _mix_partials_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, K, NMIX, K_SPLIT,
                         BT: tl.constexpr, BK: tl.constexpr, MIXP: tl.constexpr, SPLIT_X: tl.constexpr):
    # x [T, K] any float dtype, fn [NMIX, K] fp32 -> part [S, T, MIXP] fp32 (columns >= NMIX
    # are 0), sq [S, T] fp32. Program (tb, s) covers rows tb*BT.. and k in [s*K_SPLIT, (s+1)*K_SPLIT).
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    row_ok = rows < T
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K
    m = tl.arange(0, MIXP)
    kk = tl.arange(0, BK)
    acc = tl.zeros((BT, MIXP), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    k_begin = pid_s * K_SPLIT
    for k0 in range(k_begin, k_begin + K_SPLIT, BK):
        k = k0 + kk
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BT, BK]
        w = tl.load(fn_ptr + m[None, :] * K + k[:, None], mask=(m[None, :] < NMIX) & k_ok[:, None],
                    other=0.0)  # [BK, MIXP] = fn^T tile
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        # tf32 tensor-core dots on operands that are exact in tf32 (a no-op in full fp32)
        w_hi, w_lo = _split_tf32(w)
        if SPLIT_X:  # fp32 streams: x = x_hi + x_lo too; x_lo * w_lo (< 2^-21 relative) is dropped
            x_hi, x_lo = _split_tf32(xf)
            acc += tl.dot(x_lo, w_hi) + tl.dot(x_hi, w_lo) + tl.dot(x_hi, w_hi)
        else:  # 16-bit streams are exact in tf32
            acc += tl.dot(xf, w_lo) + tl.dot(xf, w_hi)
    out_rows = (pid_s * T + rows).to(tl.int64)
    tl.store(part_ptr + out_rows[:, None] * MIXP + m[None, :], acc, mask=row_ok[:, None])
    tl.store(sq_ptr + out_rows, sq, mask=row_ok)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T", "S"))
def _mix_epilogue_kernel(h_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr,
                         T, D, S, D_SPLIT, norm_eps, hc_eps, sinkhorn_iters,
                         N: tl.constexpr, NP: tl.constexpr, MIXP: tl.constexpr, S_PAD: tl.constexpr,
                         BD: tl.constexpr, FULL: tl.constexpr):
    # h [T, N, D]; part [S, T, MIXP], sq [S, T] from _mix_partials_kernel; base [NMIX], scale [3]
    # (FULL: mixes = pre | post | comb, NMIX = (2+N)N) or [1] (head: mixes = pre, NMIX = N).
    # -> x [T, D] (h's dtype) = sum_j pre_j h_j over d in [pid_d*D_SPLIT, (pid_d+1)*D_SPLIT);
    #    FULL: post [T, N], comb [T, N, N] fp32, written by the pid_d == 0 program.
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < S
    i = tl.arange(0, NP)
    i_ok = i < N
    part_t = part_ptr + (s.to(tl.int64) * T + t) * MIXP  # [S_PAD] row pointers of this token

    sq = tl.sum(tl.load(sq_ptr + s.to(tl.int64) * T + t, mask=s_ok, other=0.0), axis=0)
    rms = 1.0 / tl.sqrt(sq / (N * D) + norm_eps)
    vec_ok = s_ok[:, None] & i_ok[None, :]
    pre_w = tl.sum(tl.load(part_t[:, None] + i[None, :], mask=vec_ok, other=0.0), axis=0) * rms
    pre = 1.0 / (1.0 + tl.exp(-(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=i_ok, other=0.0))))
    pre = tl.where(i_ok, pre + hc_eps, 0.0)  # [NP], 0 in the padding

    if FULL:
        n_write = N * (pid_d == 0).to(tl.int32)  # post/comb come from the first slice only
        post_w = tl.sum(tl.load(part_t[:, None] + N + i[None, :], mask=vec_ok, other=0.0), axis=0) * rms
        post = 2.0 / (1.0 + tl.exp(-(post_w * tl.load(scale_ptr + 1)
                                     + tl.load(base_ptr + N + i, mask=i_ok, other=0.0))))
        tl.store(post_ptr + t * N + i, post, mask=i < n_write)

        # comb [NP, NP]: row softmax + eps, then column, then (iters - 1) x (row, column)
        ij = i[:, None] * N + i[None, :]
        ij_ok = i_ok[:, None] & i_ok[None, :]
        comb_w = tl.sum(tl.load(part_t[:, None, None] + 2 * N + ij[None, :, :],
                                mask=s_ok[:, None, None] & ij_ok[None, :, :], other=0.0), axis=0) * rms
        logits = comb_w * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ij, mask=ij_ok, other=0.0)
        logits = tl.where(ij_ok, logits, -1e30)  # padded columns get exp(.) = 0 (padded rows: finite junk)
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        c = tl.where(ij_ok, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)  # padding stays 0 below
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * (N * N) + ij, c, mask=(i[:, None] < n_write) & (i[None, :] < n_write))

    # collapse over this program's slice of D
    h_t = h_ptr + t.to(tl.int64) * (N * D)
    x_t = x_ptr + t.to(tl.int64) * D
    d_begin = pid_d * D_SPLIT
    for d0 in range(d_begin, d_begin + D_SPLIT, BD):
        d = d0 + tl.arange(0, BD)
        d_ok = d < D
        hv = tl.load(h_t + i[:, None] * D + d[None, :], mask=i_ok[:, None] & d_ok[None, :], other=0.0)
        x = tl.sum(pre[:, None] * hv.to(tl.float32), axis=0)
        tl.store(x_t + d, x.to(x_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _hc_post_kernel(out_ptr, h_ptr, post_ptr, comb_ptr, new_ptr, D,
                    N: tl.constexpr, NP: tl.constexpr, BD: tl.constexpr):
    # out [T, D], h [T, N, D], post [T, N], comb [T, N, N] -> new [T, N, D] (h's dtype):
    #   new[k] = post_k * out + sum_j comb[j, k] h_j, over d in [pid_d*BD, (pid_d+1)*BD).
    # As in the reference, post and comb are rounded to h's dtype first; the sum is fp32 and
    # rounded once.
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    dt = new_ptr.dtype.element_ty
    k = tl.arange(0, NP)
    k_ok = k < N
    d = pid_d * BD + tl.arange(0, BD)
    d_ok = d < D
    post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0).to(dt).to(tl.float32)
    o = tl.load(out_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    acc = post[:, None] * o[None, :]  # [NP, BD]
    for j in tl.static_range(N):
        c_j = tl.load(comb_ptr + (t * N + j) * N + k, mask=k_ok, other=0.0).to(dt).to(tl.float32)  # comb[j, :]
        h_j = tl.load(h_ptr + (t * N + j) * D + d, mask=d_ok, other=0.0).to(tl.float32)
        acc += c_j[:, None] * h_j[None, :]
    tl.store(new_ptr + (t * N + k[:, None]) * D + d[None, :], acc.to(dt), mask=k_ok[:, None] & d_ok[None, :])


_BT = 64  # token tile of the projection (16 when T <= 16)
_BK = 32  # K tile of the projection: fastest at T = 4096 in the H200 scan (docs/benchmarks.md)
_BK_FEW = 64  # ... at T <= 16 (fastest at T = 1)
_BD = 512  # D tile of the collapse / post
_EPI_WARPS = 4  # warps of the epilogue (Sinkhorn + collapse) programs below _EPI_MANY tokens
_EPI_WARPS_MANY, _EPI_MANY = 1, 1024  # from there one warp (no cross-warp reductions): hc_pre at
                                      # 16k tokens 1.8x faster on the H200 (docs/benchmarks.md)
_MAX_SPLITS = 128


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # Triton's interpreter: a handful of programs, still several K splits


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _mix_partials(h, fn):
    """h [T, N, D] (T > 0), fn [nmix, N*D] fp32 -> part [S, T, MIXP], sq [S, T]: the projection
    and the sum of squares, split over S chunks of K."""
    T, N, D = h.shape
    K, nmix = N * D, fn.shape[0]
    mixp = max(16, _next_pow2(nmix))  # tl.dot needs >= 16 columns
    # BT rows x K_SPLIT per program; enough K splits to cover the SMs twice at small T
    bt, bk = (16, _BK_FEW) if T <= 16 else (_BT, _BK)
    t_blocks, k_blocks = triton.cdiv(T, bt), triton.cdiv(K, bk)
    splits = min(k_blocks, _MAX_SPLITS, max(1, triton.cdiv(2 * _num_sms(h.device), t_blocks)))
    k_split = triton.cdiv(k_blocks, splits) * bk
    splits = triton.cdiv(K, k_split)
    part = torch.empty(splits, T, mixp, dtype=torch.float32, device=h.device)
    sq = torch.empty(splits, T, dtype=torch.float32, device=h.device)
    _mix_partials_kernel[(t_blocks, splits)](
        h, fn, part, sq, T, K, nmix, k_split,
        BT=bt, BK=bk, MIXP=mixp, SPLIT_X=h.element_size() > 2, num_warps=4)
    return part, sq


def _project_and_collapse(h, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, x, post, comb):
    """Shared by hc_pre (post/comb given) and hc_head (post/comb None); h [T, N, D] with T > 0."""
    T, N, D = h.shape
    full = post is not None
    part, sq = _mix_partials(h, fn)
    splits, mixp = part.shape[0], part.shape[2]
    sms = _num_sms(h.device)

    # epilogue: split D over programs only when there are too few tokens to fill the SMs
    d_blocks = triton.cdiv(D, _BD)
    d_progs = min(d_blocks, max(1, triton.cdiv(2 * sms, T)))
    d_split = triton.cdiv(d_blocks, d_progs) * _BD
    d_progs = triton.cdiv(D, d_split)
    _mix_epilogue_kernel[(T, d_progs)](
        h, part, sq, base, scale, x, post if full else x, comb if full else x,
        T, D, splits, d_split, float(norm_eps), float(hc_eps), int(sinkhorn_iters),
        N=N, NP=_next_pow2(N), MIXP=mixp, S_PAD=_next_pow2(splits), BD=_BD, FULL=full,
        num_warps=_EPI_WARPS_MANY if T >= _EPI_MANY else _EPI_WARPS)


def _params(fn, base, scale):
    return fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()


def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, N, D], fn [(2+N)N, N*D], base [(2+N)N], scale [3] ->
    (collapsed [T, D] in h's dtype, post [T, N] fp32, comb [T, N, N] fp32)."""
    T, N, D = h.shape
    x = torch.empty(T, D, dtype=h.dtype, device=h.device)
    post = torch.empty(T, N, dtype=torch.float32, device=h.device)
    comb = torch.empty(T, N, N, dtype=torch.float32, device=h.device)
    if T:
        _project_and_collapse(h.contiguous(), *_params(fn, base, scale), norm_eps, hc_eps, sinkhorn_iters,
                              x, post, comb)
    return x, post, comb


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    """h [T, N, D], fn [N, N*D], base [N], scale [1] -> collapsed [T, D] in h's dtype."""
    T, N, D = h.shape
    x = torch.empty(T, D, dtype=h.dtype, device=h.device)
    if T:
        _project_and_collapse(h.contiguous(), *_params(fn, base, scale), norm_eps, hc_eps, 0, x, None, None)
    return x


def hc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out [T, D], h [T, N, D], post [T, N], comb [T, N, N] -> new streams [T, N, D] in h's dtype."""
    if out.dtype != h.dtype:
        raise TypeError(f"hc_post: block output {out.dtype} and streams {h.dtype} must share a dtype")
    T, N, D = h.shape
    new = torch.empty_like(h, memory_format=torch.contiguous_format)
    if T:
        _hc_post_kernel[(T, triton.cdiv(D, _BD))](
            out.contiguous(), h.contiguous(), post.contiguous(), comb.contiguous(), new, D,
            N=N, NP=_next_pow2(N), BD=_BD, num_warps=4)
    return new
