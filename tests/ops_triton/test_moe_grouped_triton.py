"""Prefill-size routed experts against the definition `routed_experts_loop` (dsv4/ops/moe.py):
the Triton grouped GEMMs (dsv4/ops/triton/moe_grouped.py) and the torch._grouped_mm path
`routed_experts_grouped`. Odd token counts, k = 1..6, experts with no tokens, experts spread
over several M-tiles, all tokens on the same experts, T = 0, fp32 and bf16, dimensions that are
not multiples of the tiles (masked K tails and clamped rows/columns) and ones that are (EVEN_K),
the tile schedule's invariants, the dispatch from `routed_experts`, and (without a GPU) that
the kernels compile for an H200."""
import os
import subprocess
import sys

import pytest
import torch
from expert_inputs import random_experts

from dsv4.ops import moe as moe_ops
from dsv4.ops.triton import moe_grouped

E, H, I, LIMIT = 8, 72, 48, 2.0  # H, I: not multiples of the tiles below
FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # rounding of a differently ordered sum
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): several M-tiles per expert, K loops with a tail
SMALL = dict(up_tiles=(16, 32, 32, 2, 2), down_tiles=(16, 32, 32, 2, 2), group_m=3)


def make_inputs(device, T, k, dtype, h=H, i=I, seed=0, same_experts=False):
    """expert_inputs.random_experts on `device` in `dtype` (routing weights fp32, ids long)."""
    x, weights, ids, w1, w2, w3 = random_experts(T, k, E, h, i, LIMIT, seed, same_experts)
    cast = lambda t: t.to(device, dtype)  # noqa: E731
    return cast(x), weights.to(device), ids.to(device), cast(w1), cast(w2), cast(w3)


def assert_agrees(got, want, inputs):
    x, weights, ids, w1, w2, w3 = inputs
    assert got.shape == want.shape == x.shape and got.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
        return
    # the reference rounds gate, up, h, each expert's output and the sum to bf16 (the kernels
    # round h, each weighted expert output and the sum): within a bf16 ulp of
    # sum_j w_j |w2[e_j]| |h_j| and of out
    xf, w1f, w2f, w3f = (t.float() for t in (x, w1, w2, w3))
    h = moe_ops.swiglu_clamped(torch.einsum("th,tjih->tji", xf, w1f[ids]),
                               torch.einsum("th,tjih->tji", xf, w3f[ids]), LIMIT)   # [T, k, I]
    terms = torch.einsum("tj,tjni,tji->tn", weights, w2f[ids].abs(), h.abs())     # [T, H]
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * (terms + want.float().abs())).all()


def check(device, T, k, dtype, h=H, i=I, same_experts=False, **tiles):
    inputs = make_inputs(device, T, k, dtype, h, i, same_experts=same_experts)
    got = moe_grouped.routed_experts_grouped(*inputs, LIMIT, **tiles)
    assert_agrees(got, moe_ops.routed_experts_loop(*inputs, LIMIT), inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k", [(0, 6), (1, 1), (1, 6), (5, 2), (13, 3), (13, 6), (37, 4), (37, 6)])
def test_triton_grouped(device, dtype, T, k):
    check(device, T, k, dtype, **SMALL)


@pytest.mark.parametrize("tier", ["small", "mid", "large"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_grouped_default_tiles(device, monkeypatch, dtype, tier):
    """The default tiles of each tier: about one M-tile per expert, BLOCK_N > I and H
    (clamped columns), BLOCK_K not dividing H or I (masked K tails), different M-tiles for
    up-gate and down (mid)."""
    monkeypatch.setattr(moe_grouped, "MID_M_ROWS", 10 ** 9 if tier == "small" else 8)
    monkeypatch.setattr(moe_grouped, "LARGE_M_ROWS", 8 if tier == "large" else 10 ** 9)
    up, down = moe_grouped.default_tiles(105, E, dtype)
    assert (up[0], down[0]) == {"small": (64, 64), "mid": (128, 64), "large": (128, 128)}[tier]
    check(device, 21, 5, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_grouped_even_k(device, dtype):
    """H and I multiples of BLOCK_K: the unmasked K loop."""
    check(device, 19, 3, dtype, h=64, i=32, **SMALL)


@pytest.mark.parametrize("same_experts", [False, True])
@pytest.mark.parametrize("group_m", [1, 2, 8])
def test_triton_grouped_tiles(device, same_experts, group_m):
    """Different BLOCK_M up and down (two schedules), program grouping, and every token on the
    same k experts (the others empty, those few spread over many M-tiles)."""
    check(device, 29, 3, torch.float32, same_experts=same_experts, up_tiles=(16, 16, 16, 2, 2),
          down_tiles=(32, 32, 16, 2, 2), group_m=group_m)


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("T,k", [(1, 1), (9, 3), (30, 6)])
def test_schedule(block_m, T, k):
    """Rows are the pairs sorted (stably) by expert; the valid slots tile each expert's rows
    exactly once with at most block_m rows, in expert order; the other slots are empty."""
    _, _, ids, *_ = make_inputs("cpu", T, k, torch.float32)
    flat = ids.flatten()
    order, sched = moe_grouped.schedule(flat, E, block_m)
    assert torch.equal(order.long(), torch.argsort(flat, stable=True))
    expert, first, end = sched.long()
    assert sched.shape[1] == -(-T * k // block_m) + min(E, T * k)
    covered = torch.zeros(T * k, dtype=torch.long)
    for e, r0, r1 in zip(expert.tolist(), first.tolist(), end.tolist()):
        if r0 < r1:
            rows = torch.arange(r0, min(r1, r0 + block_m))
            assert (flat[order[rows].long()] == e).all()
            covered[rows] += 1
    assert (covered == 1).all()
    valid = first < end
    assert not valid[valid.sum():].any()                           # valid slots come first
    assert (expert[valid].diff() >= 0).all()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k,same", [(1, 1, False), (13, 6, False), (37, 4, False), (11, 2, True)])
def test_torch_grouped(device, dtype, T, k, same):
    """routed_experts_grouped (torch._grouped_mm, gather-based combine)."""
    inputs = make_inputs(device, T, k, dtype, same_experts=same)
    got = moe_ops.routed_experts_grouped(*inputs, LIMIT)
    assert_agrees(got, moe_ops.routed_experts_loop(*inputs, LIMIT), inputs)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_dispatch(device, monkeypatch, impl):
    """Above TRITON_MAX_PAIRS, routed_experts takes the Triton grouped GEMMs exactly when
    use_triton says so and GROUPED_GEMM is "triton"; the decode kernel at or below it."""
    calls = []
    kernel = moe_grouped.routed_experts_grouped
    monkeypatch.setattr(moe_grouped, "routed_experts_grouped",
                        lambda *a, **kw: calls.append(a[2].numel()) or kernel(*a, **kw))
    monkeypatch.setattr(moe_ops, "TRITON_MAX_PAIRS", 6)
    monkeypatch.setattr(moe_ops, "GROUPED_GEMM", impl)
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: True)
    x, weights, ids, w1, w2, w3 = make_inputs(device, 5, 2, torch.float32)   # 10 pairs > 6
    want = moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT)
    torch.testing.assert_close(moe_ops.routed_experts(x, weights, ids, w1, w2, w3, LIMIT), want, **FP32_TOL)
    moe_ops.routed_experts(x[:3], weights[:3], ids[:3], w1, w2, w3, LIMIT)    # 6 pairs: decode kernel
    assert calls == ([10] if impl == "triton" else [])
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: False)
    torch.testing.assert_close(moe_ops.routed_experts(x, weights, ids, w1, w2, w3, LIMIT), want, **FP32_TOL)
    assert calls == ([10] if impl == "triton" else [])


COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4.ops.triton import moe_grouped as mg

CONSTS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "FP32_DOT", "FP8", "MXFP4")
ALIGNED = {"H", "I", "stride_we", "stride_wi", "stride_wh"}   # multiples of 16 at V4 shapes
TYPES = {"order_ptr": "*i32", "sched_ptr": "*i32", "wt_ptr": "*fp32", "limit": "fp32"}
# FP8 (W8A16): float8_e4m3fn weights, fp32 block scales; MXFP4 (W4A16): packed uint8 weights,
# uint8 E8M0 scales
WEIGHT_TYPES = {None: (None, "*fp32"), "fp8": ("*fp8e4nv", "*fp32"), "mxfp4": ("*u8", "*u8")}
for (bm, bn, bk, warps, stages), dtype, even_k, fmt in (((64, 128, 64, 4, 4), "bf16", True, None),
                                                         ((128, 128, 64, 8, 3), "bf16", True, None),
                                                         ((64, 128, 32, 4, 3), "fp32", False, None),
                                                         ((64, 256, 64, 8, 3), "bf16", True, "fp8"),
                                                         ((64, 128, 64, 4, 4), "bf16", True, "mxfp4"),
                                                         ((128, 256, 64, 8, 3), "bf16", False, "mxfp4")):
    for fn in (mg._up_gate_kernel, mg._down_kernel):
        names = [n for n in fn.arg_names if n not in CONSTS]
        sig = {n: TYPES.get(n, "*" + dtype if n.endswith("_ptr") else "i32") for n in names}
        w_type, s_type = WEIGHT_TYPES[fmt]
        for n in names:
            if n in ("w1_ptr", "w2_ptr", "w3_ptr") and w_type:
                sig[n] = w_type
            elif n in ("s1_ptr", "s2_ptr", "s3_ptr"):
                sig[n] = s_type
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, EVEN_K=even_k, FP32_DOT=dtype == "fp32",
                      FP8=fmt == "fp8", MXFP4=fmt == "mxfp4")
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*" or n in ALIGNED}
        src = ASTSource(fn, {**sig, **{c: "constexpr" for c in consts}}, consts, attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
        ttgir = kernel.asm["ttgir"]
        if dtype == "bf16":   # an exact fp32 dot runs on FMA units
            assert "warp_group_dot" in ttgir and "async_copy_global_to_local" in ttgir, fn.__name__
        assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)
print("compiled")
"""


@pytest.mark.skipif(os.environ.get("DSV4_TRITON_DEVICE", "cpu") != "cpu", reason="compiled for real on the GPU")
def test_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile both kernels ahead of time for
    an H200 (sm_90, no GPU needed) at the default tiles in bf16, and in fp32 with K tails, FP8 and
    MXFP4 weights; in bf16 they must use wgmma fed by pipelined (async-copy) loads; all within
    shared memory."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
