"""The cache tensors, allocated once. Rows are addressed by flat slot ids (see layout.py).

Per layer (index in the model's layer list):
  swa[l]        [num_swa_pages * 128, D]      K=V vectors of recent positions
  c4[l]         [num_pages * 64, D]            CSA compressed entries (CSA layers only)
  idx[l]        [num_pages * 64, Di]           indexer keys (CSA layers only)
  c128[l]       [num_pages * 2, D]             HCA compressed entries (HCA layers only)
  ring_kv[l], ring_gate[l]       CSA: [seqs * (8+S), 2D]; HCA: [seqs * (128+S), D]
  iring_kv[l], iring_gate[l]     indexer: [seqs * (8+S), 2Di] (CSA layers only)
"""
from __future__ import annotations

import torch

from .layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan
from ..config import CSA_RATIO, HCA_RATIO


class KVPools:
    """Each pool has one extra page (and the rings one extra slot) past what the allocator
    hands out: a scratch target for the padding rows of fixed-shape (CUDA graph) steps,
    written but never read."""

    def __init__(self, layout: CacheLayout, plan: CachePlan, dtype: torch.dtype, device):
        self.layout, self.plan = layout, plan
        c = layout.cfg
        self.scratch_page, self.scratch_swa_page, self.scratch_slot = (plan.num_pages, plan.num_swa_pages,
                                                                       plan.max_num_seqs)
        self.ring_slots = plan.max_num_seqs + 1
        D, Di, seqs = c.head_dim, c.index_head_dim, self.ring_slots
        pages, swa_pages = plan.num_pages + 1, plan.num_swa_pages + 1

        def empty(rows, dim):
            return torch.zeros(rows, dim, dtype=dtype, device=device)

        self.swa = [empty(swa_pages * SWA_PAGE_TOKENS, D) for _ in range(layout.num_swa_layers)]
        self.c4, self.idx, self.c128 = {}, {}, {}
        self.ring_kv, self.ring_gate, self.iring_kv, self.iring_gate = {}, {}, {}, {}
        for layer in layout.csa_layers:
            self.c4[layer] = empty(pages * (PAGE_TOKENS // CSA_RATIO), D)
            self.idx[layer] = empty(pages * (PAGE_TOKENS // CSA_RATIO), Di)
            self.ring_kv[layer] = empty(seqs * layout.csa_ring, 2 * D)
            self.ring_gate[layer] = empty(seqs * layout.csa_ring, 2 * D)
            self.iring_kv[layer] = empty(seqs * layout.csa_ring, 2 * Di)
            self.iring_gate[layer] = empty(seqs * layout.csa_ring, 2 * Di)
        for layer in layout.hca_layers:
            self.c128[layer] = empty(pages * (PAGE_TOKENS // HCA_RATIO), D)
            self.ring_kv[layer] = empty(seqs * layout.hca_ring, D)
            self.ring_gate[layer] = empty(seqs * layout.hca_ring, D)

    def nbytes(self) -> int:
        tensors = list(self.swa)
        for d in (self.c4, self.idx, self.c128, self.ring_kv, self.ring_gate, self.iring_kv, self.iring_gate):
            tensors += list(d.values())
        return sum(t.numel() * t.element_size() for t in tensors)
