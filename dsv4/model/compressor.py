"""The compressors (CSA with overlap, HCA without) and the lightning indexer."""
from __future__ import annotations

import torch
from torch import nn

from ..config import CSA_RATIO, HCA_RATIO, ModelConfig
from ..ops.compress import close_groups, ring_write
from ..ops.indexer import indexer_topk, indexer_topk_offsets
from ..ops.kv_fp8 import is_packed, write_entries, write_index_keys
from ..ops.rope import apply_rope
from ..ops.paged import PagedRows
from .forward_batch import CompressPlan
from .layers import Linear, RMSNorm, param


class Compressor(nn.Module):
    """Pools groups of `ratio` tokens into one entry of `dim` channels.

    With overlap (CSA) the projections are 2*dim wide: first half for the next group, second
    half for the own group (see ops/compress.py).
    """

    def __init__(self, cfg: ModelConfig, ratio: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.overlap = ratio, ratio == CSA_RATIO
        self.dim, self.rope_dims = dim, cfg.qk_rope_head_dim
        self.index_keys = False      # the indexer's compressor: its packed rows are FP8 index keys
        width = 2 * dim if self.overlap else dim
        self.wkv = Linear(cfg.hidden_size, width, dtype)
        self.wgate = Linear(cfg.hidden_size, width, dtype)
        self.ape = param(ratio, width, dtype=torch.float32)
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)

    def forward(self, kv: torch.Tensor, gate: torch.Tensor, plan: CompressPlan, ring_kv: torch.Tensor,
                ring_gate: torch.Tensor, pool: torch.Tensor, entry_cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """kv = wkv(x), gate = wgate(x) [T, width] (the attention's fused GEMM computes them).
        Close this step's groups into `pool` (RoPE at entry_cos_sin [G, R]), then move the
        step's tail into the ring."""
        if plan.rows.shape[0] and is_packed(pool):      # FP8 KV: close into model-dtype rows, then pack
            G = plan.rows.shape[0]
            entries = torch.empty((G, self.dim), dtype=ring_kv.dtype, device=ring_kv.device)
            close_groups(ring_kv, ring_gate, kv, gate, plan.rows, plan.ring_rows, self.ape, self.overlap,
                         self.norm.weight, self.norm.eps, *entry_cos_sin, entries,
                         torch.arange(G, device=entries.device))
            if self.index_keys:
                write_index_keys(pool, plan.entry_slot, entries)
            else:
                write_entries(pool, plan.entry_slot, entries, self.rope_dims)
        elif plan.rows.shape[0]:
            close_groups(ring_kv, ring_gate, kv, gate, plan.rows, plan.ring_rows, self.ape, self.overlap,
                         self.norm.weight, self.norm.eps, *entry_cos_sin, pool, plan.entry_slot)
        if plan.ring_dst.shape[0]:
            ring_write(ring_kv, ring_gate, kv, gate, plan.ring_dst, plan.ring_src)


class Indexer(nn.Module):
    """Lightning indexer: its own ratio-4 compressor of index keys, per-head queries from the
    attention's low-rank q, and a top-k over ReLU(q.k) weighted per head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.dim, dtype)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, dtype)
        self.compressor = Compressor(cfg, CSA_RATIO, self.dim, dtype)
        self.compressor.index_keys = True

    def select(self, weights: torch.Tensor, q_res: torch.Tensor, cand: PagedRows, keys: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """weights = weights_proj(x) [T, heads], cand: the causal entries of each token (width E4)
        -> [T, min(topk, E4)] rows of the chosen entries (-1 where fewer are causal)."""
        q = apply_rope(self.wq_b(q_res).unflatten(-1, (self.heads, self.dim)), cos, sin)
        return indexer_topk(q, weights, keys, cand, self.topk, self.heads ** -0.5)

    def select_offsets(self, weights: torch.Tensor, q_res: torch.Tensor, cand: PagedRows, keys: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`select`, also returning the offsets of the chosen entries in each token's range
        (the logical C4 entries IndexCache's shared layers reuse): (rows, offsets) [T, k]."""
        q = apply_rope(self.wq_b(q_res).unflatten(-1, (self.heads, self.dim)), cos, sin)
        return indexer_topk_offsets(q, weights, keys, cand, self.topk, self.heads ** -0.5)


def make_compressor(cfg: ModelConfig, ratio: int, dtype: torch.dtype) -> Compressor | None:
    if ratio == 0:
        return None
    assert ratio in (CSA_RATIO, HCA_RATIO)
    return Compressor(cfg, ratio, cfg.head_dim, dtype)
