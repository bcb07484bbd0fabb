"""Top-k over a stream of score tiles, in bounded memory, with one defined order.

The lightning indexer scores every causal entry of a token (O(E) per query by nature), but it
never needs all E scores at once: it keeps the best k seen so far and merges each tile of
entries into them. The result is the same however the entries are tiled because the order is
total:

    (score descending, then offset ascending)      -- ties go to the lower offset

Each (score, offset) pair becomes one unique int64 key, the float's bits mapped to an
order-preserving int32 in the high word and (2^32 - 1 - offset) in the low word, so one
`topk` over keys gives that order, and the top k of a union is the top k of (top k of one
part + the other part). Scores of -inf (absent / not causal) are never chosen (offset -1).
Offsets must be below 2^32 (1M positions give 2^18 C4 entries).
"""
from __future__ import annotations

import torch

_LOW = 1 << 32
_LOW_MASK = _LOW - 1
_NEG_INF_KEY32 = int(torch.tensor(float("-inf")).view(torch.int32)) ^ 0x7FFFFFFF
MIN_CHOSEN_KEY = (_NEG_INF_KEY32 + 1) * _LOW          # keys below: a -inf score or the empty fill
EMPTY_KEY = torch.iinfo(torch.int64).min


def score_keys(scores: torch.Tensor, first_offset: int = 0) -> torch.Tensor:
    """scores [T, W] fp32 of offsets first_offset + [0, W) -> [T, W] int64 keys (see above)."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)     # + 0.0: -0.0 ties with 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    offsets = torch.arange(first_offset, first_offset + scores.shape[1], device=scores.device)
    return ordered * _LOW + (_LOW_MASK - offsets)


def key_offsets(keys: torch.Tensor) -> torch.Tensor:
    """keys -> their offsets, -1 where the key is no chosen entry (a -inf score or empty)."""
    return torch.where(keys >= MIN_CHOSEN_KEY, _LOW_MASK - (keys & _LOW_MASK), -1)


class RunningTopk:
    """The best k (score, offset) pairs of T rows over every tile added so far."""

    def __init__(self, T: int, k: int, device):
        self.k = k
        self.keys = torch.full((T, k), EMPTY_KEY, dtype=torch.long, device=device)

    def add(self, scores: torch.Tensor, first_offset: int, rows: slice = slice(None)) -> None:
        """Merge scores [t, W] of offsets first_offset + [0, W) into rows `rows` of the state."""
        self.merge(score_keys(scores, first_offset), rows)

    def merge(self, keys: torch.Tensor, rows: slice = slice(None)) -> None:
        """Merge keys [t, n] (of `score_keys`, e.g. a tile's own top k) into rows `rows`."""
        keys = torch.cat([self.keys[rows], keys], dim=1)
        self.keys[rows] = keys.topk(self.k, dim=1).values

    def offsets(self) -> torch.Tensor:
        """[T, k] long: chosen offsets in (score desc, offset asc) order, -1 after the last."""
        return key_offsets(self.keys)
