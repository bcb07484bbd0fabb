"""The DSpark block drafter of the 0731/0813 releases (docs/speculative.md, "DSpark").

Draft stages `mtp.0..L-1` are V4 blocks (mHC, attention, MoE) with window-only attention:
* stage 0 holds main_proj / main_norm: main_x_t = main_norm(main_proj(taps_t)), taps_t = the
  input streams of the target layers `dspark_target_layer_ids` at position t, each averaged over
  the hc dimension, concatenated ([n_taps * hidden]);
* every stage j keeps, per committed position t, the window key kv_norm(wkv_j(main_x_t)) with
  RoPE at t, in SWA cache layer `num_hidden_layers + j` (CacheLayout.with_mtp): position
  addressed like every SWA layer, written only for committed positions;
* a block of B tokens [anchor, noise x (B - 1)] at positions t+1 .. t+B (anchor = the token
  at t + 1, t the last committed position) runs through the stages; each query attends to the
  window keys of positions (t - W, t] and to all B keys of its block (non-causal);
* the last stage holds hc_head, norm, markov_head and confidence_head: base logits
  head(norm(hc_head(h))) per block row; then left to right, row i's logits get the Markov bias
  markov_w2 @ markov_w1[prev] (prev = the anchor, then draft i - 1) and draft i is drawn from
  them; confidence_i = proj([hc_head(h)_i, markov_w1[prev]]) (a logit; sigmoid = the
  probability that draft i is accepted).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.attention import sparse_attention
from ..ops.kv_fp8 import is_packed, write_entries
from ..ops.mhc import hc_head, hc_post
from ..ops.rope import apply_rope, norm_rope, rope_cos_sin
from .deepseek_v4 import Block, DeepseekV4
from .kv import LayerKV
from .layers import Linear, RMSNorm, param


class MarkovHead(nn.Module):
    """Rank-r token transition: bias(prev) = markov_w2 @ markov_w1[prev] ([V, r] each)."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.markov_w1, self.markov_w2 = nn.Module(), nn.Module()       # checkpoint: markov_w{1,2}.weight
        self.markov_w1.weight = param(vocab, rank, dtype=dtype)
        self.markov_w2.weight = param(vocab, rank, dtype=dtype)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [R] long -> (bias [R, V] fp32, embedding [R, r])."""
        e = self.markov_w1.weight[prev]
        return torch.nn.functional.linear(e, self.markov_w2.weight).float(), e


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = param(1, hidden + rank, dtype=torch.float32)

    def forward(self, x: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """x [R, H] (hc_head output, before norm), markov_embed [R, r] -> confidence logits [R]."""
        joined = torch.cat([x.float(), markov_embed.float()], dim=-1)
        return torch.nn.functional.linear(joined, self.proj.weight.float()).squeeze(-1)


class DSparkStage(Block):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype,
                 fp8_experts: tuple[bool, bool] = (False, False), mxfp4_experts: bool = False):
        super().__init__(cfg, cfg.num_hidden_layers + index, 0, dtype, fp8_experts, mxfp4_experts)
        n, H = cfg.hc_mult, cfg.hidden_size
        self.index = index
        if index == 0:
            self.main_proj = Linear(H * len(cfg.dspark_target_layer_ids), H, dtype)
            self.main_norm = RMSNorm(H, cfg.rms_norm_eps)
        if index == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.hc_head_fn = param(n, n * H, dtype=torch.float32)
            self.hc_head_base = param(n, dtype=torch.float32)
            self.hc_head_scale = param(1, dtype=torch.float32)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
            self.confidence_head = ConfidenceHead(H, cfg.dspark_markov_rank)

    def block(self, h: torch.Tensor, tokens: torch.Tensor, cos, sin, swa: torch.Tensor,
              window: torch.Tensor, B: int) -> torch.Tensor:
        """h [R*B, N, H] streams of R blocks of B rows; window [R*B, W] SWA rows each row reads
        -> new streams [R*B, N, H]."""
        x, post, comb = self._pre(h, "attn")
        h = hc_post(block_attention(self.attn, self.attn_norm(x), cos, sin, swa, window, B), h, post, comb)
        x, post, comb = self._pre(h, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), tokens), h, post, comb)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """Last stage: streams [T, N, H] -> hc_head output [T, H] (before norm)."""
        c = self.cfg
        return hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps, c.hc_eps)


def block_attention(attn, x: torch.Tensor, cos, sin, swa: torch.Tensor, window: torch.Tensor,
                    B: int) -> torch.Tensor:
    """The stage's attention over its block: x [R*B, H] normed input, RoPE tables of the block
    positions; every row attends to its window rows of `swa` and to the B keys of its block."""
    q = norm_rope(attn.wq_b(attn.q_norm(attn.wq_a(x))).unflatten(-1, (attn.heads, attn.head_dim)),
                  None, attn.eps, cos, sin)
    keys = norm_rope(attn.wkv(x), attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)
    own = torch.arange(x.shape[0], device=x.device).view(-1, 1, B).expand(-1, B, -1).reshape(-1, B)   # [R*B, B]
    out = sparse_attention(q, [(swa, window), (keys, own)], attn.attn_sink, attn.scale, attn.rope_dims)
    out = apply_rope(out, cos, sin, inverse=True)
    return attn.wo_b(attn._grouped_wo_a(out))


def stages(model: DeepseekV4) -> list[DSparkStage]:
    return list(model.mtp)


def write_window(model: DeepseekV4, taps: torch.Tensor, positions: torch.Tensor, swa_rows: torch.Tensor,
                 kv: list[LayerKV]) -> None:
    """Committed positions' window keys: taps [T, n_taps * H] at `positions` [T] -> every stage's
    kv_norm(wkv(main_x)) with RoPE, written to SWA rows `swa_rows` [T] of its cache layer."""
    first = stages(model)[0]
    main_x = first.main_norm(first.main_proj(taps.to(model.dtype)))
    cos, sin = rope_cos_sin(positions, model.main_freq)
    for stage in stages(model):
        a, swa = stage.attn, kv[stage.attn.layer].swa
        if is_packed(swa):           # FP8 KV: quantised where written, as the main layers do
            write_entries(swa, swa_rows, norm_rope(a.wkv(main_x), a.kv_norm.weight, a.kv_norm.eps, cos, sin), a.rope_dims)
        else:
            norm_rope(a.wkv(main_x), a.kv_norm.weight, a.kv_norm.eps, cos, sin, out=swa, rows=swa_rows)


def run_block(model: DeepseekV4, anchors: torch.Tensor, anchor_pos: torch.Tensor, window: torch.Tensor,
              kv: list[LayerKV]) -> tuple[torch.Tensor, torch.Tensor]:
    """R blocks: anchors [R] (tokens at anchor_pos [R] = t + 1), window [R, W] the SWA rows of
    positions (t - W, t] (-1: none) -> (base logits [R, B, V] fp32, hc_head output [R, B, H])."""
    cfg, B = model.cfg, model.cfg.dspark_block_size
    R = anchors.shape[0]
    tokens = torch.full((R, B), cfg.dspark_noise_token_id, dtype=torch.long, device=anchors.device)
    tokens[:, 0] = anchors
    tokens = tokens.flatten()
    positions = (anchor_pos[:, None] + torch.arange(B, device=anchors.device)).flatten()
    cos, sin = rope_cos_sin(positions, model.main_freq)
    rows = window.unsqueeze(1).expand(-1, B, -1).reshape(-1, window.shape[1])      # [R*B, W] (no host sync: graphs)
    h = model.embed(tokens).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for stage in stages(model):
        h = stage.block(h, tokens, cos, sin, kv[stage.attn.layer].swa, rows, B)
    last = stages(model)[-1]
    x = last.head_input(h)
    logits = torch.nn.functional.linear(last.norm(x), model.head.weight).float()
    return logits.view(R, B, -1), x.view(R, B, -1)


DraftSampler = Callable[[torch.Tensor, int], tuple[torch.Tensor, "torch.Tensor | None"]]


def markov_drafts(model: DeepseekV4, logits: torch.Tensor, x: torch.Tensor, anchors: torch.Tensor, n: int,
                  sample: DraftSampler) -> tuple[torch.Tensor, list, torch.Tensor]:
    """The Markov head left to right over the first n block rows: logits [R, B, V], x [R, B, H]
    (run_block), sample(logits [R, V], i) -> (drafts [R], q [R, V] or None) -> (drafts [R, n],
    [q_i], confidence logits [R, n])."""
    last = stages(model)[-1]
    prev, drafts, qs, conf = anchors, [], [], []
    for i in range(n):
        bias, e = last.markov_head(prev)
        prev, q = sample(logits[:, i] + bias, i)
        drafts.append(prev)
        qs.append(q)
        conf.append(last.confidence_head(x[:, i], e))
    return torch.stack(drafts, 1), qs, torch.stack(conf, 1)


def attach_dspark(model: DeepseekV4) -> None:
    """Create the checkpoint's DSpark stages (num_nextn_predict_layers of them) on the model."""
    cfg = model.cfg
    for k in range(cfg.num_nextn_predict_layers):
        model.mtp.append(DSparkStage(cfg, k, model.dtype, model.fp8_experts, model.mxfp4_experts))
