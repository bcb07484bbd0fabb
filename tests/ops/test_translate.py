"""IndexCache's translation (dsv4/ops/translate.py) and the indexer's offsets
(indexer_topk_offsets): offsets into each token's range -> pool rows, -1 kept, against the
definition in dsv4/ops/paged.py element by element. Cases after SGLang's raw-to-page kernel
tests (seed 004: invalid indices, page sizes, odd top-k sizes, non-contiguous input, empty top-k)."""
import pytest
import torch

import dsv4.ops.indexer as indexer_ops
from dsv4.ops.translate import translate_topk
from paged_inputs import dense_by_definition, random_paged


def random_offsets(paged, K: int, seed: int) -> torch.Tensor:
    """[T, K] offsets: in range, -1, and past the range (hi - lo and beyond), mixed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, paged.width + 3, (paged.num_tokens, K), generator=g)


def by_definition(paged, offsets) -> torch.Tensor:
    dense = dense_by_definition(paged)
    n = (paged.hi - paged.lo).clamp(min=0).cpu()
    out = torch.full(offsets.shape, -1, dtype=torch.long)
    for t in range(offsets.shape[0]):
        for j in range(offsets.shape[1]):
            k = int(offsets[t, j])
            if 0 <= k < min(int(n[t]), paged.width):
                out[t, j] = dense[t, k]
    return out


@pytest.mark.parametrize("per_page, pitch", [(64, 64), (64, 256), (4, 12), (1, 3)])
@pytest.mark.parametrize("K", [0, 1, 7, 40])
def test_translation_is_the_definition(per_page, pitch, K):
    paged, _ = random_paged(30, 24, per_page=per_page, pitch=pitch, seed=per_page + K)
    offsets = random_offsets(paged, K, seed=K)
    got = translate_topk(paged, offsets)
    assert got.shape == (30, K) and got.dtype == torch.long
    assert torch.equal(got, by_definition(paged, offsets))
    assert torch.equal(got < 0, by_definition(paged, offsets) < 0)


def test_non_contiguous_and_int32_offsets():
    paged, _ = random_paged(20, 16, per_page=4, pitch=12, seed=3)
    wide = random_offsets(paged, 30, seed=4)
    for offsets in (wide[:, ::3], wide.t().contiguous().t()[:, 5:17], wide[:, 2:9].to(torch.int32)):
        assert not offsets.is_contiguous() or offsets.dtype == torch.int32
        assert torch.equal(translate_topk(paged, offsets), by_definition(paged, offsets))


@pytest.mark.parametrize("topk", [1, 5, 16, 40])
def test_indexer_offsets_translate_to_its_rows(topk):
    """The reference's (rows, offsets): rows are indexer_topk's, bit for bit, and exactly the
    translation of the offsets; -1 in the same places."""
    paged, n = random_paged(25, 32, per_page=4, pitch=12, seed=topk)
    g = torch.Generator().manual_seed(topk)
    q, w, keys = torch.randn(25, 4, 16, generator=g), torch.randn(25, 4, generator=g), torch.randn(n, 16, generator=g)
    rows, offsets = indexer_ops.indexer_topk_offsets(q, w, keys, paged, topk, 0.5)
    assert rows.shape == offsets.shape == (25, min(topk, 32)) and offsets.dtype == torch.long
    assert torch.equal(rows, indexer_ops.indexer_topk(q, w, keys, paged, topk, 0.5))
    assert torch.equal(rows, translate_topk(paged, offsets)) and torch.equal(rows < 0, offsets < 0)
    assert (offsets >= 0).any() and (offsets < 0).any()
