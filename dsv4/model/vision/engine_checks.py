"""What the engine checks of a request's images before admitting it (docs/vision.md, "Bad
input"): ValueError naming the problem, a 400 at the API."""
from __future__ import annotations

from typing import Sequence

from .spans import ImageSpan, check_spans


def check_images(cfg, spans: Sequence[ImageSpan], num_prompt: int) -> None:
    """cfg: the model's ModelConfig."""
    if not spans:
        return
    if cfg.vision is None:
        raise ValueError("images: this model has no vision tower (a text-only checkpoint); send text only")
    check_spans(spans, num_prompt)
