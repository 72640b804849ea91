"""A Qwen3-VL model brought as a local Hugging Face directory (docs/vision.md, "Bring a real VL
model"): a tiny random ``Qwen3VLForConditionalGeneration`` saved with the tiny VL tokenizer and
a Qwen2-VL-style image processor with Qwen3-VL's geometry (patch 8 here, merge 2; the real
checkpoints use patch 16) loads through the same paths as a real checkpoint -- the
transformers engine, the loopback server's ledger and the trainer -- and a two-turn image
ChatAgent rollout through the stock OpenAI SDK is token-exact with the trainer's recompute
equal to the engine's logprobs (<= 1e-5, float32).

Run lengths by hand: the processor resizes to multiples of patch * merge = 16 px, one token per
16x16 block: 28x28 -> 32x32 -> grid [1, 4, 4] -> 4 tokens; 42x28 -> 48x32 -> [1, 4, 6] -> 6.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from molt_core.identity import TokenCheck, check_tokens
from molt_core.testing import run_episode

PAD = 514


def tiny_qwen3vl(tok):
    """A tiny random ``Qwen3VLForConditionalGeneration`` (interleaved M-RoPE) on ``tok``'s vision
    tokens, and its Qwen2-VL-style image processor (patch 8, merge 2)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    names = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(names)))
    text = dict(vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=384, max_position_embeddings=1024,
                rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, in_channels=3, patch_size=8,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=True, **ids)).eval()
    return model, Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2,
                                           min_pixels=16 * 16, max_pixels=64 * 64)


@pytest.fixture(scope="module")
def qwen3vl_dir(tmp_path_factory, vl_tok):
    model, processor = tiny_qwen3vl(vl_tok)
    d = tmp_path_factory.mktemp("qwen3vl")
    model.save_pretrained(d)
    vl_tok.save_pretrained(d)
    processor.save_pretrained(d)
    return str(d)


def test_a_qwen3_vl_directory_rollout_is_token_exact_and_recomputes_exactly(qwen3vl_dir):
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.models import load_model, vision_token_ids
    from molt_core.train import Trainer, build_batch
    from test_vision_chat_agent import BLUE, RED, ImageAgent
    from trainer_utils import tiny_cfg

    engine = TransformersEngine(qwen3vl_dir, seed=0)
    try:
        assert type(engine.model).__name__ == "Qwen3VLForConditionalGeneration"
        assert engine.vision_processor.merge_size == 2 and engine.vision_processor.image_token_id == PAD
        assert vision_token_ids(engine.model) == [512, 513, 514, 515]  # masked: never sampled
        agent = ImageAgent()
        (traj,) = run_episode(agent, {"prompt": "colours"}, engine=engine, max_tokens=6).trajectories
    finally:
        engine.close()
    assert traj.status == "ok", traj.error
    assert check_tokens(traj) == TokenCheck(0, 0)
    (seg,) = traj.segments
    assert [(r.end - r.start, r.grid_thw) for r in seg.images] == [(4, [1, 4, 4]), (6, [1, 4, 6])]
    assert all(seg.token_ids[r.start:r.end] == [PAD] * (r.end - r.start) for r in seg.images)
    assert seg.token_ids.count(PAD) == 10
    assert set(traj.images) == {hashlib.sha256(RED).hexdigest(), hashlib.sha256(BLUE).hexdigest()}
    # the sampled ids are the ones the OpenAI SDK returned
    assert [seg.token_ids[sp.start:sp.end] for sp in seg.spans] == [ids for ids, _ in agent.wire]
    tr = Trainer(tiny_cfg(model={"path": qwen3vl_dir}), model=load_model(qwen3vl_dir, seed=0),
                 tokenizer=engine.tokenizer)
    batch = build_batch([traj], tr.pad_id, tr.vocab_size, vision=tr.vision_processor)
    lp, _ = tr.recompute_logprobs(batch)
    diff = (lp - batch.behaviour_logprobs).abs()[batch.mask]
    assert diff.numel() == sum(sp.end - sp.start for sp in seg.spans) == 12
    assert float(diff.max()) <= 1e-5
