"""Bidirectional visibility inside an image block in the sliding window (docs/vision.md,
"Model"): a row of a block [s, e) at position p reads SWA positions [min(p - W + 1, s), e)
(clipped at 0) instead of (p - W, p]: the whole block, both ways, and its usual window
before. Chunks hold whole blocks (dsv4/model/vision/spans.py: atomic_chunk), so every key
it reads is written by the same step before attention."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .spans import ImageSpan


def blocks_in_chunk(spans: Sequence[ImageSpan], start: int, n: int) -> tuple[tuple[int, int], ...]:
    """(s, e) of the blocks inside positions [start, start + n)."""
    return tuple((s.start, s.end) for s in spans if start <= s.start and s.end <= start + n)


def widen_windows(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray, offs: np.ndarray, starts: np.ndarray,
                  blocks: Sequence[Sequence[tuple[int, int]]]) -> int:
    """In place: the window [lo, hi) (absolute positions) of every row of a block widened to
    it. pos/lo/hi [T]; offs/starts [R] first row and position of each chunk; blocks[r]: chunk
    r's blocks. Returns a bound on the widest range, rounded up to a multiple of 64 (the
    kernels compile per width)."""
    for r, chunk_blocks in enumerate(blocks):
        for s, e in chunk_blocks:
            rows = slice(offs[r] + s - starts[r], offs[r] + e - starts[r])
            lo[rows] = np.maximum(np.minimum(lo[rows], s), 0)
            hi[rows] = e
    widest = int((hi - lo).max()) if len(pos) else 0
    return -(-widest // 64) * 64
