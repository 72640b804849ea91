"""Image parts on the three wires: each wire's image shape to the internal part
(:mod:`molt_plugins.vision.images`), and their validation with each refusal naming the wire's own field.

* OpenAI Chat: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,...",
  "detail": ...}}`` (``detail`` is ignored: the model's processor decides the resolution);
  field ``messages[i].content[j].image_url.url``.
* Anthropic Messages: ``{"type": "image", "source": {"type": "base64", "media_type",
  "data"}}`` or ``{"type": "url", "url"}``, in a user turn or a ``tool_result``'s content;
  fields ``messages[i].content[j].source.data`` / ``.source.media_type`` / ``.source.url``.
* OpenAI Responses: ``{"type": "input_image", "image_url": "data:...", "detail": ...}`` in a
  message's or a ``function_call_output``'s content (``file_id`` is refused); field
  ``input[i].content[j].image_url``.

A wire's converter calls the request's :class:`WireImages` (``openai_part`` / ``anthropic_block``
/ ``responses_part``), which return the internal part and record a :class:`Pending` check; the
server then runs its ``check()`` (:func:`check_images` (off the event loop for a big body: decoding and any allowed remote fetch
happen there)) before the ledger sees the messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from molt_core.config import ImagePolicy
from molt_plugins.vision.images import ImageError, data_url, decode_base64, decode_url

__all__ = ["Pending", "WireImages", "openai_part", "anthropic_block", "responses_part", "check_images"]


@dataclass
class Pending:
    """One image to validate: ``part`` is the internal part handed to the ledger (its URL is
    replaced by the validated image's data URL unless it was one already); ``field`` the wire
    path of the value; ``url`` or (``b64``, ``media_type``) the value as sent."""

    part: dict[str, Any]
    field: str
    url: str | None = None
    b64: Any = None
    media_type: Any = None


def _internal(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def openai_part(part: dict[str, Any], where: str, pending: list[Pending]) -> dict[str, Any]:
    """An OpenAI ``image_url`` part at ``where`` (``messages[i].content[j]``) as the internal part.

    Raises:
        ImageError: the part has no ``image_url.url`` string.
    """
    iu = part.get("image_url")
    url = iu.get("url") if isinstance(iu, dict) else iu
    if not isinstance(url, str):
        raise ImageError("an image_url part is {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}",
                         f"{where}.image_url.url")
    out = _internal(url)
    pending.append(Pending(out, f"{where}.image_url.url", url=url))
    return out


def anthropic_block(block: dict[str, Any], where: str, pending: list[Pending]) -> dict[str, Any]:
    """An Anthropic ``image`` block at ``where`` (``messages[i].content[j]``) as the internal part.

    Raises:
        ImageError: a source that is neither ``base64`` nor ``url`` (naming ``<where>.source.type``).
    """
    src = block.get("source")
    if not isinstance(src, dict):
        src = {}
    kind = src.get("type")
    if kind == "base64":
        out = _internal("")
        pending.append(Pending(out, f"{where}.source.data", b64=src.get("data"), media_type=src.get("media_type")))
        return out
    if kind == "url" and isinstance(src.get("url"), str):
        out = _internal(src["url"])
        pending.append(Pending(out, f"{where}.source.url", url=src["url"]))
        return out
    raise ImageError(f"an image block's source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
                     f"{{'type': 'url', 'url': ...}}, got type {kind!r}", f"{where}.source.type")


def responses_part(part: dict[str, Any], where: str, pending: list[Pending]) -> dict[str, Any]:
    """A Responses ``input_image`` part at ``where`` (``input[i].content[j]``) as the internal part.

    Raises:
        ImageError: a ``file_id`` image (files are not stored here) or no ``image_url`` string.
    """
    url = part.get("image_url")
    if not isinstance(url, str):
        if part.get("file_id") is not None:
            raise ImageError("file_id images are not supported (this server stores no files); send the image "
                             "inline as image_url: 'data:image/png;base64,...'", f"{where}.file_id")
        raise ImageError("an input_image part needs image_url: 'data:image/png;base64,...'", f"{where}.image_url")
    out = _internal(url)
    pending.append(Pending(out, f"{where}.image_url", url=url))
    return out


def check_images(pending: list[Pending], policy: ImagePolicy | None = None, vision: Any = None) -> None:
    """Validate every pending image (:mod:`molt_plugins.vision.images`; blocking: Pillow decode, and a
    fetch for an allowed remote URL) and set each part's URL to its data URL.

    Args:
        vision: the model's :class:`~molt_plugins.vision.processor.VisionProcessor`, or None. When given,
            each image is also run through it (the result is cached by digest, so the ledger's
            expansion reuses it): an image the processor refuses -- e.g. Qwen2-VL's
            ``smart_resize`` refuses an aspect ratio of 200 or more -- is a bad image too.

    Raises:
        ImageError: the first refused image, naming its wire field.
    """
    for p in pending:
        if p.url is not None:
            img = decode_url(p.url, p.field, policy)
            if not p.url.startswith("data:"):  # a fetched remote image: the ledger gets its bytes inline
                p.part["image_url"]["url"] = data_url(img.data, img.media_type)
        else:
            img = decode_base64(p.b64, p.media_type, p.field, policy)
            p.part["image_url"]["url"] = f"data:{img.media_type};base64,{p.b64}"  # validated base64: no re-encode
        if vision is not None:
            try:
                vision.process(img.data)
            except ValueError as e:
                raise ImageError(f"the model's image processor refuses this {img.width}x{img.height} image ({e}); "
                                 "send an image it accepts", p.field) from None


class WireImages(list):
    """A request's images met by a wire's converter (a list of :class:`Pending`), what the
    kernel's wires call (the vision modality's ``wire_images``): the three part converters,
    then :meth:`check` (blocking) before the ledger sees the messages."""

    def __init__(self, policy: ImagePolicy | None = None, vision: Any = None) -> None:
        super().__init__()
        self.policy, self.vision = policy, vision

    def openai_part(self, part: dict[str, Any], where: str) -> dict[str, Any]:
        """:func:`openai_part` into this collector. Raises: ImageError as it does."""
        return openai_part(part, where, self)

    def anthropic_block(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        """:func:`anthropic_block` into this collector. Raises: ImageError as it does."""
        return anthropic_block(block, where, self)

    def responses_part(self, part: dict[str, Any], where: str) -> dict[str, Any]:
        """:func:`responses_part` into this collector. Raises: ImageError as it does."""
        return responses_part(part, where, self)

    @property
    def remote(self) -> bool:
        """True when an image is a remote URL (its check fetches it: run it off the event loop)."""
        return any(p.url is not None and not p.url.startswith("data:") for p in self)

    def check(self) -> None:
        """:func:`check_images` over the collected images. Raises: ImageError, naming the field."""
        check_images(self, self.policy, self.vision)
