"""How long one request may be (`max_model_len`) and what sets it: the flag, the model's
positions or the KV cache. A setting no request could ever use is a start-up error naming the
field (docs/architecture.md, "Serving": bad input)."""
from __future__ import annotations

from dataclasses import dataclass

from ..cache.layout import PAGE_TOKENS, CachePlan
from ..config import ConfigError, EngineConfig, ModelConfig


@dataclass(frozen=True)
class ContextLimit:
    tokens: int      # prompt + output tokens of one request
    source: str      # what sets it, for error messages ("--max-model-len", "the KV cache (...)")


def _cache_flag(config: EngineConfig) -> str:
    """The field that sized the cache: `num_pages` when given, else the memory budget."""
    return "num_pages" if config.num_pages is not None else "cache_memory_gb"


def context_limit(cfg: ModelConfig, plan: CachePlan, config: EngineConfig) -> ContextLimit:
    """`config.max_model_len` when given (it must fit the model's positions and, for one
    request alone, the cache's history pages); else the smaller of the two."""
    want, positions, cached = config.max_model_len, cfg.max_position_embeddings, plan.max_tokens
    if want is not None and want > positions:
        raise ConfigError("max_model_len", f"{want} exceeds the model's max_position_embeddings {positions}")
    if want is not None and want > cached:
        raise ConfigError(_cache_flag(config), f"the KV cache holds {cached} tokens ({plan.num_pages} pages of "
                                               f"{PAGE_TOKENS}), too few for one request of max_model_len {want}: "
                                               f"raise --num-pages / --cache-memory-gb or lower --max-model-len")
    if want is not None:
        return ContextLimit(want, "--max-model-len")
    if cached < positions:
        return ContextLimit(cached, f"the KV cache ({plan.num_pages} pages of {PAGE_TOKENS} tokens)")
    return ContextLimit(positions, "the model's max_position_embeddings")
