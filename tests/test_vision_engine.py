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
from molt_plugins.vision.processor import expand_placeholders, pixel_inputs
from tests.test_vision import VL, png

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def eng():
    e = TransformersEngine(VL, max_batch_size=8)
    yield e
    e.close()


def prompt(vl_tok, vl_vp, text: str, images: list[bytes]) -> list[int]:
    content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in images]
    ids = vl_tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return expand_placeholders(ids, images, vl_vp)[0]


def direct_logprobs(model, vl_vp, ids, images, out, sp) -> torch.Tensor:
    """The oracle: one unpadded HF forward over prompt + completion; the model computes its own
    M-RoPE positions from ``mm_token_type_ids`` (no engine code involved)."""
    full = torch.tensor([ids + out.token_ids])
    kw = {}
    if images:
        pv, thw = pixel_inputs(images, vl_vp)
        kw = dict(pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(full == vl_vp.image_token_id).int())
    with torch.no_grad():
        logits = model(input_ids=full, **kw).logits[0, len(ids) - 1:-1]
    lp = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
    return lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]


def test_engine_logprobs_equal_a_direct_forward_with_images(eng, vl_tok, vl_vp):
    red, green = png(28, 28, (220, 20, 20)), png(28, 28, (20, 220, 20))
    cases = [
        ("How many shapes?", [red]),
        ("How many shapes?", [green]),  # same ids as the first: must not share its prefill row
        ("Which line is longer?", [png(56, 42), png(40, 30, (0, 0, 0))]),
        ("What is 2 + 3?", []),
        ("Say hello to Alice.", []),
    ]
    prompts = [prompt(vl_tok, vl_vp, t, im) for t, im in cases]
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
        ref = direct_logprobs(eng.model, vl_vp, p, im, o, sp)
        worst = max(worst, (ref - torch.tensor(o.logprobs)).abs().max().item())
    assert worst <= 1e-5
    # the red and green rows saw different images: their first-token distributions differ
    with torch.no_grad():
        a = direct_logprobs(eng.model, vl_vp, prompts[0], [red], outs[1], params[1])
        b = direct_logprobs(eng.model, vl_vp, prompts[1], [green], outs[1], params[1])
    assert (a - b).abs().max().item() > 1e-4
    # alone == batched (the image rows are exact under padding and batching)
    alone = asyncio.run(eng.generate(prompts[2], params[2], images=cases[2][1]))
    assert alone.token_ids == outs[2].token_ids
    assert max(abs(x - y) for x, y in zip(alone.logprobs, outs[2].logprobs)) <= 1e-5


def test_prefix_cache_with_images_reuses_exactly_and_never_across_a_different_image(vl_tok, vl_vp):
    """An agent's turns: text, then an image, then another image -- each turn reuses the last
    one's keys/values (the vision tower encodes only the new image); a prompt with the same ids
    but another image behind the run reuses only the ids before the run. Logprobs stay exact."""
    eng = TransformersEngine(VL, max_batch_size=4)
    encoded = []
    hook = eng.model.model.visual.register_forward_hook(lambda m, a, kw: encoded.append(int(a[0].shape[0])))
    sp = SamplingParams(temperature=1.0, max_tokens=5, seed=5)
    start = vl_tok.convert_tokens_to_ids("<|vision_start|>")
    try:
        ids = prompt(vl_tok, vl_vp, "Hello there.", [])
        out = asyncio.run(eng.generate(ids, sp))
        shown: list[bytes] = []
        for k, img in enumerate([png(28, 28), png(56, 28, (0, 0, 250))]):
            tail = vl_tok.encode("<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                              "<|im_start|>assistant\n")
            prev = ids + out.token_ids
            ids = prev + expand_placeholders(tail, [img], vl_vp)[0]
            shown.append(img)
            hits, reused, n_enc = eng.prefix_cache.hits, eng.prefix_cache.reused_tokens, len(encoded)
            out = asyncio.run(eng.generate(ids, sp, images=shown))
            assert eng.prefix_cache.hits == hits + 1
            assert eng.prefix_cache.reused_tokens - reused == len(prev) - 1  # all but the last sampled token
            assert encoded[n_enc:] == [[16, 32][k]]  # only the new image: 28x28 -> 16 patches, 56x28 -> 32
            ref = direct_logprobs(eng.model, vl_vp, ids, shown, out, sp)
            assert (ref - torch.tensor(out.logprobs)).abs().max().item() <= 1e-5
        # same ids, a different second image (same size): reuse stops at that image's run
        other = shown[:1] + [png(56, 28, (250, 250, 0))]
        hits, reused = eng.prefix_cache.hits, eng.prefix_cache.reused_tokens
        out2 = asyncio.run(eng.generate(ids, sp, images=other))
        run2 = [i for i, t in enumerate(ids) if t == vl_vp.image_token_id][-1] - 7  # 8 tokens in the 56x28 run
        assert ids[run2 - 1] == start and ids[run2] == vl_vp.image_token_id
        assert eng.prefix_cache.hits == hits + 1 and eng.prefix_cache.reused_tokens - reused == run2
        ref = direct_logprobs(eng.model, vl_vp, ids, other, out2, sp)
        assert (ref - torch.tensor(out2.logprobs)).abs().max().item() <= 1e-5
    finally:
        hook.remove()
        eng.close()


def test_prefix_cache_match_by_hand():
    from molt_core.engines.prefix_cache import PrefixCache

    kv = [(torch.zeros(1, 8, 2), torch.zeros(1, 8, 2))]
    pc = PrefixCache(1 << 20)
    # ids: 0 1 [9 9] 2 [9 9] 3 -- image runs at [2, 4) (sha a) and [5, 7) (sha b)
    ids = [0, 1, 9, 9, 2, 9, 9, 3]
    pc.put(ids, kv, [("a", 2, 4), ("b", 5, 7)])
    assert pc.match(ids + [4], [("a", 2, 4), ("b", 5, 7)])[0] == 8
    assert pc.match(ids + [4], [("a", 2, 4), ("c", 5, 7)])[0] == 5  # cut before the other image
    assert pc.match(ids + [4], [("c", 2, 4), ("b", 5, 7)])[0] == 2
    short = PrefixCache(1 << 20)  # an entry that ends inside a run never reuses part of it
    short.put(ids[:6], [(torch.zeros(1, 6, 2), torch.zeros(1, 6, 2))], [("a", 2, 4)])
    assert short.match(ids, [("a", 2, 4), ("b", 5, 7)])[0] == 5


def test_refusals(eng, vl_tok, vl_vp):
    img = png(28, 28)
    ids = prompt(vl_tok, vl_vp, "Count", [img])
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
    bare = TransformersEngine(load_model(VL), vl_tok)  # a model object without its processor
    try:
        with pytest.raises(ValueError, match="no vision processor"):
            asyncio.run(bare.generate(ids, SamplingParams(max_tokens=2), images=[img]))
    finally:
        bare.close()


def test_weight_swap_mid_generation_with_images(vl_tok, vl_vp):
    model = load_model(VL, seed=0)
    new_sd = {k: v.clone() for k, v in load_model(VL, seed=1).state_dict().items()}
    eng = TransformersEngine(model, vl_tok, eos_token_ids=[], vision_processor=vl_vp)
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
    ids = prompt(vl_tok, vl_vp, "Which is longer?", [img])
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
        ref = direct_logprobs(load_model(VL, seed=seed), vl_vp, ids, [img], out, sp)
        idx = [i for i, v in enumerate(out.versions) if v == version]
        assert max(abs(out.logprobs[i] - float(ref[i])) for i in idx) <= 1e-5, version


def test_vision_special_tokens_are_never_sampled(vl_tok, vl_vp):
    """A policy that would put nearly all its mass on ``<|image_pad|>`` (an image run with no
    image: the next prompt would have more image tokens than images) never samples it: the
    vision special tokens' logits are masked in the model the engine and the trainer share, and
    the behaviour logprobs are those of the masked distribution. Fault: the mask removed, the
    same engine samples ``<|image_pad|>``."""
    model = load_model(VL)
    head = model.get_output_embeddings()
    assert model.molt_vision_token_mask == [512, 513, 514, 515] == sorted(
        vl_tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]))

    def prefer_image_pad(_m, _i, out):  # runs before the mask: logit 50 on <|image_pad|>
        return out.index_fill(-1, torch.tensor([514]), 50.0)

    head.register_forward_hook(prefer_image_pad, prepend=True)
    img = png(28, 28)
    p = prompt(vl_tok, vl_vp, "How many shapes?", [img])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p[:3]])).logits
    assert (logits[..., [512, 513, 514, 515]] == -1e9).all()
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=s) for s in range(4)]

    def sample():
        e = TransformersEngine(model, tokenizer=vl_tok, vision_processor=vl_vp, max_batch_size=4)
        try:
            async def go():
                return await asyncio.gather(*[e.generate(p, sp, images=[img]) for sp in params])
            return asyncio.run(go())
        finally:
            e.close()

    outs = sample()
    assert all(t not in (512, 513, 514, 515) for o in outs for t in o.token_ids)
    for o, sp in zip(outs, params):
        ref = direct_logprobs(model, vl_vp, p, [img], o, sp)
        assert (ref - torch.tensor(o.logprobs)).abs().max().item() <= 1e-5
    model.molt_vision_token_mask_handle.remove()  # the fault: no mask
    outs = sample()
    assert sum(t == 514 for o in outs for t in o.token_ids) >= 20


def test_vision_token_mask_in_float16():
    """float16 logits cannot hold -1e9 (index_fill raised 'value cannot be converted to type
    c10::Half without overflow' on every forward of a VL model in float16 or under float16
    autocast): the mask uses float16's lowest finite value, -65504, whose probability is 0."""
    model = load_model(VL)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        auto = model(input_ids=ids).logits
    half = model.to(torch.float16)
    with torch.no_grad():
        direct = half(input_ids=ids).logits
    for logits in (auto, direct):
        assert logits.dtype == torch.float16
        assert (logits[..., [512, 513, 514, 515]] == -65504.0).all() and torch.isfinite(logits).all()
        p = logits.float().softmax(-1)
        assert (p[..., [512, 513, 514, 515]] == 0).all()
        assert torch.isfinite(torch.special.entr(p).sum(-1)).all()
