"""Sizing of a model without compressed layers (dsv4/cache/layout.py, `CacheLayout.plan`): its
history pages hold no bytes, so a byte budget cannot bound them; the plan gives as many as
`max_num_seqs` requests at the model's longest context use (the allocator's host bookkeeping is
per page: a 4 GiB budget once meant 4.3e9 pages and a host killed for memory)."""
from __future__ import annotations

import json

import torch

from dsv4.cache.layout import PAGE_TOKENS, CacheLayout
from dsv4.cache.sizing import cache_bytes, plan_cache
from dsv4.config import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.model.random_init import preset_config
from dsv4.sampling_params import SamplingParams

SWA_ONLY = dict(compress_ratios=[0, 0, 0], num_hidden_layers=2, num_hash_layers=1)


def test_pages_without_bytes_are_bounded_by_requests_not_bytes():
    cfg = preset_config("tiny", **SWA_ONLY)
    layout = CacheLayout(cfg)
    assert layout.page_bytes(4) == 0
    for gb, seqs in [(4.0, 4), (64.0, 2), (0.05, 8)]:
        for caching in (False, True):
            plan = plan_cache(layout, EngineConfig(cache_memory_gb=gb, max_num_seqs=seqs,
                                                   enable_prefix_caching=caching), torch.float32)
            assert plan.num_pages == seqs * -(-cfg.max_position_embeddings // PAGE_TOKENS)
            assert cache_bytes(layout, plan, torch.float32) <= gb * 2**30


def test_pages_with_bytes_still_follow_the_budget():
    layout = CacheLayout(preset_config("tiny"))
    small = plan_cache(layout, EngineConfig(cache_memory_gb=0.05, max_num_seqs=2), torch.float32)
    large = plan_cache(layout, EngineConfig(cache_memory_gb=0.5, max_num_seqs=2), torch.float32)
    assert large.num_pages > 9 * small.num_pages
    assert small.num_pages > 2 * -(-layout.cfg.max_position_embeddings // PAGE_TOKENS)   # not the SWA-only bound


def test_swa_only_engine_generates_the_same_tokens_at_any_budget():
    """Any budget builds at once (benchmarks/vision.py gives its 2-layer slice 4 GiB) and the
    engine's greedy tokens equal a plain run's with a small budget (invariant 5)."""
    overrides = json.dumps(SWA_ONLY)
    out = []
    for gb in (0.05, 0.005):
        eng = LLMEngine("random:tiny", EngineConfig(device="cpu", dtype="float32", cache_memory_gb=gb, max_num_seqs=2,
                                                    hf_overrides=overrides))
        assert eng.plan.num_pages <= 2 * -(-eng.cfg.max_position_embeddings // PAGE_TOKENS)
        eng.add_request("r", list(range(3, 300)), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        tokens = []
        while eng.has_unfinished():
            for o in eng.step():
                tokens += o.new_token_ids
        out.append(tokens)
    assert out[0] == out[1] and len(out[0]) == 6
