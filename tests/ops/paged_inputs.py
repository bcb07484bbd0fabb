"""Random PagedRows for the paged-vs-dense tests (tests/ops, tests/ops_triton).

Several requests, each with a page table of shuffled physical pages drawn from one pool
(pitch > per_page: the rows in between belong to other layers and must never be read), -1
for logical pages outside every range of the request (trimmed or not yet written), and a mix
of ranges per token: sliding windows (lo > 0), prefixes (lo = 0, as causal compressed
history), full ranges (hi - lo = width) and empty ones (hi <= lo).
"""
from __future__ import annotations

import torch

from dsv4.ops.paged import PagedRows, dense_index


def random_paged(T: int, width: int, *, per_page: int, pitch: int, requests: int = 3, seed: int = 0,
                 device: str = "cpu") -> tuple[PagedRows, int]:
    """-> (PagedRows of T tokens, rows its pool needs)."""
    assert pitch >= per_page
    g = torch.Generator().manual_seed(seed)
    length = [max(width, 1) + int(torch.randint(0, 3 * width + 1, (1,), generator=g)) for _ in range(requests)]
    req = torch.randint(0, requests, (T,), generator=g)
    lo, hi = torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long)
    for t in range(T):
        n = length[int(req[t])]
        kind = t % 4 if t < 4 else int(torch.randint(0, 4, (1,), generator=g))
        end = int(torch.randint(1, n + 1, (1,), generator=g))
        if kind == 0:                                   # sliding window
            lo[t], hi[t] = max(0, end - width), end
        elif kind == 1:                                 # prefix, often shorter than width
            lo[t], hi[t] = 0, min(end, int(torch.randint(0, width + 1, (1,), generator=g)))
        elif kind == 2:                                 # full width, ending anywhere
            lo[t] = int(torch.randint(0, n - width + 1, (1,), generator=g))
            hi[t] = lo[t] + width
        else:                                           # empty, hi <= lo
            lo[t] = end
            hi[t] = end - int(torch.randint(0, 3, (1,), generator=g))
    n_logical = max(length) // per_page + 2             # a spare -1 column past every range
    used = torch.zeros(requests, n_logical, dtype=torch.bool)
    for t in range(T):
        if hi[t] > lo[t]:
            used[req[t], int(lo[t]) // per_page:(int(hi[t]) - 1) // per_page + 1] = True
    n_phys = int(used.sum()) + 5                        # spare physical pages no token reads
    phys = torch.randperm(n_phys, generator=g)[:int(used.sum())]
    pages = torch.full((requests, n_logical), -1, dtype=torch.long)
    pages[used] = phys
    paged = PagedRows(pages.to(device), req.to(device), lo.to(device), hi.to(device),
                      per_page=per_page, pitch=pitch, width=width)
    return paged, n_phys * pitch


def dense_by_definition(paged: PagedRows) -> torch.Tensor:
    """The dense table of paged.py's docstring, one element at a time."""
    out = torch.full((paged.num_tokens, paged.width), -1, dtype=torch.long)
    pages = paged.pages.cpu()
    for t in range(paged.num_tokens):
        r, lo, hi = int(paged.req[t]), int(paged.lo[t]), int(paged.hi[t])
        for k in range(min(max(hi - lo, 0), paged.width)):
            e = lo + k
            out[t, k] = int(pages[r, e // paged.per_page]) * paged.pitch + e % paged.per_page
    return out


MIXES = ["paged", "paged_dense", "dense_paged", "one"]


def mixed_sources(sources: list, mix: str) -> tuple[list, list]:
    """Two paged `(kv, PagedRows)` sources -> (the sources as `mix` says: both paged, the second
    or the first in dense form, or only the second; every source's dense form)."""
    sources = list(sources)
    if mix == "paged_dense":
        sources[1] = (sources[1][0], sources[1][1].dense())
    elif mix == "dense_paged":
        sources[0] = (sources[0][0], sources[0][1].dense())
    elif mix == "one":
        sources = sources[1:]
    return sources, [(kv, dense_index(idx)) for kv, idx in sources]
