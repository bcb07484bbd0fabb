"""Image grids and the image block layout (docs/vision.md, "Grid" and "Block").

An image of H x W pixels is resized or padded to a ViT grid of n_vit_h x n_vit_w patches,
which the aligner folds r x r into an LLM grid of n_llm_h x n_llm_w image tokens. Its block
in the prompt, at absolute position `start`:

    IMAGE_PAD x (3 - start % 4)      so that IMAGE_START sits at a position = 3 (mod 4)
    IMAGE_START
    the grid, two rows at a time in "N" order (row 2i col j, row 2i+1 col j, ...), each row
    ending in IMAGE_NEW_LINE; an odd last row paired with a row of IMAGE_PAD
    IMAGE_PAD x 2 when the grid part has an odd number of column pairs
    IMAGE_END
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(5)
COMPRESS_PAD_TO = 4


def grid_tokens(height: int, width: int, patch: int, ratio: int) -> tuple[int, int, int]:
    """(n_llm_h, n_llm_w, tokens of the block without its leading alignment pads) for a
    ViT input of height x width pixels."""
    n_h = math.ceil((height // patch) / ratio)
    n_w = math.ceil((width // patch) / ratio)
    tokens = n_h * (n_w + 1) + 2 + (n_w + 1) * (n_h % 2)
    tokens += ((n_h + 1) // 2 * (n_w + 1)) % 2 * 2
    return n_h, n_w, tokens


def _fit(height: float, width: float, patch: int, ratio: int, budget: int) -> tuple[int, int]:
    """The largest (height, width) in pixels, multiples of the patch, whose block fits `budget`
    tokens, keeping the aspect ratio (an even number of LLM rows where it can)."""
    aspect = height / width
    w_float = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    h_float = w_float * aspect
    cell = patch * ratio
    if w_float < 1.0:                      # very tall: one column
        rows = (budget - 2) // 2
        return (rows - rows % 2) * cell, cell
    if h_float < 2.0:                      # very wide: two rows
        return 2 * cell, ((budget - 2) // 2 - 1) * cell
    rows, cols = math.floor(h_float), math.floor(w_float)
    rows -= rows % 2
    beta = min(cols * cell / width, rows * cell / height)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def image_grid(height: int, width: int, patch: int, ratio: int, max_n_token: int, min_pixels: int,
               max_wh_ratio: float | None) -> tuple[int, int, int, int]:
    """(n_vit_h, n_vit_w, n_llm_h, n_llm_w) of an image of height x width pixels: too wide
    images are squeezed to max_wh_ratio, small ones scaled up to min_pixels, then the grid is
    shrunk until the block (with 3 alignment pads at most) fits max_n_token."""
    h, w = float(height), float(width)
    if max_wh_ratio is not None and w > h * max_wh_ratio:
        w = h * max_wh_ratio
    if 0 < w * h < min_pixels:
        scale = (min_pixels / (w * h)) ** 0.5
        w, h = float(int(w * scale)), float(int(h * scale))
    best_h, best_w = math.ceil(h / patch) * patch, math.ceil(w / patch) * patch
    limit = max_n_token - (COMPRESS_PAD_TO - 1)
    budget = limit
    while grid_tokens(best_h, best_w, patch, ratio)[2] > limit:
        best_h, best_w = _fit(h, w, patch, ratio, budget)
        budget -= 1
    n_llm_h, n_llm_w, _ = grid_tokens(best_h, best_w, patch, ratio)
    return best_h // patch, best_w // patch, n_llm_h, n_llm_w


def block_length(n_llm_h: int, n_llm_w: int, start: int) -> int:
    """Tokens of the block of an n_llm_h x n_llm_w grid placed at absolute position `start`."""
    pads = COMPRESS_PAD_TO - 1 - start % COMPRESS_PAD_TO
    rows, row_len = n_llm_h + n_llm_h % 2, n_llm_w + 1
    return pads + 1 + rows * row_len + (rows // 2 * row_len) % 2 * 2 + 1


def block_layout(n_llm_h: int, n_llm_w: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(types [block_length] long: the kind of each position, IMAGE_* above; perm [n_h * n_w]
    long: the row-major aligner row of each IMAGE position, in block order)."""
    import torch     # here: dsv4/engine/core.py (-> spans -> grid) imports no torch until it loads the engine
    pads = COMPRESS_PAD_TO - 1 - start % COMPRESS_PAD_TO
    rows, row_len = n_llm_h + n_llm_h % 2, n_llm_w + 1
    grid_types = torch.full((rows, row_len), IMAGE_PAD, dtype=torch.long)
    grid_types[:n_llm_h, :n_llm_w] = IMAGE
    grid_types[:n_llm_h, n_llm_w] = IMAGE_NEW_LINE
    index = torch.full((rows, row_len), -1, dtype=torch.long)
    index[:n_llm_h, :n_llm_w] = torch.arange(n_llm_h * n_llm_w).view(n_llm_h, n_llm_w)
    n_order = lambda t: t.view(rows // 2, 2, row_len).transpose(1, 2).reshape(-1)   # noqa: E731
    perm = n_order(index)
    tail = (rows // 2 * row_len) % 2 * 2
    types = torch.cat([torch.full((pads,), IMAGE_PAD), torch.tensor([IMAGE_START]), n_order(grid_types),
                       torch.full((tail,), IMAGE_PAD), torch.tensor([IMAGE_END])])
    return types, perm[perm >= 0]
