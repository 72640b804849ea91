"""The transformers engine with images (builtin:tiny-qwen2.5-vl): logprobs equal a direct HF
forward with the images (positions from the model's own get_rope_index), batching with text
rows, identical ids with different images, a weight swap mid-generation, refusals."""

from __future__ import annotations

import asyncio
import os
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from molt_core.engines.transformers_engine import TransformersEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.sampling import processed_logprobs
from molt_core.types import SamplingParams
from molt_core.vision import expand_placeholders, load_vision_processor, pixel_inputs
from tests.test_vision import VL, png

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(VL)


@pytest.fixture(scope="module")
def vp(tok):
    return load_vision_processor(VL, tok)


@pytest.fixture(scope="module")
def eng():
    e = TransformersEngine(VL, max_batch_size=8)
    yield e
    e.close()


def prompt(tok, vp, text: str, images: list[bytes]) -> list[int]:
    content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in images]
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return expand_placeholders(ids, images, vp)[0]


def direct_logprobs(model, vp, ids, images, out, sp) -> torch.Tensor:
    """The oracle: one unpadded HF forward over prompt + completion; the model computes its own
    M-RoPE positions from ``mm_token_type_ids`` (no engine code involved)."""
    full = torch.tensor([ids + out.token_ids])
    kw = {}
    if images:
        pv, thw = pixel_inputs(images, vp)
        kw = dict(pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(full == vp.image_token_id).int())
    with torch.no_grad():
        logits = model(input_ids=full, **kw).logits[0, len(ids) - 1:-1]
    lp = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
    return lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]


def test_engine_logprobs_equal_a_direct_forward_with_images(eng, tok, vp):
    red, green = png(28, 28, (220, 20, 20)), png(28, 28, (20, 220, 20))
    cases = [
        ("How many shapes?", [red]),
        ("How many shapes?", [green]),  # same ids as the first: must not share its prefill row
        ("Which line is longer?", [png(56, 42), png(40, 30, (0, 0, 0))]),
        ("What is 2 + 3?", []),
        ("Say hello to Alice.", []),
    ]
    prompts = [prompt(tok, vp, t, im) for t, im in cases]
    assert prompts[0] == prompts[1]
    params = [SamplingParams(temperature=[1.0, 1.0, 0.7, 0.0, 1.3][i], top_k=[-1, 50, -1, -1, 20][i],
                             max_tokens=12, seed=10 + i) for i in range(len(cases))]
    eng.prefix_cache.clear()

    async def go():
        return await asyncio.gather(*[eng.generate(p, sp, images=im or None)
                                      for p, sp, (_, im) in zip(prompts, params, cases)])

    outs = asyncio.run(go())
    assert all(o.token_ids and o.prompt_len == len(p) for o, p in zip(outs, prompts))
    worst = 0.0
    for (text, im), p, o, sp in zip(cases, prompts, outs, params):
        ref = direct_logprobs(eng.model, vp, p, im, o, sp)
        worst = max(worst, (ref - torch.tensor(o.logprobs)).abs().max().item())
    assert worst <= 1e-5
    # the red and green rows saw different images: their first-token distributions differ
    with torch.no_grad():
        a = direct_logprobs(eng.model, vp, prompts[0], [red], outs[1], params[1])
        b = direct_logprobs(eng.model, vp, prompts[1], [green], outs[1], params[1])
    assert (a - b).abs().max().item() > 1e-4
    # alone == batched (the image rows are exact under padding and batching)
    alone = asyncio.run(eng.generate(prompts[2], params[2], images=cases[2][1]))
    assert alone.token_ids == outs[2].token_ids
    assert max(abs(x - y) for x, y in zip(alone.logprobs, outs[2].logprobs)) <= 1e-5
    # image prompts stay out of the prefix cache (it is keyed by ids alone)
    assert all(tuple(ids[:len(prompts[0])]) != tuple(prompts[0]) for ids, _, _ in eng.prefix_cache._entries.values())


def test_multi_turn_image_prompt_after_a_text_turn_uses_no_stale_prefix(eng, tok, vp):
    """A text conversation is cached; its next turn adds an image: the cache must not be used
    for the image prompt and logprobs stay exact."""
    sp = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
    first = prompt(tok, vp, "Hello there.", [])
    o1 = asyncio.run(eng.generate(first, sp))
    img = png(28, 28)
    tail = tok.encode("<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                      "<|im_start|>assistant\n")
    nxt = first + o1.token_ids + expand_placeholders(tail, [img], vp)[0]
    hits = eng.prefix_cache.hits
    o2 = asyncio.run(eng.generate(nxt, sp, images=[img]))
    assert eng.prefix_cache.hits == hits
    ref = direct_logprobs(eng.model, vp, nxt, [img], o2, sp)
    assert (ref - torch.tensor(o2.logprobs)).abs().max().item() <= 1e-5


def test_refusals(eng, tok, vp):
    img = png(28, 28)
    ids = prompt(tok, vp, "Count", [img])
    with pytest.raises(ValueError, match="hold image tokens .* but no images"):
        asyncio.run(eng.generate(ids, SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="1 image token run.*but 2 image"):
        asyncio.run(eng.generate(ids, SamplingParams(max_tokens=2), images=[img, img]))
    with pytest.raises(ValueError, match="run has 4 tokens but its grid \\[1, 8, 8\\] gives 16"):
        asyncio.run(eng.generate(ids, SamplingParams(max_tokens=2), images=[png(56, 56)]))
    text = TransformersEngine(load_model("builtin:tiny-qwen3"), load_tokenizer("builtin:tiny-qwen3"))
    try:
        with pytest.raises(ValueError, match="not a vision-language model"):
            asyncio.run(text.generate([1, 2, 3], SamplingParams(max_tokens=2), images=[img]))
    finally:
        text.close()
    bare = TransformersEngine(load_model(VL), tok)  # a model object without its processor
    try:
        with pytest.raises(ValueError, match="no vision processor"):
            asyncio.run(bare.generate(ids, SamplingParams(max_tokens=2), images=[img]))
    finally:
        bare.close()


def test_weight_swap_mid_generation_with_images(tok, vp):
    model = load_model(VL, seed=0)
    new_sd = {k: v.clone() for k, v in load_model(VL, seed=1).state_dict().items()}
    eng = TransformersEngine(model, tok, eos_token_ids=[], vision_processor=vp)
    reached = threading.Event()
    calls = [0]

    def hook(mod, args, kwargs):
        calls[0] += 1
        if calls[0] == 4:
            eng.pause()
            reached.set()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)

    def swapper():
        assert reached.wait(30)
        eng.load_weights(new_sd, 1)
        eng.resume()

    img = png(42, 28)
    ids = prompt(tok, vp, "Which is longer?", [img])
    sp = SamplingParams(max_tokens=10, seed=3)

    async def go():
        task = asyncio.create_task(eng.generate(ids, sp, images=[img]))
        await asyncio.to_thread(swapper)
        return await task

    try:
        out = asyncio.run(go())
    finally:
        handle.remove()
        eng.close()
    assert out.versions == [0] * 4 + [1] * 6
    for version, seed in ((0, 0), (1, 1)):
        ref = direct_logprobs(load_model(VL, seed=seed), vp, ids, [img], out, sp)
        idx = [i for i, v in enumerate(out.versions) if v == version]
        assert max(abs(out.logprobs[i] - float(ref[i])) for i in idx) <= 1e-5, version
