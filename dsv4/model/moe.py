"""V4 MoE: sqrtsoftplus router (bias only for selection) or hash routing by token id (image
rows: by score with the vision bias `bias_vl`, on every layer; docs/vision.md), routed experts with clamped SwiGLU scaled by routed_scaling_factor, one shared expert."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.moe import moe_experts, route_hash, route_topk
from .layers import Linear, param
from ..ops.quant import kept_scale_shape


def _scale_param(rows: int, cols: int, *lead: int) -> torch.nn.Parameter:
    """fp32 scales of an FP8 matrix [..., rows, cols], one per 128x128 block."""
    return param(*kept_scale_shape((*lead, rows, cols), "fp8"), dtype=torch.float32)


def _mxfp4_params(rows: int, cols: int, *lead: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """An MXFP4 matrix [..., rows, cols]: packed uint8 [..., rows, cols/2] (two e2m1 values per
    byte along the input dim, low nibble first) and E8M0 bytes [..., rows, cols/32]."""
    packed = (*lead, rows, cols // 2)
    return param(*packed, dtype=torch.uint8), param(*kept_scale_shape(packed, "mxfp4"), dtype=torch.uint8)


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        self.is_hash, self.topk, self.scaling = is_hash, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = param(cfg.n_routed_experts, dtype=torch.float32)
        if cfg.vision is not None:
            self.bias_vl = param(cfg.n_routed_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """image_mask [T] bool: rows of image blocks, routed by score + bias_vl instead (hash
        layers included: an image row has no token id to hash)."""
        if self.is_hash:
            weights, ids = route_hash(x, self.weight, token_ids, self.tid2eid, self.scaling)
        else:
            weights, ids = route_topk(x, self.weight, self.bias, self.topk, self.scaling)
        if image_mask is None:
            return weights, ids
        w_img, id_img = route_topk(x[image_mask], self.weight, self.bias_vl, self.topk, self.scaling)
        weights = weights.index_put((image_mask,), w_img)
        return weights, ids.index_put((image_mask,), id_img.to(ids.dtype))


class Experts(nn.Module):
    """Routed experts stacked: w1/w3 [E, I, H] (gate/up), w2 [E, H, I] (down). fp8: kept as
    float8_e4m3fn with fp32 block scales w1_scale/w3_scale [E, cdiv(I, 128), cdiv(H, 128)] and
    w2_scale [E, cdiv(H, 128), cdiv(I, 128)]; mxfp4: kept packed, uint8 w1/w3 [E, I, H/2] and w2
    [E, H, I/2] with E8M0 bytes w1_scale/w3_scale [E, I, H/32], w2_scale [E, H, I/32]
    (dequantised in the kernels)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8: bool = False, mxfp4: bool = False):
        super().__init__()
        assert not (fp8 and mxfp4), "routed experts: FP8 or MXFP4, not both"
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if mxfp4:
            (self.w1, self.w1_scale), (self.w2, self.w2_scale), (self.w3, self.w3_scale) = (
                _mxfp4_params(I, H, E), _mxfp4_params(H, I, E), _mxfp4_params(I, H, E))
            return
        wdtype = torch.float8_e4m3fn if fp8 else dtype
        self.w1, self.w2, self.w3 = param(E, I, H, dtype=wdtype), param(E, H, I, dtype=wdtype), param(E, I, H, dtype=wdtype)
        if fp8:
            self.w1_scale, self.w2_scale, self.w3_scale = _scale_param(I, H, E), _scale_param(H, I, E), _scale_param(I, H, E)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return (self.w1_scale, self.w2_scale, self.w3_scale) if hasattr(self, "w1_scale") else None


class SharedExpert(nn.Module):
    """w1/w3 [I, H], w2 [H, I]; fp8: float8_e4m3fn, each Linear with its fp32 `scale`
    [cdiv(out, 128), cdiv(in, 128)] (the checkpoint's name)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8: bool = False):
        super().__init__()
        I, H = cfg.moe_intermediate_size, cfg.hidden_size
        wdtype = torch.float8_e4m3fn if fp8 else dtype
        self.w1, self.w2, self.w3 = Linear(H, I, wdtype), Linear(I, H, wdtype), Linear(H, I, wdtype)
        if fp8:
            for lin in (self.w1, self.w2, self.w3):
                lin.scale = _scale_param(*lin.weight.shape)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        return tuple(lin.scale for lin in (self.w1, self.w2, self.w3)) if hasattr(self.w1, "scale") else None


class MoE(nn.Module):
    """fp8_experts = (routed, shared): keep those expert weights FP8 (`EngineConfig.keep_fp8`);
    mxfp4_experts: keep the routed ones MXFP4 (`EngineConfig.keep_mxfp4`; the shared expert then
    runs unquantised or FP8, as fp8_experts[1] says)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype,
                 fp8_experts: tuple[bool, bool] = (False, False), mxfp4_experts: bool = False):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, cfg.is_hash_layer(layer), dtype)
        self.experts = Experts(cfg, dtype, fp8_experts[0], mxfp4_experts)
        self.shared_experts = SharedExpert(cfg, dtype, fp8_experts[1])

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids, image_mask)
        e, s = self.experts, self.shared_experts
        return moe_experts(x, weights, ids, e.w1, e.w2, e.w3, (s.w1.weight, s.w2.weight, s.w3.weight),
                           self.limit, scales=e.scales(), shared_scales=s.scales())
