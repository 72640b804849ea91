"""What the plugin wires share: joining a message's text and image parts."""

from __future__ import annotations

from typing import Any

__all__ = ["joined"]


def joined(parts: list[Any]) -> str | list[Any]:
    """Text parts (str) joined into one string when there is no image; else a content list
    of text parts and the image parts, in order."""
    if all(isinstance(p, str) for p in parts):
        return "".join(parts)
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
