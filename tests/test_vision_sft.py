"""SFT with images (builtin:tiny-qwen2.5-vl): prompts render and expand as the ledger does, and
a warm start on an image-only task (the answer is the image's colour) learns it."""

from __future__ import annotations

import copy

import pytest
import torch

from molt_plugins.vision.images import image_part
from molt_core.models import load_model
from molt_core.train.sft import render_example, render_with_images, sft
from molt_core.train import Trainer
from molt_plugins.vision.processor import load_vision_processor
from tests.test_vision import VL, png
from trainer_utils import tiny_cfg

COLOURS = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230)}


def colour_example(name: str, size: int = 28):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Which colour?"}, image_part(png(size, size, COLOURS[name]))]}]
    return msgs, name


def test_render_with_images_equals_the_ledger(vl_tok):
    from molt_core.ledger import Ledger

    vp = load_vision_processor(VL, vl_tok)
    msgs, answer = colour_example("red", 56)
    p, c, images = render_with_images(vl_tok, vp, msgs, answer)
    prep = Ledger(vl_tok, vision=vp).prepare(msgs)
    assert p == prep.prompt_ids and images == prep.images == [png(56, 56, COLOURS["red"])]
    assert p.count(vp.image_token_id) == 16  # 56x56 -> grid 1x8x8 -> 16 tokens
    assert c == vl_tok.encode("red", add_special_tokens=False) + [vl_tok.convert_tokens_to_ids("<|im_end|>")]
    # a text prompt is render_example's, no images
    text = [{"role": "user", "content": "hi"}]
    assert render_with_images(vl_tok, vp, text, "yo") == (*render_example(vl_tok, text, "yo"), [])
    with pytest.raises(ValueError, match="not a vision-language model"):
        render_with_images(vl_tok, None, msgs, answer)


def test_sft_on_images_learns_the_colour(vl_tok):
    """Text is identical across examples; only the image tells the answer. After SFT the
    completion's mean logprob under the right image beats the wrong one's on every colour."""
    model = load_model(VL, seed=0)
    cfg = tiny_cfg(model={"path": VL}, trainer={"micro_batch_size": 6})
    tr = Trainer(cfg, model=copy.deepcopy(model), tokenizer=vl_tok)
    examples = [colour_example(n) for n in COLOURS for _ in range(2)]
    losses = sft(tr, examples, steps=40, batch_size=6, lr=3e-3, seed=0)
    assert losses[-1] < 0.1 * losses[0]
    vp = load_vision_processor(VL, vl_tok)
    from molt_plugins.vision.processor import padded_inputs

    def score(m, shown: str, answer: str) -> float:
        p, c, images = render_with_images(vl_tok, vp, colour_example(shown)[0], answer)
        ids = p + c
        kw = padded_inputs(m, vp, [(ids, images)], len(ids))
        with torch.no_grad():
            lp = torch.log_softmax(m(input_ids=torch.tensor([ids]), **kw).logits[0].float(), -1)
        return float(sum(lp[len(p) - 1 + j, t] for j, t in enumerate(c)) / len(c))

    tuned = tr.model.eval()
    for shown in COLOURS:
        right = score(tuned, shown, shown)
        wrong = max(score(tuned, shown, other) for other in COLOURS if other != shown)
        assert right > wrong + 1.0, (shown, right, wrong)
    # weights moved, and the vision tower learned too (the text is the same in every example)
    before = dict(model.named_parameters())
    moved = {n for n, p in tuned.named_parameters() if not torch.equal(p.detach(), before[n].detach())}
    assert any(n.startswith("model.visual.") for n in moved)


def test_sft_rows_may_carry_image_parts(vl_tok):
    from molt_core.train.sft import examples_from_rows

    msgs, answer = colour_example("blue")
    rows = [{"prompt": msgs, "completion": answer},
            {"messages": msgs + [{"role": "assistant", "content": answer}]}]
    ex = examples_from_rows(rows)
    assert ex == [(msgs, "blue"), (msgs, "blue")]
    vp = load_vision_processor(VL, vl_tok)
    p, c, images = render_with_images(vl_tok, vp, *ex[0])
    assert p.count(vp.image_token_id) == 4 and len(images) == 1
    with pytest.raises(ValueError, match="assistant message's content must be a string"):
        examples_from_rows([{"messages": msgs + [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}])
    with pytest.raises(ValueError, match="must be a list of"):
        examples_from_rows([{"prompt": [{"role": "user", "content": [{"type": "audio"}]}], "completion": "x"}])
