"""IndexCache's translation kernel (dsv4/ops/triton/translate.py) and the indexer kernel's
offsets (indexer_topk_offsets) against the torch references, bit for bit. Cases after SGLang's
raw-to-page kernel tests (seed 004): invalid indices (-1 and past the range), page sizes, odd
top-k sizes, non-contiguous input, empty top-k."""
import pathlib
import sys

import pytest
import torch

from dsv4.ops import backend
from dsv4.ops import indexer as ref_indexer
from dsv4.ops import translate as ref
from dsv4.ops.paged import PagedRows
from dsv4.ops.triton import indexer as tri_indexer
from dsv4.ops.triton import translate as tri

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "ops"))
from paged_inputs import random_paged  # noqa: E402


def offsets_for(paged, K, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, paged.width + 3, (paged.num_tokens, K), generator=g).to(device)


def reference(paged, offsets):
    cpu = PagedRows(*(v.cpu() for v in (paged.pages, paged.req, paged.lo, paged.hi)), per_page=paged.per_page,
                    pitch=paged.pitch, width=paged.width)
    with backend.forced("reference"):
        return ref.translate_topk(cpu, offsets.cpu())


@pytest.mark.parametrize("per_page, pitch", [(64, 64), (64, 192), (4, 12), (1, 3)])
@pytest.mark.parametrize("K", [0, 1, 5, 37, 512])
def test_kernel_is_the_reference(per_page, pitch, K, device):
    paged, _ = random_paged(13, 40, per_page=per_page, pitch=pitch, seed=K + per_page, device=device)
    offsets = offsets_for(paged, K, K, device)
    got = tri.translate_topk(paged, offsets)
    assert got.shape == (13, K) and got.dtype == torch.long and got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), reference(paged, offsets))


def test_blocks_strides_int32_and_empty(device, monkeypatch):
    """Several programs per token (a partial last block), non-contiguous and int32 offsets,
    an int32 page table, no tokens."""
    monkeypatch.setattr(tri, "BLOCK", 4)
    paged, _ = random_paged(9, 20, per_page=4, pitch=12, seed=5, device=device)
    wide = offsets_for(paged, 33, 6, device)
    for offsets in (wide, wide[:, ::2], wide.t().contiguous().t()[:, 3:14], wide[:, 1:12].to(torch.int32)):
        assert torch.equal(tri.translate_topk(paged, offsets).cpu(), reference(paged, offsets))
    small = PagedRows(*(v.to(torch.int32) for v in (paged.pages, paged.req, paged.lo, paged.hi)),
                      per_page=4, pitch=12, width=20)
    assert torch.equal(tri.translate_topk(small, wide).cpu(), reference(paged, wide))
    none = PagedRows(paged.pages, paged.req[:0], paged.lo[:0], paged.hi[:0], per_page=4, pitch=12, width=20)
    assert tri.translate_topk(none, wide[:0]).shape == (0, 33)


def test_dispatch(device, monkeypatch):
    paged, _ = random_paged(5, 8, per_page=4, pitch=4, seed=1, device=device)
    offsets = offsets_for(paged, 6, 2, device)
    want = reference(paged, offsets)
    calls = []
    kernel = tri.translate_topk
    monkeypatch.setattr(tri, "translate_topk", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(ref, "use_triton", lambda t: True)
    assert torch.equal(ref.translate_topk(paged, offsets).cpu(), want) and calls == [1]


@pytest.mark.parametrize("topk", [1, 7, 37, 512])
def test_indexer_offsets(topk, device, monkeypatch):
    """The indexer kernel's (rows, offsets): rows are its indexer_topk's bit for bit, offsets
    translate to them, and -1 sits in the same places as in the reference's."""
    monkeypatch.setattr(tri_indexer, "ROWS_BLOCK", 4)
    cand, n = random_paged(11, 37, per_page=4, pitch=12, seed=topk, device=device)
    g = torch.Generator().manual_seed(topk)
    q = torch.randn(11, 8, 32, generator=g).to(device)
    w = torch.randn(11, 8, generator=g).to(device)
    keys = torch.randn(n, 32, generator=g).to(device)
    rows, offsets = tri_indexer.indexer_topk_offsets(q, w, keys, cand, topk, 0.5)
    assert (offsets >= 0).any() and (offsets < 0).any()
    assert rows.shape == offsets.shape == (11, min(topk, 37)) and offsets.dtype == torch.long
    assert torch.equal(rows, tri_indexer.indexer_topk(q, w, keys, cand, topk, 0.5))
    assert torch.equal(rows.cpu(), reference(cand, offsets))
    with backend.forced("reference"):
        _, want = ref_indexer.indexer_topk_offsets(q.cpu(), w.cpu(), keys.cpu(), reference_paged(cand), topk, 0.5)
    assert torch.equal((offsets < 0).sum(1).cpu(), (want < 0).sum(1))


def reference_paged(paged):
    return PagedRows(*(v.cpu() for v in (paged.pages, paged.req, paged.lo, paged.hi)), per_page=paged.per_page,
                     pitch=paged.pitch, width=paged.width)


def test_indexer_offsets_empty(device):
    cand, n = random_paged(3, 0, per_page=4, pitch=4, seed=0, device=device)
    q, w, keys = (torch.randn(3, 4, 16, device=device), torch.randn(3, 4, device=device),
                  torch.randn(max(n, 1), 16, device=device))
    rows, offsets = tri_indexer.indexer_topk_offsets(q, w, keys, cand, 5)
    assert rows.shape == offsets.shape == (3, 0)
