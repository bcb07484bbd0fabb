"""`keep_mxfp4` (EngineConfig / load_model): a checkpoint with MXFP4 routed experts (the released
V4 format) keeps them packed on the device (uint8 e2m1 pairs + uint8 E8M0 exponent bytes),
dequantised in the MoE ops; the FP8 shared expert and everything else dequantised at load as
without it. Same logits (fp32, CPU: the reference dequantises the experts it uses on the fly)
and greedy tokens as the same checkpoint dequantised at load; a scale that does not fit its
weight raises a CheckpointError naming the tensor."""
import re

import pytest
import torch
from kept_experts import assert_same_greedy_tokens, assert_same_logits, released_checkpoint
from safetensors.torch import load_file, save_file

from dsv4.engine.oneshot import full_logits
from dsv4.ops.quant import dequant_fp4
from dsv4.model.weights import CheckpointError, fp8_experts, load_model, mxfp4_experts

I = 96   # moe_intermediate_size: 3 scale groups of 32 (partial kernel tiles of 64)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    return released_checkpoint(tmp_path_factory, I, "fp4")


@pytest.fixture(scope="module")
def models(mxfp4_checkpoint):
    return load_model(mxfp4_checkpoint), load_model(mxfp4_checkpoint, keep_mxfp4=True)


def test_weights_kept_mxfp4(mxfp4_checkpoint, models):
    plain, kept = models
    assert mxfp4_experts(mxfp4_checkpoint) and fp8_experts(mxfp4_checkpoint, (128, 128)) == (False, False)
    H, E = plain.cfg.hidden_size, plain.cfg.n_routed_experts
    assert len(kept.mtp) == 1
    for block, ref in zip(list(kept.layers) + list(kept.mtp), list(plain.layers) + list(plain.mtp)):
        e, s, re_ = block.ffn.experts, block.ffn.shared_experts, ref.ffn.experts
        assert all(t.dtype == torch.uint8 for t in (e.w1, e.w2, e.w3, *e.scales()))
        assert e.w1.shape == e.w3.shape == (E, I, H // 2) and e.w2.shape == (E, H, I // 2)
        assert e.w1_scale.shape == e.w3_scale.shape == (E, I, H // 32) and e.w2_scale.shape == (E, H, I // 32)
        for name in ("w1", "w2", "w3"):      # the plain model holds exactly the dequantised values
            assert torch.equal(dequant_fp4(getattr(e, name), getattr(e, f"{name}_scale")), getattr(re_, name))
        assert s.scales() is None and s.w1.weight.dtype == torch.float32                 # dequantised at load
        assert torch.equal(s.w2.weight, ref.ffn.shared_experts.w2.weight)
        assert torch.equal(block.attn.wq_a.weight, ref.attn.wq_a.weight)
    assert plain.layers[0].ffn.experts.scales() is None and plain.layers[0].ffn.experts.w1.shape == (E, I, H)


def test_same_logits(models):
    assert_same_logits(*models)


def test_same_greedy_tokens(mxfp4_checkpoint):
    assert_same_greedy_tokens(mxfp4_checkpoint, "keep_mxfp4", torch.uint8)


SCALE = "layers.0.ffn.experts.1.w3.scale"


@pytest.mark.parametrize("edit,message", [
    (lambda s: s[:, :1], "layers.0.ffn.experts.1.w3.weight: MXFP4 scale shape (96, 1) does not fit packed weight"),
    (lambda s: s.float(), "layers.0.ffn.experts.1.w3.weight: MXFP4 scale dtype torch.float32, expected E8M0")])
def test_bad_scale_is_named(mxfp4_checkpoint, tmp_path, edit, message):
    file = f"{mxfp4_checkpoint}/model.safetensors"
    tensors = load_file(file)
    tensors[SCALE] = edit(tensors[SCALE]).contiguous()
    (tmp_path / "config.json").write_text(open(f"{mxfp4_checkpoint}/config.json").read())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_model(str(tmp_path), keep_mxfp4=True)


def test_random_spec_keep_mxfp4():
    """`random:` specs with keep_mxfp4 (GPU benchmarks): the same draws as without it, routed
    experts quantised to MXFP4, the shared expert unquantised (also with keep_fp8, as loading the
    released format gives); the same logits as the plain random model holding the dequantised values."""
    spec = f"random:tiny:2:moe_intermediate_size={I}"
    plain, kept = load_model(spec), load_model(spec, keep_fp8=True, keep_mxfp4=True)
    for block, ref in zip(kept.layers, plain.layers):
        e, re_ = block.ffn.experts, ref.ffn.experts
        assert e.w1.dtype == e.w1_scale.dtype == torch.uint8 and e.w2.shape == re_.w2.shape[:-1] + (I // 2,)
        for name in ("w1", "w2", "w3"):
            got, want = dequant_fp4(getattr(e, name), getattr(e, f"{name}_scale")), getattr(re_, name)
            assert (got - want).abs().max() <= want.abs().max() / 3          # e2m1: steps up to 1/3 of a block's max
            getattr(re_, name).copy_(got)
        assert block.ffn.shared_experts.scales() is None                     # other draws unchanged
        assert torch.equal(block.ffn.shared_experts.w1.weight, ref.ffn.shared_experts.w1.weight)
        assert torch.equal(block.ffn.gate.weight, ref.ffn.gate.weight)
    ids = list(range(3, 40))
    want, got = full_logits(plain, ids), full_logits(kept, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_flag_of_another_format_warns(mxfp4_checkpoint, caplog):
    """keep_fp8 on MXFP4 experts: nothing is kept (the experts load dequantised, as without it),
    and the log says so, naming the flag."""
    with caplog.at_level("WARNING", logger="dsv4.model"):
        model = load_model(mxfp4_checkpoint, keep_fp8=True)
    assert model.layers[0].ffn.experts.scales() is None and model.layers[0].ffn.experts.w1.dtype == torch.float32
    assert any("keep_fp8" in r.getMessage() and "dequantised at load" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dsv4.model"):
        load_model(mxfp4_checkpoint, keep_mxfp4=True)
    assert not caplog.records
