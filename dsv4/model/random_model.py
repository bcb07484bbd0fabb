"""Model specs `random:PRESET[:LAYERS][:key=value,...]`: a random-weight model built directly
in device memory (no files), for GPU benchmarks of shapes too large for the disk.
E.g. `random:flash-slice:6`, `random:flash-slice:2:n_routed_experts=32`.

keep_fp8: the routed and shared experts are FP8 kept quantised (as `load_model(keep_fp8=True)`
gives for a Flash-Base-style checkpoint): each is drawn as without it, then quantised to
float8_e4m3fn with fp32 128x128 block scales, one expert at a time (no [E, I, H] fp32 temporary).
keep_mxfp4: the routed experts likewise quantised to MXFP4 (packed uint8 + E8M0 bytes), the
shared expert unquantised (as `load_model(keep_mxfp4=True)` gives for the released V4)."""
from __future__ import annotations

import torch

from ..config import ConfigError, ModelConfig, apply_overrides
from .deepseek_v4 import DeepseekV4
from ..ops.quant import quant_fp8_stacked, quant_mxfp4_stacked, unpacked_shape
from .random_init import _random_tensor, preset_config
from .names import fp8_scale_name

PREFIX = "random:"


def is_random_spec(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(PREFIX)


def parse_spec(spec: str, overrides: dict | None = None) -> ModelConfig:
    """The spec's config; `overrides` (config.json keys, as `ModelConfig.from_dir` takes them)
    go over the spec's own key=value items."""
    parts = spec[len(PREFIX):].split(":")
    layers = int(parts[1]) if len(parts) > 1 and parts[1] else None
    items = {}
    for item in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
        key, _, value = item.partition("=")
        items[key] = _spec_value(value)
    try:
        return preset_config(parts[0], layers, **apply_overrides(items, overrides or {}))
    except ConfigError:
        raise
    except ValueError as e:
        raise ValueError(f"--model {spec!r}: {e}") from None


def _spec_value(value: str) -> int | float | str:
    """An item's value: an integer, else a number, else the text (e.g. an F/S pattern)."""
    if value.lstrip("-").isdigit():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


# kept weight dtype -> quantiser of a stack of matrices (-> codes, scales as the model holds them)
QUANTISERS = {torch.float8_e4m3fn: quant_fp8_stacked, torch.uint8: quant_mxfp4_stacked}


@torch.no_grad()
def build_random_model(spec: str, device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                       keep_fp8: bool = False, keep_mxfp4: bool = False, overrides: dict | None = None) -> DeepseekV4:
    """Same weights for the same spec and seed (generated parameter by parameter on `device`;
    with keep_fp8 / keep_mxfp4 the same draws, quantised). keep_mxfp4: the routed experts MXFP4
    and the shared expert unquantised, as `load_model(keep_mxfp4=True)` (with or without
    keep_fp8) gives for the released V4 checkpoints."""
    cfg = parse_spec(spec, overrides)
    fp8 = keep_fp8 and not keep_mxfp4
    with torch.device(device):
        model = DeepseekV4(cfg, dtype, (fp8, fp8), keep_mxfp4)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if "tid2eid" in n}
    for name, p in tensors.items():
        if _is_scale(name, tensors):               # filled with its weight (MXFP4's are uint8 too)
            continue
        if p.dtype in QUANTISERS:
            value = _random_tensor(name, unpacked_shape(p), dtype, cfg, gen, device)
            q, scales = QUANTISERS[p.dtype](value)
            p.copy_(q)
            tensors[fp8_scale_name(name)].copy_(scales)
        else:
            p.copy_(_random_tensor(name, tuple(p.shape), p.dtype, cfg, gen, device))
    return model.eval()


def _is_scale(name: str, tensors: dict) -> bool:
    """Whether `name` holds the scales of a kept (FP8 or MXFP4) weight."""
    weight = name[:-len(".scale")] + ".weight" if name.endswith(".scale") else name.removesuffix("_scale")
    return weight != name and weight in tensors and tensors[weight].dtype in QUANTISERS
