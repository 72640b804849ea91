"""The ledger's image step: expand a rendered prompt's image placeholders into the processor's
runs and record where each run sits (:class:`~molt_core.types.ImageRef`).

The chat template renders one placeholder per image; the model's ``vision`` object (see
:mod:`molt_core.vision`) knows how many image tokens each image becomes under its processor.
"""

from __future__ import annotations

from typing import Any

from molt_core.types import ImageRef

__all__ = ["expand_images"]


def expand_images(vision: Any, ids: list[int], shas: list[str], pool: dict[str, bytes],
                  offset: int) -> tuple[list[int], list[ImageRef]]:
    """Expand the placeholders of ``ids`` (template-encoded text) for the images ``shas``.

    Args:
        vision: the model's image side with ``expand_placeholders(ids, images) -> (ids,
            refs)`` (``refs``: one object with ``start``, ``end``, ``grid_thw`` per image, in
            token order); None for a text-only model.
        ids: the encoded text, one placeholder per image.
        shas: the SHA-256 of each image, in the order the template renders them.
        pool: SHA-256 -> encoded bytes (the ledger's per-rollout image store).
        offset: where ``ids`` start in the segment (the held ids before a tail).

    Returns:
        ``(expanded ids, refs)`` with each ref's ``sha256`` set and ``start`` / ``end`` shifted by
        ``offset``; ``(ids, [])`` unchanged for a text-only model and no images.

    Raises:
        ValueError: images for a model without a vision processor, or a placeholder count that
            differs from the image count (e.g. message text that spells the placeholder token).
    """
    if vision is None:
        if shas:
            raise ValueError(f"the messages carry {len(shas)} image(s) but this model has no vision processor; "
                             "serve a vision-language model (see docs/vision.md) or send text only")
        return ids, []
    out, refs = vision.expand_placeholders(list(ids), [pool[h] for h in shas])
    if len(refs) != len(shas):
        raise ValueError(f"the prompt holds {len(refs)} image placeholder(s) for {len(shas)} image(s); message text "
                         "must not contain the model's image placeholder tokens")
    return list(out), [ImageRef(sha256=h, start=r.start + offset, end=r.end + offset, grid_thw=list(r.grid_thw))
                       for h, r in zip(shas, refs)]
