"""Sharded data-parallel training (molt_plugins/distributed/sharded.py): 2 ranks == 1 rank.

Two ranks (separate processes, gloo on CPU, FSDP2) and one plain :class:`Trainer` train on
the same rollouts from the same seed; the loss, grad norm, every metric and the updated
weights must agree within float32 rounding (the gradient is summed in another order). The
batch is chosen so every seam is used: 12 rows on 2 ranks with micro-batches of 4 (shares of 6
rows: two micro-batches each, the second one partial), two-segment
rollouts, a sharded reference (KL term), an active clip (grad norm above ``grad_clip``),
and a second step whose tokens a held older version sampled (the on-policy check recomputes
them under that version's gathered weights).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from molt_core.train import Trainer
from molt_plugins.distributed.sharded import merge_loss_metrics, row_share
from trainer_utils import clone_params, set_behaviour, synthetic_rollouts, tiny_cfg

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parent.parent

# float32 tolerance of the comparison (the gradient sums the same per-row terms in a different
# order on 2 ranks; losses and norms are O(1), weights move by ~lr = 1e-3 per step)
RTOL, ATOL = 1e-5, 1e-6
# updated weights: AdamW moves each element by up to ~lr per step whatever its gradient's size,
# so on an element whose gradient is near 0 a rounding-level gradient difference can shift the
# step by a fraction of lr (seen: 4.3e-6 on 1 element of 49,152 after 4 steps at lr 1e-3;
# 2.8e-5 on 1 element after 2 SFT steps at lr 3e-3 and 2 RL steps); 3e-5 = 1% of the largest lr
W_ATOL = 3e-5


def test_row_share_splits_contiguously():
    assert [row_share(9, r, 2) for r in range(2)] == [(0, 4), (4, 9)]
    assert [row_share(2, r, 3) for r in range(3)] == [(0, 0), (0, 1), (1, 2)]


def test_merge_loss_metrics_min_max_sum():
    got = merge_loss_metrics([{"loss/total": 1.0, "ratio_max": 2.0, "ratio_min": 0.5},
                              {"loss/total": 0.5, "ratio_max": 3.0, "ratio_min": 0.25, "clipfrac": 0.125}])
    assert got == {"loss/total": 1.5, "ratio_max": 3.0, "ratio_min": 0.25, "clipfrac": 0.125}


def test_describe_ranks_names_each_rank():
    from molt_core.runtime.trainer_group import describe_ranks

    two = [{"rank": "0", "node_id": "n", "hostname": "vm", "pid": "11", "backend": "gloo"},
           {"rank": "1", "node_id": "n", "hostname": "vm2", "pid": "12", "backend": "gloo"}]
    assert describe_ranks(two) == "trainer: 2 ranks (gloo): rank 0 on vm pid 11, rank 1 on vm2 pid 12"
    one = [{"rank": "0", "node_id": "n", "hostname": "vm", "pid": "7", "backend": "none"}]
    assert describe_ranks(one) == "trainer: 1 rank: rank 0 on vm pid 7"


def _config(**over):
    cfg = dict(run={"seed": 3, "steps": 4},
               trainer={"lr": 1e-3, "micro_batch_size": 4, "grad_clip": 0.5, "refuse_unverified": False},
               algo={"kl_coef": 0.05}, **{"async": {"max_staleness": 1}})
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return tiny_cfg(**cfg)


def _rollouts(trainer: Trainer) -> list[list]:
    """Two steps of 3 groups x 3 rollouts, every 4th with two segments (rollouts 0, 4, 8: 12
    rows), sampled by version 0 (behaviour logprobs: the initial policy's own)."""
    steps = []
    for seed in (11, 12):
        trajs = synthetic_rollouts(seed, n_groups=3, n_per_group=3, two_segments_every=4)
        set_behaviour(trainer, trajs, version=0)
        steps.append(trajs)
    return steps


def _run_ranks(tmp_path: Path, cfg, steps, world_size: int, **extra) -> dict:
    """Run ``world_size`` worker processes (tests/distributed_worker.py) on ``steps``; rank
    0's metrics, full weights and output (``log``). ``extra`` goes into each spec (``run_dir``, ``save_after``,
    ``resume``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "rollouts.json").write_text(json.dumps([[t.model_dump(mode="json") for t in s] for s in steps]))
    procs = []
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    for rank in range(world_size):
        spec = {"rank": rank, "world_size": world_size, "init_method": f"file://{tmp_path / 'rdzv'}",
                "config": cfg.model_dump(mode="json", by_alias=True), "rollouts": str(tmp_path / "rollouts.json"),
                "out": str(tmp_path / "out.pt"), **extra}
        (tmp_path / f"spec{rank}.json").write_text(json.dumps(spec))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / f"spec{rank}.json")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return {**torch.load(tmp_path / "out.pt", weights_only=False), "log": outs[0]}


def _assert_parity(one: list[dict], two: list[dict]) -> None:
    for m1, m2 in zip(one, two, strict=True):
        assert set(m1) == set(m2)
        bad = {k: (m1[k], m2[k]) for k in m1 if not (k.startswith("time/") or k == "tokens_per_s")
               and m2[k] != pytest.approx(m1[k], rel=RTOL, abs=ATOL, nan_ok=True)}
        assert not bad, bad  # key: (1 rank, 2 ranks)


SFT = {"examples": [([{"role": "user", "content": f"What is {a} + {b}?"}], str(a + b))
                     for a, b in [(12, 30), (45, 11), (70, 29), (8, 64), (33, 33), (51, 17), (90, 9)]],
       "steps": 2, "batch_size": 5, "lr": 3e-3}


def test_two_ranks_match_one_rank(tmp_path):
    """First a 2-step SFT warm start (5 rows: 2 on rank 0, 3 on rank 1; the reference is then
    re-snapshotted from the sharded policy), then two RL steps."""
    from molt_core.train.sft import sft

    cfg = _config()
    single = Trainer(cfg)
    steps = _rollouts(single)
    before = clone_params(single.model)
    one: list[dict] = []
    sft(single, SFT["examples"], steps=SFT["steps"], batch_size=SFT["batch_size"], lr=SFT["lr"],
        log=lambda i, m: one.append(m))
    one += [single.train_step(s) for s in steps]
    two = _run_ranks(tmp_path, cfg, steps, 2, sft=SFT)
    assert one[0]["sft/loss"] > one[1]["sft/loss"]  # SFT learned
    one, sft_one = one[2:], one[:2]
    _assert_parity(sft_one, two["metrics"][:2])
    two["metrics"] = two["metrics"][2:]

    # the seams were exercised: two updates, clip active, KL term, the stale step measured
    assert [m["train/step"] for m in one] == [1.0, 2.0]
    assert one[0]["grad_norm"] > cfg.trainer.grad_clip
    assert one[0]["loss/kl"] == 0.0 and one[1]["loss/kl"] != 0.0  # the reference equals step 0's policy
    assert one[1]["invariants/onpolicy_stale_tokens"] > 0
    _assert_parity(one, two["metrics"])
    after = dict(single.model.named_parameters())
    moved = max(float((after[k].detach() - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the weights learned
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(two["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow  # another 2-rank launch (~60 s on 2 busy cores)
def test_two_ranks_match_one_rank_gae_two_epochs(tmp_path):
    """The other update path: a sharded GAE critic (its own AdamW, clip and value loss), two PPO
    epochs (a separate no-grad recompute, not the fused one) and sequence-level masking."""
    cfg = _config(algo={"advantage": "gae", "kl_coef": 0.05}, trainer={"ppo_epochs": 2},
                  correction={"is_level": "seq", "is_mode": "mask"})
    single = Trainer(cfg)
    steps = _rollouts(single)
    one = [single.train_step(s) for s in steps]
    two = _run_ranks(tmp_path, cfg, steps, 2)
    assert one[0]["train/fused_recompute"] == 0.0 and one[0]["critic/grad_norm"] > 0
    _assert_parity(one, two["metrics"])
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(two["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow  # four 2-rank launches: ~2-3 min on 2 busy cores
def test_sharded_checkpoint_resumes_exactly_and_reshards(tmp_path, capsys):
    """A 2-rank run checkpointed after step 1 (distributed checkpoint + Hugging Face dir):
    resumed on 2 ranks, step 2 gives bit-identical weights to the uninterrupted run; resumed on
    one plain Trainer (resharded, and it says so), the same within float32 rounding; the
    ``model/`` directory loads with ``from_pretrained`` and holds the step-1 weights. And a
    plain Trainer's checkpoint resumed on 2 ranks (weights and AdamW moments sharded on load)
    continues like the plain Trainer."""
    from transformers import AutoModelForCausalLM

    from molt_core.train.checkpoint import verify_checkpoint

    cfg = _config()
    single = Trainer(cfg)
    one_tok = single.tokenizer
    steps = _rollouts(single)
    run_dir = tmp_path / "run"
    full = _run_ranks(tmp_path / "a", cfg, steps, 2, run_dir=str(run_dir), save_after=1)
    ck = run_dir / "checkpoints" / "step_00000001"
    meta = verify_checkpoint(ck)  # every file (dcp/ shards included) matches its checksum
    assert meta["world_size"] == 2 and meta["step"] == 1
    assert (ck / "dcp" / ".metadata").is_file() and (ck / "model" / "tokenizer_config.json").is_file()

    resumed = _run_ranks(tmp_path / "b", cfg, steps, 2, resume=str(ck))
    for k, v in full["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k
    assert resumed["metrics"][0]["loss/total"] == full["metrics"][1]["loss/total"]

    from safetensors import safe_open

    with safe_open(str(ck / "model" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and len(list(f.keys())) == 46  # tied: saved once, as a plain trainer does
    hf = AutoModelForCausalLM.from_pretrained(ck / "model")
    # servable: `molt serve --model <ck>/model` builds this engine (weights and tokenizer from the directory)
    from molt_core.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine(str(ck / "model"), max_batch_size=2)
    try:
        served = eng.model.state_dict()
        assert all(torch.equal(served[k].float(), v) for k, v in hf.state_dict().items())
        assert eng.tokenizer.encode("What is 12 + 30?") == one_tok.encode("What is 12 + 30?")
    finally:
        eng.close()
    one = Trainer(cfg)
    one.load_checkpoint(ck)
    assert "written by 2 trainer ranks, resuming on 1: resharding" in capsys.readouterr().out
    for k, v in hf.state_dict().items():
        assert torch.equal(one.model.state_dict()[k], v), k  # the HF dir = the resharded weights
    assert one.step == 1 and one.version == 1
    m2 = one.train_step(steps[1])
    assert m2["loss/total"] == pytest.approx(full["metrics"][1]["loss/total"], rel=RTOL, abs=ATOL)
    for k, v in one.model.state_dict().items():
        torch.testing.assert_close(full["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")

    # the other way: a checkpoint of one plain Trainer resumed on 2 ranks
    single.train_step(steps[0])
    ck1 = single.save_checkpoint(tmp_path / "run1", {"step": 1})
    up = _run_ranks(tmp_path / "c", cfg, steps, 2, resume=str(ck1))
    assert "written by 1 trainer ranks, resuming on 2: resharding" in up["log"]
    m1 = single.train_step(steps[1])
    assert up["metrics"][0]["loss/total"] == pytest.approx(m1["loss/total"], rel=RTOL, abs=ATOL)
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(up["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")


class _Ref:
    def __init__(self, rank: int, name: str, err: Exception | None = None) -> None:
        self.rank, self.name, self.err = rank, name, err


class _FakeRay:
    """The slice of Ray that :class:`TrainerGroup` uses; records what the driver resolves."""

    def __init__(self) -> None:
        self.got: list[_Ref] = []
        self.puts = 0

    def put(self, a):
        self.puts += 1
        return ("stored", a)

    def wait(self, pending, num_returns=1):
        return pending[:num_returns], pending[num_returns:]

    def get(self, refs):
        for r in refs:
            self.got.append(r)
            if r.err is not None:
                raise r.err


class _FakeRank:
    def __init__(self, rank: int, fail: str | None = None) -> None:
        self.rank, self.fail, self.calls = rank, fail, []

    def __getattr__(self, name):
        rank = self

        class _M:
            n = 1

            def options(self, num_returns=1):
                self.n = num_returns
                return self

            def remote(self, *args):
                rank.calls.append((name, args))
                err = RuntimeError(f"rank {rank.rank} failed") if rank.fail == name else None
                refs = tuple(_Ref(rank.rank, name, err) for _ in range(self.n))
                return refs if self.n > 1 else refs[0]

        return _M()


def test_trainer_group_keeps_the_weights_out_of_the_driver_and_fails_fast():
    """``weights``: every rank joins the gather (a collective) and the driver gets rank 0's two
    refs without resolving any (the workers resolve them: the weights skip the driver); any
    other call waits for every rank and raises a failing rank's error; arguments go to the
    object store once for all ranks."""
    from molt_core.runtime.trainer_group import TrainerGroup

    ray = _FakeRay()
    ranks = [_FakeRank(0), _FakeRank(1, fail="train_step")]
    group = TrainerGroup(ray, ranks, [])
    state, version = group.weights.options(num_returns=2).remote()
    assert (state.rank, state.name, version.rank) == (0, "weights", 0)
    assert [r.calls for r in ranks] == [[("weights", ())], [("weights", ())]] and ray.got == []
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        group.train_step.remote(["rollouts"])
    assert ray.puts == 1 and ranks[0].calls[1] == ranks[1].calls[1] == ("train_step", (("stored", ["rollouts"]),))
    ray.got.clear()
    ok = TrainerGroup(ray, [_FakeRank(0), _FakeRank(1)], [])
    assert ok.save.remote("dir").rank == 0 and sorted(r.rank for r in ray.got) == [0, 1]  # waited for both


@pytest.mark.slow  # another 2-rank launch (~60 s on 2 busy cores)
def test_a_nan_in_a_later_epoch_refuses_the_same_rollout_on_two_ranks_as_on_one(tmp_path):
    """Issue 24 part 3 on FSDP2: two PPO epochs; from the first optimizer step on, the policy's
    forward is NaN after one token id that only one rollout holds, in a row of rank 1's share
    that shares a micro-batch with other rollouts. Epoch 1's loss forward sees it on rank 1
    only; both ranks refuse that one rollout (rank 0 hangs in no collective), put back their
    shards and AdamW state, and redo the step on the other 8: the weights of one rank on those
    8 (before: in lockstep the ``0 * logits`` term spread the NaN over the whole micro-batch,
    refusing its other rollouts too)."""
    from distributed_worker import poison_after_first_step

    cfg = _config(trainer={"ppo_epochs": 2})
    single = Trainer(cfg)
    trajs = _rollouts(single)[0]
    rows = [(t.rollout_id, s.token_ids, s.loss_mask) for t in trajs for s in t.segments]
    lo, hi = row_share(len(rows), 1, 2)
    seen = [tok for _rid, ids, _m in rows for tok in set(ids)]
    # a token id of one row only (once), followed by a sampled token, in rank 1's share, whose
    # micro-batch of 4 also holds other rollouts' rows
    tok, victim = next((ids[i], rid) for r, (rid, ids, m) in enumerate(rows) if lo <= r < hi
                       for i in range(len(ids) - 1) if m[i + 1] and seen.count(ids[i]) == 1
                       and ids.count(ids[i]) == 1
                       and len({rows[j][0] for j in range(lo + (r - lo) // 4 * 4, min(hi, lo + (r - lo) // 4 * 4 + 4))}) > 1)
    poison_after_first_step(single, tok)
    one = single.train_step(trajs)
    clean = Trainer(cfg)
    want = clean.train_step([t for t in trajs if t.rollout_id != victim])
    assert one["ingress/refused_nonfinite"] == 1.0 and one["invariants/nonfinite_logprobs"] > 0
    assert one["train/rollouts"] == 8.0 and one["loss/total"] == want["loss/total"]
    assert all(torch.equal(a, b) for a, b in zip(single.model.parameters(), clean.model.parameters()))
    two = _run_ranks(tmp_path, cfg, [trajs], 2, poison_token=tok)
    _assert_parity([one], two["metrics"])
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(two["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")
