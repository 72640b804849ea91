"""KL estimators k1/k2/k3 (Schulman 2020) and the adaptive KL controller (Ziegler et al. 2019)."""

import math

import pytest
import torch

from molt_core.algo.kl import AdaptiveKLController, kl_estimate, kl_loss

torch.set_num_threads(1)


def test_k1_k2_k3_by_hand():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    # log r = ref - lp = [-0.5, 1.0]
    assert kl_estimate(lp, ref, "k1").tolist() == [[0.5, -1.0]]
    assert kl_estimate(lp, ref, "k2").tolist() == [[0.125, 0.5]]
    k3 = kl_estimate(lp, ref, "k3")[0].tolist()
    assert k3 == pytest.approx([math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1], abs=1e-15)
    assert k3 == pytest.approx([0.10653066, 0.71828183], abs=1e-8)


def test_k1_k3_unbiased_on_exact_expectation():
    # E_{x~p}[k] over a categorical, enumerated exactly: k1 and k3 give KL(p||q), k2 does not.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    kl = float((p * (p.log() - q.log())).sum())
    for est in ("k1", "k3"):
        assert float((p * kl_estimate(p.log(), q.log(), est)).sum()) == pytest.approx(kl, abs=1e-15)
    assert float((p * kl_estimate(p.log(), q.log(), "k2")).sum()) != pytest.approx(kl, abs=1e-3)


def test_kl_loss_global_token_mean_and_grad():
    lp = torch.tensor([[-1.0, -2.0, -5.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    loss = kl_loss(lp, ref, mask, 4, "k3")
    assert loss.item() == pytest.approx((0.10653066 + 0.71828183) / 4, abs=1e-8)
    loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp)
    assert lp.grad[0].tolist() == pytest.approx([(1 - math.exp(-0.5)) / 4, (1 - math.e) / 4, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(lp, ref, "k4")


def test_adaptive_kl_controller():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # error clipped to +0.2: 0.1 * (1 + 0.2 * 256 / 10000)
    assert c.update(9.0, n_steps=256) == pytest.approx(0.100512, abs=1e-15)
    # error -0.1: * (1 - 0.1 * 100 / 10000)
    assert c.update(5.4, n_steps=100) == pytest.approx(0.100512 * 0.999, abs=1e-15)
    d = AdaptiveKLController(1.0, 1.0, 1)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value and d.target == 6.0 and d.horizon == 10000
    with pytest.raises(ValueError, match="kl_target"):
        AdaptiveKLController(0.1, 0.0, 10)


# -- issue 11 item 5: one token at +100 nats must not poison the step ---------------------
E20 = math.exp(20.0)  # e^LOG_RATIO_BOUND = 485165195.4097903


def test_k3_of_plus_100_nats_is_finite_tangent_beyond_20():
    lp = torch.tensor([[-101.0, -21.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    # log r = [100, 20, 0]; k3 = expm1(20) + e^20 * (100 - 20) - 100 = 81 e^20 - 101 beyond the bound
    k3 = kl_estimate(lp, ref, "k3")
    assert k3[0].tolist() == pytest.approx([81 * E20 - 101, E20 - 21, 0.0], rel=1e-15, abs=0)
    k3.sum().backward()
    # d k3 / d lp = 1 - e^min(log r, 20): the slope is capped at 1 - e^20, sign kept (towards ref)
    assert lp.grad[0].tolist() == pytest.approx([1 - E20, 1 - E20, 0.0], rel=1e-15, abs=0)


def test_k3_continuous_at_the_bound_and_exact_below():
    lp = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[19.0, 20.0 - 1e-6, 20.0 + 1e-6]], dtype=torch.float64)
    below, under, over = kl_estimate(lp, ref, "k3")[0].tolist()
    assert below == pytest.approx(math.expm1(19.0) - 19.0, rel=1e-15)  # exact below the bound
    assert under == pytest.approx(math.expm1(20.0 - 1e-6) - (20.0 - 1e-6), rel=1e-12)
    assert over == pytest.approx(math.expm1(20.0) + E20 * 1e-6 - (20.0 + 1e-6), rel=1e-12)
    assert abs(over - under) < 2 * E20 * 1e-6 + 1e-6  # value continuous (slope e^20 - 1 both sides)


def test_k3_float32_and_bf16_stay_finite():
    for dt in (torch.float32, torch.bfloat16):
        lp = torch.tensor([[-101.0]], dtype=dt, requires_grad=True)
        ref = torch.tensor([[-1.0]], dtype=dt)
        k3 = kl_estimate(lp, ref, "k3")
        assert k3.dtype == torch.float32
        assert k3.item() == pytest.approx(81 * E20 - 101, rel=1e-6)
        k3.sum().backward()
        assert torch.isfinite(lp.grad).all()


def test_k2_and_k1_of_plus_100_nats():
    lp = torch.tensor([[-101.0]], dtype=torch.float32)
    ref = torch.tensor([[-1.0]], dtype=torch.float32)
    assert kl_estimate(lp, ref, "k2").item() == 5000.0
    assert kl_estimate(lp, ref, "k1").item() == -100.0


def test_kl_loss_poisoned_token_masked_or_not_keeps_grad_finite():
    # before the bound: value inf (token counted) or grad NaN (token masked: where() sends 0 * inf)
    for counted, value, g in ((True, (81 * E20 - 101 + 0.71828183) / 2, 1 - E20), (False, 0.71828183 / 2, 0.0)):
        lp = torch.tensor([[-101.0, -2.0]], dtype=torch.float32, requires_grad=True)
        ref = torch.tensor([[-1.0, -1.0]], dtype=torch.float32)
        mask = torch.tensor([[counted, True]])
        loss = kl_loss(lp, ref, mask, 2, "k3")
        assert loss.item() == pytest.approx(value, rel=1e-6)
        loss.backward()
        assert lp.grad[0].tolist() == pytest.approx([g / 2, (1 - math.e) / 2], rel=1e-6)


def _k3(x: float) -> float:
    """k3 with the documented tangent continuation above LOG_RATIO_BOUND (float64)."""
    return math.expm1(min(x, 20.0)) + math.exp(20.0) * max(x - 20.0, 0.0) - x


def test_kl_as_reward_through_the_real_trainer_stays_finite(monkeypatch):
    """Finding 11: the poisoned token goes through ``Trainer.train_step`` (reinforce with
    ``kl_as_reward``); the per-token rewards the trainer hands to ``compute_advantages`` are
    read there, not re-typed."""
    import molt_core.train.trainer as trainer_mod  # patched where train_step looks it up
    from molt_core.train import Trainer
    from molt_core.types import SampledSpan, Segment, Trajectory
    from trainer_utils import BiasLM, tiny_cfg

    seen = {}
    real = trainer_mod.compute_advantages

    def spy(*a, **k):
        seen["token_rewards"] = k["token_rewards"].clone()
        return real(*a, **k)

    monkeypatch.setattr(trainer_mod, "compute_advantages", spy)
    pol, ref = [0.0, -100.0, 0.0], [0.0, 0.0, 0.0]  # token 1: -100.69 nats under the policy, -1.10 under ref
    cfg = tiny_cfg(algo={"advantage": "reinforce", "kl_coef": 0.1, "kl_as_reward": True},
                   trainer={"grad_clip": 0.0, "lr": 1e-3})
    tr = Trainer(cfg, model=BiasLM(pol), ref_model=BiasLM(ref))
    lse = math.log(2 + math.exp(-100.0))
    lp_pol = [0.0 - lse, -100.0 - lse]  # tokens 0 and 1 under the policy (float64)
    lp_ref = -math.log(3.0)
    traj = Trajectory(rollout_id="a", group_id="g", reward=1.0, segments=[Segment(
        token_ids=[2, 1, 0], loss_mask=[False, True, True], logprobs=[None, lp_pol[1], lp_pol[0]],
        versions=[None, 0, 0], spans=[SampledSpan(start=1, end=3, temperature=1.0)])])
    m = tr.train_step([traj])
    tok = seen["token_rewards"][0].tolist()
    x1, x0 = lp_ref - lp_pol[1], lp_ref - lp_pol[0]  # 99.59 and -0.405 nats
    assert x1 == pytest.approx(99.5945, abs=1e-4)
    assert tok == pytest.approx([0.0, -0.1 * _k3(x1), -0.1 * _k3(x0)], rel=1e-5)
    assert tok[1] == pytest.approx(-0.1 * (80.5945 * math.exp(20.0) - 100.5945), rel=1e-5)  # -3.91e9, finite
    assert all(math.isfinite(v) for v in m.values() if isinstance(v, float))
    assert m["kl"] == pytest.approx((_k3(x1) + _k3(x0)) / 2, rel=1e-5)
    assert torch.isfinite(tr.model.bias).all()


def test_estimators_are_finite_for_every_finite_input():
    """The docstring's claim, at its edges: log r is clamped to +-LOG_RATIO_MAX (1e4) first,
    so k3's linear tangent (which would overflow float32 near 7e29) and k2's square (2.6e19)
    stay finite; beyond the clamp the estimate is constant and its gradient 0."""
    from molt_core.algo.kl import LOG_RATIO_MAX

    assert LOG_RATIO_MAX == 1e4
    k3_max = _k3(1e4)  # e^20 * (1 + 1e4 - 20) - 1e4 = 4.84e12
    for x in (1e4, 1e20, 1e31, 3e38):
        lp = torch.tensor([[-x]], dtype=torch.float32, requires_grad=True)
        ref = torch.zeros(1, 1)
        k3 = kl_estimate(lp, ref, "k3")
        k3.sum().backward()
        assert k3.item() == pytest.approx(k3_max, rel=1e-6)
        assert lp.grad.item() == (0.0 if x > 1e4 else pytest.approx(1 - math.exp(20.0), rel=1e-6))
        assert kl_estimate(lp.detach(), ref, "k2").item() == 5e7
        assert kl_estimate(lp.detach(), ref, "k1").item() == -1e4
    # the other side: log r = -3e38 (policy far above the reference)
    lp = torch.tensor([[0.0]]); ref = torch.tensor([[-3e38]])
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.expm1(-1e4) + 1e4, rel=1e-9)
    assert kl_estimate(lp, ref, "k2").item() == 5e7 and kl_estimate(lp, ref, "k1").item() == 1e4


def test_adaptive_kl_controller_non_finite_kl():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10)
    assert c.update(float("nan")) == 0.1  # no information: unchanged, never NaN
    assert c.update(float("inf")) == pytest.approx(0.1 * 1.02, abs=1e-15)  # error clipped to +0.2
    assert c.update(81 * E20 - 101) == pytest.approx(0.1 * 1.02 * 1.02, abs=1e-15)
