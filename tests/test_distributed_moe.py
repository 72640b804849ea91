"""MoE routing replay (R3) on 2 sharded ranks (FSDP2, gloo) == 1 rank.

Each rank replays and records the routing of its own rows only; the R3 metrics must still be
those of the whole batch (:meth:`molt_plugins.distributed.sharded.ShardedTrainer._routing_metrics`
gathers every rank's record). Rollouts of the tiny Qwen3-MoE sampled by a bfloat16 engine
(the trainer is fp32, so the natural routers flip on a few (position, layer) pairs: the flip
rate is > 0 and replay brings the used routing to the record's). Fault injection: a backend
that replays the wrong experts on both ranks reads ``routing_replay_mismatch`` 1.0 over the
whole batch, not over one rank's half.
"""

from __future__ import annotations

import pytest
import torch

from molt_core.train import Trainer
from test_distributed import RTOL, W_ATOL, _assert_parity, _run_ranks
from test_routing_replay import bf16_rollouts  # noqa: F401 -- a fixture: 16 rollouts of a bf16 engine
from trainer_utils import tiny_cfg

torch.set_num_threads(1)


@pytest.mark.slow  # two 2-rank launches (~1-2 min on 2 busy cores)
def test_two_ranks_replay_moe_routing_like_one_rank(tmp_path, bf16_rollouts):
    # run.seed 0: the engine's weights; micro-batches of 4: two per rank
    cfg = tiny_cfg(model={"path": "builtin:tiny-qwen3-moe", "routing_replay": True}, run={"seed": 0},
                   trainer={"lr": 1e-3, "micro_batch_size": 4})
    single = Trainer(cfg)
    one = [single.train_step(bf16_rollouts)]
    m = one[0]
    assert m["invariants/routing_replay"] == 1.0 and m["routing/positions"] > 0
    assert m["invariants/routing_replay_mismatch"] == 0.0 and 0 < m["invariants/routing_flip_rate"] < 0.01  # bf16 vs fp32
    two = _run_ranks(tmp_path / "good", cfg, [bf16_rollouts], 2)
    _assert_parity(one, two["metrics"])  # flip rate, mismatch, positions, no-replay diffs included
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(two["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda msg, k=k: f"{k}: {msg}")

    bad = _run_ranks(tmp_path / "bad", cfg, [bf16_rollouts], 2, replay_backend="test_routing_replay:WrongExpertsReplay")
    b = bad["metrics"][0]
    assert b["invariants/routing_replay_mismatch"] == 1.0  # every recorded pair of both ranks' rows
    assert b["routing/positions"] == m["routing/positions"]
    assert b["invariants/routing_flip_rate"] == pytest.approx(m["invariants/routing_flip_rate"], abs=1e-12)
