"""Triton MoE router for few tokens (decode), one launch per layer; the definition is
`route_topk` / `route_hash` in dsv4/ops/moe.py.

`_route_kernel`, one program per (block of BLOCK_T tokens, block of BLOCK_E experts):
  1. scores[t, e] = sqrt(softplus(x[t] . gate_w[e])), fp32 accumulation -> [T, E] fp32 scratch.
  2. the token block's last program to arrive (per-block int32 counter, acq_rel atomic after a
     CTA barrier: the split-K "last block" pattern, no spinning) resets its counter and selects:
       score routing: K argmax rounds over scores + bias (the bias only selects), ties to the
         lowest expert id, the unbiased scores gathered;
       hash routing:  ids = tid2eid[token_ids[t]], their scores gathered;
     weights = chosen / (sum + 1e-20) * scaling -> weights [T, K] fp32, ids [T, K] int64.
E-blocks because one program alone would stream the gate weight (2 MB at V4-Flash) at one SM's
bandwidth.

Invariants:
- ids in a row come in descending biased score; the consumer takes (weight, id) pairs, so this
  matches torch.topk(sorted=False), whose order is unspecified. Exact ties go to the lowest id
  (torch.topk may pick any tied one; tests use tie-free inputs and compare sets of experts).
- NaN scores select expert E - 1 (in range; the reference ranks NaN first); real gates give none.
- CUDA-graph safe: grids depend on T and E only, no host sync. The counters (`_counters`) are one
  persistent zeroed buffer per device, left at 0 by every launch, so routing calls on a device
  must be stream-ordered (they are: one decode stream).

ONE_LAUNCH = False runs step 2 as a second launch, `_select_kernel` (no counters): a fallback
should the single-launch form misbehave on some GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# tiles (not yet tuned on an H200; `python benchmarks/kernels/moe.py --part gate` times them).
# At V4-Flash (E 256, H 4096), T = 1: 128 programs of 2 gate rows, 2 iterations of 2048 columns.
BLOCK_T_MAX = 4           # tokens per program (weight rows are read once per token block)
BLOCK_E = 2               # experts per program
PRODUCTS = 4096           # BLOCK_T * BLOCK_E * BLOCK_H: fp32 products per loop iteration
NUM_WARPS = 4
ONE_LAUNCH = True


@triton.jit
def _sqrt_softplus(z):
    # sqrt(softplus(z)), softplus(z) = max(z, 0) + log1p(exp(-|z|)); log1p(u) for u in (0, 1]
    # as log(w) * u / (w - 1), w = 1 + u (exact to a few ulp; = u where w rounds to 1)
    u = tl.exp(-tl.abs(z))
    w = 1.0 + u
    one = w == 1.0
    log1p = tl.where(one, u, tl.log(w) * (u / tl.where(one, 1.0, w - 1.0)))
    return tl.sqrt(tl.maximum(z, 0.0) + log1p)


@triton.jit
def _scores_tile(x_ptr, w_ptr, s_ptr, T, E, H, stride_x, stride_w, tb, eb,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    # x [T, H], gate_w [E, H] (last dims contiguous) -> s[t, e] fp32 for the tile's t, e
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)                     # [BLOCK_T]
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)                     # [BLOCK_E]
    t_ok, e_ok = t < T, e < E
    x_rows = x_ptr + t.to(tl.int64)[:, None] * stride_x          # [BLOCK_T, 1]
    w_rows = w_ptr + e.to(tl.int64)[:, None] * stride_w          # [BLOCK_E, 1]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + tl.arange(0, BLOCK_H)                          # [BLOCK_H]
        h_ok = hh < H
        xv = tl.load(x_rows + hh[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_rows + hh[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], axis=2)   # [BLOCK_T, BLOCK_E]
    s_off = t.to(tl.int64)[:, None] * E + e[None, :]
    tl.store(s_ptr + s_off, _sqrt_softplus(acc), mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _store_weights(wout_ptr, idout_ptr, t, t_ok, j, chosen, ids, K, scaling):
    # chosen [BLOCK_T, KP] fp32 unbiased scores (0 in columns >= K), ids [BLOCK_T, KP]
    # -> weights[t, :K] = chosen / (sum + 1e-20) * scaling, ids[t, :K] (int64)
    w = chosen / (tl.sum(chosen, axis=1)[:, None] + 1e-20) * scaling
    off = t.to(tl.int64)[:, None] * K + j[None, :]
    m = t_ok[:, None] & (j < K)[None, :]
    tl.store(wout_ptr + off, w, mask=m)
    tl.store(idout_ptr + off, ids.to(tl.int64), mask=m)


@triton.jit
def _select_topk(s_ptr, bias_ptr, wout_ptr, idout_ptr, T, E, tb, scaling,
                 BLOCK_T: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    # scores [T, E] fp32 (written by this launch's programs: read through L2, .cg), bias [E]
    # -> the K experts of largest score + bias per token, their weights
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)                     # [BLOCK_T]
    e = tl.arange(0, EP)                                         # [EP], EP = next_pow2(E)
    j = tl.arange(0, KP)                                         # [KP], KP = next_pow2(K)
    t_ok, e_ok = t < T, e < E
    s = tl.load(s_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                other=0.0, cache_modifier=".cg")                 # [BLOCK_T, EP]
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    biased = tl.where(e_ok[None, :], s + bias[None, :], float("-inf"))
    chosen = tl.zeros((BLOCK_T, KP), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, KP), dtype=tl.int32)
    for r in tl.static_range(K):
        best = tl.max(biased, axis=1)                            # [BLOCK_T]
        idx = tl.min(tl.where(biased == best[:, None], e[None, :], EP), axis=1)   # lowest tied id
        idx = tl.minimum(idx, E - 1)                             # in range even for NaN rows
        hit = e[None, :] == idx[:, None]                         # [BLOCK_T, EP], one per row
        score = tl.sum(tl.where(hit, s, 0.0), axis=1)            # the unbiased score
        biased = tl.where(hit, float("-inf"), biased)
        chosen = tl.where(j[None, :] == r, score[:, None], chosen)
        ids = tl.where(j[None, :] == r, idx[:, None], ids)
    _store_weights(wout_ptr, idout_ptr, t, t_ok, j, chosen, ids, K, scaling)


@triton.jit
def _select_hash(s_ptr, tok_ptr, tid2eid_ptr, stride_tid, wout_ptr, idout_ptr, T, E, tb, scaling,
                 BLOCK_T: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    # ids = tid2eid[token_ids[t]] [BLOCK_T, K]; their scores gathered from s [T, E] (.cg, as above)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, KP)
    t_ok = t < T
    m = t_ok[:, None] & (j < K)[None, :]
    tok = tl.load(tok_ptr + t, mask=t_ok, other=0).to(tl.int64)
    ids = tl.load(tid2eid_ptr + tok[:, None] * stride_tid + j[None, :], mask=m, other=0).to(tl.int64)
    chosen = tl.load(s_ptr + t.to(tl.int64)[:, None] * E + ids, mask=m, other=0.0, cache_modifier=".cg")
    _store_weights(wout_ptr, idout_ptr, t, t_ok, j, chosen, ids, K, scaling)


@triton.jit
def _select(s_ptr, bias_ptr, tok_ptr, tid2eid_ptr, stride_tid, wout_ptr, idout_ptr, T, E, tb, scaling,
            HASH: tl.constexpr, BLOCK_T: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    if HASH:
        _select_hash(s_ptr, tok_ptr, tid2eid_ptr, stride_tid, wout_ptr, idout_ptr, T, E, tb, scaling,
                     BLOCK_T, K, KP)
    else:
        _select_topk(s_ptr, bias_ptr, wout_ptr, idout_ptr, T, E, tb, scaling, BLOCK_T, EP, K, KP)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T",))
def _route_kernel(x_ptr, w_ptr, bias_ptr, tok_ptr, tid2eid_ptr, s_ptr, cnt_ptr, wout_ptr, idout_ptr,
                  T, E, H, stride_x, stride_w, stride_tid, scaling,
                  HASH: tl.constexpr, ONE_LAUNCH: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, EP: tl.constexpr,
                  K: tl.constexpr, KP: tl.constexpr):
    # grid (cdiv(T, BLOCK_T), cdiv(E, BLOCK_E)); cnt [>= grid[0]] int32, 0 on entry and on exit
    tb = tl.program_id(0)
    _scores_tile(x_ptr, w_ptr, s_ptr, T, E, H, stride_x, stride_w, tb, tl.program_id(1),
                 BLOCK_T, BLOCK_E, BLOCK_H)
    if ONE_LAUNCH:
        tl.debug_barrier()                                       # all of the CTA's score stores issued
        arrived = tl.atomic_add(cnt_ptr + tb, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:                    # the block's last program
            tl.store(cnt_ptr + tb, 0)                            # the others have all arrived
            _select(s_ptr, bias_ptr, tok_ptr, tid2eid_ptr, stride_tid, wout_ptr, idout_ptr, T, E, tb,
                    scaling, HASH, BLOCK_T, EP, K, KP)


# per-step sizes are not specialised: one compiled variant for every step shape
@triton.jit(do_not_specialize=("T",))
def _select_kernel(s_ptr, bias_ptr, tok_ptr, tid2eid_ptr, stride_tid, wout_ptr, idout_ptr, T, E, scaling,
                   HASH: tl.constexpr, BLOCK_T: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                   KP: tl.constexpr):
    # ONE_LAUNCH = False: step 2 as its own launch, grid (cdiv(T, BLOCK_T),)
    _select(s_ptr, bias_ptr, tok_ptr, tid2eid_ptr, stride_tid, wout_ptr, idout_ptr, T, E,
            tl.program_id(0), scaling, HASH, BLOCK_T, EP, K, KP)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Persistent zeroed int32 arrival counters (>= n) for `device`; every launch leaves them
    at 0. Made on first use (before CUDA-graph capture: the warm-up step routes first)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        # made in a capture, the buffer would live in the graph's pool and be zeroed by it
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            "route before capturing a CUDA graph (a warm-up step) to make the arrival counters"
        buf = _COUNTERS[device] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return buf


def block_t(T: int) -> int:
    return min(triton.next_power_of_2(max(T, 1)), BLOCK_T_MAX)


def _route(x, gate_w, k, scaling, bias=None, token_ids=None, tid2eid=None, one_launch=None):
    """Shared launcher: hash routing when tid2eid is given, else score routing with bias."""
    T, H = x.shape
    E = gate_w.shape[0]
    assert gate_w.shape == (E, H), "gate weight [E, H]"
    weights = torch.empty((T, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=x.device)
    if T == 0:
        return weights, ids
    x = x if x.stride(-1) == 1 else x.contiguous()
    token_ids = None if token_ids is None else token_ids.reshape(-1).contiguous()     # [T]
    gate_w = gate_w if gate_w.stride(-1) == 1 else gate_w.contiguous()
    scores = torch.empty((T, E), dtype=torch.float32, device=x.device)      # scratch
    is_hash = tid2eid is not None
    if is_hash:
        assert tid2eid.shape[1] == k and tid2eid.stride(-1) == 1, "tid2eid [vocab, k], rows contiguous"
        bias, stride_tid = scores, tid2eid.stride(0)                            # bias unused
    else:
        token_ids, tid2eid, stride_tid = ids, ids, 0                            # unused
    bt = block_t(T)
    grid = (triton.cdiv(T, bt), triton.cdiv(E, BLOCK_E))
    one = ONE_LAUNCH if one_launch is None else one_launch
    cnt = _counters(x.device, grid[0]) if one else scores                      # cnt unused if not one
    ep, kp = triton.next_power_of_2(E), triton.next_power_of_2(k)
    _route_kernel[grid](x, gate_w, bias, token_ids, tid2eid, scores, cnt, weights, ids,
                        T, E, H, x.stride(0), gate_w.stride(0), stride_tid, float(scaling),
                        HASH=is_hash, ONE_LAUNCH=one, BLOCK_T=bt, BLOCK_E=BLOCK_E,
                        BLOCK_H=max(16, PRODUCTS // (bt * BLOCK_E)), EP=ep, K=k, KP=kp,
                        num_warps=NUM_WARPS)
    if not one:
        _select_kernel[(grid[0],)](scores, bias, token_ids, tid2eid, stride_tid, weights, ids,
                                   T, E, float(scaling), HASH=is_hash, BLOCK_T=bt, EP=ep, K=k, KP=kp,
                                   num_warps=NUM_WARPS)
    return weights, ids


def route_topk(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, topk: int, scaling: float,
               one_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dsv4.ops.moe.route_topk: x [T, H], gate_w [E, H], bias [E] -> (weights [T, k] fp32,
    ids [T, k] int64, in descending order of score + bias)."""
    return _route(x, gate_w, topk, scaling, bias=bias, one_launch=one_launch)


def route_hash(x: torch.Tensor, gate_w: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor,
               scaling: float, one_launch: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """dsv4.ops.moe.route_hash: ids = tid2eid[token_ids] ([vocab, k] table), weights from the gate."""
    return _route(x, gate_w, tid2eid.shape[1], scaling, token_ids=token_ids, tid2eid=tid2eid,
                  one_launch=one_launch)
