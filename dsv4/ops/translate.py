"""IndexCache's translation (torch reference): the indexer top-k of a producer CSA layer kept as
offsets into each token's PagedRows range, turned into pool rows through a layer's own table.

    rows[t, j] = paged.rows_at(offsets)[t, j]
               = pages[req[t], e // per_page] * pitch + e % per_page,   e = lo[t] + offsets[t, j]
                 if 0 <= offsets[t, j] < hi[t] - lo[t]   else -1

For the C4 candidates lo = 0, so an offset is the logical C4 entry index (dsv4/ops/paged.py):
a shared layer reads the producer's choice of entries at its own rows (docs/architecture.md,
"Model").
"""
from __future__ import annotations

import torch

from .backend import use_triton
from .paged import PagedRows


def translate_topk(paged: PagedRows, offsets: torch.Tensor) -> torch.Tensor:
    """offsets [T, K] (any integer dtype and strides; -1 = none) -> rows [T, K] long, -1 kept."""
    if use_triton(offsets):
        from .triton.translate import translate_topk as triton_translate_topk
        return triton_translate_topk(paged, offsets)
    return paged.rows_at(offsets.long())
