"""Triton mHC kernels (dsv4/ops/triton/mhc.py) against the torch reference (dsv4/ops/mhc.py),
the definition: hc_pre (projection, sigmoid, Sinkhorn, collapse), hc_post, hc_head, for
empty/single/odd token counts, N = 4 (V4) and non-power-of-two N, fp32 and bf16, and the
dispatch from the reference module."""
import pytest
import torch

from dsv4.ops import backend
from dsv4.ops import mhc as mhc_ops
from dsv4.ops.triton import mhc as triton_mhc

NORM_EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20
# fp32: rounding of a differently ordered sum; bf16: within bf16 rounding of the output (the
# interpreter truncates fp32 -> bf16 where the GPU rounds to nearest).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
FP32_TOL = dict(rtol=1e-5, atol=1e-6)  # post and comb are fp32 whatever h's dtype


def reference(fn, *args):
    """The torch reference, also on CUDA (where the op would dispatch to the kernel)."""
    with backend.forced("reference"):
        return fn(*args)


def make_inputs(device, T, N, D, dtype, nmix, seed=0):
    """Streams h [T, N, D] and mixing weights fn [nmix, N*D], base [nmix], scale [3] scaled so
    that the sigmoids and the softmax are neither saturated nor flat."""
    g = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(T, N, D, generator=g)).to(device, dtype)
    fn = (torch.randn(nmix, N * D, generator=g) * (N * D) ** -0.5).to(device)
    base = torch.randn(nmix, generator=g).to(device)
    scale = (0.5 + torch.rand(3, generator=g)).to(device)
    return h, fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,D", [(0, 4, 64), (1, 4, 64), (7, 4, 96), (33, 4, 64), (7, 2, 64), (5, 3, 96)])
def test_hc_pre(device, dtype, T, N, D):
    h, fn, base, scale = make_inputs(device, T, N, D, dtype, (2 + N) * N)
    args = (h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    x, post, comb = triton_mhc.hc_pre(*args)
    want_x, want_post, want_comb = reference(mhc_ops.hc_pre, *args)
    assert (x.shape, x.dtype, post.dtype, comb.dtype) == (want_x.shape, dtype, torch.float32, torch.float32)
    torch.testing.assert_close(post, want_post, **FP32_TOL)
    torch.testing.assert_close(comb, want_comb, **FP32_TOL)
    torch.testing.assert_close(x, want_x, **TOL[dtype])


@pytest.mark.parametrize("iters", [1, 3])
def test_hc_pre_sinkhorn_iterations(device, iters):
    h, fn, base, scale = make_inputs(device, 3, 4, 64, torch.float32, 24, seed=1)
    args = (h, fn, base, scale, NORM_EPS, 1e-3, iters)
    for got, want in zip(triton_mhc.hc_pre(*args), reference(mhc_ops.hc_pre, *args)):
        torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,D", [(0, 4, 64), (1, 4, 64), (7, 4, 96), (33, 4, 64), (5, 3, 96)])
def test_hc_head(device, dtype, T, N, D):
    h, fn, base, scale = make_inputs(device, T, N, D, dtype, N)
    args = (h, fn, base, scale[:1], NORM_EPS, HC_EPS)
    x = triton_mhc.hc_head(*args)
    torch.testing.assert_close(x, reference(mhc_ops.hc_head, *args), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,D", [(0, 4, 64), (1, 4, 64), (33, 4, 96), (7, 3, 600)])
def test_hc_post(device, dtype, T, N, D):
    h, fn, base, scale = make_inputs(device, T, N, D, dtype, (2 + N) * N)
    _, post, comb = reference(mhc_ops.hc_pre, h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    out = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    new = triton_mhc.hc_post(out, h, post, comb)
    want = reference(mhc_ops.hc_post, out, h, post, comb)
    assert new.shape == h.shape and new.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(new, want, **TOL[dtype])
    else:  # the reference rounds post*out, the matmul and their sum to bf16 separately, the kernel once
        scale_of_output = want.float().abs().max().item() if T else 1.0
        torch.testing.assert_close(new.float(), want.float(), rtol=2 ** -7, atol=2 ** -6 * scale_of_output)


@pytest.mark.parametrize("T,D", [(20, 64), (2, 96)])
def test_small_tiles(device, monkeypatch, T, D):
    """Several token tiles in the projection (T=20) and D split over programs (T=2), where only
    the first slice writes post/comb."""
    monkeypatch.setattr(triton_mhc, "_BT", 16)
    monkeypatch.setattr(triton_mhc, "_BD", 32)
    h, fn, base, scale = make_inputs(device, T, 4, D, torch.float32, 24, seed=3)
    args = (h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
    for got, want in zip(triton_mhc.hc_pre(*args), reference(mhc_ops.hc_pre, *args)):
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_dispatch(device, monkeypatch):
    """The reference module calls the kernels exactly when use_triton says so."""
    h, fn, base, scale = make_inputs(device, 2, 4, 64, torch.float32, 24)
    out = torch.randn(2, 64).to(device)
    calls = []
    for name in ("hc_pre", "hc_post", "hc_head"):
        kernel = getattr(triton_mhc, name)
        monkeypatch.setattr(triton_mhc, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))

    def run():
        x, post, comb = mhc_ops.hc_pre(h, fn, base, scale, NORM_EPS, HC_EPS, ITERS)
        new = mhc_ops.hc_post(out, h, post, comb)
        return x, post, comb, new, mhc_ops.hc_head(new, fn[:4], base[:4], scale[:1], NORM_EPS, HC_EPS)

    monkeypatch.setattr(mhc_ops, "use_triton", lambda tensor: False)
    want = run()
    assert calls == []
    monkeypatch.setattr(mhc_ops, "use_triton", lambda tensor: True)
    got = run()
    assert calls == ["hc_pre", "hc_post", "hc_head"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **FP32_TOL)


def test_post_rejects_mixed_dtypes(device):
    h = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=device)
    post, comb = torch.zeros(1, 4, device=device), torch.zeros(1, 4, 4, device=device)
    with pytest.raises(TypeError):
        triton_mhc.hc_post(torch.zeros(1, 64, device=device), h, post, comb)
