"""V4 attention: low-rank q, one shared K=V head, partial interleaved RoPE, sinks, sliding
window plus (CSA) indexer-selected or (HCA) all compressed entries, inverse RoPE on the
output and the grouped low-rank output projection."""
from __future__ import annotations

import torch
from torch import nn

from ..config import CSA_RATIO, HCA_RATIO, ModelConfig
from ..ops.attention import sparse_attention
from ..ops.kv_fp8 import is_packed, write_entries
from ..ops.rope import apply_rope, norm_rope, rope_cos_sin
from ..ops.translate import translate_topk
from .compressor import Indexer, make_compressor
from .forward_batch import CompressPlan, ForwardBatch
from .kv import LayerKV
from .layers import Linear, RMSNorm, fused_linear, param


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.layer, self.ratio = layer, ratio
        self.heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.rope_dims = cfg.qk_rope_head_dim
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.head_dim, dtype)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.heads * self.head_dim // self.groups, self.groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(self.groups * cfg.o_lora_rank, cfg.hidden_size, dtype)
        self.attn_sink = param(self.heads, dtype=torch.float32)
        self.compressor = make_compressor(cfg, ratio, dtype)
        # a shared ("S") layer keeps its indexer's weights (the checkpoint has them) but never runs it
        self.indexer = Indexer(cfg, dtype) if ratio == CSA_RATIO else None
        self.configure_index_topk(cfg)

    def configure_index_topk(self, cfg: ModelConfig) -> None:
        """IndexCache role from cfg.index_topk_pattern: "F" (runs its indexer; `feeds_shared`:
        hands the top-k to the shared layers after it), "S" (reuses it) or "" (no indexer)."""
        self.index_role = cfg.index_topk_role(self.layer)
        self.feeds_shared = feeds_shared(cfg, self.layer)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, kv: LayerKV, rope: "RopeTables",
                topk: "SharedTopk | None" = None) -> torch.Tensor:
        """x [T, hidden] (normed block input) -> [T, hidden]; reads and writes this layer's cache
        views. topk: this forward's IndexCache hand-over (a producer layer writes it, a shared
        layer reads it)."""
        cos, sin = rope.for_ratio(self.ratio)
        q_a, kv_proj, *rest = fused_linear(x, self._input_linears())   # column slices of one GEMM
        q_res = self.q_norm(q_a)
        q = norm_rope(self.wq_b(q_res).unflatten(-1, (self.heads, self.head_dim)), None, self.eps, cos, sin)
        if is_packed(kv.swa):        # FP8 KV: quantised where written (dsv4/ops/kv_fp8.py)
            keys = norm_rope(kv_proj, self.kv_norm.weight, self.kv_norm.eps, cos, sin)
            write_entries(kv.swa, fb.swa_write, keys, self.rope_dims)
        else:
            norm_rope(kv_proj, self.kv_norm.weight, self.kv_norm.eps, cos, sin, out=kv.swa, rows=fb.swa_write)
        sources = [(kv.swa, fb.swa)]
        if self.ratio == CSA_RATIO:
            sources.append((kv.c4, self._select(rest, q_res, fb, kv, rope, cos, sin, topk)))
        elif self.ratio == HCA_RATIO:
            self.compressor(*rest, fb.hca, kv.ring_kv, kv.ring_gate, kv.c128, rope.entries(fb.hca))
            sources.append((kv.c128, fb.c128))
        out = sparse_attention(q, sources, self.attn_sink, self.scale, self.rope_dims)
        out = apply_rope(out, cos, sin, inverse=True)
        return self.wo_b(self._grouped_wo_a(out))

    def _input_linears(self) -> list[Linear]:
        """Every projection of the block input x, in the order forward unpacks them."""
        linears = [self.wq_a, self.wkv]
        if self.compressor is not None:
            linears += [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None and self.index_role != "S":
            linears += [self.indexer.weights_proj, self.indexer.compressor.wkv, self.indexer.compressor.wgate]
        return linears

    def _select(self, rest, q_res, fb: ForwardBatch, kv: LayerKV, rope, cos, sin, topk: "SharedTopk | None"):
        """This step's C4 entries into the pool, then the rows of the chosen ones [T, k]: the
        indexer's top-k, or (a shared layer, which skips its indexer altogether: compressor,
        projections, scores and top-k) the last producer's, at this layer's rows."""
        entries = rope.entries(fb.csa)
        self.compressor(rest[0], rest[1], fb.csa, kv.ring_kv, kv.ring_gate, kv.c4, entries)
        if self.index_role == "S":
            if topk is None or topk.offsets is None:
                raise RuntimeError(f"layer {self.layer}: a shared CSA layer needs its producer's top-k in the "
                                   f"same forward (SharedTopk)")
            return translate_topk(fb.c4, topk.offsets)
        i_weights, i_kv, i_gate = rest[2:]
        self.indexer.compressor(i_kv, i_gate, fb.csa, kv.iring_kv, kv.iring_gate, kv.idx, entries)
        if not self.feeds_shared or topk is None:
            return self.indexer.select(i_weights, q_res, fb.c4, kv.idx, cos, sin)
        rows, topk.offsets = self.indexer.select_offsets(i_weights, q_res, fb.c4, kv.idx, cos, sin)
        return rows

    def _grouped_wo_a(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, H, D] -> [T, G * o_lora]: each group of heads has its own projection."""
        return self.wo_a.grouped(out.flatten(1), self.groups)                  # weight [G * o_lora, H*D/G]


class SharedTopk:
    """IndexCache inside one forward: `offsets` [T, k] long, the indexer top-k of the last
    producer CSA layer that feeds shared ones, as offsets into each token's `fb.c4` range
    (= logical C4 entries, -1 = none). DeepseekV4.forward makes one per forward and hands it
    to the blocks in order, so nothing outlives the forward (under a CUDA graph it is a tensor
    of the graph's pool, written whole by the producer before any shared layer reads it)."""

    def __init__(self):
        self.offsets: torch.Tensor | None = None


def feeds_shared(cfg: ModelConfig, layer: int) -> bool:
    """Whether producer layer `layer` must hand its top-k over: the next CSA layer is shared."""
    if cfg.index_topk_role(layer) != "F" or layer >= cfg.num_hidden_layers:
        return False
    later = [cfg.index_topk_role(i) for i in range(layer + 1, cfg.num_hidden_layers)]
    return next((r for r in later if r), "") == "S"


class RopeTables:
    """cos/sin [rows, R] of the step's token positions for both RoPE kinds and of each compress
    plan's entry positions (compress kind), all computed in one pass per forward."""

    def __init__(self, fb: ForwardBatch, main_freq: torch.Tensor, compress_freq: torch.Tensor):
        R, T, G4 = main_freq.shape[0], fb.num_tokens, fb.csa.entry_pos.shape[0]
        positions = torch.cat([fb.positions, fb.csa.entry_pos, fb.hca.entry_pos])    # [T + G4 + G128]
        cos, sin = rope_cos_sin(positions, torch.cat([main_freq, compress_freq]))      # [., 2R]: both kinds
        self.main = cos[:T, :R], sin[:T, :R]
        self.compress = cos[:T, R:], sin[:T, R:]
        self._entries = {id(fb.csa): (cos[T:T + G4, R:], sin[T:T + G4, R:]),
                         id(fb.hca): (cos[T + G4:, R:], sin[T + G4:, R:])}

    def for_ratio(self, ratio: int):
        return self.main if ratio == 0 else self.compress

    def entries(self, plan: CompressPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [G, R] at the first position of each group the plan closes."""
        return self._entries[id(plan)]
