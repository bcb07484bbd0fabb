"""Model specs `random:PRESET[:LAYERS][:key=value,...]`: a random-weight model built directly
in device memory (no files), for GPU benchmarks of shapes too large for the disk.
E.g. `random:flash-slice:6`, `random:flash-slice:2:n_routed_experts=32`."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .deepseek_v4 import DeepseekV4
from .random_init import _random_tensor, preset_config

PREFIX = "random:"


def is_random_spec(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(PREFIX)


def parse_spec(spec: str) -> ModelConfig:
    parts = spec[len(PREFIX):].split(":")
    layers = int(parts[1]) if len(parts) > 1 and parts[1] else None
    overrides = {}
    for item in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    try:
        return preset_config(parts[0], layers, **overrides)
    except ValueError as e:
        raise ValueError(f"--model {spec!r}: {e}") from None


@torch.no_grad()
def build_random_model(spec: str, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> DeepseekV4:
    """Same weights for the same spec and seed (generated parameter by parameter on `device`)."""
    cfg = parse_spec(spec)
    with torch.device(device):
        model = DeepseekV4(cfg, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "tid2eid" in n]:
        p.copy_(_random_tensor(name, tuple(p.shape), p.dtype, cfg, gen, device))
    return model.eval()
