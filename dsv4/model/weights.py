"""Load a checkpoint folder (safetensors shards, any naming dsv4/model/names.py reads:
DeepSeek's and every one transformers writes; BF16/FP32, FP8 block-scaled, MXFP4 experts)
into a `DeepseekV4`, one shard at a time (the reading is dsv4/model/checkpoint_reader.py).

`load_weights(model, dir)` copies the tensors into the model's parameters and checks that
every parameter was filled exactly once, with the right shape; errors name the checkpoint key,
its file and, where the layout is a known foreign one, the conversion that fixes it
(dsv4/model/layouts.py).

`load_model(dir, keep_fp8=True)` keeps FP8 (e4m3, 128x128 block scales) routed and shared expert
weights quantised (float8_e4m3fn + fp32 scales, dequantised in the MoE kernels);
`load_model(dir, keep_mxfp4=True)` keeps MXFP4 routed experts (the released V4) packed (uint8
e2m1 pairs + uint8 E8M0 exponent bytes, dequantised in the MoE kernels); everything else is
dequantised at load as without them.
"""
from __future__ import annotations

import logging
import re

import torch
from safetensors import safe_open

from .checkpoint_reader import (CheckpointError, Loaded, checkpoint_keys, iter_checkpoint,  # noqa: F401 (re-exported)
                                read_checkpoint, shard_files)
from .layouts import foreign_layout_hint
from .names import DS_EXPERT, canonical_name, fp8_scale_name, is_transformers_name, transformers_name

log = logging.getLogger("dsv4.model")
SHARED_EXPERT = re.compile(r"^(.*\.)?ffn\.shared_experts\.w[123]\.weight$")
STACKED = re.compile(r"experts\.w[123](_scale)?$")          # routed experts: [E, ...]


def model_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of `model`, by name."""
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] == "tid2eid")
    return targets


def load_weights(model: torch.nn.Module, path: str, targets: dict[str, torch.Tensor] | None = None,
                 shared: dict[str, torch.Tensor] | None = None) -> None:
    """Fill `targets` (default: every parameter and persistent buffer of `model`) from the
    checkpoint at `path`; tensors named in `shared` must be there and equal those given
    (a draft's embedding and head, dsv4/model/draft.py)."""
    targets = model_targets(model) if targets is None else targets
    shared = shared or {}
    filled: dict[str, int] = {}
    hf_names = all(is_transformers_name(k) for k in checkpoint_keys(path))
    block = getattr(getattr(model, "cfg", None), "quant_block", (128, 128))
    # weights the model holds quantised (FP8 or MXFP4, with a scale parameter) are loaded as such
    keep = (lambda n: fp8_scale_name(n) in targets) if any(
        t.dtype in (torch.float8_e4m3fn, torch.uint8) for t in targets.values()) else None
    with torch.no_grad():
        for item in read_checkpoint(path, block, keep):
            if item.name in shared:
                _check_shared(item, shared[item.name])
            else:
                _fill(targets, item)
            filled[item.name] = filled.get(item.name, 0) + 1
    try:
        _check_complete({**targets, **shared}, filled)
    except CheckpointError as e:
        if hf_names and e.tensor and not e.tensor.startswith("mtp."):
            raise CheckpointError(f"{e} (transformers name {transformers_name(e.tensor)!r})", e.tensor) from None
        raise


def _fill(targets: dict[str, torch.Tensor], item: Loaded) -> None:
    name, expert, tensor = item.name, item.expert, item.tensor
    if name not in targets:
        raise _unexpected(item)
    target = targets[name] if expert is None else _expert_slice(targets[name], item)
    if tuple(tensor.shape) != tuple(target.shape):
        raise CheckpointError(f"tensor {name!r}{'' if expert is None else f' expert {expert}'}: shape "
                              f"{tuple(tensor.shape)}, expected {tuple(target.shape)} ({_source(item)})"
                              f"{foreign_layout_hint(item.key, name)}", name)
    target.copy_(tensor.to(target.dtype))


def _check_shared(item: Loaded, want: torch.Tensor) -> None:
    if item.expert is not None or not torch.equal(item.tensor.to(want.dtype), want):
        raise CheckpointError(f"tensor {item.name!r} ({_source(item)}) differs from the model's: the checkpoint "
                              f"was not extracted from the model's own", item.name)


def _source(item: Loaded) -> str:
    return f"key {item.key!r} in {item.file!r}"


def _unexpected(item: Loaded) -> CheckpointError:
    read_as = "" if item.key == item.name else f", read as {item.name!r}"
    return CheckpointError(f"unexpected tensor {item.key!r} in {item.file!r}{read_as} (not part of this model "
                           f"config){foreign_layout_hint(item.key, item.name)}", item.name)


def _expert_slice(param: torch.Tensor, item: Loaded) -> torch.Tensor:
    if not 0 <= item.expert < param.shape[0]:
        raise CheckpointError(f"tensor {item.name!r}: expert {item.expert} out of range [0, {param.shape[0]}) "
                              f"({_source(item)})", item.name)
    return param[item.expert]


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
    """The safetensors dtypes of the routed expert weights (one per key) and of the shared
    experts' weights in the checkpoint."""
    dtypes: tuple[set, set] = (set(), set())
    for file in shard_files(path):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                name = canonical_name(key)
                group = 0 if DS_EXPERT.match(name) else 1 if SHARED_EXPERT.match(name) else None
                if group is not None:
                    dtypes[group].add(f.get_slice(key).get_dtype())
    return dtypes


def fp8_experts(path: str, block: tuple[int, int]) -> tuple[bool, bool]:
    """(routed, shared) for `load_model(keep_fp8=True)`: routed = every routed expert weight of
    the checkpoint (one per key) is float8_e4m3fn and the scale blocks are 128x128; shared =
    the same for the shared experts, and routed (the shared expert runs fused in the routed
    experts' kernels, which take one weight format). With MXFP4 routed experts (the released V4
    checkpoints; see `mxfp4_experts`) the FP8 shared expert is dequantised at load (the kernels
    then fuse it unquantised)."""
    if tuple(block) != (128, 128):
        return False, False
    routed, shared = _expert_dtypes(path)
    return routed == {"F8_E4M3"}, routed == shared == {"F8_E4M3"}


def mxfp4_experts(path: str) -> bool:
    """For `load_model(keep_mxfp4=True)`: every routed expert weight of the checkpoint (one per
    key) is MXFP4 (packed int8)."""
    return _expert_dtypes(path)[0] == {"I8"}


def model_config(path: str, overrides: dict | None = None):
    """The ModelConfig `load_model(path, overrides=overrides)` builds (a checkpoint folder or
    a `random:` spec), reading no weights; ConfigError names the field."""
    from ..config import ModelConfig
    from .random_model import is_random_spec, parse_spec
    return parse_spec(path, overrides) if is_random_spec(path) else ModelConfig.from_dir(path, overrides)


def load_model(path: str, device="cpu", dtype: torch.dtype = torch.float32, keep_fp8: bool = False,
               keep_mxfp4: bool = False, overrides: dict | None = None, keep_fp8_dense: bool = False):
    """Build a `DeepseekV4` for the checkpoint at `path` (with its MTP blocks when the
    checkpoint has them) and load its weights. keep_fp8: FP8 expert weights stay FP8 (see
    `fp8_experts`; a random spec is built with FP8 experts, see `build_random_model`);
    keep_mxfp4: MXFP4 routed experts stay MXFP4 (see `mxfp4_experts`; a random spec is built
    with MXFP4 routed experts); overrides: config.json keys applied over the checkpoint's
    (`model_config`); keep_fp8_dense: the FP8 attention and dense projections stay FP8
    (dsv4/model/fp8_dense.py)."""
    from ..config import ModelConfig
    from .deepseek_v4 import DeepseekV4
    from .fp8_dense import fp8_dense_weights, keep_fp8_dense as keep_dense
    from .mtp import attach_mtp
    from .random_model import build_random_model, is_random_spec

    if is_random_spec(path):
        return build_random_model(path, device, dtype, keep_fp8=keep_fp8, keep_mxfp4=keep_mxfp4, overrides=overrides,
                                  keep_fp8_dense=keep_fp8_dense)
    cfg = ModelConfig.from_dir(path, overrides)
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
        if keep_fp8_dense and not keep_dense(model, fp8_dense_weights(path, cfg.quant_block)):
            log.warning("keep_fp8_dense: %s has no FP8 (128x128 block) dense weights; nothing is kept FP8", path)
    load_weights(model, path)
    return model.eval()
