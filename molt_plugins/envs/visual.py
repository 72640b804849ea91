"""``visual`` env: synthetic image tasks drawn with Pillow, for vision-language RL on CPU.

Each task is one small RGB image (``image_size`` square, black background) and a question;
the reply is scored by exact match against the gold answer (binary reward). Three tasks:

* ``count`` -- ``1..max_count`` filled shapes (``shape_kinds``: square, circle, triangle) of
  side ``shape_size`` at random positions, at least ``gap`` pixels apart; "How many shapes
  are in the image?" -> ``"3"``.
* ``digit`` -- one seven-segment digit ``0..9`` (segments drawn as rectangles, so no font is
  involved and the pixels are the same on every platform) at a random position;
  "Which digit is shown?" -> ``"7"``.
* ``longer`` -- two horizontal lines, A at one third of the height and B at two thirds, of
  different lengths (by at least ``min_gap`` pixels); "Which line is longer, A (top) or B
  (bottom)?" -> ``"A"``.

A task dict is plain JSON: ``{"task", "params", "question", "answer"}`` where ``params`` holds
every generating parameter (image size and shape side included), so :func:`draw` rebuilds
the exact image from the task alone. The first message is a user message whose content is
the image part (``molt_plugins.vision.images.image_part`` of the PNG) followed by the question text.

Splits. The held-out split is the first ``eval_size`` distinct parameter sets drawn from
``random.Random(seed + EVAL_SEED_OFFSET)``; the train split is endless, drawn from
``random.Random(seed)``, skipping any parameter set that is in the held-out split. Two tasks
with different ``params`` draw different images (shapes never overlap), so no train image --
and hence no train (image, answer) pair -- equals a held-out one
(``tests/test_env_visual.py`` checks both, pixel for pixel).
"""

from __future__ import annotations

import io
import json
import random
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt_core.agents import EpisodeState, Env
from molt_plugins.vision.images import image_part
from molt_core.types import Result
from molt_plugins.envs.dataset import strip_end_markers

__all__ = ["VisualEnv", "VisualOptions", "EVAL_SEED_OFFSET", "SEGMENTS", "QUESTIONS", "draw", "png_bytes",
           "sample_params"]

#: Added to the base seed for the held-out split's generator.
EVAL_SEED_OFFSET = 1_000_000_007

#: Default question of each task.
QUESTIONS = {
    "count": "How many shapes are in the image?",
    "digit": "Which digit is shown?",
    "longer": "Which line is longer, A (top) or B (bottom)?",
}

#: Seven-segment encoding: the lit segments of each digit. Segments: a top, b top-right,
#: c bottom-right, d bottom, e bottom-left, f top-left, g middle (the standard labelling).
SEGMENTS = {
    0: "abcdef", 1: "bc", 2: "abdeg", 3: "abcdg", 4: "bcfg",
    5: "acdfg", 6: "acdefg", 7: "abc", 8: "abcdefg", 9: "abcdfg",
}

_WHITE = (255, 255, 255)
ShapeKind = Literal["square", "circle", "triangle"]


class VisualOptions(BaseModel):
    """Options of the ``visual`` env (the recipe's ``[agent.options]``).

    * ``task`` -- ``"count"``, ``"digit"`` or ``"longer"`` (see the module docstring).
    * ``image_size`` -- side of the square RGB image in pixels (16..1024).
    * ``max_count`` -- ``count``: the number of shapes is uniform in ``1..max_count``.
    * ``shape_size`` -- ``count``: side of a shape in pixels; None: ``image_size // 7``.
    * ``shape_kinds`` -- ``count``: each shape's kind is drawn uniformly from this list.
    * ``gap`` -- ``count``: minimum free pixels between two shapes' boxes.
    * ``cell`` -- ``count``: when set, the image is a grid of ``cell`` x ``cell`` pixel cells
      and each shape sits in its own cell at a random offset, at least ``gap // 2`` pixels
      (and at least 1) from the cell's edges; a cell the size of the model's image token (14
      px for ``builtin:tiny-qwen2.5-vl``) makes each token show at most one shape.
    * ``min_gap`` -- ``longer``: minimum length difference of the two lines, in pixels;
      None: ``image_size // 8``.
    * ``seed`` -- base generator seed; None uses the ``seed`` passed to ``tasks``.
    * ``eval_size`` -- number of held-out tasks.
    * ``question`` -- the question text; None uses :data:`QUESTIONS` of the task.
    * ``system_prompt`` -- optional system message.
    * ``strip_suffixes`` -- end markers removed from the reply before matching.
    * ``reward_weight`` -- the reward is ``reward_weight * score`` (score is 1.0 for an exact
      match of the stripped reply with the answer, else 0.0).
    """

    model_config = ConfigDict(extra="forbid")

    task: Literal["count", "digit", "longer"] = "count"
    image_size: int = Field(56, ge=16, le=1024)
    max_count: int = Field(4, ge=1, le=9)
    shape_size: int | None = Field(None, ge=2)
    shape_kinds: list[ShapeKind] = Field(default_factory=lambda: list[ShapeKind](["square"]), min_length=1)
    gap: int = Field(2, ge=1)
    cell: int | None = Field(None, ge=4)
    min_gap: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0)
    eval_size: int = Field(256, ge=1)
    question: str | None = None
    system_prompt: str | None = None
    strip_suffixes: list[str] = Field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    reward_weight: float = 1.0

    @model_validator(mode="after")
    def _fits(self) -> "VisualOptions":
        side = self.side()
        if self.task == "count" and self.cell is not None:
            margin = max(1, self.gap // 2)
            if side + 2 * margin > self.cell or (self.image_size // self.cell) ** 2 < self.max_count:
                raise ValueError(
                    f"agent.options.cell = {self.cell}: a grid of {self.image_size // self.cell}x"
                    f"{self.image_size // self.cell} cells must hold max_count = {self.max_count} shapes of side "
                    f"{side} with a margin of {margin} px; raise cell or image_size, or lower shape_size")
        elif self.task == "count":
            per_row = (self.image_size - 2 + self.gap) // (side + self.gap)
            if per_row * per_row < self.max_count:
                raise ValueError(
                    f"agent.options: {self.max_count} shapes of side {side} with gap {self.gap} do not fit in "
                    f"{self.image_size}x{self.image_size}; lower max_count or shape_size, or raise image_size")
        if self.task == "longer" and self.image_size // 8 < 2 and self.min_gap is None:
            raise ValueError("agent.options.image_size is too small for the 'longer' task; use 16 or more")
        return self

    def side(self) -> int:
        """The ``count`` task's shape side in pixels (``shape_size`` or ``image_size // 7``)."""
        return self.shape_size if self.shape_size is not None else max(2, self.image_size // 7)


# -- parameters -------------------------------------------------------------------------------
def _sample_count(rng: random.Random, o: VisualOptions) -> dict[str, Any]:
    n = rng.randint(1, o.max_count)
    s, size = o.side(), o.image_size
    boxes: list[list[Any]] = []  # [kind, x, y]
    if o.cell is not None:
        per_row, margin = size // o.cell, max(1, o.gap // 2)
        for c in rng.sample(range(per_row * per_row), n):
            x = (c % per_row) * o.cell + rng.randint(margin, o.cell - s - margin)
            y = (c // per_row) * o.cell + rng.randint(margin, o.cell - s - margin)
            boxes.append([rng.choice(o.shape_kinds), x, y])
    while len(boxes) < n:  # free placement: rejection sampling (the validator guarantees a packing)
        boxes = []
        for _ in range(200 * n):
            x, y = rng.randint(1, size - s - 1), rng.randint(1, size - s - 1)
            if all(abs(x - b[1]) >= s + o.gap or abs(y - b[2]) >= s + o.gap for b in boxes):
                boxes.append([rng.choice(o.shape_kinds), x, y])
                if len(boxes) == n:
                    break
    return {"size": size, "side": s, "shapes": sorted(boxes, key=lambda b: (b[2], b[1], b[0]))}


def _digit_box(size: int) -> tuple[int, int, int]:
    """``(width, height, thickness)`` of a seven-segment digit in a ``size`` image."""
    t = max(1, size // 18)
    w = max(3 * t, size * 2 // 7)
    return w, 2 * w - t, t


def _sample_digit(rng: random.Random, o: VisualOptions) -> dict[str, Any]:
    size = o.image_size
    w, h, _ = _digit_box(size)
    return {"size": size, "digit": rng.randint(0, 9), "x": rng.randint(1, size - w - 1), "y": rng.randint(1, size - h - 1)}


def _sample_longer(rng: random.Random, o: VisualOptions) -> dict[str, Any]:
    size = o.image_size
    gap = o.min_gap if o.min_gap is not None else size // 8
    lo, hi = max(2, size // 8), size - 4
    if hi - lo < gap:
        raise ValueError(f"agent.options.min_gap = {gap} is too large for image_size {size}")
    while True:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if abs(a - b) >= gap:
            break
    return {"size": size, "a": [rng.randint(2, size - a - 2), a], "b": [rng.randint(2, size - b - 2), b]}


_SAMPLERS = {"count": _sample_count, "digit": _sample_digit, "longer": _sample_longer}


def sample_params(rng: random.Random, options: VisualOptions) -> dict[str, Any]:
    """One task's generating parameters (plain JSON), drawn from ``rng``."""
    return _SAMPLERS[options.task](rng, options)


def answer_of(task: str, params: dict[str, Any]) -> str:
    """The gold answer of a ``task`` with ``params``: the shape count, the digit, or ``"A"`` /
    ``"B"`` (the longer line)."""
    if task == "count":
        return str(len(params["shapes"]))
    if task == "digit":
        return str(params["digit"])
    return "A" if params["a"][1] > params["b"][1] else "B"


# -- drawing ----------------------------------------------------------------------------------
def draw(task: str, params: dict[str, Any]) -> Any:
    """The task's image: a ``PIL.Image`` in mode ``RGB``, ``params["size"]`` square, black
    background, white figures. Coordinates are pixels from the top-left corner; boxes are
    inclusive (Pillow's convention).

    * ``count``: each ``[kind, x, y]`` fills the box ``[x, x+side-1] x [y, y+side-1]``: a
      square fills it, a circle is its inscribed ellipse, a triangle has corners
      ``(x, y+side-1)``, ``(x+side-1, y+side-1)``, ``(x+(side-1)//2, y)``.
    * ``digit``: segments of thickness ``t = size // 18`` (at least 1) in a box of width
      ``w = max(3t, 2*size//7)`` and height ``2w - t`` at ``(x, y)``.
    * ``longer``: line A is ``[x, x+len-1]`` on rows ``size//3 .. size//3 + t - 1`` with ``t =
      max(1, size // 28)``; line B likewise at row ``2*size//3``.

    Raises:
        ValueError: unknown ``task``.
    """
    from PIL import Image, ImageDraw

    size = int(params["size"])
    img = Image.new("RGB", (size, size), (0, 0, 0))
    d = ImageDraw.Draw(img)
    if task == "count":
        s = int(params["side"])
        for kind, x, y in params["shapes"]:
            if kind == "square":
                d.rectangle([x, y, x + s - 1, y + s - 1], fill=_WHITE)
            elif kind == "circle":
                d.ellipse([x, y, x + s - 1, y + s - 1], fill=_WHITE)
            else:
                d.polygon([(x, y + s - 1), (x + s - 1, y + s - 1), (x + (s - 1) // 2, y)], fill=_WHITE)
    elif task == "digit":
        w, h, t = _digit_box(size)
        x, y = int(params["x"]), int(params["y"])
        mid = y + (h - t) // 2
        seg = {
            "a": (x, y, x + w - 1, y + t - 1), "d": (x, y + h - t, x + w - 1, y + h - 1),
            "g": (x, mid, x + w - 1, mid + t - 1),
            "f": (x, y, x + t - 1, mid + t - 1), "b": (x + w - t, y, x + w - 1, mid + t - 1),
            "e": (x, mid, x + t - 1, y + h - 1), "c": (x + w - t, mid, x + w - 1, y + h - 1),
        }
        for name in SEGMENTS[int(params["digit"])]:
            d.rectangle(list(seg[name]), fill=_WHITE)
    elif task == "longer":
        t = max(1, size // 28)
        for (x, n), row in ((params["a"], size // 3), (params["b"], 2 * size // 3)):
            d.rectangle([x, row, x + n - 1, row + t - 1], fill=_WHITE)
    else:
        raise ValueError(f"unknown visual task {task!r}; choose count, digit or longer")
    return img


def png_bytes(task: dict[str, Any]) -> bytes:
    """The PNG encoding of a task dict's image (:func:`draw` of its ``task`` and ``params``)."""
    buf = io.BytesIO()
    draw(task["task"], task["params"]).save(buf, format="PNG")
    return buf.getvalue()


def _key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


# -- the env ----------------------------------------------------------------------------------
class VisualEnv(Env):
    """Single-turn synthetic image task (see the module docstring).

    ``tasks(split, seed)`` yields ``{"task", "params", "question", "answer"}``; ``first_messages``
    shows the image and the question; ``step`` scores the reply by exact match (after
    whitespace and ``strip_suffixes`` stripping): ``score`` 1.0 or 0.0, ``reward = reward_weight
    * score``, ``terminated`` True.

    Raises (at construction):
        ValueError: invalid options (names the field), e.g. shapes that cannot fit.
    """

    Options = VisualOptions
    options: VisualOptions
    molt_example = {"options": {"task": "count", "eval_size": 8}}
    """Options for ``molt plugins --check`` (a short held-out split)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._eval_cache: dict[int, list[dict[str, Any]]] = {}

    def _base_seed(self, seed: int) -> int:
        return self.options.seed if self.options.seed is not None else seed

    def _task(self, params: dict[str, Any]) -> dict[str, Any]:
        o = self.options
        return {"task": o.task, "params": params, "question": o.question or QUESTIONS[o.task],
                "answer": answer_of(o.task, params)}

    def eval_tasks(self, seed: int) -> list[dict[str, Any]]:
        """The held-out split: the first ``eval_size`` distinct parameter sets drawn from
        ``random.Random(seed + EVAL_SEED_OFFSET)``.

        Raises:
            ValueError: the task has fewer than ``eval_size`` distinct parameter sets within
                reach (a tiny image); lower ``eval_size``.
        """
        base = self._base_seed(seed)
        if base not in self._eval_cache:
            rng = random.Random(base + EVAL_SEED_OFFSET)
            seen: dict[str, dict[str, Any]] = {}
            tries = 0
            while len(seen) < self.options.eval_size:
                p = sample_params(rng, self.options)
                seen.setdefault(_key(p), p)
                tries += 1
                if tries > 20 * self.options.eval_size:
                    raise ValueError(f"agent.options.eval_size = {self.options.eval_size}: only {len(seen)} distinct "
                                     f"{self.options.task!r} images found; lower eval_size or raise image_size")
            self._eval_cache[base] = [self._task(p) for p in seen.values()]
        return self._eval_cache[base]

    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """Yield task dicts of ``split``: ``"eval"`` the held-out tasks once, in order;
        ``"train"`` endless, drawn from ``random.Random(seed)``, skipping held-out parameters.

        Raises:
            ValueError: unknown split.
        """
        if split == "eval":
            yield from self.eval_tasks(seed)
            return
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        held_out = {_key(t["params"]) for t in self.eval_tasks(seed)}
        rng = random.Random(self._base_seed(seed))
        while True:
            p = sample_params(rng, self.options)
            if _key(p) not in held_out:
                yield self._task(p)

    def reset(self, task: dict[str, Any]) -> str:
        """The question text (the image travels in :meth:`first_messages`)."""
        return str(task["question"])

    def first_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The optional system message, then one user message whose content is the image
        part (a PNG data URL) followed by the question text part."""
        messages: list[dict[str, Any]] = []
        if self.options.system_prompt:
            messages.append({"role": "system", "content": self.options.system_prompt})
        messages.append({"role": "user", "content": [image_part(png_bytes(task)),
                                                     {"type": "text", "text": self.reset(task)}]})
        return messages

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Score the single reply by exact match; the episode ends."""
        s = 1.0 if strip_end_markers(action_text, self.options.strip_suffixes) == str(state.task["answer"]) else 0.0
        return Result(reward=self.options.reward_weight * s, score=s, terminated=True,
                      info={"task": self.options.task})

