"""MoE routing record (engine) and replay (trainer backends): issue 7 items 1-2, case B11."""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from molt_plugins.moe.routing import RoutingRecorder, find_routers, flip_mask, get_replay_backend, routing_shape
from molt_core.types import SamplingParams
from molt_plugins.replay.topk import MixtralReplay, OlmoeReplay, Qwen3MoeReplay

torch.set_num_threads(1)

B11_LOGITS = [2.0, 1.0, 0.5, 0.0]


# ------------------------------------------------------------------ B11 on a bare router
def _router(kind: str, norm: bool = True) -> torch.nn.Module:
    """A router over 4 experts, top-2, hidden size 4, weight = identity (logits = input)."""
    if kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

        r = MixtralTopKRouter(MixtralConfig(hidden_size=4, num_local_experts=4, num_experts_per_tok=2))
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        r = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm))
    with torch.no_grad():
        r.weight.copy_(torch.eye(4))
    holder = torch.nn.Module()
    holder.gate = r
    return holder


def _b11(kind: str, norm: bool, recorded: list[int]):
    holder = _router(kind, norm)
    backend = {"mixtral": MixtralReplay(), "qwen3": Qwen3MoeReplay()}[kind]
    x = torch.tensor([B11_LOGITS], requires_grad=True)  # logits == x (identity router weight)
    with backend.replay(holder, torch.tensor(recorded).view(1, 1, 1, 2)):
        logits, w, idx = holder.gate(x)
    assert torch.equal(logits.detach(), torch.tensor([B11_LOGITS]))
    return x, w, idx


@pytest.mark.parametrize("kind,norm,expected", [
    ("qwen3", False, [0.579259, 0.129250]),  # softmax over all experts, gathered at {0, 2}
    ("qwen3", True, [0.817574, 0.182426]),  # ... renormalised over the top-k (norm_topk_prob)
    ("mixtral", True, [0.817574, 0.182426]),  # Mixtral always renormalises
])
def test_b11_replayed_weights(kind, norm, expected):
    holder = _router(kind, norm)
    _, w_nat, idx_nat = holder.gate(torch.tensor([B11_LOGITS]))
    assert sorted(idx_nat[0].tolist()) == [0, 1]  # the trainer's natural top-2
    x, w, idx = _b11(kind, norm, [0, 2])
    assert idx[0].tolist() == [0, 2]
    assert w[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert bool((w > 0).all())  # never a zero weight
    # gradient: loss = w0 - 0.5 w2
    (w[0, 0] - 0.5 * w[0, 1]).backward()
    g = x.grad[0]
    assert g[0] != 0 and g[2] != 0
    if norm:
        # w = softmax([l0, l2]): dL/dl0 = 1.5 w0 w2 = 1.5 * 0.817574 * 0.182426 = 0.223719, dL/dl2 = -dL/dl0;
        # logits 1 and 3 are outside the renormalised pair: exactly 0
        assert g.tolist() == pytest.approx([0.223719, 0.0, -0.223719, 0.0], abs=1e-6)
    else:
        # w_i = p_i (full softmax p): dL/dl_j = p0(d0j - pj) - 0.5 p2(d2j - pj)
        # with p = [0.579259, 0.213097, 0.129250, 0.078394]: every logit moves (the softmax
        # denominator), the replayed pair most
        assert g.tolist() == pytest.approx([0.281153, -0.109667, -0.131141, -0.040344], abs=1e-6)


@pytest.mark.parametrize("kind", ["qwen3", "mixtral"])
def test_unrecorded_row_keeps_natural_routing(kind):
    holder = _router(kind, True)
    x = torch.tensor([B11_LOGITS, [0.0, 0.3, 0.2, 3.0], B11_LOGITS])
    nat_logits, nat_w, nat_idx = holder.gate(x)
    backend = MixtralReplay() if kind == "mixtral" else Qwen3MoeReplay()
    rec = torch.tensor([[-1, -1], [1, 2], [0, -1]]).view(1, 3, 1, 2)  # padding, recorded, incomplete
    with backend.replay(holder, rec):
        _, w, idx = holder.gate(x)
    assert torch.equal(idx[0], nat_idx[0]) and torch.equal(w[0], nat_w[0])  # never expert 0 by default
    assert torch.equal(idx[2], nat_idx[2]) and torch.equal(w[2], nat_w[2])
    assert idx[1].tolist() == [1, 2] and bool((w[1] > 0).all())
    # outside the block the router is natural again
    _, _, idx2 = holder.gate(x)
    assert torch.equal(idx2, nat_idx)


def test_replay_input_errors():
    holder = _router("qwen3")
    be = Qwen3MoeReplay()
    with pytest.raises(ValueError, match=r"expected \[B, T, 1, 2\]"):
        with be.replay(holder, torch.zeros(1, 1, 2, 2, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="expert id 4, but the model has 4 experts"):
        with be.replay(holder, torch.tensor([0, 4]).view(1, 1, 1, 2)):
            pass
    with pytest.raises(ValueError, match="repeats an expert id"):
        with be.replay(holder, torch.tensor([3, 3]).view(1, 1, 1, 2)):
            pass
    with pytest.raises(ValueError, match="got 2 tokens but routed_experts covers 1"):
        with be.replay(holder, torch.tensor([0, 1]).view(1, 1, 1, 2)):
            holder.gate(torch.zeros(2, 4))
    with pytest.raises(TypeError, match="replays MixtralTopKRouter"):
        with MixtralReplay().replay(holder, torch.tensor([0, 1]).view(1, 1, 1, 2)):
            pass
    assert "forward" not in holder.gate.__dict__  # patch removed after an error inside the block


def test_flip_mask():
    sel = torch.tensor([[[0, 1]], [[1, 0]], [[2, 3]], [[0, 1]]])
    rec = torch.tensor([[[1, 0]], [[1, 0]], [[2, 1]], [[-1, -1]]])
    flipped, valid = flip_mask(sel, rec)
    assert flipped[:, 0].tolist() == [False, False, True, False]  # order within top-k ignored
    assert valid[:, 0].tolist() == [True, True, True, False]


# ------------------------------------------------------------------ whole models
def _tiny(model_type: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig

    from molt_core.models import load_model

    if model_type == "qwen3_moe":
        return load_model("builtin:tiny-qwen3-moe")
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2, max_position_embeddings=64)
    cfg = MixtralConfig(**common, num_local_experts=4) if model_type == "mixtral" else OlmoeConfig(**common, num_experts=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe"])
def test_model_replay(model_type):
    model = _tiny(model_type)
    backend = get_replay_backend(model)  # selected by config.model_type through the plugin
    assert type(backend) is {"qwen3_moe": Qwen3MoeReplay, "mixtral": MixtralReplay, "olmoe": OlmoeReplay}[model_type]
    L, K = routing_shape(model)
    assert (L, K) == ((4, 2) if model_type == "qwen3_moe" else (2, 2))
    ids = torch.randint(0, 60, (2, 6), generator=torch.Generator().manual_seed(1))
    with RoutingRecorder(model) as rec, torch.no_grad():
        ref = model(input_ids=ids).logits
        nat = rec.take().view(2, 6, L, K)
        # replaying the natural selection is the natural forward, bit for bit
        with backend.replay(model, nat):
            same = model(input_ids=ids).logits
            assert torch.equal(rec.take().view(2, 6, L, K), nat)
    assert torch.equal(same, ref)
    # an arbitrary selection (the opposite pair of experts), padding rows -1
    other = torch.stack([torch.tensor([e for e in range(4) if e not in row]) for row in nat.view(-1, K).tolist()])
    forced = other.view(2, 6, L, K).clone()
    forced[1, :2] = -1
    model.zero_grad()
    with RoutingRecorder(model) as rec, backend.replay(model, forced):
        out = model(input_ids=ids).logits
        used = rec.take().view(2, 6, L, K)
    flipped, valid = flip_mask(used, forced)
    assert not bool(flipped.any()) and int(valid.sum()) == (12 - 2) * L
    assert torch.equal(used[1, :2], nat[1, :2])  # -1 rows keep the natural routing
    assert not torch.allclose(out, ref)
    out.float().pow(2).mean().backward()
    for r in find_routers(model):
        assert r.weight.grad is not None and bool((r.weight.grad != 0).any())  # the router keeps learning


# ------------------------------------------------------------------ engine recording
@pytest.fixture(scope="module")
def moe_engine():
    from molt_core.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=4, seed=0)
    yield eng
    eng.close()


def _natural(model, seq):
    with RoutingRecorder(model) as rec, torch.no_grad():
        model(input_ids=torch.tensor([seq]))
        return rec.take()


def test_engine_records_routing_by_position(moe_engine):
    """Concurrent requests of different prompt lengths (left padding), finishing at different
    steps (row trimming), more requests than batch rows (joining mid-decode): every row's
    routing equals that of an unbatched forward over its own tokens, by absolute position."""
    prompts = [[1] + list(range(10, 10 + k)) for k in (3, 11, 5, 17, 2, 8)]

    async def go():
        return await asyncio.gather(*[moe_engine.generate(p, SamplingParams(max_tokens=4 + 3 * i, seed=i))
                                      for i, p in enumerate(prompts)])

    outs = asyncio.run(go())
    for p, o in zip(prompts, outs):
        seq = p + o.token_ids
        r = torch.tensor(o.routed_experts)
        assert r.shape == (len(seq), 4, 2)
        assert bool((r[-1] == -1).all())  # the last sampled token never ran through the model
        assert bool((r[:-1] >= 0).all())
        assert torch.equal(r[:-1].sort(-1).values, _natural(moe_engine.model, seq[:-1]).sort(-1).values)


def test_engine_two_turns_fill_last_token(moe_engine):
    """Across turns the ledger keeps earlier rows and the next prefill supplies the previous
    turn's last token (its -1 row)."""
    from molt_core.ledger import Ledger

    led = Ledger(moe_engine.tokenizer)
    msgs = [{"role": "user", "content": "hi"}]
    p1 = led.prepare(msgs)
    o1 = asyncio.run(moe_engine.generate(p1.prompt_ids, SamplingParams(max_tokens=3, seed=3)))
    led.commit(p1, o1)
    n1 = len(led.segments()[0].token_ids)
    assert led.segments()[0].routed_experts[n1 - 1] == [[-1, -1]] * 4
    msgs2 = led.history + [{"role": "user", "content": "more"}]
    p2 = led.prepare(msgs2)
    o2 = asyncio.run(moe_engine.generate(p2.prompt_ids, SamplingParams(max_tokens=3, seed=4)))
    led.commit(p2, o2)
    (seg,) = led.segments()
    r = torch.tensor(seg.routed_experts)
    assert r.shape[0] == len(seg.token_ids)
    assert bool((r[:-1] >= 0).all()) and bool((r[-1] == -1).all())
    assert r[:n1 - 1].tolist() == o1.routed_experts[:n1 - 1]  # turn 1's own rows kept
    assert r[n1 - 1].tolist() == o2.routed_experts[n1 - 1]  # filled by turn 2's prefill


def test_dense_engine_returns_no_routing():
    from molt_core.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine("builtin:tiny-qwen3", max_batch_size=2, seed=0)
    try:
        o = asyncio.run(eng.generate([1, 20, 30], SamplingParams(max_tokens=2, seed=0)))
        assert o.routed_experts is None
    finally:
        eng.close()


# ------------------------------------------------------------------ trainer integration (item 3)
def _rollouts(engine, n: int = 16, max_tokens: int = 16):
    from molt_core.ledger import Ledger

    async def one(i):
        led = Ledger(engine.tokenizer, group_id=f"g{i // 4}")
        p = led.prepare([{"role": "user", "content": f"What is {i} + {7 * i}?"}])
        o = await engine.generate(p.prompt_ids, SamplingParams(max_tokens=max_tokens, seed=i))
        led.commit(p, o)
        return led.trajectory(reward=float(i % 2))

    async def go():
        return await asyncio.gather(*[one(i) for i in range(n)])

    return asyncio.run(go())


def _trainer(replay: bool, **kw):
    from molt_core.config import RunConfig
    from molt_core.train import Trainer

    cfg = RunConfig.model_validate({"model": {"path": "builtin:tiny-qwen3-moe", "routing_replay": replay}, **kw})
    return Trainer(cfg)


@pytest.fixture(scope="module")
def bf16_rollouts():
    """16 rollouts of the tiny Qwen3-MoE sampled by a bfloat16 engine (the trainer is fp32)."""
    from molt_core.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=16, seed=0, dtype="bfloat16")
    try:
        return _rollouts(eng)
    finally:
        eng.close()


def test_bf16_engine_fp32_trainer_replay_removes_flips(bf16_rollouts):
    """Issue 7: without replay the fp32 trainer's routers pick other experts than the bf16
    engine's on some tokens; with replay the loss forward uses exactly the recorded experts
    (routing_replay_mismatch 0) and the rollout vs trainer logprob |delta| shrinks. Measured
    here (seeded): flip rate 0.004016 (4 of 996 (position, layer) pairs), mean |delta|
    0.001793 -> 0.001632, max 0.011912 -> 0.006845."""
    off = _trainer(False).train_step(bf16_rollouts)
    on = _trainer(True).train_step(bf16_rollouts)
    assert off["invariants/routing_replay"] == 0.0 and on["invariants/routing_replay"] == 1.0
    assert off["routing/positions"] == on["routing/positions"] > 0
    # 4 (or 3: bf16 rounding depends on the process's thread state) of 996 pairs flip
    assert off["invariants/routing_flip_rate"] > 0
    assert "invariants/routing_replay_mismatch" not in off
    assert on["invariants/routing_replay_mismatch"] == 0.0
    # the flip rate is always the trainer's natural router vs the record: replay does not hide it
    assert on["invariants/routing_flip_rate"] == off["invariants/routing_flip_rate"]
    assert on["invariants/logprob_absdiff_mean_noreplay"] == pytest.approx(off["invariants/logprob_absdiff_mean"], abs=1e-7)
    assert off["invariants/logprob_absdiff_mean_noreplay"] == off["invariants/logprob_absdiff_mean"]
    assert on["invariants/logprob_absdiff_mean"] < off["invariants/logprob_absdiff_mean"]
    assert on["invariants/logprob_absdiff_max"] < off["invariants/logprob_absdiff_max"]


def test_replay_separate_recompute_and_update(bf16_rollouts):
    """Two PPO epochs (no fused recompute): the recompute and both loss forwards replay; the
    router weights are trained (live gate logits)."""
    tr = _trainer(True, trainer={"ppo_epochs": 2})
    gate0 = tr.model.model.layers[0].mlp.gate.weight.detach().clone()
    m = tr.train_step(bf16_rollouts)
    assert m["invariants/routing_replay_mismatch"] == 0.0 and m["invariants/routing_flip_rate"] > 0
    assert not torch.equal(tr.model.model.layers[0].mlp.gate.weight, gate0)


def test_fp32_engine_trainer_agree_under_replay():
    """Identical weights and dtype: no flips either way, and |delta| stays at float rounding."""
    from molt_core.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=8, seed=0)
    try:
        trajs = _rollouts(eng, n=8, max_tokens=8)
    finally:
        eng.close()
    m = _trainer(True).train_step(trajs)
    assert m["invariants/routing_replay_mismatch"] == 0.0 and m["invariants/routing_flip_rate"] == 0.0
    assert m["invariants/logprob_absdiff_max"] <= 1e-5


class WrongExpertsReplay(Qwen3MoeReplay):
    """A faulty backend: replays every recorded row shifted by one expert (mod E)."""

    def route(self, router, hidden_states, recorded):
        valid = (recorded >= 0).all(-1, keepdim=True)
        shifted = torch.where(valid, (recorded + 1) % router.num_experts, recorded)
        return super().route(router, hidden_states, shifted)


def test_replay_to_wrong_experts_is_flagged(bf16_rollouts):
    """Fault injection (issue 10 item 3): a replay backend that routes to the wrong experts
    reads routing_replay_mismatch 1.0 (every recorded (position, layer) pair: a top-2 set
    shifted by one expert mod 4 is never the same set); the correct backend reads 0.
    The flip rate stays the natural router's against the record (> 0), equal in both runs."""
    from molt_core.config import RunConfig
    from molt_core.train import Trainer

    cfg = RunConfig.model_validate({"model": {"path": "builtin:tiny-qwen3-moe", "routing_replay": True}})
    good = Trainer(cfg, replay_backend=Qwen3MoeReplay()).train_step(bf16_rollouts)
    bad = Trainer(cfg, replay_backend=WrongExpertsReplay()).train_step(bf16_rollouts)
    assert good["invariants/routing_replay_mismatch"] == 0.0
    assert bad["invariants/routing_replay_mismatch"] == 1.0
    assert good["invariants/routing_flip_rate"] == bad["invariants/routing_flip_rate"] > 0
    assert bad["invariants/logprob_absdiff_max"] > good["invariants/logprob_absdiff_max"]


def test_flip_rate_counts_scoring_positions():
    from molt_plugins.moe.routing import flip_rate

    rec = torch.tensor([[[[0, 1]], [[2, 3]], [[-1, -1]]]])  # [1, 3, 1, 2]
    sel = torch.tensor([[[[1, 0]], [[2, 1]], [[0, 1]]]])
    pos = torch.tensor([[True, True, True]])
    assert flip_rate({0: sel}, rec, pos) == (0.5, 2)  # row 2 is unrecorded: not counted
    assert flip_rate({0: sel}, rec, torch.tensor([[True, False, True]])) == (0.0, 1)


def test_ingress_rejects_mismatched_routing(bf16_rollouts):
    from molt_core.train import IngressError, build_batch

    a, b = bf16_rollouts[0].model_copy(deep=True), bf16_rollouts[1].model_copy(deep=True)
    b.segments[0].routed_experts = [row[:3] for row in b.segments[0].routed_experts]  # 3 layers, not 4
    with pytest.raises(IngressError, match=r"segment 0: routed_experts has \[layers, top_k\] = \[3, 2\]"):
        build_batch([a, b])
    b.segments[0].routed_experts = None  # a segment without routing: all -1
    batch = build_batch([a, b])
    assert batch.routed_experts.shape == (2, batch.input_ids.shape[1], 4, 2)
    assert bool((batch.routed_experts[1] == -1).all())


def test_moe_without_backend_is_refused():
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    from molt_core.config import RunConfig
    from molt_core.train import Trainer

    cfg = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, num_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="no routing-replay backend is registered for model type 'qwen2_moe'"):
        Trainer(RunConfig(), model=model)
    tr = Trainer(RunConfig.model_validate({"model": {"routing_replay": False}}), model=model)
    assert tr.replay_backend is None


def test_a_nan_in_the_noreplay_recompute_refuses_its_rollout():
    """Issue 24 part 3, the R3 path: the natural-routing (no-replay) recompute gives NaN logits
    on rollout 0's row (a forward hook, that pass only); the replayed forwards are clean.
    Rollout 0 is refused with all its sampled tokens counted in
    ``invariants/nonfinite_logprobs``, and the step is the one on the other 3 rollouts, weight
    for weight (before: the NaN was dropped from the no-replay metrics and rollout 0 trained)."""
    from molt_core.engines.transformers_engine import TransformersEngine

    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=4, seed=0)
    try:
        trajs = _rollouts(eng, n=4, max_tokens=4)
    finally:
        eng.close()
    tr, clean = _trainer(True), _trainer(True)
    hit = {"done": False}

    def poison(module, args, out):
        if not tr._replaying and not hit["done"]:  # the first micro-batch of the no-replay pass: row 0 first
            hit["done"] = True
            out.logits[0] = torch.nan

    tr.model.register_forward_hook(poison)
    m = tr.train_step(trajs)
    want = clean.train_step(trajs[1:])
    n0 = sum(trajs[0].segments[0].loss_mask)
    assert hit["done"] and n0 == 4
    assert m["invariants/nonfinite_logprobs"] == float(n0) and m["ingress/refused_nonfinite"] == 1.0
    assert m["train/rollouts"] == 3.0 and want["invariants/nonfinite_logprobs"] == 0.0
    assert m["invariants/routing_flip_rate"] == want["invariants/routing_flip_rate"]
    assert m["loss/total"] == want["loss/total"]
    assert all(torch.equal(a, b) for a, b in zip(tr.model.parameters(), clean.model.parameters()))


# ------------------------------------------------------------------ the routing tool is a plugin
def test_moe_without_routing_plugin_is_refused_by_name(monkeypatch):
    """Issue 26: with molt-sdk's routing plugin (``molt_moe``) disabled no routing tool is
    loaded: an MoE policy with ``model.routing_replay`` on is refused naming the option and the
    fix; with it off the trainer builds without R3 and the engine records no routing. With the
    replay backends' plugin (``molt_replay``) disabled instead, the model type has no backend:
    refused by name too."""
    from molt_core.config import ConfigError, RunConfig
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.train import Trainer

    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_moe")
    with pytest.raises(ConfigError, match=r"model\.routing_replay = true for a mixture-of-experts model \('qwen3_moe'\), "
                                          r"but no loaded plugin registers an MoE routing tool .*molt_plugins\.moe.*"
                                          r"else set model\.routing_replay = false"):
        Trainer(RunConfig.model_validate({"model": {"path": "builtin:tiny-qwen3-moe"}}))
    tr = Trainer(RunConfig.model_validate({"model": {"path": "builtin:tiny-qwen3-moe", "routing_replay": False}}))
    assert tr.routing is None and tr.replay_backend is None
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_replay")  # the tool, but no replay backend for the model type
    with pytest.raises(ValueError, match="model.routing_replay is true but no routing-replay backend is registered "
                                         "for model type 'qwen3_moe'"):
        Trainer(RunConfig.model_validate({"model": {"path": "builtin:tiny-qwen3-moe"}}))
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_moe")
    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=1, seed=0)
    try:
        assert asyncio.run(eng.generate([1, 20, 30], SamplingParams(max_tokens=2, seed=0))).routed_experts is None
    finally:
        eng.close()


def test_dense_model_looks_up_no_routing_tool(monkeypatch):
    """A dense policy never loads plugins for routing: trainer and engine build with the
    plugin host unreachable."""
    import molt_core.models.checks
    from molt_core.config import RunConfig
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.train import Trainer

    def unreachable(*a, **k):
        raise AssertionError("a dense model looked up a routing tool")

    monkeypatch.setattr(molt_core.models.checks, "shared_host", unreachable)
    assert Trainer(RunConfig()).routing is None
    TransformersEngine("builtin:tiny-qwen3", max_batch_size=1, seed=0).close()


def test_a_routing_tool_loaded_with_plugin_reaches_the_engine(monkeypatch):
    """Review of issue 26: with molt_moe disabled and loaded again by ``--plugin`` (what the MoE
    refusal tells a user to do), the engine must record routing -- before, only the trainer saw
    the --plugin tool, so no rollout carried ``routed_experts`` and replay was silently off."""
    from molt_core import plugins
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.models import load_model, routing_tool

    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_moe")
    monkeypatch.setattr(plugins, "_RUN_PLUGINS", ())
    model = load_model("builtin:tiny-qwen3-moe")
    assert routing_tool(model) is None  # the entry point is disabled: nothing serves the model
    plugins.use_run_plugins(["molt_plugins.moe"])
    assert type(routing_tool(model)).__name__ == "MoeRouting"
    eng = TransformersEngine("builtin:tiny-qwen3-moe", max_batch_size=2, seed=0)
    try:
        assert eng._routing is not None  # the engine records routed experts for every rollout
    finally:
        eng.close()
