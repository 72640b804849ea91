"""The vision modality: the one object ``molt_register_modalities`` registers, giving the kernel
what it calls for images (processor loading, engine pixel inputs and 3D positions, image parts
in messages, wire image parts). Its image processor (:class:`VisionProcessor`) carries the
ledger's expansion, the ingress run check and the trainer's padded inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from molt_core.config import ImagePolicy
from molt_plugins.vision.images import DecodedImage, ImageError, decode_part
from molt_plugins.vision.processor import (
    VisionProcessor,
    _rope_index_fn,
    image_runs,
    image_sha256,
    is_vision_model,
    load_vision_processor,
    pixel_inputs,
    rope_positions,
)
from molt_plugins.vision.wire import WireImages

__all__ = ["VisionModality", "RowImages"]


@dataclass(eq=False)
class RowImages:
    """A prompt's images: ``pixel_values`` ``[n, D]``, ``grid`` ``[N, 3]``, the prompt's 3D
    positions ``pos`` ``[3, P]``, ``delta`` (position of token ``j >= P`` is ``j + delta``)."""

    shas: tuple[str, ...]
    pixel_values: torch.Tensor
    grid: torch.Tensor
    pos: torch.Tensor
    delta: int
    runs: tuple[tuple[str, int, int], ...]  # (sha256, start, end) of each image's run, in token order
    rows: tuple[int, ...]  # pixel_values rows of each image: t * h * w

    def after(self, m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(pixel_values, grid)`` of the images whose runs start at or after token ``m`` (the
        ones a prefill from a reused prefix of ``m`` tokens must encode), or ``(None, None)``."""
        keep = [i for i, (_, s, _) in enumerate(self.runs) if s >= m]
        if not keep:
            return None, None
        first = sum(self.rows[:keep[0]])
        return self.pixel_values[first:], self.grid[keep[0]:]

    def positions(self, length: int) -> torch.Tensor:
        """``[3, length]`` positions of the prompt followed by ``length - P`` text tokens."""
        P = self.pos.shape[1]
        tail = (torch.arange(P, length) + self.delta).expand(3, -1)
        return torch.cat([self.pos[:, :length], tail], 1)


class VisionModality:
    """Images for Qwen2-VL-family models (see ``docs/vision.md``); stateless."""

    #: the error a refused image raises (a ValueError with ``field``, the request's field path)
    error = ImageError

    def decode_part(self, part: dict[str, Any], where: str, policy: ImagePolicy | None = None) -> DecodedImage:
        """An internal image part validated and decoded (:func:`molt_plugins.vision.images.decode_part`).

        Raises:
            ImageError: naming ``<where>.image_url.url``.
        """
        return decode_part(part, where, policy)

    def is_model(self, model: Any) -> bool:
        """True for a model that takes images (its config has a ``vision_config``)."""
        return is_vision_model(model)

    def rope_index(self, model: Any) -> Any:
        """``model``'s own ``get_rope_index`` (a Qwen2-VL-family model, peft-wrapped or not).

        Raises:
            TypeError: a model without one.
        """
        return _rope_index_fn(model)

    def processor_for(self, model: Any, path: str, tokenizer: Any = None) -> VisionProcessor | None:
        """The image processor of ``model`` loaded from ``path``; None for a text-only model.

        Raises:
            ValueError / FileNotFoundError: as :func:`~molt_plugins.vision.processor.load_vision_processor`.
        """
        return load_vision_processor(path, tokenizer) if is_vision_model(model) else None

    def row_images(self, model: Any, vp: VisionProcessor | None, ids: list[int], images: list[bytes] | None,
                   is_vision: bool) -> RowImages | None:
        """An engine prompt's images processed: pixels, grids and 3D positions; None for a text prompt.

        Raises:
            ValueError: image tokens without images, images for a text model or an engine
                without a processor, or runs that do not match the images.
        """
        if not images:
            if is_vision and vp is not None and vp.image_token_id in ids:
                raise ValueError(f"prompt_ids hold image tokens (id {vp.image_token_id}) but no images were given; "
                                 "pass images=[...] in token order")
            return None
        if not is_vision:
            raise ValueError(f"{len(images)} image(s) given but the model ({type(model).__name__}) is not a "
                             "vision-language model; use one such as builtin:tiny-qwen2.5-vl")
        if vp is None:
            raise ValueError("this engine has no vision processor: build it from a model path or pass "
                             "vision_processor=molt_plugins.vision.processor.load_vision_processor(path)")
        pixels, grid = pixel_inputs(images, vp)
        pos, delta = rope_positions(model, ids, grid.tolist(), vp)
        shas = tuple(image_sha256(b) for b in images)
        runs = tuple((h, s, e) for h, (s, e) in zip(shas, image_runs(ids, vp.image_token_id)))
        return RowImages(shas, pixels, grid, pos, delta, runs, tuple(int(g.prod()) for g in grid))

    def forward_kwargs(self, model: Any, rows: Sequence[RowImages | None], spans: Sequence[tuple[int, int]], n: int,
                       pos2d: torch.Tensor) -> dict[str, Any]:
        """Model kwargs of an engine's left-padded forward: row ``i`` runs its context tokens
        ``[a, b)`` (``spans[i]``; ``a > 0`` after a reused prefix) right-aligned in ``n`` columns.

        Returns:
            ``position_ids`` ``[3, B, n]`` (text rows keep ``pos2d`` ``[B, n]`` on all three
            axes) and, when a run lies in the tokens run, ``pixel_values`` (the model's dtype)
            and ``image_grid_thw`` of those images, in row order.
        """
        pos = pos2d.unsqueeze(0).expand(3, -1, -1).clone()
        pixels: list[torch.Tensor] = []
        grids: list[torch.Tensor] = []
        for i, (r, (a, b)) in enumerate(zip(rows, spans)):
            if r is None:
                continue
            pos[:, i, n - (b - a):] = r.positions(b)[:, a:].to(pos.device)
            pv, grid = r.after(a)
            if pv is not None and grid is not None:
                pixels.append(pv)
                grids.append(grid)
        kw: dict[str, Any] = {"position_ids": pos}
        if pixels:
            first = next(model.parameters())
            kw.update(pixel_values=torch.cat(pixels).to(first.device, first.dtype),
                      image_grid_thw=torch.cat(grids).to(first.device))
        return kw

    def wire_images(self, policy: ImagePolicy | None = None, vision: VisionProcessor | None = None) -> WireImages:
        """A request's image collector: the wires convert their image parts through it, then
        the server calls its ``check()`` (see :class:`~molt_plugins.vision.wire.WireImages`)."""
        return WireImages(policy, vision)
