"""Whole-sequence logits through the paged path, with a throw-away cache sized for it:
what `dsv4 check` and the oracle tests compare against the reference."""
from __future__ import annotations

import torch

from ..cache.layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from ..cache.pools import KVPools
from .batch import SeqChunk, build_forward_batch


@torch.no_grad()
def full_logits(model, token_ids: list[int], device=None) -> torch.Tensor:
    """One prefill of `token_ids` -> fp32 logits [len, vocab] for every position."""
    n = len(token_ids)
    device = device or next(model.parameters()).device
    layout = CacheLayout(model.cfg)
    pages, swa_pages = -(-n // PAGE_TOKENS), -(-n // SWA_PAGE_TOKENS)
    pools = KVPools(layout, CachePlan(num_pages=pages, num_swa_pages=swa_pages, max_num_seqs=1),
                    model.dtype, device)
    chunk = SeqChunk(slot=0, start=0, token_ids=list(token_ids), page_table=list(range(pages)),
                     swa_table=list(range(swa_pages)), logits="all")
    fb = build_forward_batch([chunk], layout, pools.ring_slots, device)
    return model.logits(model(fb, pools)[fb.logits_rows])
