"""Sizing with a prefix cache (dsv4/cache/layout.py, sizing.py): checkpoint slots come out of the
same budget as the pages, one per 16 history pages by default (at least two per request slot),
none without prefix caching; the storage allocates them."""
from __future__ import annotations

import torch

from dsv4.cache.checkpoint import CheckpointFormat
from dsv4.cache.layout import CacheLayout
from dsv4.cache.sizing import cache_bytes, memory_report, plan_cache
from dsv4.cache.storage import KVStorage
from dsv4.config import EngineConfig
from dsv4.model.random_init import preset_config

LAYOUT = CacheLayout(preset_config("tiny"))


def test_budget_is_split_with_checkpoints_and_respected():
    for gb, seqs in [(0.05, 2), (0.2, 8), (1.0, 4)]:
        on = plan_cache(LAYOUT, EngineConfig(cache_memory_gb=gb, max_num_seqs=seqs), torch.float32)
        off = plan_cache(LAYOUT, EngineConfig(cache_memory_gb=gb, max_num_seqs=seqs, enable_prefix_caching=False),
                         torch.float32)
        assert off.num_checkpoints == 0 and on.num_pages < off.num_pages
        assert abs(on.num_checkpoints - max(2 * seqs, on.num_pages // 16)) <= 1
        assert cache_bytes(LAYOUT, on, torch.float32) <= gb * 2**30
        assert cache_bytes(LAYOUT, off, torch.float32) <= gb * 2**30


def test_explicit_pages_and_checkpoints():
    plan = plan_cache(LAYOUT, EngineConfig(num_pages=64, max_num_seqs=2), torch.float32)
    assert plan.num_checkpoints == 4
    plan = plan_cache(LAYOUT, EngineConfig(num_pages=640, max_num_seqs=2), torch.float32)
    assert plan.num_checkpoints == 40
    plan = plan_cache(LAYOUT, EngineConfig(num_pages=64, max_num_seqs=2, num_checkpoints=7), torch.float32)
    assert plan.num_checkpoints == 7
    budget = plan_cache(LAYOUT, EngineConfig(cache_memory_gb=0.1, num_checkpoints=3), torch.float32)
    assert budget.num_checkpoints == 3


def test_storage_holds_the_checkpoints_and_the_report_names_them():
    plan = plan_cache(LAYOUT, EngineConfig(num_pages=32, max_num_seqs=2), torch.float32)
    st = KVStorage(LAYOUT, plan, torch.float32, "cpu")
    fmt = CheckpointFormat(LAYOUT, torch.float32)
    assert st.checkpoints.shape == (plan.num_checkpoints, fmt.numel)
    assert st.nbytes() >= cache_bytes(LAYOUT, plan, torch.float32)
    assert f"{plan.num_checkpoints} prefix-cache checkpoints" in memory_report(LAYOUT, plan, torch.float32, 4096)
