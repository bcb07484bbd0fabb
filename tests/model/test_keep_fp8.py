"""`keep_fp8` (EngineConfig / load_model): a checkpoint with FP8 routed and shared experts (as
V4-Flash-Base) keeps them float8_e4m3fn + fp32 block scales on the device, dequantised in the
MoE ops; everything else as without it. Same logits (fp32, CPU: the reference dequantises the
experts it uses on the fly) and greedy tokens as the same checkpoint dequantised at load."""
import pytest
import torch
from kept_experts import assert_same_greedy_tokens, assert_same_logits, released_checkpoint

from dsv4.engine.oneshot import full_logits
from dsv4.ops.quant import dequant_fp8
from dsv4.model.weights import fp8_experts, load_model

I = 160   # moe_intermediate_size: two scale blocks, the second partial


@pytest.fixture(scope="module")
def fp8_expert_checkpoint(tmp_path_factory):
    return released_checkpoint(tmp_path_factory, I, "fp8")


@pytest.fixture(scope="module")
def models(fp8_expert_checkpoint):
    return load_model(fp8_expert_checkpoint), load_model(fp8_expert_checkpoint, keep_fp8=True)


def test_weights_kept_fp8(fp8_expert_checkpoint, models):
    plain, kept = models
    assert fp8_experts(fp8_expert_checkpoint, (128, 128)) == (True, True)
    assert fp8_experts(fp8_expert_checkpoint, (64, 64)) == (False, False)
    H, E = plain.cfg.hidden_size, plain.cfg.n_routed_experts
    blocks = list(kept.layers) + list(kept.mtp)
    assert len(kept.mtp) == 1
    for block, ref in zip(blocks, list(plain.layers) + list(plain.mtp)):
        e, s, re_, rs = block.ffn.experts, block.ffn.shared_experts, ref.ffn.experts, ref.ffn.shared_experts
        assert e.w1.dtype == e.w2.dtype == e.w3.dtype == s.w1.weight.dtype == torch.float8_e4m3fn
        assert e.w1_scale.shape == e.w3_scale.shape == (E, 2, 1) and e.w2_scale.shape == (E, 1, 2)
        assert s.w1.scale.shape == (2, 1) and s.w2.scale.shape == (1, 2) and e.w1_scale.dtype == torch.float32
        for j in range(E):     # the plain model holds exactly the dequantised values
            assert torch.equal(dequant_fp8(e.w2[j], e.w2_scale[j]), re_.w2[j])
        assert torch.equal(dequant_fp8(s.w3.weight, s.w3.scale), rs.w3.weight)
        assert block.attn.wq_a.weight.dtype == torch.float32                   # dequantised at load
        assert torch.equal(block.attn.wq_a.weight, ref.attn.wq_a.weight)
    assert plain.layers[0].ffn.experts.scales() is None and plain.layers[0].ffn.experts.w1.shape == (E, I, H)


def test_same_logits(models):
    assert_same_logits(*models)


def test_same_greedy_tokens(fp8_expert_checkpoint):
    assert_same_greedy_tokens(fp8_expert_checkpoint, "keep_fp8", torch.float8_e4m3fn)


def test_random_spec_keep_fp8():
    """`random:` specs with keep_fp8 (GPU benchmarks): the same draws as without it, experts
    quantised to FP8; the same logits as the plain random model holding the dequantised values."""
    spec = f"random:tiny:2:moe_intermediate_size={I}"
    plain, kept = load_model(spec), load_model(spec, keep_fp8=True)
    for block, ref in zip(kept.layers, plain.layers):
        e, s, re_, rs = block.ffn.experts, block.ffn.shared_experts, ref.ffn.experts, ref.ffn.shared_experts
        assert e.w1.dtype == s.w2.weight.dtype == torch.float8_e4m3fn
        for w, sc, want in ((e.w1, e.w1_scale, re_.w1), (e.w2, e.w2_scale, re_.w2)):
            got = torch.stack([dequant_fp8(w[j], sc[j]) for j in range(w.shape[0])])
            assert (got - want).abs().max() <= 2 ** -3 * want.abs().max()            # e4m3: 3 mantissa bits
        assert torch.equal(block.ffn.gate.weight, ref.ffn.gate.weight)          # other draws unchanged
        assert torch.equal(block.attn.wq_a.weight, ref.attn.wq_a.weight)
        for lin, rlin in zip((s.w1, s.w2, s.w3), (rs.w1, rs.w2, rs.w3)):
            rlin.weight.copy_(dequant_fp8(lin.weight, lin.scale))
        for name in ("w1", "w2", "w3"):
            w, sc = getattr(e, name), getattr(e, f"{name}_scale")
            getattr(re_, name).copy_(torch.stack([dequant_fp8(w[j], sc[j]) for j in range(w.shape[0])]))
    ids = list(range(3, 40))
    want, got = full_logits(plain, ids), full_logits(kept, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
