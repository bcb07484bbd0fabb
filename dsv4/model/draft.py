"""A standalone draft checkpoint (`dsv4 convert SRC --extract-mtp DRAFT`): the MTP blocks
(`mtp.*`) and the embedding and head they share with the main model, with the main model's
config. `load_draft(model, dir)` gives a loaded main model those MTP blocks."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from .checkpoint_reader import CheckpointError
from .mtp import attach_mtp
from .weights import load_weights

# config fields a draft may differ in from its main model: the MTP ones and the storage
_DRAFT_FIELDS = ("num_nextn_predict_layers", "mtp_compress_ratio", "quant_method", "expert_dtype", "quant_block",
                 "torch_dtype")


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


def _check_same_main_model(main: ModelConfig, draft: ModelConfig) -> None:
    for f in dataclasses.fields(ModelConfig):
        if f.compare and f.name not in _DRAFT_FIELDS and getattr(main, f.name) != getattr(draft, f.name):
            raise CheckpointError(f"draft config field {f.name} = {getattr(draft, f.name)!r} differs from the "
                                  f"model's {getattr(main, f.name)!r}")
