"""Oracle: dsv4's full-sequence logits against transformers' DeepseekV4ForCausalLM in fp32
on CPU, for random tiny configs that differ in window, ratios, index_topk, hc_mult, experts
and top-k, with sequences long enough that the indexer's top-k discards entries and that
several 128-token HCA groups close (docs/architecture.md, "Model")."""
from __future__ import annotations

import pytest
import torch

import dsv4.model.compressor as compressor_module
from dsv4.ops.paged import dense_index

TOLERANCE = 1e-4  # max |Δlogit| relative to max |reference logit|, fp32 (docs/architecture.md, "Model")

# name -> (config overrides, sequence length). compress_ratios end with the MTP entry.
# index_n_heads >= 8 (16 where 8 gave zero-score ties at the top-k boundary with this seed).
CONFIGS = {
    "csa-hca-w32-hc4-e8k2": (dict(compress_ratios=[0, 4, 128, 4, 0], sliding_window=32, index_topk=16,
                                  index_n_heads=16, hc_mult=4, n_routed_experts=8, num_experts_per_tok=2,
                                  num_hash_layers=1), 640),
    "w64-hc2-e16k4-topk8": (dict(compress_ratios=[4, 128, 4, 0, 128, 0], sliding_window=64, index_topk=8,
                                 index_n_heads=12, hc_mult=2, n_routed_experts=16, num_experts_per_tok=4,
                                 num_hash_layers=2), 560),
    "w16-hc3-e4k1-nohash": (dict(compress_ratios=[128, 4, 128, 0, 0], sliding_window=16, index_topk=12,
                                 index_n_heads=16, hc_mult=3, n_routed_experts=4, num_experts_per_tok=1,
                                 num_hash_layers=0, index_head_dim=48), 700),
}


class IndexerProbe:
    """Wraps the indexer's top-k to measure, per call, how many queries have more causal
    entries than k (so the top-k really discards some) and the score gap between the k-th
    and (k+1)-th entries (0 = a tie that top-k breaks arbitrarily)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, q, weights, keys, paged, topk, weight_scale=1.0):
        cand = dense_index(paged)
        gathered = keys[cand.clamp(min=0)].float()
        w = weights.float() * weight_scale
        scores = (torch.relu(torch.einsum("thd,ted->the", q.float(), gathered)) * w[..., None]).sum(1)
        scores = scores.masked_fill(cand < 0, float("-inf"))
        discards = (cand >= 0).sum(1) > topk
        top = scores[discards].topk(topk + 1, dim=-1).values
        gap = top[:, topk - 1] - top[:, topk]
        self.calls.append((float(discards.float().mean()), float(gap.min()) if gap.numel() else float("inf")))
        return self.inner(q, weights, keys, paged, topk, weight_scale)


def layers_for(overrides):
    return len(overrides["compress_ratios"]) - 1


def assert_preconditions(cfg, length):
    """The test must not silently become weak: top-k discards, several HCA groups close."""
    ratios = cfg.compress_ratios
    assert 4 in ratios and 128 in ratios
    assert cfg.index_n_heads >= 8
    assert length // 4 >= 4 * cfg.index_topk, "compressed length must be several times index_topk"
    assert length // 128 >= 3, "several HCA groups must close"
    assert length > 4 * cfg.sliding_window, "the sliding window must drop keys"


def assert_matches(got, want):
    scale = float(want.abs().max())
    diff = float((got - want).abs().max())
    assert got.shape == want.shape
    assert diff <= TOLERANCE * scale, f"max |Δlogit| {diff:.3e} > {TOLERANCE} x {scale:.3f}"


CASES = [(name, None) for name in sorted(CONFIGS)] + [("csa-hca-w32-hc4-e8k2", "fp8")]


@pytest.mark.parametrize("name,quant", CASES)
def test_full_sequence_logits_match_transformers(name, quant, tiny_checkpoint, our_logits, reference_logits,
                                                 ids_for, monkeypatch):
    """quant="fp8" is `init-random --quant fp8`: FP8 block-scaled weights and MXFP4 experts."""
    overrides, length = CONFIGS[name]
    ckpt = tiny_checkpoint(layers_for(overrides), seed=1, quant=quant, **overrides)
    assert_preconditions(ckpt.cfg, length)
    ids = ids_for(ckpt.cfg, length)

    probe = IndexerProbe(compressor_module.indexer_topk)
    monkeypatch.setattr(compressor_module, "indexer_topk", probe)
    got = our_logits(ckpt.path, ids)
    monkeypatch.undo()

    assert len(probe.calls) == list(ckpt.cfg.compress_ratios).count(4)
    for discard_share, gap in probe.calls:
        assert discard_share > 0.8, "most queries must have more causal C4 entries than index_topk"
        assert gap > 0, "tied indexer scores at the top-k boundary: the oracle would be ill-posed"
    assert_matches(got, reference_logits(ckpt.path, ids))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_indexer_selection_changes_logits(name, tiny_checkpoint, ids_for):
    """Keeping every compressed entry instead of the top-k must move the logits far beyond
    the tolerance, so the oracle comparison above really exercises the selection."""
    from dsv4.engine.oneshot import full_logits
    from dsv4.model.weights import load_model

    overrides, length = CONFIGS[name]
    ckpt = tiny_checkpoint(layers_for(overrides), seed=1, **overrides)
    model = load_model(ckpt.path)
    ids = ids_for(ckpt.cfg, length)
    top_k = full_logits(model, ids)
    for block in model.layers:
        if block.attn.indexer is not None:
            block.attn.indexer.topk = 10 ** 6
    keep_all = full_logits(model, ids)
    assert float((top_k - keep_all).abs().max()) > 100 * TOLERANCE * float(top_k.abs().max())


def test_fp8_checkpoint_differs_from_unquantised(tiny_checkpoint, our_logits, ids_for):
    """The FP8 oracle case above is not the fp32 case in disguise."""
    overrides, _ = CONFIGS["csa-hca-w32-hc4-e8k2"]
    fp8 = tiny_checkpoint(layers_for(overrides), seed=1, quant="fp8", **overrides)
    fp32 = tiny_checkpoint(layers_for(overrides), seed=1, **overrides)
    ids = ids_for(fp8.cfg, 64)
    assert float((our_logits(fp8.path, ids) - our_logits(fp32.path, ids)).abs().max()) > 1e-3
