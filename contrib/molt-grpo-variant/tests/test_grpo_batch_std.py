"""grpo_batch_std: exact values computed by hand, and the estimator as molt calls it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from molt_core.algo.advantages import estimate_advantages
from molt_core.plugins import load_plugins

PLUGIN = Path(__file__).resolve().parent.parent / "molt_grpo_variant" / "__init__.py"


def _estimator():
    return load_plugins([str(PLUGIN)], entry_points=False).get("estimators", "grpo_batch_std")


def test_group_mean_batch_std_by_hand():
    # groups {3, 1}, {2, 2}: centred [1, -1, 0, 0]; batch [3, 1, 2, 2]: mean 2, sample var
    # (1 + 1 + 0 + 0) / 3 = 2/3, so A = +-1 / sqrt(2/3) = +-sqrt(3/2); the tied group gets 0
    a = _estimator()(torch.tensor([3.0, 1.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    assert a.dtype == torch.float64
    assert a.tolist() == pytest.approx([math.sqrt(1.5), -math.sqrt(1.5), 0.0, 0.0], abs=1e-12)


def test_zero_spread_batch_and_eps():
    fn = _estimator()
    assert fn(torch.tensor([0.35] * 4), torch.tensor([0, 0, 1, 1]), eps=0.0).tolist() == [0.0] * 4
    # eps is added to the batch std: [1, 0 | 1, 0] -> centred +-0.5, batch std sqrt(1/3)
    a = fn(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), eps=0.5)
    assert a.tolist() == pytest.approx([0.5 / (math.sqrt(1 / 3) + 0.5), -0.5 / (math.sqrt(1 / 3) + 0.5)] * 2, abs=1e-12)


def test_through_molts_dispatch_broadcasts_to_tokens():
    mask = torch.tensor([[True, True], [True, False], [True, True], [False, True]])
    adv, ret = estimate_advantages(_estimator(), torch.tensor([3.0, 1.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]),
                                   torch.arange(4), mask, eps=0.0, name="grpo_batch_std")
    s = math.sqrt(1.5)
    assert ret is None and adv.dtype == torch.float32
    assert adv.flatten().tolist() == pytest.approx([s, s, -s, 0.0, 0.0, 0.0, 0.0, 0.0], abs=1e-6)
