"""Policy-version correction: staleness gate (B10) and IS weights (TIS / IcePop / seq-MIS / geo)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from molt_core.train.algorithms import apply_correction
from molt_core.config import CorrectionSection

torch.set_num_threads(1)


def close(t, expected, atol=1e-6):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=0)


def _rows(rhos, versions=None, current=0):
    """One row per list in ``rhos`` (NaN = not sampled); behaviour -1, proximal = -1 + log rho."""
    T = max(len(r) for r in rhos)
    mask = torch.zeros(len(rhos), T, dtype=torch.bool)
    beh = torch.full((len(rhos), T), -1.0, dtype=torch.float64)
    prox = beh.clone()
    for b, row in enumerate(rhos):
        for t, r in enumerate(row):
            if not math.isnan(r):
                mask[b, t] = True
                prox[b, t] = -1.0 + math.log(r)
    ver = torch.where(mask, current, -1) if versions is None else versions
    return beh, ver, prox, mask


def _apply(cfg, rhos, max_staleness=0):
    beh, ver, prox, mask = _rows(rhos)
    return apply_correction(cfg, beh, ver, prox, mask, 0, max_staleness)


def test_b10_oldest_version_decides_staleness():
    T = 128
    versions = torch.full((2, T), 8)
    versions[0, :57] = 7  # row 0: [0,57) at v7, [57,128) at v8; row 1 all at v8
    mask = torch.ones(2, T, dtype=torch.bool)
    lp = torch.full((2, T), -0.5)
    c = apply_correction(CorrectionSection(), lp, versions, lp, mask, current_version=9, max_staleness=1)
    assert c.staleness.tolist() == [2, 1]
    assert c.keep.tolist() == [False, True]
    assert c.weights[0].abs().sum() == 0 and not c.loss_mask[0].any()
    assert (c.weights[1] == 1).all()
    assert c.metrics["correction/gate_dropped"] == 1.0
    assert c.metrics["correction/gate_dropped_tokens"] == 128.0
    # measured before the gate: the violation shows
    assert c.metrics["invariants/staleness_max"] == 2.0
    assert c.metrics["correction/staleness_max_kept"] == 1.0
    assert c.metrics["correction/gated_frac"] == 0.5  # 128 of 256 sampled tokens
    assert c.metrics["correction/staleness_hist/2"] == 1.0 and c.metrics["correction/staleness_hist/1"] == 1.0
    c2 = apply_correction(CorrectionSection(), lp, versions, lp, mask, current_version=9, max_staleness=2)
    assert c2.keep.tolist() == [True, True] and c2.metrics["invariants/staleness_max"] == 2.0


def test_staleness_histogram_and_unsampled_rows():
    versions = torch.tensor([[5, -1], [4, 4], [-1, 4], [2, 5], [-1, -1]])
    mask = versions >= 0
    lp = torch.zeros(5, 2)
    c = apply_correction(CorrectionSection(), lp, versions, lp, mask, current_version=5, max_staleness=2)
    assert c.staleness.tolist() == [0, 1, 1, 3, 0]
    assert c.keep.tolist() == [True, True, True, False, True]
    hist = {k: v for k, v in c.metrics.items() if k.startswith("correction/staleness_hist/")}
    assert hist == {"correction/staleness_hist/0": 1.0, "correction/staleness_hist/1": 2.0,
                    "correction/staleness_hist/3": 1.0}
    assert c.metrics["correction/gate_dropped"] == 1.0 and c.metrics["invariants/staleness_max"] == 3.0
    assert c.metrics["correction/staleness_max_kept"] == 1.0
    assert c.metrics["correction/gated_frac"] == pytest.approx(2 / 6)


def test_fault_three_versions_stale_under_bound_one_is_flagged_and_clean_reads_zero():
    """Fault injection: a token 3 versions stale under max_staleness = 1 shows in
    invariants/staleness_max (3) and is gated (correction/gated_frac); the clean batch reads 0."""
    cfg = CorrectionSection()
    lp = torch.full((2, 3), -0.7)
    mask = torch.tensor([[False, True, True], [False, True, True]])
    clean = torch.tensor([[-1, 5, 5], [-1, 5, 5]])
    c = apply_correction(cfg, lp, clean, lp, mask, current_version=5, max_staleness=1)
    assert c.metrics["invariants/staleness_max"] == 0.0 and c.metrics["correction/gated_frac"] == 0.0
    assert c.metrics["correction/gate_dropped"] == 0.0
    fault = clean.clone()
    fault[1, 1] = 2  # one token sampled by version 2, trained at version 5
    c = apply_correction(cfg, lp, fault, lp, mask, current_version=5, max_staleness=1)
    assert c.metrics["invariants/staleness_max"] == 3.0
    assert c.keep.tolist() == [True, False]
    assert c.metrics["correction/gate_dropped"] == 1.0
    assert c.metrics["correction/gated_frac"] == 0.5  # the row's 2 of 4 sampled tokens
    assert c.weights[1].tolist() == [0.0, 0.0, 0.0]


def _two_segment_rollout():
    """Rollout 0 = rows 0 and 1 (a compaction split it), rollout 1 = row 2.
    Row 0: versions 3, 4 with rho 2, 1; row 1: versions 5, 5 with rho 1.5, 0.5; row 2: v5, rho 0.8."""
    beh = torch.full((3, 2), -1.0, dtype=torch.float64)
    rhos = torch.tensor([[2.0, 1.0], [1.5, 0.5], [0.8, 1.0]], dtype=torch.float64)
    prox = beh + rhos.log()
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    ver = torch.tensor([[3, 4], [5, 5], [5, -1]])
    return beh, ver, prox, mask, torch.tensor([0, 0, 1])


def test_gate_acts_on_the_whole_rollout():
    beh, ver, prox, mask, seq = _two_segment_rollout()
    cfg = CorrectionSection(is_level="token", is_mode="trunc", high=10.0)
    # per row (no seq_index): row 0 (oldest v3, staleness 2) is dropped, row 1 trains alone
    c = apply_correction(cfg, beh, ver, prox, mask, 5, 1)
    assert c.keep.tolist() == [False, True, True]
    # per rollout: both segments share staleness 2 and are dropped together
    c = apply_correction(cfg, beh, ver, prox, mask, 5, 1, seq_index=seq)
    assert c.staleness.tolist() == [2, 2, 0]
    assert c.keep.tolist() == [False, False, True]
    assert c.metrics["correction/gate_dropped"] == 2.0 and c.metrics["correction/gated_frac"] == 0.8
    close(c.weights, [[0.0, 0.0], [0.0, 0.0], [0.8, 0.0]])


def test_seq_and_geo_weights_use_every_segment_of_the_rollout():
    beh, ver, prox, mask, seq = _two_segment_rollout()
    # seq: product over the rollout's 4 tokens = 2 * 1 * 1.5 * 0.5 = 1.5 on all of them
    c = apply_correction(CorrectionSection(is_level="seq", is_mode="trunc", high=10.0), beh, ver, prox, mask, 5, 5,
                         seq_index=seq)
    close(c.weights, [[1.5, 1.5], [1.5, 1.5], [0.8, 0.0]])
    # per row it would have been 2 on row 0 and 0.75 on row 1
    c = apply_correction(CorrectionSection(is_level="seq", is_mode="trunc", high=10.0), beh, ver, prox, mask, 5, 5)
    close(c.weights, [[2.0, 2.0], [0.75, 0.75], [0.8, 0.0]])
    # geo: 1.5 ** (1/4) = 1.106682 over the rollout
    c = apply_correction(CorrectionSection(is_level="geo", is_mode="trunc", high=10.0), beh, ver, prox, mask, 5, 5,
                         seq_index=seq)
    close(c.weights, [[1.5 ** 0.25] * 2, [1.5 ** 0.25] * 2, [0.8, 0.0]])
    # Seq-MIS with high 1.4: the product 1.5 rejects the whole rollout, both segments
    c = apply_correction(CorrectionSection(is_level="seq", is_mode="mask", low=0.0, high=1.4), beh, ver, prox, mask, 5,
                         5, seq_index=seq)
    assert c.loss_mask.tolist() == [[False, False], [False, False], [True, False]]
    with pytest.raises(ValueError, match="seq_index must be an integer"):
        apply_correction(CorrectionSection(), beh, ver, prox, mask, 5, 5, seq_index=seq[:2])


def _oos_rows():
    """Row 0: token 1 out of the recomputed support (proximal -inf), token 2 rho 1.5;
    row 1: rho 1.2, 1.0 (in support)."""
    beh = torch.full((2, 3), -1.0, dtype=torch.float64)
    prox = beh.clone()
    prox[0, 1] = -math.inf
    prox[0, 2] = -1.0 + math.log(1.5)
    prox[1, 1] = -1.0 + math.log(1.2)
    mask = torch.tensor([[False, True, True], [False, True, True]])
    return beh, torch.where(mask, 0, -1), prox, mask


@pytest.mark.parametrize("level,mode,weights,loss_mask", [
    ("token", "trunc", [[0, 0, 1.5], [0, 1.2, 1]], [[0, 1, 1], [0, 1, 1]]),
    ("token", "clip", [[0, 0, 1.5], [0, 1.2, 1]], [[0, 1, 1], [0, 1, 1]]),
    ("token", "mask", [[0, 0, 1.5], [0, 1.2, 1]], [[0, 0, 1], [0, 1, 1]]),
    ("seq", "trunc", [[0, 0, 0], [0, 1.2, 1.2]], [[0, 1, 1], [0, 1, 1]]),   # product 0 on the row
    ("seq", "clip", [[0, 0, 0.5], [0, 1.2, 1.2]], [[0, 1, 1], [0, 1, 1]]),  # clamped up to low = 0.5
    ("seq", "mask", [[0, 0, 0], [0, 1.2, 1.2]], [[0, 0, 0], [0, 1, 1]]),    # the whole sequence rejected
    ("geo", "mask", [[0, 0, 0], [0, 1.2 ** 0.5, 1.2 ** 0.5]], [[0, 0, 0], [0, 1, 1]]),
    ("off", "trunc", [[0, 0, 1], [0, 1, 1]], [[0, 1, 1], [0, 1, 1]]),
    ("off", "clip", [[0, 0, 1], [0, 1, 1]], [[0, 1, 1], [0, 1, 1]]),
    ("off", "mask", [[0, 0, 1], [0, 1, 1]], [[0, 0, 1], [0, 1, 1]]),  # finding 7c: mask rejects it at level off too
    ("geo", "trunc", [[0, 0, 0], [0, 1.2 ** 0.5, 1.2 ** 0.5]], [[0, 1, 1], [0, 1, 1]]),
    ("geo", "clip", [[0, 0, 0.5], [0, 1.2 ** 0.5, 1.2 ** 0.5]], [[0, 1, 1], [0, 1, 1]]),
])
def test_out_of_support_token_has_ratio_zero_and_never_raises(level, mode, weights, loss_mask):
    beh, ver, prox, mask = _oos_rows()
    low = 0.5 if mode == "clip" else 0.0
    c = apply_correction(CorrectionSection(is_level=level, is_mode=mode, low=low, high=2.0), beh, ver, prox, mask, 0, 0)
    close(c.weights, weights)
    assert c.loss_mask.int().tolist() == loss_mask
    assert c.out_of_support.tolist() == [[False, True, False], [False, False, False]]
    assert c.metrics["correction/out_of_support_frac"] == 0.25
    assert c.keep.all()


def test_out_of_support_clean_reads_zero_and_nan_still_raises():
    beh, ver, prox, mask = _oos_rows()
    prox[0, 1] = -1.0
    c = apply_correction(CorrectionSection(is_mode="mask"), beh, ver, prox, mask, 0, 0)
    assert c.metrics["correction/out_of_support_frac"] == 0.0 and not c.out_of_support.any()
    prox[0, 1] = math.nan
    with pytest.raises(ValueError, match="proximal_logprobs must be finite or -inf"):
        apply_correction(CorrectionSection(), beh, ver, prox, mask, 0, 0)
    beh[0, 1] = -math.inf
    prox[0, 1] = -1.0
    with pytest.raises(ValueError, match="behaviour_logprobs must be finite"):
        apply_correction(CorrectionSection(), beh, ver, prox, mask, 0, 0)


def test_tis_token_trunc():
    c = _apply(CorrectionSection(is_level="token", is_mode="trunc", high=2.0), [[3.0, 0.5, 1.5]])
    close(c.weights, [[2.0, 0.5, 1.5]])
    assert c.metrics["correction/clipped_frac"] == pytest.approx(1 / 3)
    assert c.metrics["correction/masked_frac"] == 0.0
    assert c.metrics["correction/is_weight_max"] == pytest.approx(2.0)
    assert c.metrics["correction/is_weight_min"] == pytest.approx(0.5)
    assert c.metrics["correction/is_weight_mean"] == pytest.approx(4.0 / 3, abs=1e-6)


def test_token_clip():
    c = _apply(CorrectionSection(is_level="token", is_mode="clip", low=0.5, high=2.0), [[3.0, 0.25, 1.5]])
    close(c.weights, [[2.0, 0.5, 1.5]])
    assert c.metrics["correction/clipped_frac"] == pytest.approx(2 / 3)


def test_icepop_token_mask():
    c = _apply(CorrectionSection(is_level="token", is_mode="mask", low=0.5, high=2.0), [[3.0, 0.25, 1.5, math.nan]])
    close(c.weights, [[0.0, 0.0, 1.5, 0.0]])
    assert c.loss_mask.tolist() == [[False, False, True, False]]
    assert c.metrics["correction/masked_frac"] == pytest.approx(2 / 3)
    assert c.metrics["correction/is_weight_mean"] == pytest.approx(1.5, abs=1e-6)


def test_seq_mask_mis():
    # row 0: product 1.5*1.5 = 2.25 > 2 -> whole row rejected; row 1: 1.2*1.2 = 1.44 on every token
    c = _apply(CorrectionSection(is_level="seq", is_mode="mask", low=0.0, high=2.0), [[1.5, 1.5], [1.2, 1.2]])
    close(c.weights, [[0.0, 0.0], [1.44, 1.44]])
    assert c.keep.tolist() == [True, True]  # masking is not the gate
    assert c.metrics["correction/masked_frac"] == 0.5


def test_seq_product_overflow_is_bounded():
    c = _apply(CorrectionSection(is_level="seq", is_mode="trunc", high=2.0), [[math.exp(30.0)] * 40])
    close(c.weights, [[2.0] * 40])


def test_geo_level():
    # geometric mean of 4 and 1 is 2
    c = _apply(CorrectionSection(is_level="geo", is_mode="trunc", high=1.5), [[4.0, 1.0, math.nan]])
    close(c.weights, [[1.5, 1.5, 0.0]])
    c = _apply(CorrectionSection(is_level="geo", is_mode="mask", low=0.5, high=3.0), [[4.0, 1.0]])
    close(c.weights, [[2.0, 2.0]])


def test_off_level_gates_but_weights_one():
    c = _apply(CorrectionSection(is_level="off"), [[9.0, 0.1, math.nan]])
    close(c.weights, [[1.0, 1.0, 0.0]])


def test_errors():
    beh, ver, prox, mask = _rows([[1.0, 1.0]])
    bad = ver.clone()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match=r"versions\[0, 1\]"):
        apply_correction(CorrectionSection(), beh, bad, prox, mask, 0, 0)
    with pytest.raises(ValueError, match="newer than current_version"):
        apply_correction(CorrectionSection(), beh, ver + 3, prox, mask, 0, 0)
    # the config rejects a band without 1 at load time; apply_correction re-checks unvalidated configs
    with pytest.raises(ValueError, match=r"\[0, 0.9\] must contain 1"):
        CorrectionSection(high=0.9)
    with pytest.raises(ValueError, match=r"\[1.5, 2\] must contain 1"):
        CorrectionSection(is_mode="mask", low=1.5, high=2.0)
    unchecked = dict(is_level="token", is_mode="trunc", low=0.0)
    with pytest.raises(ValueError, match="correction.high"):
        apply_correction(CorrectionSection.model_construct(**unchecked, high=0.9), beh, ver, prox, mask, 0, 0)
    with pytest.raises(ValueError, match="correction.low"):
        apply_correction(CorrectionSection.model_construct(is_level="token", is_mode="mask", low=1.5, high=2.0),
                         beh, ver, prox, mask, 0, 0)
    with pytest.raises(ValueError, match="versions must have the shape"):
        apply_correction(CorrectionSection(), beh, ver[:, :1], prox, mask, 0, 0)


@settings(max_examples=60, deadline=None)
@given(
    B=st.integers(1, 4),
    T=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
    level=st.sampled_from(["off", "token", "seq", "geo"]),
    mode=st.sampled_from(["mask", "clip", "trunc"]),
    low=st.floats(0.0, 1.0),
    high=st.floats(1.0, 10.0),
    current=st.integers(0, 1000),
    max_staleness=st.integers(0, 8),
)
def test_property_on_policy_weights_are_one_and_nothing_gated(B, T, seed, level, mode, low, high, current,
                                                             max_staleness):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.7
    lp = -torch.rand(B, T, generator=g) * 20.0
    versions = torch.where(mask, current, -1)
    cfg = CorrectionSection(is_level=level, is_mode=mode, low=low, high=high)
    c = apply_correction(cfg, lp, versions, lp.clone(), mask, current, max_staleness)
    assert c.keep.all()
    assert torch.equal(c.weights, mask.float())
    assert torch.equal(c.loss_mask, mask)
    assert c.staleness.eq(0).all()
    assert c.metrics["correction/gate_dropped"] == 0.0 and c.metrics["correction/gated_frac"] == 0.0
    assert c.metrics["invariants/staleness_max"] == 0.0 and c.metrics["correction/out_of_support_frac"] == 0.0
    assert c.metrics["correction/masked_frac"] == 0.0 and c.metrics["correction/clipped_frac"] == 0.0


def test_issue11_token_at_plus_1000_nats_gives_finite_weights():
    # exp(1000) overflows float64 (above 709.8 nats): every mode must still give a finite weight
    beh = torch.tensor([[-1001.0, -1.0]], dtype=torch.float64)
    prox = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    ver = torch.zeros(1, 2, dtype=torch.long)
    for mode, want in (("trunc", [2.0, 1.0]), ("clip", [2.0, 1.0]), ("mask", [0.0, 1.0])):
        for level in ("token", "seq"):
            c = apply_correction(CorrectionSection(is_level=level, is_mode=mode, high=2.0), beh, ver, prox, mask, 0, 0)
            expect = want if level == "token" else ([2.0, 2.0] if mode != "mask" else [0.0, 0.0])
            close(c.weights, [expect])
            assert all(math.isfinite(v) for v in c.metrics.values())
