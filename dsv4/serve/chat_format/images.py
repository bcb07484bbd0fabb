"""Image content parts in chat messages (docs/vision.md, "API"): each becomes the text
placeholder `<｜deepseek_image｜>` where it stands, in message order; the prompt's placeholders
are later expanded into image blocks (dsv4/serve/http/chat_images.py)."""
from __future__ import annotations

from typing import Any

IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
IMAGE_PARTS = ("image_url", "input_image", "image")


def image_url_of(part: dict) -> Any:
    """The URL of an image part: {"image_url": {"url": ...}} (OpenAI), {"image_url": "..."},
    or {"image": "..."}."""
    value = part.get("image_url", part.get("image"))
    return value.get("url") if isinstance(value, dict) else value


def take_images(messages: list[dict]) -> tuple[list[dict], list[tuple[str, Any]]]:
    """(messages with every image part replaced by the placeholder text, [(where, url)] of
    the images in prompt order); `where` names the part (messages.i.content.j)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in content):
            parts = []
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                    images.append((f"messages.{i}.content.{j}", image_url_of(p)))
                    p = {"type": "text", "text": IMAGE_PLACEHOLDER}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, images


def count_placeholders(text: str) -> int:
    return text.count(IMAGE_PLACEHOLDER)
