"""The fused RMSNorm + interleaved partial RoPE kernel (dsv4/ops/triton/norm_rope.py) against
the torch references rms_norm / rms_norm_unweighted / apply_rope, on odd shapes and strided rows."""
import pytest
import torch

from dsv4.ops.norm import rms_norm, rms_norm_unweighted
from dsv4.ops.rope import apply_rope, rope_cos_sin
from dsv4.ops.triton.norm_rope import norm_rope

EPS = 1e-6


def strided_rows(T, H, D, dtype, device, seed):
    """x [T, H, D] as a column slice of a wider [T, H*D + 7] tensor (row stride != H*D)."""
    g = torch.Generator().manual_seed(seed)
    wide = (torch.randn(T, H * D + 7, generator=g) * 3).to(dtype)
    return wide[:, 5:5 + H * D].to(device).unflatten(-1, (H, D))


def cos_sin(T, R, device, seed):
    pos = torch.randint(0, 100000, (T,), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / (160000 ** (torch.arange(R, dtype=torch.float32) / R))
    return tuple(c.to(device) for c in rope_cos_sin(pos, inv_freq))


def assert_matches(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:   # same roundings as the reference; an fp32 last-bit difference may flip a rare bf16 rounding
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["weighted", "unweighted", "rope_only", "inverse", "norm_only"])
@pytest.mark.parametrize("T,H,D,R", [(3, 5, 48, 8), (1, 1, 66, 16), (4, 2, 30, 15)])
def test_norm_rope_matches_reference(mode, T, H, D, R, dtype, device):
    x = strided_rows(T, H, D, dtype, device, seed=T + D)
    w = (1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(1))).to(device)
    cos, sin = cos_sin(T, R, device, seed=D)
    xc = x.cpu()
    wc, cc, sc = w.cpu(), cos.cpu(), sin.cpu()
    if mode == "weighted":
        got, want = norm_rope(x, w, EPS, cos=cos, sin=sin), apply_rope(rms_norm(xc, wc, EPS), cc, sc)
    elif mode == "unweighted":
        got, want = norm_rope(x, None, EPS, cos=cos, sin=sin), apply_rope(rms_norm_unweighted(xc, EPS), cc, sc)
    elif mode == "rope_only":
        got, want = norm_rope(x, norm=False, cos=cos, sin=sin), apply_rope(xc, cc, sc)
    elif mode == "inverse":
        got, want = norm_rope(x, norm=False, cos=cos, sin=sin, inverse=True), apply_rope(xc, cc, sc, inverse=True)
    else:
        got, want = norm_rope(x[:, 0], w, EPS), rms_norm(xc[:, 0], wc, EPS)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_matches(got.cpu(), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_into_rows(dtype, device):
    """out[rows[t]] = apply_rope(rms_norm(x[t])) in out's dtype; other rows untouched."""
    T, D, R = 5, 40, 6
    x = strided_rows(T, 1, D, dtype, device, seed=7)[:, 0]
    w = (1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(2))).to(device)
    cos, sin = cos_sin(T, R, device, seed=3)
    out = torch.randn(11, D, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    rows = torch.tensor([9, 0, 4, 2, 7], device=device)
    want = out.cpu().clone()
    want[rows.cpu()] = apply_rope(rms_norm(x.cpu(), w.cpu(), EPS), cos.cpu(), sin.cpu()).to(torch.bfloat16)
    norm_rope(x, w, EPS, cos=cos, sin=sin, out=out, rows=rows)
    assert_matches(out.cpu(), want, torch.bfloat16)
    untouched = [1, 3, 5, 6, 8, 10]
    assert torch.equal(out.cpu()[untouched], want[untouched])


def test_several_head_blocks(monkeypatch, device):
    """A small row tile splits H = 5 heads into blocks of 2 (the last one half masked)."""
    from dsv4.ops.triton import norm_rope as module
    monkeypatch.setattr(module, "ROW_TILE", 64)
    x = strided_rows(3, 5, 48, torch.float32, device, seed=9)
    cos, sin = cos_sin(3, 8, device, seed=9)
    want = apply_rope(rms_norm_unweighted(x.cpu(), EPS), cos.cpu(), sin.cpu())
    assert_matches(norm_rope(x, None, EPS, cos=cos, sin=sin).cpu(), want, torch.float32)


def test_empty_rows(device):
    x = torch.zeros(0, 3, 16, device=device)
    assert norm_rope(x, None, EPS).shape == (0, 3, 16)
