"""How big the cache is: the plan from the engine's flags and the device's free memory, and the
report the engine logs at start (docs/architecture.md, "Cache")."""
from __future__ import annotations

import math

import torch

from ..config import EngineConfig
from .checkpoint import CheckpointFormat
from .layout import PAGE_TOKENS, CacheLayout, CachePlan, default_checkpoints, dtype_bytes
from .storage import storage_dtype, storage_shapes

# storage kinds (cache/storage.py) -> the component a report names
COMPONENTS = {"swa": "sliding-window pages", "c4": "C4 entries (CSA)", "idx": "indexer keys (CSA)",
              "c128": "C128 entries (HCA)", "ring_kv": "CSA compressor rings", "ring_gate": "CSA compressor rings",
              "iring_kv": "CSA indexer rings", "iring_gate": "CSA indexer rings",
              "hring_kv": "HCA compressor rings", "hring_gate": "HCA compressor rings"}


def prefix_caching(config: EngineConfig) -> bool:
    """Whether the engine keeps a prefix cache (with either KV dtype: cache/checkpoint.py). Under
    data-parallel attention every rank keeps its own (engine/data_parallel.py)."""
    return config.enable_prefix_caching


def reserves_workspace(config: EngineConfig) -> bool:
    """Whether the cache is sized from the device's free memory, with the step's workspace
    (engine/workspace.py) left out of it; else --num-pages or --cache-memory-gb (or the CPU's
    1 GiB) give the cache's own size and the workspace comes beside it."""
    return config.num_pages is None and config.cache_memory_gb is None and str(config.device).startswith("cuda")


def cache_budget(config: EngineConfig, workspace_bytes: int) -> int:
    """The cache's bytes without --num-pages: --cache-memory-gb, else 90% of the device's free
    memory less `workspace_bytes` (reserves_workspace), 1 GiB on the CPU."""
    if config.cache_memory_gb is not None:
        return int(config.cache_memory_gb * 2**30)
    if reserves_workspace(config):
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        return int(free * 0.9) - workspace_bytes
    return 2**30


def plan_cache(layout: CacheLayout, config: EngineConfig, dtype: torch.dtype, workspace_bytes: int = 0) -> CachePlan:
    """`num_pages` when given; else split `cache_budget` (workspace_bytes: the step's workspace,
    left out of free memory) between rings, SWA pages, prefix-cache checkpoints (with prefix
    caching; `num_checkpoints` or `layout.default_checkpoints`) and history pages."""
    c = config
    ckpt = CheckpointFormat(layout, dtype).nbytes() if prefix_caching(c) else 0
    if c.num_pages is not None:
        swa = layout.swa_pages_needed(c.max_num_seqs, c.max_num_batched_tokens)
        checkpoints = 0 if not ckpt else (c.num_checkpoints if c.num_checkpoints is not None
                                          else default_checkpoints(c.num_pages, c.max_num_seqs))
        return CachePlan(num_pages=c.num_pages, num_swa_pages=swa, max_num_seqs=c.max_num_seqs,
                         num_checkpoints=checkpoints)
    return layout.plan(cache_budget(c, workspace_bytes), dtype_bytes(dtype), c.max_num_seqs, c.max_num_batched_tokens,
                       ckpt, c.num_checkpoints)


def cache_components(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each component of the storage KVStorage allocates for `plan` (scratch units
    included): exactly the sum of its tensors' bytes."""
    out: dict[str, int] = {}
    for kind, shape in storage_shapes(layout, plan).items():
        nbytes = math.prod(shape) * dtype_bytes(storage_dtype(layout, kind, dtype))
        out[COMPONENTS[kind]] = out.get(COMPONENTS[kind], 0) + nbytes
    if plan.num_checkpoints:
        out["prefix-cache checkpoints"] = plan.num_checkpoints * CheckpointFormat(layout, dtype).nbytes()
    return out


def cache_bytes(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype) -> int:
    return sum(cache_components(layout, plan, dtype).values())


def requests_that_fit(plan: CachePlan, tokens: int) -> int:
    """Requests of `tokens` tokens the cache holds at once (pages and state slots both bound it)."""
    return min(plan.num_pages // max(-(-tokens // PAGE_TOKENS), 1), plan.max_num_seqs)


def per_rank_report(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype, tensor_parallel_size: int,
                    data_parallel_size: int = 1) -> str:
    """What each rank of a parallel run holds of the cache. Tensor parallel: all of it (V4 has
    one shared K=V head, and the compressors' and indexer's keys are per token, not per head,
    so splitting heads splits no cache). Data-parallel attention: each rank the plan's whole
    storage too, but for its own requests (no replicated KV): N ranks hold N times the tokens."""
    total = cache_bytes(layout, plan, dtype)
    if data_parallel_size > 1:
        n = data_parallel_size
        return (f"per rank: {total / 2**20:.1f} MiB of KV cache on each of {n} data-parallel ranks, each for its own "
                f"requests ({n * total / 2**20:.1f} MiB in all; {plan.max_tokens} tokens and {plan.max_num_seqs} "
                f"request slots per rank, {n * plan.max_tokens} tokens in all)")
    return (f"per rank: {total / 2**20:.1f} MiB of KV cache on each of {tensor_parallel_size} tensor-parallel "
            f"ranks ({tensor_parallel_size * total / 2**20:.1f} MiB in all; one shared K=V head: every rank holds "
            f"the whole cache)")


def memory_report(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype, max_model_len: int,
                  tensor_parallel_size: int = 1, data_parallel_size: int = 1) -> str:
    fit = requests_that_fit(plan, max_model_len)
    parts = cache_components(layout, plan, dtype)
    detail = ", ".join(f"{name} {nbytes / 2**20:.1f}" for name, nbytes in parts.items())
    kv = "packed FP8" if layout.kv_fp8 else str(dtype).removeprefix("torch.")
    ranks = tensor_parallel_size * data_parallel_size
    return (f"KV cache ({kv}): {plan.num_pages} history pages x {PAGE_TOKENS} tokens = {plan.max_tokens} tokens, "
            f"{plan.num_swa_pages} sliding-window pages, {plan.max_num_seqs} request slots, "
            f"{plan.num_checkpoints} prefix-cache checkpoints, {sum(parts.values()) / 2**20:.1f} MiB ({detail} MiB); {fit} request(s) of "
            f"max_model_len {max_model_len} fit at once"
            + ("" if data_parallel_size == 1 else " on each rank")
            + ("" if ranks == 1 else "; " + per_rank_report(layout, plan, dtype, tensor_parallel_size,
                                                              data_parallel_size)))
