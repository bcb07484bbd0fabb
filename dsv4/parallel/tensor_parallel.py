"""Tensor parallelism as a transform of a built model (docs/architecture.md, "Parallelism").

`apply_tensor_parallel(model, comm)` keeps rank r's part of each split weight and hooks one
all-reduce after each attention and each MoE (the only collectives of a block):

* attention: heads r*H/n.. (wq_b rows, attn_sink); the output projection's o-groups: with
  n <= G each rank holds G/n whole groups (wo_a rows, wo_b columns); with n > G the n/G ranks of
  group g each hold its projection's columns of their heads, and since wo_b is linear the sum of
  their partial products is the full one. wq_a, wkv, the compressors and the indexer stay whole:
  V4 has one shared K=V head, so every rank writes and reads the whole KV cache; the indexer's
  top-k needs the sum over its heads (splitting it costs an all-reduce of [T, E/4] scores per
  CSA layer, more than its replicated compute).
* MoE: the shared expert's and (without expert parallelism) every routed expert's intermediate
  dim (w1/w3 rows, w2 columns); with `expert_parallel` rank r holds experts r*E/n.. whole and
  computes only the (token, expert) pairs routed to them. The router stays whole.
* vocabulary: embedding rows r*V/n.. (a token another rank holds embeds as 0; the sum is
  exact) and head rows, the logits gathered (every rank gets [L, V]).

Invariant: after each hooked module every rank holds the same (full) activation, so the rest of
the model (mHC, norms, caches) runs unchanged and identically on every rank."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.attention import Attention
from ..model.moe import MoE
from .comm import Comm
from .shard import shard_param


def apply_tensor_parallel(model, comm: Comm, expert_parallel: bool = False):
    """Shard `model` (a full DeepseekV4, MTP blocks included) in place for rank comm.rank of
    comm.size; returns it."""
    r, n = comm.rank, comm.size
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            shard_attention(module, r, n, name)
            module.register_forward_hook(_all_reduce_output(comm))
        elif isinstance(module, MoE):
            if expert_parallel:
                shard_experts(module, r, n, name)
                module.forward = _local_experts_forward(module, r * module.experts.w1.shape[0])
            else:
                for w, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
                    shard_param(module.experts, w, [(dim, r, n)], f"{name}.experts")
            for w, dim in (("w1", 0), ("w2", 1), ("w3", 0)):
                shard_param(getattr(module.shared_experts, w), "weight", [(dim, r, n)], f"{name}.shared_experts.{w}")
            module.register_forward_hook(_all_reduce_output(comm))
    _shard_vocab(model, comm)
    model.parallel = ("tp", n, expert_parallel)
    return model


def shard_attention(attn: Attention, r: int, n: int, name: str) -> None:
    H, G = attn.heads, attn.groups
    if H % n or (G % n and n % G):
        raise ValueError(f"{name}: {H} heads and {G} o-groups do not split over {n} ranks "
                         f"(heads must divide, and groups divide or be divided by the ranks)")
    shard_param(attn.wq_b, "weight", [(0, r, n)], f"{name}.wq_b")
    shard_param(attn, "attn_sink", [(0, r, n)], name)
    if G % n == 0:                      # whole groups: wo_a rows, wo_b columns
        shard_param(attn.wo_a, "weight", [(0, r, n)], f"{name}.wo_a")
        shard_param(attn.wo_b, "weight", [(1, r, n)], f"{name}.wo_b")
        attn.groups = G // n
    else:                               # n/G ranks per group: the group's rows, this rank's head columns
        per = n // G
        shard_param(attn.wo_a, "weight", [(0, r // per, G), (1, r % per, per)], f"{name}.wo_a")
        shard_param(attn.wo_b, "weight", [(1, r // per, G)], f"{name}.wo_b")
        attn.groups = 1
    attn.heads = H // n


def shard_experts(moe: MoE, r: int, n: int, name: str) -> None:
    """Keep experts [r*E/n, (r+1)*E/n) of the routed stack."""
    for w in ("w1", "w2", "w3"):
        shard_param(moe.experts, w, [(0, r, n)], f"{name}.experts")


def local_pairs(weights: torch.Tensor, ids: torch.Tensor, first: int, count: int):
    """(weights, ids) [T, k] of global experts -> the same pairs on the local stack: ids of
    experts [first, first + count) become local, the others become expert 0 with weight 0
    (they add exactly nothing)."""
    local = ids - first
    mine = (local >= 0) & (local < count)
    return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, torch.zeros_like(local))


def _local_experts_forward(moe: MoE, first: int):
    from ..ops.moe import moe_experts

    def forward(x: torch.Tensor, token_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = moe.gate(x, token_ids, image_mask)
        e, s = moe.experts, moe.shared_experts
        weights, ids = local_pairs(weights, ids, first, e.w1.shape[0])
        return moe_experts(x, weights, ids, e.w1, e.w2, e.w3, (s.w1.weight, s.w2.weight, s.w3.weight),
                           moe.limit, scales=e.scales(), shared_scales=s.scales())
    return forward


def _all_reduce_output(comm: Comm):
    def hook(module, args, out):
        return comm.all_reduce(out)
    return hook


def _shard_vocab(model, comm: Comm) -> None:
    r, n = comm.rank, comm.size
    V = model.embed.weight.shape[0]
    shard_param(model.embed, "weight", [(0, r, n)], "embed")
    shard_param(model.head, "weight", [(0, r, n)], "head")
    first, count = r * V // n, V // n
    embed = model.embed

    def embed_forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - first
        mine = (local >= 0) & (local < count)
        out = F.embedding(local.clamp(0, count - 1), embed.weight).masked_fill(~mine.unsqueeze(-1), 0)
        return comm.all_reduce(out)

    def head_logits(x: torch.Tensor) -> torch.Tensor:
        return comm.all_gather_last(F.linear(x, model.head.weight).float())

    embed.forward = embed_forward
    model.head_logits = head_logits
