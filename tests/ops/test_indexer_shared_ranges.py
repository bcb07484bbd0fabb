"""The indexer reference's prefill-chunk path (dsv4/ops/indexer.py `_shared_scores`): when a
query block is one request's tokens with one range start, each tile's keys are gathered once
and every token masks the columns past its own range. It must choose what the per-token
gather chooses, exactly where sums are exact, and score within rounding otherwise."""
import pytest
import torch

import dsv4.ops.indexer as ix
from dsv4.ops.paged import PagedRows

PER_PAGE, DI, HI = 64, 16, 4


def chunk_ranges(start: int, tokens: int, n_pages: int, seed: int, requests: int = 1) -> PagedRows:
    """Tokens [start, start + tokens) of `requests` requests (alternating), C4 ranges
    [0, (pos + 1) // 4), pages of each request a random permutation of the pool's."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.stack([torch.randperm(requests * n_pages, generator=g)[:n_pages] for _ in range(requests)])
    pos = torch.arange(start, start + tokens)
    req = torch.arange(tokens) % requests
    hi = (pos + 1) // 4
    return PagedRows(pages, req, torch.zeros_like(hi), hi, PER_PAGE, PER_PAGE, int(hi.max()))


def inputs(cand: PagedRows, exact: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    T, rows = cand.num_tokens, int(cand.pages.numel()) * PER_PAGE
    draw = (lambda *s: torch.randint(-1, 2, s, generator=g).float()) if exact else (lambda *s: torch.randn(*s, generator=g))
    return draw(T, HI, DI), draw(T, HI).abs(), draw(rows, DI)


@pytest.mark.parametrize("start, tokens", [(0, 300), (5000, 700), (3, 1)])
def test_shared_path_chooses_exactly_what_the_per_token_gather_chooses(start, tokens):
    cand = chunk_ranges(start, tokens, n_pages=(start + tokens) // 256 + 1, seed=start)
    assert ix._shared_ranges(cand, 0, tokens) is not None
    q, w, keys = inputs(cand, exact=True, seed=1)
    got = ix._topk(q, w, keys, cand, 16, 1.0)
    want = ix._topk(q, w, keys, cand.dense(), 16, 1.0)           # a dense table: the per-token gather
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])


def test_shared_scores_equal_the_per_token_scores_within_rounding():
    cand = chunk_ranges(2000, 256, n_pages=10, seed=3)
    q, w, keys = inputs(cand, exact=False, seed=2)
    widest = ix._shared_ranges(cand, 0, 256)
    assert widest == 255                                           # the last token sees the most entries
    for e0, e1 in [(0, 100), (100, 563)]:
        shared = ix._shared_scores(q, w, keys, cand, 0, 256, widest, e0, e1)
        per_token = ix._scores(q, w, keys, ix._cand_tile(cand, 0, 256, e0, e1))
        assert torch.equal(torch.isinf(shared), torch.isinf(per_token))
        finite = torch.isfinite(per_token)
        torch.testing.assert_close(shared[finite], per_token[finite], rtol=1e-5, atol=1e-6)


def test_blocks_of_several_requests_take_the_per_token_path():
    cand = chunk_ranges(1000, 64, n_pages=6, seed=4, requests=2)
    assert ix._shared_ranges(cand, 0, 64) is None
    assert ix._shared_ranges(cand, 0, 1) == 0                       # one token: trivially shared
    q, w, keys = inputs(cand, exact=True, seed=5)
    assert torch.equal(ix._topk(q, w, keys, cand, 8, 1.0)[1], ix._topk(q, w, keys, cand.dense(), 8, 1.0)[1])
