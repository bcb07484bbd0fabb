"""A standalone draft checkpoint (`dsv4 convert SRC --extract-mtp DRAFT`): the MTP blocks
(`mtp.*`) and the embedding and head they share with the main model, with the main model's
config. `load_draft(model, dir)` gives a loaded main model those MTP blocks.

A DSpark draft folder (docs/speculative.md "DSpark"): the main model's config plus the DSpark
fields, and only the stages' tensors (`mtp.*`; embedding and head are the main model's).
`load_dspark_draft(model, dir)` gives a loaded main model those stages in place of its MTP blocks."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from .checkpoint_reader import CheckpointError
from .dspark import attach_dspark
from .mtp import attach_mtp
from .weights import load_weights

# config fields a draft may differ in from its main model: the MTP ones and the storage
_DRAFT_FIELDS = ("num_nextn_predict_layers", "mtp_compress_ratio", "quant_method", "expert_dtype", "quant_block",
                 "torch_dtype")
_DSPARK_FIELDS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")


def load_draft(model, path: str) -> None:
    """Replace `model.mtp` by the MTP blocks of the draft checkpoint at `path`, whose embed and
    head must equal the model's (else CheckpointError) and whose config must describe the same
    main model (else CheckpointError naming the first field that differs)."""
    draft_cfg = ModelConfig.from_dir(path)
    _check_same_main_model(model.cfg, draft_cfg)
    if not draft_cfg.num_nextn_predict_layers:
        raise CheckpointError(f"draft {path!r}: config field num_nextn_predict_layers is 0 (no MTP block)")
    model.cfg = model.cfg.replace(num_nextn_predict_layers=draft_cfg.num_nextn_predict_layers,
                                  mtp_compress_ratio=draft_cfg.mtp_compress_ratio)
    model.mtp = nn.ModuleList()
    with torch.device(model.embed.weight.device):
        attach_mtp(model)
    targets = dict(model.mtp.named_parameters(prefix="mtp"))
    targets.update((n, b) for n, b in model.mtp.named_buffers(prefix="mtp") if n.endswith("tid2eid"))
    load_weights(model, path, targets, shared={"embed.weight": model.embed.weight, "head.weight": model.head.weight})


def load_dspark_draft(model, path: str) -> None:
    """Replace `model.mtp` by the DSpark stages of the draft folder at `path` and give the
    model's config its DSpark fields; the folder's config must describe the same main model
    (else CheckpointError naming the first field that differs) and have dspark_block_size."""
    draft_cfg = ModelConfig.from_dir(path)
    _check_same_main_model(model.cfg, draft_cfg, _DRAFT_FIELDS + _DSPARK_FIELDS)
    if not draft_cfg.dspark_block_size or not draft_cfg.num_nextn_predict_layers:
        raise CheckpointError(f"DSpark draft {path!r}: config has no DSpark drafter (dspark_block_size unset "
                              "or num_nextn_predict_layers 0)")
    model.cfg = model.cfg.replace(num_nextn_predict_layers=draft_cfg.num_nextn_predict_layers, mtp_compress_ratio=0,
                                  **{name: getattr(draft_cfg, name) for name in _DSPARK_FIELDS})
    model.mtp = nn.ModuleList()
    with torch.device(model.embed.weight.device):
        attach_dspark(model)
    targets = dict(model.mtp.named_parameters(prefix="mtp"))
    targets.update((n, b) for n, b in model.mtp.named_buffers(prefix="mtp") if n.endswith("tid2eid"))
    load_weights(model, path, targets)


def _check_same_main_model(main: ModelConfig, draft: ModelConfig, free: tuple[str, ...] = _DRAFT_FIELDS) -> None:
    for f in dataclasses.fields(ModelConfig):
        if f.compare and f.name not in free and getattr(main, f.name) != getattr(draft, f.name):
            raise CheckpointError(f"draft config field {f.name} = {getattr(draft, f.name)!r} differs from the "
                                  f"model's {getattr(main, f.name)!r}")
