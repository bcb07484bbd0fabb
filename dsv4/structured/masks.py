"""A step's token bitmask, built on the host (xgrammar's layout: int32 words, bit t % 32 of word
t // 32 set = token t allowed) for the rows that have a grammar; rows without one are not in
it and cost nothing. The sampler applies it as one masked fill (engine/sampler.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .matcher import RequestGrammar


@dataclass
class GrammarMask:
    rows: torch.Tensor        # [R] long: the sampling rows the mask applies to
    bitmask: torch.Tensor     # [R, ceil(V / 32)] int32


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def step_mask(grammars: list[RequestGrammar | None], vocab_size: int) -> GrammarMask | None:
    """One row per sampling row (None: unconstrained) -> the mask of the constrained rows."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.constrains]
    if not rows:
        return None
    bitmask = torch.empty(len(rows), words(vocab_size), dtype=torch.int32)
    for n, i in enumerate(rows):
        grammars[i].fill(bitmask, n)
    return GrammarMask(torch.tensor(rows, dtype=torch.long), bitmask)


def verify_mask(grammars: list[tuple[RequestGrammar | None, list[int]]], vocab_size: int) -> GrammarMask | None:
    """Per verify chunk (its grammar, its drafts), in row order: len(drafts) + 1 rows each, row j
    masked as after drafts[:j] (the matcher is rolled back after)."""
    total = sum(len(d) + 1 for g, d in grammars if g is not None)
    if total == 0:
        return None
    bitmask = torch.empty(total, words(vocab_size), dtype=torch.int32)
    rows, used, first = [], 0, 0
    for g, drafts in grammars:
        if g is not None:
            masked = g.fill_drafts(bitmask, used, drafts)
            rows += [first + j if m else -1 for j, m in enumerate(masked)]
            used += len(drafts) + 1
        first += len(drafts) + 1
    keep = [n for n, r in enumerate(rows) if r >= 0]
    if not keep:
        return None
    return GrammarMask(torch.tensor([rows[n] for n in keep], dtype=torch.long), bitmask[keep])
