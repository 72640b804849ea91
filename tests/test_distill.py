"""On-policy distillation end to end: the ``[teacher]`` table, the rollout worker's teacher
annotation (a failing teacher fails that rollout), the trainer's ``distill/reverse_kl``
metric by hand, the ``tiny-qwen3-large`` teacher builtin, and (slow) ``recipes/distill.toml``
through ``molt sft`` + ``molt run``: the reverse KL at the end is below half its start."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from molt_core.config import RunConfig
from molt_core.cli.recipe import load_config
from molt_core.models import load_model, load_tokenizer
from molt_core.runtime import RolloutWorker
from molt_core.train import Trainer
from molt_core.types import SampledSpan, Segment, Trajectory
from molt_plugins.teachers.hf_teacher import HFTeacher, check_same_vocab
from trainer_utils import BiasLM, tiny_cfg

torch.set_num_threads(1)

AGENT_FILE = '''
from molt_core.agents import Env
from molt_core.types import Result

class Once(Env):
    def tasks(self, split, seed):
        i = 0
        while True:
            yield {"i": i}
            i += 1
    def reset(self, task):
        return "What is 2 + 3?"
    def step(self, action_text, state):
        return Result(reward=0.0, terminated=True)
'''

BROKEN_TEACHER = '''
from molt_core.hookspecs import hookimpl

class Broken:
    def __init__(self, student_tokenizer, **options):
        self.options = options
    def annotate(self, trajectory):
        raise RuntimeError("no teacher today")

@hookimpl
def molt_register_teachers(register):
    register("broken", Broken)
'''


def worker_for(tmp_path, **over) -> RolloutWorker:
    f = tmp_path / "agent.py"
    f.write_text(textwrap.dedent(AGENT_FILE))
    return RolloutWorker(RunConfig.model_validate({"agent": {"path": str(f)}, "rollout": {"max_tokens": 4}, **over}))


def test_large_builtin_is_a_bigger_model_on_the_same_vocabulary():
    m = load_model("builtin:tiny-qwen3-large")
    c = m.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size) == (192, 6, 6, 3, 32, 576)
    # embed 512*192 (tied) + 6 * (q 192*192 + k,v 2*192*96 + o 192*192 + qk-norm 2*32
    # + mlp 3*192*576 + 2 norms 2*192) + final norm 192
    per_layer = 192 * 192 + 2 * 192 * 96 + 192 * 192 + 2 * 32 + 3 * 192 * 576 + 2 * 192
    assert sum(p.numel() for p in m.parameters()) == 512 * 192 + 6 * per_layer + 192 == 2755392
    check_same_vocab(load_tokenizer("builtin:tiny-qwen3-large"), load_tokenizer("builtin:tiny-qwen3"))



def test_trainer_reports_reverse_kl_by_hand():
    """Student logits [2, 1, 0] everywhere: log p_k = k' - log(e^2 + e + 1) with k' = 2, 1, 0.
    Sampled tokens 0, 1 (rollout A) and 2 (rollout B), teacher logprobs -0.1, -3.0, -1.0:
    reverse KL (k1) = [(log p0 + 0.1) + (log p1 + 3.0) + (log p2 + 1.0)] / 3
                    = [3 - 3 log(11.107338) + 4.1] / 3 = [7.1 - 7.222819] / 3 = -0.0409396."""
    cfg = tiny_cfg(algo={"advantage": "on_policy_distill"}, trainer={"lr": 1e-9})
    tr = Trainer(cfg, model=BiasLM([2.0, 1.0, 0.0]))
    lp = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), 0).tolist()
    a = Trajectory(rollout_id="a", reward=0.0, info={"teacher_logprobs": [[None, -0.1, -3.0]]}, segments=[Segment(
        token_ids=[2, 0, 1], loss_mask=[False, True, True], logprobs=[None, lp[0], lp[1]], versions=[None, 0, 0],
        spans=[SampledSpan(start=1, end=3)])])
    b = Trajectory(rollout_id="b", reward=0.0, info={"teacher_logprobs": [[None, -1.0]]}, segments=[Segment(
        token_ids=[2, 2], loss_mask=[False, True], logprobs=[None, lp[2]], versions=[None, 0],
        spans=[SampledSpan(start=1, end=2)])])
    m = tr.train_step([a, b])
    assert m["distill/reverse_kl"] == pytest.approx(-0.0409396, abs=1e-6)
    assert m["distill/reverse_kl"] == pytest.approx((7.1 - 3 * math.log(math.exp(2) + math.e + 1)) / 3, abs=1e-6)
    grpo = Trainer(tiny_cfg(), model=BiasLM([2.0, 1.0, 0.0]))
    assert "distill/reverse_kl" not in grpo.train_step([a.model_copy(update={"reward": 1.0}), b])


def test_teacher_table_defaults_and_recipe():
    assert RunConfig().teacher.name is None and RunConfig().teacher.options == {}
    cfg = load_config("distill")
    assert cfg.algo.advantage == "on_policy_distill" and cfg.teacher.name == "hf_teacher"
    assert cfg.model.path == "builtin:tiny-qwen3" and cfg.sft.steps == 0  # `molt run` never SFTs the student


def test_worker_annotates_ok_trajectories_with_teacher_logprobs(tmp_path):
    w = worker_for(tmp_path, teacher={"name": "hf_teacher", "options": {"path": "builtin:tiny-qwen3", "seed": 1}})
    groups = asyncio.run(w.rollout([{"i": 0}], 2))
    ref = HFTeacher(load_tokenizer("builtin:tiny-qwen3"), path="builtin:tiny-qwen3", seed=1)
    for t in groups[0].trajectories:
        assert t.status == "ok"
        got = t.info["teacher_logprobs"]
        assert got == ref.trajectory_logprobs(t)  # same frozen model, same ids
        seg = t.segments[0]
        assert [x is not None for x in got[0]] == list(seg.loss_mask)  # values exactly on sampled tokens


def test_teacher_failure_marks_the_rollout_failed(tmp_path):
    plug = tmp_path / "broken_teacher.py"
    plug.write_text(textwrap.dedent(BROKEN_TEACHER))
    w = worker_for(tmp_path, plugins=[str(plug)], teacher={"name": "broken"})
    groups = asyncio.run(w.rollout([{"i": 0}], 2))
    assert [t.status for t in groups[0].trajectories] == ["failed", "failed"]
    assert [t.error for t in groups[0].trajectories] == ["teacher broken raised RuntimeError: no teacher today"] * 2


def test_unknown_teacher_is_an_error_before_any_rollout(tmp_path):
    with pytest.raises(ValueError, match="teacher.name: no teacher named 'nope'; registered: .*hf_teacher"):
        worker_for(tmp_path, teacher={"name": "nope"})


# -- the recipe end to end -------------------------------------------------------------------

MOLT = [sys.executable, "-m", "molt_core.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
TEACHER_SFT_STEPS = 200  # the recipe's documented teacher warm start


@pytest.mark.slow
def test_distill_recipe_halves_reverse_kl(tmp_path):
    teacher = tmp_path / "teacher"
    r = subprocess.run(MOLT + ["sft", "distill", "--set", "model.path=builtin:tiny-qwen3-large",
                               "--set", f"sft.steps={TEACHER_SFT_STEPS}", "--out", str(teacher)],
                       env=ENV, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    sft_rows = [json.loads(x) for x in (teacher / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(sft_rows) == TEACHER_SFT_STEPS
    run = tmp_path / "run"
    r = subprocess.run(MOLT + ["run", "distill", "--out", str(run), "--set", f"teacher.options.path={teacher / 'model'}"],
                       env=ENV, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in rows if x["step"] > 0]
    assert [x["step"] for x in steps] == list(range(1, load_config("distill").run.steps + 1))
    for x in steps:
        assert x["invariants/tokens_retokenized"] == 0 and x["rollout/failed"] == 0
    kl = [x["distill/reverse_kl"] for x in steps]
    assert kl[-1] < 0.5 * kl[0], kl
