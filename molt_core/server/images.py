"""A request's image collector: the registered modality's (``wire_images``: the wires hand it
their image parts, the server then runs its ``check()``), or -- with no modality plugin --
:class:`NoImages`, which refuses every image part by its field."""

from __future__ import annotations

from typing import Any

from molt_core.plugins import modality

__all__ = ["ImagePartRefused", "NoImages", "request_images", "convert_checked"]


class ImagePartRefused(ValueError):
    """An image part sent to a run with no modality plugin; ``field`` is its request path."""

    def __init__(self, field: str) -> None:
        super().__init__(f"{field}: an image part, but no modality plugin is loaded (this server takes text only); "
                         "enable molt_plugins.vision (see docs/vision.md) or send text only")
        self.field = field


class NoImages(list):
    """The image collector of a run with no modality plugin (always empty)."""

    remote = False

    def openai_part(self, part: dict[str, Any], where: str) -> dict[str, Any]:
        """Refuse an OpenAI ``image_url`` part. Raises: ImagePartRefused naming ``<where>.image_url.url``."""
        raise ImagePartRefused(f"{where}.image_url.url")

    def anthropic_block(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        """Refuse an Anthropic ``image`` block. Raises: ImagePartRefused naming ``<where>.source``."""
        raise ImagePartRefused(f"{where}.source")

    def responses_part(self, part: dict[str, Any], where: str) -> dict[str, Any]:
        """Refuse a Responses ``input_image`` part. Raises: ImagePartRefused naming ``<where>.image_url``."""
        raise ImagePartRefused(f"{where}.image_url")

    def check(self) -> None:
        """Nothing to check (no image is ever collected)."""


def request_images(mod: Any, policy: Any = None, vision: Any = None) -> Any:
    """A request's image collector: ``mod.wire_images(policy, vision)``, or :class:`NoImages` when ``mod`` is None."""
    return mod.wire_images(policy, vision) if mod is not None else NoImages()


def convert_checked(convert: Any, pending: Any) -> list[dict[str, Any]]:
    """``convert(collector)``, a wire's message conversion; with ``pending`` None the registered modality's
    collector takes the images and they are checked here, else ``pending`` does and the caller checks them.

    Raises:
        WireError: from ``convert``; ImagePartRefused or the modality's error: a refused image.
    """
    checks = request_images(modality()) if pending is None else pending
    out = convert(checks)
    if pending is None:
        checks.check()
    return out
