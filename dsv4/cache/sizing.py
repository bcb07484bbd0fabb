"""How big the cache is: the plan from the engine's flags and the device's free memory, and the
report the engine logs at start (docs/architecture.md, "Cache")."""
from __future__ import annotations

import torch

from ..config import EngineConfig
from .checkpoint import CheckpointFormat
from .layout import PAGE_TOKENS, CacheLayout, CachePlan, default_checkpoints, dtype_bytes


def plan_cache(layout: CacheLayout, config: EngineConfig, dtype: torch.dtype) -> CachePlan:
    """`num_pages` when given; else split `cache_memory_gb` (or 90% of the device's free memory,
    1 GiB on the CPU) between rings, SWA pages, prefix-cache checkpoints (with prefix caching;
    `num_checkpoints` or `layout.default_checkpoints`) and history pages."""
    c = config
    ckpt = CheckpointFormat(layout, dtype).nbytes() if c.enable_prefix_caching else 0
    if c.num_pages is not None:
        swa = layout.swa_pages_needed(c.max_num_seqs, c.max_num_batched_tokens)
        checkpoints = 0 if not ckpt else (c.num_checkpoints if c.num_checkpoints is not None
                                          else default_checkpoints(c.num_pages, c.max_num_seqs))
        return CachePlan(num_pages=c.num_pages, num_swa_pages=swa, max_num_seqs=c.max_num_seqs,
                         num_checkpoints=checkpoints)
    if c.cache_memory_gb is not None:
        budget = int(c.cache_memory_gb * 2**30)
    elif str(c.device).startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(c.device))
        budget = int(free * 0.9)
    else:
        budget = 2**30
    return layout.plan(budget, dtype_bytes(dtype), c.max_num_seqs, c.max_num_batched_tokens, ckpt, c.num_checkpoints)


def cache_bytes(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype) -> int:
    elem = dtype_bytes(dtype)
    checkpoints = plan.num_checkpoints * CheckpointFormat(layout, dtype).nbytes() if plan.num_checkpoints else 0
    return (plan.num_pages * layout.page_bytes(elem) + plan.num_swa_pages * layout.swa_page_bytes(elem)
            + plan.max_num_seqs * layout.ring_bytes(elem) + checkpoints)


def memory_report(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype, max_model_len: int) -> str:
    per_request = -(-max_model_len // PAGE_TOKENS)
    fit = min(plan.num_pages // max(per_request, 1), plan.max_num_seqs)   # pages and state slots both bound it
    return (f"KV cache: {plan.num_pages} history pages x {PAGE_TOKENS} tokens = {plan.max_tokens} tokens, "
            f"{plan.num_swa_pages} sliding-window pages, {plan.max_num_seqs} request slots, "
            f"{plan.num_checkpoints} prefix-cache checkpoints, {cache_bytes(layout, plan, dtype) / 2**20:.1f} MiB; {fit} request(s) of "
            f"max_model_len {max_model_len} fit at once")
