"""Image bytes -> ViT patches (docs/vision.md, "Preprocessing"), with Pillow.

Decoding checks what a request can get wrong (ImageError, a 400 at the API): bytes Pillow
cannot read or that end early, an empty image, more than MAX_PIXELS pixels (checked from the
header, before any pixel is decoded). Animated images give their first frame.
"""
from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ...config_parse import VisionConfig
from .grid import image_grid

MAX_PIXELS = 50_000_000       # a decoded image above this is refused (Pillow's bomb guard is 89M)


class ImageError(ValueError):
    """An image a request sent cannot be used; the message says why."""


@dataclass(frozen=True)
class ImageGrid:
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int


def image_hash(data: bytes) -> str:
    """The identity of an image: sha256 of its bytes (encoder cache and prefix-cache keys)."""
    return hashlib.sha256(data).hexdigest()


def open_image(data: bytes):
    """Bytes -> an RGB PIL image of the first frame; ImageError when unusable."""
    from PIL import Image
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w <= 0 or h <= 0:
                raise ImageError(f"the image has no pixels ({w}x{h})")
            if w * h > MAX_PIXELS:
                raise ImageError(f"the image has {w}x{h} = {w * h / 1e6:.1f} megapixels; at most "
                                 f"{MAX_PIXELS / 1e6:.0f} are accepted")
            img.seek(0)
            return img.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise ImageError(f"the image is too large: more than {MAX_PIXELS / 1e6:.0f} megapixels") from None
    except Exception as e:  # Pillow raises many kinds for bad bytes (OSError, SyntaxError, ...)
        raise ImageError(f"the image cannot be decoded: {type(e).__name__}: {e}") from None


def grid_of(img, v: VisionConfig) -> ImageGrid:
    return ImageGrid(*image_grid(img.height, img.width, v.patch_size, v.downsample_ratio, v.max_n_token,
                                 v.min_pixels, v.max_wh_ratio))


def to_patches(img, v: VisionConfig) -> tuple[torch.Tensor, ImageGrid]:
    """RGB image -> (patches [n_vit_h * n_vit_w, 3, p, p] float32 in [-1, 1], row-major over
    the grid, channel first; its grid). Too wide images are stretched to the grid; the others
    are fitted inside it keeping their aspect ratio and padded with gray (127)."""
    from PIL import ImageOps
    g, p = grid_of(img, v), v.patch_size
    size = (g.n_vit_w * p, g.n_vit_h * p)
    if v.max_wh_ratio is not None and img.width >= v.max_wh_ratio * img.height:
        img = img.resize(size)
    else:
        img = ImageOps.pad(img, size, color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 255
    x = (x - 0.5) / 0.5
    patches = x.reshape(3, g.n_vit_h, p, g.n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
    return patches, g
