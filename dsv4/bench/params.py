"""Parameter inventory of a DeepSeek-V4 model, grouped by how a serving step reads it.

Counts are weight *elements* (not bytes), derived from a `ModelConfig` alone; the shapes
follow the released checkpoints (and transformers' `DeepseekV4ForCausalLM`):

  attention   wq_a [q_lora, D], wq_b [H*hd, q_lora], wkv [hd, D],
              wo_a [o_groups*o_lora, H*hd/o_groups] (grouped), wo_b [D, o_groups*o_lora]
  compressor  wkv + wgate, each [2*hd, D] on CSA layers (overlapping windows carry two
              halves) and [hd, D] on HCA layers; none on sliding layers
  indexer     (CSA only) wq_b [iH*ihd, q_lora], weights_proj [iH, D],
              its compressor wkv + wgate, each [2*ihd, D]
  mHC         per block (attention, ffn): fn [(2+N)*N, N*D], base [(2+N)*N], scale [3]
  MoE         gate [E, D]; shared expert and each routed expert: w1, w3 [I, D], w2 [D, I]
  model       embed [V, D], head [V, D], hc_head fn [N, N*D] + base [N] + scale [1]

1-D vectors (RMSNorm weights, attention sinks, compressor `ape`, gate bias) are left out:
together they are < 0.01 % of the bytes of any step. The MTP layer is not counted.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.config import CSA_RATIO, HCA_RATIO, ModelConfig


@dataclass(frozen=True)
class LayerParams:
    """Weight elements of one decoder layer, split by role (and so by stored precision)."""
    attention: int          # wq_a, wq_b, wkv, wo_a, wo_b
    compressor: int         # compressor wkv + wgate (0 on sliding layers)
    indexer_query: int      # indexer wq_b (0 off CSA layers)
    indexer_aux: int        # indexer weights_proj + its compressor wkv/wgate (0 off CSA layers)
    hyper_connections: int  # fn + base + scale of the attention block's and the ffn block's mHC
    gate: int               # router weight
    shared_expert: int      # w1, w2, w3 of the shared expert
    routed_expert: int      # w1, w2, w3 of ONE routed expert

    @property
    def dense(self) -> int:
        """Elements every token of a step uses: all but the routed experts."""
        return (self.attention + self.compressor + self.indexer_query + self.indexer_aux
                + self.hyper_connections + self.gate + self.shared_expert)


@dataclass(frozen=True)
class ModelParams:
    vocab_size: int
    hidden_size: int
    hc_head: int            # final mHC collapse: fn + base + scale
    layers: tuple[LayerParams, ...]
    n_routed_experts: int
    experts_per_token: int

    @property
    def embed(self) -> int:
        """[V, D]; a step reads one row per token."""
        return self.vocab_size * self.hidden_size

    @property
    def head(self) -> int:
        """[V, D]; a step reads all of it."""
        return self.vocab_size * self.hidden_size

    @property
    def total(self) -> int:
        per_layer = sum(p.dense + self.n_routed_experts * p.routed_expert for p in self.layers)
        return self.embed + self.head + self.hc_head + per_layer

    @property
    def active_per_token(self) -> int:
        """Elements one token uses: one embedding row, every dense weight, the top-k
        routed experts of each layer, hc_head and the head."""
        per_layer = sum(p.dense + self.experts_per_token * p.routed_expert for p in self.layers)
        return self.hidden_size + per_layer + self.hc_head + self.head


def model_params(cfg: ModelConfig) -> ModelParams:
    return ModelParams(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        hc_head=cfg.hc_mult * cfg.hc_mult * cfg.hidden_size + cfg.hc_mult + 1,
        layers=tuple(layer_params(cfg, i) for i in range(cfg.num_hidden_layers)),
        n_routed_experts=cfg.n_routed_experts,
        experts_per_token=cfg.num_experts_per_tok,
    )


def layer_params(cfg: ModelConfig, layer: int) -> LayerParams:
    ratio = cfg.compress_ratios[layer]
    d, hd = cfg.hidden_size, cfg.head_dim
    heads_dim = cfg.num_attention_heads * hd
    attention = (d * cfg.q_lora_rank + cfg.q_lora_rank * heads_dim + d * hd
                 + heads_dim * cfg.o_lora_rank  # wo_a: o_groups blocks of [o_lora, heads_dim/o_groups]
                 + cfg.o_groups * cfg.o_lora_rank * d)
    compressor_out = {0: 0, CSA_RATIO: 2 * hd, HCA_RATIO: hd}[ratio]
    on_csa = ratio == CSA_RATIO
    indexer_query = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim if on_csa else 0
    indexer_aux = (d * cfg.index_n_heads + 2 * d * 2 * cfg.index_head_dim) if on_csa else 0
    n = cfg.hc_mult
    one_hc = (2 + n) * n * (n * d) + (2 + n) * n + 3
    expert = 3 * d * cfg.moe_intermediate_size
    return LayerParams(attention=attention, compressor=2 * d * compressor_out,
                       indexer_query=indexer_query, indexer_aux=indexer_aux,
                       hyper_connections=2 * one_hc, gate=cfg.n_routed_experts * d,
                       shared_expert=expert, routed_expert=expert)
