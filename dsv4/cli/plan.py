"""`dsv4 plan --model M [engine flags] [--request-tokens N]`: where the memory goes, before
loading anything — weights by kind, the KV cache by component (what KVStorage allocates), and
how many tokens and requests fit."""
from __future__ import annotations

import torch

from .args import positive_int
from .engine_args import add_engine_args, engine_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory plan: weights, KV cache components, what fits")
    p.add_argument("--model", required=True, help="checkpoint folder or random:PRESET[:LAYERS][:k=v,...]")
    p.add_argument("--request-tokens", type=positive_int, default=None,
                   help="length of the requests to count (default: max_model_len)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..cache.layout import CacheLayout
    from ..cache.report import model_dtype_plan, plan_report
    from ..cache.sizing import plan_cache, requests_that_fit, reserves_workspace
    from ..config import ConfigError
    from ..engine.context_limit import context_limit
    from ..engine.workspace import workspace_components
    config = engine_config(args, serving=True)
    cfg = _model_config(args.model)
    dtype = DTYPES[config.dtype]
    layout = CacheLayout(cfg, spec_slots=config.spec_slots, with_mtp=config.speculative_config is not None,
                         kv_fp8=config.kv_cache_dtype == "fp8")
    try:               # the same start-up checks as the engine's (a max_model_len no request could use)
        workspace = workspace_components(cfg, config, dtype)
        # sized from free memory: the engine measures it with the weights loaded, this with none
        loaded = sum(_device_weights(cfg, dtype, config).values()) if reserves_workspace(config) else 0
        plan = plan_cache(layout, config, dtype, sum(workspace.values()) + loaded)
        limit = context_limit(cfg, plan, config)
    except ConfigError as e:
        raise SystemExit(f"--{e.field.replace('_', '-')}: {e}") from None
    tokens = args.request_tokens or limit.tokens
    kinds = {0: "sliding", 4: "CSA", 128: "HCA"}
    mix = ", ".join(f"{cfg.compress_ratios.count(r)} {name}" for r, name in kinds.items() if r in cfg.compress_ratios)
    print(f"{args.model}: {cfg.num_hidden_layers} layers ({mix}), {config.dtype}")
    print(plan_report(_weights(cfg, dtype, config), layout, plan, dtype, tokens,
                      model_dtype_plan(layout, plan, dtype, config.max_num_batched_tokens),
                      workspace, reserves_workspace(config)))
    if config.tensor_parallel_size > 1:
        _per_rank(cfg, dtype, config, layout, plan)
    elif config.data_parallel_size > 1:
        _per_dp_rank(cfg, dtype, config, layout, plan)
    if requests_that_fit(plan, tokens) == 0:
        raise SystemExit(f"--request-tokens: a request of {tokens} tokens does not fit this cache; "
                         f"raise --cache-memory-gb or --num-pages")
    return 0


def _per_rank(cfg, dtype, config, layout, plan) -> None:
    """One rank of --tensor-parallel-size N: its share of the weights (dsv4/parallel/
    tensor_parallel.py: the split kinds / N) and the whole KV cache."""
    from ..cache.sizing import cache_bytes, per_rank_report
    n = config.tensor_parallel_size
    rank = {**_device_weights(cfg, dtype, config), "KV cache (whole)": cache_bytes(layout, plan, dtype)}
    _section(f"per rank of {n} (tensor parallel{', experts split E/N' if config.enable_expert_parallel else ''})", rank)
    print(per_rank_report(layout, plan, dtype, n))


def _per_dp_rank(cfg, dtype, config, layout, plan) -> None:
    """One rank of --data-parallel-size N --enable-expert-parallel (dsv4/parallel/
    expert_parallel.py): the routed experts / N, every other weight whole, and a whole cache
    of its own for its own requests."""
    from ..cache.sizing import cache_bytes, per_rank_report
    n = config.data_parallel_size
    rank = {**_device_weights(cfg, dtype, config), "KV cache (its own requests)": cache_bytes(layout, plan, dtype)}
    _section(f"per rank of {n} (data-parallel attention, experts split E/N)", rank)
    print(per_rank_report(layout, plan, dtype, 1, n))


def _model_config(spec: str):
    from ..config import ModelConfig
    from ..model.random_model import is_random_spec, parse_spec
    if is_random_spec(spec):
        return parse_spec(spec)
    try:
        return ModelConfig.from_dir(spec)
    except FileNotFoundError as e:
        raise SystemExit(f"--model: {e}") from None


def _weights(cfg, dtype: torch.dtype, config) -> dict[str, int]:
    """Bytes by kind at the loaded precision: the model dtype, routed experts FP8 (1 byte + a
    fp32 scale per 128x128 block) or MXFP4 (half a byte + a byte per 32) when kept quantised."""
    from ..bench.params import model_params
    p, elem = model_params(cfg), torch.empty((), dtype=dtype).element_size()
    routed = sum(layer.routed_expert for layer in p.layers) * p.n_routed_experts
    routed_bytes = (routed * (0.5 + 1 / 32) if config.keep_mxfp4 else routed * (1 + 4 / 128**2) if config.keep_fp8
                    else routed * elem)
    return {
        "attention projections": sum(layer.attention for layer in p.layers) * elem,
        "compressors and indexers": sum(layer.compressor + layer.indexer_query + layer.indexer_aux
                                        for layer in p.layers) * elem,
        "mHC": (sum(layer.hyper_connections for layer in p.layers) + p.hc_head) * 4,
        "routers": sum(layer.gate for layer in p.layers) * elem,
        "shared experts": sum(layer.shared_expert for layer in p.layers) * elem,
        f"routed experts ({p.n_routed_experts} per layer)": int(routed_bytes),
        "embedding and head": (p.embed + p.head) * elem,
    }


def _device_weights(cfg, dtype: torch.dtype, config) -> dict[str, int]:
    """_weights on one device: under --tensor-parallel-size N the split kinds / N (dsv4/parallel/
    tensor_parallel.py; the attention's q_a and kv projections stay whole), under
    --data-parallel-size N the routed experts / N, else all of them."""
    from ..bench.params import model_params
    weights = _weights(cfg, dtype, config)
    if config.tensor_parallel_size > 1:
        n, elem = config.tensor_parallel_size, torch.empty((), dtype=dtype).element_size()
        whole = sum(cfg.hidden_size * (cfg.q_lora_rank + cfg.head_dim) for _ in model_params(cfg).layers) * elem
        split = {"attention projections": (weights["attention projections"] - whole) / n + whole}
        split.update((k, v / n) for k, v in weights.items() if k.startswith(("shared", "routed", "embedding")))
        return {**weights, **{k: int(v) for k, v in split.items()}}
    if config.data_parallel_size > 1:
        return {k: v // config.data_parallel_size if k.startswith("routed") else v for k, v in weights.items()}
    return weights


def _section(title: str, parts: dict[str, int]) -> None:
    width = max(len(k) for k in parts) + 2
    unit, scale = ("GiB", 2**30) if sum(parts.values()) >= 2**30 else ("MiB", 2**20)
    print(f"{title}:")
    for name, nbytes in parts.items():
        print(f"  {name:<{width}} {nbytes / scale:10.3f} {unit}")
    print(f"  {'total':<{width}} {sum(parts.values()) / scale:10.3f} {unit}")
