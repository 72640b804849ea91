"""Trainer: recompute with the engine's transform (B08), ratio/IS weight exactly 1 on-policy,
the version gate from the trainer side (B10), micro-batch invariance (B15), ingress errors,
LR schedule, KL to a frozen reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_core.config import RunConfig
from molt_core.models import load_model, load_tokenizer
from molt_core.train import IngressError, Trainer, build_batch, lr_factor, token_logprobs
from molt_core.types import SampledSpan, Segment, Trajectory
from trainer_utils import (BiasLM, clone_params, record_engine_ids, resample_completions, set_behaviour, synthetic_rollouts,
                           tiny_cfg)


@pytest.fixture(scope="module")
def base():
    return load_model("builtin:tiny-qwen3", seed=0), load_tokenizer("builtin:tiny-qwen3")


def make(base, **sections) -> Trainer:
    model, tok = base
    return Trainer(tiny_cfg(**sections), model=copy.deepcopy(model), tokenizer=tok)



def _b08_traj(rid, reward, lp=None):
    # token 0 at T=0.5 after one context token; token 1 at T=0.5 after it
    lps = lp if lp is not None else [None, -0.5, -0.5]
    return Trajectory(rollout_id=rid, group_id="g", reward=reward, segments=[Segment(
        token_ids=[2, 0, 1], loss_mask=[False, True, True], logprobs=lps, versions=[None, 0, 0],
        spans=[SampledSpan(start=1, end=3, temperature=0.5)])])


# -- B08 from the trainer side ----------------------------------------------------------

def test_b08_recompute_uses_span_temperature():
    logits = torch.tensor([[[2.0, 1.0, 0.0]] * 3])
    ids = torch.tensor([[2, 0, 1]])
    pid = torch.tensor([[-1, 0, 0]])
    lp, ent = token_logprobs(logits, ids, pid, [(0.5, -1, 1.0)], with_entropy=True)
    # log softmax([4, 2, 0])[0] = 4 - log(e^4 + e^2 + 1)
    want0 = 4 - math.log(math.exp(4) + math.exp(2) + 1)
    assert lp[0, 1].item() == pytest.approx(-0.142932, abs=5e-7)
    assert lp[0, 1].item() == pytest.approx(want0, abs=1e-6)
    assert lp[0, 2].item() == pytest.approx(2 - math.log(math.exp(4) + math.exp(2) + 1), abs=1e-6)
    assert lp[0, 0].item() == 0.0
    p = torch.softmax(torch.tensor([4.0, 2.0, 0.0]), 0)
    assert ent[0, 1].item() == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


def test_b08_ratio_exactly_one_and_hand_gradient():
    """Identical weights: the PPO ratio and IS weights are exactly 1, and the gradient on the
    bias equals the hand-derived GRPO/PPO gradient."""
    cfg = tiny_cfg(trainer={"grad_clip": 0.0, "lr": 1e-3})
    tr = Trainer(cfg, model=BiasLM([2.0, 1.0, 0.0]))
    exact = token_logprobs(torch.tensor([[[2.0, 1.0, 0.0]] * 3]), torch.tensor([[2, 0, 1]]),
                           torch.tensor([[-1, 0, 0]]), [(0.5, -1, 1.0)])[0][0]
    lps = [None, float(exact[1]), float(exact[2])]
    m = tr.train_step([_b08_traj("a", 1.0, lps), _b08_traj("b", 0.0, lps)])
    assert m["invariants/logprob_absdiff_max"] == 0.0
    assert m["loss/ratio_min"] == 1.0 and m["loss/ratio_max"] == 1.0
    assert m["correction/is_weight_min"] == 1.0 and m["correction/is_weight_max"] == 1.0
    # GRPO: rewards [1, 0], sample std sqrt(1/2): A = +-0.5 / (0.7071068 + 1e-6)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    # loss = -(1/4) sum_r A_r sum_t logp_t; d logp(tok)/d bias = (e_tok - p) / T, T = 0.5.
    # Both rollouts sample tokens 0 and 1, with A = +a and -a: the gradient cancels to 0.
    assert tr.model.bias.grad.tolist() == pytest.approx([0.0, 0.0, 0.0], abs=1e-7)

    # one rollout samples token 0 twice, the other token 1 twice -> grad = -(a/2)(e0 - e1)/0.5
    tr2 = Trainer(cfg, model=BiasLM([2.0, 1.0, 0.0]))
    ta = Trajectory(rollout_id="a", group_id="g", reward=1.0, segments=[Segment(
        token_ids=[2, 0, 0], loss_mask=[False, True, True], logprobs=[None, float(exact[1]), float(exact[1])],
        versions=[None, 0, 0], spans=[SampledSpan(start=1, end=3, temperature=0.5)])])
    tb = Trajectory(rollout_id="b", group_id="g", reward=0.0, segments=[Segment(
        token_ids=[2, 1, 1], loss_mask=[False, True, True], logprobs=[None, float(exact[2]), float(exact[2])],
        versions=[None, 0, 0], spans=[SampledSpan(start=1, end=3, temperature=0.5)])])
    m2 = tr2.train_step([ta, tb])
    assert m2["loss/ratio_min"] == 1.0 and m2["loss/ratio_max"] == 1.0
    g = tr2.model.bias.grad
    # -(1/4) * [a * 2 (e0 - p) - a * 2 (e1 - p)] / 0.5 = -a (e0 - e1)
    assert g.tolist() == pytest.approx([-a, a, 0.0], abs=1e-6)
    assert m2["grad_norm"] == pytest.approx(a * math.sqrt(2), abs=1e-6)
    assert tr2.version == 1 and tr2.step == 1


# -- on-policy: IS weights 1, ratio 1, nothing gated (property) -------------------------

@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), mb=st.integers(1, 7), temp=st.sampled_from([1.0, 0.7]),
       top_k=st.sampled_from([-1, 50]), top_p=st.sampled_from([1.0, 0.9]), two=st.sampled_from([0, 3]))
def test_on_policy_weights_are_one_and_nothing_gated(base, seed, mb, temp, top_k, top_p, two):
    tr = make(base, trainer={"micro_batch_size": mb})
    trajs = synthetic_rollouts(seed, n_groups=2, n_per_group=3, temperature=temp, top_k=top_k, top_p=top_p,
                               two_segments_every=two)
    resample_completions(tr.model, trajs, seed)
    set_behaviour(tr, trajs)
    m = tr.train_step(trajs)
    assert m["invariants/logprob_absdiff_max"] == 0.0
    assert m["correction/is_weight_min"] == 1.0 and m["correction/is_weight_max"] == 1.0
    assert m["loss/ratio_min"] == 1.0 and m["loss/ratio_max"] == 1.0
    assert m["correction/gate_dropped"] == 0.0 and m["train/gated_sequences"] == 0.0
    assert m["invariants/staleness_max"] == 0.0
    assert m["train/action_tokens"] == sum(t.num_sampled for t in trajs)
    assert tr.version == 1


def test_top_k_filtered_token_logprob_matches_renormalised_distribution(base):
    """B09-style: with top-k the recompute renormalises over the k kept tokens."""
    tr = make(base)
    trajs = synthetic_rollouts(5, n_groups=1, n_per_group=1, top_k=3)
    batch = build_batch(trajs, tr.pad_id, tr.vocab_size)
    lp, _ = tr.recompute_logprobs(batch)
    with torch.no_grad():
        logits = tr.model(input_ids=batch.input_ids).logits[0]
    seg = trajs[0].segments[0]
    for t, m in enumerate(seg.loss_mask):
        if not m:
            continue
        row = logits[t - 1]
        top = torch.topk(row, 3).values
        tok = seg.token_ids[t]
        want = float(torch.log_softmax(top, 0)[(top == row[tok]).nonzero()[0, 0]]) if row[tok] >= top[-1] else -math.inf
        assert lp[0, t].item() == pytest.approx(want, abs=1e-5)


# -- B10 from the trainer side ------------------------------------------------------------

def _b10_traj():
    n = 140
    p = 12
    ids = [1] + [3 + (i * 7) % 400 for i in range(n - 1)]
    sampled = [i >= p for i in range(n)]
    # request dispatched at v7: generated tokens [0, 57) at v7, [57, 128) at v8
    vers = [None if i < p else (7 if i - p < 57 else 8) for i in range(n)]
    return Trajectory(rollout_id="b10", group_id="g", reward=1.0, segments=[Segment(
        token_ids=ids, loss_mask=sampled, logprobs=[-2.0 if s else None for s in sampled], versions=vers,
        spans=[SampledSpan(start=p, end=n)])])


def test_b10_staleness_is_two_and_gated(base):
    tr = make(base, **{"async": {"max_staleness": 1}})
    tr.version = 9
    other = Trajectory(rollout_id="ok", group_id="g", reward=0.0, segments=[Segment(
        token_ids=[1, 5, 6, 7], loss_mask=[False, True, True, True], logprobs=[None, -1.0, -1.0, -1.0],
        versions=[None, 8, 9, 9], spans=[SampledSpan(start=1, end=4)])])
    before = clone_params(tr.model)
    m = tr.train_step([_b10_traj(), other])
    assert m["invariants/staleness_max"] == 2.0  # over every token that reached the trainer
    assert m["correction/staleness_hist/2"] == 1.0
    assert m["correction/gate_dropped"] == 1.0 and m["train/gated_sequences"] == 1.0
    assert m["correction/staleness_max_kept"] == 1.0  # over the rows trained on
    assert m["correction/gated_frac"] == 128 / 131
    assert m["train/action_tokens"] == 3.0
    assert tr.version == 10
    assert any(not torch.equal(before[k], v) for k, v in tr.model.named_parameters())


def test_everything_gated_skips_the_step(base):
    tr = make(base, **{"async": {"max_staleness": 1}})
    tr.version = 9
    before = clone_params(tr.model)
    m = tr.train_step([_b10_traj()])
    assert m["train/skipped"] == 1.0 and m["train/action_tokens"] == 0.0
    assert tr.version == 9 and tr.step == 0
    assert all(torch.equal(before[k], v) for k, v in tr.model.named_parameters())


# -- micro-batch invariance (B15 through the whole trainer) -------------------------------

@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
def test_micro_batch_invariance(base, loss):
    trajs = synthetic_rollouts(11, n_groups=3, n_per_group=4, two_segments_every=5)
    grads, metrics = [], []
    for mb in (64, 5, 1):
        tr = make(base, trainer={"micro_batch_size": mb, "ppo_epochs": 1, "grad_clip": 0.0},
                  algo={"loss": loss, "kl_coef": 0.1})
        t2 = [t.model_copy(deep=True) for t in trajs]
        set_behaviour(tr, t2)
        for seg in t2[0].segments:  # make one rollout off-policy so IS weights are not all 1
            seg.logprobs = [None if x is None else x - 0.05 for x in seg.logprobs]
        metrics.append(tr.train_step(t2))
        grads.append({k: p.grad.clone() for k, p in tr.model.named_parameters() if p.grad is not None})
    # Tolerances fit float32 (eps = 2**-24 ~ 6e-8) at any thread count: the loss is a sum of
    # ~150 per-token terms of size ~1 whose order depends on the micro-batching and on how many
    # threads split each reduction; rounding is bounded by ~n * eps * sum|l| (Higham, Accuracy
    # and Stability of Numerical Algorithms, 2nd ed., eq. 4.4) and is ~sqrt(n) * eps in
    # practice, i.e. ~1e-6 relative. A real micro-batching bug (a wrong denominator, a token
    # counted twice) moves the loss by >= 1 / num_tokens ~ 7e-3 and the gradients by far more.
    for g, m in zip(grads[1:], metrics[1:]):
        assert m["loss/total"] == pytest.approx(metrics[0]["loss/total"], rel=1e-6, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(metrics[0]["grad_norm"], rel=1e-5)
        for k in grads[0]:
            torch.testing.assert_close(g[k], grads[0][k], rtol=1e-4, atol=1e-6)


def test_ppo_epochs_two_second_epoch_is_off_proximal(base):
    tr = make(base, trainer={"ppo_epochs": 2, "lr": 1e-2})
    trajs = synthetic_rollouts(3)
    set_behaviour(tr, trajs)
    m = tr.train_step(trajs)
    # the mean over epochs of ratio_max: epoch 1 is exactly 1, epoch 2 moved
    assert m["loss/ratio_max"] > 1.0
    assert tr.version == 1 and tr.step == 1


# -- KL to a frozen reference -------------------------------------------------------------

def test_kl_reference_term(base):
    tr = make(base, algo={"kl_coef": 0.5, "kl_estimator": "k3"}, trainer={"lr": 1e-2})
    assert tr.ref_model is not None
    trajs = synthetic_rollouts(4)
    set_behaviour(tr, trajs)
    m1 = tr.train_step(trajs)
    assert m1["kl"] == 0.0 and m1["loss/kl"] == 0.0  # the reference is the initial policy
    trajs = synthetic_rollouts(5)
    set_behaviour(tr, trajs)
    m2 = tr.train_step(trajs)
    assert m2["kl"] > 0.0 and m2["loss/kl"] > 0.0
    assert m2["loss/total"] == pytest.approx(m2["loss/policy"] + 0.5 * m2["loss/kl"], abs=1e-6)
    assert all(not p.requires_grad for p in tr.ref_model.parameters())


def test_kl_as_reward_needs_token_level_estimator(base):
    with pytest.raises(ValueError, match="kl_as_reward"):
        make(base, algo={"kl_coef": 0.1, "kl_as_reward": True, "advantage": "grpo"})


# -- ingress --------------------------------------------------------------------------------

def _seg(ids, mask, lps=None, vers=None, spans=None):
    lps = lps or [-1.0 if m else None for m in mask]
    vers = vers or [0 if m else None for m in mask]
    if spans is None:  # one T=1 span over the sampled tokens
        spans = [SampledSpan(start=mask.index(True), end=len(mask))] if any(mask) else []
    return Segment(token_ids=ids, loss_mask=mask, logprobs=lps, versions=vers, spans=spans)


def test_ingress_errors(base):
    tr = make(base)
    ok = _seg([1, 5, 6], [False, True, True])
    with pytest.raises(IngressError, match="no usable trajectory"):
        tr.train_step([Trajectory(segments=[ok], reward=1.0, status="failed", error="boom")])
    # build_batch still rejects each malformed input; train_step refuses such a rollout alone
    # (test_one_malformed_rollout_is_refused_and_the_rest_trains) with the same message
    with pytest.raises(IngressError, match="reward is None"):
        build_batch([Trajectory(segments=[ok])])
    with pytest.raises(IngressError, match="appears twice"):
        build_batch([Trajectory(rollout_id="x", segments=[ok], reward=1.0),
                     Trajectory(rollout_id="x", segments=[ok], reward=0.0)])
    with pytest.raises(IngressError, match=r"loss_mask\[0\] is True"):
        build_batch([Trajectory(segments=[_seg([1, 5], [True, True])], reward=1.0)])
    with pytest.raises(IngressError, match="outside the vocabulary"):
        build_batch([Trajectory(segments=[_seg([1, 5, 512], [False, True, True])], reward=1.0)], vocab_size=512)
    with pytest.raises(IngressError, match="lies in no sampled span"):
        build_batch([Trajectory(segments=[_seg([1, 5, 6], [False, True, True],
                                               spans=[SampledSpan(start=1, end=2)])], reward=1.0)])
    with pytest.raises(IngressError, match=r"rollout nospan, segment 1: sampled tokens but no sampled span"):
        build_batch([Trajectory(rollout_id="nospan", segments=[_seg([1, 5, 6], [False, True, True]),
                                                               _seg([1, 5, 6], [False, True, True], spans=[])],
                                reward=1.0)])
    with pytest.raises(IngressError, match="overlaps another span"):
        build_batch([Trajectory(segments=[_seg([1, 5, 6], [False, True, True], spans=[
            SampledSpan(start=1, end=3), SampledSpan(start=2, end=3, temperature=0.5)])], reward=1.0)])
    with pytest.raises(IngressError, match="no sampled token"):
        build_batch([Trajectory(segments=[_seg([1, 5, 6], [False, False, False])], reward=1.0)])
    # a segment mutated after validation (validate_assignment is off): lengths re-checked
    bad = Trajectory(segments=[_seg([1, 5, 6], [False, True, True])], reward=1.0)
    bad.segments[0].logprobs = [None, -1.0]
    with pytest.raises(IngressError, match="logprobs has length 2, token_ids has 3"):
        build_batch([bad])
    bad = Trajectory(segments=[_seg([1, 5, 6], [False, True, True])], reward=1.0)
    bad.segments[0].logprobs = [None, 0.5, -1.0]
    with pytest.raises(IngressError, match="finite logprob <= 0"):
        build_batch([bad])
    assert tr.version == 0
    from molt_core.train.ingress import refuse_malformed

    nospan = Trajectory(rollout_id="nospan", segments=[_seg([1, 5, 6], [False, True, True]),
                                                       _seg([1, 5, 6], [False, True, True], spans=[])], reward=1.0)
    kept, m, reasons = refuse_malformed([nospan])
    assert kept == [] and m == {"ingress/refused_malformed": 1.0, "ingress/refused_no_span": 1.0,
                                "ingress/refused_nonfinite": 0.0, "invariants/nonfinite_logprobs": 0.0}
    assert reasons[0].startswith("rollout nospan, segment 1: sampled tokens but no sampled span")
    m = tr.train_step([nospan])
    assert m["train/skipped"] == 1.0 and m["ingress/refused_no_span"] == 1.0 and tr.version == 0


def test_failed_trajectories_are_skipped_and_counts(base):
    tr = make(base)
    trajs = synthetic_rollouts(8, n_groups=1, n_per_group=4)
    set_behaviour(tr, trajs)
    trajs[1] = trajs[1].fail("agent raised")
    m = tr.train_step(trajs)
    assert m["train/rollouts"] == 3.0
    assert m["train/action_tokens"] == sum(t.num_sampled for t in trajs if t.status == "ok")
    # synthetic spans carry no engine record: their action tokens are trained, counted as unverified
    assert m["invariants/tokens_retokenized"] == 0.0 and m["ingress/refused_rollouts"] == 0.0
    assert m["invariants/tokens_unverified"] == m["train/action_tokens"]


# -- token identity at ingress (issue 10 item 1) ------------------------------------------

def test_altered_sampled_id_is_counted_and_not_trained_on(base):
    """Fault injection: one sampled id altered after the segment was built (the engine's
    record says otherwise) -> counted in invariants/tokens_retokenized, that rollout is
    refused; the step trains on the other three exactly as if it had never been there."""
    trajs = synthetic_rollouts(8, n_groups=1, n_per_group=4)
    set_behaviour(make(base), trajs)
    record_engine_ids(trajs)
    clean = make(base).train_step(copy.deepcopy(trajs))
    assert clean["invariants/tokens_retokenized"] == 0.0 and clean["invariants/tokens_unverified"] == 0.0
    assert clean["ingress/refused_rollouts"] == 0.0 and clean["train/rollouts"] == 4.0

    bad = copy.deepcopy(trajs)
    seg = bad[2].segments[0]
    k = seg.spans[0].start + 1
    seg.token_ids[k] = seg.token_ids[k] % 499 + 1  # another id in [1, 500)
    tr = make(base)
    m = tr.train_step(bad)
    assert m["invariants/tokens_retokenized"] == 1.0 and m["ingress/refused_rollouts"] == 1.0
    assert m["train/rollouts"] == 3.0 and m["train/skipped"] == 0.0
    assert m["train/action_tokens"] == float(sum(t.num_sampled for i, t in enumerate(trajs) if i != 2))
    ref = make(base)
    ref.train_step([t for i, t in enumerate(copy.deepcopy(trajs)) if i != 2])
    for (name, p), q in zip(tr.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name  # the refused rollout contributed nothing

    # three ids of one span altered: three tokens count
    bad3 = copy.deepcopy(trajs[:1])
    s0 = bad3[0].segments[0]
    for i in range(s0.spans[0].start, s0.spans[0].start + 3):
        s0.token_ids[i] = s0.token_ids[i] % 499 + 1
    assert s0.spans[0].end - s0.spans[0].start >= 3
    # nothing left to train on: the step is skipped with the count, the trainer does not move
    tr = make(base)
    m = tr.train_step(bad3)
    assert m == {"invariants/tokens_retokenized": 3.0, "invariants/tokens_unverified": 0.0,
                 "ingress/refused_retokenized": 1.0, "ingress/refused_unverified": 0.0,
                 "ingress/refused_malformed": 0.0, "ingress/refused_no_span": 0.0,
                 "ingress/refused_nonfinite": 0.0, "invariants/nonfinite_logprobs": 0.0,
                 "ingress/refused_rollouts": 1.0, "ledger/context_reencoded_tokens": 0.0,
                 "train/skipped": 1.0, "train/rollouts": 0.0, "train/step": 0.0}
    assert tr.version == 0 and tr.step == 0


def test_stripped_engine_record_is_refused_by_default(base):
    """Finding 3: altered ids with the engine's record stripped (``digest`` and
    ``sampled_ids`` None) cannot be checked. Default (``trainer.refuse_unverified = true``):
    the rollout is refused, counted, never trained on; the update equals training on the rest.
    With the option off it is trained on, its tokens counted as unverified. Clean: 0."""
    trajs = synthetic_rollouts(8, n_groups=1, n_per_group=4)
    set_behaviour(make(base), trajs)
    record_engine_ids(trajs)
    bad = copy.deepcopy(trajs)
    seg = bad[1].segments[0]
    sp = seg.spans[0]
    seg.token_ids[sp.start] = seg.token_ids[sp.start] % 499 + 1
    sp.digest = sp.sampled_ids = None
    n1 = sp.end - sp.start
    assert n1 == 6
    assert RunConfig().trainer.refuse_unverified is True
    tr = make(base, trainer={"refuse_unverified": True})
    m = tr.train_step(bad)
    assert m["invariants/tokens_unverified"] == float(n1) and m["invariants/tokens_retokenized"] == 0.0
    assert m["ingress/refused_unverified"] == 1.0 and m["ingress/refused_rollouts"] == 1.0
    assert m["train/rollouts"] == 3.0
    ref = make(base)
    ref.train_step([t for i, t in enumerate(copy.deepcopy(trajs)) if i != 1])
    for (name, p), q in zip(tr.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name
    off = make(base, trainer={"refuse_unverified": False}).train_step(copy.deepcopy(bad))
    assert off["invariants/tokens_unverified"] == float(n1) and off["ingress/refused_rollouts"] == 0.0
    assert off["train/rollouts"] == 4.0
    clean = make(base, trainer={"refuse_unverified": True}).train_step(copy.deepcopy(trajs))
    assert clean["invariants/tokens_unverified"] == 0.0 and clean["ingress/refused_rollouts"] == 0.0
    assert clean["train/rollouts"] == 4.0


def _malformed(kind: str, good: Trajectory) -> Trajectory:
    """A copy of ``good`` (rollout id ``x``) broken one way (built with ``model_construct``
    where the validators would refuse it)."""
    t = copy.deepcopy(good)
    t.rollout_id = "x"
    seg = t.segments[0]
    if kind == "no_span":
        seg.spans = []
    elif kind == "token_outside_span":
        seg.spans = [SampledSpan(start=seg.spans[0].start + 1, end=seg.spans[0].end)]
    elif kind == "misaligned":
        t.segments[0] = Segment.model_construct(**{**seg.__dict__, "logprobs": seg.logprobs[:-1]})
    elif kind == "id_out_of_vocab":
        t.segments[0] = Segment.model_construct(**{**seg.__dict__, "token_ids": [10**6] + seg.token_ids[1:]})
    elif kind == "reward_none":
        t = Trajectory.model_construct(**{**t.__dict__, "reward": None})
    elif kind == "duplicate_id":
        t.rollout_id = good.rollout_id
    return t


@pytest.mark.parametrize("kind,no_span", [("no_span", 1.0), ("token_outside_span", 1.0), ("misaligned", 0.0),
                                          ("id_out_of_vocab", 0.0), ("reward_none", 0.0), ("duplicate_id", 0.0)])
def test_one_malformed_rollout_is_refused_and_the_rest_trains(base, kind, no_span):
    """Finding 7b: a rollout whose sampled tokens have no span ended the whole step with an
    IngressError. Now it -- and every other malformed rollout -- is refused alone, counted
    (``ingress/refused_malformed``; ``ingress/refused_no_span`` for the span cases), and the
    step trains on the rest exactly as if it had never been there."""
    trajs = synthetic_rollouts(8, n_groups=1, n_per_group=4)
    set_behaviour(make(base), trajs)
    tr = make(base)
    m = tr.train_step(copy.deepcopy(trajs) + [_malformed(kind, trajs[0])])
    assert m["ingress/refused_malformed"] == 1.0 and m["ingress/refused_no_span"] == no_span
    assert m["ingress/refused_rollouts"] == 1.0 and m["train/rollouts"] == 4.0 and m["train/skipped"] == 0.0
    ref = make(base)
    clean = ref.train_step(copy.deepcopy(trajs))
    assert clean["ingress/refused_malformed"] == 0.0 and clean["ingress/refused_rollouts"] == 0.0
    for (name, p), q in zip(tr.model.named_parameters(), ref.model.parameters()):
        assert torch.equal(p, q), name
    # alone it leaves nothing: the step is skipped, counted, the trainer does not move
    tr = make(base)
    if kind != "duplicate_id":
        m = tr.train_step([_malformed(kind, trajs[0])])
        assert m["train/skipped"] == 1.0 and m["ingress/refused_malformed"] == 1.0 and tr.version == 0


def test_context_reencoded_tokens_summed_from_ledger_info(base):
    trajs = synthetic_rollouts(3, n_groups=1, n_per_group=2)
    set_behaviour(make(base), trajs)
    trajs[0].info["context_reencoded_tokens"] = 7
    trajs[1].info["context_reencoded_tokens"] = 5
    assert make(base).train_step(trajs)["ledger/context_reencoded_tokens"] == 12.0


def test_multi_segment_rollout_counts_one_reward():
    trajs = synthetic_rollouts(2, n_groups=1, n_per_group=3, two_segments_every=2)
    b = build_batch(trajs)
    assert b.size == 5 and b.rewards.tolist() == [t.reward for t in trajs]
    assert b.rollout_index.tolist() == [0, 0, 1, 2, 2]
    assert b.group_index.tolist() == [0, 0, 0]


# -- LR schedule ------------------------------------------------------------------------------

def test_lr_factor_values():
    assert [lr_factor(s, 4, 10, "constant") for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(5, 0, 10, "linear") == 0.5
    assert lr_factor(0, 0, 10, "linear") == 1.0
    assert lr_factor(5, 0, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(7, 2, 12, "cosine") == pytest.approx(0.5)  # halfway through the decay
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor(0, 0, 1, "exp")


def test_trainer_lr_follows_schedule(base):
    tr = make(base, trainer={"lr": 1e-3, "warmup_steps": 2, "lr_schedule": "linear"}, run={"steps": 6})
    lrs = []
    for s in range(4):
        trajs = synthetic_rollouts(s)
        set_behaviour(tr, trajs)
        lrs.append(tr.train_step(trajs)["lr"])
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 0.75e-3])


def test_publish_calls_load_weights_with_version(base):
    tr = make(base)
    calls = []

    class Eng:
        def load_weights(self, state, version):
            calls.append((set(state), version))

    trajs = synthetic_rollouts(1)
    set_behaviour(tr, trajs)
    tr.train_step(trajs)
    assert tr.publish([Eng(), Eng()]) == 1
    assert [v for _, v in calls] == [1, 1]
    assert "model.embed_tokens.weight" in calls[0][0]


# -- forward consistency with the embedded engine -------------------------------------------

def test_engine_and_trainer_logprobs_agree_and_publish(base):
    """Same weights, same batch, fp32 CPU: |engine logprob - trainer recompute| <= 1e-5;
    after a step, publish -> the engine samples at version 1 and agrees again."""
    import asyncio

    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.types import SamplingParams

    model, tok = base
    tr = make(base, trainer={"lr": 1e-2})
    eng = TransformersEngine(copy.deepcopy(model), tok, max_batch_size=8, seed=0)
    settings_ = [(1.0, -1, 1.0), (0.7, 50, 1.0), (1.3, -1, 0.9)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {a + 3}?"}],
                                       add_generation_prompt=True, tokenize=False) for a in range(4)]
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]

    async def rollouts():
        jobs, meta = [], []
        for i, ids in enumerate(prompt_ids):
            for j, (t, k, p) in enumerate(settings_):
                sp = SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=12, seed=10 * i + j)
                jobs.append(eng.generate(ids, sp))
                meta.append((i, ids, sp))
        outs = await asyncio.gather(*jobs)
        trajs = []
        for n, ((i, ids, sp), o) in enumerate(zip(meta, outs)):
            P, N = len(ids), len(o.token_ids)
            trajs.append(Trajectory(rollout_id=f"r{n}", group_id=f"g{i}", reward=float(n % 2), segments=[Segment(
                token_ids=ids + o.token_ids, loss_mask=[False] * P + [True] * N,
                logprobs=[None] * P + o.logprobs, versions=[None] * P + o.versions,
                spans=[SampledSpan(start=P, end=P + N, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)])]))
        return trajs

    try:
        trajs = asyncio.run(rollouts())
        assert {v for t in trajs for v in t.segments[0].versions if v is not None} == {0}
        m = tr.train_step(trajs)
        print("engine vs trainer |dlogprob| max (v0):", m["invariants/logprob_absdiff_max"])
        assert m["invariants/logprob_absdiff_max"] <= 1e-5
        assert m["correction/gate_dropped"] == 0.0
        assert tr.publish([eng]) == 1 and eng.version == 1
        trajs = asyncio.run(rollouts())
        assert {v for t in trajs for v in t.segments[0].versions if v is not None} == {1}
        m = tr.train_step(trajs)
        assert m["invariants/logprob_absdiff_max"] <= 1e-5
        assert m["invariants/staleness_max"] == 0.0
    finally:
        eng.close()


@pytest.mark.parametrize("sections,shared", [
    ({}, False),
    ({"algo": {"kl_coef": 0.1}, "trainer": {"micro_batch_size": 4}}, False),
    ({"async": {"max_staleness": 1}, "correction": {"is_level": "geo", "is_mode": "clip", "low": 0.5, "high": 1.5}},
     False),
    ({"algo": {"kl_coef": 0.1}, "trainer": {"micro_batch_size": 5}}, True),
])
def test_fused_recompute_is_bit_identical_to_separate_pass(base, sections, shared):
    """With one PPO epoch the proximal logprobs taken from the loss forward equal a separate
    no-grad recompute bit for bit: same weights, metrics and correction after two steps. With
    ``shared`` a group's rollouts share their prompt, so the loss forward, the recompute and the
    KL reference all run the shared-prefix forward (``trainer.shared_prefix``), micro-batches
    of 5 splitting groups of 4."""
    runs = []
    # seq/geo weights of a multi-segment rollout need all its rows: not fused (next test)
    two = 0 if sections.get("correction", {}).get("is_level") in ("seq", "geo") else 4
    for fuse in (True, False):
        tr = make(base, trainer={"lr": 1e-2, **sections.get("trainer", {})},
                  **{k: v for k, v in sections.items() if k != "trainer"})
        tr.fuse_recompute = fuse
        ms = []
        for i in range(2):
            trajs = synthetic_rollouts(40 + i, two_segments_every=two, shared_prompt=shared)
            if shared:  # the first micro-batch really shares a prefix
                from molt_core.train.forward import shared_prefix

                b = build_batch(trajs, tr.pad_id, tr.vocab_size)
                T5 = int(b.lengths[:5].max())
                assert shared_prefix(b.input_ids[:5, :T5], b.param_ids[:5, :T5]) is not None
            set_behaviour(tr, trajs, version=max(0, tr.version - i))  # step 2: one version stale
            for seg in trajs[0].segments:
                seg.logprobs = [None if x is None else x - 0.3 for x in seg.logprobs]
            ms.append(tr.train_step(trajs))
        runs.append((ms, tr.model.state_dict()))
    (mf, sf), (mu, su) = runs
    assert [m["train/fused_recompute"] for m in mf] == [1.0, 1.0]
    assert [m["train/fused_recompute"] for m in mu] == [0.0, 0.0]
    for a, b in zip(mf, mu):
        for k in a:
            if not k.startswith(("time/", "tokens_per_s", "train/fused")):
                assert a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])), k
    for k in sf:
        assert torch.equal(sf[k], su[k]), k


def test_seq_weights_of_a_multi_segment_rollout_are_not_fused(base):
    tr = make(base, correction={"is_level": "seq", "is_mode": "trunc", "high": 2.0})
    assert tr.fused_recompute_ok(build_batch(synthetic_rollouts(1, two_segments_every=0)))
    assert not tr.fused_recompute_ok(build_batch(synthetic_rollouts(1, two_segments_every=2)))
    assert make(base).fused_recompute_ok(build_batch(synthetic_rollouts(1, two_segments_every=2)))


def test_mask_mode_uses_separate_recompute(base):
    tr = make(base, correction={"is_level": "token", "is_mode": "mask", "low": 0.5, "high": 2.0})
    assert not tr.fused_recompute_ok()
    assert not make(base, trainer={"ppo_epochs": 2}).fused_recompute_ok()
    assert make(base).fused_recompute_ok()


def test_on_policy_distill_hand_gradient():
    """A_t = -coef (log pi_student - log pi_teacher) per token, no baseline: with the
    teacher 0.5 nats above the student on token 0, A = +0.5 and the gradient on the
    bias logits is -(A / N) (e_0 - p) with N = 1."""
    cfg = tiny_cfg(algo={"advantage": "on_policy_distill", "distill_coef": 1.0}, trainer={"grad_clip": 0.0})
    tr = Trainer(cfg, model=BiasLM([2.0, 1.0, 0.0]))
    assert not tr.fused_recompute_ok()
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0)
    s = float(torch.log(p[0]))
    t = Trajectory(rollout_id="d", reward=0.0, info={"teacher_logprobs": [[None, s + 0.5]]}, segments=[Segment(
        token_ids=[2, 0], loss_mask=[False, True], logprobs=[None, s], versions=[None, 0],
        spans=[SampledSpan(start=1, end=2)])])
    m = tr.train_step([t])
    assert m["loss/ratio_max"] == 1.0
    want = (-0.5 * (torch.tensor([1.0, 0.0, 0.0]) - p)).tolist()
    assert tr.model.bias.grad.tolist() == pytest.approx(want, abs=1e-6)
    bad = t.model_copy(deep=True, update={"info": {}})
    with pytest.raises(IngressError, match="teacher_logprobs"):
        build_batch([bad], need_teacher=True)
    # through the trainer the rollout without teacher logprobs is refused alone (counted)
    m = tr.train_step([bad])
    assert m["ingress/refused_malformed"] == 1.0 and m["train/skipped"] == 1.0


def test_kl_as_reward_with_reinforce(base):
    tr = make(base, algo={"advantage": "reinforce", "kl_coef": 0.2, "kl_as_reward": True}, trainer={"lr": 1e-2})
    assert not tr.fused_recompute_ok()
    for i in range(2):
        trajs = synthetic_rollouts(60 + i)
        set_behaviour(tr, trajs)
        m = tr.train_step(trajs)
    assert m["kl"] > 0 and m["loss/kl"] == 0.0  # KL went into the rewards, not the loss


# -- GAE critic -------------------------------------------------------------------------------

def test_gae_critic_first_step_by_hand_and_learns(base):
    tr = make(base, algo={"advantage": "gae", "gamma": 1.0, "lam": 1.0, "value_clip": 0.2},
              trainer={"critic_lr": 1e-2, "lr": 1e-4})
    assert tr.critic is not None and tr.fused_recompute_ok()
    trajs = synthetic_rollouts(70)
    set_behaviour(tr, trajs)
    m = tr.train_step(trajs)
    # zero-initialised head: V = 0, so A_t = G_t = reward at every token (gamma = lam = 1);
    # value loss = 0.5 * mean over action tokens of G^2 = 0.5 * share of tokens with reward 1
    n = sum(t.num_sampled for t in trajs)
    want = 0.5 * sum(t.num_sampled for t in trajs if t.reward == 1.0) / n
    assert m["loss/value"] == pytest.approx(want, abs=1e-6)
    assert m["critic/value_mean"] == 0.0 and m["critic/explained_variance"] == 0.0
    assert m["critic/return_mean"] == pytest.approx(2 * want, abs=1e-6)
    first = m["loss/value"]
    for _ in range(15):
        set_behaviour(tr, trajs)
        m = tr.train_step(trajs)
    assert m["loss/value"] < 0.5 * first
    assert m["critic/explained_variance"] > 0.3


def test_value_model_alignment(base):
    from molt_core.train import ValueModel

    model, _ = base
    vm = ValueModel(model)
    torch.nn.init.normal_(vm.head.weight)
    ids = torch.tensor([[1, 40, 41, 42]])
    with torch.no_grad():
        v = vm(ids)
        h = model.get_decoder()(input_ids=ids).last_hidden_state
        want = vm.head(h).squeeze(-1)
    assert v[0, 0].item() == 0.0
    torch.testing.assert_close(v[0, 1:], want[0, :-1])
    with pytest.raises(ValueError, match="get_decoder"):
        ValueModel(BiasLM([0.0, 1.0]))
