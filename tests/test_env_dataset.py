"""The ``dataset`` env and its row reader (molt_core/rollout/datafiles.py): every source format, field
mapping and template rendering, split determinism and disjointness, the error messages, and
the shipped ``builtin:chain_sum`` dataset."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from molt_core.agents import EpisodeState
from molt_core.rollout.datafiles import BUILTIN_DATASETS_DIR, load_rows
from molt_core.rollout.tasks import SplitExhausted, TaskStream, check_train_split
from molt_plugins.envs.dataset import DatasetEnv, strip_end_markers

ROWS = [{"q": f"{a} plus {b}", "a": str(a + b), "extra": a} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9)]]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", ROWS)
    test = _jsonl(tmp_path / "test.jsonl", [{"q": "10 plus 1", "a": "11", "extra": 10}])
    return tmp_path, train, test


# -- reading every format --------------------------------------------------------------------
def test_jsonl_rows_skip_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"x": 1}\n\n  \n{"x": 2}\n')
    assert load_rows(str(p)) == [{"x": 1}, {"x": 2}]


def test_parquet_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(str(tmp_path / "d.parquet")) == ROWS
    env = DatasetEnv(path=str(tmp_path / "d.parquet"), prompt_field="q", answer_field="a", eval_fraction=0.2)
    assert len(list(env.tasks("eval", 0))) == 1 and len(env._train) == 4


def test_corrupt_parquet_file_names_the_option_and_the_fix(tmp_path):
    """A .parquet file that is not Parquet (truncated, or another format renamed) is a
    ValueError naming the option and the file, with the reader's reason and how to fix it --
    not pyarrow's bare error -- through the env as through load_rows."""
    datasets = pytest.importorskip("datasets")
    bad = tmp_path / "bad.parquet"
    bad.write_text('{"q": "1 plus 1", "a": "2"}\n')  # JSONL under a .parquet name
    with pytest.raises(ValueError, match=r"agent.options.path = '.*bad.parquet' is not a readable Parquet file "
                                         r"\(ArrowInvalid: .*\); write it again .* or give a .jsonl file"):
        load_rows(str(bad), what="agent.options.path")
    good = tmp_path / "good.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(good))
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # truncated
    with pytest.raises(ValueError, match=r"agent.options.path = ..*cut.parquet. is not a readable Parquet file"):
        DatasetEnv(path=str(cut), prompt_field="q", answer_field="a")


def test_save_to_disk_dataset_dict_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "test": datasets.Dataset.from_list([{"q": "10 plus 1", "a": "11", "extra": 10}])})
    dd.save_to_disk(str(tmp_path / "saved"))
    env = DatasetEnv(path=str(tmp_path / "saved"), eval_split="test", prompt_field="q", answer_field="a")
    assert [t["question"] for t in env.tasks("eval", 0)] == ["10 plus 1"]
    assert sorted(t["question"] for t in env._train) == sorted(r["q"] for r in ROWS)
    with pytest.raises(ValueError, match=r"agent.options.eval_split = .* has splits \['test', 'train'\]; no split 'valid'"):
        DatasetEnv(path=str(tmp_path / "saved"), eval_split="valid", prompt_field="q", answer_field="a")


def test_save_to_disk_single_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    env = DatasetEnv(path=str(tmp_path / "one"), prompt_field="q", answer_field="a", eval_fraction=0.2)
    assert len(env._train) == 4
    with pytest.raises(ValueError, match="holds one Dataset .* there is no split 'test'"):
        DatasetEnv(path=str(tmp_path / "one"), eval_split="test", prompt_field="q", answer_field="a")


def test_directory_of_split_files(files):
    d, _, _ = files
    env = DatasetEnv(path=str(d), eval_split="test", prompt_field="q", answer_field="a")
    assert [t["answer"] for t in env.tasks("eval", 0)] == ["11"]
    assert len(env._train) == 5


def test_hub_name_offline_is_a_clear_error():
    pytest.importorskip("datasets")
    code = ("from molt_core.rollout.datafiles import load_rows\n"
            "try:\n    load_rows('no-such-user/no-such-dataset-xyz', what='agent.options.path')\n"
            "except ValueError as e:\n    print('ERR', e)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": "/nonexistent-molt-test"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                       cwd=str(Path(__file__).resolve().parents[1]))
    assert "ERR agent.options.path = 'no-such-user/no-such-dataset-xyz'" in p.stdout, p.stdout + p.stderr
    assert "HF_HUB_OFFLINE is set" in p.stdout


# -- field mapping and templates ---------------------------------------------------------------
def test_template_renders_exactly_and_system_prompt(files):
    _, train, test = files
    env = DatasetEnv(path=str(train), eval_path=str(test), template="Q: {q} (#{extra})", answer_field="a",
                     system_prompt="Answer with a number.")
    (t,) = list(env.tasks("eval", 0))
    assert t == {"q": "10 plus 1", "a": "11", "extra": 10, "question": "Q: 10 plus 1 (#10)", "answer": "11", "row": 0}
    assert env.first_messages(t) == [{"role": "system", "content": "Answer with a number."},
                                     {"role": "user", "content": "Q: 10 plus 1 (#10)"}]


def test_messages_field_trailing_assistant_is_the_answer(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    p = _jsonl(tmp_path / "c.jsonl", [{"conv": chat}, {"conv": chat[:2], "gold": "x"}])
    tr = _jsonl(tmp_path / "t.jsonl", [{"conv": [{"role": "user", "content": "1+1?"}], "gold": "2"}])
    env = DatasetEnv(path=str(tr), eval_path=str(p), messages_field="conv", answer_field="gold", scorer="none")
    t0, t1 = list(env.tasks("eval", 0))
    assert t0["messages"] == chat[:2] and t0["answer"] == "4" and t0["question"] == "2+2?"
    assert t1["answer"] == "x"
    assert env.first_messages(t0) == chat[:2]
    assert env.first_messages(t0) is not t0["messages"]


def test_exact_scorer_and_none_scorer(files):
    _, train, test = files
    env = DatasetEnv(path=str(train), eval_path=str(test), prompt_field="q", answer_field="a")
    task = next(env.tasks("eval", 0))
    assert env.step(" 11<|im_end|>", EpisodeState(task=task)).reward == 1.0
    r = env.step("12", EpisodeState(task=task))
    assert (r.reward, r.score, r.terminated) == (0.0, 0.0, True)
    none = DatasetEnv(path=str(train), eval_path=str(test), prompt_field="q", answer_field="a", scorer="none")
    r = none.step("11", EpisodeState(task=task))
    assert (r.reward, r.score) == (0.0, None)
    assert strip_end_markers(" 7 <|im_end|><|endoftext|>\n", ["<|im_end|>", "<|endoftext|>"]) == "7"


# -- splits ------------------------------------------------------------------------------------
def test_held_out_fraction_is_deterministic_and_disjoint(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(50)]
    p = _jsonl(tmp_path / "d.jsonl", rows)
    a = DatasetEnv(path=str(p), eval_fraction=0.1, split_seed=3)
    b = DatasetEnv(path=str(p), eval_fraction=0.1, split_seed=3)
    ev = [t["row"] for t in a.tasks("eval", 0)]
    perm = list(range(50))
    random.Random(3).shuffle(perm)
    assert ev == sorted(perm[:5])  # ceil(0.1 * 50) rows, source order
    assert ev == [t["row"] for t in b.tasks("eval", 123)]  # independent of the run seed
    train = {t["row"] for t in a._train}
    assert train == set(range(50)) - set(ev)
    other = DatasetEnv(path=str(p), eval_fraction=0.1, split_seed=4)
    assert [t["row"] for t in other.tasks("eval", 0)] != ev


def test_train_rows_that_repeat_an_eval_prompt_are_dropped(files):
    _, train, _ = files
    test = _jsonl(train.parent / "ev.jsonl", [ROWS[1]])
    env = DatasetEnv(path=str(train), eval_path=str(test), prompt_field="q", answer_field="a")
    assert env.dropped_overlap == 1
    assert ROWS[1]["q"] not in {t["question"] for t in env._train}


def test_train_epochs_reshuffle_and_epochs_limit(files):
    _, train, test = files
    env = DatasetEnv(path=str(train), eval_path=str(test), prompt_field="q", answer_field="a")
    stream = TaskStream(env, seed=5)
    e0 = [t["row"] for t in stream.take(5)]
    e1 = [t["row"] for t in stream.take(5)]
    o0, o1 = list(range(5)), list(range(5))
    random.Random(5).shuffle(o0)
    random.Random(6).shuffle(o1)
    assert (e0, e1) == (o0, o1)
    plain = DatasetEnv(path=str(train), eval_path=str(test), prompt_field="q", answer_field="a", shuffle=False, epochs=2)
    assert [t["row"] for t in plain.tasks("train", 9)] == [0, 1, 2, 3, 4] * 2
    check_train_split(plain, 0, 10)
    with pytest.raises(SplitExhausted, match="has 10 tasks and must not repeat"):
        check_train_split(plain, 0, 11)


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts, rows, msg", [
    ({}, [{"prompt": "a", "answer": "1"}, {"question": "b", "answer": "2"}],
     r"agent.options.prompt_field = 'prompt': train row 2 has no such field; fields: \['answer', 'question'\]"),
    ({}, [{"prompt": "a", "answer": "1"}, {"prompt": "b"}],
     r"agent.options.answer_field = 'answer': train row 2 has no such field"),
    ({"template": "{x} and {y}"}, [{"x": 1, "answer": "1"}],
     r"agent.options.template '\{x\} and \{y\}' refers to 'y', which train row 1 lacks"),
    ({"messages_field": "m"}, [{"m": "hi", "answer": "1"}],
     r"agent.options.messages_field = 'm': train row 1 has no list of \{role, content\} messages"),
    ({"messages_field": "m", "template": "{m}"}, [{"m": []}], "set either messages_field .* or template"),
    ({"answer_field": ""}, [{"prompt": "a"}], "scorer = 'exact' compares the reply with answer_field"),
])
def test_errors_name_the_option_and_row(tmp_path, opts, rows, msg):
    p = _jsonl(tmp_path / "d.jsonl", rows)
    ev = _jsonl(tmp_path / "e.jsonl", [{"prompt": "z", "answer": "0", "x": 0, "y": 0, "m": [{"role": "user", "content": "z"}]}])
    with pytest.raises(ValueError, match=msg):
        DatasetEnv(path=str(p), eval_path=str(ev), **opts)


def test_source_errors(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"agent.options.path = .*d.csv': unknown format '.csv'"):
        DatasetEnv(path=str(tmp_path / "d.csv"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="split 'train' has no rows"):
        DatasetEnv(path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is a JSON list, not an object"):
        DatasetEnv(path=str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad2.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        DatasetEnv(path=str(tmp_path / "bad2.jsonl"))
    with pytest.raises(ValueError, match="no shipped dataset 'nope'; shipped: chain_sum"):
        DatasetEnv(path="builtin:nope")
    _jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ValueError, match="eval_fraction = 0.1 of 1 rows leaves no train row"):
        DatasetEnv(path=str(tmp_path / "one.jsonl"))
    with pytest.raises(ValueError, match=r"invalid options: agent.options.eval_fraction"):
        DatasetEnv(path=str(tmp_path / "one.jsonl"), eval_fraction=1.5)


def test_relative_data_paths_are_made_absolute_for_the_workers(tmp_path, monkeypatch):
    from molt_core.config import RunConfig
    from molt_core.runtime.loop import _absolute

    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = RunConfig.model_validate({"agent": {"name": "dataset", "options": {"path": "d.jsonl", "eval_path": "none.jsonl"}},
                                    "sft": {"data": "d.jsonl"}})
    got = _absolute(cfg)
    assert got.agent.options == {"path": str(tmp_path / "d.jsonl"), "eval_path": "none.jsonl"}  # a missing one stays
    assert got.sft.data == str(tmp_path / "d.jsonl")


def test_registered_as_dataset():
    from molt_core.plugins import load_plugins

    assert load_plugins().get("envs", "dataset") is DatasetEnv


# -- the shipped dataset ----------------------------------------------------------------------
def test_builtin_chain_sum_is_correct_and_disjoint():
    env = DatasetEnv(path="builtin:chain_sum", eval_split="test", template="What is {expression}?")
    ev, tr = list(env.tasks("eval", 0)), env._train
    assert (len(ev), len(tr), env.dropped_overlap) == (300, 3000, 0)
    assert not {t["expression"] for t in ev} & {t["expression"] for t in tr}
    for t in ev + tr:  # every answer checked independently of reasoning-gym
        a, op1, b, op2, c = t["expression"].split()
        v = int(a) + (int(b) if op1 == "+" else -int(b))
        v += int(c) if op2 == "+" else -int(c)
        assert t["answer"] == str(v) and t["question"] == f"What is {t['expression']}?"
    sizes = {p.name: p.stat().st_size for p in (BUILTIN_DATASETS_DIR / "chain_sum").iterdir()}
    assert sum(sizes.values()) < 300_000
    sft_rows = load_rows("builtin:chain_sum/sft.jsonl")
    assert sft_rows[0] == {"prompt": f"What is {tr[0]['expression']}?", "completion": tr[0]["answer"]}
    assert len(sft_rows) == 500


def test_make_dataset_reproduces_the_shipped_files(tmp_path):
    pytest.importorskip("reasoning_gym")
    from molt_core.assets.datasets.make_dataset import build

    for p in build(tmp_path):
        assert p.read_bytes() == (BUILTIN_DATASETS_DIR / "chain_sum" / p.name).read_bytes(), p.name


# -- the recipe learns ---------------------------------------------------------------------------
@pytest.mark.slow
def test_dataset_recipe_learns_on_its_jsonl(tmp_path, monkeypatch):
    """recipes/dataset.toml, shortened to 100 GRPO steps: the SFT warm start on the train rows'
    answers lifts held-out pass@1 (T = 1, 300 test rows) from 0 to >= 0.15, and GRPO raises it
    by >= 0.05 more (measured: 0.307 -> 0.400 at step 100 in the full run, README); `molt eval`
    of the final checkpoint gives the run's last pass@1."""
    from molt_core import runtime
    from molt_core.cli.recipe import load_config
    from molt_core.plugins import load_plugins

    cfg = load_config("dataset", ["run.steps=100", "eval.every=0", "checkpoint.every=0"])
    monkeypatch.chdir(tmp_path)
    out = runtime.main_job(cfg, load_plugins(), out_dir=str(tmp_path / "run"), local=True, recipe_name="dataset")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    assert [s for s, _ in evals] == [0, 100]
    (_, first), (_, last) = evals
    assert first >= 0.15, evals
    assert last >= first + 0.05, evals
    # every training step reports token identity (it passed on any run when filtered by the key)
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 100
    assert all(r["invariants/tokens_retokenized"] == 0 == r["invariants/tokens_unverified"] for r in steps)
    # `molt eval` on the final checkpoint reports the run's last eval: the eval split is fixed
    from click.testing import CliRunner

    from molt_core.cli import main

    res = CliRunner().invoke(main, ["eval", "--model", str(out / "checkpoints" / "step_00000100")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["eval/pass@1"] == last


def test_eval_split_of_a_single_file_is_refused_naming_eval_fraction(tmp_path):
    # a single file has no splits: eval_split would hold out every train row (found by a new-user
    # trial pointing recipes/dataset.toml, eval_split = "test", at one JSONL file)
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(10)))
    with pytest.raises(ValueError) as e:
        DatasetEnv(path=str(f), eval_split="test", prompt_field="prompt", answer_field="answer")
    msg = str(e.value)
    assert msg.startswith(f"agent.options.eval_split = 'test': agent.options.path = {str(f)!r} is one file")
    assert "agent.options.eval_fraction" in msg and "molt run examples/dataset --set agent.options.path=FILE" in msg
    env = DatasetEnv(path=str(f), eval_fraction=0.2, prompt_field="prompt", answer_field="answer")  # the fix it names
    assert len(list(env.tasks("eval", 0))) == 2
