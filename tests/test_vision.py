"""molt_plugins.vision.processor: placeholder expansion, pixel inputs and 3D positions for the builtin tiny
Qwen2.5-VL model, checked against hand-computed grids and transformers' own processor."""

from __future__ import annotations

import io

import pytest
import torch

from molt_core.models import load_model, load_tokenizer
from molt_plugins.vision.processor import (
    TINY_VL_MAX_PIXELS,
    check_runs,
    expand_placeholders,
    image_runs,
    image_sha256,
    load_vision_processor,
    pixel_inputs,
    rope_positions,
)

VL = "builtin:tiny-qwen2.5-vl"


def png(w: int, h: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """Encoded PNG bytes of a ``w`` x ``h`` image with a diagonal line (so pixels vary)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), color)
    ImageDraw.Draw(img).line([(0, 0), (w - 1, h - 1)], fill=(0, 0, 255), width=2)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def hf_processor(vl_vp, vl_tok):
    """transformers' ``Qwen2_5_VLProcessor`` over our image processor and tokenizer: the oracle.
    (Its video processor needs torchvision, so this subclass registers image + tokenizer only.)"""
    from transformers import Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnly(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kw):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnly(image_processor=vl_vp.image_processor, tokenizer=vl_tok)


def test_tokenizer_has_vision_tokens_after_the_512_entries(vl_tok):
    assert vl_tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]) == [
        512, 513, 514, 515]
    assert len(vl_tok) == 516
    # text ids are those of the text tokenizer
    assert vl_tok.encode("What is 2 + 3?") == load_tokenizer("builtin:tiny-qwen3").encode("What is 2 + 3?")


def test_chat_template_renders_one_placeholder_per_image_part(vl_tok):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "How many?"}, part]}]
    text = vl_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nHow many?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                    "<|im_start|>assistant\n")
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "input_image"}]}]
    assert vl_tok.apply_chat_template(two, tokenize=False).count("<|image_pad|>") == 2
    # the text model's template ignores image parts
    assert "<|image_pad|>" not in load_tokenizer("builtin:tiny-qwen3").apply_chat_template(msgs, tokenize=False)


# (width, height) -> grid [t, h, w] by Qwen2-VL's smart_resize with factor 14 = patch 7 * merge 2,
# min 14*14, max 56*56 pixels:
#   28x28 -> 28x28 -> [1, 4, 4] -> 16 / 4 = 4 tokens
#   56x56 -> 56x56 -> [1, 8, 8] -> 16 tokens
#   40x30 -> h round(30/14)*14 = 28, w round(40/14)*14 = 42 -> [1, 4, 6] -> 6 tokens
#   10x10 -> 14x14 (the minimum) -> [1, 2, 2] -> 1 token
#   200x100 -> 20000 > 3136: beta = sqrt(20000/3136) = 2.525; h floor(100/2.525/14)*14 = 28,
#             w floor(200/2.525/14)*14 = 70 -> [1, 4, 10] -> 10 tokens
@pytest.mark.parametrize("size,grid,n", [((28, 28), [1, 4, 4], 4), ((56, 56), [1, 8, 8], 16),
                                        ((40, 30), [1, 4, 6], 6), ((10, 10), [1, 2, 2], 1),
                                        ((200, 100), [1, 4, 10], 10)])
def test_placeholder_count_is_thw_over_merge_squared(vl_vp, vl_tok, size, grid, n):
    img = png(*size)
    ids = vl_tok.encode("a<|vision_start|><|image_pad|><|vision_end|>b")
    out, refs = expand_placeholders(ids, [img], vl_vp, offset=5)
    assert len(refs) == 1 and refs[0].grid_thw == grid and refs[0].sha256 == image_sha256(img)
    assert len(out) == len(ids) - 1 + n
    s = ids.index(vl_vp.image_token_id)
    assert (refs[0].start, refs[0].end) == (5 + s, 5 + s + n)
    assert out[s:s + n] == [vl_vp.image_token_id] * n and out[s + n] == vl_tok.convert_tokens_to_ids("<|vision_end|>")
    pv, thw = pixel_inputs([img], vl_vp)
    assert thw.tolist() == [grid] and pv.shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 7 * 7)
    assert 56 * 56 == TINY_VL_MAX_PIXELS


def test_expansion_equals_the_hf_processor(vl_vp, vl_tok):
    imgs = [png(40, 30), png(56, 56, (10, 200, 10)), png(28, 28)]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Count"}, {"type": "image"}, {"type": "image"}]},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and now?"}]}]
    text = vl_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = vl_tok.encode(text)
    ours, refs = expand_placeholders(ids, imgs, vl_vp)
    from PIL import Image

    oracle = hf_processor(vl_vp, vl_tok)(text=[text], images=[Image.open(io.BytesIO(b)).convert("RGB") for b in imgs],
                                   return_tensors="pt")
    assert ours == oracle["input_ids"][0].tolist()
    assert [r.grid_thw for r in refs] == oracle["image_grid_thw"].tolist() == [[1, 4, 6], [1, 8, 8], [1, 4, 4]]
    assert [(r.start, r.end) for r in refs] == image_runs(ours, vl_vp.image_token_id)
    pv, thw = pixel_inputs(imgs, vl_vp)
    assert torch.equal(pv, oracle["pixel_values"].float()) and torch.equal(thw, oracle["image_grid_thw"])


def test_expand_refuses_a_count_mismatch_and_bad_bytes(vl_vp, vl_tok):
    ids = vl_tok.encode("<|image_pad|> and <|image_pad|>")
    with pytest.raises(ValueError, match="2 image placeholder.*but 1 image"):
        expand_placeholders(ids, [png(28, 28)], vl_vp)
    with pytest.raises(ValueError, match="could not be decoded"):
        expand_placeholders(ids, [b"not an image", b"\x89PNG"], vl_vp)


def test_check_runs_flags_wrong_length_and_shifted_refs(vl_vp, vl_tok):
    ids, refs = expand_placeholders(vl_tok.encode("x<|image_pad|>y"), [png(28, 28)], vl_vp)
    check_runs(ids, [refs[0].grid_thw], vl_vp, refs)  # clean
    with pytest.raises(ValueError, match="run has 3 tokens but its grid"):
        check_runs(ids[:2] + ids[3:], [refs[0].grid_thw], vl_vp)
    shifted = refs[0].model_copy(update={"start": refs[0].start + 1, "end": refs[0].end + 1})
    with pytest.raises(ValueError, match=r"records tokens \[2, 6\) but the image run is at \[1, 5\)"):
        check_runs(ids, [refs[0].grid_thw], vl_vp, [shifted])


def test_rope_positions_by_hand(vl_vp, vl_tok):
    # [t0, t1, <4 image tokens of grid 1x4x4 -> 2x2 merged>, t2, t3]: text 0, 1; the image takes
    # t = 2, h = 2 + [0, 0, 1, 1], w = 2 + [0, 1, 0, 1]; text resumes at 2 + max(2, 2) = 4.
    ids, refs = expand_placeholders([10, 11, vl_vp.image_token_id, 12, 13], [png(28, 28)], vl_vp)
    model = load_model(VL)
    pos, delta = rope_positions(model, ids, [r.grid_thw for r in refs], vl_vp)
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    assert delta == 6 - 8
    text, d0 = rope_positions(model, [1, 2, 3], [], vl_vp)
    assert text.tolist() == [[0, 1, 2]] * 3 and d0 == 0


def test_text_builtins_have_no_vision_processor():
    assert load_vision_processor("builtin:tiny-qwen3") is None


def test_a_saved_vl_directory_loads_back_with_its_processor(tmp_path, vl_tok, vl_vp):
    """A real VL model is a directory: config with a vision_config (AutoModelForImageTextToText),
    preprocessor_config.json, tokenizer with <|image_pad|>."""
    from molt_plugins.vision.processor import tiny_image_processor

    model = load_model(VL)
    model.save_pretrained(tmp_path)
    vl_tok.save_pretrained(tmp_path)
    tiny_image_processor().save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    vp2 = load_vision_processor(str(tmp_path))
    assert type(again).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert (vp2.image_token_id, vp2.merge_size) == (514, 2)
    img = png(40, 30)
    ids, refs = expand_placeholders(vl_tok.encode("a<|image_pad|>b"), [img], vp2)
    assert refs[0].grid_thw == [1, 4, 6]
    pv, thw = pixel_inputs([img], vp2)
    x = torch.tensor([ids])
    kw = dict(pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=(x == 514).int())
    with torch.no_grad():
        assert torch.equal(model(input_ids=x, **kw).logits, again(input_ids=x, **kw).logits)


def test_processed_image_cache_is_bounded_in_bytes(vl_tok):
    """The pixel cache is bounded by bytes as well as by count: a 28x28 image is 16 patch rows
    of 3 * 2 * 7 * 7 = 294 float32 (16 * 294 * 4 = 18,816 bytes); with a 40,000-byte budget two
    fit, a third evicts the oldest, and an image over the budget (56x56: 64 rows, 75,264 bytes)
    is processed but not kept."""
    from molt_plugins.vision.processor import VisionProcessor, tiny_image_processor

    vl_vp = VisionProcessor(tiny_image_processor(), 514, 2, cache_bytes=40_000)
    a, b, c = png(28, 28, (1, 0, 0)), png(28, 28, (2, 0, 0)), png(28, 28, (3, 0, 0))
    assert vl_vp.process(a)[0].shape == (16, 294)
    vl_vp.process(b)
    assert vl_vp.cached_bytes == 2 * 18_816 and len(vl_vp._cache) == 2
    vl_vp.process(c)
    assert vl_vp.cached_bytes == 2 * 18_816 and list(vl_vp._cache) == [image_sha256(b), image_sha256(c)]
    big = vl_vp.process(png(56, 56))
    assert big[0].shape == (64, 294) and big[1] == [1, 8, 8]
    assert vl_vp.cached_bytes == 2 * 18_816 and len(vl_vp._cache) == 2
    vl_vp.clear_cache()
    assert vl_vp.cached_bytes == 0 and not vl_vp._cache
