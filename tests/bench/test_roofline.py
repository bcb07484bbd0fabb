"""Roofline model: hand-computed tiny example, released-model parameter counts, the
expert-touch formula, closed-form context sums, and monotonicity of step costs."""
import random

import pytest

from dsv4.config import ModelConfig
from dsv4.bench.context_sums import sum_entries, sum_selected, sum_window
from dsv4.bench.params import model_params
from dsv4.bench.roofline import (BF16, H200, RELEASED_FP8_FP4, StepCost, bound_seconds, decode_step_cost,
                                expected_experts_touched, indexer_cost, prefill_cost, roofline)


def tiny() -> ModelConfig:
    """Small enough to count every element by hand (see the numbers in the tests)."""
    return ModelConfig.from_dict(dict(
        vocab_size=10, hidden_size=8, num_hidden_layers=3, num_attention_heads=2, head_dim=4,
        qk_rope_head_dim=2, q_lora_rank=4, o_groups=1, o_lora_rank=2, moe_intermediate_size=3,
        n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=2, index_topk=1,
        sliding_window=2, hc_mult=1, compress_ratios=[0, 4, 128]))


def flash() -> ModelConfig:
    """V4-Flash as released: 43 layers, [0, 0] + [4, 128] * 20 + [4], + one MTP entry 0."""
    return ModelConfig.from_dict(dict(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0]))


def pro() -> ModelConfig:
    """V4-Pro as released: 61 layers, [128, 128] + [4, 128] * 29 + [4], + MTP entry 0."""
    return ModelConfig.from_dict(dict(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        q_lora_rank=1536, o_groups=16, n_routed_experts=384, moe_intermediate_size=3072,
        index_topk=1024, compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0]))


# ---- exact tiny example ---------------------------------------------------------------
def test_tiny_parameter_inventory_by_hand():
    # attention: wq_a 8*4 + wq_b 4*8 + wkv 8*4 + wo_a 8*2 + wo_b 2*8 = 128
    # CSA compressor 2 * [8, 8] = 128, HCA 2 * [4, 8] = 64
    # indexer: wq_b 4*(2*2) = 16; weights_proj 8*2 + compressor 2 * [4, 8] = 80
    # mHC (N=1): 2 * (fn 3*8 + base 3 + scale 3) = 60; gate 4*8 = 32; expert 3*8*3 = 72
    layers = model_params(tiny()).layers
    assert [(p.attention, p.compressor, p.indexer_query, p.indexer_aux) for p in layers] == [
        (128, 0, 0, 0), (128, 128, 16, 80), (128, 64, 0, 0)]
    assert {(p.hyper_connections, p.gate, p.shared_expert, p.routed_expert) for p in layers} == {(60, 32, 72, 72)}
    assert [p.dense for p in layers] == [292, 516, 356]
    params = model_params(tiny())
    assert params.total == 80 + 80 + 10 + (292 + 516 + 356) + 3 * 4 * 72  # embed, head, hc_head
    assert params.active_per_token == 8 + (292 + 516 + 356) + 3 * 2 * 72 + 10 + 80


def test_tiny_decode_cost_by_hand():
    cost = decode_step_cost(tiny(), batch=1, context=8, precision=BF16)
    # weights: (embed row 8 + head 80) * 2 + hc_head 10 * 4 + dense layers 704 + 1152 + 832
    #          + 2 experts touched * 72 * 2 bytes * 3 layers
    assert cost.bytes_weights == 176 + 40 + 704 + 1152 + 832 + 864
    # history: SWA min(8, 2) keys * 4 * 2 B per layer; CSA + top-1 of 2 entries + 2 indexer keys * 2 * 2 B
    assert cost.bytes_history == 16 + (16 + 8 + 8) + 16
    # written: a key per layer, + 1/4 of (entry 8 B + indexer key 4 B), + 1/128 of an 8 B entry
    assert cost.bytes_written == 8 * 3 + 12 / 4 + 8 / 128
    # flops: 2 * (1164 dense + 3 * 2 * 72) + logits 2 * (10 + 80)
    #        + attention 4 * 2 heads * 4 * keys (2, 3, 2) + indexer 2 * 2 * 2 * 2 entries
    assert cost.flops == 2 * 1596 + 180 + 32 * 7 + 16


def test_tiny_prefill_cost_by_hand():
    cost = prefill_cost(tiny(), tokens=8, context_start=0, precision=BF16)
    experts = 4 * (1 - 0.5 ** 8)
    assert cost.bytes_weights == (64 + 80) * 2 + 40 + 2688 + 3 * experts * 72 * 2
    assert cost.bytes_history == 0
    assert cost.bytes_written == 3 * 8 * 4 * 2 + 2 * 12  # 8 keys per layer, CSA closes 2 groups
    # keys summed over contexts 1..8: SWA 1+2*7 = 15, CSA top-1 adds 5, indexer scores 6 entries
    assert cost.flops == 8 * 2 * 1596 + 180 + 32 * (15 + 20 + 15) + 2 * 2 * 2 * 6


def test_tiny_indexer_cost_by_hand():
    """The indexer's O(E) part of a chunk: its FLOPs are prefill_cost's indexer term; it reads
    the indexer keys that existed before the chunk (one CSA layer, 2-dim keys of 2 B)."""
    cost = indexer_cost(tiny(), tokens=8, context_start=0)
    assert (cost.bytes_weights, cost.bytes_history, cost.bytes_written) == (0, 0, 0)
    assert cost.flops == 2 * 2 * 2 * 6                         # 6 entries scored, as above
    later = indexer_cost(tiny(), tokens=8, context_start=100)
    assert later.bytes_history == 25 * 2 * 2                   # 100 // 4 keys
    assert later.flops == 2 * 2 * 2 * sum((c + 1) // 4 for c in range(100, 108))
    assert later.flops < prefill_cost(tiny(), 8, 100).flops


def test_roofline_takes_the_slower_of_memory_and_compute():
    cost = StepCost(bytes_weights=300, bytes_history=100, bytes_written=100, flops=1000)
    times = roofline(cost, bandwidth=100, peak_flops=1000)
    assert (times.time_memory, times.time_compute, times.seconds, times.limited_by) == (5, 1, 5, "memory")
    assert bound_seconds(cost, bandwidth=1e6, peak_flops=100) == 10
    assert roofline(cost, bandwidth=1e6, peak_flops=100).limited_by == "compute"


# ---- released models -----------------------------------------------------------------
@pytest.mark.parametrize("cfg, total, active", [(flash(), 284e9, 13e9), (pro(), 1.6e12, 49e9)])
def test_released_parameter_counts(cfg, total, active):
    params = model_params(cfg)
    assert abs(params.total / total - 1) < 0.03
    assert abs(params.active_per_token / active - 1) < 0.15


def test_flash_decode_of_one_token_reads_its_active_weights():
    cfg = flash()
    cost = decode_step_cost(cfg, batch=1, context=4096, precision=BF16)
    assert 0.99 < cost.bytes_weights / (2 * model_params(cfg).active_per_token) < 1.01
    assert 22e9 < cost.bytes_weights < 30e9  # ~13B active params in bf16
    assert roofline(cost, H200.hbm_bandwidth, H200.dense_flops).limited_by == "memory"
    released = decode_step_cost(cfg, batch=1, context=4096, precision=RELEASED_FP8_FP4)
    assert released.bytes_weights < 0.5 * cost.bytes_weights


def test_flash_large_prefill_is_compute_bound():
    assert roofline(prefill_cost(flash(), tokens=8192)).limited_by == "compute"


def test_decode_flops_and_weights_equal_a_one_token_prefill():
    cfg = flash()
    for context in (1, 100, 5000):
        decode, prefill = decode_step_cost(cfg, 1, context), prefill_cost(cfg, 1, context - 1)
        assert decode.flops == prefill.flops
        assert decode.bytes_weights == prefill.bytes_weights


# ---- expert touch --------------------------------------------------------------------
def test_expert_touch_formula_limits():
    assert expected_experts_touched(256, 6, 0) == 0
    assert expected_experts_touched(256, 6, 1) == pytest.approx(6)
    assert expected_experts_touched(4, 2, 2) == pytest.approx(3)  # each expert missed w.p. 1/4
    assert expected_experts_touched(8, 8, 3) == 8
    assert expected_experts_touched(256, 6, 10_000) == pytest.approx(256)
    touched = [expected_experts_touched(256, 6, t) for t in range(0, 2000, 7)]
    assert touched == sorted(touched) and touched[-1] <= 256


def test_expert_touch_formula_matches_uniform_sampling():
    rng = random.Random(0)
    experts, top_k, tokens, trials = 32, 4, 10, 3000
    mean = sum(len({e for _ in range(tokens) for e in rng.sample(range(experts), top_k)})
               for _ in range(trials)) / trials
    assert mean == pytest.approx(expected_experts_touched(experts, top_k, tokens), rel=0.02)


# ---- context sums --------------------------------------------------------------------
@pytest.mark.parametrize("start", [0, 1, 3, 127, 128, 129, 600])
@pytest.mark.parametrize("n", [0, 1, 4, 5, 130, 1000])
def test_context_sums_match_loops(start, n):
    contexts = range(start + 1, start + n + 1)
    assert sum_window(start, n, 128) == sum(min(c, 128) for c in contexts)
    for ratio in (4, 128):
        assert sum_entries(start, n, ratio) == sum(c // ratio for c in contexts)
    for topk in (1, 3, 64):
        assert sum_selected(start, n, 4, topk) == sum(min(topk, c // 4) for c in contexts)


# ---- monotonicity --------------------------------------------------------------------
def _non_decreasing(costs):
    for a, b in zip(costs, costs[1:]):
        assert b.bytes_weights >= a.bytes_weights and b.bytes_history >= a.bytes_history
        assert b.bytes_written >= a.bytes_written and b.flops >= a.flops


def test_decode_cost_grows_with_batch_and_context():
    cfg = flash()
    _non_decreasing([decode_step_cost(cfg, b, 4096) for b in (0, 1, 2, 8, 64, 512)])
    _non_decreasing([decode_step_cost(cfg, 8, c) for c in (1, 3, 4, 127, 128, 129, 2048, 2052, 10**6)])
    per_token = [bound_seconds(decode_step_cost(cfg, b, 4096)) / b for b in (1, 8, 64, 512)]
    assert per_token == sorted(per_token, reverse=True)  # batching amortises the weights


def test_prefill_cost_grows_with_tokens_and_context_start():
    cfg = flash()
    _non_decreasing([prefill_cost(cfg, n, 0) for n in (0, 1, 4, 128, 1024, 8192)])
    _non_decreasing([prefill_cost(cfg, 512, s) for s in (0, 1, 4, 128, 4096, 65536)])


def test_negative_or_empty_shapes_are_rejected():
    with pytest.raises(ValueError, match="batch"):
        decode_step_cost(tiny(), -1, 8)
    with pytest.raises(ValueError, match="context"):
        decode_step_cost(tiny(), 1, 0)
    with pytest.raises(ValueError, match="context_start"):
        prefill_cost(tiny(), 8, -1)
