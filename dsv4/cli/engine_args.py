"""Engine flags for every command that runs the engine, generated from `EngineConfig`."""
from __future__ import annotations

import argparse
import dataclasses
import typing

from ..config import ConfigError, EngineConfig, default_batched_tokens

HELP = {
    "device": "cpu, cuda or cuda:N",
    "dtype": "weights and cache dtype (float32 or bfloat16)",
    "max_num_batched_tokens": "tokens per step across all sequences (default: 8192 serving and 16384 offline on a "
                              "GPU of >= 70 GiB other than an A100, 2048 and 8192 on other GPUs, 2048 on the CPU)",
    "max_num_seqs": "sequences per step",
    "max_prompt_logprobs_tokens": "prompt positions a step computes prompt logprobs for, all requests together (a "
                                  "request asking for them prefills in chunks of at most this): bounds the logits "
                                  "rows of a step, which the memory plan's workspace counts",
    "max_model_len": "prompt + output tokens of one request (default: model max or what the cache holds)",
    "num_pages": "256-token history pages in the KV cache (default: from the memory budget)",
    "cache_memory_gb": "KV cache budget in GiB (default: 1 on CPU, 90%% of free GPU memory)",
    "kv_cache_dtype": "auto (the model dtype) or fp8: DeepSeek's released packed rows (FP8 e4m3 with UE8M0 scales "
                      "per 64 channels + bf16 RoPE part, 584 bytes an entry; FP8 indexer keys with an fp32 scale), "
                      "quantised where written; turns the prefix cache off",
    "spec_slots": "speculative tokens the private cache state can roll back",
    "seed": "engine seed for unseeded sampling",
    "ops_backend": "auto (Triton kernels on CUDA) or reference (torch ops only)",
    "enforce_eager": "run decode steps eagerly (no CUDA graphs)",
    "cuda_graph_max_bs": "largest decode batch replayed as a CUDA graph",
    "async_scheduling": "on, off or auto (on for CUDA): launch the next step before reading this one's tokens",
    "keep_fp8": "keep FP8 (128x128 block-scaled) routed and shared expert weights FP8 on the device, dequantised "
                "inside the MoE kernels (W8A16); other weights and MXFP4 experts are dequantised at load",
    "keep_mxfp4": "keep MXFP4 routed expert weights (e2m1 pairs + an E8M0 scale per 32 inputs, the released V4 "
                  "format) packed on the device, dequantised inside the MoE kernels (W4A16); the shared expert and "
                  "other weights are dequantised at load",
    "keep_fp8_dense": "keep the FP8 (128x128 block-scaled) attention and dense projections (wq_a, wq_b, wkv, "
                      "wo_a, wo_b, the indexer's wq_b, MTP e_proj/h_proj) FP8 on the device, multiplied by FP8 GEMMs "
                      "(W8A16, or W8A8 with per-token-group FP8 activations: dsv4/ops/quant_gemm.py)",
    "index_topk_freq": "IndexCache: every N-th CSA layer computes the indexer top-k and the CSA layers after it reuse "
                       "it (1: every layer computes its own; overrides config.json's index_topk_freq / _pattern)",
    "index_topk_pattern": "IndexCache: one letter per CSA layer, F computes the indexer top-k, S reuses the last F "
                          "layer's; the first must be F (overrides config.json's index_topk_pattern / _freq)",
    "hf_overrides": "JSON object of config.json keys applied over the checkpoint's, e.g. "
                    "'{\"index_topk_freq\": 4}'",
    "enable_prefix_caching": "reuse the cached history of resent prompt prefixes (256-token pages resumed from "
                             "checkpoints); --no-enable-prefix-caching turns it off",
    "num_checkpoints": "prefix-cache checkpoints (the private state at a page boundary; default: one per 16 "
                       "history pages, at least two per request slot)",
    "host_cache_gb": "GiB of pinned host memory keeping prefix-cache pages and checkpoints offloaded from the GPU "
                     "(0: off)",
    "disk_cache_dir": "folder of the disk tier of the prefix cache, written from the host tier and kept across "
                      "restarts (needs --host-cache-gb)",
    "disk_cache_gb": "most GiB of files in --disk-cache-dir",
    "tokenizer": "tokenizer folder (default: the model folder; needed for a random:... model spec)",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' "
                          "(off by default; --spec-slots defaults to num_speculative_tokens)",
    "tensor_parallel_size": "ranks (GPUs) sharing every layer: attention heads, o-groups, the experts' width (or, "
                            "with --enable-expert-parallel, the experts) and the vocabulary split; each rank holds "
                            "the whole KV cache (one shared K=V head)",
    "data_parallel_size": "ranks running attention on their own requests with their own KV cache and prefix "
                          "tree, a new request to the rank holding the longest prefix of it (else the least "
                          "loaded); needs --enable-expert-parallel (routed experts split E/N); --max-num-seqs, "
                          "--max-num-batched-tokens and the cache budget are per rank; no CUDA graphs under DP yet",
    "grammar_worker": "where grammar masks (structured outputs) are filled: process (a worker process owning the "
                      "matchers, fed each step's tokens through a pipe, the masks through shared memory), threads "
                      "(in the engine process, on fill threads) or auto (process with 8 or more usable cores)",
    "enable_expert_parallel": "split the routed experts E/N over the ranks (each expert whole on one rank)",
}
# config.json keys that have a flag of their own (the rest of an override comes from --hf-overrides)
OVERRIDE_FLAGS = ("index_topk_freq", "index_topk_pattern")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind = hints[f.name]
        if kind is bool:
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument("--" + f.name.replace("_", "-"), action=action, default=f.default,
                               help=HELP.get(f.name))
            continue
        conv = int if kind in (int, int | None) else float if kind in (float, float | None) else str
        group.add_argument("--" + f.name.replace("_", "-"), type=conv, default=f.default, help=HELP.get(f.name))


def engine_config(args: argparse.Namespace, serving: bool = False) -> EngineConfig:
    """The flags' EngineConfig; `serving` picks the server's default step size (default_batched_tokens)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    try:
        if values["max_num_batched_tokens"] is None:
            values["max_num_batched_tokens"] = default_batched_tokens(values["device"], serving)
        config = EngineConfig(**values)
    except ConfigError as e:
        raise SystemExit(_flag(e.field) + f": {e}") from None
    check_model_overrides(config, getattr(args, "model", None))
    return config


def check_model_overrides(config: EngineConfig, model: str | None) -> None:
    """The model's config.json with the engine's overrides must parse: an override it rejects
    exits naming its flag (a checkpoint whose own config is invalid is left to the loader)."""
    from ..model.weights import model_config
    overrides = config.model_overrides()
    if not overrides:
        return
    if model is None:
        from ..assets import demo_model_dir
        model = demo_model_dir()
    try:
        model_config(model)
    except (ConfigError, OSError, ValueError):
        return
    try:
        model_config(model, overrides)
    except ConfigError as e:
        given = e.field in OVERRIDE_FLAGS and getattr(config, e.field) is not None
        raise SystemExit(_flag(e.field if given else "hf_overrides") + f": {e}") from None


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")
