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
