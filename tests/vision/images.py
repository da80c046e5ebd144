"""Small test images as data URLs, each of its own content and size."""

from __future__ import annotations

import base64
import io
from typing import Any

from PIL import Image


def picture(width: int, height: int, shade: int = 0) -> Image.Image:
    """`width` x `height` pixels with a grid drawn in them (`shade` varies the colour)."""
    image = Image.new("RGB", (width, height), (200, 30 + shade % 200, 30))
    for x in range(0, width, 7):
        for y in range(0, height, 7):
            image.putpixel((x, y), (0, 0, 255))
    return image


def data_url(width: int, height: int, shade: int = 0) -> str:
    """`picture` as a PNG data URL."""
    image = picture(width, height, shade)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(width: int, height: int, shade: int = 0) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(width, height, shade)}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}
