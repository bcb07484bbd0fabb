"""A tiny released-format model with its FP8 projections kept (`keep_fp8_dense`) gives the same
logits with the FP8 GEMM kernels (dsv4/ops/triton/quant_gemm.py) as with their torch
definitions, W8A16 and W8A8 alike: every other op stays on its reference."""
import pytest
import torch

from dsv4.engine.oneshot import full_logits
from dsv4.model.random_model import build_random_model
from dsv4.ops import quant_gemm
from dsv4.ops.triton import quant_gemm as tri


@pytest.mark.parametrize("gemm", ["w8a16", "w8a8"])
def test_fp8_gemm_kernels_keep_logits(monkeypatch, device, gemm):
    torch.set_num_threads(1)
    model = build_random_model("random:tiny:2", device, released=True, keep_fp8_dense=True, keep_mxfp4=True)
    monkeypatch.setattr(quant_gemm, "FP8_DENSE_GEMM", gemm)
    ids = [(7 * i + 3) % model.cfg.vocab_size for i in range(21)]
    monkeypatch.setattr(quant_gemm, "use_triton", lambda t: False)       # the definitions (also on CUDA)
    want = full_logits(model, ids)
    launches = []
    real = tri.fp8_gemm
    monkeypatch.setattr(tri, "fp8_gemm", lambda *a, **k: launches.append(1) or real(*a, **k))
    monkeypatch.setattr(quant_gemm, "use_triton", lambda t: True)
    got = full_logits(model, ids)
    assert len(launches) >= 2 * 5            # wq_a + wkv fused, wq_b, wo_a, wo_b (+ indexer wq_b) per layer
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
