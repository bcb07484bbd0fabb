"""The indexer's streaming top-k (dsv4/ops/stream_topk.py, dsv4/ops/indexer.py): one total order
(score descending, ties to the lower offset), the same result for every tiling, and a step's
largest tensor bounded by O(T * k + tile), never O(T * E), at a 64k-token context."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsv4.ops.indexer as indexer_ops
from dsv4.ops import backend
from dsv4.ops.paged import PagedRows
from dsv4.ops.stream_topk import RunningTopk, key_offsets, score_keys
from paged_inputs import random_paged


def by_definition(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, k] offsets: a stable sort by score descending (ties keep the lower offset first),
    -1 for -inf scores."""
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    return torch.where(torch.isfinite(order.values[:, :k]), order.indices[:, :k], -1)


def tied_scores(T, E, seed):
    """Scores of few distinct values (many ties), both zeros, negatives and -inf."""
    g = torch.Generator().manual_seed(seed)
    values = torch.tensor([-2.5, -0.0, 0.0, 0.5, 1.0, 3.0, float("-inf")])
    return values[torch.randint(0, len(values), (T, E), generator=g)]


def test_keys_order_scores_then_lower_offset():
    scores = torch.tensor([[1.0, -1.0, 1.0, float("-inf"), -0.0, 0.0, 3e38, -3e38]])
    keys = score_keys(scores, first_offset=5)
    assert key_offsets(keys).tolist() == [[5, 6, 7, -1, 9, 10, 11, 12]]
    order = keys.argsort(dim=1, descending=True)[0].tolist()
    assert [o + 5 for o in order] == [11, 5, 7, 9, 10, 6, 12, 8]      # ties (1.0; -0.0 = 0.0): lower first


@pytest.mark.parametrize("width", [1, 3, 7, 16, 40])
@pytest.mark.parametrize("k", [1, 5, 16])
def test_any_tiling_is_the_definition(width, k):
    scores = tied_scores(9, 40, seed=width * 10 + k)
    running = RunningTopk(9, k, "cpu")
    for e0 in range(0, 40, width):
        running.add(scores[:, e0:e0 + width], e0)
    assert torch.equal(running.offsets(), by_definition(scores, k))


def indexer_scores(q, weights, keys, dense):
    s = torch.relu(torch.einsum("thd,ted->the", q.float(), keys[dense.clamp(min=0)].float())) * q.shape[-1] ** -0.5
    return (s * weights.float()[..., None]).sum(1).masked_fill(dense < 0, float("-inf"))


@pytest.mark.parametrize("tile", [1, 40, 1 << 22])
@pytest.mark.parametrize("topk", [3, 10])
def test_reference_ties_and_tiles(monkeypatch, tile, topk):
    """Small-integer inputs (exact sums, many exact ties): every tiling gives the definition's
    offsets, so the order is the stated one and not an accident of torch.topk."""
    cand, n = random_paged(23, 30, per_page=4, pitch=8, seed=topk)
    g = torch.Generator().manual_seed(tile)
    q = torch.randint(-1, 2, (23, 2, 16), generator=g).float()
    weights = torch.randint(0, 2, (23, 2), generator=g).float()
    keys = torch.randint(-1, 2, (n, 16), generator=g).float()
    monkeypatch.setattr(indexer_ops, "QUERY_BLOCK", 8)
    monkeypatch.setattr(indexer_ops, "TILE_ELEMS", tile)
    with backend.forced("reference"):
        rows, offsets = indexer_ops.indexer_topk_offsets(q, weights, keys, cand, topk)
    want = by_definition(indexer_scores(q, weights, keys, cand.dense()), topk)
    assert torch.equal(offsets, want) and torch.equal(rows, cand.rows_at(want))


class LargestTensor(TorchDispatchMode):
    """The largest tensor (elements) any op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_64k_context_chunk_memory_is_bounded(monkeypatch):
    """A 512-token prefill chunk ending at position 65536 (E = 16384 C4 entries): no tensor of
    the indexer grows with T x E (8.4M scores); the largest is within the tile bound, and the
    result equals the selection of the same chunk computed with a tile 64x larger."""
    T, E, Hi, Di, k = 512, 65536 // 4, 2, 16, 64
    lo = torch.zeros(T, dtype=torch.long)
    hi = (torch.arange(65536 - T, 65536) + 1) // 4                   # causal C4 entries per token
    pages = torch.randperm(E // 64 + 1)[None, : E // 64] * 1         # one request, 64-entry pages
    cand = PagedRows(pages, torch.zeros(T, dtype=torch.long), lo, hi, per_page=64, pitch=64, width=E)
    g = torch.Generator().manual_seed(0)
    q, weights = torch.randn(T, Hi, Di, generator=g), torch.randn(T, Hi, generator=g)
    keys = torch.randn((E // 64 + 1) * 64, Di, generator=g)
    monkeypatch.setattr(indexer_ops, "QUERY_BLOCK", 128)
    monkeypatch.setattr(indexer_ops, "TILE_ELEMS", 1 << 19)
    with backend.forced("reference"), LargestTensor() as mode:
        got = indexer_ops.indexer_topk(q, weights, keys, cand, k)
    tile = 128 * indexer_ops.entry_tile(128, Di, k)                   # [block, tile] scores
    assert mode.largest <= max(tile * Di, T * k) and mode.largest * 16 <= T * E
    monkeypatch.setattr(indexer_ops, "TILE_ELEMS", 1 << 25)
    with backend.forced("reference"):
        assert torch.equal(got, indexer_ops.indexer_topk(q, weights, keys, cand, k))
    assert (got >= 0).all()
