"""The ledger's image step: expand a rendered prompt's image placeholders into the processor's
runs and record where each run sits (:class:`~molt_core.types.ImageRef`).

The chat template renders one placeholder per image; the model's
:class:`~molt_plugins.vision.processor.VisionProcessor` knows how many image tokens each image becomes.
"""

from __future__ import annotations

from typing import Any

from molt_core.types import ImageRef

__all__ = ["expand_images", "extra_image_tokens"]


def expand_images(vision: Any, ids: list[int], shas: list[str], pool: dict[str, bytes],
                  offset: int) -> tuple[list[int], list[ImageRef]]:
    """Expand the placeholders of ``ids`` (template-encoded text) for the images ``shas``.

    Args:
        vision: the model's :class:`~molt_plugins.vision.processor.VisionProcessor`; None for a text-only model.
        ids: the encoded text, one placeholder per image.
        shas: the SHA-256 of each image, in the order the template renders them.
        pool: SHA-256 -> encoded bytes (the ledger's per-rollout image store).
        offset: where ``ids`` start in the segment (the held ids before a tail).

    Returns:
        ``(expanded ids, refs)`` (:func:`molt_plugins.vision.processor.expand_placeholders`, refs positioned
        in the segment); ``(ids, [])`` unchanged for a text-only model and no images.

    Raises:
        ValueError: images for a model without a vision processor, or a placeholder count that
            differs from the image count (e.g. message text that spells the placeholder token).
    """
    if vision is None:
        if shas:
            raise ValueError(f"the messages carry {len(shas)} image(s) but this model has no vision processor; "
                             "serve a vision-language model (see docs/vision.md) or send text only")
        return ids, []
    n = sum(1 for t in ids if t == vision.image_token_id)
    if n != len(shas):
        why = ("message text must not contain the model's image placeholder tokens" if n > len(shas) else
               "the chat template does not render every image part: send images only where it renders them")
        raise ValueError(f"the prompt has {n} image placeholder(s) (<|image_pad|>, id {vision.image_token_id}) but "
                         f"{len(shas)} image(s) were given ({why})")
    return vision.expand_placeholders(ids, [pool[h] for h in shas], offset=offset)


def extra_image_tokens(vision: Any, shas: list[str], pool: dict[str, bytes]) -> int:
    """Tokens the images ``shas`` add to a render by expansion: ``sum(run length - 1)`` (each
    image's one placeholder becomes its run); 0 for no images or a text-only model."""
    if vision is None or not shas:
        return 0
    return sum(vision.num_tokens(vision.process(pool[h])[1]) - 1 for h in shas)
