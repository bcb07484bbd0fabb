"""Load a checkpoint folder (safetensors shards, DeepSeek or transformers names, BF16/FP32,
FP8 block-scaled, MXFP4 experts) into a `DeepseekV4`, one shard at a time.

`iter_checkpoint(dir)` yields (canonical DeepSeek name, expert index | None, dequantised
tensor); `load_weights(model, dir)` copies them into the model's parameters and checks that
every parameter was filled exactly once, with the right shape.

`load_model(dir, keep_fp8=True)` keeps FP8 (e4m3, 128x128 block scales) routed and shared expert
weights quantised (float8_e4m3fn + fp32 scales, dequantised in the MoE kernels);
`load_model(dir, keep_mxfp4=True)` keeps MXFP4 routed experts (the released V4) packed (uint8
e2m1 pairs + uint8 E8M0 exponent bytes, dequantised in the MoE kernels); everything else is
dequantised at load as without them.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from .names import (DS_EXPERT, HF_DOWN, HF_GATE_UP, fp8_scale_name, hf_to_ds, is_transformers_name,
                    transformers_name)
from ..ops.quant import dequant_fp4, dequant_fp8, e8m0_to_float

log = logging.getLogger("dsv4.model")
QUANT_SCALE = re.compile(r"^(.*)\.(scale|weight_scale_inv)$")
SHARED_EXPERT = re.compile(r"^(.*\.)?ffn\.shared_experts\.w[123]\.weight$")
STACKED = re.compile(r"experts\.w[123](_scale)?$")          # routed experts: [E, ...]


class CheckpointError(ValueError):
    """A tensor is missing, unexpected or mis-shaped; the message names it."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


def shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path!r}")
    return [os.path.join(path, f) for f in files]


def checkpoint_keys(path: str) -> list[str]:
    keys = []
    for file in shard_files(path):
        with safe_open(file, "pt") as f:
            keys.extend(f.keys())
    return keys


def iter_checkpoint(path: str, block: tuple[int, int] = (128, 128),
                    keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """Yield (canonical name, expert index or None, tensor) with quantised weights dequantised
    to fp32, except those whose canonical name `keep` accepts: FP8 ones come as is
    (float8_e4m3fn) followed by their scales in fp32, MXFP4 ones packed (uint8 [out, in/2])
    followed by their E8M0 exponent bytes (uint8 [out, in/32]), the scales under
    `fp8_scale_name`. A weight and its scale may sit in different shards; the first waits for
    the other."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for file in shard_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                scale_of = QUANT_SCALE.match(key)
                if scale_of and (scale_of.group(2) == "weight_scale_inv" or not is_transformers_name(key)):
                    base = scale_of.group(1) + ".weight"
                    if base in waiting_weights:
                        yield from _quantised(base, waiting_weights.pop(base), tensor, block, keep)
                    else:
                        waiting_scales[base] = tensor
                elif tensor.dtype in (torch.float8_e4m3fn, torch.int8):
                    if key in waiting_scales:
                        yield from _quantised(key, tensor, waiting_scales.pop(key), block, keep)
                    else:
                        waiting_weights[key] = tensor
                else:
                    yield from _canonical(key, tensor)
    if waiting_weights:
        raise CheckpointError(f"quantised tensor {next(iter(waiting_weights))!r} has no scale tensor")
    if waiting_scales:
        raise CheckpointError(f"scale for {next(iter(waiting_scales))!r} has no quantised weight")


def _quantised(key: str, weight: torch.Tensor, scale: torch.Tensor, block, keep):
    """A quantised weight and its scale -> canonical tensors: dequantised, or kept + scales."""
    if keep is not None:
        items = list(_canonical(key, weight))
        if len(items) == 1 and keep(items[0][0]):
            name, expert, _ = items[0]
            yield name, expert, _kept_weight(weight, scale, block, key)
            yield fp8_scale_name(name), expert, _kept_scale(weight, scale, key)
            return
    yield from _canonical(key, _dequant(weight, scale, block, key))


def _kept_weight(weight: torch.Tensor, scale: torch.Tensor, block, name: str) -> torch.Tensor:
    """A kept weight as the model holds it (checked against its scale): FP8 as is, MXFP4 the
    packed bytes as uint8."""
    if weight.dtype == torch.int8:
        _check_fp4_scale(weight, scale, name)
        return weight.view(torch.uint8)
    _check_fp8_scale(weight, scale, block, name)
    return weight


def _kept_scale(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """A kept weight's scale as the model holds it: FP8 fp32; MXFP4 the raw E8M0 bytes."""
    if weight.dtype != torch.int8:
        return e8m0_to_float(scale)
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise CheckpointError(f"{name}: MXFP4 scale dtype {scale.dtype}, expected E8M0 (float8_e8m0fnu or uint8) "
                              f"to keep the weight MXFP4")
    return scale.view(torch.uint8)


def _check_fp8_scale(weight: torch.Tensor, scale: torch.Tensor, block, name: str) -> None:
    want = (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1]))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{name}: FP8 scale shape {tuple(scale.shape)}, expected {list(want)}")


def _check_fp4_scale(weight: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """packed weight [out, in/2], scale [out, in/32]."""
    if weight.shape[1] * 2 != scale.shape[1] * 32 or weight.shape[0] != scale.shape[0]:
        raise CheckpointError(f"{name}: MXFP4 scale shape {tuple(scale.shape)} does not fit packed "
                              f"weight {tuple(weight.shape)} (expected [{weight.shape[0]}, "
                              f"{weight.shape[1] * 2 // 32}])")


def _dequant(weight: torch.Tensor, scale: torch.Tensor, block, name: str) -> torch.Tensor:
    if weight.dtype == torch.int8:
        _check_fp4_scale(weight, scale, name)
        return dequant_fp4(weight, scale)
    _check_fp8_scale(weight, scale, block, name)
    return dequant_fp8(weight, scale, block)


def _canonical(key: str, tensor: torch.Tensor) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    if is_transformers_name(key):
        if m := HF_GATE_UP.match(key):
            layer = hf_to_ds(m.group(1))
            w1, w3 = tensor.chunk(2, dim=1)
            yield f"{layer}.ffn.experts.w1", None, w1
            yield f"{layer}.ffn.experts.w3", None, w3
            return
        if m := HF_DOWN.match(key):
            yield f"{hf_to_ds(m.group(1))}.ffn.experts.w2", None, tensor
            return
        key = hf_to_ds(key)
    if m := DS_EXPERT.match(key):
        yield f"{m.group(1)}.{m.group(3)}", int(m.group(2)), tensor
        return
    yield key, None, tensor


def load_weights(model: torch.nn.Module, path: str) -> None:
    """Fill every parameter and persistent buffer of `model` from the checkpoint at `path`."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] == "tid2eid")
    filled: dict[str, int] = {}
    hf_names = all(is_transformers_name(k) for k in checkpoint_keys(path))
    block = getattr(getattr(model, "cfg", None), "quant_block", (128, 128))
    # weights the model holds quantised (FP8 or MXFP4, with a scale parameter) are loaded as such
    keep = (lambda n: fp8_scale_name(n) in targets) if any(
        t.dtype in (torch.float8_e4m3fn, torch.uint8) for t in targets.values()) else None
    with torch.no_grad():
        for name, expert, tensor in iter_checkpoint(path, block, keep):
            if name not in targets:
                raise CheckpointError(f"unexpected tensor {name!r} in {path!r} (not part of this model config)")
            target = targets[name] if expert is None else _expert_slice(targets[name], expert, name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"tensor {name!r}{'' if expert is None else f' expert {expert}'}: shape "
                                      f"{tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor.to(target.dtype))
            filled[name] = filled.get(name, 0) + 1
    try:
        _check_complete(targets, filled)
    except CheckpointError as e:
        if hf_names and e.tensor and not e.tensor.startswith("mtp."):
            raise CheckpointError(f"{e} (transformers name {transformers_name(e.tensor)!r})", e.tensor) from None
        raise


def _expert_slice(param: torch.Tensor, expert: int, name: str) -> torch.Tensor:
    if not 0 <= expert < param.shape[0]:
        raise CheckpointError(f"tensor {name!r}: expert {expert} out of range [0, {param.shape[0]})")
    return param[expert]


def _check_complete(targets: dict[str, torch.Tensor], filled: dict[str, int]) -> None:
    for name, t in targets.items():
        got = filled.get(name, 0)
        if got == 0:
            raise CheckpointError(f"missing tensor {name!r} in checkpoint", name)
        stacked = STACKED.search(name) is not None
        if got not in ((1, t.shape[0]) if stacked else (1,)):
            raise CheckpointError(f"tensor {name!r} appears {got} times" +
                                  (f" (expected 1 stacked or {t.shape[0]} per-expert)" if stacked else ""))


def _expert_dtypes(path: str) -> tuple[set[str], set[str]]:
    """The safetensors dtypes of the routed expert weights (DeepSeek names) and of the shared
    experts' weights in the checkpoint."""
    dtypes: tuple[set, set] = (set(), set())
    for file in shard_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                group = 0 if DS_EXPERT.match(key) else 1 if SHARED_EXPERT.match(key) else None
                if group is not None:
                    dtypes[group].add(f.get_slice(key).get_dtype())
    return dtypes


def fp8_experts(path: str, block: tuple[int, int]) -> tuple[bool, bool]:
    """(routed, shared) for `load_model(keep_fp8=True)`: routed = every routed expert weight of
    the checkpoint (DeepSeek names) is float8_e4m3fn and the scale blocks are 128x128; shared =
    the same for the shared experts, and routed (the shared expert runs fused in the routed
    experts' kernels, which take one weight format). With MXFP4 routed experts (the released V4
    checkpoints; see `mxfp4_experts`) the FP8 shared expert is dequantised at load (the kernels
    then fuse it unquantised)."""
    if tuple(block) != (128, 128):
        return False, False
    routed, shared = _expert_dtypes(path)
    return routed == {"F8_E4M3"}, routed == shared == {"F8_E4M3"}


def mxfp4_experts(path: str) -> bool:
    """For `load_model(keep_mxfp4=True)`: every routed expert weight of the checkpoint (DeepSeek
    names) is MXFP4 (packed int8)."""
    return _expert_dtypes(path)[0] == {"I8"}


def load_model(path: str, device="cpu", dtype: torch.dtype = torch.float32, keep_fp8: bool = False,
               keep_mxfp4: bool = False):
    """Build a `DeepseekV4` for the checkpoint at `path` (with its MTP blocks when the
    checkpoint has them) and load its weights. keep_fp8: FP8 expert weights stay FP8 (see
    `fp8_experts`; a random spec is built with FP8 experts, see `build_random_model`);
    keep_mxfp4: MXFP4 routed experts stay MXFP4 (see `mxfp4_experts`; a random spec is built
    with MXFP4 routed experts)."""
    from ..config import ModelConfig
    from .deepseek_v4 import DeepseekV4
    from .mtp import attach_mtp
    from .random_model import build_random_model, is_random_spec

    if is_random_spec(path):
        return build_random_model(path, device, dtype, keep_fp8=keep_fp8, keep_mxfp4=keep_mxfp4)
    cfg = ModelConfig.from_dir(path)
    has_mtp = any(k.startswith("mtp.") for k in checkpoint_keys(path))
    fp8 = fp8_experts(path, cfg.quant_block) if keep_fp8 else (False, False)
    mxfp4 = keep_mxfp4 and mxfp4_experts(path)
    for flag, wanted, kept in (("keep_fp8", keep_fp8, fp8[0]), ("keep_mxfp4", keep_mxfp4, mxfp4)):
        if wanted and not kept:
            log.warning("%s: the routed experts of %s are not all in that format; they are dequantised at load",
                        flag, path)
    with torch.device(device):
        model = DeepseekV4(cfg, dtype, fp8, mxfp4)
        if has_mtp and cfg.num_nextn_predict_layers:
            attach_mtp(model)
    load_weights(model, path)
    return model.eval()
