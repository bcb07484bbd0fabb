"""dsv4: a serving engine for the DeepSeek-V4 model family."""
from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "ModelConfig", "EngineConfig"]


def __getattr__(name):
    # lazy: `import dsv4` stays light (the API server process never loads torch models)
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .sampling_params import SamplingParams
        return SamplingParams
    if name in ("ModelConfig", "EngineConfig"):
        from . import config
        return getattr(config, name)
    raise AttributeError(name)
