"""hf_teacher: vocabulary check naming both tokenizers; per-token logprobs equal an unbatched
forward; trajectory annotation in the trainer's info['teacher_logprobs'] format."""

from __future__ import annotations

import pytest
import torch

from molt_core.models import load_model, load_tokenizer
from molt_core.types import Segment, Trajectory
from molt_plugins.teachers.hf_teacher import HFTeacher, check_same_vocab

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def student_tok():
    return load_tokenizer("builtin:tiny-qwen3")


@pytest.fixture(scope="module")
def teacher(student_tok):
    return HFTeacher(student_tok, path="builtin:tiny-qwen3", seed=1, batch_size=2)


def test_vocab_mismatch_names_both(student_tok):
    big = load_tokenizer("builtin:tiny-qwen3-bigvocab")
    with pytest.raises(ValueError) as ei:
        check_same_vocab(big, student_tok)
    msg = str(ei.value)
    assert f"({big.name_or_path}, {len(big.get_vocab())} tokens)" in msg
    assert f"({student_tok.name_or_path}, {len(student_tok.get_vocab())} tokens)" in msg
    assert "id 0: teacher" in msg
    with pytest.raises(ValueError, match="differs from the student's"):
        HFTeacher(student_tok, path="builtin:tiny-qwen3-bigvocab")
    check_same_vocab(student_tok, load_tokenizer("builtin:tiny-qwen3"))  # same vocab: no error


def test_logprobs_equal_unbatched_forward(teacher, student_tok):
    seqs = [student_tok.encode("What is 23 + 45?"), student_tok.encode("68"), student_tok.encode("a longer one, with more tokens")]
    got = teacher.batch_token_logprobs(seqs)  # batch_size=2: a padded batch and a single
    ref = load_model("builtin:tiny-qwen3", seed=1)
    for s, g in zip(seqs, got):
        assert len(g) == len(s) and g[0] is None
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=torch.tensor([s])).logits[0].float(), -1)
        want = [float(lp[i - 1, s[i]]) for i in range(1, len(s))]
        assert g[1:] == pytest.approx(want, abs=1e-5)
        assert all(x <= 0 for x in g[1:])
    assert all(not p.requires_grad for p in teacher.model.parameters())


def test_trajectory_annotation_format(teacher, student_tok):
    ids = student_tok.encode("What is 2 + 2?4")
    n = len(ids)
    mask = [False] * (n - 1) + [True]
    seg = Segment(token_ids=ids, loss_mask=mask, logprobs=[None] * (n - 1) + [-0.5], versions=[None] * (n - 1) + [0])
    t = teacher.annotate(Trajectory(segments=[seg, seg], reward=1.0))
    tl = t.info["teacher_logprobs"]
    assert len(tl) == 2 and all(len(x) == n for x in tl)
    full = teacher.token_logprobs(ids)
    assert tl[0][:-1] == [None] * (n - 1) and tl[0][-1] == pytest.approx(full[-1], abs=1e-6)


def test_bad_input(teacher):
    with pytest.raises(ValueError, match="empty"):
        teacher.batch_token_logprobs([[]])
    with pytest.raises(ValueError, match=r"token id 99999 outside the teacher's vocabulary"):
        teacher.token_logprobs([1, 99999])
    with pytest.raises(ValueError, match=r"teacher.path: Field required"):
        HFTeacher(None)


def test_registered():
    from molt_core.plugins import load_plugins

    assert load_plugins().get("teachers", "hf_teacher") is HFTeacher


def test_vl_teacher_sees_the_rollout_images():
    """A vision-language teacher scores an image rollout with its images (pixels and 3D
    positions): with the policy's own weights (builtin:tiny-qwen2.5-vl, seed 0) its logprobs
    equal the engine's behaviour logprobs (T = 1, no filter) on every sampled token. Before,
    the teacher ran on the ids alone -- image tokens with no image -- and its logprobs differed
    (the fault below: the same ids scored without images)."""
    import asyncio
    import base64

    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.types import SampledSpan, SamplingParams
    from molt_plugins.vision.processor import expand_placeholders, image_sha256
    from tests.test_vision import VL, png

    tok = load_tokenizer(VL)
    eng = TransformersEngine(VL, seed=0)
    img = png(42, 28, (0, 0, 200))
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ids, refs = expand_placeholders(ids, [img], eng.vision_processor)
    try:
        out = asyncio.run(eng.generate(ids, SamplingParams(temperature=1.0, max_tokens=6, seed=4), images=[img]))
    finally:
        eng.close()
    P, n = len(ids), len(ids) + len(out.token_ids)
    seg = Segment(token_ids=ids + out.token_ids, loss_mask=[False] * P + [True] * len(out.token_ids),
                  logprobs=[None] * P + out.logprobs, versions=[None] * P + out.versions,
                  spans=[SampledSpan(start=P, end=n, temperature=1.0, top_k=-1, top_p=1.0)], images=refs)
    traj = Trajectory(rollout_id="r", group_id="g", reward=1.0, segments=[seg],
                      images={image_sha256(img): base64.b64encode(img).decode()})
    teacher = HFTeacher(tok, path=VL, seed=0)
    (lps,) = teacher.trajectory_logprobs(traj)
    got = torch.tensor([x for x in lps if x is not None])
    assert len(got) == len(out.token_ids)
    assert float((got - torch.tensor(out.logprobs)).abs().max()) <= 1e-5
    (blind,) = teacher.batch_token_logprobs([seg.token_ids])  # the fault: no images shown
    assert float((torch.tensor(blind[P:]) - torch.tensor(out.logprobs)).abs().max()) > 1e-3


def test_a_length_dependent_rope_teacher_scores_each_sequence_alone(tmp_path, student_tok):
    """Issue 24 (review): a longrope teacher (Phi-3.5 / Phi-4-mini style) picks its factors from
    the longest position of each forward, so a 6-token sequence batched with a 20-token one was
    rotated with the long factors (original_max_position_embeddings = 8) and scored differently
    than alone. Such a teacher now runs one sequence per forward: a sequence's logprobs are
    those of its own forward whatever it is batched with, bit for bit."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8, "factor": 4.0,
            "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}
    cfg = Qwen3Config(vocab_size=len(student_tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128, max_position_embeddings=32,
                      rope_parameters=rope)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "phi-like")
    student_tok.save_pretrained(tmp_path / "phi-like")
    teacher = HFTeacher(student_tok, path=str(tmp_path / "phi-like"), batch_size=16)
    short, long = list(range(10, 16)), list(range(30, 50))
    alone = teacher.batch_token_logprobs([short])[0]
    batched = teacher.batch_token_logprobs([short, long])
    assert len(alone) == 6 and alone[0] is None and all(x < 0 for x in alone[1:])
    assert batched[0] == alone and batched[1] == teacher.batch_token_logprobs([long])[0]
    assert teacher.batch_size == 1
