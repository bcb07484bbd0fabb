"""V4 attention: low-rank q, one shared K=V head, partial interleaved RoPE, sinks, sliding
window plus (CSA) indexer-selected or (HCA) all compressed entries, inverse RoPE on the
output and the grouped low-rank output projection."""
from __future__ import annotations

import torch
from torch import nn

from ..config import CSA_RATIO, HCA_RATIO, ModelConfig
from ..ops.attention import sparse_attention
from ..ops.norm import rms_norm_unweighted
from ..ops.rope import apply_rope
from .compressor import Indexer, make_compressor
from .forward_batch import ForwardBatch
from .layers import Linear, RMSNorm, param


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.layer, self.ratio = layer, ratio
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.head_dim, dtype)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.heads * self.head_dim // self.groups, self.groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(self.groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = param(self.heads, dtype=torch.float32)
        self.compressor = make_compressor(cfg, ratio, dtype)
        self.indexer = Indexer(cfg, dtype) if ratio == CSA_RATIO else None

    def forward(self, x: torch.Tensor, fb: ForwardBatch, pools, rope: "RopeTables") -> torch.Tensor:
        """x [T, hidden] (normed block input) -> [T, hidden]."""
        cos, sin = rope.for_ratio(self.ratio)
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).unflatten(-1, (self.heads, self.head_dim))
        q = apply_rope(rms_norm_unweighted(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        swa = pools.swa[self.layer]
        swa[fb.swa_write] = kv.to(swa.dtype)
        sources = [(swa, fb.swa_idx)]
        if self.ratio == CSA_RATIO:
            sources.append((pools.c4[self.layer], self._select(x, q_res, fb, pools, rope, cos, sin)))
        elif self.ratio == HCA_RATIO:
            self.compressor(x, fb.hca, pools.ring_kv[self.layer], pools.ring_gate[self.layer],
                            pools.c128[self.layer], rope.compress_freq)
            sources.append((pools.c128[self.layer], fb.c128_idx))
        out = sparse_attention(q, sources, self.attn_sink, self.scale)
        out = apply_rope(out, cos, sin, inverse=True)
        return self.wo_b(self._grouped_wo_a(out))

    def _select(self, x, q_res, fb, pools, rope, cos, sin):
        l = self.layer
        self.compressor(x, fb.csa, pools.ring_kv[l], pools.ring_gate[l], pools.c4[l], rope.compress_freq)
        self.indexer.compressor(x, fb.csa, pools.iring_kv[l], pools.iring_gate[l], pools.idx[l],
                                rope.compress_freq)
        return self.indexer.select(x, q_res, fb.c4_cand, pools.idx[l], cos, sin)

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, H, D] -> [T, G * o_lora]: each group of heads has its own projection."""
        grouped = out.flatten(1).unflatten(-1, (self.groups, -1))              # [T, G, H*D/G]
        w = self.wo_a.weight.unflatten(0, (self.groups, -1))                     # [G, o_lora, H*D/G]
        return torch.einsum("tgi,goi->tgo", grouped, w).flatten(1)


class RopeTables:
    """cos/sin of the step's positions for both RoPE kinds, computed once per forward."""

    def __init__(self, positions: torch.Tensor, main_freq: torch.Tensor, compress_freq: torch.Tensor):
        from ..ops.rope import rope_cos_sin
        self.main = rope_cos_sin(positions, main_freq)
        self.compress = rope_cos_sin(positions, compress_freq)
        self.compress_freq = compress_freq

    def for_ratio(self, ratio: int):
        return self.main if ratio == 0 else self.compress
