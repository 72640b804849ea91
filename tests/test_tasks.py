"""Issue 11 item 8: a finite train split runs in epochs (resumable cursor, ``rollout/epoch``);
a split that must not repeat stops with an error naming the agent, the split and the counts;
an empty split fails before compute."""

from __future__ import annotations

import json
import textwrap

import pytest

from molt_core.rollout.tasks import SplitExhausted, TaskStream, check_train_split


class Three:
    """Three train tasks."""

    repeat_train_split = True

    def tasks(self, split, seed):
        for i in range(3):
            yield {"i": i, "seed": seed}


class ThreeOnce(Three):
    repeat_train_split = False


class Empty:
    def tasks(self, split, seed):
        return iter(())


def ids(tasks):
    return [t["i"] for t in tasks]


def test_epochs_over_a_finite_split():
    s = TaskStream(Three(), seed=7)
    assert ids(s.take(2)) == [0, 1] and (s.epoch, s.drawn, s.epoch_size) == (0, 2, None)
    assert ids(s.take(2)) == [2, 0] and (s.epoch, s.drawn, s.epoch_size) == (1, 4, 3)
    assert ids(s.take(2)) == [1, 2] and (s.epoch, s.drawn) == (1, 6)
    assert ids(s.take(4)) == [0, 1, 2, 0] and s.epoch == 3
    assert s.take(1)[0]["seed"] == 7  # every epoch replays the split with the run seed


def test_resume_cursor_continues_across_epochs():
    s = TaskStream(Three(), seed=0, start=4)
    assert (s.epoch, s.drawn) == (1, 4)
    assert ids(s.take(3)) == [1, 2, 0] and s.epoch == 2


def test_non_repeating_split_names_agent_split_and_counts():
    s = TaskStream(ThreeOnce(), seed=0, name="once")
    s.take(3)
    with pytest.raises(SplitExhausted, match=r"agent 'once': its 'train' split has 3 tasks and must not repeat "
                                             r"\(repeat_train_split = False\), but the run asked for task 4"):
        s.next()
    with pytest.raises(SplitExhausted, match=r"agent 'once': its 'train' split has 3 tasks and must not repeat "
                                             r"\(repeat_train_split = False\), but the run needs 6 "):
        check_train_split(ThreeOnce(), 0, needed=6, name="once")
    check_train_split(ThreeOnce(), 0, needed=3, name="once")
    check_train_split(Three(), 0, needed=600)  # repeating: no count needed


def test_empty_split_is_a_clear_error():
    with pytest.raises(ValueError, match=r"agent Empty: its 'train' split yields no task"):
        check_train_split(Empty(), 0, needed=1)
    with pytest.raises(ValueError, match=r"agent Empty: its 'train' split yields no task"):
        TaskStream(Empty(), 0).next()


FINITE_ENV = '''
from molt_core.agents import Env
from molt_core.types import Result

class Finite(Env):
    repeat_train_split = {repeat}
    def tasks(self, split, seed):
        yield from ({{"i": i}} for i in range({n}))
    def reset(self, task):
        return "Add " + str(task["i"])
    def step(self, action_text, state):
        return Result(reward=float(len(action_text) % 2), terminated=True)
'''


def run(tmp_path, n, repeat=True, steps=3):
    from molt_core.cli.recipe import load_config
    from molt_core.plugins import load_plugins
    from molt_core.runtime import main_job

    agent = tmp_path / "finite.py"
    agent.write_text(textwrap.dedent(FINITE_ENV.format(n=n, repeat=repeat)))
    cfg = load_config("env_agent", [f"run.steps={steps}", "sft.steps=0", "eval.n_problems=0", f"agent.path={str(agent)!r}",
                                    "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "rollout.max_tokens=3",
                                    "checkpoint.every=0"])
    out = main_job(cfg, load_plugins(cfg.plugins), out_dir=str(tmp_path / "run"), local=True)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_finite_split_run_starts_new_epochs(tmp_path):
    rows = run(tmp_path, 3)
    # 3 tasks, 2 per step: [0, 1] epoch 0, [2, 0] epoch 1, [1, 2] epoch 1 -- no StopIteration
    assert [(r["step"], r["rollout/epoch"]) for r in rows] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert all(r["rollout/trajectories"] == 4 for r in rows)


def test_non_repeating_or_empty_split_fails_before_compute(tmp_path):
    with pytest.raises(SplitExhausted, match=r"its 'train' split has 3 tasks and must not repeat .* needs 6"):
        run(tmp_path, 3, repeat=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match=r"its 'train' split yields no task"):
        run(tmp_path, 0)
