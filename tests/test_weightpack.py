"""The weight publish (issue 16 item 2): the trainer's state dict packed into one buffer per
dtype (:mod:`molt_core.runtime.weightpack`), unpacked into views by the rollout worker.

* exact round trip of a hand-built state (dtypes, a scalar, an empty tensor, a tied alias
  stored once, byte count by hand); the pack is a copy, never a view of the live weights;
* through the real workers, the trainer one real optimizer step (AdamW, lr 1e-5) ahead of the
  engine: every engine tensor equals the trainer's bit for bit after a publish (and none still
  equals the old), and a publish that skips one tensor is caught -- the engine keeps that
  tensor's old value bit for bit, and the run's own forward-consistency invariant
  ``invariants/logprob_absdiff_max_onpolicy`` exceeds its float32 bound.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest
import torch

from molt_core.config import RunConfig
from molt_core.runtime import weightpack
from molt_core.runtime.weightpack import PackedState, as_state_dict, pack_state, unpack_state
from molt_core.train.version_history import ONPOLICY_ABSDIFF_TOL

torch.set_num_threads(1)


def _state():
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    return {"a": a, "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "n": torch.tensor(7),
            "e": torch.zeros(0, 4), "tied": a}


def test_pack_round_trip_exact_and_tied_tensor_stored_once():
    st = _state()
    p = pack_state(st)
    # float32: a (6 x 4 B) + e (0 B), the alias not again; bfloat16: 2 x 2 B; int64: 8 B
    assert p.nbytes == 24 + 4 + 8 and len(p) == 5
    assert sorted(p.buffers) == ["bfloat16", "float32", "int64"]
    assert {n: (d, s, o) for n, d, s, o in p.index} == {
        "a": ("float32", (2, 3), 0), "b": ("bfloat16", (2,), 0), "n": ("int64", (), 0),
        "e": ("float32", (0, 4), 6), "tied": ("float32", (2, 3), 0)}
    for buf in p.buffers.values():  # what Ray hands the receiver: a read-only buffer
        buf.setflags(write=False)
    out = unpack_state(p)
    assert list(out) == list(st)
    for k, v in st.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k
    assert out["a"].data_ptr() == out["tied"].data_ptr()
    assert out["b"].tolist() == [1.5, -2.0] and out["n"].item() == 7
    assert as_state_dict(st) is st and torch.equal(as_state_dict(p)["a"], st["a"])


def test_pack_is_a_copy_of_the_live_weights():
    st = _state()
    p = pack_state(st)
    st["a"].add_(100.0)  # the optimizer steps while the pack is in flight
    assert unpack_state(p)["a"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_pack_rejects_a_non_tensor_naming_its_key():
    with pytest.raises(TypeError, match="'w' is a list"):
        pack_state({"w": [1.0]})


def test_empty_state_packs_to_nothing():  # the non-zero ranks of a sharded trainer
    p = pack_state({})
    assert p.nbytes == 0 and unpack_state(p) == {}


AGENT = '''
from molt_core.agents import Env
from molt_core.types import Result

class Echo(Env):
    def tasks(self, split, seed):
        i = 0
        while True:
            i += 1
            yield {"i": i}
    def reset(self, task):
        return f"Count to {task['i']}."
    def step(self, action_text, state):
        return Result(reward=float(len(action_text) % 2), terminated=True)
'''


def make_workers(tmp_path, **sections):
    """A trainer and a rollout worker on the Echo agent (``sections``: more config tables), the
    trainer's weights equal to the engine's (same init seed); :func:`step_ahead` moves them apart."""
    from molt_core.runtime.workers import RolloutWorker, TrainerWorker

    f = tmp_path / "agent.py"
    f.write_text(textwrap.dedent(AGENT))
    cfg = RunConfig.model_validate({"agent": {"path": str(f)}, "rollout": {"max_tokens": 6},
                                    "sft": {"steps": 0}, **sections})
    return TrainerWorker(cfg), RolloutWorker(cfg)


@pytest.fixture
def workers(tmp_path):
    tw, rw = make_workers(tmp_path, trainer={"lr": 1e-5})
    yield tw, rw
    rw.engine.close()


def _publish_and_measure(tw, rw):
    """Publish (as ``molt run`` does, minus Ray), sample with the engine, train on it: the
    names whose engine tensor differs from the trainer's (rounded to the engine's dtype), and
    the step's metrics; asserts that every sampled token carries the published version and was
    measured on-policy. The trainer is then one optimizer step ahead of the engine."""
    state, version = tw.weights()
    for buf in state.buffers.values():
        buf.setflags(write=False)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(rw.load_weights(state, version)) == version
        groups = loop.run_until_complete(rw.rollout([{"i": 3}, {"i": 5}], 4))
    finally:
        loop.close()
    engine = dict(rw.engine.model.state_dict())
    differ = sorted(k for k, v in tw.trainer.model.state_dict().items() if not torch.equal(engine[k], v.to(engine[k].dtype)))
    trajs = [t for g in groups for t in g.trajectories if t.status == "ok"]
    assert trajs and rw.engine.version == version == tw.trainer.version
    # every sampled token carries the published version (a token stamped otherwise is a
    # publish of the wrong version: the on-policy check would skip it, reading NaN or less)
    assert {v for t in trajs for s in t.segments for v in s.versions if v is not None} == {version}
    m = tw.train_step(trajs)
    assert m["invariants/staleness_max"] == 0.0 and m["invariants/onpolicy_tokens"] == m["train/action_tokens"] > 0
    return differ, m


def step_ahead(tw, rw):
    """One real step (publish, sample, train): the trainer's weights are then one optimizer
    step ahead of the engine's; returns a copy of the engine's (now old) state and the step's metrics."""
    differ, m = _publish_and_measure(tw, rw)
    assert differ == [] and tw.trainer.version == 1
    return {k: v.clone() for k, v in rw.engine.model.state_dict().items()}, m


def test_publish_reaches_the_engine_exactly(workers):
    tw, rw = workers
    old, _ = step_ahead(tw, rw)
    differ, m = _publish_and_measure(tw, rw)
    assert differ == []
    engine = dict(rw.engine.model.state_dict())
    # a publish that never arrived leaves the old tensors bit for bit: one AdamW step moves every one
    assert [k for k, v in engine.items() if torch.equal(v, old[k])] == []
    assert m["invariants/logprob_absdiff_max_onpolicy"] < 1e-4  # fp32, same function: rounding only
    assert m["sync/bytes"] == 853_376 * 4  # tiny-qwen3's parameters, the tied embedding once


def test_a_publish_that_skips_one_tensor_is_caught(workers, monkeypatch):
    tw, rw = workers
    old, _ = step_ahead(tw, rw)
    skip = "model.layers.0.mlp.down_proj.weight"
    real = weightpack.pack_state

    def faulty(state, **kw):  # the fault: one tensor never reaches the engine
        return real({k: v for k, v in state.items() if k != skip}, **kw)

    monkeypatch.setattr("molt_core.runtime.workers.pack_state", faulty)  # the trainer actor's own import
    differ, m = _publish_and_measure(tw, rw)
    assert differ == [skip]
    assert torch.equal(rw.engine.model.state_dict()[skip], old[skip])  # the old weights, bit for bit
    # the run's own invariant flags it: one tensor one step (lr 1e-5) behind reads ~7e-4 (rounding: < 1e-6)
    assert m["invariants/logprob_absdiff_max_onpolicy"] > ONPOLICY_ABSDIFF_TOL["float32"]
