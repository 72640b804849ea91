"""LoRA through peft ([trainer.lora], molt_plugins.lora) and gradient checkpointing."""

from __future__ import annotations

import asyncio
import copy
import sys

import pytest
import torch

pytest.importorskip("peft")

from molt_core.config import ConfigError  # noqa: E402
from molt_core.cli.recipe import load_config  # noqa: E402
from molt_core.models import load_model, load_tokenizer  # noqa: E402
from molt_core.train import Trainer, build_batch  # noqa: E402
from molt_plugins.lora.adapter import base_state_dict, merged_state_dict  # noqa: E402
from molt_core.types import SampledSpan, Segment, Trajectory  # noqa: E402
from tests.trainer_utils import set_behaviour, synthetic_rollouts, tiny_cfg  # noqa: E402

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def base():
    return load_model("builtin:tiny-qwen3", seed=0), load_tokenizer("builtin:tiny-qwen3")


def make(base, lora=LORA, **sections) -> Trainer:
    model, tok = base
    tr = sections.setdefault("trainer", {})
    tr.setdefault("lr", 1e-2)
    if lora is not None:
        tr["lora"] = lora
    return Trainer(tiny_cfg(**sections), model=copy.deepcopy(model), tokenizer=tok)


def steps(tr: Trainer, n: int, start: int = 0) -> list[dict[str, float]]:
    out = []
    for s in range(start, start + n):
        trajs = synthetic_rollouts(s)
        set_behaviour(tr, trajs)
        out.append(tr.train_step(trajs))
    return out


def _adapter(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if ".lora_" in n}


def test_base_weights_bit_identical_adapter_learns(base):
    tr = make(base)
    base0 = {k: v.clone() for k, v in base_state_dict(tr.model).items()}
    ad0 = _adapter(tr)
    assert set(ad0) and all(p.requires_grad for n, p in tr.model.named_parameters() if ".lora_" in n)
    assert {id(p) for p in tr.params} == {id(p) for n, p in tr.model.named_parameters() if ".lora_" in n}
    ms = steps(tr, 3)
    assert all(m["grad_norm"] > 0 and m["train/skipped"] == 0 for m in ms)
    after = base_state_dict(tr.model)
    assert set(after) == set(base0) and all(torch.equal(after[k], base0[k]) for k in base0)
    ad1 = _adapter(tr)
    moved = [n for n in ad0 if not torch.equal(ad0[n], ad1[n])]
    assert len(moved) == len(ad0)  # every A and B moved (B from 0: A's grad is 0 only at step 1)
    assert all(float(ad0[n].abs().max()) == 0.0 for n in ad0 if ".lora_B." in n)  # B starts at zero


def test_merged_weights_are_base_names_and_w_plus_scaled_ba(base):
    tr = make(base)
    steps(tr, 2)
    merged = tr.weights()
    plain = base[0].state_dict()
    assert set(merged) == set(plain)  # the base model's own names: no base_model.model., no lora_*
    assert not [k for k in merged if "lora_" in k or "base_layer" in k or k.startswith("base_model")]
    name = "model.layers.1.self_attn.q_proj"
    layer = tr.model.get_base_model().get_submodule(name)
    W = layer.base_layer.weight.detach()
    A = layer.lora_A["default"].weight.detach()  # [r, in]
    B = layer.lora_B["default"].weight.detach()  # [out, r]
    assert A.shape == (4, 128) and B.shape[1] == 4 and float(B.abs().max()) > 0
    scale = 8 / 4  # alpha / r
    assert layer.scaling["default"] == 2.0
    assert torch.equal(merged[f"{name}.weight"], W + (B @ A) * scale)
    # an untargeted module is the base weight itself
    assert torch.equal(merged["model.layers.1.self_attn.k_proj.weight"],
                       tr.model.get_base_model().get_submodule("model.layers.1.self_attn.k_proj").weight)
    # the merged plain model computes what the adapted policy computes
    ref = copy.deepcopy(base[0])
    ref.load_state_dict(merged)
    ids = torch.tensor([[1, 17, 42, 99, 250, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=ids).logits, tr.model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_engine_logprobs_after_publish_equal_trainer_recompute(base):
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.types import SamplingParams

    model, tok = base
    tr = make(base)
    steps(tr, 2)  # the adapter is non-zero
    eng = TransformersEngine(copy.deepcopy(model), tok, max_batch_size=8, seed=0)
    prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + 3?"}],
                                                     add_generation_prompt=True, tokenize=False),
                             add_special_tokens=False) for a in range(3)]

    async def rollouts():
        sps = [SamplingParams(temperature=t, max_tokens=10, seed=i) for i, t in enumerate([1.0, 0.7, 1.3])]
        outs = await asyncio.gather(*[eng.generate(ids, sp) for ids, sp in zip(prompt_ids, sps)])
        return [Trajectory(rollout_id=f"r{i}", group_id="g", reward=float(i % 2), segments=[Segment(
            token_ids=ids + o.token_ids, loss_mask=[False] * len(ids) + [True] * len(o.token_ids),
            logprobs=[None] * len(ids) + o.logprobs, versions=[None] * len(ids) + o.versions,
            spans=[SampledSpan(start=len(ids), end=len(ids) + len(o.token_ids), temperature=sp.temperature)])])
            for i, (ids, sp, o) in enumerate(zip(prompt_ids, sps, outs))]

    try:
        assert tr.publish([eng]) == 2 and eng.version == 2
        trajs = asyncio.run(rollouts())
        batch = build_batch(trajs, tr.pad_id, tr.vocab_size)
        lp, _ = tr.recompute_logprobs(batch)
        diff = (lp - batch.behaviour_logprobs).abs()[batch.mask]
        assert diff.numel() > 0 and float(diff.max()) <= 1e-5
        m = tr.train_step(trajs)
        assert m["invariants/logprob_absdiff_max"] <= 1e-5
        # the fault: an engine left on the base weights disagrees
        eng.load_weights(base_state_dict(tr.model), tr.version)
        trajs = asyncio.run(rollouts())
        batch = build_batch(trajs, tr.pad_id, tr.vocab_size)
        lp, _ = tr.recompute_logprobs(batch)
        assert float((lp - batch.behaviour_logprobs).abs()[batch.mask].max()) > 1e-3
    finally:
        eng.close()


def test_reference_is_base_with_adapter_disabled(base):
    tr = make(base, algo={"kl_coef": 0.1})
    trajs = synthetic_rollouts(7)
    batch = build_batch(trajs, tr.pad_id, tr.vocab_size)
    ref0, _ = tr.recompute_logprobs(batch, model=tr.ref_model)
    ms = steps(tr, 3)
    assert ms[0]["kl"] == 0.0 and ms[-1]["kl"] > 0  # the policy leaves its reference
    ref1, _ = tr.recompute_logprobs(batch, model=tr.ref_model)
    pol, _ = tr.recompute_logprobs(batch)
    assert torch.equal(ref0, ref1)  # the reference stays the base
    assert float((pol - ref1).abs().max()) > 1e-4
    plain = Trainer(tiny_cfg(), model=copy.deepcopy(base[0]), tokenizer=base[1])  # the base, no adapter
    torch.testing.assert_close(plain.recompute_logprobs(batch)[0], ref1, atol=1e-6, rtol=0)
    assert list(tr.ref_model.parameters()) == []  # no copy of the weights


def test_sft_warm_start_trains_base_and_leaves_adapter(base):
    from molt_core.train.sft import sft

    tr = make(base, algo={"kl_coef": 0.1})
    base0 = {k: v.clone() for k, v in base_state_dict(tr.model).items()}
    ad0 = _adapter(tr)
    examples = [([{"role": "user", "content": f"What is {a} + 1?"}], str(a + 1)) for a in range(8)]
    losses = sft(tr, examples, steps=3, batch_size=4, lr=1e-2)
    assert len(losses) == 3 and losses[-1] < losses[0]
    after = base_state_dict(tr.model)
    assert any(not torch.equal(after[k], base0[k]) for k in base0)  # the base learnt
    assert all(torch.equal(v, _adapter(tr)[n]) for n, v in ad0.items())  # the adapter did not
    assert all(not p.requires_grad for n, p in tr.model.named_parameters() if ".lora_" not in n)  # frozen again
    assert all(p.grad is None for p in tr.model.parameters())
    # the reference is the warm-started base: KL 0 at the first RL step
    assert steps(tr, 1)[0]["kl"] == 0.0


def test_checkpoint_holds_adapter_and_merged_model_and_resumes_exactly(base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tr = make(base, algo={"kl_coef": 0.05})
    steps(tr, 2)
    ck = tr.save_checkpoint(tmp_path, {"cursor": 2})
    assert {p.name for p in ck.iterdir()} >= {"model", "base", "adapter", "trainer_state.pt", "state.json"}
    assert not (ck / "ref").exists()  # the reference is base/ with the adapter disabled
    merged = tr.weights()
    hf = AutoModelForCausalLM.from_pretrained(ck / "model")
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in merged.items())
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ck / "base"), ck / "adapter")
    ids = torch.tensor([[1, 5, 77, 300]])
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, tr.model(input_ids=ids).logits)

    tr2 = make(base, algo={"kl_coef": 0.05})
    assert tr2.load_checkpoint(ck) == {"cursor": 2}
    assert (tr2.step, tr2.version) == (2, 2)
    a, b = steps(tr, 2, start=2), steps(tr2, 2, start=2)
    for ma, mb in zip(a, b):
        assert ma["loss/total"] == mb["loss/total"] and ma["grad_norm"] == mb["grad_norm"]
    wa, wb = tr.weights(), tr2.weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoint_without_adapter_is_refused_by_a_lora_trainer(base, tmp_path):
    full = make(base, lora=None)
    ck = full.save_checkpoint(tmp_path, {})
    with pytest.raises(FileNotFoundError, match="not written by a LoRA run"):
        make(base).load_checkpoint(ck)


def _grads(tr: Trainer, batch) -> tuple[float, dict[str, torch.Tensor]]:
    tr.model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        lp, _ = tr._forward(tr.model, batch, slice(0, batch.size))
        loss = -(lp * batch.mask).sum() / batch.mask.sum()
        loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_gradient_checkpointing_same_loss_and_grads(base, lora):
    from transformers.modeling_layers import GradientCheckpointingLayer

    trajs = synthetic_rollouts(3)
    plain = make(base, lora=lora)
    ck = make(base, lora=lora, trainer={"gradient_checkpointing": True})
    batch = build_batch(trajs, plain.pad_id, plain.vocab_size)
    layers = [m for m in ck.model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 4 and all(m.gradient_checkpointing and m.training for m in layers)
    assert not any(m.training for m in ck.model.modules() if not isinstance(m, GradientCheckpointingLayer))
    calls = []
    for m in layers:  # count the checkpointed forwards (the fault: a layer that is not checkpointed)
        f = m._gradient_checkpointing_func
        m._gradient_checkpointing_func = lambda *a, _f=f, **k: calls.append(1) or _f(*a, **k)
    l0, g0 = _grads(plain, batch)
    l1, g1 = _grads(ck, batch)
    assert len(calls) == 4
    assert abs(l0 - l1) <= 1e-6 and set(g0) == set(g1) and len(g0) > 0
    assert max(float((g0[n] - g1[n]).abs().max()) for n in g0) <= 1e-6
    with torch.no_grad():  # no grad: the layers run as is
        calls.clear()
        ck.recompute_logprobs(batch)
        assert calls == []
    # a whole RL step with it agrees too
    set_behaviour(plain, trajs)
    m0, m1 = plain.train_step(trajs), ck.train_step(copy.deepcopy(trajs))
    assert abs(m0["loss/total"] - m1["loss/total"]) <= 1e-6 and abs(m0["grad_norm"] - m1["grad_norm"]) <= 1e-6


def test_lora_config_errors(base):
    with pytest.raises(ConfigError, match="trainer.lora.dropout.*only 0"):
        load_config("quickstart", ["trainer.lora.dropout=0.1"])
    with pytest.raises(ConfigError, match="trainer.lora.rank: unknown key"):
        load_config("quickstart", ["trainer.lora.rank=4"])
    cfg = load_config("quickstart", ["trainer.lora.r=4", "trainer.lora.alpha=8"])
    assert (cfg.trainer.lora.r, cfg.trainer.lora.alpha) == (4, 8.0)
    with pytest.raises(ConfigError, match="trainer.world_size = 2 is not supported"):
        load_config("quickstart", ["trainer.lora.r=4", "trainer.world_size=2"])
    assert load_config("quickstart", ["trainer.lora.r=4", "algo.advantage=\"gae\""]).algo.advantage == "gae"
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules = \['nope_proj'\]"):
        make(base, lora={"r": 2, "target_modules": ["nope_proj"]})


def test_gae_critic_beside_an_adapter_learns_and_resumes_exactly(base, tmp_path):
    """LoRA with a GAE critic (refused before): the critic is a copy of the plain decoder (no
    adapter layers; it copied the peft-wrapped one, adapters included, before) and trains every
    weight; the policy's base weights stay bit-identical while its adapter and the critic learn;
    a checkpoint holds critic/ and a resume continues bit for bit."""
    gae = {"advantage": "gae"}
    tr = make(base, algo=gae)
    names = [n for n, _ in tr.critic.named_parameters()]
    assert names and not [n for n in names if "lora_" in n or "base_layer" in n]
    assert all(p.requires_grad for p in tr.critic.parameters())
    dec0 = base[0].get_decoder().state_dict()
    assert all(torch.equal(v, dec0[k]) for k, v in tr.critic.backbone.state_dict().items())  # the initial decoder
    base0 = {k: v.clone() for k, v in base_state_dict(tr.model).items()}
    ad0, c0 = _adapter(tr), {n: p.detach().clone() for n, p in tr.critic.named_parameters()}
    ms = steps(tr, 2)
    assert all(m["critic/grad_norm"] > 0 and m["grad_norm"] > 0 for m in ms)
    assert all(torch.equal(v, base0[k]) for k, v in base_state_dict(tr.model).items())
    assert all(not torch.equal(v, _adapter(tr)[n]) for n, v in ad0.items())
    c1 = dict(tr.critic.named_parameters())
    assert not torch.equal(c1["head.weight"], c0["head.weight"])  # from zeros
    assert any(not torch.equal(c1[n], c0[n]) for n in c0 if n.startswith("backbone."))
    ck = tr.save_checkpoint(tmp_path, {})
    assert (ck / "critic").is_dir() and (ck / "adapter").is_dir()
    tr2 = make(base, algo=gae)
    tr2.load_checkpoint(ck)
    a, b = steps(tr, 1, start=2)[0], steps(tr2, 1, start=2)[0]
    assert (a["loss/total"], a["loss/value"], a["critic/grad_norm"]) == (b["loss/total"], b["loss/value"], b["critic/grad_norm"])
    # with gradient checkpointing the critic's decoder layers are checkpointed too
    from transformers.modeling_layers import GradientCheckpointingLayer

    ckpt = make(base, algo=gae, trainer={"gradient_checkpointing": True})
    layers = [m for m in ckpt.critic.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == 4 and all(m.gradient_checkpointing for m in layers)
    m = steps(ckpt, 1)[0]
    assert m["loss/value"] == pytest.approx(ms[0]["loss/value"], abs=1e-6)


def test_missing_peft_names_the_extra(base, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install 'molt-sdk\[lora\]'"):
        make(base)


def test_merged_state_dict_refuses_a_plain_model(base):
    with pytest.raises(TypeError, match="needs a peft model"):
        merged_state_dict(base[0])


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_adapter_on_a_tied_embedding_is_refused(base, target):
    """Review 14: tiny-qwen3 ties lm_head to embed_tokens. An adapter on either made the merged
    lm_head differ from the embedding, which no engine holds (the transformers engine loads both
    names into one tensor, vLLM skips a tied lm_head) and a saved model/ re-ties on load: after one
    step at lr 1e-2 the engine's logprobs were off by 0.10 with no error. Refused, naming the twin."""
    with pytest.raises(ValueError, match=r"trainer.lora.target_modules.*tied to (model\.embed_tokens|lm_head)\.weight"):
        make(base, lora={"r": 4, "alpha": 8, "target_modules": [target, "q_proj"]})


def test_adapter_on_an_untied_lm_head_is_published(base):
    """Without tied embeddings an adapted lm_head is fine: published merged, the embedding left as is."""
    model, tok = base
    untied = copy.deepcopy(model)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    tr = Trainer(tiny_cfg(trainer={"lr": 1e-2, "lora": {"r": 4, "alpha": 8, "target_modules": ["lm_head"]}}),
                 model=untied, tokenizer=tok)
    steps(tr, 1)
    w = tr.weights()
    assert not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    assert torch.equal(w["model.embed_tokens.weight"], model.model.embed_tokens.weight)
