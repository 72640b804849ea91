"""The shared-prefix forward (issue 16): a prompt prefix the rows of a micro-batch share runs
once per distinct prefix (molt_core.train.forward.shared_prefix), and the rows read its keys
and values. Same function as the full forward up to float rounding; the on-policy metric
flags a wrong prefix; a model that drops the cache is refused, never silently trained."""

from __future__ import annotations

import pytest
import torch

import molt_core.train.forward as fwd
from molt_core.train import Trainer, build_batch
from molt_core.train.version_history import ONPOLICY_ABSDIFF_TOL
from trainer_utils import record_engine_ids, set_behaviour, synthetic_rollouts, tiny_cfg

torch.set_num_threads(1)


def test_plan_exact_values():
    """L = (earliest sampled column) - 1; distinct prefixes in sorted order; the saving rule."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 0],
                        [1, 2, 3, 6, 7, 8],
                        [9, 2, 3, 4, 0, 0],
                        [1, 2, 3, 5, 0, 0]])
    pids = torch.full(ids.shape, -1)
    pids[0, 3:5] = 0
    pids[1, 4:6] = 0
    pids[2, 3] = 0  # row 3 samples nothing: it bounds L by T only
    L, pre, inv = fwd.shared_prefix(ids, pids)
    assert L == 2  # earliest sampled column 3
    assert pre.tolist() == [[1, 2], [9, 2]] and inv.tolist() == [0, 0, 1, 0]
    # saving (4 - 2) * 2 = 4 token positions of 24: above 10 %, not above 20 %
    assert fwd.shared_prefix(ids, pids, min_saving=0.16) is not None
    assert fwd.shared_prefix(ids, pids, min_saving=0.17) is None
    pids[2, 1] = 0  # a token sampled at column 1: no prompt column left to share
    assert fwd.shared_prefix(ids, pids) is None
    assert fwd.shared_prefix(ids[:1], pids[:1]) is None  # one row shares with nobody
    distinct = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert fwd.shared_prefix(distinct, torch.tensor([[-1, -1, 0, 0], [-1, -1, 0, 0]])) is None


def _trainers(**trainer):
    """Two trainers on the same tiny Qwen3 weights, shared prefix on and off."""
    a = Trainer(tiny_cfg(trainer={"lr": 1e-2, **trainer}))
    b = Trainer(tiny_cfg(trainer={"lr": 1e-2, "shared_prefix": False, **trainer}), model=_copy(a.model))
    assert a.shared_prefix and not b.shared_prefix
    return a, b


def _copy(model):
    import copy

    return copy.deepcopy(model)


def _count_forwards(model):
    calls = []
    model.register_forward_hook(lambda m, i, o: calls.append(1))
    return calls

def _shared_then_full(tr, batch):
    """No-grad logprobs ``[B, T]`` of ``batch`` with ``tr``'s shared prefix on (two forward
    calls: asserted), then off (one), and the sampled-token mask ``[B, T]``."""
    calls = _count_forwards(tr.model)
    with torch.no_grad():
        lp_shared, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
        tr.shared_prefix = False
        lp_full, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
    assert len(calls) == 3
    return lp_shared, lp_full, batch.mask[:, :lp_full.shape[1]]



def _assert_grads_close(a, b):
    """Every parameter of ``b`` got a gradient, and ``a``'s is within 1e-4 of its largest entry."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        scale = float(pb.grad.abs().max())
        assert scale > 0, name
        assert float((pa.grad - pb.grad).abs().max()) <= 1e-4 * scale, name


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 250)])
def test_forward_equals_the_full_forward_and_so_do_the_gradients(temperature, top_k):
    """3 groups x 4 rollouts, one prompt per group (lengths differ across groups, so ``L`` is
    the shortest group's), one micro-batch: logprobs and entropies within 2e-5 of the full
    forward's (float32 rounding: other matmul shapes), the gradient of their sum within 1e-4
    relative -- and the shared path really ran (two forward calls, not one)."""
    a, b = _trainers()
    ts = synthetic_rollouts(3, shared_prompt=True, temperature=temperature, top_k=top_k)
    batch = build_batch(ts, a.pad_id, a.vocab_size)
    T = int(batch.lengths.max())
    plan = fwd.shared_prefix(batch.input_ids[:, :T], batch.param_ids[:, :T])
    assert plan is not None and plan[1].shape[0] == 3  # three distinct prompts for 12 rows
    calls_a, calls_b = _count_forwards(a.model), _count_forwards(b.model)
    lp_a, ent_a = fwd.forward_rows(a, a.model, batch, slice(None), with_entropy=True)
    lp_b, ent_b = fwd.forward_rows(b, b.model, batch, slice(None), with_entropy=True)
    assert len(calls_a) == 2 and len(calls_b) == 1
    m = batch.mask[:, :T]
    # (top-k 250: a random synthetic token is often outside the support, -inf in both)
    torch.testing.assert_close(lp_a[m], lp_b[m], atol=2e-5, rtol=0)
    torch.testing.assert_close(ent_a[m], ent_b[m], atol=2e-5, rtol=0)
    assert bool((lp_b[m] < -1e-3).all()) and int(torch.isfinite(lp_b[m]).sum()) >= 10  # real logprobs, not zeros
    assert float(lp_a[~m].detach().abs().max()) == 0.0
    fin = torch.isfinite(lp_b.detach())
    (lp_a[fin].sum()).backward()
    (lp_b[fin].sum()).backward()
    _assert_grads_close(a.model, b.model)


def test_train_step_matches_and_micro_batches_share_within_themselves():
    """A GRPO step with the shared prefix on equals the step with it off (loss, grad norm,
    updated weights) up to rounding, at ``micro_batch_size = 5`` too (groups split across
    micro-batches: each shares what it holds)."""
    # train/shared_prefix_frac = positions saved / positions run, by hand from the rollouts
    # (seed 5: groups of 4 with prompts of 7, 8 and 4 tokens, row lengths 14 12 15 15 | 13 15 12 16 |
    # 8 8 11 9; a micro-batch shares L = its shortest prompt - 1 columns, saving (rows - groups) * L):
    #   one micro-batch: T = 16, L = 3, 3 prefixes -> (12 - 3) * 3 = 27 of 12 * 16 = 192
    #   micro-batches of 5: rows 0-4 (T 15, L 6, 2 prefixes) 3 * 6 = 18 of 75; rows 5-9 (T 16, L 3,
    #   2 prefixes) 3 * 3 = 9 of 80; rows 10-11 (T 11, L 3, 1 prefix) 1 * 3 = 3 of 22 -> 30 of 177
    for mb, frac in ((64, 27 / 192), (5, 30 / 177)):
        a, b = _trainers(micro_batch_size=mb)
        w0 = torch.cat([p.detach().flatten().clone() for p in a.model.parameters()])
        ts = synthetic_rollouts(5, shared_prompt=True)  # shares at both micro-batch sizes (seed 4: only at 5)
        assert [len(t.segments[0].token_ids) for t in ts] == [14, 12, 15, 15, 13, 15, 12, 16, 8, 8, 11, 9]
        assert [t.segments[0].spans[0].start for t in ts] == [7] * 4 + [8] * 4 + [4] * 4
        record_engine_ids(ts)
        set_behaviour(b, ts)
        ma, mb_ = a.train_step(ts), b.train_step(ts)
        assert ma["grad_norm"] > 0
        assert abs(ma["grad_norm"] - mb_["grad_norm"]) <= 1e-4 * mb_["grad_norm"]
        assert abs(ma["loss/total"] - mb_["loss/total"]) <= 1e-5
        assert ma["invariants/logprob_absdiff_max_onpolicy"] < 2e-5
        assert ma["train/shared_prefix_frac"] == frac
        assert mb_["train/shared_prefix_frac"] == 0.0
        # AdamW's first step is ~lr * sign(grad): a weight whose gradient is ~0 moves by
        # rounding either way, so compare the updates as vectors, not weight for weight
        da = torch.cat([p.detach().flatten() for p in a.model.parameters()]) - w0
        db = torch.cat([p.detach().flatten() for p in b.model.parameters()]) - w0
        assert float(db.abs().max()) > 0.5 * 1e-2  # the weights moved (lr 1e-2)
        # (a weight whose gradient is ~eps moves by up to ~lr on either side: a handful of them)
        assert float(((da - db).abs() > 1e-2 * 1e-2).float().mean()) < 1e-4  # measured: 3.5e-6 (seed 4, mb 5)
        assert float((da - db).abs().mean()) < 1e-7  # measured: 4e-9


def test_a_wrong_shared_prefix_is_flagged_by_the_onpolicy_metric(monkeypatch):
    """Fault: every row reads the keys/values of another group's prompt (the row -> prefix map
    rolled by one). The engine's behaviour logprobs are the full forward's, so the step's
    ``invariants/logprob_absdiff_max_onpolicy`` reads far above the float32 bound; clean, it
    stays under it."""
    a, b = _trainers()
    ts = synthetic_rollouts(5, shared_prompt=True)
    record_engine_ids(ts)
    set_behaviour(b, ts)
    clean = Trainer(tiny_cfg(trainer={"lr": 1e-2}), model=_copy(a.model)).train_step(ts)
    assert clean["invariants/logprob_absdiff_max_onpolicy"] < ONPOLICY_ABSDIFF_TOL["float32"]
    real = fwd.shared_prefix

    def rolled(ids, pids, min_saving=0.1):
        plan = real(ids, pids, min_saving)
        return plan if plan is None else (plan[0], plan[1], (plan[2] + 1) % plan[1].shape[0])

    monkeypatch.setattr(fwd, "shared_prefix", rolled)
    m = a.train_step(ts)
    assert m["invariants/logprob_absdiff_max_onpolicy"] > 0.1


def test_a_model_that_drops_the_cache_is_refused_not_trained():
    """Gradient checkpointing drops the KV cache inside a checkpointed layer: the trainer turns
    the shared prefix off with it; forced on, the forward raises instead of computing every
    row without its prompt."""
    tr = Trainer(tiny_cfg(trainer={"gradient_checkpointing": True}))
    assert not tr.shared_prefix
    ts = synthetic_rollouts(6, shared_prompt=True)
    batch = build_batch(ts, tr.pad_id, tr.vocab_size)
    tr.shared_prefix = True
    with torch.no_grad():  # no backward to replay: the layers keep the cache
        fwd.forward_rows(tr, tr.model, batch, slice(None))
    with pytest.raises(RuntimeError, match="trainer.shared_prefix = false"):
        fwd.forward_rows(tr, tr.model, batch, slice(None))


def test_off_where_it_cannot_apply():
    """No sharing for a sharded trainer (its ranks must run the same forward calls), a batch
    with routing, or a model whose forward takes no KV cache (one forward call each; the
    plain model shares: two)."""
    tr = Trainer(tiny_cfg())
    ts = synthetic_rollouts(7, shared_prompt=True)
    batch = build_batch(ts, tr.pad_id, tr.vocab_size)
    calls = _count_forwards(tr.model)
    with torch.no_grad():
        fwd.forward_rows(tr, tr.model, batch, slice(None))
        assert len(calls) == 2
        tr.lockstep = True
        fwd.forward_rows(tr, tr.model, batch, slice(None))
        assert len(calls) == 3
        tr.lockstep = False
        batch.routed_experts = torch.full((*batch.input_ids.shape, 1, 1), -1)
        fwd.forward_rows(tr, tr.model, batch, slice(None))
        assert len(calls) == 4
        batch.routed_experts = None

        class NoCache(torch.nn.Module):  # a forward with logits_to_keep but no cache keyword
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, use_cache=False, logits_to_keep=0):
                return self.inner(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep)

        fwd.forward_rows(tr, NoCache(tr.model), batch, slice(None))
        assert len(calls) == 5


def test_a_lora_policy_shares_its_prefix_too():
    """Through peft (the adapter's layers see the prefix and the rest of the rows alike): the
    same logprobs as the full forward, after an update has moved the adapter off zero."""
    pytest.importorskip("peft")
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    tr = Trainer(tiny_cfg(trainer={"lr": 1e-2, "lora": lora}))
    ts = synthetic_rollouts(8, shared_prompt=True)
    record_engine_ids(ts)
    set_behaviour(tr, ts)
    assert tr.train_step(ts)["grad_norm"] > 0
    batch = build_batch(ts, tr.pad_id, tr.vocab_size)
    lp_shared, lp_full, m = _shared_then_full(tr, batch)
    torch.testing.assert_close(lp_shared[m], lp_full[m], atol=2e-5, rtol=0)


def _tiny_lfm2():
    """A 2-layer LFM2 (one short-convolution layer, one attention layer; vocab 512): its cache
    holds a convolution state (a transformers ``LinearAttentionLayer``) beside keys/values."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    cfg = Lfm2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"])
    return Lfm2ForCausalLM(cfg)


def test_a_model_whose_cache_is_not_keys_and_values_runs_in_full():
    """A hybrid model (LFM2's convolution layer; likewise Mamba, Qwen3-Next's linear attention)
    keeps a per-row state that ``batch_select_indices`` does not select (the old code raised
    AttributeError from the cache on the first forward): the forward falls back to the full
    one -- bit for bit the logprobs of ``shared_prefix`` off -- once per model, and that model
    never tries the prefix again (one forward call, not two)."""
    tr = Trainer(tiny_cfg(), model=_tiny_lfm2())
    ts = synthetic_rollouts(3, shared_prompt=True)
    batch = build_batch(ts, tr.pad_id, tr.vocab_size)
    T = int(batch.lengths.max())
    assert fwd.shared_prefix(batch.input_ids[:, :T], batch.param_ids[:, :T]) is not None
    calls = _count_forwards(tr.model)
    with torch.no_grad():
        lp1, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))  # tries the prefix: 2 calls
        lp2, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))  # remembered: 1 call
        tr.shared_prefix = False
        lp_full, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
    assert len(calls) == 4
    m = batch.mask[:, :T]
    assert bool((lp_full[m] < -1e-3).all())
    assert torch.equal(lp1, lp_full) and torch.equal(lp2, lp_full)
    # an update on it counts no saved position (train/shared_prefix_frac: the prefix never ran)
    # (its first forward is the update's: the behaviour logprobs come from a copy)
    tr2 = Trainer(tiny_cfg(trainer={"lr": 1e-2}), model=_tiny_lfm2())
    record_engine_ids(ts)
    set_behaviour(Trainer(tiny_cfg(trainer={"shared_prefix": False}), model=_copy(tr2.model)), ts)
    m2 = tr2.train_step(ts)
    assert m2["grad_norm"] > 0 and m2["train/shared_prefix_frac"] == 0.0
    # a fresh Qwen3 still shares (the memory is per model object, not per process)
    a, _ = _trainers()
    c = _count_forwards(a.model)
    with torch.no_grad():
        fwd.forward_rows(a, a.model, batch, slice(None))
    assert len(c) == 2


def test_a_micro_batch_that_samples_nothing_plans_no_prefix():
    """Rows with no sampled token (a segment of a multi-segment rollout can have none): a
    micro-batch of only such rows computes no logits, so no prefix is planned (the old plan
    took ``L = T`` and ran an empty suffix)."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 0]])
    assert fwd.shared_prefix(ids, torch.full(ids.shape, -1)) is None
    tr = Trainer(tiny_cfg())
    batch = build_batch(synthetic_rollouts(3, shared_prompt=True), tr.pad_id, tr.vocab_size)
    batch.param_ids[:4] = -1  # the first group's 4 rows sample nothing
    calls = _count_forwards(tr.model)
    with torch.no_grad():
        lp, _ = fwd.forward_rows(tr, tr.model, batch, slice(0, 4))
    assert len(calls) == 1 and float(lp.abs().max()) == 0.0


def test_a_lora_runs_kl_reference_shares_its_prefix():
    """A LoRA run's KL reference is the policy under ``disable_adapter()``
    (:class:`molt_plugins.lora.adapter.AdapterDisabled`): it shares the prefix too (two forward
    calls; the old code saw no cache keyword on the wrapper and ran it in full), with the
    logprobs of its full forward -- the base weights', not the adapter's (after an update
    has moved the adapter, they differ from the policy's)."""
    pytest.importorskip("peft")
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    tr = Trainer(tiny_cfg(trainer={"lr": 1e-2, "lora": lora}, algo={"kl_coef": 0.1}))
    ts = synthetic_rollouts(9, shared_prompt=True)
    record_engine_ids(ts)
    set_behaviour(tr, ts)
    assert tr.train_step(ts)["grad_norm"] > 0
    batch = build_batch(ts, tr.pad_id, tr.vocab_size)
    calls = _count_forwards(tr.model)  # the reference's forwards are the policy's, adapter off
    with torch.no_grad():
        ref_shared, _ = fwd.forward_rows(tr, tr.ref_model, batch, slice(None))
        assert len(calls) == 2
        tr.shared_prefix = False
        ref_full, _ = fwd.forward_rows(tr, tr.ref_model, batch, slice(None))
        policy, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
    m = batch.mask[:, :ref_full.shape[1]]
    torch.testing.assert_close(ref_shared[m], ref_full[m], atol=2e-5, rtol=0)
    assert float((policy[m] - ref_full[m]).abs().max()) > 1e-3


def test_a_sliding_window_model_shares_with_the_same_logprobs_and_gradients():
    """Mistral with a 2-token sliding window, shorter than the shared prefix (its cache keeps
    only the window's last keys, ``DynamicSlidingWindowLayer``): the suffix still reads the
    right ones -- logprobs within 2e-5 of the full forward's (measured 5e-7) and gradients
    within 1e-4 relative -- and it really shared (two forward calls)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=32, intermediate_size=128, sliding_window=2)
    a = Trainer(tiny_cfg(), model=MistralForCausalLM(cfg))
    b = Trainer(tiny_cfg(trainer={"shared_prefix": False}), model=_copy(a.model))
    batch = build_batch(synthetic_rollouts(3, shared_prompt=True), a.pad_id, a.vocab_size)
    T = int(batch.lengths.max())
    L = fwd.shared_prefix(batch.input_ids[:, :T], batch.param_ids[:, :T])[0]
    assert L > cfg.sliding_window
    calls = _count_forwards(a.model)
    lp_a, _ = fwd.forward_rows(a, a.model, batch, slice(None))
    lp_b, _ = fwd.forward_rows(b, b.model, batch, slice(None))
    assert len(calls) == 2
    m = batch.mask[:, :T]
    assert bool((lp_b[m] < -1e-3).all())
    torch.testing.assert_close(lp_a[m], lp_b[m], atol=2e-5, rtol=0)
    lp_a[m].sum().backward()
    lp_b[m].sum().backward()
    _assert_grads_close(a.model, b.model)


def test_bfloat16_autocast_shares_within_the_bf16_bound():
    """bf16 autocast on CPU (float32 parameters): the prefix's cached keys/values and the
    suffix's meet in one attention without a dtype clash, and the logprobs stay within 0.02
    nats of the full forward's (measured 3.9e-3: other matmul shapes round differently in
    bf16), far inside the on-policy bound (ONPOLICY_ABSDIFF_TOL["bfloat16"] = 0.1)."""
    tr = Trainer(tiny_cfg(model={"dtype": "bfloat16"}))
    assert tr.compute_dtype == torch.bfloat16
    batch = build_batch(synthetic_rollouts(3, shared_prompt=True), tr.pad_id, tr.vocab_size)
    lp_shared, lp_full, m = _shared_then_full(tr, batch)
    assert bool((lp_full[m] < -1e-3).all())
    d = float((lp_shared[m] - lp_full[m]).abs().max())
    assert d < 0.02 < ONPOLICY_ABSDIFF_TOL["bfloat16"]


def _tiny_qwen3(rope, max_positions=32):
    """A 2-layer Qwen3 (vocab 512, head_dim 32: 16 rotary frequencies) with ``rope_parameters``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, intermediate_size=128,
                      max_position_embeddings=max_positions, rope_parameters={"rope_theta": 10000.0, **rope})
    return Qwen3ForCausalLM(cfg).eval()


#: longrope switching at 8 positions: the batch's prefix (L = 3) is under it, its rows (T = 17) over it
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 8, "factor": 4.0,
            "short_factor": [1.0] * 16, "long_factor": [4.0] * 16}


@pytest.mark.parametrize("rope,max_positions", [(LONGROPE, 32), ({"rope_type": "dynamic", "factor": 4.0}, 8),
                                                ({"rope_type": "dynamic", "factor": 4.0, "alpha": 1000.0}, 8)])
def test_a_rotary_embedding_whose_factors_depend_on_the_length_runs_in_full(rope, max_positions):
    """Issue 24: transformers picks longrope's factors (and dynamic NTK's base) from the longest
    position of each forward call, so a prefix of L = 3 positions was rotated with the short
    factors and the rows' other 14 with the long ones (0.043 nats from the full forward on this
    model; the old code shared; a non-Hunyuan ``dynamic`` with ``alpha`` shared until review, its
    rotary ignores ``alpha``). Now such a model runs in full -- one forward call, bit for bit
    the logprobs of ``shared_prefix`` off -- while default RoPE on the same weights shares."""
    model = _tiny_qwen3(rope, max_positions)
    tr = Trainer(tiny_cfg(), model=model)
    batch = build_batch(synthetic_rollouts(3, shared_prompt=True), tr.pad_id, tr.vocab_size)
    T = int(batch.lengths.max())
    assert T == 17 and fwd.shared_prefix(batch.input_ids[:, :T], batch.param_ids[:, :T])[0] == 3
    calls = _count_forwards(model)
    with torch.no_grad():
        lp, _ = fwd.forward_rows(tr, model, batch, slice(None))
        tr.shared_prefix = False
        lp_full, _ = fwd.forward_rows(tr, model, batch, slice(None))
    assert len(calls) == 2  # one call each: no prefix forward
    m = batch.mask[:, :T]
    assert bool((lp_full[m] < -1e-3).all()) and torch.equal(lp, lp_full)
    plain = _tiny_qwen3({"rope_type": "default"}, max_positions)
    calls = _count_forwards(plain)
    tr.shared_prefix = True
    with torch.no_grad():
        fwd.forward_rows(tr, plain, batch, slice(None))
    assert len(calls) == 2  # the prefix, then the rows


def test_a_longrope_with_one_factor_set_shares_exactly():
    """The fix the run set-up names: ``short_factor`` equal to ``long_factor`` makes longrope
    static, so it shares (two forward calls) with the full forward's logprobs (within 2e-5)."""
    model = _tiny_qwen3({**LONGROPE, "short_factor": [4.0] * 16})
    tr = Trainer(tiny_cfg(), model=model)
    batch = build_batch(synthetic_rollouts(3, shared_prompt=True), tr.pad_id, tr.vocab_size)
    lp_shared, lp_full, m = _shared_then_full(tr, batch)
    assert bool((lp_full[m] < -1e-3).all())
    torch.testing.assert_close(lp_shared[m], lp_full[m], atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_rope_deltas_a_vl_model_keeps_between_calls_reach_no_forward(family):
    """Issue 24: Qwen2.5-VL and Qwen3-VL keep the ``rope_deltas`` of their last call on the model
    object and derive a cached forward's positions from them (``compute_3d_position_ids``).
    After a ``generate()`` of 5 text prompts (deltas ``[5, 1]``) the shared-prefix suffix of 12
    rows crashed (a shape error: 12 vs 10); after an image call (deltas < 0) its positions
    shifted (8.8e-3 nats on Qwen2.5-VL, 0.13 on Qwen3-VL). Every forward now passes its positions: text rows after either call get the
    logprobs of a model that never ran anything (shared within 2e-5, full bit for bit), and a
    GRPO step runs on-policy."""
    from molt_core.models import load_tokenizer
    from molt_plugins.vision.processor import VisionProcessor, expand_placeholders, load_vision_processor, pixel_inputs
    from tests.test_vision import VL, png
    from tests.test_vision_qwen3vl import tiny_qwen3vl

    tok = load_tokenizer(VL)
    model, vp = None, load_vision_processor(VL, tok)
    if family == "qwen3-vl":
        model, ip = tiny_qwen3vl(tok)
        vp = VisionProcessor(ip, tok.convert_tokens_to_ids("<|image_pad|>"), 2)
    tr = Trainer(tiny_cfg(model={"path": VL}, trainer={"lr": 1e-3}), model=model, tokenizer=tok)
    fresh = _copy(tr.model)
    ts = synthetic_rollouts(3, shared_prompt=True)
    batch = build_batch(ts, tr.pad_id, tr.vocab_size)
    m = batch.mask[:, :int(batch.lengths.max())]
    with torch.no_grad():
        tr.shared_prefix = False
        ref, _ = fwd.forward_rows(tr, fresh, batch, slice(None))
        tr.shared_prefix = True
        tr.model.generate(input_ids=batch.input_ids[:5, :4], max_new_tokens=2, do_sample=False)
        assert tr.model.model.rope_deltas.shape == (5, 1)
        after_generate, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
        ids, _ = expand_placeholders(tok("<|image_pad|>")["input_ids"], [png(28, 28, (200, 0, 0))], vp)
        pv, grid = pixel_inputs([png(28, 28, (200, 0, 0))], vp)
        x = torch.tensor([ids])
        tr.model(input_ids=x, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=(x == vp.image_token_id).int())
        assert int(tr.model.model.rope_deltas.flatten()[0]) < 0
        after_image, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
        tr.shared_prefix = False
        full, _ = fwd.forward_rows(tr, tr.model, batch, slice(None))
        tr.shared_prefix = True
    assert bool((ref[m] < -1e-3).all())
    for lp in (after_generate, after_image):
        torch.testing.assert_close(lp[m], ref[m], atol=2e-5, rtol=0)
    assert torch.equal(full, ref)
    record_engine_ids(ts)
    set_behaviour(Trainer(tiny_cfg(model={"path": VL}, trainer={"shared_prefix": False}), model=fresh,
                          tokenizer=tok), ts)
    assert tr.train_step(ts)["invariants/logprob_absdiff_max_onpolicy"] < 2e-5
