"""Data-parallel attention with expert-parallel MoE (docs/architecture.md, "Parallelism").

`apply_dp_expert_parallel(model, comm, dispatch)`: every rank keeps the whole model but only
experts [r*E/n, (r+1)*E/n) of each routed stack, and runs attention (and its own KV cache) for
its own requests; each MoE sends its tokens' (token, expert) pairs to the experts' ranks and
combines the results back. Ranks may hold different numbers of tokens, also none:
`DPStep.begin(T)` (called at the start of every forward on every rank) exchanges the counts, and
a rank without requests runs `idle_step(model)`, which joins each MoE's collectives with 0 tokens.

Two dispatches (the same sums, `benchmarks/multi_gpu.py` times both):
* "gather": all-gather every rank's tokens (padded to the largest count M) with their routing,
  compute the local experts' share of all n*M rows, reduce-scatter back. Shapes depend only
  on M (no host synchronisation).
* "all_to_all": each pair goes only to its expert's rank (sizes exchanged first, one host
  synchronisation per MoE), the results come back the same way and are summed per token.
The router, the shared expert and everything outside the MoE run locally."""
from __future__ import annotations

import torch

from ..model.moe import MoE
from ..ops.moe import dense_swiglu, routed_experts
from .comm import Comm
from .tensor_parallel import local_pairs, shard_experts

DISPATCHES = ("gather", "all_to_all")


class DPStep:
    """The token counts of every rank for the forward in progress (same on every rank)."""

    def __init__(self, comm: Comm):
        self.comm, self.counts = comm, [0] * comm.size

    def begin(self, num_tokens: int) -> None:
        self.counts = self.comm.all_gather_ints(num_tokens)


def apply_dp_expert_parallel(model, comm: Comm, dispatch: str = "gather"):
    step = DPStep(comm)
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            shard_experts(module, comm.rank, comm.size, name)
    model.register_forward_pre_hook(lambda m, args: step.begin(args[0].num_tokens))
    model.dp_step = step
    return use_dispatch(model, comm, dispatch)


def use_dispatch(model, comm: Comm, dispatch: str):
    """Switch the MoE dispatch of a model `apply_dp_expert_parallel` made (every rank alike)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch: expected one of {DISPATCHES}, got {dispatch!r}")
    for moe in _moes(model):
        moe.forward = _dispatch_forward(moe, comm, model.dp_step, dispatch)
    model.parallel = ("dp_ep", comm.size, dispatch)
    return model


@torch.inference_mode()
def idle_step(model) -> None:
    """This rank has no requests this step: take part in every MoE's collectives with 0 tokens."""
    model.dp_step.begin(0)
    H = model.cfg.hidden_size
    x = torch.empty(0, H, dtype=model.dtype, device=model.embed.weight.device)
    ids = torch.empty(0, dtype=torch.long, device=x.device)
    for moe in _forward_moes(model):
        moe(x, ids)


def _moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _forward_moes(model) -> list[MoE]:
    """The MoEs a step's forward runs, in its order: the main layers' (not the MTP blocks',
    which only drafting runs)."""
    return [m for layer in model.layers for m in layer.modules() if isinstance(m, MoE)]


def _dispatch_forward(moe: MoE, comm: Comm, step: DPStep, dispatch: str):
    combine = _gather_combine if dispatch == "gather" else _all_to_all_combine

    def forward(x: torch.Tensor, token_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        T, k = x.shape[0], moe.gate.topk
        if T:
            weights, ids = moe.gate(x, token_ids, image_mask)
        else:
            weights = torch.empty(0, k, dtype=torch.float32, device=x.device)
            ids = torch.empty(0, k, dtype=torch.long, device=x.device)
        routed = combine(moe, comm, step, x, weights, ids)
        s = moe.shared_experts
        return routed + dense_swiglu(x, s.w1.weight, s.w2.weight, s.w3.weight, moe.limit, scales=s.scales())
    return forward


def _local_experts(moe: MoE, comm: Comm, x, weights, ids) -> torch.Tensor:
    """The local experts' weighted sum for each row of x (pairs on other ranks add 0)."""
    e = moe.experts
    count = e.w1.shape[0]
    weights, ids = local_pairs(weights, ids.long(), comm.rank * count, count)
    return routed_experts(x, weights, ids, e.w1, e.w2, e.w3, moe.limit, e.scales())


def _gather_combine(moe, comm, step, x, weights, ids) -> torch.Tensor:
    T, M = x.shape[0], max(step.counts)
    if M == 0:
        return torch.zeros_like(x)
    pad = M - T
    xs = comm.all_gather_rows(torch.nn.functional.pad(x, (0, 0, 0, pad)))                # [n*M, H]
    ws = comm.all_gather_rows(torch.nn.functional.pad(weights, (0, 0, 0, pad)))          # padding: weight 0
    ids_all = comm.all_gather_rows(torch.nn.functional.pad(ids, (0, 0, 0, pad)))
    return comm.reduce_scatter_rows(_local_experts(moe, comm, xs, ws, ids_all))[:T]


def _all_to_all_combine(moe, comm, step, x, weights, ids) -> torch.Tensor:
    T, k = ids.shape
    count = moe.experts.w1.shape[0]
    owner = (ids // count).flatten()                                      # [T*k] the rank of each pair
    order = torch.argsort(owner, stable=True)
    send_t = torch.bincount(owner, minlength=comm.size)
    recv_t = comm.all_to_all(send_t.unsqueeze(-1), [1] * comm.size, [1] * comm.size).flatten()
    send, recv = send_t.tolist(), recv_t.tolist()                          # the host synchronisation
    token = order // k
    xr = comm.all_to_all(x[token], send, recv)
    wr = comm.all_to_all(weights.flatten()[order].unsqueeze(-1), send, recv)
    ir = comm.all_to_all(ids.flatten()[order].unsqueeze(-1), send, recv)
    y = comm.all_to_all(_local_experts(moe, comm, xr, wr, ir), recv, send)   # [T*k, H], pair order `order`
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y.float())
    return out.to(x.dtype)
