"""The memory plan as text: weights by kind, the KV cache by component (the bytes KVStorage
allocates), what fits, and with FP8 KV the gain over model-dtype KV in the same budget.
`dsv4 plan` prints it before loading anything (weights estimated from the config); the engine
logs it at start with the weights it loaded (`dsv4 serve` prints it when ready)."""
from __future__ import annotations

import dataclasses
import re

import torch

from .checkpoint import CheckpointFormat
from .layout import PAGE_TOKENS, CacheLayout, CachePlan
from .sizing import cache_bytes, cache_components, requests_that_fit

GIB = 2**30

# parameter names (released names, docs/architecture.md "Weights") -> the kind a report names
WEIGHT_KINDS = (("compressors and indexers", r"attn\.(compressor|indexer)\."), ("mHC", r"(^|\.)hc_"),
                ("routers", r"ffn\.gate\."), ("shared experts", r"ffn\.shared_experts\."),
                ("routed experts", r"ffn\.experts\."), ("embedding and head", r"^(embed|head)\."),
                ("attention projections", r"attn\."))


def loaded_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of a loaded model's parameters and buffers by kind (norms and tables: "other")."""
    out: dict[str, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        kind = next((k for k, pattern in WEIGHT_KINDS if re.search(pattern, name)), "other")
        out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
    return out


def plan_report(weights: dict[str, int], layout: CacheLayout, plan: CachePlan, dtype: torch.dtype,
                request_tokens: int, model_dtype_plan: CachePlan | None = None,
                workspace: dict[str, int] | None = None, reserved: bool = False) -> str:
    """The report's lines. model_dtype_plan: the plan the same budget gives with model-dtype KV
    (with FP8 KV), for the capacity gain line. workspace: engine/workspace.py's components;
    reserved: whether they were left out of free memory before the cache was sized
    (sizing.reserves_workspace), else they come beside the cache."""
    lines = _section("weights", weights)
    kv = "packed FP8" if layout.kv_fp8 else str(dtype).removeprefix("torch.")
    lines += _section(f"KV cache, {kv} (as allocated, scratch units included)",
                      cache_components(layout, plan, dtype))
    if workspace:
        how = ("left out of free memory before the cache was sized" if reserved
               else "beside the cache: its size was given")
        lines += _section(f"workspace ({how})", workspace)
    fit = requests_that_fit(plan, request_tokens)
    bound = "request slots" if fit == plan.max_num_seqs else "history pages"
    lines.append(f"fits: {plan.max_tokens} tokens of history ({plan.num_pages} pages of {PAGE_TOKENS}); "
                 f"{fit} request(s) of {request_tokens} tokens at once (bounded by {bound})")
    if model_dtype_plan is not None:
        plain = dataclasses.replace(layout, kv_fp8=False)
        lines.append(f"FP8 KV: {plan.max_tokens / max(model_dtype_plan.max_tokens, 1):.2f}x the tokens of "
                     f"{str(dtype).removeprefix('torch.')} KV in the same budget ({model_dtype_plan.max_tokens} "
                     f"tokens, {cache_bytes(plain, model_dtype_plan, dtype) / 2**20:.1f} MiB); a history page "
                     f"{layout.page_bytes(1)} bytes instead of {plain.page_bytes(torch.empty((), dtype=dtype).element_size())}")
    return "\n".join(lines)


def model_dtype_plan(layout: CacheLayout, plan: CachePlan, dtype: torch.dtype,
                     max_num_batched_tokens: int) -> CachePlan | None:
    """With FP8 KV: the plan model-dtype KV gets from the bytes `plan` takes, with prefix-cache
    checkpoints (of the model-dtype format, as many as its plan gives) when `plan` has them (None
    without FP8 KV or when that budget holds no page)."""
    if not layout.kv_fp8:
        return None
    plain = dataclasses.replace(layout, kv_fp8=False)
    ckpt = CheckpointFormat(plain, dtype).nbytes() if plan.num_checkpoints else 0
    try:
        return plain.plan(cache_bytes(layout, plan, dtype), torch.empty((), dtype=dtype).element_size(),
                          plan.max_num_seqs, max_num_batched_tokens, checkpoint_bytes=ckpt)
    except ValueError:
        return None


def _section(title: str, parts: dict[str, int]) -> list[str]:
    width = max(len(k) for k in parts) + 2
    unit, scale = ("GiB", GIB) if sum(parts.values()) >= GIB else ("MiB", 2**20)
    lines = [f"{title}:"]
    lines += [f"  {name:<{width}} {nbytes / scale:10.3f} {unit}" for name, nbytes in parts.items()]
    lines.append(f"  {'total':<{width}} {sum(parts.values()) / scale:10.3f} {unit}")
    return lines
