"""The oracle: transformers' `DeepseekV4ForCausalLM` built from any checkpoint dsv4 loads.
A transformers-named, unquantised checkpoint is loaded by transformers itself; anything
else (DeepSeek names, FP8/MXFP4) is converted in memory."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .names import ds_to_hf
from .weights import checkpoint_keys, iter_checkpoint

INSTALL_HINT = "the reference needs transformers>=5.23: pip install 'dsv4[check]'"


def _transformers():
    try:
        import transformers
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as e:
        raise RuntimeError(INSTALL_HINT) from e
    return transformers, DeepseekV4Config, DeepseekV4ForCausalLM


def load_reference(path: str, device="cpu", dtype: torch.dtype = torch.float32):
    _, _, model_cls = _transformers()
    cfg = ModelConfig.from_dir(path)
    keys = checkpoint_keys(path)
    native = all(k.startswith("model.") or k == "lm_head.weight" for k in keys) and not cfg.quant_method
    if native:
        return model_cls.from_pretrained(path, dtype=dtype).to(device).eval()
    return _build(cfg, iter_checkpoint(path, cfg.quant_block), device, dtype)


def reference_from_model(model, dtype: torch.dtype | None = None):
    """The reference with the weights of a loaded dsv4 model (e.g. a `random:` spec)."""
    device = next(model.parameters()).device
    named = ((n, None, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
             if "freq" not in n)
    return _build(model.cfg, named, device, dtype or model.dtype)


def _build(cfg: ModelConfig, named, device, dtype):
    _, config_cls, model_cls = _transformers()
    with torch.device(device):
        model = model_cls(config_cls(**cfg.to_transformers_dict())).to(dtype)
    _keep_fp32(model)
    model.load_state_dict(_convert(named), strict=True)
    return model.eval()


def _convert(named) -> dict[str, torch.Tensor]:
    """(DeepSeek name, expert, tensor) -> transformers names (per-expert tensors stacked)."""
    state, experts = {}, {}
    for name, expert, tensor in named:
        if name.startswith("mtp."):
            continue
        if ".ffn.experts." in name:
            experts.setdefault(name, {})[expert] = tensor
        else:
            state[ds_to_hf(name)] = tensor
    stacked = {n: (torch.stack([d[e] for e in sorted(d)]) if None not in d else d[None]) for n, d in experts.items()}
    for name in [n for n in stacked if n.endswith(".w1")]:
        prefix = "model." + name[: -len(".ffn.experts.w1")]
        state[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([stacked[name], stacked[name[:-1] + "3"]], dim=1)
        state[f"{prefix}.mlp.experts.down_proj"] = stacked[name[:-1] + "2"]
    return state


def _keep_fp32(model) -> None:
    """transformers keeps these modules in fp32 whatever the model dtype."""
    for name, module in model.named_modules():
        if any(part in name.split(".") for part in model._keep_in_fp32_modules_strict):
            module.float()
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith(("sinks", "position_bias", "e_score_correction_bias", "inv_freq")):
            p.data = p.data.float()
