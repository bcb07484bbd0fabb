"""PagedRows (dsv4/ops/paged.py) and the torch references given one: the same results, bit for
bit, as given its dense form, computed block by block (never a whole-step dense table)."""
import pytest
import torch

import dsv4.ops.attention as attention_ops
import dsv4.ops.indexer as indexer_ops
from dsv4.ops import backend
from dsv4.ops.paged import PagedRows, dense_index, index_width
from paged_inputs import MIXES, dense_by_definition, mixed_sources, random_paged


@pytest.mark.parametrize("per_page, pitch", [(4, 4), (4, 12), (8, 24), (1, 3)])
def test_dense_is_the_definition(per_page, pitch):
    paged, rows = random_paged(40, 16, per_page=per_page, pitch=pitch, seed=per_page + pitch)
    dense = paged.dense()
    assert dense.shape == (40, 16) and dense.dtype == torch.long
    assert torch.equal(dense, dense_by_definition(paged))
    assert int(dense.max()) < rows and not ((dense >= 0) & (dense % pitch >= per_page)).any()
    assert torch.equal(paged.dense(5, 17), dense[5:17])
    assert torch.equal(dense_index(paged, 5, 17), dense[5:17]) and index_width(paged) == 16
    k = torch.tensor([[-1, 0, 15, 16, 40]]).expand(40, -1)
    want = torch.cat([torch.full((40, 1), -1), dense[:, [0, 15]], torch.full((40, 2), -1)], dim=1)
    assert torch.equal(paged.rows_at(k), want)


def test_inputs_cover_the_cases():
    """The random tables have what the kernel tests rely on."""
    paged, _ = random_paged(40, 16, per_page=4, pitch=12)
    n = (paged.hi - paged.lo).clamp(min=0)
    assert (paged.lo > 0).any() and (n == 0).any() and (n == 16).any() and ((n > 0) & (n < 16)).any()
    assert (paged.hi < paged.lo).any() and (paged.pages < 0).any() and paged.req.unique().numel() > 1


class DenseCalls:
    """Records the token count of every PagedRows.dense call."""

    def __init__(self, monkeypatch):
        self.sizes = []
        dense = PagedRows.dense

        def spy(paged, start=0, stop=None):
            out = dense(paged, start, stop)
            self.sizes.append(out.shape[0])
            return out
        monkeypatch.setattr(PagedRows, "dense", spy)


def attention_inputs(T, H=4, D=32, seed=0):
    window, n_window = random_paged(T, 16, per_page=8, pitch=24, requests=3, seed=seed)
    history, n_history = random_paged(T, 24, per_page=4, pitch=12, requests=3, seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(T, H, D, generator=g)
    kv0, kv1 = torch.randn(n_window, D, generator=g), torch.randn(n_history, D, generator=g)
    return q, [(kv0, window), (kv1, history)], torch.randn(H, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES)
def test_attention_paged_is_dense(monkeypatch, dtype, mix):
    monkeypatch.setattr(attention_ops, "QUERY_BLOCK", 8)
    calls = DenseCalls(monkeypatch)
    q, sources, sinks = attention_inputs(29)
    q, sources = q.to(dtype), [(kv.to(dtype), idx) for kv, idx in sources]
    sources, dense = mixed_sources(sources, mix)
    calls.sizes.clear()
    with backend.forced("reference"):
        got = attention_ops.sparse_attention(q, sources, sinks, 0.2)
        want = attention_ops.sparse_attention(q, dense, sinks, 0.2)
    assert torch.equal(got, want)
    assert calls.sizes and max(calls.sizes) <= 8, "the reference builds the dense rows block by block"
    empty = torch.stack([(idx.hi <= idx.lo) if isinstance(idx, PagedRows) else (idx < 0).all(1)
                         for _, idx in sources]).all(0)
    assert empty.any() and got[empty].abs().max() == 0


def indexer_inputs(T, width, Hi=4, Di=16, seed=0):
    cand, n = random_paged(T, width, per_page=4, pitch=12, requests=3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hi, Di, generator=g)
    return q, torch.randn(T, Hi, generator=g), torch.randn(n, Di, generator=g), cand


class RowsAtCalls:
    """Records the shape of every PagedRows.rows_at result."""

    def __init__(self, monkeypatch):
        self.shapes = []
        rows_at = PagedRows.rows_at

        def spy(paged, k, start=0, stop=None):
            out = rows_at(paged, k, start, stop)
            self.shapes.append(tuple(out.shape))
            return out
        monkeypatch.setattr(PagedRows, "rows_at", spy)


@pytest.mark.parametrize("topk", [5, 24, 100])            # fewer than width, width, more
def test_indexer_paged_is_dense(monkeypatch, topk):
    monkeypatch.setattr(indexer_ops, "QUERY_BLOCK", 8)
    monkeypatch.setattr(indexer_ops, "TILE_ELEMS", 8 * 4 * 6)      # 6-entry tiles (or k wide)
    calls = RowsAtCalls(monkeypatch)
    q, weights, keys, cand = indexer_inputs(29, 24)
    dense = cand.dense()
    calls.shapes.clear()
    with backend.forced("reference"):
        got = indexer_ops.indexer_topk(q, weights, keys, cand, topk, 0.5)
        want = indexer_ops.indexer_topk(q, weights, keys, dense, topk, 0.5)
    assert got.shape == (29, min(topk, 24)) and got.dtype == torch.long
    assert torch.equal(got, want)
    tiles = calls.shapes[:-1]                     # the last call turns the chosen offsets into rows
    assert tiles and max(t for t, _ in tiles) <= 8, "the reference builds the rows block by block"
    assert max(w for _, w in tiles) <= max(6, min(topk, 24)), "and tile by tile"
    n = (cand.hi - cand.lo).clamp(min=0, max=24)
    assert torch.equal((got >= 0).sum(1), n.clamp(max=got.shape[1]))


def test_indexer_zero_width():
    q, weights, keys, cand = indexer_inputs(5, 24)
    empty = PagedRows(cand.pages, cand.req, cand.lo, cand.lo, cand.per_page, cand.pitch, 0)
    with backend.forced("reference"):
        got = indexer_ops.indexer_topk(q, weights, keys, empty, 8)
    assert got.shape == (5, 0) and got.dtype == torch.long


@pytest.mark.parametrize("per_page, pitch", [(2, 8), (64, 64 * 3)])
def test_one_item_pages_address_the_same_rows(per_page, pitch):
    paged, _ = random_paged(40, 150, per_page=per_page, pitch=pitch, seed=5)
    flat = paged.one_item_pages()
    assert (flat.per_page, flat.pitch) == (1, 1)
    assert torch.equal(flat.dense(), paged.dense()) and (flat.dense() >= 0).any()
