"""Forward consistency and out-of-support tokens through the trainer (issue 10, items 4 and 6).

* ``invariants/logprob_absdiff_max_onpolicy`` is reported on every step, async included: a
  token sampled by an older version is recomputed under that version's weights. Fault: the
  engine sampled at temperature 1 while the span records 0.5 -> flagged; clean -> 0.
* A sampled token outside the trainer's recomputed top-k support (proximal logprob -inf)
  never crashes a step: ratio 0, masked or weight 0 per the correction mode, counted in
  ``correction/out_of_support_frac``; the gradient is the hand-derived one.
"""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from molt_core.sampling import processed_logprobs
from molt_core.train import Trainer
from molt_core.types import SampledSpan, Segment, Trajectory
from molt_core.train.version_history import VersionHistory, onpolicy_metrics, sample_rows
from trainer_utils import BiasLM, tiny_cfg

torch.set_num_threads(1)



def _lp(bias, tok, temperature=1.0, top_k=-1):
    return float(processed_logprobs(torch.tensor(bias), temperature, top_k)[tok])


def _traj(rid, reward, ids, lps, vers, temperature=1.0, top_k=-1):
    n = len(ids)
    return Trajectory(rollout_id=rid, group_id="g", reward=reward, segments=[Segment(
        token_ids=ids, loss_mask=[False] + [True] * (n - 1), logprobs=[None] + lps, versions=[None] + vers,
        spans=[SampledSpan(start=1, end=n, temperature=temperature, top_k=top_k)])])


# -- on-policy difference, async -----------------------------------------------------------

B0 = [2.0, 1.0, 0.0]


def _async_trainer():
    """A trainer at version 1 that holds version 0's weights (bias B0): one GRPO step taken."""
    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}, trainer={"lr": 0.1, "grad_clip": 0.0}),
                 model=BiasLM(B0))
    lp = [_lp(B0, 0, 0.5), _lp(B0, 1, 0.5)]
    m = tr.train_step([_traj("a", 1.0, [2, 0, 1], lp, [0, 0], 0.5),
                       _traj("b", 0.0, [2, 1, 2], [_lp(B0, 1, 0.5), _lp(B0, 2, 0.5)], [0, 0], 0.5)])
    assert m["grad_norm"] > 0 and tr.version == 1
    assert tr.history.versions() == [0]
    return tr


def test_onpolicy_diff_async_clean_reads_zero_and_temperature_fault_is_flagged():
    tr = _async_trainer()
    b1 = tr.model.bias.detach().tolist()
    assert b1 != B0  # the policy moved: drift between v0 and v1
    # clean: rollout a sampled wholly at v0 (one version stale); rollout b is a partial rollout,
    # token 1 at v0 and token 2 at v1 after a weight sync landed mid-generation
    clean = [_traj("a", 1.0, [2, 0, 1], [_lp(B0, 0, 0.5), _lp(B0, 1, 0.5)], [0, 0], 0.5),
             _traj("b", 0.0, [2, 1, 2], [_lp(B0, 1, 0.5), _lp(b1, 2, 0.5)], [0, 1], 0.5)]
    m = tr.train_step(clean)
    assert m["invariants/staleness_max"] == 1.0
    assert m["invariants/logprob_absdiff_max_onpolicy"] == 0.0
    assert m["invariants/onpolicy_tokens"] == 4.0 and m["invariants/onpolicy_stale_tokens"] == 3.0
    assert m["invariants/logprob_absdiff_max"] > 1e-3  # the all-token difference mixes in policy drift
    # stale tokens corrected: token-level trunc (high 2) weight exp(lp_v1 - lp_v0) per stale token,
    # 1 on b's version-1 token (each exp(.) in float32 logprobs, as the trainer computes it)
    ws = [min(math.exp(_lp(b1, t, 0.5) - _lp(B0, t, 0.5)), 2.0) for t in (0, 1, 1)] + [1.0]
    assert min(ws) < 1.0 - 1e-3 and max(ws) > 1.0 + 1e-3  # (the policy's step moved every stale ratio)
    assert m["correction/is_weight_min"] == pytest.approx(min(ws), abs=1e-6)
    assert m["correction/is_weight_max"] == pytest.approx(max(ws), abs=1e-6)
    assert m["correction/is_weight_mean"] == pytest.approx(sum(ws) / 4, abs=1e-6)
    # fault: the engine sampled at temperature 1 but recorded spans of temperature 0.5
    tr = _async_trainer()
    fault = [_traj("a", 1.0, [2, 0, 1], [_lp(B0, 0, 1.0), _lp(B0, 1, 1.0)], [0, 0], 0.5),
             _traj("b", 0.0, [2, 1, 2], [_lp(B0, 1, 0.5), _lp(B0, 2, 0.5)], [0, 0], 0.5)]
    m = tr.train_step(fault)
    # token 1 of a: |(1 - log(e^2 + e + 1)) - (2 - log(e^4 + e^2 + 1))| = 0.735326
    want = abs((1 - math.log(math.e ** 2 + math.e + 1)) - (2 - math.log(math.e ** 4 + math.e ** 2 + 1)))
    assert want == pytest.approx(0.735326, abs=1e-6)
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(want, abs=1e-6)


def test_onpolicy_diff_sync_clean_zero_and_temperature_fault():
    tr = Trainer(tiny_cfg(), model=BiasLM(B0))
    ok = [_traj("a", 1.0, [2, 0, 1], [_lp(B0, 0, 0.5), _lp(B0, 1, 0.5)], [0, 0], 0.5),
          _traj("b", 0.0, [2, 1, 2], [_lp(B0, 1, 0.5), _lp(B0, 2, 0.5)], [0, 0], 0.5)]
    m = tr.train_step(ok)
    assert m["invariants/logprob_absdiff_max_onpolicy"] == 0.0 and m["invariants/onpolicy_tokens"] == 4.0
    tr = Trainer(tiny_cfg(), model=BiasLM(B0))
    bad = [_traj("a", 1.0, [2, 0, 1], [_lp(B0, 0, 1.0), _lp(B0, 1, 0.5)], [0, 0], 0.5), ok[1]]
    m = tr.train_step(bad)
    # token 0: |(2 - log(e^2 + e + 1)) - (-0.142932)| = |-0.407606 + 0.142932| = 0.264674
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.264674, abs=1e-6)


def test_onpolicy_metrics_unmeasured_is_nan_and_history_keeps_newest():
    m = onpolicy_metrics(torch.zeros(0), torch.zeros(0))
    assert math.isnan(m["invariants/logprob_absdiff_max_onpolicy"]) and m["invariants/onpolicy_tokens"] == 0.0
    h = VersionHistory(2)
    model = BiasLM(B0)
    for v in range(4):
        h.record(v, model)
    assert h.versions() == [2, 3]
    with pytest.raises(KeyError, match="version 0 is not held"):
        h.load(0, model)
    h0 = VersionHistory(0)
    h0.record(0, model)
    assert h0.versions() == []


def _fault_in_one_row(rows=None):
    """Finding 2: 64 stale rollouts, the temperature fault only in rollout 5 (the engine sampled
    at T = 1, the span records 0.5); the trainer at version 1 holds version 0."""
    kw = {"max_staleness": 1} if rows is None else {"max_staleness": 1, "onpolicy_rows": rows}
    tr = Trainer(tiny_cfg(**{"async": kw}, trainer={"lr": 0.1, "grad_clip": 0.0}), model=BiasLM(B0))
    tr.train_step([_traj("a", 1.0, [2, 0, 1], [_lp(B0, 0, 0.5), _lp(B0, 1, 0.5)], [0, 0], 0.5),
                   _traj("b", 0.0, [2, 1, 2], [_lp(B0, 1, 0.5), _lp(B0, 2, 0.5)], [0, 0], 0.5)])
    batch = [_traj(f"r{i}", float(i % 2), [2, 0, 1], [_lp(B0, 0, 1.0 if i == 5 else 0.5), _lp(B0, 1, 1.0 if i == 5 else 0.5)],
                   [0, 0], 0.5) for i in range(64)]
    return tr.train_step(batch)


def test_onpolicy_default_measures_every_stale_row():
    """By default every stale row is recomputed under its version: a fault in one row of 64
    shows (before the fix the default measured 16 evenly spaced rows, the same every step,
    and read 0.0 here)."""
    m = _fault_in_one_row()
    assert m["invariants/onpolicy_tokens"] == 128.0 == m["train/action_tokens"]
    assert m["invariants/onpolicy_stale_tokens"] == 128.0
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.735326, abs=1e-6)
    # a sample of 16 rows per version: 32 tokens measured
    m16 = _fault_in_one_row(16)
    assert m16["invariants/onpolicy_tokens"] == 32.0


def test_onpolicy_row_sample_is_random_and_changes_every_step():
    idx = torch.arange(100, 164)
    assert torch.equal(sample_rows(idx, -1), idx) and torch.equal(sample_rows(idx, 64), idx)
    picks = [sample_rows(idx, 16, torch.Generator().manual_seed(1_000_003 * 0 + v)) for v in (1, 2, 3)]
    for p in picks:
        assert p.numel() == 16 and len(set(p.tolist())) == 16 and set(p.tolist()) <= set(idx.tolist())
        assert p.tolist() == sorted(p.tolist())
    assert picks[0].tolist() != picks[1].tolist() != picks[2].tolist()
    # over steps the sample covers rows a fixed spread never would: 3 draws of 16 cover > 16 rows
    assert len(set().union(*[set(p.tolist()) for p in picks])) > 16


def test_version_history_copies_tied_weights_once_and_counts_copy_time(monkeypatch):
    """Finding 5: tied input/output embeddings are stored once per version (the tiny Qwen3
    ties them: before, every version held them twice, +7.7%); the copy is timed in
    ``time/onpolicy_check``."""
    import time

    from trainer_utils import set_behaviour, synthetic_rollouts

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 3}}))
    sd = tr.model.state_dict()
    tied = [k for k in sd if k.endswith("embed_tokens.weight") or k == "lm_head.weight"]
    assert len(tied) == 2 and sd[tied[0]].data_ptr() == sd[tied[1]].data_ptr()
    unique = sum(p.numel() * p.element_size() for p in tr.model.parameters())
    with_dups = sum(v.numel() * v.element_size() for v in sd.values())
    assert with_dups > unique
    h = VersionHistory(3)
    h.record(0, tr.model)
    assert h._states[0][tied[0]] is h._states[0][tied[1]]
    assert h.nbytes() == unique == 3413504  # the policy's parameters, once (its buffers are not persistent)
    for v in (1, 2, 3):
        h.record(v, tr.model)
    assert h.versions() == [1, 2, 3] and h.nbytes() == 3 * unique  # keep = 3: three copies, not 3.23
    # the trainer's copy is timed as part of the check, not of the update: the copy moves a
    # fake clock on by 1000 s, which lands in time/onpolicy_check and not in time/train
    real, clock, offset = tr.history.record, time.perf_counter, [0.0]

    def slow(version, model):
        offset[0] += 1000.0
        real(version, model)

    tr.history.record = slow
    ts = synthetic_rollouts(0)
    set_behaviour(tr, ts)
    import molt_core.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod.time, "perf_counter", lambda: clock() + offset[0])
    m = tr.train_step(ts)
    monkeypatch.undo()
    assert m["time/onpolicy_check"] >= 1000.0 and m["time/train"] < 1000.0
    assert tr.history.versions() == [0]


# -- out of the recomputed support ---------------------------------------------------------

# the trainer's weights now: token 0 ranks 6th (logits 7, 6, 5, 4, 3 are above it)
B_NOW = [1.0, 7.0, 6.0, 5.0, 4.0, 3.0, 0.0, -1.0]
P1 = 1 / (1 + math.exp(-1))  # top-2 softmax of logits (7, 6): p(token 1)
P2 = 1 - P1


def _oos_batch(fault=True):
    """Rollout a sampled token 0 with top_k = 2 under the previous weights (version 0, where it
    was in the top 2), then token 1; rollout b sampled tokens 1, 2. Trainer at version 1."""
    lp1, lp2 = _lp(B_NOW, 1, top_k=2), _lp(B_NOW, 2, top_k=2)
    a_ids = [2, 0, 1] if fault else [2, 1, 1]
    a_lp = [-0.5 if fault else lp1, lp1]
    return [_traj("a", 1.0, a_ids, a_lp, [0, 0], top_k=2), _traj("b", 0.0, [2, 1, 2], [lp1, lp2], [0, 0], top_k=2)]


def _oos_trainer(fuse=True, **correction):
    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}, correction=correction, trainer={"grad_clip": 0.0}),
                 model=BiasLM(B_NOW))
    tr.version = 1
    tr.fuse_recompute = fuse
    return tr


def _grad(indices_values):
    g = [0.0] * len(B_NOW)
    for i, v in indices_values:
        g[i] = v
    return g


A = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO advantage of rewards [1, 0]


@pytest.mark.parametrize("fuse", [True, False])
def test_out_of_support_token_trunc_weight_zero_no_crash(fuse):
    tr = _oos_trainer(fuse)
    m = tr.train_step(_oos_batch())
    assert m["train/fused_recompute"] == float(fuse)
    assert m["correction/out_of_support_frac"] == 0.25
    assert m["train/action_tokens"] == 4.0  # under trunc it counts, with weight 0
    # in the gradient: a's token 1 (A = +a), b's tokens 1 and 2 (A = -a); a's token 1 and b's
    # token 1 cancel, leaving -(1/4)(-a)(e_2 - p) over the top-2 support {1, 2}
    g = tr.model.bias.grad.tolist()
    assert g == pytest.approx(_grad([(1, -A / 4 * P1), (2, A / 4 * P1)]), abs=1e-6)
    # every metric finite, except the on-policy difference: version 0 is not held (NaN, logged null)
    assert [k for k, x in m.items() if not math.isfinite(x)] == ["invariants/logprob_absdiff_max_onpolicy",
                                                                 "invariants/logprob_absdiff_mean_onpolicy"]
    assert m["invariants/logprob_absdiff_max"] == pytest.approx(0.0, abs=1e-6)  # over in-support tokens


def test_out_of_support_token_icepop_mask_is_rejected():
    tr = _oos_trainer(is_level="token", is_mode="mask", low=0.5, high=2.0)
    m = tr.train_step(_oos_batch())
    assert m["correction/out_of_support_frac"] == 0.25 and m["correction/masked_frac"] == 0.25
    assert m["train/action_tokens"] == 3.0
    g = tr.model.bias.grad.tolist()
    assert g == pytest.approx(_grad([(1, -A / 3 * P1), (2, A / 3 * P1)]), abs=1e-6)


def test_out_of_support_token_mask_at_level_off_is_rejected():
    """Finding 7c: ``is_level = "off"`` with ``is_mode = "mask"`` rejects the out-of-support
    token as the doc says (before: it stayed in the loss's token count with weight 0). The
    loss-token count then depends on the recompute, so the fused path is not taken."""
    tr = _oos_trainer(is_level="off", is_mode="mask", low=0.5, high=2.0)
    assert not tr.fused_recompute_ok()
    m = tr.train_step(_oos_batch())
    assert m["train/fused_recompute"] == 0.0
    assert m["correction/out_of_support_frac"] == 0.25 and m["correction/masked_frac"] == 0.25
    assert m["train/action_tokens"] == 3.0
    g = tr.model.bias.grad.tolist()  # weight 1 on the other three tokens, as IcePop's gradient
    assert g == pytest.approx(_grad([(1, -A / 3 * P1), (2, A / 3 * P1)]), abs=1e-6)
    clean = _oos_trainer(is_level="off", is_mode="mask", low=0.5, high=2.0).train_step(_oos_batch(fault=False))
    assert clean["correction/out_of_support_frac"] == 0.0 and clean["train/action_tokens"] == 4.0


def test_out_of_support_token_seq_mask_rejects_its_rollout():
    tr = _oos_trainer(is_level="seq", is_mode="mask", low=0.5, high=2.0)
    m = tr.train_step(_oos_batch())
    assert m["train/action_tokens"] == 2.0  # only rollout b
    # -(1/2)(-a)[(e_1 - p) + (e_2 - p)] = (a/2)(0, 1 - 2 p1, 1 - 2 p2)
    g = tr.model.bias.grad.tolist()
    assert g == pytest.approx(_grad([(1, A / 2 * (1 - 2 * P1)), (2, A / 2 * (1 - 2 * P2))]), abs=1e-6)


def test_out_of_support_clean_case_reads_zero():
    tr = _oos_trainer()
    m = tr.train_step(_oos_batch(fault=False))
    assert m["correction/out_of_support_frac"] == 0.0
    assert m["train/action_tokens"] == 4.0 and m["grad_norm"] > 0


# -- MoE: the older version's recompute replays the recorded routing (R3) ------------------

def test_moe_stale_tokens_are_recomputed_under_their_version_with_routing_replay():
    """A bf16 engine's rollouts trained twice by an fp32 trainer with routing replay and
    ``max_staleness = 1``: at step 2 the tokens are one version stale and are recomputed under
    version 0's weights, replaying the engine's recorded routing -- the same |delta| as step 1
    measured on-policy, while the all-token difference now includes the policy's drift."""
    import asyncio

    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.ledger import Ledger
    from molt_core.types import SamplingParams

    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=16, seed=0, dtype="bfloat16")

    async def one(i):
        led = Ledger(eng.tokenizer, group_id=f"g{i // 4}")
        p = led.prepare([{"role": "user", "content": f"What is {i} + {7 * i}?"}])
        led.commit(p, await eng.generate(p.prompt_ids, SamplingParams(max_tokens=16, seed=i)))
        return led.trajectory(reward=float(i % 2))

    async def go():
        return await asyncio.gather(*[one(i) for i in range(16)])

    try:
        trajs = asyncio.run(go())
    finally:
        eng.close()
    cfg = tiny_cfg(model={"path": "builtin:tiny-qwen3-moe", "routing_replay": True},
                   **{"async": {"max_staleness": 1}}, trainer={"lr": 1e-2})
    tr = Trainer(cfg)
    m1 = tr.train_step(trajs)
    m2 = tr.train_step(trajs)  # the same tokens, now one version stale
    # without replay the routers flip on some tokens and the difference is larger (measured:
    # max 0.005807 replayed; 0.010856 when the stale recompute does not replay): the stale
    # recompute must replay to match step 1
    off = Trainer(tiny_cfg(model={"path": "builtin:tiny-qwen3-moe", "routing_replay": False})).train_step(trajs)
    assert off["invariants/routing_flip_rate"] > 0
    assert off["invariants/logprob_absdiff_max_onpolicy"] > m1["invariants/logprob_absdiff_max_onpolicy"] + 1e-3
    assert m1["invariants/onpolicy_stale_tokens"] == 0.0
    assert m1["invariants/onpolicy_tokens"] == m1["train/action_tokens"]
    assert m2["invariants/staleness_max"] == 1.0
    assert m2["invariants/onpolicy_stale_tokens"] == m2["train/action_tokens"]
    assert m1["invariants/logprob_absdiff_max_onpolicy"] > 0  # bf16 engine vs fp32 trainer
    assert m2["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(m1["invariants/logprob_absdiff_max_onpolicy"],
                                                                          abs=1e-6)
    assert m2["invariants/logprob_absdiff_max"] > 10 * m2["invariants/logprob_absdiff_max_onpolicy"]


# -- out of the reference's support (KL) and out of its own version's support ----------------

def _k3(lp, ref):
    return math.exp(ref - lp) - (ref - lp) - 1


@pytest.mark.parametrize("estimator,as_reward", [("k3", False), ("k1", False), ("k3", True)])
def test_reference_out_of_support_keeps_kl_finite_and_is_counted(estimator, as_reward):
    """Finding 6: a sampled token inside the policy's top-2 but outside the reference's top-2
    (reference logprob -inf). Before: ``kl``, ``loss/kl``, ``loss/total`` were inf and written
    as ``Infinity``. Now the token is left out of the KL term, counted, and every metric is
    finite; the KL over the other tokens is the hand value."""
    policy, ref = [2.0, 1.0, 0.0], [0.0, 1.0, 3.0]  # top-2: policy {0, 1}, reference {1, 2}
    adv = "reinforce" if as_reward else "grpo"
    tr = Trainer(tiny_cfg(algo={"kl_coef": 0.1, "kl_estimator": estimator, "kl_as_reward": as_reward, "advantage": adv}),
                 model=BiasLM(policy), ref_model=BiasLM(ref))
    lp0, lp1 = _lp(policy, 0, top_k=2), _lp(policy, 1, top_k=2)
    batch = [_traj("a", 1.0, [2, 0, 1], [lp0, lp1], [0, 0], top_k=2),
             _traj("b", 0.0, [2, 1, 1], [lp1, lp1], [0, 0], top_k=2)]
    m = tr.train_step(batch)
    assert [k for k, x in m.items() if not math.isfinite(x)] == []
    assert bool(torch.isfinite(tr.model.bias).all())
    assert m["kl/ref_out_of_support_frac"] == 0.25
    r1 = _lp(ref, 1, top_k=2)  # -log(1 + e^2)
    want = _k3(lp1, r1) if estimator == "k3" else lp1 - r1
    assert m["kl"] == pytest.approx(want, abs=1e-6)  # the 3 tokens in the reference's support
    if not as_reward:
        assert m["loss/kl"] == pytest.approx(3 * want / 4, abs=1e-6)  # global token mean over 4
    # clean: the reference is the policy -> nothing out of support, KL 0
    tr = Trainer(tiny_cfg(algo={"kl_coef": 0.1, "kl_estimator": estimator, "kl_as_reward": as_reward, "advantage": adv}),
                 model=BiasLM(policy), ref_model=BiasLM(policy))
    m = tr.train_step(batch)
    assert m["kl/ref_out_of_support_frac"] == 0.0 and m["kl"] == pytest.approx(0.0, abs=1e-7)


def test_onpolicy_token_outside_its_own_support_is_counted_and_metrics_stay_finite():
    """An on-policy token the trainer puts outside the top-2 of the very weights that sampled
    it (an engine/trainer mismatch at the k-th boundary): counted in
    ``invariants/onpolicy_out_of_support_tokens`` (before: the max was inf, written as
    ``Infinity``); the max over the other tokens stays finite (0 here); clean case 0."""
    policy = [2.0, 1.0, 0.0]
    lp1 = _lp(policy, 1, top_k=2)
    bad = [_traj("a", 1.0, [2, 2, 1], [-1.5, lp1], [0, 0], top_k=2),  # token 2 is not in the top 2
           _traj("b", 0.0, [2, 1, 1], [lp1, lp1], [0, 0], top_k=2)]
    m = Trainer(tiny_cfg(), model=BiasLM(policy)).train_step(bad)
    assert [k for k, x in m.items() if not math.isfinite(x)] == []
    assert m["invariants/onpolicy_out_of_support_tokens"] == 1.0 and m["invariants/onpolicy_tokens"] == 4.0
    assert m["invariants/logprob_absdiff_max_onpolicy"] == 0.0
    clean = [_traj("a", 1.0, [2, 0, 1], [_lp(policy, 0, top_k=2), lp1], [0, 0], top_k=2), bad[1]]
    m = Trainer(tiny_cfg(), model=BiasLM(policy)).train_step(clean)
    assert m["invariants/onpolicy_out_of_support_tokens"] == 0.0 and m["invariants/logprob_absdiff_max_onpolicy"] == 0.0


def _two_async_steps(overlap: bool, fault: float = 0.0, wait: bool = True):
    """The tiny Qwen3 at ``async.max_staleness = 1``: step 1 on rollouts sampled by version 0,
    step 2 on rollouts also sampled by version 0 (one version stale), with ``fault`` nats added
    to one behaviour logprob of step 2's first rollout."""
    from trainer_utils import set_behaviour, synthetic_rollouts

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}, trainer={"lr": 1e-2}))
    tr.overlap_onpolicy_check = overlap
    ts0, ts1 = synthetic_rollouts(0), synthetic_rollouts(1)
    set_behaviour(tr, ts0)
    set_behaviour(tr, ts1)  # both sampled by version 0
    seg = ts1[0].segments[0]
    k = seg.loss_mask.index(True)
    seg.logprobs[k] += fault
    m0 = tr.train_step(ts0)
    if tr._check_proc is not None and wait:  # started after the first update; in line until it is ready
        assert tr._check_proc.ready(timeout=120)
    m1 = tr.train_step(ts1)
    assert m0["grad_norm"] > 0 and m1["grad_norm"] > 0 and tr.version == 2
    return tr, m1


def test_overlapped_onpolicy_check_equals_the_serial_one_and_flags_a_fault():
    """The stale rows' check runs in a child process beside the update (one process trainer,
    no images, no routing replay), reading the version history in shared memory: same metrics
    and weights as run in line, and a fault of 0.5 nats in one stale token reads 0.5."""
    tr_o, m_o = _two_async_steps(True)
    tr_s, m_s = _two_async_steps(False)
    assert tr_o._check_proc.checks == 1 and tr_s._check_proc is None  # the process was (not) used
    assert tr_o.history.ring is not None and tr_s.history.ring is None
    assert m_o["invariants/onpolicy_stale_tokens"] == m_o["train/action_tokens"] > 0
    for key in m_s:
        if not key.startswith("time/") and key != "tokens_per_s":
            assert m_o[key] == m_s[key] or (math.isnan(m_o[key]) and math.isnan(m_s[key])), key
    for (n, a), (_, b) in zip(tr_o.model.named_parameters(), tr_s.model.named_parameters()):
        assert torch.equal(a, b), n
    assert m_o["invariants/logprob_absdiff_max_onpolicy"] < 1e-4
    tr_o._check_proc.close()
    tr_f, m_f = _two_async_steps(True, fault=0.5)
    assert tr_f._check_proc.checks == 1
    assert m_f["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.5, abs=1e-4)
    tr_f._check_proc.close()


def _five_async_steps(overlap: bool, swap_slots: bool = False):
    """The tiny Qwen3 at ``async.max_staleness = 2``, lr 1e-2: five steps whose batches hold
    rows sampled by versions (0), (0), (1, 0), (2), (3) -- so the ring of 3 shared slots
    wraps around (version 3 reuses version 0's slot). ``swap_slots`` hands the check the
    held versions' slots swapped (the fault of reading the wrong version's weights)."""
    from trainer_utils import set_behaviour, synthetic_rollouts

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 2}}, trainer={"lr": 1e-2}))
    tr.overlap_onpolicy_check = overlap
    if swap_slots:
        real = tr.history.slots
        tr.history.slots = lambda: dict(zip(sorted(real()), reversed([real()[v] for v in sorted(real())])))
    a, b, e = synthetic_rollouts(0), synthetic_rollouts(1), synthetic_rollouts(4)
    for t in (a, b, e):
        set_behaviour(tr, t)  # version 0
    ms = [tr.train_step(a)]
    if overlap:
        assert tr._check_proc.ready(timeout=120)
    c = synthetic_rollouts(2)
    set_behaviour(tr, c)  # version 1
    ms.append(tr.train_step(b))  # version 0's rows at version 1
    d = synthetic_rollouts(3)
    set_behaviour(tr, d)  # version 2
    ms.append(tr.train_step(c + e))  # versions 1 and 0 at version 2
    f = synthetic_rollouts(5)
    set_behaviour(tr, f)  # version 3
    ms.append(tr.train_step(d))  # version 2 at version 3
    ms.append(tr.train_step(f))  # version 3 (in version 0's old slot) at version 4
    assert tr.version == 5 and all(m["grad_norm"] > 0 for m in ms)
    return tr, ms


def test_onpolicy_check_process_reads_each_rows_own_version_through_the_ring():
    """With the check process, each stale row is measured under the weights of the version
    that sampled it, read from the shared ring: the same readings as in line at every step
    (the step with rows of two older versions included, and after the ring wraps), all under
    1e-4 nats; handing the check the slots swapped (version 0's rows under version 1's
    weights, an lr-1e-2 step apart) reads far above it."""
    tr_o, ms_o = _five_async_steps(True)
    tr_s, ms_s = _five_async_steps(False)
    assert tr_o._check_proc.checks == 4 and len(tr_o.history.ring) == 3
    # slots: v0 -> 0 (moved in at the first check), v1 -> 1, v2 -> 2, then v3 -> 0 and v4 -> 1 (the freed ones)
    assert tr_o.history.slots() == {3: 0, 4: 1}
    for k, (m_o, m_s) in enumerate(zip(ms_o, ms_s)):
        stale = m_o["invariants/onpolicy_stale_tokens"]
        assert stale == m_s["invariants/onpolicy_stale_tokens"] and (stale > 0) == (k > 0), k
        assert m_o["invariants/logprob_absdiff_max_onpolicy"] == m_s["invariants/logprob_absdiff_max_onpolicy"] < 1e-4
    tr_o._check_proc.close()
    tr_f, ms_f = _five_async_steps(True, swap_slots=True)
    assert ms_f[2]["invariants/logprob_absdiff_max_onpolicy"] > 1e-2  # two held versions, swapped
    tr_f._check_proc.close()


def test_overlapped_onpolicy_check_only_on_a_cpu_trainer():
    """The stale rows' check runs in the check process only for a CPU trainer: on an
    accelerator a second process's kernels would contend for the device and its logits would
    sit in memory beside the update's activations. The recompute call tells which path was
    taken (in line: the trainer's own ``recompute_logprobs``); the values are the same."""
    from molt_core.train import build_batch

    calls: list[bool] = []

    def fake_recompute(batch, model=None, with_entropy=False):
        calls.append(True)
        return torch.zeros(batch.input_ids.shape), None

    for device, want_inline in (("cpu", False), ("cuda", True)):
        tr = _async_trainer()  # version 1, holds version 0
        lps = [_lp(B0, 0), _lp(B0, 1)]
        batch = build_batch([_traj("a", 1.0, [2, 0, 1], lps, [0, 0])], tr.pad_id, tr.vocab_size)
        assert tr._check_proc.ready(timeout=120)  # started after the first update (on the CPU)
        tr.device = torch.device(device)  # only the decision reads it; in line the recompute is faked
        tr.recompute_logprobs = fake_recompute
        calls.clear()
        d, rows = tr._onpolicy_stale(batch)()
        assert rows.tolist() == [0, 0]  # both tokens are row 0's
        assert bool(calls) == want_inline and tr._check_proc.checks == (0 if want_inline else 1), device
        want = [abs(x) for x in lps] if want_inline else [abs(x - _lp(B0, i)) for i, x in enumerate(lps)]
        assert d.tolist() == pytest.approx(want, abs=1e-6)  # in line |behaviour - 0|; process: the real 0
        tr._check_proc.close()


def test_a_failing_overlapped_check_raises_after_the_steps_bookkeeping():
    """The overlapped check fails only after the update moved the weights: the step still
    advances ``version`` / ``step`` (they match the weights the trainer now holds), then raises
    with the check process's error. A check process that died before the step is a clear
    error too, raised before the update."""
    import os
    import signal

    from trainer_utils import set_behaviour, synthetic_rollouts

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}, trainer={"lr": 1e-2}))
    ts0, ts1, ts2 = synthetic_rollouts(0), synthetic_rollouts(1), synthetic_rollouts(2)
    for t in (ts0, ts1, ts2):
        set_behaviour(tr, t)
    tr.train_step(ts0)
    assert tr._check_proc.ready(timeout=120)
    tr.history.slots = lambda: {0: 99}  # the child looks for a ring slot that does not exist
    before = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
    with pytest.raises(RuntimeError, match="on-policy check of step 2 failed after its update.*version 2.*"
                                           "check process failed: IndexError"):
        tr.train_step(ts1)
    assert tr.version == 2 and tr.step == 2  # the weights moved, and so did the bookkeeping
    assert any(not torch.equal(before[k], v) for k, v in tr.model.named_parameters())
    os.kill(tr._check_proc.pid, signal.SIGKILL)
    tr._check_proc._proc.wait(10)
    before = {k: v.detach().clone() for k, v in tr.model.named_parameters()}
    with pytest.raises(RuntimeError, match=r"on-policy check process died \(exit code -9\)"):
        tr.train_step(ts2)  # rows older than version 2 while version 1 is held: a check is sent
    assert tr.version == 2 and all(torch.equal(before[k], v) for k, v in tr.model.named_parameters())


def test_a_small_dev_shm_keeps_the_check_in_line_and_says_why(monkeypatch, caplog):
    """A container's /dev/shm is often 64 MiB, and writing past a tmpfs's size kills the writer
    (SIGBUS) instead of raising: when the ring would take more than half of what is free, the
    trainer logs why and runs the check in line, with the same readings (0.5 for a 0.5-nat fault)."""
    import logging

    import molt_core.train.onpolicy_check as oc

    monkeypatch.setattr(oc, "_shm_free", lambda: 1024)
    with caplog.at_level(logging.WARNING, logger="molt_core.train.trainer"):
        tr, m = _two_async_steps(True, fault=0.5)
    assert tr._check_proc is None and tr._check_proc_failed and tr.history.ring is None
    assert "runs in line" in caplog.text and "MiB free" in caplog.text and "--shm-size" in caplog.text
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.5, abs=1e-4)


def test_checks_run_in_line_until_the_process_is_ready_and_when_it_cannot_start(monkeypatch, caplog):
    """No step waits for the check process's start-up (seconds of imports): until it reports
    ready the check runs in line, with the same reading. A child that cannot start -- here the
    model's class lives in a module only the trainer has (as one defined in a script's
    ``__main__`` would) -- is logged once and the check stays in line."""
    import logging
    import sys
    import time
    import types

    from molt_core.train.onpolicy_check import CheckProcess

    monkeypatch.setattr(CheckProcess, "ready", lambda self, timeout=0.0: False)
    tr, m = _two_async_steps(True, fault=0.5, wait=False)
    assert tr._check_proc is not None and tr._check_proc.checks == 0
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.5, abs=1e-4)
    tr._check_proc.close()
    monkeypatch.undo()

    mod = types.ModuleType("molt_only_here")
    exec("import torch\nclass Lin(torch.nn.Linear):\n    pass\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, "molt_only_here", mod)
    proc = CheckProcess(mod.Lin(2, 2), 2, 4, torch.float32, 1)  # the trainer pickles it ...
    with pytest.raises(RuntimeError, match="could not start: ModuleNotFoundError.*molt_only_here"):
        proc.ready(timeout=120)  # ... the child cannot import its class
    tr = _async_trainer()
    tr._check_proc.close()
    tr._check_proc = CheckProcess(mod.Lin(2, 2), 2, 4, torch.float32, 1)
    with caplog.at_level(logging.WARNING, logger="molt_core.train.trainer"):
        deadline = time.monotonic() + 120
        while tr._check_proc is not None and time.monotonic() < deadline:  # never waits: poll until it answers
            assert tr._check_ready() is False
            time.sleep(0.05)
        assert tr._check_ready() is False  # logged once
    assert tr._check_proc is None and tr._check_proc_failed
    assert caplog.text.count("runs in line (its process could not start: the on-policy check process could not "
                             "start: ModuleNotFoundError") == 1


def _interrupted_check_steps(where: str):
    """The tiny Qwen3 at ``async.max_staleness = 2``, the check process ready: step 2 (version
    0's rows at version 1, a check in flight) is interrupted -- ``where = "update"``: the update
    raises after the check was sent; ``"wait"``: Ctrl-C while the step waits for the check's
    reply -- then step 3 trains version 0's rows with a 0.5-nat fault in one stale token."""
    import molt_core.train.trainer as trainer_mod
    from trainer_utils import set_behaviour, synthetic_rollouts

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 2}}, trainer={"lr": 1e-2}))
    ts0, ts1, ts2 = synthetic_rollouts(0), synthetic_rollouts(1), synthetic_rollouts(2)
    for t in (ts0, ts1, ts2):
        set_behaviour(tr, t)  # version 0
    seg = ts2[0].segments[0]
    seg.logprobs[seg.loss_mask.index(True)] += 0.5
    tr.train_step(ts0)
    assert tr._check_proc.ready(timeout=120)
    proc = tr._check_proc
    if where == "update":
        real = trainer_mod.policy_update

        def fails(*a, **k):
            trainer_mod.policy_update = real
            raise MemoryError("no room for the update")

        trainer_mod.policy_update = fails
        with pytest.raises(MemoryError):
            tr.train_step(ts1)
        trainer_mod.policy_update = real
    else:
        real_recv = type(proc)._recv

        def interrupted(self):
            proc._recv = real_recv.__get__(proc)
            raise KeyboardInterrupt

        proc._recv = interrupted.__get__(proc)
        with pytest.raises(KeyboardInterrupt):
            tr.train_step(ts1)
    assert proc.checks == 1
    return tr, tr.train_step(ts2)


@pytest.mark.parametrize("where", ["update", "wait"])
def test_a_step_interrupted_with_a_check_in_flight_leaves_the_next_check_right(where):
    """A step that raises (or is interrupted by Ctrl-C, e.g. in a notebook) while its check is
    in flight leaves that check's reply unread: the next step's check drops it and reads its own
    -- the 0.5-nat fault of the next batch reads 0.5 (it was an internal error after a failed
    update, and after Ctrl-C in the wait the next step took the interrupted step's reply, ~0: a
    fault missed)."""
    tr, m = _interrupted_check_steps(where)
    assert tr._check_proc.checks == 2
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.5, abs=1e-4)
    tr._check_proc.close()


def test_starting_the_check_process_does_not_wait_for_the_child(monkeypatch):
    """The model (MBs: more than a pipe holds) reaches the child while the trainer goes on: a
    child still importing (here one that never reads) does not hold up the step that starts it
    (it blocked in the write until the child had imported torch: 1.8 s of the tiny Qwen3's
    first step on 2 cores)."""
    import subprocess
    import sys
    import threading

    from molt_core.train.onpolicy_check import CheckProcess

    real = subprocess.Popen
    children: list = []

    def never_reads(args, **kw):
        children.append(real([sys.executable, "-c", "import time; time.sleep(120)"], **kw))
        return children[-1]

    monkeypatch.setattr(subprocess, "Popen", never_reads)
    made: list = []
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights, pickled
    t = threading.Thread(target=lambda: made.append(CheckProcess(model, 2, 4, torch.float32, 1)), daemon=True)
    t.start()
    t.join(60)
    done = not t.is_alive()
    children[0].kill()  # (the old code: unblocks the write, which fails)
    t.join(10)
    assert done and made[0].ready() is False
    made[0].close()


def test_a_trainer_killed_before_the_child_is_ready_leaves_nothing_in_dev_shm(tmp_path):
    """On Linux the ring's files are unlinked as soon as the trainer has mapped them and live
    on through descriptors the child inherits, so nothing is on disk even while the child
    starts: the trainer and its child both SIGKILLed at once (a Ctrl-C that makes Ray kill the
    actor's children, OOM) leave nothing in /dev/shm. (Before: the child unlinked them once it
    had mapped them, after seconds of imports; a new user's Ctrl-C in that window left 6.5 MB.)"""
    import subprocess
    import sys

    script = ("import os, signal, sys, torch\n"
              "from molt_core.train.onpolicy_check import CheckProcess\n"
              "p = CheckProcess(torch.nn.Linear(64, 64), 2, 4, torch.float32, 1)\n"
              "print(p._tmp, p.pid, os.path.exists(p._tmp), flush=True)\n"
              "os.kill(p.pid, signal.SIGKILL)\n"
              "os.kill(os.getpid(), signal.SIGKILL)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert out.returncode == -signal.SIGKILL, out.stderr
    tmp, pid, existed = out.stdout.split()
    assert os.path.isdir(os.path.dirname(tmp)) and existed == "False"  # gone before the child was even started
    assert not os.path.exists(tmp)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("rows,shared", [(-1, False), (5, False), (-1, True)])
def test_check_process_readings_equal_in_line_token_for_token_over_micro_batches(rows, shared):
    """The check process's ``[N]`` differences equal the in-line check's exactly, token for
    token, when the batch is split into micro-batches (12 rows at ``micro_batch_size = 5``:
    5 + 5 + 2, each padded to its own longest row -- the other tests' 12 rows fit the default
    64 in one micro-batch) and with ``async.onpolicy_rows = 5`` (the same 5 rows sampled). The
    behaviour logprobs are the placeholder -1.0, so each difference is ``|-1 - logprob under
    version 0|``: every token's recompute is compared, not a zero. With ``shared`` a group's
    rollouts share their prompt, and both checks run its forward once per micro-batch
    (``trainer.shared_prefix``, the default)."""
    from molt_core.train import build_batch
    from trainer_utils import set_behaviour, synthetic_rollouts

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1, "onpolicy_rows": rows}},
                          trainer={"lr": 1e-2, "micro_batch_size": 5}))
    ts0, ts1 = synthetic_rollouts(0), synthetic_rollouts(1, shared_prompt=shared)  # ts1: version 0, behaviour -1.0
    set_behaviour(tr, ts0)
    tr.train_step(ts0)
    assert tr._check_proc.ready(timeout=120)
    batch = build_batch(ts1, tr.pad_id, tr.vocab_size)
    assert batch.size == 12 and len(tr._micro_batches(batch)) == 3
    from molt_core.train.forward import shared_prefix

    T = int(batch.lengths[:5].max())
    assert (shared_prefix(batch.input_ids[:5, :T], batch.param_ids[:5, :T]) is not None) == shared
    d_proc, rows_proc = tr._onpolicy_stale(batch)()
    assert tr._check_proc.checks == 1
    tr.overlap_onpolicy_check = False
    d_line, rows_line = tr._onpolicy_stale(batch)()
    assert tr._check_proc.checks == 1
    assert torch.equal(rows_proc, rows_line)
    n_all = int(batch.mask.sum())
    assert (d_line.numel() == n_all) if rows < 0 else (0 < d_line.numel() < n_all)  # all, or 5 rows' tokens
    assert torch.equal(d_proc, d_line) and bool((d_line > 0).all())
    d_now = (batch.behaviour_logprobs - tr.recompute_logprobs(batch)[0]).abs()[batch.mask].double()
    if rows < 0:  # the current (version 1) weights read otherwise: the process read version 0's
        assert not torch.allclose(d_now, d_line, atol=1e-4)
    tr._check_proc.close()


def test_the_ring_is_allocated_when_the_process_starts_so_a_full_dev_shm_is_an_error_not_sigbus(monkeypatch):
    """Every ring slot's pages are allocated in /dev/shm when the check process starts, so
    another user of /dev/shm (Ray's object store, growing with each publish) cannot take them
    before the slot's first write -- which then killed the trainer with SIGBUS (shown on a
    10 MiB tmpfs: a 2-slot ring of 2 MiB each, a 7 MiB file written after it, the record into
    the spare slot: exit 135; now the other writer gets ENOSPC). No room at the start is a
    MemoryError naming the fix (the trainer then checks in line), and nothing is left behind."""
    import errno
    import glob
    import subprocess
    import sys

    import molt_core.train.onpolicy_check as oc

    real = subprocess.Popen
    children: list = []

    def never_reads(args, **kw):  # a child that never maps the ring
        children.append(real([sys.executable, "-c", "import time; time.sleep(120)"], **kw))
        return children[-1]

    monkeypatch.setattr(subprocess, "Popen", never_reads)
    model = torch.nn.Linear(256, 256)
    layout, nbytes = oc.ring_layout(model)
    assert nbytes == 256 * 256 * 4 + 256 * 4  # weight, then bias (64-byte aligned)
    p = oc.CheckProcess(model, 3, 4, torch.float32, 1)
    assert not os.path.exists(p._tmp)  # unlinked at once: the slots live on in the child's descriptors
    fd_dir = f"/proc/{children[0].pid}/fd"
    slot_fds = [os.path.join(fd_dir, fd) for fd in os.listdir(fd_dir)
                if "molt-onpolicy-" in os.readlink(os.path.join(fd_dir, fd))]
    sizes = [(os.stat(f).st_size, os.stat(f).st_blocks * 512) for f in slot_fds]
    assert len(sizes) == 3 and all(size == nbytes and blocks >= nbytes for size, blocks in sizes), sizes
    children[0].kill()
    p.close()
    assert not os.path.exists(p._tmp)

    def full(fd, offset, n):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(oc.os, "posix_fallocate", full)
    before = set(glob.glob(os.path.join(oc._shm_dir() or "/nonexistent", "molt-onpolicy-*")))
    with pytest.raises(MemoryError, match=r"shared ring \(0\.8 MiB\) does not fit in .*No space left on device.*"
                                          r"--shm-size"):
        oc.CheckProcess(model, 3, 4, torch.float32, 1)
    assert len(children) == 1  # no child was started
    assert set(glob.glob(os.path.join(oc._shm_dir() or "/nonexistent", "molt-onpolicy-*"))) == before


def test_trainer_close_stops_the_check_process_and_the_check_goes_on_in_line():
    """``Trainer.close()`` stops the child (its exit code is set) and is idempotent; a later
    step's check runs in line and still reads a 0.5-nat fault as 0.5."""
    from trainer_utils import set_behaviour, synthetic_rollouts

    tr, _ = _two_async_steps(True)
    proc = tr._check_proc
    tr.close()
    tr.close()
    assert tr._check_proc is None and proc._proc.poll() is not None
    ts = synthetic_rollouts(2)
    set_behaviour(tr, ts, version=1)  # sampled "by version 1" with version 2's weights: 0 nats would be wrong
    seg = ts[0].segments[0]
    seg.logprobs[seg.loss_mask.index(True)] += 0.5
    m = tr.train_step(ts)
    assert tr._check_proc is None and m["invariants/onpolicy_stale_tokens"] > 0
    assert m["invariants/logprob_absdiff_max_onpolicy"] > 0.5 - 1e-4


def test_the_check_process_can_start_before_the_first_step():
    """``Trainer.start_check_process()`` (the run loop calls it after the warm start) starts the
    child before any update, so the first stale check already runs there; a trainer keeping no
    versions starts none. Its first step's check then goes to the process and reads a 0.5-nat
    fault as 0.5."""
    from trainer_utils import set_behaviour, synthetic_rollouts

    assert Trainer(tiny_cfg()).start_check_process() is False  # sync: no versions held
    sharded_like = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}))
    sharded_like.overlap_onpolicy_check = False  # as ShardedTrainer (the run loop calls it on every rank)
    assert sharded_like.start_check_process() is False
    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}, trainer={"lr": 1e-2}))
    assert tr.start_check_process() is True and tr._check_proc.ready(timeout=120)
    proc = tr._check_proc
    assert tr.start_check_process() is True and tr._check_proc is proc  # once
    ts0, ts1 = synthetic_rollouts(0), synthetic_rollouts(1)
    set_behaviour(tr, ts0)
    set_behaviour(tr, ts1)  # sampled by version 0, trained at version 1
    seg = ts1[0].segments[0]
    seg.logprobs[seg.loss_mask.index(True)] += 0.5
    tr.train_step(ts0)  # version 0 goes to the ring
    m = tr.train_step(ts1)
    assert tr._check_proc.checks == 1
    assert m["invariants/onpolicy_stale_tokens"] > 0
    assert abs(m["invariants/logprob_absdiff_max_onpolicy"] - 0.5) < 1e-4
    tr.close()


# -- a non-finite recompute is refused, never out of support (issue 24, part 3) --------------

BP = [2.0, 1.0, 0.0, -1.0]  # PoisonLM: the token after id 3 gets a NaN logprob while its gate is on


def _poison_trainer(overlap=True, fuse=True):
    """A PoisonLM trainer at version 1 holding version 0 (bias BP): one step taken."""
    from trainer_utils import PoisonLM

    tr = Trainer(tiny_cfg(**{"async": {"max_staleness": 1}}, trainer={"lr": 0.1, "grad_clip": 0.0}),
                 model=PoisonLM(BP, poison=3))
    tr.overlap_onpolicy_check, tr.fuse_recompute = overlap, fuse
    tr.train_step([_traj("a", 1.0, [2, 0, 1], [_lp(BP, 0), _lp(BP, 1)], [0, 0]),
                   _traj("b", 0.0, [2, 1, 2], [_lp(BP, 1), _lp(BP, 2)], [0, 0])])
    assert tr.version == 1 and tr.history.versions() == [0]
    if overlap:
        assert tr._check_proc.ready(timeout=120)
    else:
        assert tr._check_proc is None
    return tr


def _poison_batch(version, bias, poisoned=True):
    """Rollouts a, b (clean) and p = [2, 3, 0], whose token 0 follows the poison id 3, all
    sampled by ``version`` with logits ``bias``."""
    ts = [_traj("a", 1.0, [2, 0, 1], [_lp(bias, 0), _lp(bias, 1)], [version] * 2),
          _traj("b", 0.0, [2, 1, 2], [_lp(bias, 1), _lp(bias, 2)], [version] * 2)]
    return ts + [_traj("p", 1.0, [2, 3, 0], [_lp(bias, 3), _lp(bias, 0)], [version] * 2)] if poisoned else ts


@pytest.mark.parametrize("case", ["current-fused", "current-separate", "stale-inline", "stale-process"])
def test_a_nan_recompute_refuses_its_rollout_on_current_and_stale_tokens_alike(case):
    """The recompute of one token of rollout p is NaN -- under the current weights (proximal,
    fused into the loss forward or a separate pass) or under the older version that sampled it
    (the on-policy check, in line or in the check process). Every path: the token is counted in
    ``invariants/nonfinite_logprobs``, p is refused (``ingress/refused_nonfinite``), nothing is
    out of support, and the update is exactly the one on a and b alone. (Before: the stale NaN
    was counted as out of support and p trained; the current one raised ValueError.)"""
    stale = case.startswith("stale")
    tr = _poison_trainer(overlap=case == "stale-process", fuse=case != "current-separate")
    clean = _poison_trainer(overlap=False, fuse=case != "current-separate")
    v, bias = (0, BP) if stale else (1, tr.model.bias.detach().tolist())
    if stale:  # the held copy of version 0 (in the process's shared ring for stale-process) only
        tr.history._states[0]["nan_gate"].fill_(1.0)
    else:
        tr.model.nan_gate.fill_(1.0)
    m = tr.train_step(_poison_batch(v, bias))
    want = clean.train_step(_poison_batch(v, bias, poisoned=False))
    assert m["invariants/onpolicy_out_of_support_tokens"] == 0.0 and m["correction/out_of_support_frac"] == 0.0
    assert m["invariants/nonfinite_logprobs"] == 1.0
    assert m["ingress/refused_nonfinite"] == 1.0 and m["ingress/refused_rollouts"] == 1.0
    assert m["train/rollouts"] == 2.0 and m["train/action_tokens"] == 4.0
    assert m["invariants/onpolicy_tokens"] == 4.0 and m["invariants/onpolicy_stale_tokens"] == (4.0 if stale else 0.0)
    assert m["invariants/logprob_absdiff_max_onpolicy"] == pytest.approx(0.0, abs=1e-6)
    assert tr.version == 2 and torch.equal(tr.model.bias, clean.model.bias)  # as if p never came
    for k in ("loss/total", "grad_norm", "correction/is_weight_mean"):
        assert m[k] == want[k], k
    assert want["invariants/nonfinite_logprobs"] == 0.0 and want["ingress/refused_nonfinite"] == 0.0
    if case == "stale-process":
        assert tr._check_proc.checks == 2  # the refused try's check and the redo's
        tr._check_proc.close()
    # clean case: the same batch with the gate off reads 0 and trains all three rollouts
    tr = _poison_trainer(overlap=False, fuse=case != "current-separate")
    m = tr.train_step(_poison_batch(v, BP if stale else tr.model.bias.detach().tolist()))
    assert m["invariants/nonfinite_logprobs"] == 0.0 and m["ingress/refused_nonfinite"] == 0.0
    assert m["train/rollouts"] == 3.0 and m["invariants/onpolicy_tokens"] == 6.0


def test_a_nan_reference_recompute_refuses_its_rollout():
    """The frozen reference's logprob of p's token is NaN: refused and counted like a NaN
    proximal logprob (before: counted as out of the reference's support,
    ``kl/ref_out_of_support_frac`` 1/6, and p trained)."""
    from trainer_utils import PoisonLM

    ref = PoisonLM(BP, poison=3)
    ref.nan_gate.fill_(1.0)
    tr = Trainer(tiny_cfg(algo={"kl_coef": 0.1}), model=PoisonLM(BP, poison=3), ref_model=ref)
    m = tr.train_step(_poison_batch(0, BP))
    assert m["kl/ref_out_of_support_frac"] == 0.0 and m["train/rollouts"] == 2.0
    assert m["invariants/nonfinite_logprobs"] == 1.0 and m["ingress/refused_nonfinite"] == 1.0


def test_every_rollout_refused_for_nan_skips_the_step():
    """A NaN in every rollout's recompute: all refused, no optimizer step (``train/skipped``)."""
    tr = _poison_trainer(overlap=False)
    tr.model.nan_gate.fill_(1.0)
    b1 = tr.model.bias.detach().tolist()
    ts = [_traj(r, float(i), [2, 3, 0], [_lp(b1, 3), _lp(b1, 0)], [1, 1]) for i, r in enumerate("pq")]
    m = tr.train_step(ts)
    assert m["train/skipped"] == 1.0 and m["train/rollouts"] == 0.0 and tr.version == 1
    assert m["invariants/nonfinite_logprobs"] == 2.0 and m["ingress/refused_nonfinite"] == 2.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_behaviour_logprob_is_refused_at_ingress_and_counted(bad):
    """The engine's behaviour logprob of one sampled token is NaN / +inf / -inf (written past
    the Segment validator): the rollout is refused at ingress and counted in
    ``invariants/nonfinite_logprobs`` and ``ingress/refused_nonfinite``; clean case 0."""
    ts = _poison_batch(0, BP, poisoned=False) + [_traj("c", 1.0, [2, 0, 1], [_lp(BP, 0), _lp(BP, 1)], [0, 0])]
    m = Trainer(tiny_cfg(), model=BiasLM(BP)).train_step(ts)
    assert m["invariants/nonfinite_logprobs"] == 0.0 and m["ingress/refused_nonfinite"] == 0.0
    ts[2].segments[0].logprobs[2] = bad
    m = Trainer(tiny_cfg(), model=BiasLM(BP)).train_step(ts)
    assert m["invariants/nonfinite_logprobs"] == 1.0 and m["ingress/refused_nonfinite"] == 1.0
    assert m["ingress/refused_malformed"] == 1.0 and m["ingress/refused_rollouts"] == 1.0
    assert m["train/rollouts"] == 2.0


def test_stale_absdiff_marks_nan_and_plus_inf_apart_from_out_of_support_and_metrics_refuse_nan():
    """``stale_absdiff``: a recompute of -inf (out of support) is an infinite difference, NaN
    and +inf are NaN; ``onpolicy_metrics`` counts the infinite one as out of support and
    raises on a NaN (before: both were counted as out of support)."""
    from molt_core.train import build_batch
    from molt_core.train.version_history import stale_absdiff

    h = VersionHistory(1)
    h.record(0, BiasLM(BP))
    batch = build_batch(_poison_batch(0, BP), 0, 4)
    fake = torch.full(batch.input_ids.shape, -1.0)
    fake[0, 1], fake[1, 2], fake[2, 2] = -math.inf, math.nan, math.inf
    d, rows = stale_absdiff(batch, 1, h, lambda b, m: fake[:b.size], BiasLM(BP))
    beh = batch.behaviour_logprobs[batch.mask].double()
    want = (beh + 1.0).abs()
    want[0], want[3], want[5] = math.inf, math.nan, math.nan
    assert torch.equal(d.isnan(), want.isnan()) and torch.equal(d[~d.isnan()], want[~want.isnan()])
    assert rows.tolist() == [0, 0, 1, 1, 2, 2]
    m = onpolicy_metrics(torch.zeros(0), d[~d.isnan()])
    assert m["invariants/onpolicy_out_of_support_tokens"] == 1.0 and m["invariants/onpolicy_tokens"] == 4.0
    with pytest.raises(ValueError, match="NaN logprob difference.*refuse their rollouts"):
        onpolicy_metrics(torch.zeros(0), d)


def _epochs_trainer():
    """A PoisonLM trainer at version 0 with 2 PPO epochs (separate recompute); its first
    optimizer step turns the poison gate on, so only epoch 1's loss forward is NaN on p."""
    from trainer_utils import PoisonLM

    tr = Trainer(tiny_cfg(trainer={"lr": 0.1, "grad_clip": 0.0, "ppo_epochs": 2}), model=PoisonLM(BP, poison=3))
    tr.optimizer.register_step_post_hook(lambda opt, args, kwargs: tr.model.nan_gate.fill_(1.0))
    return tr


def _adam_state(tr):
    return [{k: v.clone() for k, v in tr.optimizer.state[p].items()} for p in tr.params]


def test_a_nan_in_a_later_ppo_epoch_refuses_its_rollout_with_the_weights_restored():
    """ppo_epochs = 2: the recompute is finite, but epoch 1's loss forward (after epoch 0's
    optimizer step) is NaN on p's token. The token is counted in
    ``invariants/nonfinite_logprobs``, p refused, and the step redone on a and b from the
    weights and AdamW state before the update: bit-identical to a trainer that never saw p.
    (Before: the NaN was taken for out of support in that epoch, silently, and p trained.)"""
    tr = _epochs_trainer()
    clean = Trainer(tiny_cfg(trainer={"lr": 0.1, "grad_clip": 0.0, "ppo_epochs": 2}), model=BiasLM(BP))
    m = tr.train_step(_poison_batch(0, BP))
    want = clean.train_step(_poison_batch(0, BP, poisoned=False))
    assert m["invariants/nonfinite_logprobs"] == 1.0 and m["ingress/refused_nonfinite"] == 1.0
    assert m["ingress/refused_rollouts"] == 1.0 and m["train/rollouts"] == 2.0
    assert m["correction/out_of_support_frac"] == 0.0
    assert tr.version == clean.version == 1 and tr.step == 1
    assert torch.equal(tr.model.bias, clean.model.bias)
    got, ref = _adam_state(tr), _adam_state(clean)
    assert [sorted(s) for s in got] == [sorted(s) for s in ref] == [["exp_avg", "exp_avg_sq", "step"]]
    assert all(torch.equal(g[k], r[k]) for g, r in zip(got, ref) for k in g)  # step 1, not 2 or 3
    for k in ("loss/total", "grad_norm", "lr"):
        assert m[k] == want[k], k
    assert want["invariants/nonfinite_logprobs"] == 0.0


def test_a_nan_in_a_later_ppo_epoch_on_every_rollout_skips_the_step_untouched():
    """Every rollout's epoch-1 forward is NaN: all refused, weights and AdamW state as before
    the step (no state at all: no optimizer step counts), version and step stay."""
    tr = _epochs_trainer()
    before = tr.model.bias.detach().clone()
    ts = [_traj(r, float(i), [2, 3, 0], [_lp(BP, 3), _lp(BP, 0)], [0, 0]) for i, r in enumerate("pq")]
    m = tr.train_step(ts)
    assert m["train/skipped"] == 1.0 and m["train/rollouts"] == 0.0
    assert m["invariants/nonfinite_logprobs"] == 2.0 and m["ingress/refused_nonfinite"] == 2.0
    assert tr.version == 0 and tr.step == 0 and torch.equal(tr.model.bias, before)
    assert all(len(tr.optimizer.state[p]) == 0 for p in tr.params)
