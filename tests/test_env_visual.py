"""The ``visual`` env: known tasks per seed, exact pixels, exact reward, a held-out split
disjoint from training image for image, and clear option errors."""

from __future__ import annotations

import base64
import io
import itertools
import json
import random

import numpy as np
import pytest
from PIL import Image

from molt_core.agents import EpisodeState
from molt_plugins.envs.visual import (
    SEGMENTS, VisualEnv, VisualOptions, _key, answer_of, draw, png_bytes, sample_params,
)

WHITE, BLACK = (255, 255, 255), (0, 0, 0)


def _white(img: Image.Image) -> int:
    px = img.tobytes()
    return sum(px[i:i + 3] == b"\xff\xff\xff" for i in range(0, len(px), 3))


def _first(env: VisualEnv, split: str, seed: int = 0) -> dict:
    return next(env.tasks(split, seed))


# -- known tasks and pixels ------------------------------------------------------------------
def test_count_seed0_known_params_and_pixels():
    env = VisualEnv(task="count")
    assert _first(env, "eval") == {"task": "count", "params": {"size": 56, "side": 8, "shapes": [["square", 26, 3]]},
                                   "question": "How many shapes are in the image?", "answer": "1"}
    t = _first(env, "train")
    assert t["params"] == {"size": 56, "side": 8,
                           "shapes": [["square", 27, 3], ["square", 38, 14], ["square", 20, 31], ["square", 33, 32]]}
    assert t["answer"] == "4"
    img = draw(t["task"], t["params"])
    assert (img.size, img.mode) == ((56, 56), "RGB")
    # square at (27, 3), side 8, fills x 27..34, y 3..10 (inclusive)
    assert img.getpixel((27, 3)) == WHITE and img.getpixel((34, 10)) == WHITE
    assert img.getpixel((26, 3)) == BLACK and img.getpixel((35, 10)) == BLACK and img.getpixel((27, 11)) == BLACK
    assert img.getpixel((45, 21)) == WHITE  # the far corner of the square at (38, 14)
    assert _white(img) == 4 * 8 * 8  # four disjoint 8x8 squares, nothing else


def test_count_shape_kinds_pixels():
    p = {"size": 28, "side": 7, "shapes": [["circle", 2, 2], ["triangle", 12, 2], ["square", 2, 12]]}
    img = draw("count", p)
    assert answer_of("count", p) == "3"
    assert img.getpixel((5, 5)) == WHITE and img.getpixel((2, 2)) == BLACK  # circle: centre lit, box corner not
    # triangle: base corners (12, 8), (18, 8) and apex (15, 2) lit; the box's top-left corner is not
    assert [img.getpixel(xy) for xy in ((12, 8), (18, 8), (15, 2), (12, 2))] == [WHITE, WHITE, WHITE, BLACK]
    sq = img.crop((2, 12, 9, 19))
    assert _white(sq) == 49  # the 7x7 square is solid


def test_count_cell_layout_puts_each_shape_inside_its_own_cell():
    env = VisualEnv(task="count", image_size=56, cell=14, shape_size=8)
    seen = set()
    for t in itertools.islice(env.tasks("train", 0), 500):
        cells = []
        for _, x, y in t["params"]["shapes"]:
            for v in (x, y):  # margin max(1, gap // 2) = 1: the shape spans v .. v+7 inside 1 .. 12 of its cell
                assert 1 <= v % 14 and v % 14 + 7 <= 12, t
            cells.append((x // 14, y // 14))
        assert len(set(cells)) == len(cells) == int(t["answer"])
        seen.add(len(cells))
    assert seen == {1, 2, 3, 4}
    with pytest.raises(ValueError, match=r"agent\.options\.cell = 8"):
        VisualEnv(task="count", image_size=56, cell=8, shape_size=8)
    with pytest.raises(ValueError, match=r"max_count = 5"):
        VisualEnv(task="count", image_size=28, cell=14, shape_size=8, max_count=5)


def test_digit_seed0_known_params_and_segments():
    env = VisualEnv(task="digit")
    assert _first(env, "eval")["params"] == {"size": 56, "digit": 0, "x": 26, "y": 2}
    t = _first(env, "train")
    assert t["params"] == {"size": 56, "digit": 6, "x": 27, "y": 2} and t["answer"] == "6"
    img = draw("digit", t["params"])
    # size 56: thickness 3, box 16 wide x 29 high at (27, 2); the middle bar is rows 15..17
    assert img.getpixel((41, 8)) == BLACK  # segment b (upper right) is off for a 6
    assert img.getpixel((28, 8)) == WHITE  # f (upper left)
    assert img.getpixel((41, 22)) == WHITE  # c (lower right)
    assert img.getpixel((28, 22)) == WHITE  # e (lower left)
    assert img.getpixel((34, 16)) == WHITE  # g (middle)
    assert img.getpixel((34, 3)) == WHITE and img.getpixel((34, 29)) == WHITE  # a (top), d (bottom)
    assert img.getpixel((34, 8)) == BLACK and img.getpixel((34, 22)) == BLACK  # the two holes
    # every digit lights exactly its segments: 8 is the union, so each digit's pixels are a subset
    full = np.asarray(draw("digit", {**t["params"], "digit": 8}))[..., 0] == 255
    for d in range(10):
        lit = np.asarray(draw("digit", {**t["params"], "digit": d}))[..., 0] == 255
        assert not (lit & ~full).any() and bool((lit == full).all()) == (d == 8), d
    assert len(SEGMENTS) == 10


def test_longer_seed0_known_params_and_pixels():
    env = VisualEnv(task="longer")
    assert _first(env, "eval")["params"] == {"size": 56, "a": [4, 8], "b": [12, 32]}
    t = _first(env, "train")
    assert t["params"] == {"size": 56, "a": [34, 9], "b": [17, 23]} and t["answer"] == "B"
    img = draw("longer", t["params"])
    # thickness 2; A on rows 18..19 (56 // 3), x 34..42; B on rows 37..38 (2 * 56 // 3), x 17..39
    assert [img.getpixel(xy) for xy in ((34, 18), (42, 19), (43, 18), (33, 18))] == [WHITE, WHITE, BLACK, BLACK]
    assert [img.getpixel(xy) for xy in ((17, 37), (39, 38), (40, 37), (17, 39))] == [WHITE, WHITE, BLACK, BLACK]
    assert _white(img) == 2 * (9 + 23)
    assert answer_of("longer", {"size": 56, "a": [2, 30], "b": [2, 10]}) == "A"


# -- messages and reward ---------------------------------------------------------------------
def test_first_messages_carry_the_png_and_the_question():
    env = VisualEnv(task="count", system_prompt="Answer with one number.")
    t = _first(env, "eval")
    sys_msg, user = env.first_messages(t)
    assert sys_msg == {"role": "system", "content": "Answer with one number."}
    assert user["role"] == "user"
    img_part, text_part = user["content"]
    assert text_part == {"type": "text", "text": "How many shapes are in the image?"}
    assert img_part["type"] == "image_url"
    url = img_part["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    raw = base64.b64decode(url.split(",", 1)[1])
    assert raw == png_bytes(t)
    decoded = Image.open(io.BytesIO(raw))
    assert decoded.format == "PNG" and decoded.convert("RGB").tobytes() == draw("count", t["params"]).tobytes()
    assert [m["role"] for m in VisualEnv(task="count").first_messages(t)] == ["user"]
    assert json.loads(json.dumps(t)) == t  # tasks are plain JSON


@pytest.mark.parametrize("reply,score", [
    ("3", 1.0), ("3<|im_end|>", 1.0), ("  3 \n", 1.0), ("3<|endoftext|>", 1.0),
    ("33", 0.0), ("three", 0.0), ("", 0.0), ("4", 0.0), ("3.", 0.0),
])
def test_exact_binary_reward(reply, score):
    env = VisualEnv(task="count")
    task = {"task": "count", "params": {}, "question": "q", "answer": "3"}
    r = env.step(reply, EpisodeState(task=task))
    assert (r.reward, r.score, r.terminated) == (score, score, True)


def test_reward_weight_scales_reward_not_score():
    env = VisualEnv(task="longer", reward_weight=0.5)
    r = env.step("A", EpisodeState(task={"answer": "A"}))
    assert (r.reward, r.score) == (0.5, 1.0)


# -- held-out split --------------------------------------------------------------------------
@pytest.mark.parametrize("task", ["count", "digit", "longer"])
def test_eval_split_disjoint_from_train_by_params_and_pixels(task):
    env = VisualEnv(task=task, eval_size=256)
    ev = list(env.tasks("eval", 0))
    tr = list(itertools.islice(env.tasks("train", 0), 3000))
    assert len(ev) == 256 and len({_key(t["params"]) for t in ev}) == 256  # distinct held-out tasks
    assert not {_key(t["params"]) for t in ev} & {_key(t["params"]) for t in tr}
    ev_px = {draw(task, t["params"]).tobytes() for t in ev}
    assert len(ev_px) == 256  # distinct params draw distinct images
    assert not ev_px & {draw(task, t["params"]).tobytes() for t in tr}
    assert {t["answer"] for t in tr} == {"count": {"1", "2", "3", "4"}, "digit": set("0123456789"),
                                          "longer": {"A", "B"}}[task]
    assert ev == list(env.tasks("eval", 0))  # the held-out split is fixed for a seed


def test_train_skips_held_out_params_when_the_generator_hits_them():
    # a small problem space (16x16 'longer': a few thousand parameter sets): the raw train
    # generator draws held-out parameters, and the train split must drop exactly those
    env = VisualEnv(task="longer", image_size=16, eval_size=400)
    held = {_key(t["params"]) for t in env.tasks("eval", 0)}
    rng = random.Random(0)
    raw = [sample_params(rng, env.options) for _ in range(2000)]
    hits = sum(_key(p) in held for p in raw)
    assert hits > 0  # the fault the skip guards against does occur here
    tr = list(itertools.islice(env.tasks("train", 0), 2000 - hits))
    assert [t["params"] for t in tr] == [p for p in raw if _key(p) not in held]


def test_seed_option_overrides_run_seed():
    a = VisualEnv(task="digit", seed=5)
    assert _first(a, "eval", seed=0) == _first(a, "eval", seed=123) == _first(VisualEnv(task="digit"), "eval", seed=5)


# -- options -----------------------------------------------------------------------------------
def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match=r"agent\.options\.task"):
        VisualEnv(task="colour")
    with pytest.raises(ValueError, match=r"max_count"):
        VisualEnv(task="count", image_size=16, shape_size=8, max_count=4)
    with pytest.raises(ValueError, match=r"agent\.options\.image_size"):
        VisualEnv(image_size=8)
    with pytest.raises(ValueError, match=r"eval_size"):
        next(VisualEnv(task="digit", image_size=16, eval_size=1000).tasks("eval", 0))  # 10 digits x 88 positions
    with pytest.raises(ValueError, match=r"split must be"):
        next(VisualEnv().tasks("test", 0))
    assert VisualOptions(image_size=28).side() == 4


def test_registered_as_builtin_env():
    from molt_core.plugins import load_plugins

    assert load_plugins().get("envs", "visual") is VisualEnv
