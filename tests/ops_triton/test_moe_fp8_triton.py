"""FP8 (W8A16) routed and shared experts in the Triton kernels (dsv4/ops/triton/moe.py decode
GEMVs, dsv4/ops/triton/moe_grouped.py grouped GEMMs): float8_e4m3fn weights with fp32 scales
per 128x128 block, dequantised tile by tile in the kernels. Against the reference
(`routed_experts_loop` / `dense_swiglu` with scales, which dequantise on the fly) and against
the same kernels on the dequantised weights (equal: the dequantised tile is exactly what the
load-time dequantisation stores). Dimensions above 128 and not multiples of 128 or of the
tiles; tiles within one scale block (one scale) and across several (a gather)."""
import os

import pytest
import torch
from expert_inputs import (assert_matches, assert_quantised_dispatch, assert_same_as_dequantised, dequantised,
                           random_experts)

from dsv4.ops.quant import e8m0_to_float, quant_fp8
from dsv4.ops import moe as moe_ops
from dsv4.ops.triton import moe as triton_moe
from dsv4.ops.triton import moe_grouped

E, H, I, LIMIT = 8, 200, 136, 2.0      # H, I: two scale blocks each, the second partial
# decode tiles (BLOCK_I, BLOCK_H, warps) / (BLOCK_H, BLOCK_I, warps): the defaults (one scale
# per up tile, a vector per down tile), tiles spanning several blocks (gathers), small ones (64
# columns: tiles that start inside a scale block, at 64 and 192 / 64, and masked tails)
DECODE_TILES = {"default": {}, "wide": dict(up_tiles=(256, 256, 4), down_tiles=(256, 256, 4)),
                "small": dict(up_tiles=(16, 64, 2), down_tiles=(32, 64, 2))}
# grouped tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): N within a block and K within a
# block; N across blocks; N and K across blocks (full gather)
GROUPED_TILES = {"default": {}, "wide_n": dict(up_tiles=(16, 256, 32, 4, 2), down_tiles=(16, 256, 32, 4, 2)),
                 "wide_nk": dict(up_tiles=(16, 256, 256, 4, 2), down_tiles=(32, 256, 256, 4, 2))}


def quantise(w: torch.Tensor, pow2: bool = True, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (float8_e4m3fn [..., R, C], fp32 scales [..., cdiv(R, 128), cdiv(C, 128)]).
    Each 128x128 block is first scaled by a random factor (so the scales differ per block);
    pow2=False multiplies the scales by a non-power-of-two factor (fp32 scales, as Flash-Base)."""
    g = torch.Generator().manual_seed(seed)
    flat = w.reshape(-1, *w.shape[-2:])
    qs, ss = [], []
    for m in flat:
        rb, cb = -(-m.shape[0] // 128), -(-m.shape[1] // 128)
        factor = torch.exp2(torch.randint(-3, 4, (rb, cb), generator=g).float())
        q, s = quant_fp8(m * factor.repeat_interleave(128, 0).repeat_interleave(128, 1)[:m.shape[0], :m.shape[1]])
        s = e8m0_to_float(s)
        if not pow2:
            s = s * (1 + torch.rand(s.shape, generator=g))
        qs.append(q)
        ss.append(s)
    return (torch.stack(qs).view(*w.shape[:-2], *w.shape[-2:]),
            torch.stack(ss).view(*w.shape[:-2], *ss[0].shape).contiguous())


def make_inputs(device, T, k, dtype, pow2=True, seed=0):
    """x [T, H], weights [T, k], ids [T, k]; FP8 w1/w3 [E, I, H], w2 [E, H, I] and their scales."""
    x, weights, ids, w1, w2, w3 = random_experts(T, k, E, H, I, LIMIT, seed)
    (q1, s1), (q2, s2), (q3, s3) = (quantise(w, pow2, seed + j) for j, w in enumerate((w1, w2, w3)))
    dev = lambda t: t.to(device)  # noqa: E731
    return (x.to(device, dtype), dev(weights), dev(ids), dev(q1), dev(q2), dev(q3),
            (dev(s1), dev(s2), dev(s3)))


def make_shared(device, pow2=True, seed=7):
    g = torch.Generator().manual_seed(seed)
    sw = (torch.randn(I, H, generator=g) * (3 * LIMIT / H ** 0.5), torch.randn(H, I, generator=g) / I ** 0.5,
          torch.randn(I, H, generator=g) * (1.5 * LIMIT / H ** 0.5))
    q = [quantise(w, pow2, seed + j) for j, w in enumerate(sw)]
    return tuple(w.to(device) for w, _ in q), tuple(s.to(device) for _, s in q)


def fp8_down_defaults(T, ks, tiles=None):
    """The down tiles / split the FP8 kernels default to, for the same kernels on dequantised
    (bf16 / fp32) weights, whose defaults differ: the same tiles sum in the same order."""
    if tiles and "down_tiles" in tiles:
        return tiles
    tri = triton_moe
    bh, bi = tri.FP8_DOWN_BLOCK_H, tri.FP8_DOWN_BLOCK_I
    return {**(tiles or {}), "down_tiles": (bh, bi, tri.FP8_DOWN_WARPS),
            "down_split": tri.default_down_split(T, ks, H, I, bh, bi, tri.FP8_DOWN_MIN_PROGRAMS)}


BF16, FP32 = torch.bfloat16, torch.float32


# k = 6 at T = 1 in both dtypes, k = 1..5 there and k = 1, 2 at T = 3 in alternating dtypes
# (the interpreter is slow; a k is one more pair through the same loops, and the dtype changes
# only x's load, h's rounding and the output's store, the same for every k)
@pytest.mark.parametrize("T,k,dtype", [(1, 6, d) for d in (FP32, BF16)]
                         + [(T, k, BF16 if (k + T) % 2 == 0 else FP32) for T, k in [(1, 1), (1, 2), (1, 3), (1, 4),
                                                                                   (1, 5)]]
                         + [(3, 1, FP32), (3, 2, BF16)])
def test_decode_fp8(device, dtype, T, k):
    x, weights, ids, w1, w2, w3, scales = make_inputs(device, T, k, dtype, seed=k)
    got = triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, scales=scales)
    d1, d2, d3 = dequantised((w1, w2, w3), scales, dtype)
    assert_same_as_dequantised(got, triton_moe.routed_experts(x, weights, ids, d1, d2, d3, LIMIT,
                                                              **fp8_down_defaults(T, k)), True, dtype, device)
    assert_matches(got, moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales), dtype)


# test_decode_fp8_shared_tiles: 2 tokens of 3 routed pairs + the shared one (k = 1..6 are
# test_decode_fp8's); down split 3: 8 (expert, I-block) units (default tiles) in 3 + 3 + 2
SHARED_T, SHARED_K, SHARED_SPLIT = 2, 3, 3


@pytest.mark.parametrize("tiles,dtype,pow2", [("default", BF16, True), ("default", BF16, False),
                                              ("default", FP32, False), ("wide", BF16, False), ("wide", FP32, True),
                                              ("small", BF16, False)])
def test_decode_fp8_shared_tiles(device, tiles, dtype, pow2):
    """The shared expert fused as one more pair, FP8 too; tiles within and across scale blocks;
    non-power-of-two fp32 scales (rounded to x's dtype after the product, as at load). Down split
    SHARED_SPLIT (the default split, one (expert, I-block) unit per program here, is test_decode_fp8's):
    each program sums several units, the shared pair among them, and the interpreter runs
    fewer programs than the default's (12 splits with the small tiles)."""
    x, weights, ids, w1, w2, w3, scales = make_inputs(device, SHARED_T, SHARED_K, dtype, pow2)
    sw, ss = make_shared(device, pow2)
    got = triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, shared=sw, scales=scales,
                                    shared_scales=ss, **DECODE_TILES[tiles], down_split=SHARED_SPLIT)
    d1, d2, d3 = dequantised((w1, w2, w3), scales, dtype)
    dsw = dequantised(sw, ss, dtype)
    same_tiles = {**fp8_down_defaults(SHARED_T, SHARED_K + 1, DECODE_TILES[tiles]), "down_split": SHARED_SPLIT}
    assert_same_as_dequantised(got, triton_moe.routed_experts(x, weights, ids, d1, d2, d3, LIMIT, shared=dsw,
                                                              **same_tiles),
                               pow2, dtype, device)
    want = (moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales)
            + moe_ops.dense_swiglu(x, *sw, LIMIT, scales=ss))
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("split", [2, 5])
def test_decode_fp8_down_split(device, split):
    x, weights, ids, w1, w2, w3, scales = make_inputs(device, 1, 6, torch.float32)
    got = triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, scales=scales, down_split=split,
                                    down_tiles=(32, 64, 2))
    assert_matches(got, moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales), torch.float32)


ON_GPU = os.environ.get("DSV4_TRITON_DEVICE", "cpu") != "cpu"


# every (T, k) with every tiles; the default tiles in both dtypes (fp32 halves their BLOCK_K:
# moe_grouped.default_tiles), the explicit ones in alternating dtypes (there the dtype changes only
# what the dequantised tile is rounded to, the same loads, masks and scale gathers: each tiles
# still takes both dtypes, each (T, k) too). wide_nk (256 x 256 weight tiles, the full
# per-element scale gather) only in the interpreter: compiled, its up-gate tile pair alone needs
# 256 KB of shared memory (the H200 has 228 KB)
@pytest.mark.parametrize("tiles,T,k,dtype", [pytest.param(t, T, k, d, marks=pytest.mark.skipif(
    t == "wide_nk" and ON_GPU, reason="tiles exceed the GPU's shared memory"))
    for t in sorted(GROUPED_TILES) for i, (T, k) in enumerate([(1, 1), (3, 4), (37, 6)])
    for d in ((FP32, BF16) if t == "default" else ((FP32, BF16)[(i + (t == "wide_nk")) % 2],))])
def test_grouped_fp8(device, dtype, T, k, tiles):
    pow2 = tiles != "wide_n"
    x, weights, ids, w1, w2, w3, scales = make_inputs(device, T, k, dtype, pow2, seed=T)
    got = moe_grouped.routed_experts_grouped(x, weights, ids, w1, w2, w3, LIMIT, scales=scales,
                                             **GROUPED_TILES[tiles])
    d1, d2, d3 = dequantised((w1, w2, w3), scales, dtype)
    assert_same_as_dequantised(got, moe_grouped.routed_experts_grouped(x, weights, ids, d1, d2, d3, LIMIT,
                                                                       **GROUPED_TILES[tiles]), pow2, dtype, device)
    assert_matches(got, moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales), dtype)


def test_reference_dequantises_on_the_fly(device):
    """routed_experts_loop / dense_swiglu with scales == the same on the dequantised weights."""
    x, weights, ids, w1, w2, w3, scales = make_inputs(device, 5, 3, torch.float32)
    d = dequantised((w1, w2, w3), scales, torch.float32)
    assert torch.equal(moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales),
                       moe_ops.routed_experts_loop(x, weights, ids, *d, LIMIT))
    sw, ss = make_shared(device)
    assert torch.equal(moe_ops.dense_swiglu(x, *sw, LIMIT, scales=ss),
                       moe_ops.dense_swiglu(x, *dequantised(sw, ss, torch.float32), LIMIT))


def test_dispatch_fp8(device, monkeypatch):
    """FP8 weights: decode kernels (shared fused) at small T*k; above it the Triton grouped GEMMs
    even when GROUPED_GEMM is "torch" (torch._grouped_mm never gets FP8); the loop without Triton."""
    x, weights, ids, w1, w2, w3, scales = make_inputs(device, 5, 2, torch.float32)
    sw, ss = make_shared(device)
    want = (moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales)
            + moe_ops.dense_swiglu(x, *sw, LIMIT, scales=ss))
    assert_quantised_dispatch(monkeypatch, x, weights, ids, (w1, w2, w3), sw, LIMIT,
                              dict(scales=scales, shared_scales=ss), want, decode_rows=3)


def test_fusable_shared_fp8(device):
    """The shared expert fuses with FP8 routed experts only when it is FP8 too, and back."""
    _, _, _, w1, w2, _, scales = make_inputs(device, 1, 1, torch.float32)
    sw, ss = make_shared(device)
    assert triton_moe.fusable_shared(w1, sw, scales, ss)
    assert not triton_moe.fusable_shared(w1, sw, scales, None)
    assert not triton_moe.fusable_shared(w1, dequantised(sw, ss, torch.float32), scales, None)
    assert not triton_moe.fusable_shared(w1, sw, scales, tuple(s.T for s in ss))     # scale layout
    with pytest.raises(AssertionError, match="need their scales"):
        triton_moe.routed_experts(torch.zeros(1, H, device=device), torch.ones(1, 1, device=device),
                                  torch.zeros(1, 1, dtype=torch.long, device=device), w1, w2, w1, LIMIT)
