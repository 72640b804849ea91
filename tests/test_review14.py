"""Review of issue 14 (sharded trainer, LoRA, weight sync, bf16): regressions for what the
adversarial review found."""

from __future__ import annotations

import pytest
import torch

from molt_core.train import Trainer
from test_distributed import ATOL, RTOL, W_ATOL, _assert_parity, _config, _rollouts, _run_ranks


@pytest.mark.slow  # one 2-rank launch (~60 s on 2 busy cores)
def test_two_ranks_match_one_rank_with_gradient_checkpointing(tmp_path):
    """The shipped GPU recipe (recipes/examples/gpu_qwen3.toml) runs FSDP2 with
    ``trainer.gradient_checkpointing = true``; no test ran that combination (the GPU check sets
    it false). 2 checkpointed ranks == 1 plain rank: the recompute in the backward all-gathers
    the block again and gives the same gradients."""
    cfg = _config(trainer={"gradient_checkpointing": True})
    single = Trainer(_config())
    steps = _rollouts(single)
    one = [single.train_step(s) for s in steps]
    two = _run_ranks(tmp_path, cfg, steps, 2)
    assert one[0]["grad_norm"] > cfg.trainer.grad_clip
    _assert_parity(one, two["metrics"])
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(two["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow  # one 2-rank launch (~60 s on 2 busy cores)
def test_two_ranks_match_one_rank_when_a_rank_has_no_row(tmp_path):
    """A step with fewer rows than ranks (one single-segment rollout on 2 ranks: rank 0 owns no
    row and runs stand-ins only) after a normal step: same loss, KL, grad norm and weights as
    one rank. The KL term (reference = the initial policy) makes the one row's gradient non-zero."""
    from trainer_utils import set_behaviour, synthetic_rollouts

    cfg = _config()
    single = Trainer(cfg)
    steps = _rollouts(single)[:1]
    lone = synthetic_rollouts(21, n_groups=1, n_per_group=1)
    set_behaviour(single, lone, version=0)
    steps.append(lone)
    one = [single.train_step(s) for s in steps]
    two = _run_ranks(tmp_path, cfg, steps, 2)
    assert one[1]["train/step"] == 2.0 and one[1]["loss/kl"] != 0.0 and one[1]["grad_norm"] > 0
    _assert_parity(one, two["metrics"])
    for k, v in single.model.state_dict().items():
        torch.testing.assert_close(two["weights"][k], v, rtol=RTOL, atol=W_ATOL, msg=lambda m, k=k: f"{k}: {m}")


def _one_publish_behind(tmp_path, dtype: str, lr: float) -> tuple[float, float]:
    """Train one step at ``lr`` on the engine's samples, then let the engine miss the publish
    (old weights) while its tokens carry the new version: ``(clean max, stale max)`` of
    ``invariants/logprob_absdiff_max_onpolicy``."""
    import asyncio

    from test_weightpack import make_workers

    tmp_path.mkdir(parents=True, exist_ok=True)
    tw, rw = make_workers(tmp_path, model={"dtype": dtype}, engine={"dtype": dtype}, trainer={"lr": lr})

    def rollout(stamp=None):
        loop = asyncio.new_event_loop()
        try:
            groups = loop.run_until_complete(rw.rollout([{"i": 3}, {"i": 5}], 4))
        finally:
            loop.close()
        trajs = [t for g in groups for t in g.trajectories if t.status == "ok"]
        for t in trajs if stamp is not None else []:
            for s in t.segments:
                s.versions = [stamp if v is not None else None for v in s.versions]
        return trajs

    try:
        state, v = tw.weights()
        asyncio.run(rw.load_weights(state, v))
        clean = tw.train_step(rollout())["invariants/logprob_absdiff_max_onpolicy"]
        stale = tw.train_step(rollout(stamp=tw.trainer.version))["invariants/logprob_absdiff_max_onpolicy"]
    finally:
        rw.engine.close()
    return clean, stale


@pytest.mark.slow  # two engine + trainer pairs (~25 s)
def test_bf16_bound_misses_one_stale_publish_at_the_gpu_recipe_lr(tmp_path):
    """What docs/gpu.md now says: at lr 1e-6 (recipes/examples/gpu_qwen3.toml) an engine that
    missed one publish reads under the bf16 bound (0.1) -- blind -- while float32 flags the same
    fault against its 1e-4 bound. (The docs claimed 2.5 for "one publish behind"; that figure came
    from noise of 0.05 on every weight, not from a publish.)"""
    from molt_core.train.version_history import ONPOLICY_ABSDIFF_TOL

    clean32, stale32 = _one_publish_behind(tmp_path / "f32", "float32", 1e-6)
    assert clean32 <= ONPOLICY_ABSDIFF_TOL["float32"] < stale32
    clean16, stale16 = _one_publish_behind(tmp_path / "bf16", "bfloat16", 1e-6)
    assert clean16 <= ONPOLICY_ABSDIFF_TOL["bfloat16"] and stale16 <= ONPOLICY_ABSDIFF_TOL["bfloat16"]


def test_sharded_load_model_refuses_missing_and_unknown_weights(tmp_path):
    """A plain checkpoint's model/ resumed on a sharded trainer (molt_plugins.distributed.checkpoint.load_model)
    loaded with ``strict=False`` and no check: a missing tensor kept the rank's current weights, an
    unknown one was dropped, silently (the plain path raises for both). Now the same checks, before
    anything is loaded; a good directory (tied lm_head saved once) still loads exactly. One process,
    a gloo group of one."""
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from molt_core.models import load_model as build
    from molt_plugins.distributed.sharded import init_distributed, shard_module
    from molt_core.train.model_files import save_model
    from molt_plugins.distributed.checkpoint import load_model

    src = build("builtin:tiny-qwen3", seed=7)
    save_model(src, tmp_path / "good")
    saved = load_file(str(tmp_path / "good" / "model.safetensors"))
    assert "lm_head.weight" not in saved  # tied: saved once
    skip = "model.layers.0.mlp.down_proj.weight"
    (tmp_path / "missing").mkdir()
    save_file({k: v for k, v in saved.items() if k != skip}, str(tmp_path / "missing" / "model.safetensors"))
    (tmp_path / "unknown").mkdir()
    save_file({**saved, "model.layers.9.mlp.extra.weight": torch.zeros(2)}, str(tmp_path / "unknown" / "model.safetensors"))
    init_distributed(0, 1, f"file://{tmp_path / 'rdzv'}", backend="gloo")
    try:
        m = shard_module(build("builtin:tiny-qwen3", seed=0))
        full = lambda: get_model_state_dict(m, options=StateDictOptions(full_state_dict=True))  # noqa: E731
        before = {k: v.clone() for k, v in full().items()}
        with pytest.raises(ValueError, match=r"lacks weights for \['model\.layers\.0\.mlp\.down_proj\.weight'\]"):
            load_model(m, tmp_path / "missing")
        with pytest.raises(ValueError, match=r"unknown parameters \['model\.layers\.9\.mlp\.extra\.weight'\]"):
            load_model(m, tmp_path / "unknown")
        assert all(torch.equal(v, before[k]) for k, v in full().items())  # refused before loading anything
        load_model(m, tmp_path / "good")
        got = full()
        for k, v in src.state_dict().items():
            assert torch.equal(got[k], v), k
    finally:
        dist.destroy_process_group()


def test_sharded_stale_shadow_is_the_only_unsharded_copy(tmp_path):
    """With ``async.max_staleness`` > 0 a sharded rank kept two full unsharded copies of the
    policy on its device beside its shards -- the template (a deepcopy made before sharding) and
    the shadow deep-copied from it -- which the 1/N memory figure (bench_fsdp_memory.py: params
    + optimizer only) does not see. Now the template waits on CPU and becomes the shadow (moved to
    the trainer's device) on first use: one copy. One process, a gloo group of one."""
    import torch.distributed as dist

    from molt_plugins.distributed.sharded import ShardedTrainer, init_distributed

    init_distributed(0, 1, f"file://{tmp_path / 'rdzv'}", backend="gloo")
    try:
        tr = ShardedTrainer(_config())
        template = tr.history.template
        assert template is not None and {p.device.type for p in template.parameters()} == {"cpu"}
        steps = _rollouts(Trainer(_config()))
        m = [tr.train_step(s) for s in steps]
        assert m[1]["invariants/onpolicy_stale_tokens"] > 0  # the shadow ran version 0
        assert m[1]["invariants/logprob_absdiff_max_onpolicy"] < 1e-4
        assert tr.history.shadow is template and tr.history.template is None  # no second copy
        assert {p.device for p in tr.history.shadow.parameters()} == {tr.device}
    finally:
        dist.destroy_process_group()


def test_sharded_weights_keep_the_tied_head_one_tensor(tmp_path):
    """Audit of issue 14: the gathered full state of a sharded trainer held ``lm_head.weight`` as a
    copy of ``model.embed_tokens.weight`` (tied), so every publish packed it twice: the quickstart
    at world size 2 moved 3,675,648 bytes per sync against 3,413,504 at world size 1 (262,144 =
    512 x 128 x 4 B more). Now both names are one tensor and the pack is the plain trainer's,
    byte for byte. One process, a gloo group of one."""
    import torch.distributed as dist

    from molt_core.runtime.weightpack import pack_tensors
    from molt_plugins.distributed.sharded import ShardedTrainer, init_distributed

    plain = Trainer(_config())
    init_distributed(0, 1, f"file://{tmp_path / 'rdzv'}", backend="gloo")
    try:
        full = ShardedTrainer(_config()).weights()
    finally:
        dist.destroy_process_group()
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    got, want = pack_tensors(full)[0], pack_tensors(plain.weights())[0]
    assert {k: v.numel() for k, v in got.items()} == {"float32": 4 * 853_376}  # distinct parameters of tiny-qwen3
    assert {k: v.numel() for k, v in want.items()} == {"float32": 4 * 853_376}
    assert all(torch.equal(got[k], want[k]) for k in want)
