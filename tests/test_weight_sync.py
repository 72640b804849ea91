"""The collective weight sync (issue 14; :mod:`molt_plugins.engines.vllm.weight_sync`) without vLLM:
a sender and two receivers in threads of this process, joined by a gloo group over a TCP store
(what runs between the trainer's rank 0 and the vLLM workers on CPU; NCCL on GPU is covered by
``benchmarks/gpu_check.py``).

* exact round trip of a hand-built state (fp32 + a bf16 tensor + a tied alias), bytes counted
  by hand, a dtype cast on the way (fp32 master weights -> a bf16 engine);
* faults, each refused by every receiver, which then still takes the next good sync (the group
  stays in step): a wrong version, a skipped tensor, an extra name, a wrong shape, and bytes
  changed in transit (the checksum);
* the backend choice: gloo on CPU; NCCL only for distinct GPUs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from molt_plugins.engines.vllm import weight_sync as ws
from molt_plugins.engines.vllm.weight_sync import SyncGroup, check_full_state, free_address, receive_weights, send_weights

torch.set_num_threads(1)


def _state():
    a = torch.arange(6, dtype=torch.float32).view(2, 3)
    return {"model.embed_tokens.weight": a, "model.norm.weight": torch.tensor([1.5, -2.0, 0.25]),
            "model.bias": torch.tensor([3.0], dtype=torch.bfloat16), "lm_head.weight": a}


EXPECTED = {"model.embed_tokens.weight": (2, 3), "model.norm.weight": (3,), "model.bias": (1,)}


def _run(syncs, n_recv=2, expected=EXPECTED):
    """Sender + ``n_recv`` receivers in threads; ``syncs``: ``[(state, sent_version, asked_version)]``.
    Returns ``(headers, per receiver: [dict name -> tensor | the exception])``."""
    host, port = free_address()
    world = 1 + n_recv
    results: list[list] = [[] for _ in range(n_recv)]
    headers, errors = [], []

    def receiver(i):
        try:
            g = SyncGroup(host, port, 1 + i, world, "cpu", timeout_s=60)
            for _state, _sent, asked in syncs:
                try:
                    _h, named = receive_weights(g, asked, expected, tied=True)
                    results[i].append({n: t.clone() for n, t in named})
                except (ValueError, KeyError) as e:
                    results[i].append(e)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(i,)) for i in range(n_recv)]
    for t in threads:
        t.start()
    g = SyncGroup(host, port, 0, world, "cpu", timeout_s=60)
    assert g.backend == "gloo"
    for state, sent, _asked in syncs:
        headers.append(send_weights(g, state, sent, dtype=None))
    for t in threads:
        t.join(60)
    assert not errors, errors
    return headers, results


def test_round_trip_exact_bytes_by_hand_and_dtype_cast():
    st = _state()
    headers, results = _run([(st, 3, 3)])
    h = headers[0]
    # float32: embed 6 + norm 3 = 9 x 4 B = 36 B, padded to 40; bfloat16: 1 x 2 B padded to 8; the tied alias once
    assert h.version == 3 and h.sizes == {"float32": 40, "bfloat16": 8} and h.nbytes == 48
    for got in results:
        assert list(got[0]) == ["model.embed_tokens.weight", "model.norm.weight", "model.bias"]  # lm_head: tied, skipped
        for n, t in got[0].items():
            assert t.dtype == st[n].dtype and torch.equal(t, st[n]), n
    # fp32 master weights sent to a bf16 engine: half the float bytes, values rounded to bf16
    host, port = free_address()
    out = {}

    def recv():
        g = SyncGroup(host, port, 1, 2, "cpu", timeout_s=60)
        out["h"], named = receive_weights(g, 0, EXPECTED, tied=True)
        out["named"] = {n: t.clone() for n, t in named}

    th = threading.Thread(target=recv)
    th.start()
    emb = torch.full((2, 3), 1.0 + 2 ** -10)
    sent = {**_state(), "model.embed_tokens.weight": emb, "lm_head.weight": emb}
    send_weights(SyncGroup(host, port, 0, 2, "cpu", timeout_s=60), sent, 0, dtype=torch.bfloat16)
    th.join(60)
    assert out["h"].sizes == {"bfloat16": 24}  # (6 + 3 + 1) x 2 B = 20, padded to 24
    assert out["named"]["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert out["named"]["model.embed_tokens.weight"].flatten().tolist() == [1.0] * 6  # 1 + 2^-10 rounds to 1 in bf16


def test_faults_refused_and_group_stays_in_step():
    good = _state()
    skipped = {k: v for k, v in good.items() if k != "model.norm.weight"}
    extra = {**good, "model.layers.9.w": torch.zeros(1)}
    reshaped = {**good, "model.norm.weight": torch.zeros(4)}
    headers, results = _run([(good, 1, 2), (skipped, 2, 2), (extra, 2, 2), (reshaped, 2, 2), (good, 2, 2)])
    for got in results:
        assert isinstance(got[0], ValueError) and "sent policy version 1" in str(got[0]) and "version 2" in str(got[0])
        assert isinstance(got[1], ValueError) and "1 tensors missing" in str(got[1]) and "model.norm.weight" in str(got[1])
        assert isinstance(got[2], KeyError) and "model.layers.9.w" in str(got[2])
        assert isinstance(got[3], ValueError) and "model.norm.weight has shape (4,)" in str(got[3])
        assert isinstance(got[4], dict) and torch.equal(got[4]["model.norm.weight"], good["model.norm.weight"])


def test_bytes_changed_in_transit_caught_by_checksum(monkeypatch):
    real = SyncGroup.broadcast

    def corrupt(self, t):
        real(self, t)
        if self.rank != 0 and t.dtype == torch.uint8 and t.numel() == 40:  # the float32 buffer, one byte flipped
            t[5] ^= 1
        return t

    monkeypatch.setattr(SyncGroup, "broadcast", corrupt)
    _h, results = _run([(_state(), 0, 0)], n_recv=1)
    err = results[0][0]
    assert isinstance(err, ValueError) and "float32 buffer (40 bytes) has checksum" in str(err)


def test_check_full_state_matches_the_engine_rule():
    assert check_full_state({"a": (1,), "lm_head.weight": (2,)}, {"a": (1,)}, tied=True) == ["a"]
    with pytest.raises(KeyError, match="lm_head.weight"):  # not tied: an unknown name
        check_full_state({"a": (1,), "lm_head.weight": (2,)}, {"a": (1,)}, tied=False)


def test_backend_choice():
    """NCCL only when every member is on its own GPU; gloo for CPU or a shared GPU."""
    assert ws._device_id(torch.device("cpu")) == "cpu"
    assert ws.choose_backend(["cpu", "cpu"], True) == "gloo"
    assert ws.choose_backend(["GPU-a", "GPU-b", "GPU-c"], True) == "nccl"
    assert ws.choose_backend(["GPU-a", "GPU-b"], False) == "gloo"
    assert ws.choose_backend(["GPU-a", "GPU-a"], True) == "gloo"  # NCCL refuses two ranks on one GPU
    assert ws.choose_backend(["GPU-a", "cpu"], True) == "gloo"
    with pytest.raises(ValueError, match="world_size 1"):
        SyncGroup("127.0.0.1", 1, 0, 1, "cpu")
    with pytest.raises(ValueError, match=r"rank 2 outside \[0, 2\)"):
        SyncGroup("127.0.0.1", 1, 2, 2, "cpu")


def test_trainer_worker_sends_its_weights_cast_to_the_engine_dtype():
    """The trainer actor's side (``TrainerWorker.sync_init`` / ``sync_send``): fp32 master
    weights reach a bf16 engine as bf16 (tied lm_head once), version stamped, ``sync/bytes`` set."""
    from molt_core.config import RunConfig
    from molt_core.runtime.workers import TrainerWorker

    cfg = RunConfig.model_validate({"engine": {"name": "vllm", "dtype": "bfloat16", "weight_sync": "collective"}})
    tw = TrainerWorker(cfg)
    tw.trainer.version = 4
    sd = tw.trainer.model.state_dict()
    assert all(t.dtype == torch.float32 for t in sd.values())
    expected = {n: tuple(t.shape) for n, t in sd.items() if n != "lm_head.weight"}
    host, port = tw.sync_address()
    got = {}

    def recv():
        g = SyncGroup(host, port, 1, 2, "cpu", timeout_s=60)
        got["h"], named = receive_weights(g, 4, expected, tied=True)
        got["named"] = dict(named)

    th = threading.Thread(target=recv)
    th.start()
    assert tw.sync_init(host, port, 2, 60) == "gloo"
    assert tw.sync_send() == 4
    th.join(60)
    n = sum(p.numel() for p in tw.trainer.model.parameters())  # distinct parameters: the tied head once
    assert got["h"].sizes == {"bfloat16": 2 * n + (-2 * n) % 8} and tw._sync_bytes == got["h"].nbytes
    for name, t in got["named"].items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, sd[name].to(torch.bfloat16)), name


def test_resolve_weight_sync():
    from molt_core.config import RunConfig
    from molt_core.runtime.collective_sync import resolve_weight_sync

    def cfg(**e):
        return RunConfig.model_validate({"engine": e})

    assert resolve_weight_sync(cfg(name="vllm", num_gpus=1), local=False) == "collective"
    assert resolve_weight_sync(cfg(name="vllm", num_gpus=1), local=True) == "ray"
    assert resolve_weight_sync(cfg(name="vllm"), local=False) == "ray"  # vLLM on CPU: auto keeps Ray
    assert resolve_weight_sync(cfg(num_gpus=1), local=False) == "ray"  # the transformers engine
    assert resolve_weight_sync(cfg(name="vllm", weight_sync="collective"), local=False) == "collective"
    assert resolve_weight_sync(cfg(name="vllm", num_gpus=1, weight_sync="ray"), local=False) == "ray"
    with pytest.raises(ValueError, match="needs Ray"):
        resolve_weight_sync(cfg(name="vllm", weight_sync="collective"), local=True)
    with pytest.raises(ValueError, match='set engine.name = "vllm"'):
        cfg(weight_sync="collective")


def test_engine_device_follows_num_gpus(monkeypatch):
    """``engine.num_gpus`` alone decides the engine's device (mocked CUDA, no GPU needed)."""
    from molt_core.config import RunConfig
    from molt_core.runtime.workers import engine_kwargs

    assert "device" not in engine_kwargs(RunConfig.model_validate({}))  # CPU: factories see no new argument
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kw = engine_kwargs(RunConfig.model_validate({"engine": {"num_gpus": 0.5, "dtype": "bfloat16"}}), index=2)
    assert kw["device"] == "cuda" and kw["dtype"] == "bfloat16" and kw["seed"] == 2
    kw = engine_kwargs(RunConfig.model_validate({"engine": {"num_gpus": 1, "options": {"device": "cuda:1"}}}))
    assert kw["device"] == "cuda:1"  # an explicit option wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_kwargs(RunConfig.model_validate({"engine": {"num_gpus": 1}}))["device"] == "cpu"


def test_vision_language_names_mapped_to_the_checkpoint_spelling():
    """Review 14: a vision-language trainer's state dict nests the language model
    (``model.language_model.*``, ``model.visual.*``) while the checkpoint vLLM loaded spells them
    ``model.*`` / ``visual.*``. The Ray path (VLLMEngine.load_weights) maps them; the collective
    path refused every tensor with a KeyError (with ``weight_sync = "auto"``, the default of the vLLM
    engine on a GPU, the first publish of a VL run failed). Now both map the same way."""
    st = {"model.language_model.embed_tokens.weight": torch.arange(6, dtype=torch.float32).view(2, 3),
          "model.language_model.norm.weight": torch.tensor([1.5, -2.0, 0.25]),
          "model.visual.patch.weight": torch.tensor([3.0, 4.0])}
    expected = {"model.embed_tokens.weight": (2, 3), "model.norm.weight": (3,), "visual.patch.weight": (2,)}
    assert ws.checkpoint_name("model.language_model.norm.weight", expected) == "model.norm.weight"
    assert ws.checkpoint_name("model.norm.weight", expected) == "model.norm.weight"
    _h, results = _run([(st, 1, 1)], n_recv=1, expected=expected)
    got = results[0][0]
    assert list(got) == ["model.embed_tokens.weight", "model.norm.weight", "visual.patch.weight"]
    assert torch.equal(got["model.norm.weight"], st["model.language_model.norm.weight"])
    assert torch.equal(got["visual.patch.weight"], st["model.visual.patch.weight"])


_RANK = """
import json, sys
import torch
torch.set_num_threads(1)
from molt_core.runtime.trainer_group import ShardedTrainerWorker
rank, init, host, port = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
w = ShardedTrainerWorker(json.loads(sys.argv[5]))
w.start(rank, 2, init)
backend = w.sync_init(host, port, 2, 120)  # rank 0 joins the sync group as its sender; rank 1 does not
version = w.sync_send()                    # both ranks gather the shards; rank 0 broadcasts
print(json.dumps({"backend": backend, "version": version, "bytes": getattr(w, "_sync_bytes", None)}))
"""


def test_two_sharded_ranks_broadcast_the_gathered_weights(tmp_path):
    """The collective sync from a sharded trainer (recipes/examples/gpu_qwen3.toml: 2 FSDP2 ranks,
    ``weight_sync = "collective"``) without vLLM: two :class:`ShardedTrainerWorker` processes (gloo),
    and a receiver here in the place of the vLLM worker. Both ranks join the gather of the full
    weights; rank 0 alone joins the sync group and sends them, cast to the engine's bf16: every
    tensor arrives equal to one plain trainer's (same seed), the tied head once, the bytes counted."""
    import json
    import os
    import subprocess
    import sys

    from molt_core.config import RunConfig
    from molt_core.train import Trainer

    cfg = {"engine": {"name": "vllm", "dtype": "bfloat16", "weight_sync": "collective"},
           "trainer": {"world_size": 2}, "async": {"max_staleness": 0}}
    sd = Trainer(RunConfig.model_validate(cfg)).model.state_dict()  # the weights both ranks build (run.seed)
    expected = {n: tuple(t.shape) for n, t in sd.items() if n != "lm_head.weight"}
    host, port = free_address()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), f"file://{tmp_path / 'rdzv'}", host, str(port),
                               json.dumps(cfg)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    got = {}
    try:
        g = SyncGroup(host, port, 1, 2, "cpu", timeout_s=120)
        got["h"], named = receive_weights(g, 0, expected, tied=True)
        got["named"] = {n: t.clone() for n, t in named}
    finally:
        outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    r0, r1 = (json.loads(o[0].strip().splitlines()[-1]) for o in outs)
    n = sum(t.numel() for name, t in sd.items() if name != "lm_head.weight")
    assert r0 == {"backend": "gloo", "version": 0, "bytes": got["h"].nbytes} and got["h"].nbytes == 2 * n + (-2 * n) % 8
    assert r1 == {"backend": "", "version": 0, "bytes": None}  # rank 1 gathered but sent nothing
    assert set(got["named"]) == set(expected)
    for name, t in got["named"].items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, sd[name].to(torch.bfloat16)), name


def test_weight_sync_without_its_transport_plugin_is_refused_by_name(tmp_path):
    """Issue 26: the ``collective`` transport enters through ``molt_register_weight_sync_transports``
    (first-party plugin ``molt_engines``). Without it, ``engine.weight_sync = "collective"`` (or
    ``auto`` resolving to it) is refused naming the option and the fix -- in the driver before any
    compute (``molt run``: exit 2, no run directory), and in a trainer actor; ``ray`` needs none."""
    from click.testing import CliRunner

    from molt_core.cli import main
    from molt_core.config import ConfigError, RunConfig
    from molt_core.plugins import load_plugins
    from molt_core.runtime.collective_sync import resolve_weight_sync, worker_transport

    def cfg(**e):
        return RunConfig.model_validate({"engine": e})

    full, bare = load_plugins(), load_plugins(entry_points=False)
    assert full.names("weight_sync_transports") == ["collective"]
    assert resolve_weight_sync(cfg(name="vllm", weight_sync="collective"), False, full) == "collective"
    with pytest.raises(ConfigError, match=r'engine.weight_sync = "collective": no loaded plugin registers the weight-sync '
                                          r'transport "collective" \(registered: \(none\)\).*molt_plugins.engines.*'
                                          r'engine.weight_sync = "ray"'):
        resolve_weight_sync(cfg(name="vllm", weight_sync="collective"), False, bare)
    with pytest.raises(ConfigError, match=r'engine.weight_sync = "auto" resolves to "collective" here'):
        resolve_weight_sync(cfg(name="vllm", num_gpus=1), False, bare)
    assert resolve_weight_sync(cfg(name="vllm", num_gpus=1), True, bare) == "ray"  # --local: the Ray path, no plugin
    assert resolve_weight_sync(cfg(name="vllm", num_gpus=1, weight_sync="ray"), False, bare) == "ray"

    class Worker:  # what worker_transport reads of a trainer or rollout actor
        cfg = RunConfig.model_validate({"engine": {"name": "vllm", "weight_sync": "collective"}})

    w = Worker()
    assert worker_transport(w, full) is worker_transport(w, bare)  # built once, kept on the worker
    assert hasattr(w._weight_sync_transport, "send")
    with pytest.raises(ConfigError, match="engine.weight_sync"):
        worker_transport(Worker(), bare)
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["run", "quickstart", "--out", str(out), "--set", "engine.name=vllm",
                                  "--set", "engine.weight_sync=collective"], env={"MOLT_DISABLE_PLUGINS": "molt_engines"})
    assert r.exit_code == 2, r.output
    assert 'engine.weight_sync = "collective"' in r.output and 'engine.weight_sync = "ray"' in " ".join(r.output.split())
    assert not out.exists()
