"""The device memory a step needs beside the weights and the KV cache (docs/architecture.md,
"Cache"): the lightning indexer's prefill scores, the largest step's activations and the decode
CUDA graphs' pool and static buffers. Figures from the engine's settings, before loading
anything, for the memory plan and for what the cache leaves free (cache/sizing.py)."""
from __future__ import annotations

import torch

from ..config import CSA_RATIO, EngineConfig, ModelConfig

# the components a plan names
INDEXER = "indexer prefill scores"
ACTIVATIONS = "step activations"
GRAPHS = "CUDA-graph pool and buffers"


def context_bound(cfg: ModelConfig, config: EngineConfig) -> int:
    """The longest request the workspace is sized for: --max-model-len, else the model's
    positions (the cache may bound max_model_len lower, but it is sized after the workspace)."""
    return config.max_model_len or cfg.max_position_embeddings


def workspace_components(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each workspace term, T = max_num_batched_tokens (the largest step), E = C4
    entries of the longest request (context_bound / 4), k = min(index_topk, E):
    - INDEXER: the scores of one prefill chunk's tiles (ops/triton/indexer.py, score_bytes):
      fp32 [T, tile_width(T, k)] twice where the tiles' top-k runs beside the scores (CUDA,
      OVERLAP_TOPK, T >= ROWS_MIN, E over one tile), else one tile [T, min(E, tile_width)];
      0 without CSA layers;
    - ACTIVATIONS: step_bytes of T tokens with the most logits rows a step has (logits_rows);
    - GRAPHS (CUDA, graphs on, one data-parallel rank): graph_bytes.
    The terms are added although the indexer's and the head's peaks do not coincide: an
    upper bound."""
    T = config.max_num_batched_tokens
    cuda = torch.device(config.device).type == "cuda"
    out = {INDEXER: indexer_score_bytes(cfg, config, T, side_stream=cuda),
           ACTIVATIONS: step_bytes(cfg, dtype, T, logits_rows(config))}
    if cuda and not config.enforce_eager and config.cuda_graph_max_bs > 0 and config.data_parallel_size == 1:
        out[GRAPHS] = graph_bytes(cfg, config, dtype)
    return out


def indexer_score_bytes(cfg: ModelConfig, config: EngineConfig, tokens: int, side_stream: bool) -> int:
    """The indexer's scores for a step of `tokens` tokens over the longest request's C4 entries."""
    if CSA_RATIO not in cfg.compress_ratios:
        return 0
    from ..ops.triton.indexer import OVERLAP_TOPK, score_bytes
    E = context_bound(cfg, config) // CSA_RATIO
    return score_bytes(tokens, min(cfg.index_topk, E), E, side_stream and OVERLAP_TOPK) if E else 0


def step_bytes(cfg: ModelConfig, dtype: torch.dtype, tokens: int, logits_rows: int) -> int:
    """Activation bytes of a step of `tokens` tokens, `logits_rows` of them with logits, at its
    peak (model dtype elem bytes, N = hc_mult, H = hidden): the residual streams [T, N, H] kept
    across blocks (and while the head runs), plus the larger of
    - a block: the new streams of hc_post [T, N, H] beside the old, and the larger of attention
      (q, its output and the output's inverse RoPE: 3 x [T, heads, head_dim]) and the MoE (the
      grouped GEMMs' SwiGLU rows [T * k, I] and down rows [T * k, H], their fp32 sum [T, H],
      the router's fp32 scores [T, n_experts]);
    - the head: head_bytes_per_row for each logits row.
    Small terms (projections' low-rank outputs, the indexer's queries, RoPE tables, routing
    ids) are not counted."""
    c, elem = cfg, torch.empty((), dtype=dtype).element_size()
    streams = c.hc_mult * c.hidden_size * elem
    attention = 3 * c.num_attention_heads * c.head_dim * elem
    k = c.num_experts_per_tok
    moe = k * (c.moe_intermediate_size + c.hidden_size) * elem + 4 * (c.hidden_size + c.n_routed_experts)
    return tokens * streams + max(tokens * (streams + max(attention, moe)), logits_rows * head_bytes_per_row(cfg, dtype))


def head_bytes_per_row(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What the head allocates per logits row (DeepseekV4.head_logits): its output [vocab] in
    the model dtype and, unless that is fp32 already, the fp32 copy."""
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.vocab_size * (elem + (4 if dtype != torch.float32 else 0))


def logits_rows(config: EngineConfig) -> int:
    """The most rows of a step with logits (engine/runner.py, ModelRunner.seq_chunk): every row
    of the chunks computing prompt logprobs, max_prompt_logprobs_tokens together at most
    (engine/scheduler.py); q at most of each other chunk (k + 1 to verify k drafts, else 1);
    max_num_seqs chunks; never more rows than the step's tokens."""
    spec = config.speculative_config
    q = spec.num_speculative_tokens + 1 if spec is not None else 1
    S, P = config.max_num_seqs, config.max_prompt_logprobs_tokens
    return min(config.max_num_batched_tokens, max(S * q, P + (S - 1) * q))


def graph_bytes(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """The decode CUDA graphs (engine/cuda_graphs.py): every shape `warmup` captures (uniform
    steps of q = 1, and k + 1 with k speculative tokens), sharing one pool:
    - the pool's peak: the largest shape's step (B * q tokens) without the head (it runs after
      the graph): step_bytes of B * q tokens and no logits rows, plus its indexer scores (one tile: no side
      stream while capturing);
    - each shape's outputs kept in the pool: the head input [B * q, H] (and with an MTP
      drafter the streams [B * q, N, H], with DSpark the taps [B * q, n_taps * H]);
    - each shape's static inputs (the padded ForwardBatch's leaves in one device buffer,
      HostToDevice.allocate): cuda_graphs.static_bytes, exactly what StepGraphs allocates.
    The speculative drafters' own graphs are not counted."""
    from .cuda_graphs import graph_shapes, static_bytes
    spec, elem = config.speculative_config, torch.empty((), dtype=dtype).element_size()
    qs = (1, spec.num_speculative_tokens + 1) if spec is not None else (1,)
    per_row = cfg.hidden_size * elem
    if spec is not None:
        per_row += (cfg.hc_mult if spec.method != "dspark" else len(cfg.dspark_target_layer_ids)) * cfg.hidden_size * elem
    shapes = [s for q in qs for s in graph_shapes(config.cuda_graph_max_bs, config.max_num_seqs,
                                                  context_bound(cfg, config), q, cfg.sliding_window)]
    if not shapes:
        return 0
    top = max(s.seqs * s.tokens for s in shapes)
    pool = step_bytes(cfg, dtype, top, 0) + indexer_score_bytes(cfg, config, top, False)
    outputs = sum(s.seqs * s.tokens for s in shapes) * per_row
    return pool + outputs + sum(map(static_bytes, shapes))
