"""Image spans of a prompt and the engine's rules about them (docs/vision.md, "Engine").

A span is one image's block: prompt positions [start, start + length). Rules:
  * a prefill chunk never ends strictly inside a span (`atomic_chunk`);
  * a prefix-cache resume point never falls strictly inside one (`resume_limit`);
  * the prefix-cache key of a span's positions is its image hash, not the placeholder token
    (`key_tokens`), so two prompts with different images never share a page.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .grid import block_length


@dataclass(frozen=True)
class ImageSpan:
    start: int            # absolute position of the block's first token
    length: int           # tokens of the block
    hash: str             # sha256 of the image bytes (dsv4/model/vision/preprocess.py)
    data: bytes           # the encoded image (PNG, JPEG, WebP, GIF, ...)
    n_llm_h: int
    n_llm_w: int

    @property
    def end(self) -> int:
        return self.start + self.length


def check_spans(spans: Sequence[ImageSpan], num_prompt: int) -> None:
    """ValueError naming the problem when spans overlap, leave the prompt or have a length
    their grid does not give."""
    last = 0
    for i, s in enumerate(sorted(spans, key=lambda s: s.start)):
        if s.start < last or s.end > num_prompt:
            raise ValueError(f"images: image {i}'s block [{s.start}, {s.end}) overlaps another or leaves "
                             f"the prompt of {num_prompt} tokens")
        if s.length != block_length(s.n_llm_h, s.n_llm_w, s.start):
            raise ValueError(f"images: image {i}'s block at {s.start} has {s.length} tokens, its grid "
                             f"{s.n_llm_h}x{s.n_llm_w} gives {block_length(s.n_llm_h, s.n_llm_w, s.start)}")
        last = s.end


def atomic_chunk(spans: Sequence[ImageSpan], start: int, n: int) -> int:
    """The size of a chunk [start, start + n) moved so it ends outside every span: back to the
    start of a span it would cut, or, when that leaves nothing, past its end (a step may then
    exceed the token budget by up to one block)."""
    end = start + n
    for s in spans:
        if s.start < end < s.end:
            return s.start - start if s.start > start else s.end - start
    return n


def resume_limit(spans: Sequence[ImageSpan], limit: int) -> int:
    """The last position <= limit that is not strictly inside a span."""
    for s in spans:
        if s.start < limit < s.end:
            return s.start
    return limit


def image_key(span: ImageSpan) -> int:
    """The prefix-cache key of every position of a span: a negative number from its hash
    (token ids are >= 0)."""
    return -1 - int(span.hash[:15], 16)


def key_tokens(tokens: list[int], spans: Sequence[ImageSpan], start: int = 0) -> list[int]:
    """tokens (positions start, start + 1, ...) with the positions of spans replaced by their
    image keys."""
    if not spans:
        return tokens
    out = list(tokens)
    for s in spans:
        lo, hi = max(s.start - start, 0), min(s.end - start, len(out))
        if lo < hi:
            out[lo:hi] = [image_key(s)] * (hi - lo)
    return out
