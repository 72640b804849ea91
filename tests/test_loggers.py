"""Loggers: JSONL rows and rewind; TensorBoard scalars read back; W&B offline run written;
neither tensorboard nor wandb is imported unless enabled."""

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
            "assert {'jsonl','tensorboard','wandb'} <= set(h.names('loggers')); "
            "print(sorted(m for m in ('wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))")
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
