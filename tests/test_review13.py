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
