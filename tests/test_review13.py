"""Review of issue 13: regressions for what the adversarial review found."""

import json
import traceback

import pytest
from click.testing import CliRunner

from molt_core.cli import main


def _ray_task_error(cause: Exception):
    from ray.exceptions import RayTaskError

    try:
        raise cause
    except Exception as e:
        tb = "".join(traceback.format_exception(e))
    return RayTaskError("sft_begin", tb, cause, proctitle="ray::TrainerWorker.sft_begin").as_instanceof_cause()


@pytest.mark.parametrize("cause", [RuntimeError("worker exploded"), ValueError("bad value in a worker")])
def test_a_ray_worker_error_reaches_a_redirected_log_without_ansi_codes(monkeypatch, cause):
    """Ray colours the worker name in a RayTaskError's text whatever the terminal (issue 13
    item 7): `molt run` prints it as an error, exit 1, with no escape codes and no Python
    traceback of the driver."""
    import molt_core.runtime as runtime

    err = _ray_task_error(cause)
    assert "\x1b[" in str(err)  # the fault is real: Ray's text carries the codes

    def boom(*a, **k):
        raise err

    monkeypatch.setattr(runtime, "main_job", boom)
    res = CliRunner().invoke(main, ["run", "quickstart", "--local", "--steps", "1"])
    assert res.exit_code == 1, res.output
    assert "\x1b[" not in res.output
    assert "a Ray worker failed" in res.output and str(cause) in res.output
    assert "ray::TrainerWorker.sft_begin()" in res.output


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("rows, options, expect", [
    # a malformed template was a bare "expected '}' before end of string", naming no option
    ([{"q": f"a{i}", "answer": "1"} for i in range(10)], {"template": "Q: {q"},
     "agent.options.template 'Q: {q' is not a valid format string"),
    # a null answer was reported as "no such field" while the field list showed it
    ([{"prompt": f"a{i}", "answer": None} for i in range(10)], {}, "has a null value"),
    # chat rows: null / non-text content was sent as the text "None" or a Python repr
    ([{"messages": [{"role": "user", "content": None}], "answer": "1"} for _ in range(10)],
     {"messages_field": "messages"}, "message 1 has content of type NoneType"),
    ([{"messages": [{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]}], "answer": "1"} for i in range(10)],
     {"messages_field": "messages"}, "message 1 has content of type list"),
    # a misspelt role, and a chat with no user message, were accepted
    ([{"messages": [{"role": "usr", "content": f"q{i}"}], "answer": "1"} for i in range(10)],
     {"messages_field": "messages"}, "message 1 has role 'usr'"),
    ([{"messages": [{"role": "system", "content": f"s{i}"}, {"role": "assistant", "content": "1"}]} for i in range(10)],
     {"messages_field": "messages"}, "has no user message"),
])
def test_dataset_env_refuses_malformed_rows_naming_the_option(tmp_path, rows, options, expect):
    from molt_plugins.envs.dataset import DatasetEnv

    with pytest.raises(ValueError, match="agent.options") as e:
        DatasetEnv(path=_jsonl(tmp_path / "d.jsonl", rows), **options)
    assert expect in str(e.value)


def test_dataset_env_accepts_a_well_formed_chat_with_a_system_message(tmp_path):
    from molt_plugins.envs.dataset import DatasetEnv

    rows = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": str(i)}]} for i in range(10)]
    env = DatasetEnv(path=_jsonl(tmp_path / "d.jsonl", rows), messages_field="messages")
    task = next(env.tasks("train", 0))
    assert env.first_messages(task)[0] == {"role": "system", "content": "be brief"} and task["answer"] == task["question"][1:]


CHAT_PARITY = '''
import openai
from molt_core.agents import AgentContext, ChatAgent
from molt_core.types import Result


class ParityChat(ChatAgent):
    def tasks(self, split, seed):
        for i in range(10**6 if split == "train" else 16):
            yield {"i": i}

    async def run(self, ctx: AgentContext) -> Result:
        client = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        messages = [{"role": "user", "content": f"Say {ctx.task['i']}."}]
        oks = []
        for follow in ("Again.", None):  # no seed sent: the agent talks as to any OpenAI server
            r = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                     max_tokens=ctx.sampling.max_tokens,
                                                     temperature=ctx.sampling.temperature)
            reply = r.choices[0].message.content or ""
            oks.append(len(reply) % 2 == 0)
            messages.append({"role": "assistant", "content": reply})
            if follow:
                messages.append({"role": "user", "content": follow})
        await client.close()
        return Result(reward=0.5 * sum(oks), terminated=True, score=1.0 if oks[-1] else 0.0)
'''

from test_evaluate import RECIPE as CHAT_RECIPE  # noqa: E402  (the same tiny 2-turn recipe)


def test_molt_eval_of_a_chat_agent_reports_the_runs_final_eval(tmp_path):
    """Issue 13 item 12 for a ChatAgent: its requests carry no seed, so the eval was unseeded
    (the engine's own stream) and `molt eval` on the final checkpoint reported another pass@1
    than the run logged (measured 0.4375 vs 0.375). The runtime now seeds the eval session."""
    (tmp_path / "parity_chat.py").write_text(CHAT_PARITY)
    recipe = tmp_path / "pc.toml"
    recipe.write_text(CHAT_RECIPE.format(agent=tmp_path / "parity_chat.py"))
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", str(recipe), "--local", "--out", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output[-3000:]
    final = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
    assert final["step"] == 2 and 0.0 < final["eval/pass@1"] < 1.0
    res = CliRunner().invoke(main, ["eval", "--model", str(out / "checkpoints" / "step_00000002")], catch_exceptions=False)
    assert res.exit_code == 0, res.output[-3000:]
    rep = json.loads((out / "eval" / "step_00000002.json").read_text())
    assert rep["metrics"] == {k: v for k, v in final.items() if k.startswith("eval/")}


def test_molt_show_header_is_not_cut_at_80_columns(tmp_path):
    """A real rollout id is 34 characters: the header (status, reward, score, versions,
    truncated) passes 80 columns, and a rich Rule cut it to "versions 0…", hiding that the
    rollout was truncated, in a redirected `molt show` (80 columns)."""
    import io

    from rich.console import Console

    from molt_core.cli.show import show_run

    rid = "r-f1b45a328a714704bee3429ae5ab7d12"
    row = {"step": 1, "rollout_id": rid, "status": "ok", "reward": 0.0, "score": 0.0, "truncated": True,
           "segments": [{"versions": [None, 0, 0]}], "turns": [{"context": "What is 1 + 1?", "response": "91006002",
                                                                 "versions": [0, 0]}]}
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(row) + "\n")
    buf = io.StringIO()
    show_run(tmp_path, console=Console(file=buf, width=80, force_terminal=False, soft_wrap=True))
    out = buf.getvalue()
    assert f"{rid}  ok  reward 0.000  score 0.000  versions 0  truncated" in out
    assert "…" not in out and "\x1b[" not in out


def test_set_on_plugin_option_tables_keeps_dates_as_text_and_says_how_to_quote_numbers():
    """`--set` parses a value as TOML; a core string field gets the raw text back, but a
    plugin's option table (loggers.NAME, agent.options, rewards.NAME) is untyped there, so
    `--set loggers.wandb.name=2024-01-01` became a date and `project=123` an int: both failed
    with a bare "Input should be a valid string" (issue 13 items 8b and 9)."""
    from molt_core.cli.recipe import load_config
    from molt_core.plugins import load_plugins
    from molt_core.runtime.rundir import check_loggers

    host = load_plugins([])
    cfg = load_config("examples/wandb", ["loggers.wandb.name=2024-01-01"])
    assert cfg.loggers["wandb"]["name"] == "2024-01-01"
    check_loggers(cfg, host)
    with pytest.raises(ValueError) as e:
        check_loggers(load_config("examples/wandb", ["loggers.wandb.project=123"]), host)
    assert "loggers.wandb.project: Input should be a valid string (got 123; quote it for text: " \
           "--set 'loggers.wandb.project=\"123\"')" in str(e.value)
    check_loggers(load_config("examples/wandb", ['loggers.wandb.project="123"']), host)  # the quoted form works
    res = CliRunner().invoke(main, ["run", "quickstart", "--local", "--set", "agent.options.prompt_template=123"])
    assert res.exit_code == 2 and "--set 'agent.options.prompt_template=\"123\"'" in res.output


def test_molt_eval_of_a_missing_checkpoint_path_says_no_such_directory(tmp_path):
    """A pruned or mistyped checkpoint path was taken for a Hub id, and `molt eval` answered
    "give a RECIPE ... only for a run's checkpoint" (issue 13 item 12)."""
    from molt_core.cli.evaluate import resolve_model

    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    missing = tmp_path / "checkpoints" / "step_00000000"
    res = CliRunner().invoke(main, ["eval", "--model", str(missing)])
    assert res.exit_code == 2
    out = " ".join(res.output.split())
    assert f"--model {missing}: no such file or directory" in out and "step_00000002" in out
    assert resolve_model("Qwen/Qwen3-0.6B")["kind"] == "hf"  # a Hub id is still one
    assert resolve_model("builtin:tiny-qwen3")["kind"] == "hf"


def test_run_threads_is_what_the_trainer_and_molt_sft_use(tmp_path):
    """tests/test_trainer_sft.py checked `torch.get_num_threads() == 1` with run.threads = 1,
    which conftest already sets for every test: it could not fail. Here the setting differs
    from the ambient thread count (issue 13 item 3)."""
    import torch

    from molt_core.cli.recipe import load_config
    from molt_core.runtime import TrainerWorker

    try:
        torch.set_num_threads(1)
        TrainerWorker(load_config("quickstart", ["run.threads=3", "sft.steps=0"]))
        assert torch.get_num_threads() == 3
        torch.set_num_threads(1)
        res = CliRunner().invoke(main, ["sft", "quickstart", "--out", str(tmp_path / "o"), "--set", "run.threads=2",
                                        "--set", "sft.steps=1", "--set", "sft.batch_size=2", "--set", "sft.n_examples=4"])
        assert res.exit_code == 0, res.output
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
