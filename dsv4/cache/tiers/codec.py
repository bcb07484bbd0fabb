"""History pages as flat rows (docs/architecture.md, "Host and disk tiers").

A 256-token history page is three contiguous blocks of `KVStorage` (`page(kind, p)`: C4
entries, indexer keys, C128 entries, each [layers of the kind, slots, width]); a tier stores
them back to back in one row of `numel` elements of the cache dtype, in the order of KINDS.
`gather` / `scatter` move any number of pages in a fixed number of kernels (one gather or
scatter per kind): what a tier copy issues does not grow with its pages.
"""
from __future__ import annotations

import torch

KINDS = ("c4", "idx", "c128")


class PageCodec:
    def __init__(self, storage):
        self.storage = storage
        self.sizes = [storage.page(kind, 0).numel() for kind in KINDS]
        self.numel = sum(self.sizes)
        self.dtype = storage.kinds["c4"].dtype

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Pack history pages `pages` (long [n], on the cache's device) into rows `out` [n, numel]."""
        blocks = [self.storage.kinds[kind].index_select(0, pages).view(len(pages), -1) for kind in KINDS]
        torch.cat(blocks, dim=1, out=self._rows(out, len(pages)))

    def scatter(self, rows: torch.Tensor, pages: torch.Tensor) -> None:
        """Write rows `rows` [n, numel] (on the cache's device) into history pages `pages` (long [n])."""
        start = 0
        for n, kind in zip(self.sizes, KINDS):
            t = self.storage.kinds[kind]
            t.index_copy_(0, pages, self._rows(rows, len(pages))[:, start:start + n].view(len(pages), *t.shape[1:]))
            start += n

    def _rows(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        if rows.shape != (n, self.numel):
            raise ValueError(f"page rows of shape {tuple(rows.shape)}, expected ({n}, {self.numel})")
        return rows
