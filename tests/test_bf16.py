"""bf16 training (issue 14): ``model.dtype = "bfloat16"`` trains fp32 master weights with bf16
forwards (autocast; :meth:`molt_core.train.Trainer.autocast`, as verl / OpenRLHF / the HF
Trainer do), the engine runs bf16 weights (``engine.dtype``), and the forward-consistency
invariant stays within the documented bf16 tolerance :data:`BF16_TOL` -- and is flagged when
the engine runs other weights (fault injection).

CPU bf16 matmuls (oneDNN) make this runnable without a GPU; ``benchmarks/gpu_check.py``
repeats the measurement on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from molt_core.version_history import ONPOLICY_ABSDIFF_TOL
from test_weightpack import _publish_and_measure, make_workers

torch.set_num_threads(1)

BF16_TOL = ONPOLICY_ABSDIFF_TOL["bfloat16"]  # the documented bound (molt_core.version_history)


@pytest.fixture
def bf16_workers(tmp_path):
    tw, rw = make_workers(tmp_path, model={"dtype": "bfloat16"}, engine={"dtype": "bfloat16"}, trainer={"lr": 1e-3})
    yield tw, rw
    rw.engine.close()


def test_bf16_trains_fp32_master_weights_and_optimizer_state(bf16_workers):
    tw, rw = bf16_workers
    tr = tw.trainer
    assert tr.compute_dtype == torch.bfloat16
    assert {p.dtype for p in tr.model.parameters()} == {torch.float32}
    assert {p.dtype for p in rw.engine.model.parameters()} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    _differ, m = _publish_and_measure(tw, rw)
    assert m["grad_norm"] > 0 and tr.version == 1
    moved = [n for n, p in tr.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every weight moved (AdamW, lr 1e-3)
    states = [v for st in tr.optimizer.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert states and {v.dtype for v in states} == {torch.float32}
    # the forward ran in bf16: the logits of a forward under the trainer's autocast are bf16
    with tr.autocast():
        out = tr.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.dtype == torch.bfloat16
    # the publish moved bf16 bytes: half of fp32 (853,376 distinct parameters of tiny-qwen3)
    assert m["sync/bytes"] == 853_376 * 2


def test_bf16_forward_consistency_within_tolerance_and_fault_flagged(bf16_workers):
    import asyncio

    tw, rw = bf16_workers
    state, version = tw.weights()
    asyncio.run(rw.load_weights(state, version))
    # the engine's bf16 tensors are the trainer's fp32 masters rounded to bf16, exactly
    engine = dict(rw.engine.model.state_dict())
    assert all(torch.equal(engine[k], v.to(torch.bfloat16)) for k, v in tw.trainer.model.state_dict().items())
    _differ, m = _publish_and_measure(tw, rw)
    clean = m["invariants/logprob_absdiff_max_onpolicy"]
    print(f"bf16 clean: max {clean:.4g}, mean {m['invariants/logprob_absdiff_mean_onpolicy']:.4g}")
    assert 0 < clean <= BF16_TOL  # not exactly 0: the two bf16 forwards round differently
    # fault: the engine keeps sampling with other weights (a publish that never arrived)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in tw.trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    loop = asyncio.new_event_loop()
    try:
        groups = loop.run_until_complete(rw.rollout([{"i": 3}, {"i": 5}], 4))  # no publish first
    finally:
        loop.close()
    trajs = [t for g_ in groups for t in g_.trajectories if t.status == "ok"]
    for t in trajs:  # stamped with the trainer's version, so the invariant compares them as on-policy
        for s in t.segments:
            s.versions = [tw.trainer.version if v is not None else None for v in s.versions]
    bad = tw.train_step(trajs)["invariants/logprob_absdiff_max_onpolicy"]
    print(f"bf16 fault: max {bad:.4g}")
    assert bad > BF16_TOL
