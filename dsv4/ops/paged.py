"""Paged row ranges: which pool rows each token of a step reads, without a [tokens x rows] table.

Token t reads the items (positions or compressed entries) e in [lo[t], hi[t]) of one request,
whose page table is pages[req[t]]. Item e sits on logical page e // per_page, slot
e % per_page, i.e. on pool row

    row(t, e) = pages[req[t], e // per_page] * pitch + e % per_page

(`pitch` = pool rows between consecutive pages of one layer: pages are page-major across the
layers of a kind, docs/architecture.md "Cache"). Building one costs O(tokens + pages); the
kernels look rows up as they go. `width` is a static bound on hi - lo (the step's widest
range; for CUDA graphs a bucket), the width of the equivalent dense table

    dense[t, k] = row(t, lo[t] + k)   if k < hi[t] - lo[t]   else -1     (k < width)

which the torch references build block by block and never for the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedRows:
    pages: torch.Tensor   # [R, P] long: physical page of each logical page (-1: none; never in range)
    req: torch.Tensor     # [T] long: the request (row of `pages`) of each token
    lo: torch.Tensor      # [T] long: first item of the range
    hi: torch.Tensor      # [T] long: one past the last item (hi <= lo: empty)
    per_page: int         # items on one page
    pitch: int            # pool rows from one page to the next
    width: int            # static bound on hi - lo

    @property
    def num_tokens(self) -> int:
        return int(self.req.shape[0])

    def rows_at(self, k: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """k [t, K] offsets into the ranges of tokens [start, stop) -> their pool rows, -1 where
        k is outside [0, hi - lo)."""
        stop = self.num_tokens if stop is None else stop
        lo, hi, req = self.lo[start:stop, None], self.hi[start:stop, None], self.req[start:stop, None]
        e = lo + k
        valid = (k >= 0) & (e < hi)
        logical = torch.where(valid, e // self.per_page, 0).clamp(max=self.pages.shape[1] - 1)
        phys = self.pages[req, logical]
        return torch.where(valid, phys * self.pitch + e % self.per_page, -1)

    def dense(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The dense table of tokens [start, stop): [stop - start, width] long, -1 past hi - lo."""
        k = torch.arange(self.width, device=self.req.device)[None, :]
        return self.rows_at(k, start, stop)

    def one_item_pages(self) -> "PagedRows":
        """The same rows with one item per page: the table holds each item's row (pitch 1).
        O(pages x per_page) to build; for small pages (HCA's 2 entries) the kernels then read
        the table contiguously instead of once per pair."""
        e = torch.arange(self.pages.shape[1] * self.per_page, device=self.pages.device)
        phys = self.pages[:, e // self.per_page]
        table = torch.where(phys >= 0, phys * self.pitch + e % self.per_page, -1)
        return PagedRows(table, self.req, self.lo, self.hi, 1, 1, self.width)


def index_width(idx: torch.Tensor | PagedRows) -> int:
    """Slots per token: a dense table's K, a PagedRows' width."""
    return idx.width if isinstance(idx, PagedRows) else int(idx.shape[1])


def dense_index(idx: torch.Tensor | PagedRows, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows [start, stop) of a dense index table, or of a PagedRows' dense form."""
    if isinstance(idx, PagedRows):
        return idx.dense(start, stop)
    return idx[start:stop]
