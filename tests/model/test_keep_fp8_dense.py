"""`keep_fp8_dense` (EngineConfig / load_model): the FP8 attention and dense projections of a
released-format checkpoint stay float8_e4m3fn + fp32 block scales and run the FP8 GEMMs
(dsv4/ops/quant_gemm.py); the same logits (fp32, CPU: W8A16's definition multiplies by the
dequantised weight) and greedy tokens as the checkpoint dequantised at load; W8A8 within the
activation quantisation's error."""
import pytest
import torch
from kept_experts import released_checkpoint

from dsv4.engine.llm import LLM
from dsv4.engine.oneshot import full_logits
from dsv4.model.fp8_dense import fp8_dense_weights
from dsv4.model.weights import load_model
from dsv4.ops import quant_gemm
from dsv4.ops.quant import dequant_fp8
from dsv4.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return released_checkpoint(tmp_path_factory, 160, "fp4")


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint), load_model(checkpoint, keep_fp8_dense=True, keep_mxfp4=True)


def test_dense_weights_kept_fp8(checkpoint, models):
    plain, kept = models
    names = fp8_dense_weights(checkpoint, (128, 128))
    assert "layers.1.attn.indexer.wq_b.weight" in names and "mtp.0.e_proj.weight" in names
    assert not any("compressor" in n or "shared_experts" in n for n in names)
    for block, ref in zip(list(kept.layers) + list(kept.mtp), list(plain.layers) + list(plain.mtp)):
        for lin in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b"):
            k, p = getattr(block.attn, lin), getattr(ref.attn, lin)
            assert k.weight.dtype == torch.float8_e4m3fn and torch.equal(dequant_fp8(k.weight, k.scale), p.weight)
        assert block.attn.compressor is None or block.attn.compressor.wkv.weight.dtype == torch.float32


def test_same_logits(models):
    plain, kept = models
    ids = torch.randint(0, plain.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    want, got = full_logits(plain, ids), full_logits(kept, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_w8a8_logits_close(models, monkeypatch):
    plain, kept = models
    ids = list(range(5, 45))
    want = full_logits(plain, ids)
    monkeypatch.setattr(quant_gemm, "FP8_DENSE_GEMM", "w8a8")
    got = full_logits(kept, ids)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.3          # e4m3 activations (3 mantissa bits) through 2 random layers + MTP-free head


def test_same_greedy_tokens(checkpoint):
    """Invariant 5 through the engine: prefill and decode steps, two requests."""
    prompts = [torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for keep in (False, True):
        llm = LLM(checkpoint, max_num_seqs=2, num_pages=4, keep_fp8_dense=keep)
        assert (llm.engine.model.layers[1].attn.wq_b.weight.dtype == torch.float8_e4m3fn) == keep
        outs[keep] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                        use_tqdm=False)]
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])
