"""A chat prompt with image placeholders -> token ids and image blocks (docs/vision.md, "API").

Runs in the worker thread that encodes the prompt: each image is fetched (media.py) and
decoded once with Pillow here, to size its block (its grid and the block's alignment pads
depend on the absolute position); the engine decodes the bytes again to encode them.
"""
from __future__ import annotations

from ...config_parse import parse_vision
from ...engine.ipc import ImageItem
from ...model.vision.grid import block_length
from ...model.vision.preprocess import ImageError, grid_of, image_hash, open_image
from ..chat_format.images import IMAGE_PLACEHOLDER
from .errors import bad_request
from .media import MediaPolicy, load_media


def image_prompt(text: str, images: list[tuple[str, object]], state,
                 policy: MediaPolicy) -> tuple[list[int], list[ImageItem]]:
    """text: the encoded prompt, one placeholder per image; images: [(where, url)] in order."""
    pieces = text.split(IMAGE_PLACEHOLDER)
    if len(pieces) - 1 != len(images):
        raise bad_request(f"messages: the text holds {len(pieces) - 1 - len(images)} extra "
                          f"{IMAGE_PLACEHOLDER} placeholders; write images as image_url content parts", "messages")
    if not images:
        return state.tokenizer.encode(text), []
    vision = parse_vision(state.info.vision or {})
    if vision is None:
        raise bad_request(f"{images[0][0]}: image content is not supported: the model is text-only",
                          images[0][0])
    token = vision.image_token_id
    if token is None:
        token = state.tokenizer.token_to_id(IMAGE_PLACEHOLDER)
    if token is None:
        raise bad_request(f"{images[0][0]}: the model has no image token", images[0][0])
    ids, items = state.tokenizer.encode(pieces[0]), []
    for (where, url), piece in zip(images, pieces[1:]):
        data = load_media(url, policy, where)
        try:
            g = grid_of(open_image(data), vision)
        except ImageError as e:
            raise bad_request(f"{where}: {e}", where) from None
        start = len(ids)
        n = block_length(g.n_llm_h, g.n_llm_w, start)
        items.append(ImageItem(start, n, data, image_hash(data), g.n_llm_h, g.n_llm_w))
        ids += [token] * n + state.tokenizer.encode(piece)
    return ids, items
