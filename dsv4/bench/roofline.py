"""Roofline model of a DeepSeek-V4 serving step: the bytes it must move, the FLOPs it must
do, and the time neither HBM nor the tensor cores can beat.

Conventions (every count below follows them):
  * context c of a query = the tokens it attends over = its position + 1. It sees
    min(c, W) sliding-window keys, c // 4 CSA entries (the top min(index_topk, c // 4) of
    which it reads, after the indexer scored all c // 4 indexer keys) and c // 128 HCA
    entries; the same limits as "entry e is visible iff e < (t+1) // ratio".
  * Weights are read once per step, however many tokens the step has (a lower bound).
  * Routed experts touched by a step of T tokens, top-k of E, assuming *uniform,
    independent routing*: E * (1 - (1 - k/E)^T) per layer (hash layers included). Real
    routing is skewed, so real steps touch fewer distinct experts than this.
  * Decode: every sequence reads its own history (no sharing across the batch); each
    writes one SWA key per layer and, amortised over a group, 1/ratio compressed entry.
  * Prefill of one chunk: the state that existed before the chunk (SWA keys, all
    compressed entries) is read once; the chunk's own keys and new entries are written once.
    Logits (hc_head + head matmul) are computed for the last token only.
  * FLOPs = 2 x weight elements used x tokens (projections, experts, gate, mHC fn, head)
    + attention 4 * head_dim * keys per head per token (QK^T and PV)
    + indexer 2 * index_n_heads * index_head_dim * (c // 4) per token on CSA layers.
    Norms, softmax, Sinkhorn, RoPE and the compressors' pooling are left out.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.config import CSA_RATIO, HCA_RATIO, ModelConfig
from dsv4.bench.context_sums import sum_entries, sum_selected, sum_window
from dsv4.bench.params import LayerParams, ModelParams, model_params

FP32_BYTES = 4  # mHC parameters are FP32 in every released checkpoint


@dataclass(frozen=True)
class Precision:
    """Bytes per stored element, by role. The released checkpoints keep the projections in
    FP8 (+ block scales), routed experts in MXFP4, and embed/head/compressors/indexer
    weights_proj/gate in BF16 (`aux`)."""
    weight_bytes: float = 2.0      # wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b
    expert_bytes: float = 2.0      # routed experts
    aux_weight_bytes: float = 2.0  # embed, head, compressor wkv/wgate, weights_proj, gate
    kv_bytes: float = 2.0          # one element of a K=V vector or a compressed entry
    index_kv_bytes: float = 2.0    # one element of an indexer key
    shared_expert_bytes: float = 2.0

    @classmethod
    def uniform(cls, weight_bytes: float, kv_bytes: float) -> "Precision":
        """Every weight `weight_bytes`, every cached element `kv_bytes`."""
        return cls(weight_bytes, weight_bytes, weight_bytes, kv_bytes, kv_bytes, weight_bytes)


BF16 = Precision.uniform(2.0, 2.0)
# FP8 + one E8M0 scale per 128x128 block; MXFP4 + one E8M0 scale per 32; KV packed as
# 584 B per 512-dim vector; indexer keys 128 B FP8 + 4 B scale per 128-dim key.
RELEASED_FP8_FP4 = Precision(weight_bytes=1 + 1 / (128 * 128), expert_bytes=0.5 + 1 / 32,
                             aux_weight_bytes=2.0, kv_bytes=584 / 512, index_kv_bytes=132 / 128,
                             shared_expert_bytes=1 + 1 / (128 * 128))
# dsv4 in bf16 with `--keep-fp8` on an FP8-expert checkpoint: routed and shared experts FP8 +
# one fp32 scale per 128x128 block, everything else bf16
BF16_FP8_EXPERTS = Precision(expert_bytes=1 + 4 / (128 * 128), shared_expert_bytes=1 + 4 / (128 * 128))
# ... with `--keep-mxfp4` on the released format: routed experts MXFP4 + one E8M0 byte per 32,
# the shared expert (FP8 in the checkpoint) dequantised to bf16 at load, like everything else
BF16_MXFP4_EXPERTS = Precision(expert_bytes=0.5 + 1 / 32)


@dataclass(frozen=True)
class StepCost:
    bytes_weights: float  # weights read
    bytes_history: float  # KV / compressed / indexer state read
    bytes_written: float  # new KV and compressed entries written
    flops: float

    @property
    def bytes_total(self) -> float:
        return self.bytes_weights + self.bytes_history + self.bytes_written

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.bytes_weights + other.bytes_weights, self.bytes_history + other.bytes_history,
                        self.bytes_written + other.bytes_written, self.flops + other.flops)


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bandwidth: float  # bytes/s
    dense_flops: float    # bf16 dense tensor-core FLOP/s

    def measured(self, bandwidth: float | None = None, flops: float | None = None) -> "GPU":
        """This GPU with measured figures in place of the nominal ones."""
        return GPU(self.name, bandwidth or self.hbm_bandwidth, flops or self.dense_flops)


H200 = GPU("H200", hbm_bandwidth=4.8e12, dense_flops=989e12)


@dataclass(frozen=True)
class RooflineTimes:
    time_memory: float   # seconds to move the bytes at full bandwidth
    time_compute: float  # seconds to do the FLOPs at peak
    seconds: float       # max of the two: no step can be faster
    limited_by: str      # "memory" or "compute"


def expected_experts_touched(n_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts a step of `tokens` tokens touches in one layer, each token choosing
    `top_k` of `n_experts` uniformly: each expert is missed by one token with probability
    1 - k/E, by all of them with (1 - k/E)^T."""
    if tokens <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step_cost(cfg: ModelConfig, batch: int, context: int,
                     precision: Precision = BF16) -> StepCost:
    """One decode step: `batch` sequences, each with a new token whose context is
    `context` tokens (see the module's conventions)."""
    _check_at_least(0, batch=batch)
    _check_at_least(1, context=context)  # a query sees at least itself
    params = model_params(cfg)
    weights = _weight_bytes(params, batch, precision)
    history = batch * sum(_history_read_per_query(cfg, r, context, precision) for r in cfg.compress_ratios)
    written = batch * sum(_written_per_token(cfg, r, precision) for r in cfg.compress_ratios)
    flops = batch * (_matmul_flops_per_token(params) + _logit_flops(params)
                     + sum(_attention_flops(cfg, r, context - 1, 1) for r in cfg.compress_ratios))
    return StepCost(weights, history, written, flops)


def prefill_cost(cfg: ModelConfig, tokens: int, context_start: int = 0,
                 precision: Precision = BF16) -> StepCost:
    """One prefill chunk of `tokens` tokens of one sequence whose first `context_start`
    tokens are already cached (contexts context_start+1 … context_start+tokens)."""
    _check_at_least(0, tokens=tokens, context_start=context_start)
    params = model_params(cfg)
    weights = _weight_bytes(params, tokens, precision)
    history = sum(_history_read_by_chunk(cfg, r, context_start, precision) for r in cfg.compress_ratios)
    written = sum(_written_by_chunk(cfg, r, context_start, tokens, precision) for r in cfg.compress_ratios)
    flops = (tokens * _matmul_flops_per_token(params) + (_logit_flops(params) if tokens else 0)
             + sum(_attention_flops(cfg, r, context_start, tokens) for r in cfg.compress_ratios))
    return StepCost(weights, history, written, flops)


def indexer_cost(cfg: ModelConfig, tokens: int, context_start: int = 0,
                 precision: Precision = BF16) -> StepCost:
    """The indexer's O(E) part of a prefill chunk (as `prefill_cost` counts it): scoring every
    visible C4 entry for each token (FLOPs) and reading the pre-existing indexer keys once,
    over the CSA layers."""
    _check_at_least(0, tokens=tokens, context_start=context_start)
    csa = sum(1 for r in cfg.compress_ratios if r == CSA_RATIO)
    keys = context_start // CSA_RATIO * cfg.index_head_dim * precision.index_kv_bytes
    return StepCost(0.0, csa * keys, 0.0, csa * _indexer_flops(cfg, context_start, tokens))


def roofline(cost: StepCost, bandwidth: float = H200.hbm_bandwidth,
             peak_flops: float = H200.dense_flops) -> RooflineTimes:
    t_mem = cost.bytes_total / bandwidth
    t_comp = cost.flops / peak_flops
    return RooflineTimes(t_mem, t_comp, max(t_mem, t_comp), "memory" if t_mem >= t_comp else "compute")


def bound_seconds(cost: StepCost, bandwidth: float = H200.hbm_bandwidth,
                  peak_flops: float = H200.dense_flops) -> float:
    """The least time the step can take: max(bytes / bandwidth, flops / peak)."""
    return roofline(cost, bandwidth, peak_flops).seconds


# ---- weights -------------------------------------------------------------------------
def _weight_bytes(params: ModelParams, tokens: int, p: Precision) -> float:
    """Weights a step of `tokens` tokens reads: embedding rows, every dense weight, the
    expected distinct routed experts, hc_head and the whole head."""
    if tokens == 0:
        return 0.0
    experts = expected_experts_touched(params.n_routed_experts, params.experts_per_token, tokens)
    embed_rows = min(tokens, params.vocab_size) * params.hidden_size
    layers = sum(_dense_layer_bytes(layer, p) + experts * layer.routed_expert * p.expert_bytes
                 for layer in params.layers)
    return (embed_rows + params.head) * p.aux_weight_bytes + params.hc_head * FP32_BYTES + layers


def _dense_layer_bytes(layer: LayerParams, p: Precision) -> float:
    return ((layer.attention + layer.indexer_query) * p.weight_bytes + layer.shared_expert * p.shared_expert_bytes
            + (layer.compressor + layer.indexer_aux + layer.gate) * p.aux_weight_bytes
            + layer.hyper_connections * FP32_BYTES)


def _matmul_flops_per_token(params: ModelParams) -> float:
    """Projections, mHC, gate, shared + top-k experts of every layer, for one token."""
    used = sum(layer.dense + params.experts_per_token * layer.routed_expert for layer in params.layers)
    return 2.0 * used


def _logit_flops(params: ModelParams) -> float:
    """hc_head collapse and the head matmul for one token."""
    return 2.0 * (params.hc_head + params.head)


# ---- history and state ---------------------------------------------------------------
def _history_read_per_query(cfg: ModelConfig, ratio: int, context: int, p: Precision) -> float:
    """Bytes one query with `context` tokens reads from the cache of one layer."""
    kv = cfg.head_dim * p.kv_bytes
    keys = min(context, cfg.sliding_window) * kv
    if ratio == CSA_RATIO:
        entries = context // CSA_RATIO
        keys += min(cfg.index_topk, entries) * kv + entries * cfg.index_head_dim * p.index_kv_bytes
    elif ratio == HCA_RATIO:
        keys += context // HCA_RATIO * kv
    return keys


def _history_read_by_chunk(cfg: ModelConfig, ratio: int, start: int, p: Precision) -> float:
    """Bytes of pre-existing state a prefill chunk after `start` tokens reads from one layer,
    each byte once: the last min(start, W) SWA keys and every compressed entry."""
    kv = cfg.head_dim * p.kv_bytes
    read = min(start, cfg.sliding_window) * kv
    if ratio:
        read += start // ratio * _entry_bytes(cfg, ratio, p)
    return read


def _written_per_token(cfg: ModelConfig, ratio: int, p: Precision) -> float:
    """Bytes one decode token writes to one layer: its SWA key plus, amortised over the
    group it belongs to, 1/ratio of a compressed entry."""
    written = cfg.head_dim * p.kv_bytes
    if ratio:
        written += _entry_bytes(cfg, ratio, p) / ratio
    return written


def _written_by_chunk(cfg: ModelConfig, ratio: int, start: int, tokens: int, p: Precision) -> float:
    """Bytes a prefill chunk writes to one layer: its SWA keys and the entries it closes."""
    written = tokens * cfg.head_dim * p.kv_bytes
    if ratio:
        closed = (start + tokens) // ratio - start // ratio
        written += closed * _entry_bytes(cfg, ratio, p)
    return written


def _entry_bytes(cfg: ModelConfig, ratio: int, p: Precision) -> float:
    """One compressed entry: a head_dim vector, plus the indexer key on CSA layers."""
    entry = cfg.head_dim * p.kv_bytes
    if ratio == CSA_RATIO:
        entry += cfg.index_head_dim * p.index_kv_bytes
    return entry


# ---- attention FLOPs -----------------------------------------------------------------
def _attention_flops(cfg: ModelConfig, ratio: int, start: int, tokens: int) -> float:
    """Score + value FLOPs (and indexer scoring on CSA) of one layer for `tokens` queries
    with contexts start+1 … start+tokens."""
    keys = sum_window(start, tokens, cfg.sliding_window)
    indexer = 0
    if ratio == CSA_RATIO:
        keys += sum_selected(start, tokens, CSA_RATIO, cfg.index_topk)
        indexer = _indexer_flops(cfg, start, tokens)
    elif ratio == HCA_RATIO:
        keys += sum_entries(start, tokens, HCA_RATIO)
    return 4.0 * cfg.num_attention_heads * cfg.head_dim * keys + indexer


def _indexer_flops(cfg: ModelConfig, start: int, tokens: int) -> float:
    """Indexer scoring of one CSA layer: every visible C4 entry, each head's dot, per token."""
    return 2 * cfg.index_n_heads * cfg.index_head_dim * sum_entries(start, tokens, CSA_RATIO)


def _check_at_least(minimum: int, **values: int) -> None:
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
