"""Policy losses: PPO clip / dual clip, GSPO, CISPO hand-computed; global-token aggregation (B15)."""

import math

import pytest
import torch

from molt_core.algo.losses import aggregate_tokens
from molt_core.train.algorithms import policy_loss
from molt_core.config import AlgoSection

torch.set_num_threads(1)


def close(t, expected, atol=1e-6):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=0)


def _inputs(ratios, logprobs=None):
    """logprobs (leaf, requires grad) and proximal logprobs giving the requested ratios, [1, N]."""
    n = len(ratios)
    lp = torch.tensor([logprobs or [-1.0] * n], dtype=torch.float64, requires_grad=True)
    prox = lp.detach() - torch.log(torch.tensor([ratios], dtype=torch.float64))
    return lp, prox


def _run(cfg, ratios, adv, num_tokens=None, mask=None, w=None, logprobs=None):
    lp, prox = _inputs(ratios, logprobs)
    a = torch.tensor([adv], dtype=torch.float64)
    mask = torch.ones_like(a, dtype=torch.bool) if mask is None else torch.tensor([mask])
    w = torch.ones_like(a) if w is None else torch.tensor([w], dtype=torch.float64)
    loss, m = policy_loss(cfg, lp, prox, a, mask, w, num_tokens or int(mask.sum()))
    loss.backward()
    return loss, m, lp.grad


def test_ppo_asymmetric_clip_by_hand():
    # r=1.5,A=1: min(1.5, 1.28)=1.28 (clipped high); r=0.5,A=-1: min(-0.5,-0.8)=-0.8 (clipped low);
    # r=1.1,A=-1: -1.1; r=0.7,A=1: min(0.7, 0.8)=0.7. loss = (-1.28+0.8+1.1-0.7)/4 = -0.02
    cfg = AlgoSection(loss="ppo", clip_low=0.2, clip_high=0.28)
    loss, m, g = _run(cfg, [1.5, 0.5, 1.1, 0.7], [1, -1, -1, 1])
    assert loss.item() == pytest.approx(-0.02, abs=1e-12)
    # d/dlogp of -r*A on unclipped tokens = -r*A, divided by 4; clipped tokens get 0
    close(g, [[0.0, 0.0, 1.1 / 4, -0.7 / 4]], atol=1e-12)
    assert m["loss/clip_frac"] == 0.5 and m["loss/clip_frac_low"] == 0.25 and m["loss/clip_frac_high"] == 0.25
    assert m["loss/ratio_min"] == pytest.approx(0.5) and m["loss/ratio_max"] == pytest.approx(1.5)
    assert m["loss/ratio_mean"] == pytest.approx(0.95)
    assert m["loss/pg"] == pytest.approx(-0.02, abs=1e-12)
    assert m["loss/tokens"] == 4.0


def test_ppo_dual_clip_by_hand():
    # A=-1: r=5 -> -min(-5, -1.2) = 5, capped at dual_clip*|A| = 3 (no gradient); r=2 -> 2 (< 3)
    cfg = AlgoSection(loss="ppo", dual_clip=3.0)
    loss, m, g = _run(cfg, [5.0, 2.0], [-1, -1])
    assert loss.item() == pytest.approx(2.5, abs=1e-12)
    close(g, [[0.0, 1.0]], atol=1e-12)  # d(-rA)/dlogp = r*1 = 2, /2 tokens
    assert m["loss/dual_clip_frac"] == 0.5
    loss, m, g = _run(AlgoSection(loss="ppo"), [5.0, 2.0], [-1, -1])
    assert loss.item() == pytest.approx(3.5, abs=1e-12)
    close(g, [[2.5, 1.0]], atol=1e-12)
    with pytest.raises(ValueError, match="dual_clip"):
        _run(AlgoSection(loss="ppo", dual_clip=1.0), [1.0], [1])


def test_gspo_sequence_ratio_by_hand():
    # row 0: token ratios 1.2, 0.9 (+ a masked pad with ratio 100) -> s = sqrt(1.08) = 1.0392305, in band
    # row 1: ratios 1.5, 1.5 -> s = 1.5, A=1 -> clipped at 1.2, no gradient
    cfg = AlgoSection(loss="gspo", clip_low=0.2, clip_high=0.2)
    r = torch.tensor([[1.2, 0.9, 100.0], [1.5, 1.5, 1.0]], dtype=torch.float64)
    lp = torch.full((2, 3), -1.0, dtype=torch.float64, requires_grad=True)
    prox = lp.detach() - torch.log(r)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    adv = torch.ones(2, 3, dtype=torch.float64)
    loss, m = policy_loss(cfg, lp, prox, adv, mask, torch.ones_like(adv), 4)
    loss.backward()
    s = math.sqrt(1.08)
    assert loss.item() == pytest.approx((-2 * s - 2 * 1.2) / 4, abs=1e-12)  # -1.1196152
    assert loss.item() == pytest.approx(-1.1196152, abs=1e-7)
    close(lp.grad, [[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]], atol=1e-12)
    assert m["loss/clip_frac_high"] == 0.5
    assert m["loss/ratio_max"] == pytest.approx(1.5)


def test_cispo_by_hand_keeps_gradient_of_clipped_tokens():
    # r = 1.5 -> weight clipped to 1.28; r = 0.5 -> 0.8; logprobs [-0.5, -1.0], A = 1
    # loss = -(1.28*-0.5 + 0.8*-1.0)/2 = 0.72; grad = -w*A/2 = [-0.64, -0.4]
    cfg = AlgoSection(loss="cispo", clip_low=0.2, clip_high=0.28)
    loss, m, g = _run(cfg, [1.5, 0.5], [1, 1], logprobs=[-0.5, -1.0])
    assert loss.item() == pytest.approx(0.72, abs=1e-12)
    close(g, [[-0.64, -0.4]], atol=1e-12)
    assert m["loss/clip_frac"] == 1.0


def test_b15_global_token_aggregation_any_cut():
    # sequence A: 1 token of loss 1; sequence B: 3 tokens of loss 3 each -> loss 2.5, every weight 1/4
    per_tok = torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    one = aggregate_tokens(per_tok, mask, 4)
    (g_one,) = torch.autograd.grad(one, per_tok)
    two = aggregate_tokens(per_tok[:1], mask[:1], 4) + aggregate_tokens(per_tok[1:], mask[1:], 4)
    (g_two,) = torch.autograd.grad(two, per_tok)
    assert one.item() == 2.5 and two.item() == 2.5
    assert g_one.tolist() == [[0.25, 0.0, 0.0], [0.25, 0.25, 0.25]]
    assert g_two.tolist() == g_one.tolist()


def test_b15_through_policy_loss_micro_batches():
    # PPO at ratio 1: token loss = -A. A = -1 (seq A), -3 (seq B) -> token losses 1 and 3 -> 2.5.
    cfg = AlgoSection(loss="ppo")
    adv = torch.tensor([[-1.0, 0.0, 0.0], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[True, False, False], [True, True, True]])
    lp = torch.full((2, 3), -0.7, requires_grad=True)
    w = torch.ones(2, 3)
    one, _ = policy_loss(cfg, lp, lp.detach(), adv, mask, w, 4)
    (g_one,) = torch.autograd.grad(one, lp)
    l1, _ = policy_loss(cfg, lp[:1], lp[:1].detach(), adv[:1], mask[:1], w[:1], 4)
    l2, _ = policy_loss(cfg, lp[1:], lp[1:].detach(), adv[1:], mask[1:], w[1:], 4)
    (g_two,) = torch.autograd.grad(l1 + l2, lp)
    assert one.item() == pytest.approx(2.5, abs=1e-6) and (l1 + l2).item() == pytest.approx(2.5, abs=1e-6)
    # d loss / d logp_t = -A_t * r / 4: each token's loss enters with weight 1/4
    close(g_one, [[0.25, 0.0, 0.0], [0.75, 0.75, 0.75]])
    close(g_two, g_one.tolist())


def test_is_weights_scale_tokens_and_num_tokens_checked():
    cfg = AlgoSection(loss="ppo")
    loss, _, g = _run(cfg, [1.0, 1.0], [1, 1], w=[0.5, 0.0])
    assert loss.item() == pytest.approx(-0.25, abs=1e-12)
    close(g, [[-0.25, 0.0]], atol=1e-12)
    with pytest.raises(ValueError, match="GLOBAL"):
        _run(cfg, [1.0, 1.0], [1, 1], num_tokens=1)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_tokens(torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.bool), 0)


def test_empty_micro_batch_is_zero_with_graph():
    cfg = AlgoSection(loss="ppo")
    loss, m, g = _run(cfg, [1.3], [1], mask=[False], num_tokens=5)
    assert loss.item() == 0.0 and m["loss/tokens"] == 0.0
    assert g.tolist() == [[0.0]]


# -- issue 11 item 5 (class): exp of a log ratio in the losses is bounded -----------------
E20 = math.exp(20.0)


def _poisoned(loss, adv, dual_clip=None):
    """Token 0 at log ratio +100 nats (current vs proximal), token 1 on-policy."""
    cfg = AlgoSection(loss=loss, clip_low=0.2, clip_high=0.2, dual_clip=dual_clip)
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float32, requires_grad=True)
    prox = torch.tensor([[-101.0, -1.0]], dtype=torch.float32)
    a = torch.tensor([[adv, adv]], dtype=torch.float32)
    mask = torch.ones_like(a, dtype=torch.bool)
    l, m = policy_loss(cfg, lp, prox, a, mask, torch.ones_like(a), 2)
    l.backward()
    return l.item(), m, lp.grad[0].tolist()


def test_ppo_plus_100_nats_positive_advantage_no_nan_grad():
    # before: ratio inf, clipped branch -> grad 0 * inf = NaN
    loss, m, g = _poisoned("ppo", 1.0)
    assert loss == pytest.approx((-1.2 - 1.0) / 2, rel=1e-6)
    assert g == [0.0, -0.5]
    assert m["loss/ratio_max"] == pytest.approx(E20, rel=1e-6)
    assert m["loss/approx_kl"] == pytest.approx((math.exp(-20) - 1 + 20) / 2, rel=1e-9)


def test_ppo_plus_100_nats_negative_advantage_finite():
    # before: loss = -min(inf * -1, ...) = inf
    loss, _, g = _poisoned("ppo", -1.0)
    assert loss == pytest.approx((E20 + 1.0) / 2, rel=1e-6)
    assert g == [0.0, 0.5]
    loss, _, g = _poisoned("ppo", -1.0, dual_clip=3.0)
    assert loss == pytest.approx((3.0 + 1.0) / 2, rel=1e-6)
    assert g == [0.0, 0.5]


def test_gspo_plus_100_nats_row_finite():
    # row log s = mean(100, 0) = 50 -> bounded to 20; s = e^20 is clipped for A > 0 (grad 0, not NaN)
    loss, m, g = _poisoned("gspo", 1.0)
    assert loss == pytest.approx(-1.2, rel=1e-6)
    assert g == [0.0, 0.0]
    assert m["loss/ratio_max"] == pytest.approx(E20, rel=1e-6)


def test_cispo_plus_100_nats_metrics_finite():
    loss, m, g = _poisoned("cispo", 1.0)
    # l = -clip(r) * A * lp: token 0 weight 1.2, token 1 weight 1; lp = -1
    assert loss == pytest.approx((1.2 + 1.0) / 2, rel=1e-6)
    assert g == pytest.approx([-0.6, -0.5], rel=1e-6)
    assert m["loss/ratio_max"] == pytest.approx(E20, rel=1e-6)
