"""The head-loop kernel of the indexer's tiled scores (dsv4/ops/triton/indexer_scores_heads.py)
against the tiled and per-token kernels and the torch reference: q by pointers or TMA boxes;
prefill chunks, blocks mixing requests or windows (token by token), causal tails, padding; the
default dispatch (dsv4/ops/triton/indexer.py TILED_SCORES)."""
import pytest
import torch
from test_indexer_gemm_triton import CASES, chunks, inputs
from test_indexer_triton import assert_scores_close, reference_scores

from dsv4.ops.paged import PagedRows
from dsv4.ops.triton import indexer_scores as isc
from dsv4.ops.triton.indexer_scores_heads import HeadLoopTiles, indexer_scores_heads

VARIANTS = {
    "pointers": HeadLoopTiles(16, 16, 4, 2),
    "q tma": HeadLoopTiles(16, 16, 4, 2, q_tma=True),
}


def on(device, cand):
    return PagedRows(*(v.to(device) for v in (cand.pages, cand.req, cand.lo, cand.hi)), cand.per_page, cand.pitch,
                     cand.width)


@pytest.mark.parametrize("kind", ["int-bf16", "rand-bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_scores(variant, case, kind, device):
    """Bit for bit the per-token kernel's scores where every sum is exact, within fp32 summation
    order otherwise; -inf at the reference's places; tiles of e0 > 0 too."""
    tiles = VARIANTS[variant]
    spans, pad, window, width = CASES[case]
    cand, n = chunks(spans, pad, window, seed=len(case), width=width)
    cand = on(device, cand)
    T = cand.num_tokens
    q, weights, keys = (v.to(device) for v in inputs(T, n, 4, kind, seed=T, Di=32 if kind.startswith("rand") else 16))
    got = indexer_scores_heads(q, weights, keys, cand, tiles, weight_scale=0.5).cpu()
    old = isc.indexer_scores(q, weights, keys, cand, block_e=16, weight_scale=0.5, tiles=None).cpu()
    want = reference_scores(q.cpu(), weights.cpu() * 0.5, keys.cpu(), cand.dense().cpu())
    assert got.shape == (T, cand.width)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    if kind.startswith("int"):
        assert torch.equal(got, old) and torch.equal(got, want)
    else:
        assert_scores_close(got, want)
    e0 = cand.width // 2
    part = indexer_scores_heads(q, weights, keys, cand, tiles, weight_scale=0.5, e0=e0, e1=cand.width).cpu()
    assert_scores_close(part, got[:, e0:])


@pytest.mark.parametrize("variant", ["pointers", "q tma"])
def test_v4_shapes(variant, device):
    """V4-Flash's indexer (Hi = 64, Di = 128, C4 pages of 64 entries) at a 900k-like launch
    shape (64 x 128 blocks): a chunk's scores are the reference's up to fp32 summation order."""
    tiles = HeadLoopTiles(**{**VARIANTS[variant].__dict__, "block_t": 64, "block_e": 128})
    T, E = 69, 135
    cand, n = chunks([(0, 4 * E - T, T)])
    q, weights, keys = (v.to(device) for v in inputs(T, n, 64, "rand-bf16", Di=128))
    got = indexer_scores_heads(q, weights, keys, on(device, cand), tiles).cpu()
    assert_scores_close(got, reference_scores(q.cpu(), weights.cpu(), keys.cpu(), cand.dense().cpu()))
    assert torch.isfinite(got[-1]).all() and not torch.isfinite(got[0]).all()


def test_other_inputs_take_the_tiled_kernel(device):
    """Packed FP8 keys and dense candidates: indexer_scores' tiled kernel, the same scores."""
    cand, n = chunks([(0, 60, 20)])
    q, weights, keys = (v.to(device) for v in inputs(20, n, 4, "rand-fp8"))
    cand = on(device, cand)
    want = isc.indexer_scores(q, weights, keys, cand, tiles=isc.GEMM_TILES)
    assert torch.equal(indexer_scores_heads(q, weights, keys, cand, VARIANTS["q tma"]), want)
    q, weights, keys = (v.to(device) for v in inputs(20, n, 4, "int-bf16"))
    dense = cand.dense()
    assert torch.equal(indexer_scores_heads(q, weights, keys, dense, VARIANTS["pointers"]),
                       isc.indexer_scores(q, weights, keys, dense, tiles=isc.GEMM_TILES))


@pytest.mark.parametrize("aligned", [True, False])
def test_default_dispatch(aligned, device):
    """indexer.py's TILED_SCORES "heads" (the default) scores a prefill tile by this kernel where it
    takes q (TMA: 16-byte aligned rows), else by indexer_scores: the same scores either way; q
    one element off a 16-byte boundary takes the fallback, and heads_ok says so."""
    from dsv4.ops.triton import indexer as triton_indexer
    from dsv4.ops.triton.indexer_scores_heads import HEAD_TILES, heads_ok
    assert triton_indexer.TILED_SCORES == "heads"
    T, E = 40, 70
    cand, n = chunks([(0, 4 * E - T, T)])
    cand = on(device, cand)
    q, weights, keys = (v.to(device) for v in inputs(T, n, 4, "int-bf16", Di=16))
    if not aligned:     # the same values in a view that starts one element past an aligned base
        q = torch.cat([q.new_zeros(1), q.flatten()])[1:].view(q.shape)
    assert heads_ok(q, keys, cand, HEAD_TILES) == aligned
    got = triton_indexer._tile_scores(q, weights, keys, cand, 0.5, 8, E).cpu()
    want = isc.indexer_scores(q, weights, keys, cand, weight_scale=0.5, e0=8, e1=E, tiles=isc.GEMM_TILES).cpu()
    assert torch.equal(got, want)
    buffer = torch.full((T * E,), float("nan"), device=device)          # out=: the scores in a given view
    into = triton_indexer._tile_scores(q, weights, keys, cand, 0.5, 8, E, buffer[:T * (E - 8)].view(T, E - 8))
    assert into.data_ptr() == buffer.data_ptr() and torch.equal(into.cpu(), want)
    with pytest.raises(ValueError, match="out must be"):
        triton_indexer._tile_scores(q, weights, keys, cand, 0.5, 8, E, buffer[:T * (E - 7)].view(T, E - 7))
