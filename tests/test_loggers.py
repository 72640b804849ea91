"""Loggers: JSONL rows and rewind; TensorBoard scalars read back; W&B offline run written;
neither tensorboard, wandb nor mlflow is imported unless enabled; [loggers.NAME] option tables
reach the logger; sample tables (W&B, TensorBoard, MLflow) hold the exact rows (issue 13, item 9)."""

from __future__ import annotations

import glob
import json
import math
import subprocess
import sys

import pytest

from molt_plugins.loggers.jsonl import JsonlLogger, read_metrics


def test_jsonl_rows_and_rewind(tmp_path):
    lg = JsonlLogger(tmp_path)
    for s in range(4):
        lg.log(s, {"reward/mean": s / 4, "loss": float("nan") if s == 2 else -s})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1] == {"step": 1, "reward/mean": 0.25, "loss": -1}
    assert math.isnan(rows[2]["loss"])
    assert lg.rewind(1) == 2
    lg.log(2, {"reward/mean": 0.9})
    lg.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(0, 0.0), (1, 0.25), (2, 0.9)]
    with pytest.raises(ValueError, match="closed"):
        lg.log(3, {})
    with pytest.raises(ValueError, match="disagrees"):
        JsonlLogger(tmp_path / "b").log(1, {"step": 2})
    with pytest.raises(ValueError, match=r"loggers.jsonl.nope"):
        JsonlLogger(tmp_path, nope=1)


def test_jsonl_skips_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    assert read_metrics(p) == [{"step": 0, "a": 1}]


def test_optional_backends_not_imported_until_enabled():
    code = ("import sys; from molt_core.plugins import load_plugins; h = load_plugins(); "
            "assert {'jsonl','tensorboard','wandb','mlflow'} <= set(h.names('loggers')); "
            "print(sorted(m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from molt_plugins.loggers.tensorboard_logger import TensorBoardLogger

    lg = TensorBoardLogger(tmp_path, None)
    lg.log(0, {"reward/mean": 0.5, "note": "skipped"})
    lg.log(1, {"reward/mean": 0.75})
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.5), (1, 0.75)]


def test_wandb_offline_without_account(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from molt_core.config import RunConfig
    from molt_plugins.loggers.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = RunConfig.model_validate({"run": {"name": "wb-test"}})
    lg = WandbLogger(tmp_path, cfg)
    lg.log(0, {"reward/mean": 0.125})
    lg.log(1, {"reward/mean": 0.375})
    lg.close()
    # wandb's service process may still be flushing the offline file when finish() returns
    import time

    deadline, data = time.time() + 30, b""
    while time.time() < deadline:
        files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(files) <= 1
        data = open(files[0], "rb").read() if files else b""
        if b"0.375" in data and b"wb-test" in data:
            break
        time.sleep(0.2)
    # the history records hold the key and the JSON values (protobuf strings are stored raw)
    assert b"reward/mean" in data and b"0.125" in data and b"0.375" in data
    assert b"wb-test" in data  # the run config / name went in too
    with pytest.raises(ValueError, match=r"loggers.wandb.mode"):
        WandbLogger(tmp_path, cfg, mode="cloud")


def test_logger_json_schema_lists_options():
    from molt_plugins.loggers.wandb_logger import WandbOptions

    assert json.loads(json.dumps(WandbOptions.model_json_schema()))["properties"]["mode"]["default"] == "offline"


# -- [loggers.NAME] option tables -------------------------------------------------------------

def test_loggers_list_and_table_forms():
    from molt_core.config import ConfigError, RunConfig
    from molt_core.cli.recipe import apply_overrides, validate_config

    assert RunConfig.model_validate({"loggers": ["wandb", "tensorboard"]}).loggers == {"wandb": {}, "tensorboard": {}}
    cfg = RunConfig.model_validate({"loggers": {"wandb": {"mode": "online", "project": "p"}}})
    assert cfg.loggers == {"wandb": {"mode": "online", "project": "p"}}
    import tomllib

    assert RunConfig.model_validate(tomllib.loads(cfg.to_toml())) == cfg  # the written form loads back
    assert "[loggers.wandb]\nmode = \"online\"" in cfg.to_toml()
    # --set into the list form of a recipe
    data = apply_overrides({"loggers": ["wandb"]}, ["loggers.wandb.mode=disabled", "loggers.mlflow.run_name=r1"])
    assert data["loggers"] == {"wandb": {"mode": "disabled"}, "mlflow": {"run_name": "r1"}}
    with pytest.raises(ConfigError, match=r"loggers: expected logger names \(strings\) or \[loggers.NAME\] option "
                                          r"tables, got 3"):
        validate_config({"loggers": ["wandb", 3]})
    with pytest.raises(ConfigError, match=r"loggers: a logger is named twice in \['wandb', 'wandb'\]"):
        validate_config({"loggers": ["wandb", "wandb"]})


RECORDER = """
from molt_core.hookspecs import hookimpl
from pydantic import BaseModel, ConfigDict

class RecOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: int = 1
    label: str = "x"

class Recorder:
    Options = RecOptions
    built = []
    def __init__(self, run_dir, config, **options):
        self.options = options
        self.rows = []
        Recorder.built.append(self)
    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))
    def close(self):
        pass

@hookimpl
def molt_register_loggers(register):
    register("recorder", Recorder)
"""


def _recorder_host(tmp_path):
    from molt_core.plugins import load_plugins

    f = tmp_path / "recorder_plugin.py"
    f.write_text(RECORDER)
    return load_plugins([str(f)])


def test_runlog_passes_options_and_checks_them(tmp_path):
    from molt_core.config import RunConfig
    from molt_core.runtime.rundir import RunLog, check_loggers

    host = _recorder_host(tmp_path)
    cfg = RunConfig.model_validate({"loggers": {"recorder": {"level": 3, "label": "abc"}}})
    for d in ("run", "run2", "run3"):
        (tmp_path / d).mkdir()
    log = RunLog(tmp_path / "run", cfg, host, resume_step=None)
    rec = host.get("loggers", "recorder").built[-1]
    assert rec.options == {"level": 3, "label": "abc"}
    log.log(1, {"reward/mean": 0.5})
    assert rec.rows == [(1, {"reward/mean": 0.5})]
    cfg = RunConfig.model_validate({"loggers": ["recorder"]})  # list form: no options
    RunLog(tmp_path / "run2", cfg, host, resume_step=None)
    assert host.get("loggers", "recorder").built[-1].options == {}
    bad = RunConfig.model_validate({"loggers": {"recorder": {"levle": 3, "label": 5}}})
    with pytest.raises(ValueError) as e:
        check_loggers(bad, host)
    assert str(e.value) == ("invalid logger options: loggers.recorder.label: Input should be a valid string (got 5; quote it for "
                            "text: --set 'loggers.recorder.label=\"5\"'); "
                            "loggers.recorder.levle: unknown option (did you mean 'level'? options of recorder: level, label)")
    with pytest.raises(ValueError, match=r"^loggers.recordr: no logger named 'recordr' \(did you mean 'recorder'\?\); "
                                         r"registered: .*--plugin FILE.py"):
        RunLog(tmp_path / "run3", RunConfig.model_validate({"loggers": ["recordr"]}), host, resume_step=None)


def test_runlog_jsonl_options(tmp_path):
    from molt_core.config import RunConfig
    from molt_core.plugins import load_plugins
    from molt_core.runtime.rundir import RunLog

    host = load_plugins()
    log = RunLog(tmp_path, RunConfig.model_validate({"loggers": {"jsonl": {"filename": "copy.jsonl"}}}), host, None)
    log.log(1, {"a": 0.5})
    log.close()
    assert read_metrics(tmp_path / "copy.jsonl") == [{"step": 1, "a": 0.5}]
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "a": 0.5}]
    (tmp_path / "b").mkdir()
    log = RunLog(tmp_path / "b", RunConfig.model_validate({"loggers": ["jsonl"]}), host, None)
    assert log.loggers == []  # metrics.jsonl is RunLog's own file: no second writer


# -- sample tables --------------------------------------------------------------------------

ROWS = [
    {"prompt": "What is 2+3?", "completion": "5", "reward": 1.0, "status": "ok"},
    {"prompt": "a | b\nc", "completion": "x", "reward": 0.25, "status": "ok"},
    {"prompt": "p", "completion": "", "reward": None, "status": "failed"},
]


def test_sample_table_and_markdown():
    from molt_plugins.loggers.samples import markdown_table, sample_table

    assert sample_table(ROWS) == [["What is 2+3?", "5", 1.0, "ok"], ["a | b\nc", "x", 0.25, "ok"], ["p", "", None, "failed"]]
    assert sample_table([{"prompt": "p", "completion": "c", "reward": float("nan"), "status": "failed"}])[0][2] is None
    assert markdown_table(ROWS) == (
        "| prompt | completion | reward | status |\n"
        "|---|---|---|---|\n"
        "| What is 2+3? | 5 | 1 | ok |\n"
        "| a \\| b<br>c | x | 0.25 | ok |\n"
        "| p |  |  | failed |"
    )
    with pytest.raises(ValueError, match=r"samples\[1\]: missing key\(s\) reward, status"):
        sample_table([ROWS[0], {"prompt": "p", "completion": "c"}])
    with pytest.raises(ValueError, match=r"samples\[0\].reward: expected a number or None, got str '1'"):
        sample_table([{**ROWS[0], "reward": "1"}])


def test_tensorboard_samples_as_markdown_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    from molt_plugins.loggers.samples import markdown_table
    from molt_plugins.loggers.tensorboard_logger import TensorBoardLogger

    lg = TensorBoardLogger(tmp_path, None)
    lg.log_samples(3, ROWS)
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (ev,) = acc.Tensors("samples/text_summary")
    assert ev.step == 3
    assert tensor_util.make_ndarray(ev.tensor_proto).item().decode() == markdown_table(ROWS)


def test_wandb_samples_table_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from molt_core.config import RunConfig
    from molt_plugins.loggers.wandb_logger import WandbLogger

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = RunConfig.model_validate({"run": {"name": "wb-samples"}})
    lg = WandbLogger(tmp_path, cfg, group="seeds", tags=["a"])
    assert (lg._run.group, list(lg._run.tags), lg._run.project) == ("seeds", ["a"], "wb-samples")
    lg.log_samples(2, ROWS)
    lg.close()
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "media" / "table" / "samples_*.table.json"))
    assert len(files) == 1
    table = json.load(open(files[0]))
    assert table["columns"] == ["step", "prompt", "completion", "reward", "status"]
    assert table["data"] == [[2, "What is 2+3?", "5", 1.0, "ok"], [2, "a | b\nc", "x", 0.25, "ok"],
                             [2, "p", "", None, "failed"]]


# -- mlflow (a fake module records the calls; the real package is tested when installed) -----

class _FakeClient:
    calls: list = []

    def __init__(self, tracking_uri=None):
        self.calls.append(("init", tracking_uri))

    def get_experiment_by_name(self, name):
        self.calls.append(("get_experiment_by_name", name))
        return None

    def create_experiment(self, name, artifact_location=None):
        self.calls.append(("create_experiment", name, artifact_location))
        return "7"

    def create_run(self, experiment_id, run_name=None, tags=None):
        import types

        self.calls.append(("create_run", experiment_id, run_name, tags))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))

    def log_batch(self, run_id, metrics=(), params=()):
        self.calls.append(("log_batch", run_id, [tuple(m) for m in metrics], [tuple(p) for p in params]))

    def log_table(self, run_id, data, artifact_file):
        self.calls.append(("log_table", run_id, data, artifact_file))

    def set_terminated(self, run_id, status=None):
        self.calls.append(("set_terminated", run_id, status))


@pytest.fixture
def fake_mlflow(monkeypatch):
    import collections
    import types

    mod = types.ModuleType("mlflow")
    mod.tracking = types.ModuleType("mlflow.tracking")
    mod.entities = types.ModuleType("mlflow.entities")
    mod.tracking.MlflowClient = _FakeClient
    mod.entities.Metric = collections.namedtuple("Metric", "key value timestamp step")
    mod.entities.Param = collections.namedtuple("Param", "key value")
    for name, m in (("mlflow", mod), ("mlflow.tracking", mod.tracking), ("mlflow.entities", mod.entities)):
        monkeypatch.setitem(sys.modules, name, m)
    _FakeClient.calls = []
    return _FakeClient.calls


def test_mlflow_logger_calls(tmp_path, fake_mlflow, monkeypatch):
    from molt_core.config import RunConfig
    from molt_plugins.loggers import mlflow_logger
    from molt_plugins.loggers.mlflow_logger import MlflowLogger

    monkeypatch.setattr(mlflow_logger.time, "time", lambda: 1700000000.5)
    cfg = RunConfig.model_validate({"run": {"name": "ml-test", "steps": 3}})
    lg = MlflowLogger(tmp_path, cfg, tags={"team": "rl"})
    assert fake_mlflow[:4] == [("init", f"sqlite:///{tmp_path.resolve()}/mlflow.db"), ("get_experiment_by_name", "ml-test"),
                               ("create_experiment", "ml-test", f"file://{tmp_path.resolve()}/mlartifacts"),
                               ("create_run", "7", "ml-test", {"team": "rl"})]
    params = dict(p for c in fake_mlflow[4:] for p in c[3])
    assert all(c[0] == "log_batch" and len(c[3]) <= 100 for c in fake_mlflow[4:])
    assert params["run.steps"] == "3" and params["run.name"] == "ml-test" and params["trainer.betas"] == "[0.9, 0.98]"
    assert params["async.max_staleness"] == "0"
    n = len(fake_mlflow)
    lg.log(2, {"reward/mean": 0.5, "eval/pass@1": 1, "note": "text", "flag": True})
    lg.log_samples(2, ROWS[:2])
    lg.close()
    lg.close()
    assert fake_mlflow[n:] == [
        ("log_batch", "r1", [("reward/mean", 0.5, 1700000000500, 2), ("eval/pass_at_1", 1.0, 1700000000500, 2)], []),
        ("log_table", "r1", {"step": [2, 2], "prompt": ["What is 2+3?", "a | b\nc"], "completion": ["5", "x"],
                             "reward": [1.0, 0.25], "status": ["ok", "ok"]}, "samples/step_000002.json"),
        ("set_terminated", "r1", "FINISHED"),
    ]
    fake_mlflow.clear()
    MlflowLogger(tmp_path, cfg, tracking_uri="http://127.0.0.1:1", experiment="exp", run_name="r", log_config=False)
    assert fake_mlflow == [("init", "http://127.0.0.1:1"), ("get_experiment_by_name", "exp"),
                           ("create_experiment", "exp", None), ("create_run", "7", "r", {})]
    with pytest.raises(ValueError, match=r"loggers.mlflow.experimnt: Extra inputs"):
        MlflowLogger(tmp_path, cfg, experimnt="x")


def test_mlflow_missing_names_the_extra(tmp_path, monkeypatch):
    from molt_core.config import RunConfig
    from molt_core.plugins import load_plugins
    from molt_core.runtime.rundir import RunLog

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    monkeypatch.setitem(sys.modules, "mlflow.entities", None)
    cfg = RunConfig.model_validate({"loggers": ["mlflow"]})
    with pytest.raises(ValueError, match=r"^loggers.mlflow: the mlflow logger needs the `mlflow` package: "
                                         r"pip install 'molt-sdk\[mlflow\]'$"):
        RunLog(tmp_path, cfg, load_plugins(), resume_step=None)


def test_mlflow_key_and_params():
    from molt_plugins.loggers.mlflow_logger import flat_params, mlflow_key

    assert mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_key("a b-c.d:e/f_g") == "a b-c.d:e/f_g"
    assert mlflow_key("x%y(z)") == "x_y_z_"
    assert flat_params({"a": {"b": 1, "c": "s", "d": None, "e": {}}, "f": "x" * 600}) == {
        "a.b": "1", "a.c": "s", "a.d": "null", "f": "x" * 497 + "..."}


def test_mlflow_real_local_store(tmp_path):
    """The real package (when installed, e.g. `pip install 'molt-sdk[mlflow]'`): the default local
    store (SQLite in the run dir, artifacts beside it) holds the metrics, params and the samples table."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from molt_core.config import RunConfig
    from molt_plugins.loggers.mlflow_logger import MlflowLogger

    cfg = RunConfig.model_validate({"run": {"name": "ml-real", "steps": 3}})
    lg = MlflowLogger(tmp_path, cfg)
    lg.log(1, {"reward/mean": 0.25, "eval/pass@1": 0.5})
    lg.log(2, {"reward/mean": 0.75})
    lg.log_samples(2, ROWS[:2])
    lg.close()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    run = client.get_run(lg.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "ml-real"
    assert client.get_experiment(run.info.experiment_id).name == "ml-real"
    assert run.data.params["run.steps"] == "3"
    hist = [(m.step, m.value) for m in client.get_metric_history(lg.run_id, "reward/mean")]
    assert sorted(hist) == [(1, 0.25), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(lg.run_id, "eval/pass_at_1")] == [(1, 0.5)]
    path = client.download_artifacts(lg.run_id, "samples/step_000002.json", str(tmp_path / "dl"))
    table = json.load(open(path))
    assert table["columns"] == ["step", "prompt", "completion", "reward", "status"]
    assert table["data"] == [[2, "What is 2+3?", "5", 1.0, "ok"], [2, "a | b\nc", "x", 0.25, "ok"]]
    assert list((tmp_path / "mlartifacts").rglob("step_000002.json"))  # beside the store, not in the cwd


def test_runlog_hands_wandb_its_options(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from molt_core.config import RunConfig
    from molt_core.plugins import load_plugins
    from molt_core.runtime.rundir import RunLog

    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = RunConfig.model_validate({"loggers": {"wandb": {"mode": "disabled", "project": "p", "group": "g"}}})
    log = RunLog(tmp_path, cfg, load_plugins(), resume_step=None)
    (lg,) = log.loggers
    assert (lg.options.mode, lg.options.project, lg.options.group) == ("disabled", "p", "g")
    log.log(1, {"reward/mean": 0.5})
    log.close()
    assert not list(tmp_path.glob("wandb/offline-run-*"))  # disabled: nothing written, nothing sent
