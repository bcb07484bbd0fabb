"""MXFP4 (W4A16) routed experts in the Triton kernels (dsv4/ops/triton/moe.py decode GEMVs,
dsv4/ops/triton/moe_grouped.py grouped GEMMs): e2m1 pairs packed along the input dim (uint8,
low nibble first) with an E8M0 exponent byte per 32 inputs, dequantised tile by tile in the
kernels. Against the same kernels on the dequantised weights (grouped GEMMs: equal in the
interpreter, as e2m1 * 2^k is exact in bf16, so the dequantised tile is exactly what the
load-time dequantisation stores; compiled, within tolerance: see assert_same_as_dequantised;
decode GEMVs: within tolerance, as `_mxfp4_dot` adds each word's 8 products before the scale,
in another order than the bf16 GEMV) and against
the reference (`routed_experts_loop` with scales, which dequantises with dsv4.ops.quant's
`dequant_fp4`, the definition of the format). Uniformly random bytes: every nibble code, both
signs (and -0). H, I multiples of 32 but not of the tiles (partial tiles, partial scale runs)."""
import math

import pytest
import torch
from expert_inputs import (assert_matches, assert_quantised_dispatch, assert_same_as_dequantised, dequantised,
                           random_experts)

from dsv4.ops import moe as moe_ops
from dsv4.ops.triton import moe as triton_moe
from dsv4.ops.triton import moe_grouped

E, H, I, LIMIT = 4, 160, 96, 2.0     # H: 2.5 tiles of 64, I: 1.5; 5 and 3 scale groups
BF16, FP32 = torch.bfloat16, torch.float32
SMALL_DECODE = dict(up_tiles=(16, 64, 2), down_tiles=(32, 64, 2))     # several tiles along H and I


def random_mxfp4(*shape: int, std: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 matrices of unpacked shape [..., R, C]: (packed uint8 [..., R, C/2], E8M0
    bytes [..., R, C/32]), exponents within +-2 of the one giving entries of about `std` (random
    e2m1 codes have an rms of ~2.9)."""
    q = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, dtype=torch.uint8)
    e = 127 + round(math.log2(std / 2.9))
    return q, torch.randint(e - 2, e + 3, (*shape[:-1], shape[-1] // 32), generator=g).to(torch.uint8)


def make_inputs(device, T, k, dtype, seed=0):
    """x [T, H], weights [T, k], ids [T, k]; MXFP4 w1/w3 [E, I, H/2], w2 [E, H, I/2] and their
    E8M0 bytes (s1, s2, s3); the dense shared expert (sw1, sw2, sw3) in dtype."""
    x, weights, ids, *_ = random_experts(T, k, E, H, I, LIMIT, seed)
    g = torch.Generator().manual_seed(seed)
    (q1, s1), (q2, s2), (q3, s3) = (random_mxfp4(E, I, H, std=3 * LIMIT / H ** 0.5, g=g),
                                    random_mxfp4(E, H, I, std=1 / I ** 0.5, g=g),
                                    random_mxfp4(E, I, H, std=1.5 * LIMIT / H ** 0.5, g=g))
    shared = (torch.randn(I, H, generator=g) / H ** 0.5, torch.randn(H, I, generator=g) / I ** 0.5,
              torch.randn(I, H, generator=g) / H ** 0.5)
    dev = lambda t: t.to(device)  # noqa: E731
    return (x.to(device, dtype), dev(weights), dev(ids), dev(q1), dev(q2), dev(q3), (dev(s1), dev(s2), dev(s3)),
            tuple(w.to(device, dtype) for w in shared))


# default tiles (one tile of 512 columns, masked past H = 160 / I = 96) and SMALL_DECODE (several);
# T = 1 with k = 3 of E = 4 (an expert without tokens), T = 2 with k = E (each expert 2 tokens)
@pytest.mark.parametrize("T,k,dtype,tiles", [(1, 3, FP32, {}), (3, 2, BF16, {}), (1, 3, BF16, SMALL_DECODE),
                                             (2, 4, FP32, {})])
def test_decode_mxfp4(device, T, k, dtype, tiles):
    x, weights, ids, w1, w2, w3, scales, _ = make_inputs(device, T, k, dtype, seed=k)
    got = triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, scales=scales, **tiles)
    d1, d2, d3 = dequantised((w1, w2, w3), scales, dtype)
    assert_same_as_dequantised(got, triton_moe.routed_experts(x, weights, ids, d1, d2, d3, LIMIT, **tiles), False,
                               dtype, device)
    assert_matches(got, moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales), dtype)


def test_decode_mxfp4_shared_split(device):
    """The dense shared expert fused as the (k+1)-th pair of MXFP4 routed experts (its own masked
    load), tiles spanning several scale groups and tiles, the down reduction split 3 ways."""
    x, weights, ids, w1, w2, w3, scales, sw = make_inputs(device, 1, 2, BF16)
    got = triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, shared=sw, scales=scales, down_split=3,
                                    **SMALL_DECODE)
    d = dequantised((w1, w2, w3), scales, BF16)
    assert_same_as_dequantised(got, triton_moe.routed_experts(x, weights, ids, *d, LIMIT, shared=sw, down_split=3,
                                                              **SMALL_DECODE), False, BF16, device)
    want = moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales) + moe_ops.dense_swiglu(x, *sw, LIMIT)
    assert_matches(got, want, BF16)


def test_empty_mxfp4(device):
    x, weights, ids, w1, w2, w3, scales, sw = make_inputs(device, 0, 2, BF16)
    assert torch.equal(triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, shared=sw, scales=scales),
                       torch.zeros(0, H, dtype=BF16, device=device))
    assert moe_grouped.routed_experts_grouped(x, weights, ids, w1, w2, w3, LIMIT, scales=scales).shape == (0, H)


# (T, k, dtype, tiles): BLOCK_K 128 (4 scale groups, a K tail) and 64; None: fp32's default tiles,
# whose BLOCK_K (halved to 32 for unquantised weights) stays at MXFP4_BLOCK
@pytest.mark.parametrize("T,k,dtype,tiles", [
    (5, 3, BF16, dict(up_tiles=(16, 64, 128, 4, 2), down_tiles=(16, 64, 64, 4, 2))),
    (1, 1, FP32, None)])
def test_grouped_mxfp4(device, T, k, dtype, tiles):
    x, weights, ids, w1, w2, w3, scales, _ = make_inputs(device, T, k, dtype, seed=T)
    if tiles is None:
        up, down = moe_grouped.default_tiles(T * k, E, dtype, mxfp4=True)
        assert up[2] == down[2] == triton_moe.MXFP4_BLOCK
        tiles = dict(up_tiles=up, down_tiles=down)                 # the same for the dequantised run
    got = moe_grouped.routed_experts_grouped(x, weights, ids, w1, w2, w3, LIMIT, scales=scales, **tiles)
    d = dequantised((w1, w2, w3), scales, dtype)
    assert_same_as_dequantised(got, moe_grouped.routed_experts_grouped(x, weights, ids, *d, LIMIT, **tiles), True,
                               dtype, device)
    assert_matches(got, moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales), dtype)


def test_reference_dequantises_on_the_fly(device):
    """routed_experts_loop with MXFP4 weights and scales == the same on the dequantised weights."""
    x, weights, ids, w1, w2, w3, scales, _ = make_inputs(device, 5, 3, FP32)
    assert torch.equal(moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales),
                       moe_ops.routed_experts_loop(x, weights, ids, *dequantised((w1, w2, w3), scales, FP32), LIMIT))


def test_dispatch_mxfp4(device, monkeypatch):
    """MXFP4 weights: the decode kernels with the dense shared expert fused at small T*k; above
    TRITON_MAX_PAIRS the Triton grouped GEMMs even when GROUPED_GEMM is "torch" (torch._grouped_mm
    never gets MXFP4); the loop without Triton."""
    x, weights, ids, w1, w2, w3, scales, sw = make_inputs(device, 3, 2, FP32)
    want = moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT, scales) + moe_ops.dense_swiglu(x, *sw, LIMIT)
    assert_quantised_dispatch(monkeypatch, x, weights, ids, (w1, w2, w3), sw, LIMIT, dict(scales=scales), want,
                              decode_rows=2)


def test_mxfp4_checks(device):
    """The shared expert fuses with MXFP4 routed experts only unquantised; scales must be uint8 of
    the packed layout; tiles along the packed dims multiples of 64."""
    x, weights, ids, w1, w2, w3, scales, sw = make_inputs(device, 1, 1, FP32)
    assert triton_moe.fusable_shared(w1, sw, scales)
    assert not triton_moe.fusable_shared(w1, sw, scales, scales)                 # quantised shared
    assert not triton_moe.fusable_shared(w1, (w1[0], w2[0], w3[0]), scales)       # MXFP4 shared
    assert not triton_moe.fusable_shared(w1, (sw[0].T, sw[1], sw[2].T), scales)   # layout
    run = lambda **kw: triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, **kw)  # noqa: E731
    with pytest.raises(AssertionError, match="need their scales"):
        run()
    with pytest.raises(AssertionError, match="uint8 for MXFP4"):
        run(scales=tuple(s.float() for s in scales))
    with pytest.raises(AssertionError, match="multiples of 64"):
        run(scales=scales, up_tiles=(16, 32, 2))
    with pytest.raises(AssertionError, match="multiple of 64"):
        moe_grouped.routed_experts_grouped(x, weights, ids, w1, w2, w3, LIMIT, scales=scales,
                                           up_tiles=(16, 64, 32, 4, 2))
