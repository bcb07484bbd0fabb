"""Images for the vision tests, made in memory with Pillow."""
from __future__ import annotations

import io
import struct
import zlib

import torch
from PIL import Image


def noise(w: int, h: int, seed: int = 0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


def encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def png(w: int, h: int, seed: int = 0) -> bytes:
    return encoded(noise(w, h, seed))


def png_header_claiming(w: int, h: int) -> bytes:
    """A PNG whose header says w x h pixels (its data is one pixel's): a decompression bomb."""
    data = png(1, 1)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]
