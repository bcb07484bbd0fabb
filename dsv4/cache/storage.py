"""The cache tensors, allocated once, page-major (docs/architecture.md, "Cache").

One tensor per kind, [units, layers of the kind, rows per unit, C]:

  swa        [swa_pages + 1, L_swa, 128, D]        K=V vectors of recent positions
  c4, idx    [pages + 1, L_csa, 64, D | Di]        CSA entries and indexer keys
  c128       [pages + 1, L_hca, 2, D]              HCA entries
  csa rings  [slots + 1, L_csa, 8 + S + 4, 2D | 2Di]  CSA compressor / indexer continuation (kv, gate),
                                                    then the staging rows (layout.py)
  hca rings  [slots + 1, L_hca, 128 + S, D]        HCA compressor continuation (kv, gate)

(with `layout.kv_fp8`, swa / c4 / c128 / idx are uint8 rows of packed FP8, dsv4/ops/kv_fp8.py:
C = layout.entry_width / index_width bytes),

and, with a prefix cache, `checkpoints` [num_checkpoints, numel] (bytes with packed FP8 KV): one flat checkpoint a row
(checkpoint.py: the private rows a request resumes from at a page boundary),

so one page of one kind (or one request's ring rows) is a contiguous block that can be copied,
packed and sent as a unit (`page`). Each layer sees its rows as a 2-D view starting at its
offset in a page (layout.py gives the row arithmetic); the views of all layers of a kind have
the same length, so a row id means the same slot in every layer. The last unit of each tensor
is scratch: padding rows of fixed-shape (CUDA graph) steps write there and nothing reads it.
"""
from __future__ import annotations

import torch

from ..config import CSA_RATIO, HCA_RATIO
from ..model.kv import LayerKV
from .checkpoint import CheckpointFormat
from .layout import PAGE_TOKENS, SWA_PAGE_TOKENS, CacheLayout, CachePlan


def storage_shapes(layout: CacheLayout, plan: CachePlan) -> dict[str, tuple[int, int, int, int]]:
    """Every storage tensor's shape [units (+1 scratch), layers of the kind, rows per unit, C]:
    what KVStorage allocates and what the planner (cache/sizing.py) counts."""
    c, csa, hca = layout.cfg, len(layout.csa_layers), len(layout.hca_layers)
    D, Di, row, irow = c.head_dim, c.index_head_dim, layout.entry_width, layout.index_width
    pages, swa_pages, slots = plan.num_pages + 1, plan.num_swa_pages + 1, plan.max_num_seqs + 1
    shapes = {"swa": (swa_pages, layout.num_swa_layers, SWA_PAGE_TOKENS, row),
              "c4": (pages, csa, PAGE_TOKENS // CSA_RATIO, row),
              "idx": (pages, csa, PAGE_TOKENS // CSA_RATIO, irow),
              "c128": (pages, hca, PAGE_TOKENS // HCA_RATIO, row)}
    for name, layers, ring, width in (("ring", csa, layout.csa_ring_rows, 2 * D),
                                      ("iring", csa, layout.csa_ring_rows, 2 * Di), ("hring", hca, layout.hca_ring, D)):
        shapes[f"{name}_kv"] = shapes[f"{name}_gate"] = (slots, layers, ring, width)
    return shapes


PACKABLE = ("swa", "c4", "idx", "c128")


def storage_dtype(layout: CacheLayout, kind: str, dtype: torch.dtype) -> torch.dtype:
    """The element type of a kind's tensor: uint8 for the packed FP8 kinds, else `dtype`."""
    return torch.uint8 if layout.kv_fp8 and kind in PACKABLE else dtype


class KVStorage:
    def __init__(self, layout: CacheLayout, plan: CachePlan, dtype: torch.dtype, device):
        self.layout, self.plan, self.dtype = layout, plan, dtype     # dtype: the model's (rings, unpacked rows)
        self.scratch_page, self.scratch_swa_page, self.scratch_slot = (plan.num_pages, plan.num_swa_pages,
                                                                       plan.max_num_seqs)
        self.ring_slots = plan.max_num_seqs + 1
        self.kinds = {name: torch.zeros(shape, dtype=storage_dtype(layout, name, dtype), device=device)
                      for name, shape in storage_shapes(layout, plan).items()}
        self.layers = [self._layer_views(layer) for layer in range(layout.num_swa_layers)]
        self.checkpoint_format = CheckpointFormat(layout, dtype) if plan.num_checkpoints else None
        numel = self.checkpoint_format.numel if self.checkpoint_format else 0
        ckpt_dtype = self.checkpoint_format.buffer_dtype if self.checkpoint_format else dtype
        self.checkpoints = torch.zeros(plan.num_checkpoints, numel, dtype=ckpt_dtype, device=device)

    def _layer_views(self, layer: int) -> LayerKV:
        lay, k = self.layout, self.kinds
        views = {"swa": _layer_view(k["swa"], layer)}
        if layer in lay.csa_layers:
            i = lay.csa_layers.index(layer)
            views.update(c4=_layer_view(k["c4"], i), idx=_layer_view(k["idx"], i),
                         ring_kv=_layer_view(k["ring_kv"], i), ring_gate=_layer_view(k["ring_gate"], i),
                         iring_kv=_layer_view(k["iring_kv"], i), iring_gate=_layer_view(k["iring_gate"], i))
        elif layer in lay.hca_layers:
            i = lay.hca_layers.index(layer)
            views.update(c128=_layer_view(k["c128"], i), ring_kv=_layer_view(k["hring_kv"], i),
                         ring_gate=_layer_view(k["hring_gate"], i))
        return LayerKV(**views)

    def page(self, kind: str, unit: int) -> torch.Tensor:
        """The contiguous block of one page (or ring slot) of `kind` across its layers."""
        return self.kinds[kind][unit]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.kinds.values(), self.checkpoints])


def _layer_view(blocks: torch.Tensor, i: int) -> torch.Tensor:
    """Layer i's rows of a [units, layers, rows, C] tensor as a 2-D view [units * layers * rows, C]
    starting at row i * rows: row u * pitch + j (pitch = layers * rows) is unit u's slot j of
    layer i. Every layer's view has the same length (the last layers' views end in padding
    rows of the following layers, never addressed)."""
    units, layers, rows, width = blocks.shape
    flat = blocks.view(units * layers * rows, width)
    length = (units - 1) * layers * rows + rows            # rows through the last unit's slots of layer i
    return flat[i * rows:i * rows + length] if length > 0 else flat[:0]
