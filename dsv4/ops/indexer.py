"""Lightning indexer (torch reference): score compressed entries, keep the top k.

score(t, e) = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * Di^-0.5, over the candidate entries
of token t (`cand[t, j]`: flat row of the indexer-key pool, -1 = not causal / absent). cand may
also be a PagedRows (dsv4/ops/paged.py), which means its dense form.
"""
import torch

from .backend import use_triton
from .paged import PagedRows, dense_index, index_width

QUERY_BLOCK = 1024


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor | PagedRows,
                 topk: int, weight_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] (w[t, h] = weights[t, h] * weight_scale, e.g. the
    projection's output and index_heads^-0.5), keys [N, Di], cand [T, E] or a PagedRows of
    width E (rows long, as its dense form).

    Returns [T, min(topk, E)] flat rows of the chosen entries, -1 where fewer are valid.
    """
    if use_triton(q):
        from .triton.indexer import indexer_topk as triton_indexer_topk
        return triton_indexer_topk(q, weights, keys, cand, topk, weight_scale)
    return _topk(q, weights, keys, cand, topk, weight_scale)[0]


def indexer_topk_offsets(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: PagedRows, topk: int,
                         weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """indexer_topk over a PagedRows, also returning where each choice sits in its token's
    range: (rows, offsets), both [T, min(topk, E)] long, -1 together; rows =
    cand.rows_at(offsets) (dsv4/ops/translate.py). For the C4 candidates an offset is the
    logical entry index, which IndexCache's shared layers reuse."""
    if use_triton(q):
        from .triton.indexer import indexer_topk_offsets as triton_indexer_topk_offsets
        return triton_indexer_topk_offsets(q, weights, keys, cand, topk, weight_scale)
    return _topk(q, weights, keys, cand, topk, weight_scale)


def _topk(q, weights, keys, cand, topk, weight_scale):
    """-> (rows, offsets) [T, k]: offsets are columns of the dense table (-1 where not chosen)."""
    weights = weights.float() * weight_scale
    k = min(topk, index_width(cand))
    dtype, device = (torch.long, cand.req.device) if isinstance(cand, PagedRows) else (cand.dtype, cand.device)
    rows = torch.full((q.shape[0], k), -1, dtype=dtype, device=device)
    offsets = torch.full((q.shape[0], k), -1, dtype=torch.long, device=device)
    if k == 0:
        return rows, offsets
    for start in range(0, q.shape[0], QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, q.shape[0])
        rows[start:stop], offsets[start:stop] = _select(q[start:stop], weights[start:stop], keys,
                                                        dense_index(cand, start, stop), k)
    return rows, offsets


def _select(q, weights, keys, cand, k):
    valid = cand >= 0
    gathered = keys[cand.clamp(min=0)].float()                             # [T, E, Di]
    scores = torch.relu(torch.einsum("thd,ted->the", q.float(), gathered)) * q.shape[-1] ** -0.5
    scores = (scores * weights.float()[..., None]).sum(dim=1)              # [T, E]
    scores = scores.masked_fill(~valid, float("-inf"))
    top = scores.topk(k, dim=-1)
    chosen = torch.isfinite(top.values)
    return (torch.where(chosen, cand.gather(1, top.indices), torch.full_like(top.indices, -1, dtype=cand.dtype)),
            torch.where(chosen, top.indices, -1))
