"""Vision-language inputs, the processor side (Qwen2-VL family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

A chat template renders each image as one placeholder, ``<|vision_start|><|image_pad|>
<|vision_end|>``. The model sees each image as a *run* of ``<|image_pad|>`` tokens, one per
merged patch: the image processor resizes the image to a multiple of ``patch_size *
merge_size``, cuts it into a ``[t, h, w]`` patch grid, and the run has ``t * h * w //
merge_size**2`` tokens (``Qwen2_5_VLProcessor.replace_image_token`` in transformers).

* :func:`expand_placeholders` turns rendered ids (one ``<|image_pad|>`` per image) into the
  expanded ids and the :class:`~molt_core.types.ImageRef` of each run -- what the ledger
  stores, so token identity covers the image tokens id for id.
* :func:`pixel_inputs` gives the model's ``pixel_values`` and ``image_grid_thw`` for the
  images of a sequence, in token order.
* :func:`rope_positions` gives the 3D (M-RoPE) position ids of a sequence with images, from
  the model's own ``get_rope_index``; engines and the trainer place them into their padded
  layouts, so both run the same positions.

Images travel as their encoded bytes (PNG, JPEG, ...) and are identified by the SHA-256 of
those bytes (:func:`image_sha256`); the processed pixels of recently seen images are cached
by that digest.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from molt_core.models import (  # noqa: F401 - the vision-token mask is part of this module's API
    VISION_TOKEN_LOGIT,
    declares_vision,
    hub_kwargs,
    is_builtin,
    load_tokenizer,
    mask_vision_tokens,
    resolve_path,
    vision_token_ids,
)
from molt_core.types import ImageRef
from molt_plugins.tiny_models.vl import TINY_VL_MAX_PIXELS, TINY_VL_MERGE, TINY_VL_MIN_PIXELS, TINY_VL_PATCH
from molt_plugins.vision.expand import expand_images, extra_image_tokens
from molt_plugins.vision.images import DecodedImage, decode_part

__all__ = [
    "TINY_VL_MAX_PIXELS", "TINY_VL_MERGE", "TINY_VL_MIN_PIXELS", "TINY_VL_PATCH", "VisionProcessor",
    "check_runs", "decode_image", "expand_placeholders", "image_runs", "image_sha256", "is_vision_model",
    "load_vision_processor", "padded_inputs", "pixel_inputs", "rope_positions", "tiny_image_processor",
]



def image_sha256(data: bytes) -> str:
    """Hex SHA-256 of an image's encoded bytes: its key in ``Trajectory.images``."""
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes) -> Any:
    """Decode encoded image bytes into an RGB ``PIL.Image``.

    Raises:
        ValueError: the bytes are not an image Pillow can decode (names the cause).
    """
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # noqa: BLE001 - UnidentifiedImageError, truncated files, ...
        raise ValueError(f"image bytes could not be decoded: {type(e).__name__}: {e}") from e
    return img.convert("RGB")


@dataclass(eq=False)
class VisionProcessor:
    """A model's image processor plus what expansion needs.

    Fields:
      * ``image_processor`` -- a transformers Qwen2-VL-style image processor (callable on a
        list of PIL images, returning ``pixel_values`` and ``image_grid_thw``).
      * ``image_token_id`` -- the id of ``<|image_pad|>``.
      * ``merge_size`` -- spatial merge (``2`` in the Qwen2-VL family): a run has
        ``t * h * w // merge_size**2`` tokens.
      * ``cache_size`` -- processed images kept, by SHA-256 (LRU).
      * ``cache_bytes`` -- most bytes of ``pixel_values`` kept (default 1 GiB): a real model's
        image may process to hundreds of MB (Qwen2.5-VL at its shipped ``max_pixels``:
        65,536 patch rows x 1,176 float32 = 308 MB), so the count alone does not bound memory.
        An image bigger than the budget is not kept.
    """

    image_processor: Any
    image_token_id: int
    merge_size: int
    cache_size: int = 256
    cache_bytes: int = 1 << 30
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _nbytes: int = field(default=0, repr=False)

    @property
    def cached_bytes(self) -> int:
        """Bytes of ``pixel_values`` the cache holds now."""
        return self._nbytes

    def clear_cache(self) -> None:
        """Drop every processed image."""
        with self._lock:
            self._cache.clear()
            self._nbytes = 0

    def process(self, data: bytes) -> tuple[torch.Tensor, list[int]]:
        """Process one image.

        Returns:
            ``(pixel_values, grid_thw)``: ``[t * h * w, C * temporal_patch * patch**2]`` float32
            patch rows and the ``[t, h, w]`` patch grid.

        Raises:
            ValueError: undecodable bytes.
        """
        key = image_sha256(data)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        out = self.image_processor(images=[decode_image(data)], return_tensors="pt")
        res = (out["pixel_values"].to(torch.float32), [int(g) for g in out["image_grid_thw"][0]])
        size = res[0].numel() * res[0].element_size()
        if size > self.cache_bytes:
            return res
        with self._lock:
            if key not in self._cache:
                self._cache[key] = res
                self._nbytes += size
            while self._cache and (len(self._cache) > self.cache_size or self._nbytes > self.cache_bytes):
                _, (old, _) = self._cache.popitem(last=False)
                self._nbytes -= old.numel() * old.element_size()
        return res

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        """Length of the placeholder run of an image with patch grid ``grid_thw``."""
        t, h, w = grid_thw
        return int(t) * int(h) * int(w) // self.merge_size**2

    # -- what the kernel calls on the processor it holds (ledger, ingress, trainer forward, SFT)
    def decode_part(self, part: dict[str, Any], where: str, policy: Any = None) -> DecodedImage:
        """An internal image part read (:func:`molt_plugins.vision.images.decode_part`). Raises: ImageError."""
        return decode_part(part, where, policy)

    def expand(self, ids: list[int], shas: list[str], pool: dict[str, bytes], offset: int) -> tuple[list[int], list[ImageRef]]:
        """The ledger's expansion (:func:`molt_plugins.vision.expand.expand_images`)."""
        return expand_images(self, ids, shas, pool, offset)

    def extra_tokens(self, shas: list[str], pool: dict[str, bytes]) -> int:
        """Tokens the images ``shas`` add by expansion (:func:`molt_plugins.vision.expand.extra_image_tokens`)."""
        return extra_image_tokens(self, shas, pool)

    def expand_placeholders(self, ids: Sequence[int], images: Sequence[bytes], *,
                            offset: int = 0) -> tuple[list[int], list[ImageRef]]:
        """:func:`expand_placeholders` with this processor."""
        return expand_placeholders(ids, images, self, offset=offset)

    def check_segment(self, ids: Sequence[int], refs: Sequence[ImageRef], images: Sequence[bytes]) -> None:
        """Trainer ingress: ``ids`` hold one run per ref, where the ref records it, and each
        image's grid as this processor computes it (what the forward will use) is the ref's.

        Raises:
            ValueError: the first mismatch (``images[k]: ...`` for an image's own fault).
        """
        check_runs(ids, [ref.grid_thw for ref in refs], self, refs)
        for k, (ref, data) in enumerate(zip(refs, images)):
            try:
                grid = self.process(data)[1]  # cached by digest: the forward reuses it
            except ValueError as e:
                raise ValueError(f"images[{k}]: {e}") from None
            if list(grid) != list(ref.grid_thw):
                raise ValueError(f"images[{k}] records grid {list(ref.grid_thw)} but the trainer's image processor "
                                 f"gives {list(grid)}: the engine and the trainer process images differently (use "
                                 "the same model.path processor for both)")

    def padded_inputs(self, model: Any, rows: Sequence[tuple[Sequence[int], Sequence[bytes]]], width: int,
                      device: Any = None) -> dict[str, torch.Tensor]:
        """:func:`padded_inputs` with this processor (shapes there)."""
        return padded_inputs(model, self, rows, width, device)


def tiny_image_processor() -> Any:
    """The image processor of ``builtin:tiny-qwen2.5-vl`` (Pillow backend: needs no torchvision):
    patch :data:`TINY_VL_PATCH`, merge :data:`TINY_VL_MERGE`, temporal patch 2, pixel limits
    :data:`TINY_VL_MIN_PIXELS`..:data:`TINY_VL_MAX_PIXELS`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=TINY_VL_PATCH, merge_size=TINY_VL_MERGE, temporal_patch_size=2,
                                    min_pixels=TINY_VL_MIN_PIXELS, max_pixels=TINY_VL_MAX_PIXELS)


def load_vision_processor(path: str, tokenizer: Any = None) -> VisionProcessor | None:
    """The :class:`VisionProcessor` of model ``path``, or None for a text-only model.

    Args:
        path: ``builtin:<name>`` (``tiny-qwen2.5-vl`` has one, other builtins are text-only),
            a local Hugging Face directory, ``pkg:<module>`` or a Hub id (its
            ``preprocessor_config.json``; see :func:`molt_core.models.hub_kwargs`).
        tokenizer: the model's tokenizer (to find ``<|image_pad|>``); loaded when None.

    Raises:
        ValueError: a vision model whose tokenizer has no ``<|image_pad|>`` token.
        FileNotFoundError: as :func:`molt_core.models.hub_kwargs`.
    """
    if is_builtin(path):
        if not declares_vision(path):
            return None
        ip = tiny_image_processor()
    else:
        from transformers import AutoConfig, AutoImageProcessor

        name, kw = hub_kwargs(resolve_path(path))
        if getattr(AutoConfig.from_pretrained(name, **kw), "vision_config", None) is None:
            return None
        ip = AutoImageProcessor.from_pretrained(name, **kw)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    if image_id is None or image_id == getattr(tok, "unk_token_id", None):
        raise ValueError(f"model.path {path!r} is a vision model but its tokenizer has no <|image_pad|> token")
    return VisionProcessor(ip, int(image_id), int(ip.merge_size))


def is_vision_model(model: Any) -> bool:
    """True for a model whose config has a ``vision_config`` (takes ``pixel_values``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def image_runs(ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of ``image_token_id`` in ``ids``, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(ids):
        if t == image_token_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(ids)))
    return runs


def expand_placeholders(ids: Sequence[int], images: Sequence[bytes], vp: VisionProcessor,
                        *, offset: int = 0) -> tuple[list[int], list[ImageRef]]:
    """Expand each image's single ``<|image_pad|>`` into the processor's run.

    Args:
        ids: rendered token ids holding exactly one ``<|image_pad|>`` per image (the chat
            template's placeholder), in the order of ``images``.
        images: encoded bytes of each image, in token order.
        vp: the model's :class:`VisionProcessor`.
        offset: added to every ``ImageRef`` position (the index ``ids[0]`` will have in the
            segment, when ``ids`` is a tail appended to earlier tokens).

    Returns:
        ``(expanded_ids, refs)``: ``refs[i]`` has the SHA-256 of ``images[i]``, its run
        ``[start, end)`` in ``expanded_ids`` (plus ``offset``) and its patch grid; the run
        length is ``t * h * w // merge_size**2`` (equal to what transformers' own
        ``Qwen2_5_VLProcessor`` produces for the same text and images).

    Raises:
        ValueError: the number of ``<|image_pad|>`` tokens differs from ``len(images)``, or an
            image cannot be decoded.
    """
    pos = [i for i, t in enumerate(ids) if t == vp.image_token_id]
    if len(pos) != len(images):
        raise ValueError(f"the prompt has {len(pos)} image placeholder(s) (<|image_pad|>, id {vp.image_token_id}) "
                         f"but {len(images)} image(s) were given; give one image per placeholder")
    out: list[int] = []
    refs: list[ImageRef] = []
    prev = 0
    for p, data in zip(pos, images):
        out.extend(ids[prev:p])
        grid = vp.process(data)[1]
        n = vp.num_tokens(grid)
        refs.append(ImageRef(sha256=image_sha256(data), start=offset + len(out), end=offset + len(out) + n,
                             grid_thw=grid))
        out.extend([vp.image_token_id] * n)
        prev = p + 1
    out.extend(ids[prev:])
    return [int(t) for t in out], refs


def pixel_inputs(images: Sequence[bytes], vp: VisionProcessor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's image inputs for ``images`` (encoded bytes, in token order).

    Returns:
        ``(pixel_values, image_grid_thw)``: ``[sum_i t_i * h_i * w_i, D]`` float32 patch rows
        (``D = channels * temporal_patch * patch**2``) and ``[N, 3]`` int64 grids.

    Raises:
        ValueError: no images, or an image cannot be decoded.
    """
    if not images:
        raise ValueError("pixel_inputs needs at least one image")
    done = [vp.process(d) for d in images]
    return torch.cat([p for p, _ in done]), torch.tensor([g for _, g in done], dtype=torch.long)


def check_runs(ids: Sequence[int], grids: Sequence[Sequence[int]], vp: VisionProcessor,
               refs: Sequence[ImageRef] | None = None) -> None:
    """Check that ``ids`` hold one ``<|image_pad|>`` run per image, of the length its grid gives
    (and, with ``refs``, at the positions the refs record).

    Raises:
        ValueError: naming the first image whose run is missing, mislaid or of the wrong length.
    """
    runs = image_runs(ids, vp.image_token_id)
    if len(runs) != len(grids):
        raise ValueError(f"the ids hold {len(runs)} image token run(s) (id {vp.image_token_id}) but "
                         f"{len(grids)} image(s) were given; expand the prompt with expand_placeholders")
    for i, ((s, e), g) in enumerate(zip(runs, grids)):
        if e - s != vp.num_tokens(g):
            raise ValueError(f"image {i}: its run has {e - s} tokens but its grid {list(g)} gives "
                             f"{vp.num_tokens(g)}; expand the prompt with expand_placeholders")
        if refs is not None and (refs[i].start, refs[i].end) != (s, e):
            raise ValueError(f"images[{i}] records tokens [{refs[i].start}, {refs[i].end}) but the image run "
                             f"is at [{s}, {e})")


def _rope_index_fn(model: Any) -> Any:
    for m in (model, getattr(model, "model", None), getattr(getattr(model, "base_model", None), "model", None)):
        fn = getattr(m, "get_rope_index", None)
        if fn is not None:
            return fn
    inner = getattr(model, "get_base_model", None)
    if inner is not None:  # peft
        return _rope_index_fn(inner())
    raise TypeError(f"{type(model).__name__} has no get_rope_index: not a Qwen2-VL-family model")


def rope_positions(model: Any, ids: Sequence[int], grids: Sequence[Sequence[int]], vp: VisionProcessor,
                   ) -> tuple[torch.Tensor, int]:
    """3D (M-RoPE) position ids of one unpadded sequence with images, from the model's own
    ``get_rope_index`` (transformers; temporal/height/width positions on image tokens, one
    shared position per text token).

    Args:
        ids: the sequence's ids (expanded image runs included).
        grids: ``[t, h, w]`` of each image, in token order.

    Returns:
        ``(positions, delta)``: ``[3, len(ids)]`` int64, and the offset a text token appended at
        index ``j >= len(ids)`` has: its position is ``j + delta`` on all three axes.

    Raises:
        ValueError: as :func:`check_runs`.
    """
    check_runs(ids, grids, vp)
    x = torch.tensor([list(ids)], dtype=torch.long)
    types = (x == vp.image_token_id).int()
    if not grids:
        return torch.arange(len(ids)).expand(3, -1).clone(), 0
    pos, delta = _rope_index_fn(model)(x, mm_token_type_ids=types,
                                        image_grid_thw=torch.tensor([list(g) for g in grids], dtype=torch.long))
    return pos[:, 0].cpu(), int(delta.flatten()[0])


def padded_inputs(model: Any, vp: VisionProcessor | None, rows: Sequence[tuple[Sequence[int], Sequence[bytes]]],
                  width: int, device: Any = None) -> dict[str, torch.Tensor]:
    """Image kwargs of a right-padded forward (trainer recompute, SFT) over ``rows``.

    Args:
        rows: per row, its real ids (unpadded, ``len <= width``, image runs expanded) and the
            encoded bytes of its images in token order (empty for a text row).
        width: ``T``, the padded row length.

    Returns:
        ``{}`` when no row has an image; else ``position_ids`` ``[3, B, T]`` int64 (a row's
        :func:`rope_positions`, continued as ``j + delta`` over its padding; text rows
        ``0..T-1``), ``pixel_values`` ``[n, D]`` (in the model's dtype) and ``image_grid_thw``
        ``[N, 3]`` of every image, rows in order.

    Raises:
        ValueError: images but no vision processor, or a row whose image runs do not match
            its images (:func:`check_runs`).
    """
    if not any(imgs for _, imgs in rows):
        return {}
    if vp is None:
        raise ValueError("rows carry images but the model has no vision processor")
    pos = torch.arange(width).expand(3, len(rows), -1).clone()
    pixels, grids = [], []
    for i, (ids, imgs) in enumerate(rows):
        if not imgs:
            continue
        pv, grid = pixel_inputs(imgs, vp)
        p, delta = rope_positions(model, ids, grid.tolist(), vp)
        pos[:, i, :len(ids)] = p
        pos[:, i, len(ids):] = torch.arange(len(ids), width) + delta
        pixels.append(pv)
        grids.append(grid)
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype  # a LoRA reference holds no parameters
    return {"position_ids": pos.to(device), "pixel_values": torch.cat(pixels).to(device, dtype),
            "image_grid_thw": torch.cat(grids).to(device)}
