"""The trainer on image segments (builtin:tiny-qwen2.5-vl): ingress carries each segment's
images from ``Trajectory.images``; the recompute equals the engine's logprobs (<= 1e-5, fp32);
the forward-consistency metric flags a different image under the same placeholder run; ingress
refuses a shifted ImageRef and bytes that do not match their digest; a GRPO step moves the
vision tower."""

from __future__ import annotations

import asyncio
import base64
import copy

import pytest
import torch

from molt_core.engines.transformers_engine import TransformersEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.train import Trainer, build_batch
from molt_core.types import SampledSpan, SamplingParams, Segment, Trajectory
from molt_plugins.vision.processor import expand_placeholders, image_sha256, load_vision_processor
from tests.test_vision import VL, png
from trainer_utils import tiny_cfg

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup():
    """Engine rollouts: 2 prompts (one image each, a third image in the second) x 2 samples."""
    tok = load_tokenizer(VL)
    vp = load_vision_processor(VL, tok)
    model = load_model(VL, seed=0)
    eng = TransformersEngine(copy.deepcopy(model), tok, vision_processor=vp)
    prompts = [("How many?", [png(28, 28, (200, 0, 0))]),
               ("Which is longer?", [png(42, 28, (0, 0, 200)), png(28, 56, (0, 150, 0))])]
    jobs = []
    for g, (text, imgs) in enumerate(prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]
                                        + [{"type": "image"}] * len(imgs)}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids, refs = expand_placeholders(ids, imgs, vp)
        for k in range(2):
            jobs.append((g, k, ids, refs, imgs, SamplingParams(temperature=1.0, top_k=[-1, 40][k], max_tokens=8,
                                                               seed=10 * g + k)))

    async def go():
        return await asyncio.gather(*[eng.generate(ids, sp, images=imgs) for _, _, ids, _, imgs, sp in jobs])

    outs = asyncio.run(go())
    eng.close()
    return tok, vp, model, jobs, outs


def rollouts(jobs, outs, images=None) -> list[Trajectory]:
    """One Trajectory per generation; ``images`` overrides the bytes shown for every image."""
    out = []
    for (g, k, ids, refs, imgs, sp), o in zip(jobs, outs):
        shown = images or imgs
        refs = [r.model_copy(update={"sha256": image_sha256(b)}) for r, b in zip(refs, shown)]
        n, P = len(ids) + len(o.token_ids), len(ids)
        seg = Segment(token_ids=ids + o.token_ids, loss_mask=[False] * P + [True] * len(o.token_ids),
                      logprobs=[None] * P + o.logprobs, versions=[None] * P + o.versions,
                      spans=[SampledSpan(start=P, end=n, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)],
                      images=refs)
        out.append(Trajectory(rollout_id=f"r{g}{k}", group_id=f"g{g}", reward=float(k), segments=[seg],
                              images={image_sha256(b): base64.b64encode(b).decode() for b in shown}))
    return out


def trainer(model, tok, **trainer_kw):
    return Trainer(tiny_cfg(model={"path": VL}, trainer={"lr": 1e-3, **trainer_kw}), model=copy.deepcopy(model),
                   tokenizer=tok)


def test_recompute_on_image_segments_equals_the_engine(setup):
    tok, vp, model, jobs, outs = setup
    tr = trainer(model, tok)
    trajs = rollouts(jobs, outs)
    batch = build_batch(trajs, tr.pad_id, tr.vocab_size)
    assert [len(x) for x in batch.images] == [1, 1, 2, 2]
    lp, _ = tr.recompute_logprobs(batch)
    diff = (lp - batch.behaviour_logprobs).abs()[batch.mask]
    assert diff.numel() == sum(len(o.token_ids) for o in outs) and float(diff.max()) <= 1e-5
    m = tr.train_step(trajs)
    assert m["invariants/logprob_absdiff_max_onpolicy"] <= 1e-5
    assert m["ingress/refused_rollouts"] == 0.0


def test_a_different_image_under_the_same_run_is_flagged(setup):
    """The metadata is consistent (digest and bytes match, same grid), but the image is not the
    one the engine saw: only the forward-consistency metric can tell -- and it does."""
    tok, vp, model, jobs, outs = setup
    swapped = rollouts(jobs[:2], outs[:2], images=[png(28, 28, (255, 255, 0))])  # yellow, the engine saw red
    m = trainer(model, tok).train_step(swapped + rollouts(jobs[2:], outs[2:]))
    assert m["ingress/refused_rollouts"] == 0.0
    assert m["invariants/logprob_absdiff_max_onpolicy"] > 1e-3


def test_ingress_refuses_a_shifted_ref_and_mismatched_bytes(setup):
    tok, vp, model, jobs, outs = setup
    tr = trainer(model, tok)
    clean = rollouts(jobs, outs)
    shifted = copy.deepcopy(clean[0])
    r = shifted.segments[0].images[0]
    shifted.segments[0].images[0] = r.model_copy(update={"start": r.start + 1, "end": r.end + 1})
    with pytest.raises(ValueError, match=r"rollout r00, segment 0: images\[0\] records tokens"):
        build_batch([shifted], tr.pad_id, tr.vocab_size, vision=tr.vision_processor)
    forged = copy.deepcopy(clean[1])
    sha = forged.segments[0].images[0].sha256
    forged.images[sha] = base64.b64encode(png(28, 28, (255, 255, 0))).decode()  # other bytes, same key
    with pytest.raises(ValueError, match=r"rollout r01: images\[.*\] does not hash to its key"):
        build_batch([forged], tr.pad_id, tr.vocab_size)
    m = tr.train_step([shifted, forged] + clean[2:])
    assert m["ingress/refused_malformed"] == 2.0 and m["ingress/refused_rollouts"] == 2.0


def test_a_grpo_step_on_images_moves_the_vision_tower(setup):
    tok, vp, model, jobs, outs = setup
    tr = trainer(model, tok)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n.startswith("model.visual.")}
    m = tr.train_step(rollouts(jobs, outs))
    assert m["grad_norm"] > 0
    moved = [n for n, p in tr.model.named_parameters() if n in before and not torch.equal(p.detach(), before[n])]
    assert len(moved) > len(before) // 2


def test_async_stale_image_rows_are_measured_under_their_own_version(setup):
    """One step makes version 1; the same version-0 rollouts then arrive one version stale: the
    on-policy check recomputes 2 of the 4 rows (a row subset: images selected with their rows)
    under version 0's weights -> 0 diff."""
    tok, vp, model, jobs, outs = setup
    tr = Trainer(tiny_cfg(model={"path": VL}, trainer={"lr": 1e-2}, **{"async": {"max_staleness": 1, "onpolicy_rows": 2}}),
                 model=copy.deepcopy(model), tokenizer=tok)
    tr.train_step(rollouts(jobs, outs))
    assert tr.version == 1
    m = tr.train_step(rollouts(jobs, outs))
    assert m["invariants/staleness_max"] == 1.0 and m["invariants/onpolicy_stale_tokens"] > 0
    assert m["invariants/logprob_absdiff_max_onpolicy"] <= 1e-5
    assert m["invariants/logprob_absdiff_max"] > 1e-4  # the policy moved between the versions


def test_a_vl_checkpoint_is_a_model_path_with_its_processor(setup, tmp_path):
    """checkpoints/step-N/model/ holds the image processor too: it loads back as model.path
    (model, tokenizer and vision processor) and gives the trainer's logprobs."""
    from molt_core.train.checkpoint import save_checkpoint

    tok, vp, model, jobs, outs = setup
    tr = trainer(model, tok)
    tr.train_step(rollouts(jobs, outs))
    d = save_checkpoint(tr, tmp_path) / "model"
    again = Trainer(tiny_cfg(model={"path": str(d)}), tokenizer=load_tokenizer(str(d)))
    assert again.vision_processor is not None and again.vision_processor.image_token_id == 514
    batch = build_batch(rollouts(jobs, outs), tr.pad_id, tr.vocab_size)
    a, _ = tr.recompute_logprobs(batch)
    b, _ = again.recompute_logprobs(batch)
    assert torch.equal(a, b)


def test_ingress_refuses_a_grid_the_trainers_processor_does_not_give(setup):
    """The engine expanded each image with its processor and recorded the grid; a trainer whose
    processor gives another grid would feed other pixels and positions. Ingress compares the
    grid it computes with the recorded one and refuses the rollout (before: the record was only
    checked against the run length, and the forward raised mid-step)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from molt_plugins.vision.processor import VisionProcessor

    tok, vp, model, jobs, outs = setup
    tr = trainer(model, tok)
    clean = rollouts(jobs, outs)
    # the 28x56 image (width x height) is grid [1, 8, 4] (h = 56 / 7, w = 28 / 7): 8 tokens; the
    # transposed record [1, 4, 8] has the same run length, so only the grid comparison sees it
    flipped = copy.deepcopy(clean[2])
    r = flipped.segments[0].images[1]
    assert list(r.grid_thw) == [1, 8, 4]
    flipped.segments[0].images[1] = r.model_copy(update={"grid_thw": [1, 4, 8]})
    with pytest.raises(ValueError, match=r"images\[1\] records grid \[1, 4, 8\] but the trainer's image processor "
                                         r"gives \[1, 8, 4\]"):
        build_batch([flipped], tr.pad_id, tr.vocab_size, vision=tr.vision_processor)
    m = tr.train_step([flipped] + clean[:2])
    assert m["ingress/refused_malformed"] == 1.0
    # a trainer processor with a smaller pixel cap (28 x 28): every image shrinks; every rollout refused
    small = Qwen2VLImageProcessorPil(patch_size=7, merge_size=2, temporal_patch_size=2, min_pixels=14 * 14,
                                     max_pixels=28 * 28)
    tr.vision_processor = VisionProcessor(small, vp.image_token_id, 2)
    with pytest.raises(ValueError, match=r"images\[0\] records grid \[1, 4, 6\] but the trainer's image processor "
                                         r"gives \[1, 2, 4\]"):
        build_batch([clean[2]], tr.pad_id, tr.vocab_size, vision=tr.vision_processor)


def test_lora_reference_on_image_rows(setup):
    """LoRA with a KL term: the reference is the policy with its adapter disabled. It got no
    image inputs (its forward took only ids) and had no get_rope_index, so every step on image
    rollouts raised. Now its logprobs on image rows equal the base model's, and after a step
    moves the adapter the KL term is positive while the on-policy check stays clean."""
    pytest.importorskip("peft")
    tok, vp, model, jobs, outs = setup
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    tr = Trainer(tiny_cfg(model={"path": VL}, trainer={"lr": 1e-2, "lora": lora}, algo={"kl_coef": 0.05},
                          **{"async": {"max_staleness": 1}}), model=copy.deepcopy(model), tokenizer=tok)
    batch = build_batch(rollouts(jobs, outs), tr.pad_id, tr.vocab_size)
    m1 = tr.train_step(rollouts(jobs, outs))
    assert m1["invariants/logprob_absdiff_max_onpolicy"] <= 1e-5 and m1["loss/kl"] == 0.0
    ref, _ = tr.recompute_logprobs(batch, model=tr.ref_model)
    base, _ = trainer(model, tok).recompute_logprobs(batch)
    assert float((ref - base).abs()[batch.mask].max()) <= 1e-5
    pol, _ = tr.recompute_logprobs(batch)
    assert float((pol - base).abs()[batch.mask].max()) > 1e-4  # the adapter moved the policy
    m2 = tr.train_step(rollouts(jobs, outs))
    assert m2["loss/kl"] > 0.0
