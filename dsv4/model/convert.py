"""Checkpoint conversion (`dsv4 convert`), streamed shard by shard: every source shard is read
(dsv4/model/checkpoint_reader.py), its tensors converted and renamed, and written as one output
shard (dsv4/model/checkpoint_writer.py) before the next is read; the source is only read.

Conversions (ConvertOptions):
  * to="bf16": FP8 and MXFP4 weights dequantised exactly as the loader does, stored bf16 (exact
    with E8M0 scales: e4m3 and e2m1 values times a power of two fit bf16); other tensors keep
    their dtype; the config loses its quantisation fields;
  * fp8_scales="e8m0" | "fp32": the scales of FP8 weights rewritten between DeepSeek's released
    E8M0 and fp32 (as Flash-Base ships them), bit-exact both ways; a value E8M0 cannot hold
    (not a power of two) is refused, naming the tensor; MXFP4 scales stay E8M0;
  * names="deepseek" | "transformers": DeepSeek's names (routed experts one per key) or
    transformers' module names (experts stacked per layer; `mtp.*` keeps DeepSeek's names, which
    transformers ignores); transformers' names have no FP8/MXFP4 layout, so they need to="bf16"
    for a quantised source;
  * part="all" | "main" (without `mtp.*`) | "draft" (`mtp.*`, MTP and DSpark, plus the shared
    `embed` and `head`: a standalone draft checkpoint, see dsv4/model/draft.py).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from ..config import ModelConfig
from .checkpoint_reader import (Raw, check_fp4_scale, check_fp8_scale, dequantise, is_mxfp4, iter_raw_shards,
                                model_tensors, shard_files)
from .checkpoint_writer import ShardWriter, check_output_dir
from .names import canonical_name, ds_to_hf, transformers_name
from ..ops.quant import e8m0_to_float, float_to_e8m0

DRAFT_SHARED = ("embed.weight", "head.weight")
QUANTISED_DTYPES = ("F8_E4M3", "I8")


class ConvertError(ValueError):
    """Options that do not fit the checkpoint, or a tensor that cannot be converted."""


@dataclass(frozen=True)
class ConvertOptions:
    to: str | None = None            # "bf16"
    fp8_scales: str | None = None    # "e8m0" | "fp32"
    names: str = "deepseek"          # "deepseek" | "transformers"
    part: str = "all"                # "all" | "main" | "draft"


@dataclass
class ConvertSummary:
    out_dir: str
    tensors: int = 0
    shards: int = 0
    dequantised: int = 0
    rescaled: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


def selected(name: str, part: str) -> bool:
    is_mtp = name.startswith("mtp.")
    return part == "all" or (part == "main" and not is_mtp) or (part == "draft" and (is_mtp or name in DRAFT_SHARED))


def convert_checkpoint(src: str, out: str, opts: ConvertOptions,
                       on_shard: Callable[[str, int], None] | None = None) -> ConvertSummary:
    """Write the conversion of checkpoint folder `src` to the new folder `out`. on_shard(file,
    its bytes) is called after each source shard is written out."""
    check_output_dir(out, src)
    cfg = ModelConfig.from_dir(src)
    _check_options(src, opts)
    config = output_config(src, cfg, opts)
    summary, writer = ConvertSummary(out), ShardWriter(out)
    namer = _Namer(opts.names, cfg.n_routed_experts)
    try:
        for file, raws in iter_raw_shards(src):
            for raw in raws:
                if selected(raw.name, opts.part):
                    for key, tensor in _convert(raw, opts, cfg.quant_block, namer, summary):
                        writer.add(key, tensor)
            writer.end_shard()
            summary.bytes_read += os.path.getsize(file)
            if on_shard:
                on_shard(file, os.path.getsize(file))
        namer.finish()
        summary.bytes_written = writer.finish(config, src)
    except BaseException:
        writer.abort()
        raise
    summary.tensors, summary.shards = len(writer.written), len(writer.shards)
    return summary


def _check_options(src: str, opts: ConvertOptions) -> None:
    """Refuse, before writing anything, options that do not fit the checkpoint."""
    dtypes = _selected_dtypes(src, opts.part)
    if opts.part == "draft" and not any(n.startswith("mtp.") for n in dtypes):
        raise ConvertError(f"--extract-mtp: {src!r} has no MTP weights (mtp.*)")
    if opts.to == "bf16" and opts.fp8_scales:
        raise ConvertError("--fp8-scales: no FP8 scales remain with --to bf16")
    if opts.fp8_scales and "F8_E4M3" not in dtypes.values():
        raise ConvertError(f"--fp8-scales {opts.fp8_scales}: {src!r} has no FP8 weights")
    quantised = [n for n, d in dtypes.items() if d in QUANTISED_DTYPES]
    if opts.names == "transformers" and opts.to is None and quantised:
        raise ConvertError(f"--names transformers: transformers' names have no layout for FP8/MXFP4 weights "
                           f"(e.g. {quantised[0]!r}); add --to bf16")


def _selected_dtypes(src: str, part: str) -> dict[str, str]:
    """canonical name -> safetensors dtype of the tensors `part` selects (headers only)."""
    dtypes = {}
    for file in shard_files(src):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                name = canonical_name(key)
                if selected(name, part):
                    dtypes[name] = f.get_slice(key).get_dtype()
    return dtypes


def output_config(src: str, cfg: ModelConfig, opts: ConvertOptions) -> dict:
    """The source's config.json with the quantisation fields and the MTP count the output has."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if opts.to == "bf16":
        config.pop("quantization_config", None)
        config.pop("expert_dtype", None)
    if opts.fp8_scales:
        quant = dict(config.get("quantization_config") or {"quant_method": "fp8", "fmt": "e4m3"})
        quant["scale_fmt"] = "ue8m0" if opts.fp8_scales == "e8m0" else "float"
        config["quantization_config"] = quant
    if opts.part == "main" and cfg.num_nextn_predict_layers:
        config["num_nextn_predict_layers"] = 0
        ratios = config.get("compress_ratios")
        if isinstance(ratios, list) and len(ratios) > cfg.num_hidden_layers:
            config["compress_ratios"] = ratios[:cfg.num_hidden_layers]
    ModelConfig.from_dict(config)            # the output's config must parse
    return config


def _convert(raw: Raw, opts: ConvertOptions, block, namer: "_Namer",
             summary: ConvertSummary) -> Iterator[tuple[str, torch.Tensor]]:
    if raw.scale is None:
        yield from namer.weight(raw.name, raw.tensor)
        return
    if opts.to == "bf16":
        summary.dequantised += 1
        yield from namer.weight(raw.name, dequantise(raw, block).to(torch.bfloat16))
        return
    if is_mxfp4(raw):
        check_fp4_scale(raw)
        scale = raw.scale
    else:
        check_fp8_scale(raw, block)
        scale = raw.scale
        if opts.fp8_scales:
            scale = _rescaled(raw, opts.fp8_scales)
            summary.rescaled += 1
    yield from namer.weight(raw.name, raw.tensor)
    yield namer.scale(raw.name), scale


def _rescaled(raw: Raw, fmt: str) -> torch.Tensor:
    """An FP8 weight's scales in format fmt, holding the same values as the loader reads them."""
    values = e8m0_to_float(raw.scale)
    try:
        if fmt == "e8m0":
            return float_to_e8m0(values)
        if not torch.isfinite(values).all():
            raise ValueError("a scale is NaN (E8M0 code 255)")
        return values
    except ValueError as e:
        raise ConvertError(f"--fp8-scales {fmt}: scale {raw.scale_key!r} in {raw.file!r}: {e}") from None


class _Namer:
    """Output keys for canonical tensors in the target naming; for transformers' names it
    collects each layer's routed experts until all E of w1, w2 and w3 are there and emits the
    stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]."""

    def __init__(self, names: str, num_experts: int):
        self.names, self.num_experts = names, num_experts
        self.stacks: dict[str, dict[str, list]] = {}      # "layers.N.ffn.experts" -> w -> E slots

    def weight(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for param, expert, part in model_tensors(name, tensor):
            stem, _, w = param.rpartition(".")
            if not stem.endswith(".ffn.experts"):
                yield (param if self.names == "deepseek" or param.startswith("mtp.") else ds_to_hf(param)), part
            elif self.names == "deepseek" or param.startswith("mtp."):
                for e, matrix in (enumerate(part) if expert is None else [(expert, part)]):
                    yield f"{stem}.{e}.{w}.weight", matrix
            else:
                yield from self._stack(stem, w, expert, part)

    def scale(self, name: str) -> str:
        """DeepSeek's key for the scale of quantised weight `name` (`X.weight` -> `X.scale`)."""
        return name[:-len("weight")] + "scale"

    def _stack(self, stem: str, w: str, expert: int | None, part: torch.Tensor):
        slots = self.stacks.setdefault(stem, {k: [None] * self.num_experts for k in ("w1", "w2", "w3")})
        matrices = list(enumerate(part)) if expert is None else [(expert, part)]
        for e, matrix in matrices:
            if not 0 <= e < self.num_experts:
                raise ConvertError(f"{stem}.{w}: expert {e} out of range [0, {self.num_experts})")
            slots[w][e] = matrix
        if all(m is not None for ms in slots.values() for m in ms):
            del self.stacks[stem]
            yield transformers_name(f"{stem}.w1"), torch.cat([torch.stack(slots["w1"]), torch.stack(slots["w3"])], 1)
            yield transformers_name(f"{stem}.w2"), torch.stack(slots["w2"])

    def finish(self) -> None:
        for stem, slots in self.stacks.items():
            w, e = next((w, e) for w, ms in slots.items() for e, m in enumerate(ms) if m is None)
            raise ConvertError(f"routed expert {e} of {stem}.{w} is missing from the checkpoint")
