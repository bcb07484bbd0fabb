"""Mixture of experts (torch reference): routing and the routed experts with clamped SwiGLU.

Expert weights may be quantised, the format told by their dtype, the scales passed as
`scales` = (s1, s2, s3) (the shared expert's without E):
- FP8 (W8A16, `EngineConfig.keep_fp8`): float8_e4m3fn with fp32 scales per 128x128 block
  ([E, ceil(I/128), ceil(H/128)] for w1/w3, [E, ceil(H/128), ceil(I/128)] for w2);
- MXFP4 (W4A16, `EngineConfig.keep_mxfp4`, routed experts only): uint8 holding two e2m1 values
  along the last (input) dim, low nibble first (w1/w3 [E, I, H/2], w2 [E, H, I/2]), with uint8
  E8M0 exponents (2^(b - 127)) per 32 inputs ([E, I, H/32], [E, H, I/32]).
The reference dequantises the experts it uses on the fly (fp32 product, then x's dtype: what the
load-time dequantisation stores); the Triton kernels dequantise tiles in-kernel."""
import torch
import torch.nn.functional as F

from .quant import dequant_kept
from .backend import use_triton

# decode sizes: up to this many (token, expert) pairs T*k run the Triton GEMV kernels, which
# stream each selected expert once; larger batches use a grouped GEMM (see
# benchmarks/kernels/moe.py for the crossover)
TRITON_MAX_PAIRS = 64
# the grouped GEMM on CUDA above that: "torch" = routed_experts_grouped (torch._grouped_mm,
# bf16 only), "triton" = dsv4/ops/triton/moe_grouped.py (SwiGLU fused into the up-gate GEMM,
# routing weight into the down GEMM). `python benchmarks/kernels/moe.py --part prefill`
# measures both.
GROUPED_GEMM = "triton"


# decode sizes: up to this many tokens route_topk / route_hash run the Triton router
# (dsv4/ops/triton/moe_gate.py, one launch per layer); its token blocks re-read the gate weight
# from L2, so large prefills keep the torch path (one fp32 GEMM). Not yet measured on an H200:
# `python benchmarks/kernels/moe.py --part gate` times both per T.
ROUTE_MAX_TOKENS = 64


def route_topk(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, topk: int,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Score-based routing. x [T, H] -> (weights [T, k] fp32, expert ids [T, k]).

    scores = sqrt(softplus(x W^T)) in fp32; the bias only changes which experts are chosen;
    the chosen scores are normalised to sum 1 and multiplied by `scaling`. The order of the
    ids within a row is unspecified (consumers take (weight, id) pairs)."""
    if use_triton(x) and x.shape[0] <= ROUTE_MAX_TOKENS:
        from .triton import moe_gate
        return moe_gate.route_topk(x, gate_w, bias, topk, scaling)
    scores = _gate_scores(x, gate_w)
    ids = torch.topk(scores + bias.float(), topk, dim=-1, sorted=False).indices
    return _weights(scores, ids, scaling), ids


def route_hash(x: torch.Tensor, gate_w: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor,
               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing: the experts come from a fixed token-id table, the weights from the gate."""
    if use_triton(x) and x.shape[0] <= ROUTE_MAX_TOKENS:
        from .triton import moe_gate
        return moe_gate.route_hash(x, gate_w, token_ids, tid2eid, scaling)
    ids = tid2eid[token_ids].long()
    return _weights(_gate_scores(x, gate_w), ids, scaling), ids


def _gate_scores(x, gate_w):
    """sqrt(softplus(x W^T)) [T, E] in fp32 (an fp32 GEMM of x and W made fp32)."""
    return F.softplus(F.linear(x.float(), _fp32_weight(gate_w))).sqrt()


def _weights(scores, ids, scaling):
    w = scores.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling


def _fp32_weight(w: torch.Tensor) -> torch.Tensor:
    """w in fp32: w itself when it is fp32, else an fp32 copy cached on the tensor object, so
    the copy is made once rather than every step (the result is the same as w.float()). Made
    again when the weight was replaced or changed in place since (data_ptr, version, device,
    shape): a loader that assigns .data or copies into it gets a fresh copy. Costs E x H x 4
    bytes per gate (4 MiB at V4-Flash), made only where the torch path runs (on the GPU:
    batches above ROUTE_MAX_TOKENS)."""
    if w.dtype == torch.float32:
        return w
    key = (w.data_ptr(), _version(w), w.device, w.shape)
    cached = w.__dict__.get("_dsv4_fp32")
    if cached is None or cached[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            cached = (key, w.detach().float())
        w.__dict__["_dsv4_fp32"] = cached         # a plain attribute of the tensor object
    return cached[1]


def _version(w: torch.Tensor) -> int | None:
    try:
        return w._version
    except RuntimeError:          # an inference tensor: no version counter (keyed on data_ptr only)
        return None


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, limit: float, scales=None) -> torch.Tensor:
    """x [T, H]; weights/ids [T, k]; w1/w3 [E, I, H] (gate/up), w2 [E, H, I] -> [T, H];
    scales = (s1, s2, s3) when the weights are FP8 or MXFP4 (module docstring).

    Triton (use_triton): the decode GEMVs up to TRITON_MAX_PAIRS pairs, else the Triton grouped
    GEMMs when GROUPED_GEMM == "triton" (always for quantised weights). Otherwise
    torch._grouped_mm on CUDA in bf16 (never quantised weights), else the loop (the definition)."""
    if use_triton(x) and ids.numel() <= TRITON_MAX_PAIRS:
        from .triton import moe as triton_moe
        return triton_moe.routed_experts(x, weights, ids, w1, w2, w3, limit, scales=scales)
    if use_triton(x) and (GROUPED_GEMM == "triton" or scales is not None):
        from .triton import moe_grouped
        return moe_grouped.routed_experts_grouped(x, weights, ids, w1, w2, w3, limit, scales=scales)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and scales is None:
        return routed_experts_grouped(x, weights, ids, w1, w2, w3, limit)
    return routed_experts_loop(x, weights, ids, w1, w2, w3, limit, scales)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, w3: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                limit: float, scales=None, shared_scales=None) -> torch.Tensor:
    """routed_experts(x, weights, ids, w1, w2, w3) + dense_swiglu(x, *shared) -> [T, H], the
    MoE output; shared = (sw1, sw2, sw3) [I, H], [H, I], [I, H]; scales / shared_scales the
    scales of the routed / shared weights (module docstring), None when not quantised.

    Triton at decode sizes (as routed_experts): the shared expert runs as one more pair of the
    routed GEMV kernels (weight 1), the sum in their fp32 accumulator, rounded once."""
    if use_triton(x) and ids.numel() <= TRITON_MAX_PAIRS:
        from .triton import moe as triton_moe
        if triton_moe.fusable_shared(w1, shared, scales, shared_scales):
            return triton_moe.routed_experts(x, weights, ids, w1, w2, w3, limit, shared=shared, scales=scales,
                                             shared_scales=shared_scales)
    return (routed_experts(x, weights, ids, w1, w2, w3, limit, scales)
            + dense_swiglu(x, *shared, limit, scales=shared_scales))


def routed_experts_grouped(x, weights, ids, w1, w2, w3, limit):
    """One grouped GEMM per projection over the pairs sorted by expert; no host synchronisation.
    The combine gathers each token's k rows back (inverse of the sort) and sums them weighted
    in fp32: deterministic, no atomics."""
    T, k = ids.shape
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)                  # sorted row -> pair t*k + j
    counts = torch.zeros(w1.shape[0], dtype=torch.long, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))   # bincount would sync to size its output
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]                                            # [T*k, H], sorted rows
    h = swiglu_clamped(torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs),
                       torch._grouped_mm(xs, w3.transpose(1, 2), offs=offs), limit)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)      # [T*k, H], sorted rows
    y = y[torch.argsort(order)].view(T, k, -1)                    # [T, k, H], pair order
    return (y * weights.float().unsqueeze(-1)).sum(1).to(x.dtype)


def routed_experts_loop(x, weights, ids, w1, w2, w3, limit, scales=None):
    """Tokens grouped by expert (one sort); each expert that received tokens runs once (FP8 /
    MXFP4 weights: dequantised when used, see `expert_weights`)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w1.shape[0]).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tok = token_of[start:start + count]
        e1, e2, e3 = expert_weights((w1, w2, w3), scales, expert, x.dtype)
        h = swiglu_clamped(x[tok] @ e1.T, x[tok] @ e3.T, limit)
        y = (h @ e2.T).float() * weight_of[start:start + count, None]
        out.index_add_(0, tok, y)
        start += count
    return out.to(x.dtype)


def dense_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 limit: float, scales=None) -> torch.Tensor:
    """The shared expert: clamped SwiGLU MLP. w1/w3 [I, H], w2 [H, I] (FP8 with scales:
    dequantised here)."""
    w1, w2, w3 = expert_weights((w1, w2, w3), scales, None, x.dtype)
    return swiglu_clamped(x @ w1.T, x @ w3.T, limit) @ w2.T


def expert_weights(ws, scales, expert: int | None, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Matrices of `expert` (None: ws are single matrices) from ws = (w1, w2, w3); quantised ones
    (scales given) dequantised in fp32 and rounded to `dtype`, as the loader would store them."""
    pick = (lambda t: t) if expert is None else (lambda t: t[expert])
    if scales is None:
        return tuple(pick(w) for w in ws)
    return tuple(dequant_kept(pick(w), pick(s)).to(dtype) for w, s in zip(ws, scales))
