"""Lightning indexer (torch reference): score compressed entries, keep the top k.

score(t, e) = sum_h w[t, h] * ReLU(q[t, h] . k[e]) * Di^-0.5, over the candidate entries
of token t (`cand[t, j]`: flat row of the indexer-key pool, -1 = not causal / absent). cand may
also be a PagedRows (dsv4/ops/paged.py), which means its dense form.

Top-k order is total: score descending, ties to the lower j (dsv4/ops/stream_topk.py). The
entries stream through in tiles merged into a running top-k, so memory is O(T * k + tile)
whatever the context length (never a [T, E] score table).
"""
import torch

from .backend import use_triton
from .kv_fp8 import is_packed, unpack_index_keys
from .paged import PagedRows, index_width
from .stream_topk import RunningTopk

QUERY_BLOCK = 1024
TILE_ELEMS = 1 << 22   # bound on a tile's [tokens, heads or dim, entries] intermediates


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand: torch.Tensor | PagedRows,
                 topk: int, weight_scale: float = 1.0) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] (w[t, h] = weights[t, h] * weight_scale, e.g. the
    projection's output and index_heads^-0.5), keys [N, Di] (or packed FP8 [N, Di + 4] uint8,
    dsv4/ops/kv_fp8.py), cand [T, E] or a PagedRows of width E (rows long, as its dense form).

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
    """-> (rows, offsets) [T, k]: offsets are columns of the dense table (-1 where not chosen),
    in (score desc, offset asc) order (dsv4/ops/stream_topk.py). Queries in blocks of
    QUERY_BLOCK, entries in tiles: nothing grows with T x E."""
    weights = weights.float() * weight_scale
    T, Hi, Di = q.shape
    k = min(topk, index_width(cand))
    paged = isinstance(cand, PagedRows)
    device = cand.req.device if paged else cand.device
    running = RunningTopk(T, k, device)
    for start in range(0, T if k else 0, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, T)
        width = entry_tile(stop - start, max(Hi, Di), k)
        widest = _shared_ranges(cand, start, stop) if paged else None
        for e0 in range(0, index_width(cand), width):
            e1 = min(e0 + width, index_width(cand))
            if widest is None:
                scores = _scores(q[start:stop], weights[start:stop], keys, _cand_tile(cand, start, stop, e0, e1))
            else:
                scores = _shared_scores(q[start:stop], weights[start:stop], keys, cand, start, stop, widest, e0, e1)
            running.add(scores, e0, slice(start, stop))
    offsets = running.offsets()
    if paged:
        return cand.rows_at(offsets), offsets
    return torch.where(offsets >= 0, cand.gather(1, offsets.clamp(min=0)), -1), offsets


def entry_tile(tokens: int, per_entry: int, k: int) -> int:
    """Entries per tile for `tokens` queries: the [tokens, per_entry, tile] intermediates stay
    within TILE_ELEMS, and a tile is never narrower than the k it merges with."""
    return max(k, 1, TILE_ELEMS // max(1, tokens * per_entry))


def _cand_tile(cand, start, stop, e0, e1) -> torch.Tensor:
    """Columns [e0, e1) of the dense candidate table, rows [start, stop): [t, e1 - e0]."""
    if isinstance(cand, PagedRows):
        return cand.rows_at(torch.arange(e0, e1, device=cand.req.device)[None, :], start, stop)
    return cand[start:stop, e0:e1]


def _shared_ranges(cand: PagedRows, start: int, stop: int) -> int | None:
    """When tokens [start, stop) are one request's and their ranges start at one lo (a prefill
    chunk), column e is the same pool row for all of them, valid up to each one's hi: the
    token with the widest range (whose rows cover every other's); else None."""
    req, lo = cand.req[start:stop], cand.lo[start:stop]
    if not (bool((req == req[0]).all()) and bool((lo == lo[0]).all())):
        return None
    return start + int(cand.hi[start:stop].argmax())


def _shared_scores(q, weights, keys, cand: PagedRows, start, stop, widest, e0, e1) -> torch.Tensor:
    """`_scores` of columns [e0, e1) for a block with shared ranges (`_shared_ranges`): the
    tile's keys are gathered once ([W, Di], not [t, W, Di]); each token masks the columns past
    its own range. -> [t, W] fp32."""
    cols = torch.arange(e0, e1, device=cand.req.device)
    rows = cand.rows_at(cols[None, :], widest, widest + 1)[0]              # [W], -1 past the widest range
    gathered = keys[rows.clamp(min=0)]
    gathered = unpack_index_keys(gathered) if is_packed(keys) else gathered.float()
    scores = torch.relu(torch.einsum("thd,ed->the", q.float(), gathered)) * q.shape[-1] ** -0.5
    scores = (scores * weights[..., None]).sum(dim=1)                      # [t, W]
    span = (cand.hi[start:stop] - cand.lo[start:stop])[:, None]
    return scores.masked_fill((cols[None, :] >= span) | (rows[None, :] < 0), float("-inf"))


def _scores(q, weights, keys, cand) -> torch.Tensor:
    """q [t, Hi, Di], weights [t, Hi] fp32, cand [t, W] rows (-1 absent) -> [t, W] fp32."""
    gathered = keys[cand.clamp(min=0)]                                     # [t, W, Di] (or packed)
    gathered = unpack_index_keys(gathered) if is_packed(keys) else gathered.float()
    scores = torch.relu(torch.einsum("thd,ted->the", q.float(), gathered)) * q.shape[-1] ** -0.5
    scores = (scores * weights[..., None]).sum(dim=1)                      # [t, W]
    return scores.masked_fill(cand < 0, float("-inf"))
