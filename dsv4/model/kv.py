"""What one attention layer reads and writes of the cache: views into the page-major storage
that dsv4/cache/storage.py allocates (docs/architecture.md, "Cache").

Every view is a 2-D tensor [rows, C] with contiguous rows, addressed by the flat row ids of
the step's ForwardBatch (its PagedRows and CompressPlans). Rows of one layer are interleaved
with the other layers' rows of the same page (the page pitch), so the ids already carry it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerKV:
    swa: torch.Tensor                        # [., D] K=V vectors of recent positions
    c4: torch.Tensor | None = None           # [., D] CSA compressed entries
    idx: torch.Tensor | None = None          # [., Di] indexer keys (CSA)
    c128: torch.Tensor | None = None         # [., D] HCA compressed entries
    ring_kv: torch.Tensor | None = None      # compressor continuation: CSA [., 2D], HCA [., D]
    ring_gate: torch.Tensor | None = None
    iring_kv: torch.Tensor | None = None     # indexer compressor continuation [., 2Di] (CSA)
    iring_gate: torch.Tensor | None = None
