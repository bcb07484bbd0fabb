"""The engine's image encoder (docs/vision.md, "Engine"): patches -> tower -> aligner, with
an LRU cache of aligner rows keyed by the image hash, so a resent image is not encoded again.
`prepare` encodes every image a step needs at once, images of one grid in one batch."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from .preprocess import open_image, to_patches
from .spans import ImageSpan
from .tower import assemble_block, encode_images


class VisionEncoder:
    def __init__(self, model, capacity: int = 256):
        self.model, self.capacity = model, capacity
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()   # hash -> [n_llm_h * n_llm_w, hidden]
        self.encoded = 0                                             # images run through the tower

    @torch.inference_mode()
    def prepare(self, spans: Sequence[ImageSpan]) -> None:
        """Encode the images of `spans` not in the cache, batched by grid."""
        todo: dict[str, ImageSpan] = {s.hash: s for s in spans if s.hash not in self.cache}
        groups: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}
        cfg = self.model.cfg.vision
        for h, s in todo.items():
            patches, g = to_patches(open_image(s.data), cfg)
            groups.setdefault((g.n_vit_h, g.n_vit_w), []).append((h, patches))
        device = self.model.image_start.device
        for (n_h, n_w), items in groups.items():
            batch = torch.stack([p for _, p in items]).to(device)
            rows = encode_images(self.model.vision, self.model.aligner, batch, n_h, n_w)
            for (h, _), r in zip(items, rows):
                self._put(h, r)
            self.encoded += len(items)

    def block(self, span: ImageSpan) -> torch.Tensor:
        """The span's block embeddings [span.length, hidden] (its image encoded if it is not)."""
        if span.hash not in self.cache:
            self.prepare([span])
        self.cache.move_to_end(span.hash)
        return assemble_block(self.cache[span.hash], self.model.sentinels(), span.n_llm_h, span.n_llm_w,
                              span.start)

    def _put(self, h: str, rows: torch.Tensor) -> None:
        self.cache[h] = rows
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
