"""Random routed-expert inputs and the kernels-vs-reference tolerance shared by the MoE kernel
tests (imported by file name: this folder is on sys.path while its tests run)."""
import torch

from dsv4.ops.quant import dequant_kept


def random_experts(T: int, k: int, E: int, h: int, i: int, limit: float, seed: int = 0,
                   same_experts: bool = False) -> tuple[torch.Tensor, ...]:
    """fp32 on the CPU: x [T, h], routing weights [T, k], ids [T, k] (distinct within a token;
    the same k experts for every token when same_experts), w1/w3 [E, i, h] scaled so |gate| and
    |up| often exceed `limit`, w2 [E, h, i] -> (x, weights, ids, w1, w2, w3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g)
    if same_experts:
        ids = torch.randperm(E, generator=g)[:k].repeat(T, 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
            torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(T, k, generator=g) * 2.5
    w1 = torch.randn(E, i, h, generator=g) * (3 * limit / h ** 0.5)  # gate std ~ 3 limit
    w3 = torch.randn(E, i, h, generator=g) * (1.5 * limit / h ** 0.5)
    w2 = torch.randn(E, h, i, generator=g) / i ** 0.5
    return x, weights, ids, w1, w2, w3


def dequantised(ws, scales, dtype) -> tuple[torch.Tensor, ...]:
    """Kept quantised weights (FP8 or MXFP4 stacks or matrices) -> what the load-time
    dequantisation stores: the fp32 product rounded to the model dtype."""
    return tuple(dequant_kept(w, s).to(dtype) for w, s in zip(ws, scales))


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Kernel output vs the reference (`routed_experts_loop`, `dense_swiglu`) in dtype."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:   # rounding of differently ordered sums (outputs up to ~30)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:   # bf16: the reference rounds gate, up, h and each expert's output (the kernels fewer)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6 * want.float().abs().max().item())


def assert_same_as_dequantised(got: torch.Tensor, want: torch.Tensor, exact: bool, dtype: torch.dtype,
                               device: str) -> None:
    """The kernels on quantised weights vs the same kernels on the dequantised weights: bit for
    bit in the interpreter when `exact` (FP8 with power-of-two (E8M0) scales, as released, and
    MXFP4: the in-kernel dequantisation, or FP8 scales folded into x / h, is then exact, as at
    load). Otherwise within `assert_matches`' tolerance: compiled on the GPU the compiler lays a
    quantised tile out unlike a bf16 one, so tl.sum / tl.dot add in another order; FP8 scales
    that are not powers of two round w * s differently (folded: not at all)."""
    if exact and device == "cpu":
        assert torch.equal(got, want)
    else:
        assert_matches(got, want, dtype)


def assert_quantised_dispatch(monkeypatch, x, weights, ids, ws, sw, limit, quant_kw, want, decode_rows):
    """moe_experts on quantised experts ws = (w1, w2, w3) with the shared expert sw (quant_kw:
    scales= [, shared_scales=]), want its reference output: the torch loop without Triton; with
    Triton the grouped GEMMs above TRITON_MAX_PAIRS even when GROUPED_GEMM is "torch"
    (torch._grouped_mm never gets quantised weights), and the decode kernels with the shared
    expert fused for the first `decode_rows` tokens (TRITON_MAX_PAIRS is set to their pairs)."""
    from dsv4.ops import moe as moe_ops
    from dsv4.ops.triton import moe as triton_moe
    from dsv4.ops.triton import moe_grouped
    calls = []
    decode, grouped = triton_moe.routed_experts, moe_grouped.routed_experts_grouped
    monkeypatch.setattr(triton_moe, "routed_experts", lambda *a, **kw: calls.append(("decode", "shared" in kw))
                        or decode(*a, **kw))
    monkeypatch.setattr(moe_grouped, "routed_experts_grouped", lambda *a, **kw: calls.append(("grouped",))
                        or grouped(*a, **kw))
    monkeypatch.setattr(moe_ops, "TRITON_MAX_PAIRS", decode_rows * ids.shape[1])
    monkeypatch.setattr(moe_ops, "GROUPED_GEMM", "torch")

    def run(rows):
        return moe_ops.moe_experts(x[:rows], weights[:rows], ids[:rows], *ws, sw, limit, **quant_kw)
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: False)
    assert torch.equal(run(len(x)), want) and calls == []
    monkeypatch.setattr(moe_ops, "use_triton", lambda tensor: True)
    assert_matches(run(len(x)), want, x.dtype)
    assert calls == [("grouped",)]
    assert_matches(run(decode_rows), want[:decode_rows], x.dtype)
    assert calls == [("grouped",), ("decode", True)]
