"""Triton decode-size routed experts (dsv4/ops/triton/moe.py) against the torch reference
`routed_experts_loop` (dsv4/ops/moe.py), the definition: empty/one/few tokens, k in {1, 2, 6},
experts repeated across tokens, the SwiGLU clamp engaged, fp32 and bf16, dimensions that are
not multiples of the tiles, the down projection split over programs (fp32 partials + sum), the
shared expert fused as one more pair (against + dense_swiglu), and the dispatch from
`routed_experts` and `moe_experts`."""
import pytest
import torch
from expert_inputs import random_experts

from dsv4.ops import moe as moe_ops
from dsv4.ops.triton import moe as triton_moe

E, H, I, LIMIT = 8, 72, 48, 2.0  # H, I: not multiples of the tiles below
FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # rounding of a differently ordered sum
SMALL_TILES = dict(up_tiles=(16, 32, 2), down_tiles=(16, 32, 2))  # several loop iterations, masked tails


def make_inputs(device, T, k, dtype, seed=0):
    """expert_inputs.random_experts on `device` in `dtype` (routing weights fp32, ids long)."""
    x, weights, ids, w1, w2, w3 = random_experts(T, k, E, H, I, LIMIT, seed)
    cast = lambda t: t.to(device, dtype)  # noqa: E731
    return cast(x), weights.to(device), ids.to(device), cast(w1), cast(w2), cast(w3)


def make_shared(device, dtype, seed=1):
    """The shared expert's sw1/sw3 [I, H], sw2 [H, I], scaled like the routed ones."""
    g = torch.Generator().manual_seed(seed)
    sw1 = torch.randn(I, H, generator=g) * (3 * LIMIT / H ** 0.5)
    sw2 = torch.randn(H, I, generator=g) / I ** 0.5
    sw3 = torch.randn(I, H, generator=g) * (1.5 * LIMIT / H ** 0.5)
    return tuple(t.to(device, dtype) for t in (sw1, sw2, sw3))


def expert_terms(x, w1, w2, w3, weights):
    """sum_j w_j |w2_j| |h_j| [T, H] in fp32 for x [T, H], w1/w3 [T, k, I, H], w2 [T, k, H, I],
    weights [T, k]: the scale of a bf16 rounding of each expert's output."""
    h = moe_ops.swiglu_clamped(torch.einsum("th,tjih->tji", x, w1), torch.einsum("th,tjih->tji", x, w3), LIMIT)
    return torch.einsum("tj,tjni,tji->tn", weights, w2.abs(), h.abs())


def check(device, T, k, dtype, shared=False, **tiles):
    """The kernel against routed_experts_loop (+ dense_swiglu for the shared expert)."""
    x, weights, ids, w1, w2, w3 = make_inputs(device, T, k, dtype)
    sw = make_shared(device, dtype) if shared else None
    got = triton_moe.routed_experts(x, weights, ids, w1, w2, w3, LIMIT, shared=sw, **tiles)
    want = moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT)
    if shared:
        want = want + moe_ops.dense_swiglu(x, *sw, LIMIT)
    assert got.shape == want.shape == (T, H) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32_TOL)
    else:  # the reference rounds gate, up, h, each expert's output and the sum to bf16 (the
        # kernel only h and the sum): within a bf16 ulp of sum_j w_j |w2[e_j]| |h_j| and of out
        xf, w1f, w2f, w3f = (t.float() for t in (x, w1, w2, w3))
        terms = expert_terms(xf, w1f[ids], w2f[ids], w3f[ids], weights)       # [T, H]
        if shared:   # the shared expert: one more "expert" of weight 1, its sum rounded once more
            s1, s2, s3 = (t.float().expand(T, 1, *t.shape) for t in sw)
            terms = terms + expert_terms(xf, s1, s2, s3, torch.ones(T, 1, device=x.device)) + want.float().abs()
        assert ((got.float() - want.float()).abs() <= 2 ** -7 * (terms + want.float().abs())).all()


def alternate_dtypes(cases: list[tuple]) -> list[tuple]:
    """Each case with one dtype, bfloat16 and float32 in turn (the interpreter is slow)."""
    return [(*c, (torch.bfloat16, torch.float32)[i % 2]) for i, c in enumerate(cases)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,k", [(0, 6), (1, 1), (1, 6), (3, 2), (3, 6)])
def test_routed_experts(device, dtype, T, k):
    check(device, T, k, dtype)


# bf16: fp32 takes the small tiles in test_down_split (splits 5 and 16 at T = 1, 7 at T = 3: several
# units a program, empty programs) and in test_shared_expert unsplit (one unit a program, as here)
def test_small_tiles(device):
    check(device, 3, 6, torch.bfloat16, **SMALL_TILES)


# SMALL_TILES down: BLOCK_I 32 over I 48 -> 2 I-blocks per expert (the second a masked tail), so
# k * 2 units; splits that cut inside an expert, unevenly (5 over 12), one unit each (12), and
# more splits than units (16: empty programs write zero partials); the dtypes alternate (the
# split's arithmetic does not depend on it; test_routed_experts takes every case in both)
@pytest.mark.parametrize("T,k,split,dtype", alternate_dtypes([(1, 6, 2), (1, 6, 5), (1, 6, 12), (1, 6, 16), (3, 2, 3),
                                                              (3, 6, 7)]))
def test_down_split(device, dtype, T, k, split):
    check(device, T, k, dtype, down_split=split, **SMALL_TILES)


@pytest.mark.parametrize("split", [1, 3, 10])
def test_down_split_default_tiles(device, split):
    """Default tiles (one I-block per expert at I 48): splits over whole experts only."""
    check(device, 2, 6, torch.float32, down_split=split)


# the shared expert as pair k of every token (weight 1): k = 1 and 6, T up to 5, the down
# projection unsplit, split inside and across experts (the shared one included); the dtypes
# alternate, T = 1, k = 6 unsplit in both. Unsplit (the default split) every case here has one
# (expert, I-block) unit a program: T = 8 at k = 3 repeated T = 5 at k = 2 with more programs
@pytest.mark.parametrize("T,k,split,dtype", alternate_dtypes([(1, 1, None), (1, 6, None), (2, 6, None), (5, 2, None),
                                                              (1, 6, 1), (1, 6, 5), (1, 6, 14), (3, 2, 7)])
                         + [(1, 6, None, torch.bfloat16)])
def test_shared_expert(device, dtype, T, k, split):
    check(device, T, k, dtype, shared=True, down_split=split, **SMALL_TILES)


def test_shared_expert_default_tiles(device):
    check(device, 2, 6, torch.bfloat16, shared=True)


def test_fusable_shared(device):
    """The shared expert fuses only with the routed experts' dtype and I and contiguous rows."""
    _, _, _, w1, _, _ = make_inputs(device, 1, 1, torch.float32)
    sw = make_shared(device, torch.float32)
    assert triton_moe.fusable_shared(w1, sw)
    assert not triton_moe.fusable_shared(w1, tuple(t.bfloat16() for t in sw))        # dtype
    assert not triton_moe.fusable_shared(w1, (sw[0][:-1], sw[1][:, :-1], sw[2][:-1]))  # I
    assert not triton_moe.fusable_shared(w1, (sw[0].T.contiguous().T, sw[1], sw[2].T.contiguous().T))


def test_moe_experts_dispatch(device, monkeypatch):
    """moe_experts = routed + shared: the fused kernel when use_triton and T*k is small (one
    call with shared=), else routed_experts + dense_swiglu; same results."""
    calls = []
    kernel = triton_moe.routed_experts
    monkeypatch.setattr(triton_moe, "routed_experts",
                        lambda *a, **kw: calls.append("shared" in kw) or kernel(*a, **kw))
    x, weights, ids, w1, w2, w3 = make_inputs(device, 3, 2, torch.float32)
    sw = make_shared(device, torch.float32)
    want = moe_ops.routed_experts_loop(x, weights, ids, w1, w2, w3, LIMIT) + moe_ops.dense_swiglu(x, *sw, LIMIT)
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: False)
    torch.testing.assert_close(moe_ops.moe_experts(x, weights, ids, w1, w2, w3, sw, LIMIT), want, **FP32_TOL)
    assert calls == []
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: True)
    torch.testing.assert_close(moe_ops.moe_experts(x, weights, ids, w1, w2, w3, sw, LIMIT), want, **FP32_TOL)
    assert calls == [True]
    sw_cols = (sw[0].T.contiguous().T, sw[1], sw[2].T.contiguous().T)              # not fusable
    torch.testing.assert_close(moe_ops.moe_experts(x, weights, ids, w1, w2, w3, sw_cols, LIMIT), want, **FP32_TOL)
    assert calls == [True, False]


def test_default_down_split():
    """Shapes only; >= 1, <= the number of units; fewer splits as T grows; 1 at the V4-Flash
    sizes once T fills the machine."""
    split = lambda T: triton_moe.default_down_split(T, 6, 4096, 2048)  # noqa: E731
    assert [split(T) for T in (1, 2, 4, 8, 64)] == [2, 1, 1, 1, 1]
    assert triton_moe.default_down_split(1, 1, 8, 48) == 1          # one unit: nothing to split
    assert triton_moe.default_down_split(1, 6, 72, 48, 16, 32) == 12   # capped at k * 2 units


def test_inputs_exercise_clamp_and_repeats(device):
    """The cases above engage both clamps (and leave values unclamped) and share experts."""
    x, _, ids, w1, _, w3 = make_inputs(device, 3, 6, torch.float32)
    gate = torch.einsum("th,tjih->tji", x, w1[ids])
    up = torch.einsum("th,tjih->tji", x, w3[ids])
    assert (gate > LIMIT).any() and (gate < LIMIT).any()
    assert (up > LIMIT).any() and (up < -LIMIT).any() and (up.abs() < LIMIT).any()
    assert ids.flatten().unique().numel() < ids.numel()  # some expert serves several tokens


def test_dispatch(device, monkeypatch):
    """routed_experts takes the kernel exactly when use_triton says so and T*k is small."""
    calls = []
    kernel = triton_moe.routed_experts
    monkeypatch.setattr(triton_moe, "routed_experts",
                        lambda *a, **kw: calls.append(a[2].numel()) or kernel(*a, **kw))
    monkeypatch.setattr(moe_ops, "TRITON_MAX_PAIRS", 6)
    x, weights, ids, w1, w2, w3 = make_inputs(device, 3, 2, torch.float32)
    args = (weights, ids, w1, w2, w3, LIMIT)
    want = moe_ops.routed_experts_loop(x, *args)

    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: False)
    torch.testing.assert_close(moe_ops.routed_experts(x, *args), want, **FP32_TOL)
    assert calls == []
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: True)
    torch.testing.assert_close(moe_ops.routed_experts(x, *args), want, **FP32_TOL)  # 6 pairs
    assert calls == [6]
    torch.testing.assert_close(moe_ops.routed_experts(x[:1], weights[:1], ids[:1], w1, w2, w3, LIMIT),
                               moe_ops.routed_experts_loop(x[:1], weights[:1], ids[:1], w1, w2, w3, LIMIT),
                               **FP32_TOL)
    assert calls == [6, 2]
    x4, weights4, ids4, *_ = make_inputs(device, 4, 2, torch.float32, seed=1)  # 8 pairs > 6
    moe_ops.routed_experts(x4, weights4, ids4, w1, w2, w3, LIMIT)
    assert calls == [6, 2]
