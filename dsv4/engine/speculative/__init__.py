"""Speculative decoding (docs/architecture.md, "Speculative decoding"): drafters (`mtp.py`),
verification and acceptance (`verify.py`), the step that ties them to the engine
(`decoder.py`) and its counters (`stats.py`)."""
from __future__ import annotations

from ...config import ConfigError, SpeculativeConfig

DSPARK_DRAFT_DIR = "dspark"     # a checkpoint folder's own DSpark draft folder (model/draft.py)


def check_speculative(spec: SpeculativeConfig, model, model_dir: str | None = None) -> None:
    """Give `model` the draft checkpoint's MTP blocks (or DSpark stages) when `spec.model` names
    one, then check that it can draft: ConfigError naming `speculative_config` otherwise. Method
    'dspark' on a checkpoint without DSpark stages takes them from `model_dir`'s DSpark draft
    folder `dspark/` when it has one (the demo model's trained drafter, docs/demo-model.md)."""
    if spec.method == "dspark":
        return _check_dspark(spec, model, model_dir)
    if spec.model is not None:
        from ...model.draft import load_draft
        load_draft(model, spec.model)
    if model.cfg.dspark_block_size:
        raise ConfigError("speculative_config", "method 'mtp': the model's mtp.* blocks are DSpark stages "
                                                "(dspark_block_size is set); use method 'dspark'")
    if not len(model.mtp):
        raise ConfigError("speculative_config", "method 'mtp': the model has no MTP block (config "
                                                f"num_nextn_predict_layers = {model.cfg.num_nextn_predict_layers}, "
                                                "no mtp.* weights loaded); name a draft checkpoint with "
                                                "\"model\": DIR (dsv4 convert SRC DIR --extract-mtp)")
    if model.cfg.mtp_compress_ratio != 0:
        raise ConfigError("speculative_config", f"method 'mtp': MTP blocks with compress ratio "
                                                f"{model.cfg.mtp_compress_ratio} are not supported (sliding "
                                                "window only: ratio 0)")


def _check_dspark(spec: SpeculativeConfig, model, model_dir: str | None) -> None:
    import os
    from ...model.draft import load_dspark_draft
    bundled = os.path.join(model_dir, DSPARK_DRAFT_DIR) if model_dir else None
    if spec.model is not None:
        load_dspark_draft(model, spec.model)
    elif not model.cfg.dspark_block_size and bundled and os.path.isfile(os.path.join(bundled, "config.json")):
        load_dspark_draft(model, bundled)
    cfg = model.cfg
    if not cfg.dspark_block_size or not len(model.mtp):
        raise ConfigError("speculative_config", "method 'dspark': the model has no DSpark drafter (config "
                                                "dspark_block_size unset or no mtp.* weights loaded)")
    if spec.num_speculative_tokens > cfg.dspark_block_size:
        raise ConfigError("speculative_config", f"num_speculative_tokens: at most dspark_block_size = "
                                                f"{cfg.dspark_block_size} for method 'dspark', got "
                                                f"{spec.num_speculative_tokens}")
