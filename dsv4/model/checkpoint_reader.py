"""Read a checkpoint folder (safetensors shards, any naming `names.canonical_name` reads,
BF16/FP32, FP8 block-scaled, MXFP4 experts) one shard at a time.

`iter_raw_shards(dir)` yields each shard with its tensors as `Raw` records: canonical name,
the key and file it came from, and a quantised weight paired with its scale (a weight and its
scale may sit in different shards; the first waits for the other). `read_checkpoint(dir)`
turns them into what the model holds (`Loaded`: dequantised to fp32, or kept quantised);
dsv4/model/weights.py fills a model from it, dsv4/model/convert.py rewrites checkpoints.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from safetensors import safe_open

from .names import DS_DOWN, DS_EXPERT, DS_GATE_UP, canonical_name, fp8_scale_name
from ..ops.quant import dequant_fp4, dequant_fp8, e8m0_to_float

SCALE_SUFFIX = re.compile(r"\.(scale|weight_scale_inv)$")     # of a canonical name
QUANTISED = (torch.float8_e4m3fn, torch.int8)                   # FP8 e4m3; MXFP4 packed e2m1 pairs


class CheckpointError(ValueError):
    """A tensor is missing, unexpected or mis-shaped; the message names it (and its file)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class Raw(NamedTuple):
    """One checkpoint tensor as stored: `tensor` under canonical `name` (key `key` in `file`);
    a quantised weight comes with its `scale` (stored under `scale_key`), others with None."""
    file: str
    key: str
    name: str
    tensor: torch.Tensor
    scale: torch.Tensor | None = None
    scale_key: str | None = None


class Loaded(NamedTuple):
    """A tensor for the model: parameter `name`, expert index (None: whole tensor), value, and
    the checkpoint key and file it came from (for error messages)."""
    name: str
    expert: int | None
    tensor: torch.Tensor
    key: str
    file: str


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


class _Pairing:
    """Pairs quantised weights with their scales across shards (by canonical name)."""

    def __init__(self):
        self.weights: dict[str, tuple[str, str, torch.Tensor]] = {}   # name -> file, key, weight
        self.scales: dict[str, tuple[str, str, torch.Tensor]] = {}    # weight name -> file, key, scale

    def shard(self, file: str) -> Iterator[Raw]:
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensor, name = f.get_tensor(key), canonical_name(key)
                if SCALE_SUFFIX.search(name):
                    base = SCALE_SUFFIX.sub(".weight", name)
                    if base in self.weights:
                        w_file, w_key, weight = self.weights.pop(base)
                        yield Raw(w_file, w_key, base, weight, tensor, key)
                    else:
                        self.scales[base] = (file, key, tensor)
                elif tensor.dtype in QUANTISED:
                    if name in self.scales:
                        _, s_key, scale = self.scales.pop(name)
                        yield Raw(file, key, name, tensor, scale, s_key)
                    else:
                        self.weights[name] = (file, key, tensor)
                else:
                    yield Raw(file, key, name, tensor)

    def finish(self) -> None:
        for name, (file, key, _) in self.weights.items():
            raise CheckpointError(f"quantised tensor {name!r} has no scale tensor (key {key!r} in {file!r})", name)
        for name, (file, key, _) in self.scales.items():
            raise CheckpointError(f"scale for {name!r} has no quantised weight (scale {key!r} in {file!r})", name)


def iter_raw_shards(path: str) -> Iterator[tuple[str, Iterator[Raw]]]:
    """(file, its tensors) per shard, in order; a pair completes in the shard of its second
    half. Raises CheckpointError after the last shard if a weight or scale is left unpaired."""
    pairing = _Pairing()
    for file in shard_files(path):
        yield file, pairing.shard(file)
    pairing.finish()


def iter_raw(path: str) -> Iterator[Raw]:
    for _, tensors in iter_raw_shards(path):
        yield from tensors


def read_checkpoint(path: str, block: tuple[int, int] = (128, 128),
                    keep: Callable[[str], bool] | None = None) -> Iterator[Loaded]:
    """Every tensor for the model, quantised weights dequantised to fp32 except those whose
    parameter name `keep` accepts: FP8 ones come as is (float8_e4m3fn) followed by their scales
    in fp32, MXFP4 ones packed (uint8 [out, in/2]) followed by their E8M0 exponent bytes (uint8
    [out, in/32]), the scales under `fp8_scale_name`."""
    for raw in iter_raw(path):
        if raw.scale is None:
            yield from _loaded(raw, raw.tensor)
            continue
        if keep is not None:
            parts = list(model_tensors(raw.name, raw.tensor))
            if len(parts) == 1 and keep(parts[0][0]):
                name, expert, _ = parts[0]
                yield Loaded(name, expert, kept_weight(raw, block), raw.key, raw.file)
                yield Loaded(fp8_scale_name(name), expert, kept_scale(raw), raw.scale_key, raw.file)
                continue
        yield from _loaded(raw, dequantise(raw, block))


def iter_checkpoint(path: str, block: tuple[int, int] = (128, 128),
                    keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """(parameter name, expert index or None, tensor) of `read_checkpoint`."""
    for item in read_checkpoint(path, block, keep):
        yield item.name, item.expert, item.tensor


def _loaded(raw: Raw, tensor: torch.Tensor) -> Iterator[Loaded]:
    for name, expert, part in model_tensors(raw.name, tensor):
        yield Loaded(name, expert, part, raw.key, raw.file)


def model_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, int | None, torch.Tensor]]:
    """Canonical checkpoint tensor -> (model parameter name, expert or None, tensor): stacked
    `experts.gate_up_proj` [E, 2I, H] splits into `experts.w1` and `experts.w3` [E, I, H],
    `experts.down_proj` is `experts.w2`, per-expert `experts.E.wK.weight` is expert E of
    `experts.wK`."""
    if m := DS_GATE_UP.match(name):
        w1, w3 = tensor.chunk(2, dim=1)
        yield f"{m.group(1)}.w1", None, w1
        yield f"{m.group(1)}.w3", None, w3
    elif m := DS_DOWN.match(name):
        yield f"{m.group(1)}.w2", None, tensor
    elif m := DS_EXPERT.match(name):
        yield f"{m.group(1)}.{m.group(3)}", int(m.group(2)), tensor
    else:
        yield name, None, tensor


def is_mxfp4(raw: Raw) -> bool:
    return raw.tensor.dtype == torch.int8


def dequantise(raw: Raw, block: tuple[int, int]) -> torch.Tensor:
    """A quantised weight and its scale -> fp32 (checked shapes)."""
    if is_mxfp4(raw):
        check_fp4_scale(raw)
        return dequant_fp4(raw.tensor, raw.scale)
    check_fp8_scale(raw, block)
    return dequant_fp8(raw.tensor, raw.scale, block)


def kept_weight(raw: Raw, block: tuple[int, int]) -> torch.Tensor:
    """A kept weight as the model holds it (checked against its scale): FP8 as is, MXFP4 the
    packed bytes as uint8."""
    if is_mxfp4(raw):
        check_fp4_scale(raw)
        return raw.tensor.view(torch.uint8)
    check_fp8_scale(raw, block)
    return raw.tensor


def kept_scale(raw: Raw) -> torch.Tensor:
    """A kept weight's scale as the model holds it: FP8 fp32; MXFP4 the raw E8M0 bytes."""
    if not is_mxfp4(raw):
        return e8m0_to_float(raw.scale)
    if raw.scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise CheckpointError(f"{raw.name}: MXFP4 scale dtype {raw.scale.dtype}, expected E8M0 (float8_e8m0fnu or "
                              f"uint8) to keep the weight MXFP4 (scale {raw.scale_key!r} in {raw.file!r})", raw.name)
    return raw.scale.view(torch.uint8)


def check_fp8_scale(raw: Raw, block: tuple[int, int]) -> None:
    want = (-(-raw.tensor.shape[0] // block[0]), -(-raw.tensor.shape[1] // block[1]))
    if tuple(raw.scale.shape) != want:
        raise CheckpointError(f"{raw.name}: FP8 scale shape {tuple(raw.scale.shape)}, expected {list(want)} "
                              f"(scale {raw.scale_key!r} in {raw.file!r})", raw.name)


def check_fp4_scale(raw: Raw) -> None:
    """packed weight [out, in/2], scale [out, in/32]."""
    weight, scale = raw.tensor, raw.scale
    if weight.shape[1] * 2 != scale.shape[1] * 32 or weight.shape[0] != scale.shape[0]:
        raise CheckpointError(f"{raw.name}: MXFP4 scale shape {tuple(scale.shape)} does not fit packed "
                              f"weight {tuple(weight.shape)} (expected [{weight.shape[0]}, "
                              f"{weight.shape[1] * 2 // 32}]; scale {raw.scale_key!r} in {raw.file!r})", raw.name)
