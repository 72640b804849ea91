"""bf16 training (issue 14): ``model.dtype = "bfloat16"`` trains fp32 master weights with bf16
forwards (autocast; :meth:`molt_core.train.Trainer.autocast`, as verl / OpenRLHF / the HF
Trainer do), the engine runs bf16 weights (``engine.dtype``), and the forward-consistency
invariant stays within the documented bf16 tolerance :data:`BF16_TOL`. A missed publish after a
realistic step (AdamW, lr 1e-5) reads under that bound (docs/gpu.md; ``test_review14``), so the
publish is checked exactly: the engine holds the trainer's masters rounded to bf16, bit for bit,
and no longer the old ones.

CPU bf16 matmuls (oneDNN) make this runnable without a GPU; ``benchmarks/gpu_check.py``
repeats the measurement on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from molt_core.train.version_history import ONPOLICY_ABSDIFF_TOL
from test_weightpack import _publish_and_measure, make_workers, step_ahead

torch.set_num_threads(1)

BF16_TOL = ONPOLICY_ABSDIFF_TOL["bfloat16"]  # the documented bound (molt_core.train.version_history)


@pytest.fixture
def bf16_workers(tmp_path):
    tw, rw = make_workers(tmp_path, model={"dtype": "bfloat16"}, engine={"dtype": "bfloat16"}, trainer={"lr": 1e-5})
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
    assert len(moved) == len(before)  # every weight moved (AdamW, lr 1e-5: steps a bf16 master would mostly round away)
    states = [v for st in tr.optimizer.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert states and {v.dtype for v in states} == {torch.float32}
    # the forward ran in bf16: the logits of a forward under the trainer's autocast are bf16
    with tr.autocast():
        out = tr.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.dtype == torch.bfloat16
    # the publish moved bf16 bytes: half of fp32 (853,376 distinct parameters of tiny-qwen3)
    assert m["sync/bytes"] == 853_376 * 2


def test_bf16_forward_consistency_within_tolerance_and_publish_exact(bf16_workers):
    tw, rw = bf16_workers
    old, m = step_ahead(tw, rw)  # publish, sample, one AdamW step at lr 1e-5
    clean = m["invariants/logprob_absdiff_max_onpolicy"]
    print(f"bf16 clean: max {clean:.4g}, mean {m['invariants/logprob_absdiff_mean_onpolicy']:.4g}")
    assert 0 < clean <= BF16_TOL  # not exactly 0: the two bf16 forwards round differently
    want = {k: v.to(torch.bfloat16) for k, v in tw.trainer.model.state_dict().items()}
    moved = sorted(k for k, v in want.items() if not torch.equal(v, old[k]))
    assert moved  # one step changes the bf16 rounding of some tensors (not of every one)
    differ, _ = _publish_and_measure(tw, rw)
    # the engine's bf16 tensors are the trainer's fp32 masters rounded to bf16, exactly -- and a
    # missed publish (the old tensors, bit for bit) is seen on every tensor the step moved
    assert differ == []
    engine = dict(rw.engine.model.state_dict())
    assert sorted(k for k, v in engine.items() if not torch.equal(v, old[k])) == moved
