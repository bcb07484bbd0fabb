"""The image rows of one step: which token rows take image block embeddings (docs/vision.md).

ImageRows is what `DeepseekV4.forward` reads: rows [I] long (token rows of the step),
embeds [I, hidden] (their embeddings), mask [T] bool (the same rows, for the router).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .spans import ImageSpan


@dataclass(frozen=True)
class ImageRows:
    rows: torch.Tensor
    embeds: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class ChunkImages:
    """One chunk of the step: positions [start, start + n) at token rows [row, row + n)."""
    spans: Sequence[ImageSpan]
    start: int
    n: int
    row: int


def step_image_rows(chunks: list[ChunkImages], blocks, num_tokens: int, device) -> ImageRows | None:
    """`blocks(span)` -> the span's block embeddings [span.length, hidden]; None when no chunk
    of the step touches an image."""
    rows, embeds = [], []
    for c in chunks:
        for s in c.spans:
            lo, hi = max(s.start, c.start), min(s.end, c.start + c.n)
            if lo >= hi:
                continue
            rows.append(torch.arange(lo, hi) - c.start + c.row)
            embeds.append(blocks(s)[lo - s.start:hi - s.start])
    if not rows:
        return None
    rows_t = torch.cat(rows).to(device)
    mask = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    mask[rows_t] = True
    return ImageRows(rows_t, torch.cat(embeds).to(device), mask)
