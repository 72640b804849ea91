"""Checkpoints: save -> kill -> resume is bit-exact (CPU fp32), retention, HF-loadable, atomic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from molt_core.models import load_model, load_tokenizer
from molt_core.train import Trainer, latest_checkpoint, list_checkpoints
from trainer_utils import set_behaviour, synthetic_rollouts, tiny_cfg

HERE = Path(__file__).resolve().parent

# A config where every piece of optimizer/scheduler state matters: warmup + cosine decay,
# weight decay, two PPO epochs (ratio != 1 in the second), a KL term to the frozen reference.
SECTIONS = {
    "run": {"steps": 5, "seed": 0},
    "trainer": {"lr": 3e-3, "warmup_steps": 1, "lr_schedule": "cosine", "weight_decay": 0.01,
                "ppo_epochs": 2, "micro_batch_size": 5},
    "algo": {"kl_coef": 0.05},
    "checkpoint": {"keep": 2},
}


def step(trainer: Trainer, i: int) -> dict:
    trajs = synthetic_rollouts(100 + i, n_groups=2, n_per_group=4, two_segments_every=3)
    set_behaviour(trainer, trajs)
    return trainer.train_step(trajs)


CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    import torch
    torch.set_num_threads(1)
    from molt_core.train import Trainer
    from test_trainer_checkpoint import SECTIONS, step
    from trainer_utils import tiny_cfg
    tr = Trainer(tiny_cfg(**SECTIONS))
    for i in range(2):
        step(tr, i)
    path = tr.save_checkpoint({run_dir!r}, {{"next_batch": 2}})
    print("SAVED", path, flush=True)
    time.sleep(600)
""")


def test_save_kill_resume_is_bit_exact(tmp_path):
    # uninterrupted: 4 steps
    ref = Trainer(tiny_cfg(**SECTIONS))
    metrics = [step(ref, i) for i in range(4)]

    # 2 steps in a child process, checkpoint, SIGKILL
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(here=str(HERE), run_dir=str(run_dir))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("SAVED"), proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # fresh trainer from a *different* init, resumed from the checkpoint: 2 more steps
    other = load_model("builtin:tiny-qwen3", seed=123)
    res = Trainer(tiny_cfg(**SECTIONS), model=other, tokenizer=load_tokenizer("builtin:tiny-qwen3"))
    cursor = res.load_checkpoint(run_dir)  # a run dir resolves to its latest checkpoint
    assert cursor == {"next_batch": 2}
    assert (res.step, res.version) == (2, 2)
    for i in (2, 3):
        m = step(res, i)
        for k in ("loss/total", "loss/policy", "loss/kl", "grad_norm", "lr", "kl", "entropy"):
            assert m[k] == metrics[i][k], (i, k)
    for (k, a), (_, b) in zip(ref.model.state_dict().items(), res.model.state_dict().items()):
        assert torch.equal(a, b), k
    for (k, a), (_, b) in zip(ref.ref_model.state_dict().items(), res.ref_model.state_dict().items()):
        assert torch.equal(a, b), k
    sa, sb = ref.optimizer.state_dict()["state"], res.optimizer.state_dict()["state"]
    for i in sa:
        assert torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])


def test_retention_latest_and_hf_loadable(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tr = Trainer(tiny_cfg(**SECTIONS))
    paths = []
    for i in range(4):
        step(tr, i)
        paths.append(tr.save_checkpoint(tmp_path, {"i": i}))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path) == paths[-1]
    assert not paths[0].exists() and not paths[1].exists()
    meta = json.loads((paths[-1] / "state.json").read_text())
    assert (meta["step"], meta["version"], meta["data_cursor"]) == (4, 4, {"i": 3})
    assert (paths[-1] / "model" / "model.safetensors").is_file()

    hf = AutoModelForCausalLM.from_pretrained(paths[-1] / "model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(paths[-1] / "model")
    assert tok.eos_token == "<|im_end|>"
    ids = torch.tensor([[1, 40, 41, 42, 2]])
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, tr.model(input_ids=ids).logits)


def test_rng_states_restored(tmp_path):
    import random

    import numpy as np

    tr = Trainer(tiny_cfg(**SECTIONS))
    path = tr.save_checkpoint(tmp_path, {})
    want = (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)])
    torch.manual_seed(999), np.random.seed(999), random.seed(999)
    Trainer(tiny_cfg(**SECTIONS)).load_checkpoint(path)
    assert (torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]) == want


def test_partial_write_is_ignored_and_cleaned(tmp_path):
    tr = Trainer(tiny_cfg(**SECTIONS))
    first = tr.save_checkpoint(tmp_path, {"i": 0})
    # a writer killed mid-save leaves only a temp dir (and maybe a half directory w/o state.json)
    junk = tmp_path / "checkpoints" / ".tmp-step_00000009-999999"
    junk.mkdir()
    (junk / "state.json").write_text("{}")
    half = tmp_path / "checkpoints" / "step_00000007"
    half.mkdir()
    assert latest_checkpoint(tmp_path) == first
    step(tr, 0)
    tr.save_checkpoint(tmp_path, {"i": 1})
    assert not junk.exists()
    with pytest.raises(FileNotFoundError, match="holds no checkpoints"):
        tr.load_checkpoint(tmp_path / "nothing")
    with pytest.raises(TypeError, match="JSON-serialisable"):
        tr.save_checkpoint(tmp_path, {"bad": object()})


def test_gae_critic_checkpoint_round_trip(tmp_path):
    sections = {**SECTIONS, "algo": {"advantage": "gae", "value_clip": 0.2}, "trainer": {**SECTIONS["trainer"], "ppo_epochs": 1}}
    tr = Trainer(tiny_cfg(**sections))
    step(tr, 0)
    path = tr.save_checkpoint(tmp_path, {})
    assert (path / "critic" / "model.safetensors").is_file()
    res = Trainer(tiny_cfg(**sections))
    res.load_checkpoint(path)
    for k, v in tr.critic.state_dict().items():
        assert torch.equal(v, res.critic.state_dict()[k]), k
    a, b = step(tr, 1), step(res, 1)
    assert a["loss/value"] == b["loss/value"] and a["loss/total"] == b["loss/total"]
    plain = tmp_path / "plain"
    Trainer(tiny_cfg(**SECTIONS)).save_checkpoint(plain, {})
    with pytest.raises(FileNotFoundError, match="no critic"):
        Trainer(tiny_cfg(**sections)).load_checkpoint(plain)


def test_corrupt_checkpoints_are_named_and_skipped(tmp_path):
    """Issue 12 item 12: SHA-256 per file at save; a flipped byte, a truncated file or a
    garbage state.json raises CheckpointCorrupt naming the file; from a run directory the
    newest intact checkpoint is used instead, and the skipped one is reported."""
    from molt_core.train.checkpoint import CheckpointCorrupt, latest_intact_checkpoint, verify_checkpoint

    tr = Trainer(tiny_cfg(**{**SECTIONS, "checkpoint": {"keep": 5}}))
    paths = []
    for i in range(3):
        step(tr, i)
        paths.append(tr.save_checkpoint(tmp_path, {"next_batch": i + 1}))
    p1, p2, p3 = paths
    manifest = json.loads((p3 / "checksums.json").read_text())
    assert "model/model.safetensors" in manifest and "state.json" in manifest and "trainer_state.pt" in manifest
    assert verify_checkpoint(p3)["step"] == 3
    # one flipped byte in the newest weights
    w = p3 / "model" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 0x01
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=r"step_00000003/model/model\.safetensors: SHA-256 differs"):
        verify_checkpoint(p3)
    # a truncated trainer state in the one before
    st = p2 / "trainer_state.pt"
    st.write_bytes(st.read_bytes()[:100])
    fresh = Trainer(tiny_cfg(**SECTIONS))
    with pytest.raises(CheckpointCorrupt, match=r"step_00000002/trainer_state\.pt: SHA-256 differs"):
        fresh.load_checkpoint(p2)
    ck, skipped = latest_intact_checkpoint(tmp_path)
    assert ck == p1 and len(skipped) == 2
    assert "model.safetensors" in skipped[0] and "trainer_state.pt" in skipped[1]
    assert fresh.load_checkpoint(tmp_path) == {"next_batch": 1} and fresh.step == 1
    # garbage state.json, checked even when the manifest is gone (a pre-checksum checkpoint)
    (p1 / "checksums.json").unlink()
    (p1 / "state.json").write_text("{not json")
    with pytest.raises(CheckpointCorrupt, match=r"step_00000001/state\.json: unreadable"):
        fresh.load_checkpoint(p1)
    with pytest.raises(CheckpointCorrupt, match="no intact checkpoint"):
        fresh.load_checkpoint(tmp_path)
