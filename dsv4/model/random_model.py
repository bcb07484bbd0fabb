"""Model specs `random:PRESET[:LAYERS][:key=value,...]`: a random-weight model built directly
in device memory (no files), for GPU benchmarks of shapes too large for the disk.
E.g. `random:flash-slice:6`, `random:flash-slice:2:n_routed_experts=32`.

keep_fp8: the routed and shared experts are FP8 kept quantised (as `load_model(keep_fp8=True)`
gives for a Flash-Base-style checkpoint): each is drawn as without it, then quantised to
float8_e4m3fn with fp32 128x128 block scales, one expert at a time (no [E, I, H] fp32 temporary).
keep_mxfp4: the routed experts likewise quantised to MXFP4 (packed uint8 + E8M0 bytes), the
shared expert unquantised (as `load_model(keep_mxfp4=True)` gives for the released V4).
keep_fp8_dense: the attention and dense projections likewise quantised to FP8
(dsv4/model/fp8_dense.py).

The released presets (`random:flash`, `random:pro`: every layer and the MTP block) and any build
given a `shard` take the released-format path instead (`released=True`; dsv4/model/
random_released.py): the model is laid out on the meta device, then each tensor is drawn in
place on `device`, layer by layer, already in its kept format (FP8 codes, MXFP4 bytes) — no
fp32 copy of any whole weight — and only the slice `shard.index(name, full_shape)` of each
(`Shard`, `ExpertShard`): what a rank of a multi-GPU engine calls to build its own part. Run
them with `--keep-fp8 --keep-fp8-dense --keep-mxfp4` (V4-Flash is about 160 GB so; without the
flags the same values are held dequantised)."""
from __future__ import annotations

import torch

from ..config import ConfigError, ModelConfig, apply_overrides
from .deepseek_v4 import DeepseekV4
from ..ops.quant import kept_scale_shape, quant_fp8_stacked, quant_mxfp4_stacked, unpacked_shape, weight_format
from .fp8_dense import keep_fp8_dense as keep_dense
from .random_init import RELEASED_PRESETS, _random_tensor, preset_config
from .random_released import ExpertShard, Shard, fill, is_released_fp8  # noqa: F401 (Shard, ExpertShard: the API)
from .rope import compress_inv_freq, main_inv_freq
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
                       keep_fp8: bool = False, keep_mxfp4: bool = False, overrides: dict | None = None,
                       keep_fp8_dense: bool = False, shard: Shard | None = None,
                       released: bool | None = None) -> DeepseekV4:
    """Same weights for the same spec and seed. keep_mxfp4: the routed experts MXFP4 and the
    shared expert unquantised, as `load_model(keep_mxfp4=True)` (with or without keep_fp8) gives
    for the released V4 checkpoints. released (default: for the released presets or a shard):
    the released-format path (module docstring), which also attaches the MTP blocks; shard: the
    part of each tensor this rank holds (None: everything). Otherwise the draws are made
    parameter by parameter on `device` (with the keep flags: the same draws, quantised)."""
    cfg = parse_spec(spec, overrides)
    fp8 = keep_fp8 and not keep_mxfp4
    if released is None:
        released = spec[len(PREFIX):].split(":")[0] in RELEASED_PRESETS or shard is not None
    if released:
        return _build_released(cfg, device, dtype, seed, fp8, keep_mxfp4, keep_fp8_dense, shard or Shard())
    with torch.device(device):
        model = DeepseekV4(cfg, dtype, (fp8, fp8), keep_mxfp4)
        if cfg.dspark_block_size:                  # a DSpark preset: its draft stages too
            from .mtp import attach_mtp
            attach_mtp(model)
        if keep_fp8_dense:
            keep_dense(model)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = _tensors(model)
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


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if "tid2eid" in n}


def _build_released(cfg: ModelConfig, device, dtype, seed: int, fp8_experts: bool, mxfp4: bool, fp8_dense: bool,
                    shard: Shard) -> DeepseekV4:
    """Lay the model out on the meta device, then materialise each tensor's shard on `device`,
    in module order (layer by layer), drawn in its kept format (random_released.fill)."""
    from .mtp import attach_mtp
    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype, (fp8_experts, fp8_experts), mxfp4)
        if cfg.num_nextn_predict_layers:
            attach_mtp(model)
        if fp8_dense:
            keep_dense(model)
    modules = dict(model.named_modules())
    tensors = _tensors(model)
    for name, meta in tensors.items():
        if _is_scale(name, tensors):
            continue
        index = shard.index(name, tuple(meta.shape))
        local = tuple(s.stop - s.start for s in index)
        p = torch.empty(local, dtype=meta.dtype, device=device)
        scale = None
        if meta.dtype in QUANTISERS:
            s_meta = tensors[fp8_scale_name(name)]
            scale = torch.empty(kept_scale_shape(local, weight_format(p)), dtype=s_meta.dtype, device=device)
            _place(modules, fp8_scale_name(name), scale)
        if p.device.type != "meta":                # (the meta device: the layout alone)
            fill(p, name, tuple(meta.shape), index, cfg, seed, is_released_fp8(name), scale)
        _place(modules, name, p)
    model.main_freq, model.compress_freq = main_inv_freq(cfg).to(device), compress_inv_freq(cfg).to(device)
    return model.eval()


def _place(modules: dict[str, torch.nn.Module], name: str, t: torch.Tensor) -> None:
    """Put tensor t in the model as parameter (or buffer) `name`, replacing the meta one."""
    owner, _, attr = name.rpartition(".")
    module = modules[owner]
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[attr] = t


def _is_scale(name: str, tensors: dict) -> bool:
    """Whether `name` holds the scales of a kept (FP8 or MXFP4) weight."""
    weight = name[:-len(".scale")] + ".weight" if name.endswith(".scale") else name.removesuffix("_scale")
    return weight != name and weight in tensors and tensors[weight].dtype in QUANTISERS
