"""What the engine checks of a request's images before admitting it (docs/vision.md, "Bad
input"): ValueError naming the problem (a 400 at the API). Each image is decoded once here,
so no step can fail on an image later."""
from __future__ import annotations

from typing import Sequence

from .preprocess import ImageError, grid_of, image_hash, open_image
from .spans import ImageSpan, check_spans


def check_images(cfg, spans: Sequence[ImageSpan], num_prompt: int) -> None:
    """cfg: the model's ModelConfig."""
    if not spans:
        return
    if cfg.vision is None:
        raise ValueError("images: this model has no vision tower (a text-only checkpoint); send text only")
    check_spans(spans, num_prompt)
    for i, s in enumerate(spans):
        if s.hash != image_hash(s.data):
            raise ValueError(f"images: image {i}'s hash does not match its bytes")
        try:
            g = grid_of(open_image(s.data), cfg.vision)
        except ImageError as e:
            raise ValueError(f"images: image {i}: {e}") from None
        if (g.n_llm_h, g.n_llm_w) != (s.n_llm_h, s.n_llm_w):
            raise ValueError(f"images: image {i} has an {g.n_llm_h}x{g.n_llm_w} grid, its block says "
                             f"{s.n_llm_h}x{s.n_llm_w}")
