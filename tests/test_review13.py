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
