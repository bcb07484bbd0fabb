"""One history page as one flat row (docs/architecture.md, "Host and disk tiers").

A 256-token history page is three contiguous blocks of `KVStorage` (`page(kind, p)`: C4
entries, indexer keys, C128 entries, each [layers of the kind, slots, width]); a tier stores
them back to back in one row of `numel` elements of the cache dtype, in the order of KINDS.
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

    def pack(self, page: int, out: torch.Tensor) -> None:
        """Copy history page `page` into the flat row `out` [numel] (any device)."""
        for view, kind in zip(self._views(out), KINDS):
            view.copy_(self.storage.page(kind, page).reshape(-1), non_blocking=True)

    def unpack(self, row: torch.Tensor, page: int) -> None:
        """Write the flat row `row` into history page `page`."""
        for view, kind in zip(self._views(row), KINDS):
            self.storage.page(kind, page).copy_(view.view(self.storage.page(kind, page).shape), non_blocking=True)

    def _views(self, row: torch.Tensor) -> list[torch.Tensor]:
        if row.shape != (self.numel,):
            raise ValueError(f"page row of shape {tuple(row.shape)}, expected ({self.numel},)")
        out, start = [], 0
        for n in self.sizes:
            out.append(row[start:start + n])
            start += n
        return out
