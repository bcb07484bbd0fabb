"""FP8-weight GEMMs (dsv4/ops/triton/quant_gemm.py) against their definitions in
dsv4/ops/quant_gemm.py: act_quant bit for bit; W8A16 and W8A8 within the fp32 / bf16 sum-order
tolerance, for decode and prefill row counts, K-splits, the o-groups' block-diagonal form, and
sizes not multiples of the 128-blocks or the tiles."""
import pytest
import torch

from dsv4.ops import quant_gemm as ref
from dsv4.ops.quant import e8m0_to_float, quant_fp8
from dsv4.ops.triton import quant_gemm as tq


def fp8_weight(N: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weight [N, K] with fp32 power-of-two scales that differ per 128x128 block."""
    g = torch.Generator().manual_seed(seed)
    factor = torch.exp2(torch.randint(-3, 4, (-(-N // 128), -(-K // 128)), generator=g).float())
    w = torch.randn(N, K, generator=g) / K ** 0.5
    w = w * factor.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    q, s = quant_fp8(w)
    return q, e8m0_to_float(s).contiguous()


def activations(M: int, K: int, dtype: torch.dtype, device: str, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-4, 5, (M, 1), generator=g).float())
    return x.to(dtype).to(device)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    got, want = got.float().cpu(), want.float().cpu()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(1, 256), (5, 200), (33, 384)])
def test_act_quant_bit_exact(device, dtype, M, K):
    x = activations(M, K, dtype, device)
    x[0, :7] = 0.0                                      # a group with a zero run; amax floors at 1e-4
    q, s = tq.act_quant(x)
    want_q, want_s = ref.act_quant(x.cpu())
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))


def test_act_quant_scales_are_the_smallest_power_of_two():
    x = activations(7, 300, torch.float32, "cpu")
    x[1, :128] = 448.0 * 2.0 ** -3                     # amax exactly 448 * s: s = 2^-3
    x[2, :128] = 448.0 * 2.0 ** -3 * 1.0001            # just above: the next power
    q, s = ref.act_quant(x)
    amax = torch.nn.functional.pad(x.abs(), (0, 84)).view(7, 3, 128).amax(-1).clamp(min=1e-4)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))                     # powers of two
    assert bool((amax <= 448 * s).all()) and bool((amax > 224 * s).all())        # the smallest
    assert s[1, 0] == 2.0 ** -3 and s[2, 0] == 2.0 ** -2
    back = q.float() * s.repeat_interleave(128, -1)[:, :300]
    assert bool(((back - x).abs() <= s.repeat_interleave(128, -1)[:, :300] * 16).all())   # e4m3 steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,groups,split", [
    (1, 256, 512, 1, None),       # decode: K split into 4
    (3, 320, 200, 1, 1),          # N past the 128-blocks and the tiles, K tail, no split
    (3, 320, 200, 1, 2),          # the same split in two (the second holds the tail)
    (70, 256, 384, 1, None),      # prefill tiles (128 x 128)
    (2, 512, 256, 4, None),       # o-groups: 4 groups of 128 outputs, each reading its 256 inputs
])
def test_fp8_gemm_w8a16_matches_reference(device, dtype, M, N, K, groups, split):
    w, s = fp8_weight(N, K)
    x = activations(M, groups * K, dtype, device)
    got = tq.fp8_gemm(x, w.to(device), s.to(device), groups=groups, split=split)
    assert_close(got, ref.fp8_linear(x.cpu(), w, s, groups), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K,groups", [(1, 256, 512, 1), (3, 320, 200, 1), (70, 256, 384, 1), (2, 512, 256, 4)])
def test_fp8_gemm_w8a8_matches_reference(device, dtype, M, N, K, groups):
    w, s = fp8_weight(N, K)
    x = activations(M, groups * K, dtype, device)
    xq, xs = tq.act_quant(x)
    got = tq.fp8_gemm(xq, w.to(device), s.to(device), groups=groups, x_scale=xs, out_dtype=dtype)
    assert_close(got, ref.fp8_linear_w8a8(x.cpu(), w, s, groups), dtype)


def test_w8a8_definition_is_close_to_w8a16():
    """Quantising the activations per 128 inputs costs at most e4m3's relative step."""
    w, s = fp8_weight(256, 512)
    x = activations(9, 512, torch.float32, "cpu")
    a16, a8 = ref.fp8_linear(x, w, s), ref.fp8_linear_w8a8(x, w, s)
    rel = (a8 - a16).norm() / a16.norm()
    assert 0 < float(rel) < 2 ** -4


def test_explicit_tiles_and_leading_dims(device):
    """[T, N, K] activations (MTP's h_proj) and every small-M tile give the same as [T*N, K]."""
    w, s = fp8_weight(128, 256)
    x = activations(6, 256, torch.float32, device).view(2, 3, 256)
    want = ref.fp8_linear(x.cpu(), w, s)
    for tiles in [(16, 16, 2, 2), (16, 32, 4, 3), (32, 128, 4, 2)]:
        got = tq.fp8_gemm(x, w.to(device), s.to(device), tiles=tiles)
        assert got.shape == (2, 3, 128)
        assert_close(got, want, torch.float32)
