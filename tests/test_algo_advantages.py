"""Advantage estimators: exact values from issue 4 and hand computation."""

import math

import pytest
import torch

from molt_core.algo.advantages import gae, grpo, reinforce_baseline, rloo, rloo_norm
from molt_core.train.algorithms import compute_advantages
from molt_core.config import AlgoSection

torch.set_num_threads(1)


def close(t, expected, atol=1e-6):
    """Elementwise |t - expected| <= atol (rtol 0); expected may be nested lists."""
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=0)


def _one_token_each(R):
    """R rollouts, one row each, one sampled token per row."""
    return torch.arange(R), torch.ones(R, 1, dtype=torch.bool)


def _adv(name, rewards, groups, **kw):
    cfg = AlgoSection(advantage=name, **kw)
    r = torch.tensor(rewards, dtype=torch.float32)
    g = torch.tensor(groups, dtype=torch.long)
    ri, mask = _one_token_each(len(rewards))
    adv, ret = compute_advantages(cfg, r, g, ri, mask)
    assert ret is None
    return adv[:, 0]


def test_grpo_one_group_sample_std():
    assert _adv("grpo", [1, 0, 0, 0], [0] * 4, adv_eps=0.0).tolist() == [1.5, -0.5, -0.5, -0.5]
    # with the default eps the value moves only by eps/std
    assert _adv("grpo", [1, 0, 0, 0], [0] * 4).tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)


def test_rloo_one_group():
    assert _adv("rloo", [1, 0, 0, 0], [0] * 4).tolist() == pytest.approx([1, -1 / 3, -1 / 3, -1 / 3], abs=1e-7)


def test_singleton_group_is_zero_and_groups_are_separate():
    a = _adv("grpo", [1, 0, 0, 0, 5.0], [0, 0, 0, 0, 1], adv_eps=0.0)
    assert a.tolist() == [1.5, -0.5, -0.5, -0.5, 0.0]
    assert _adv("rloo", [7.0], [3]).tolist() == [0.0]
    assert _adv("rloo_norm", [7.0], [3]).tolist() == [0.0]


def test_constant_group_is_exactly_zero():
    # float64 mean of equal values may carry a ~1e-17 residue; it must never be divided by.
    for v in (0.35, 0.1, 1.0 / 3.0):
        for name in ("grpo", "dr_grpo", "rloo_norm", "reinforce_baseline"):
            assert _adv(name, [v] * 8, [0] * 8).tolist() == [0.0] * 8, (name, v)


def test_dr_grpo_no_std():
    assert _adv("dr_grpo", [1, 0, 0, 0], [0] * 4).tolist() == [0.75, -0.25, -0.25, -0.25]


def test_reinforce_baseline_batch_std():
    # group means: g0 0.25 -> [.75,-.25,-.25,-.25], g1 [0,0]; batch pop std over 6 rollouts = sqrt(0.75/6)
    a = _adv("reinforce_baseline", [1, 0, 0, 0, 2, 2], [0, 0, 0, 0, 1, 1], adv_eps=0.0)
    s = math.sqrt(0.125)
    assert a.tolist() == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0], abs=1e-6)
    assert a[0].item() == pytest.approx(2.1213203, abs=1e-6)


def test_b14_leave_one_out_normalised_singleton_exact():
    a = _adv("rloo_norm", [0.35] * 7 + [0.0], [0] * 8)
    # the 0.0 rollout: others all 0.35 -> LOO std exactly 0 -> not divided -> exactly -0.35
    assert a[7] == torch.tensor(-0.35, dtype=torch.float32)
    # each 0.35: LOO mean 0.3, LOO sample std sqrt((6*0.05^2 + 0.3^2)/6) = sqrt(0.0175)
    assert a[:7].tolist() == pytest.approx([0.05 / math.sqrt(0.0175)] * 7, rel=1e-5)
    assert a.max() < 0.5


def test_b14_control():
    a = _adv("rloo_norm", [1.0] * 7 + [0.0], [0] * 8)
    assert a[7].item() == -1.0
    assert a[:7].tolist() == pytest.approx([math.sqrt(1 / 7)] * 7, rel=1e-5)
    assert a.max() < 0.5


def test_b14_case_is_meaningful_naive_fp32_residue():
    # A one-pass fp32 LOO variance leaves a ~1e-4 std for the singleton: dividing by it is the bug.
    x = torch.tensor([0.35] * 7 + [0.0])
    s, q = x.sum() - x[7], (x * x).sum() - x[7] ** 2
    naive = torch.sqrt(torch.clamp((q - s * s / 7) / 6, min=0))
    assert naive.item() > 1e-5
    assert rloo_norm(x, torch.zeros(8, dtype=torch.long))[7].item() == pytest.approx(-0.35, abs=1e-7)


def test_multi_segment_rollout_counts_one_reward():
    # rollout 0 has 3 segments (rows 0,1,2); rollouts 1..3 one each. Rewards [1,0,0,0], one group.
    rewards = torch.tensor([1.0, 0, 0, 0])
    groups = torch.zeros(4, dtype=torch.long)
    rollout_index = torch.tensor([0, 0, 0, 1, 2, 3])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    for name, hi, lo in (("grpo", 1.5, -0.5), ("rloo", 1.0, -1 / 3)):
        adv, _ = compute_advantages(AlgoSection(advantage=name, adv_eps=0.0), rewards, groups, rollout_index, mask)
        want = torch.tensor([hi, hi, hi, lo, lo, lo])[:, None] * mask
        close(adv, want.tolist(), atol=1e-7)
        assert (adv[~mask] == 0).all()


def test_reinforce_discounted_across_segments_whitened():
    # rollout 0: two segments, sampled tokens (0,0),(0,1),(1,1), reward 1; rollout 1: token (2,0), reward 0.
    # gamma 0.5 -> returns [0.25, 0.5, 1] and [0]; whitened with population std over the 4 tokens.
    mask = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 0, 0]], dtype=torch.bool)
    cfg = AlgoSection(advantage="reinforce", gamma=0.5, adv_eps=0.0)
    adv, _ = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 0, 1]), mask)
    g = [0.25, 0.5, 1.0, 0.0]
    m = sum(g) / 4
    s = math.sqrt(sum((x - m) ** 2 for x in g) / 4)  # sqrt(0.13671875)
    want = [(x - m) / s for x in g]  # [-0.507093, 0.169031, 1.521278, -1.183216]
    got = [adv[0, 0], adv[0, 1], adv[1, 1], adv[2, 0]]
    assert [float(x) for x in got] == pytest.approx(want, abs=1e-6)
    assert float(got[2]) == pytest.approx(1.521278, abs=1e-6)
    assert adv[~mask].abs().sum() == 0


def test_reinforce_token_rewards():
    # KL penalty as token reward: row0 rew [-0.2, -0.2+1], row1 [-0.4]; gamma 0.5 -> G [0.2, 0.8, -0.4]
    mask = torch.ones(2, 2, dtype=torch.bool)
    mask[1, 1] = False
    tr = torch.tensor([[-0.2, -0.2], [-0.4, 99.0]])
    cfg = AlgoSection(advantage="reinforce", gamma=0.5, adv_eps=0.0)
    adv, _ = compute_advantages(cfg, torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.tensor([0, 1]), mask,
                                token_rewards=tr)
    s = math.sqrt(0.24)
    close(adv, [[0.0, 0.6 / s], [-0.6 / s, 0.0]])


def test_gae_three_steps_by_hand():
    # values 0.5, 0.6, 0.7; reward 1 at the end; gamma 0.9, lam 0.8
    # delta = [0.9*0.6-0.5, 0.9*0.7-0.6, 1-0.7] = [0.04, 0.03, 0.3]
    # A2 = 0.3, A1 = 0.03 + 0.72*0.3 = 0.246, A0 = 0.04 + 0.72*0.246 = 0.21712; returns = A + V
    mask = torch.tensor([[False, True, True, True]])
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7]])
    cfg = AlgoSection(advantage="gae", gamma=0.9, lam=0.8)
    adv, ret = compute_advantages(cfg, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0]), mask, values=values)
    close(adv, [[0.0, 0.21712, 0.246, 0.3]])
    close(ret, [[0.0, 0.71712, 0.846, 1.0]])


def test_gae_lam1_gamma1_is_return_minus_value():
    mask = torch.ones(1, 3, dtype=torch.bool)
    values = torch.tensor([[0.2, -0.1, 0.4]])
    adv, ret = gae(torch.tensor([2.0]), torch.tensor([0]), mask, values, gamma=1.0, lam=1.0)
    close(adv, [[1.8, 2.1, 1.6]])
    close(ret, [[2.0, 2.0, 2.0]])


def test_on_policy_distill():
    mask = torch.tensor([[True, True, False]])
    s = torch.tensor([[-1.0, -2.0, -3.0]])
    t = torch.tensor([[-1.5, -1.0, 0.0]])
    adv, _ = compute_advantages(AlgoSection(advantage="on_policy_distill", distill_coef=0.5), torch.tensor([0.0]),
                                torch.tensor([0]), torch.tensor([0]), mask, student_logprobs=s, teacher_logprobs=t)
    assert adv.tolist() == [[-0.25, 0.5, 0.0]]


def test_errors_name_the_argument():
    r, g = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    ri, mask = _one_token_each(2)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AlgoSection(advantage="gae"), r, g, ri, mask)
    with pytest.raises(ValueError, match="token_rewards"):
        compute_advantages(AlgoSection(advantage="grpo"), r, g, ri, mask, token_rewards=torch.zeros(2, 1))
    with pytest.raises(ValueError, match="rollout_index"):
        compute_advantages(AlgoSection(), r, g, torch.tensor([0, 2]), mask)
    with pytest.raises(ValueError, match="rewards"):
        compute_advantages(AlgoSection(), torch.tensor([1.0, float("nan")]), g, ri, mask)
    with pytest.raises(ValueError, match="student_logprobs"):
        compute_advantages(AlgoSection(advantage="on_policy_distill"), r, g, ri, mask)


def test_direct_functions_agree_with_dispatch():
    r = torch.tensor([3.0, 1.0, 2.0, 0.5, 0.5, 4.0])
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    assert grpo(r, g, eps=0.0)[:3].tolist() == pytest.approx([1.0, -1.0, 0.0], abs=1e-12)
    assert rloo(r, g)[:3].tolist() == pytest.approx([1.5, -1.5, 0.0], abs=1e-12)
    assert reinforce_baseline(r, g, eps=0.0).abs().sum() > 0
