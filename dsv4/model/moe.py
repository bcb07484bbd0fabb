"""V4 MoE: sqrtsoftplus router (bias only for selection) or hash routing by token id,
routed experts with clamped SwiGLU scaled by routed_scaling_factor, one shared expert."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.moe import moe_experts, route_hash, route_topk
from .layers import Linear, param


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        self.is_hash, self.topk, self.scaling = is_hash, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = param(cfg.n_routed_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_hash:
            return route_hash(x, self.weight, token_ids, self.tid2eid, self.scaling)
        return route_topk(x, self.weight, self.bias, self.topk, self.scaling)


class Experts(nn.Module):
    """Routed experts stacked: w1/w3 [E, I, H] (gate/up), w2 [E, H, I] (down)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.w1, self.w2, self.w3 = param(E, I, H, dtype=dtype), param(E, H, I, dtype=dtype), param(E, I, H, dtype=dtype)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        I, H = cfg.moe_intermediate_size, cfg.hidden_size
        self.w1, self.w2, self.w3 = Linear(H, I, dtype), Linear(I, H, dtype), Linear(H, I, dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, cfg.is_hash_layer(layer), dtype)
        self.experts = Experts(cfg, dtype)
        self.shared_experts = SharedExpert(cfg, dtype)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, token_ids)
        e, s = self.experts, self.shared_experts
        return moe_experts(x, weights, ids, e.w1, e.w2, e.w3, (s.w1.weight, s.w2.weight, s.w3.weight),
                           self.limit)
