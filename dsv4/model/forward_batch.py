"""What one forward reads: flat tokens of a mixed batch plus precomputed cache addressing.

Built once per step (dsv4/cache/addressing.py) and shared by every layer of a kind. All ids
are rows of the layer views of dsv4/model/kv.py (LayerKV); -1 marks "none".
T = tokens in the step, W = sliding window, E4/E128 = most causal entries of any token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.paged import PagedRows


@dataclass(frozen=True)
class CompressPlan:
    """Groups of one ratio that close in this step, and the ring rows to (over)write.

    `rows` index cat(ring, fresh): ring rows first (`ring_rows` of them), then the step's
    T fresh projections, so fresh token t is row `ring_rows + t`.
    """
    rows: torch.Tensor        # [G, span] long
    entry_slot: torch.Tensor  # [G] long: flat slot of the entry in its pool
    entry_pos: torch.Tensor   # [G] long: first position of the group (its RoPE position)
    ring_dst: torch.Tensor    # [Wr] long: ring rows written this step
    ring_src: torch.Tensor    # [Wr] long: token index of each written row
    ring_rows: int


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor   # [T] long
    positions: torch.Tensor   # [T] long
    swa_write: torch.Tensor   # [T] long: SWA row that receives each token's K=V
    swa: PagedRows            # width W: SWA rows of positions (p-W, p]
    c4: PagedRows             # width E4: C4 / indexer-key rows of entries e < (p+1)//4
    c128: PagedRows           # width E128: C128 rows of entries e < (p+1)//128
    csa: CompressPlan         # ratio-4 groups (CSA compressor and indexer share it)
    hca: CompressPlan         # ratio-128 groups
    logits_rows: torch.Tensor  # [L] long: token rows whose logits are wanted
    seq_lens: tuple[int, ...]  # tokens of each sequence in the step, in order

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
