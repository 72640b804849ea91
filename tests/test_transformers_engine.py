"""The embedded transformers rollout engine (issue 3 item 1; cases B06-B09)."""

from __future__ import annotations

import asyncio
import math
import os
import threading

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from molt_core.engines.base import RolloutEngine
from molt_core.engines.transformers_engine import TransformersEngine
from molt_core.models import load_model, load_tokenizer
from molt_core.sampling import processed_logprobs
from molt_core.types import SamplingParams

torch.set_num_threads(1)


class StubLM(torch.nn.Module):
    """A causal-LM stand-in whose next-token logits are ``logits_fn(step)``, where ``step`` is
    the index of the token being generated (0 for the first), from ``position_ids``."""

    def __init__(self, vocab: int, prompt_len: int, logits_fn):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"vocab_size": vocab, "max_position_embeddings": 4096})()
        self.vocab, self.prompt_len, self.logits_fn = vocab, prompt_len, logits_fn

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, logits_to_keep=0, **kw):
        b, t = input_ids.shape
        if cache is None:
            cache = DynamicCache()
        cache.update(torch.zeros(b, 1, t, 1), torch.zeros(b, 1, t, 1), 0)
        steps = position_ids[:, -1] - self.prompt_len + 1
        logits = torch.stack([torch.as_tensor(self.logits_fn(int(s)), dtype=torch.float32) for s in steps])
        return CausalLMOutputWithPast(logits=logits[:, None, :], cache=cache)


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- B08 / B09: the sampled distribution
def test_b08_sampling_module():
    lp = processed_logprobs(torch.tensor([2.0, 1.0, 0.0]), temperature=0.5)
    # log softmax([4, 2, 0]) = [4, 2, 0] - log(e^4 + e^2 + 1)
    assert lp[0].item() == pytest.approx(-0.142932, abs=1e-6)
    assert lp[2].item() == pytest.approx(-4.142932, abs=1e-6)


def test_b09_sampling_module():
    lp = processed_logprobs(torch.tensor([0.5, 0.3, 0.2]).log(), top_k=2)
    assert lp[0].item() == pytest.approx(math.log(0.5 / 0.8), abs=1e-6) == pytest.approx(-0.470004, abs=1e-6)
    assert lp[2].item() == float("-inf")


def test_b08_through_engine():
    eng = TransformersEngine(StubLM(3, 2, lambda s: [2.0, 1.0, 0.0]), eos_token_ids=[])
    try:
        out = run(eng.generate([0, 1], SamplingParams(temperature=0.5, max_tokens=1000, seed=7)))
    finally:
        eng.close()
    assert len(out.token_ids) == 1000 and out.finish_reason == "length" and out.prompt_len == 2
    expected = {0: -0.142932, 1: -2.142932, 2: -4.142932}
    for t, lp in zip(out.token_ids, out.logprobs):
        assert lp == pytest.approx(expected[t], abs=1e-5)
    counts = [out.token_ids.count(i) for i in range(3)]
    assert counts[0] > 800 and counts[2] >= 1  # p = 0.867, 0.117, 0.016


def test_b09_through_engine():
    eng = TransformersEngine(StubLM(3, 1, lambda s: [math.log(0.5), math.log(0.3), math.log(0.2)]), eos_token_ids=[])
    try:
        out = run(eng.generate([0], SamplingParams(top_k=2, max_tokens=300, seed=1)))
    finally:
        eng.close()
    assert 2 not in out.token_ids and 0 in out.token_ids and 1 in out.token_ids
    for t, lp in zip(out.token_ids, out.logprobs):
        assert lp == pytest.approx({0: -0.470004, 1: math.log(0.3 / 0.8)}[t], abs=1e-5)


# ---------------------------------------------------------------- B06 / B07: stops and reported length
def _script(ids, vocab=512):
    def fn(step):
        row = [0.0] * vocab
        row[ids[min(step, len(ids) - 1)]] = 100.0
        return row

    return fn


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_b06_b07_pad_equal_stop(temperature):
    tok = load_tokenizer("builtin:tiny-qwen3")
    s = tok.pad_token_id  # <|endoftext|>: the pad id, and a stop id
    assert s in TransformersEngine(StubLM(512, 3, _script([5])), tok).eos_token_ids
    eng = TransformersEngine(StubLM(512, 3, _script([101, 102, 103, s, s, s])), tok)
    try:
        out = run(eng.generate([1, 2, 3], SamplingParams(temperature=temperature, max_tokens=6, seed=0)))
    finally:
        eng.close()
    assert out.token_ids == [101, 102, 103, s]
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert len(out.logprobs) == 4 and len(out.versions) == 4 and out.prompt_len == 3


def test_stop_token_ids_param_and_length():
    tok = load_tokenizer("builtin:tiny-qwen3")
    eng = TransformersEngine(StubLM(512, 2, _script([101, 102, 7, 103, 104])), tok)
    try:
        a = run(eng.generate([1, 2], SamplingParams(temperature=0, stop_token_ids=[7])))
        b = run(eng.generate([1, 2], SamplingParams(temperature=0, max_tokens=2)))
    finally:
        eng.close()
    assert (a.token_ids, a.finish_reason, a.stop_reason) == ([101, 102, 7], "stop", 7)
    assert (b.token_ids, b.finish_reason, b.stop_reason) == ([101, 102], "length", None)


def test_stop_string_on_decoded_text():
    tok = load_tokenizer("builtin:tiny-qwen3")
    ids = tok("The answer is 42. Done", add_special_tokens=False).input_ids
    cut = next(i for i, t in enumerate(ids) if tok.decode(ids[: i + 1]).endswith("is 4"))
    eng = TransformersEngine(StubLM(512, 1, _script(ids)), tok)
    try:
        out = run(eng.generate([1], SamplingParams(temperature=0, stop=["never", "is 4"], max_tokens=50)))
    finally:
        eng.close()
    assert out.token_ids == ids[: cut + 1]
    assert tok.decode(out.token_ids) == "The answer is 4"
    assert (out.finish_reason, out.stop_reason) == ("stop", "is 4")


# ---------------------------------------------------------------- the tiny model: batching and exactness
@pytest.fixture(scope="module")
def tiny():
    eng = TransformersEngine("builtin:tiny-qwen3", max_batch_size=64, seed=0)
    yield eng
    eng.close()


def _prompts(tok, n):
    out = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i * 37}? " * (i % 4 + 1)}],
                                       add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False).input_ids)
    return out


def _params(n, max_tokens=24):
    return [SamplingParams(temperature=[1.0, 0.7, 0.0, 1.3][i % 4], top_k=[-1, 50][i % 2], top_p=[1.0, 0.9, 1.0][i % 3],
                           max_tokens=max_tokens, seed=100 + i) for i in range(n)]


def test_protocol(tiny):
    assert isinstance(tiny, RolloutEngine)
    assert tiny.eos_token_ids == {0, 2}


def test_concurrent_equals_sequential_and_unpadded_forward(tiny):
    prompts, params = _prompts(tiny.tokenizer, 32), _params(32)

    async def batched():
        return await asyncio.gather(*[tiny.generate(p, sp) for p, sp in zip(prompts, params)])

    steps0 = tiny.num_steps
    outs = run(batched())
    batched_steps = tiny.num_steps - steps0
    assert len(outs) == 32 and all(o.finish_reason in ("stop", "length") and o.token_ids for o in outs)
    # batched: far fewer forwards than the 32 * 24 one-at-a-time decoding would need
    assert batched_steps < sum(len(o.token_ids) for o in outs) / 4
    singles = [run(tiny.generate(p, sp)) for p, sp in zip(prompts, params)]
    for a, b in zip(outs, singles):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
    # each reported logprob equals a plain unpadded forward over prompt + completion
    worst = 0.0
    with torch.no_grad():
        for p, o, sp in zip(prompts, outs, params):
            logits = tiny.model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1 : -1]
            lp = processed_logprobs(logits, sp.temperature, sp.top_k, sp.top_p)
            ref = lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(o.logprobs)).abs().max().item())
    assert worst <= 1e-5


def test_identical_prompts_share_one_prefill_row(tiny):
    """A group's n rollouts of one prompt are prefilled once; results equal separate prefills."""
    prompts = _prompts(tiny.tokenizer, 2)
    batch = [prompts[0]] * 6 + [prompts[1]] * 2
    params = _params(8)
    tiny.prefix_cache.clear()  # earlier tests' generations would let these prompts reuse a prefix
    rows = []
    orig = tiny._forward

    def spy(ids, mask, pos, cache, *vision):
        if cache is None:
            rows.append(ids.shape[0])
        return orig(ids, mask, pos, cache, *vision)

    tiny._forward = spy
    try:
        async def batched():
            return await asyncio.gather(*[tiny.generate(p, sp) for p, sp in zip(batch, params)])

        outs = run(batched())
    finally:
        del tiny._forward
    assert rows == [2]  # 8 requests, 2 distinct prompts -> one prefill forward of 2 rows
    singles = [run(tiny.generate(p, sp)) for p, sp in zip(batch, params)]
    for a, b in zip(outs, singles):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_requests_join_a_running_batch(tiny):
    prompts, params = _prompts(tiny.tokenizer, 3), _params(3, max_tokens=40)

    async def staggered():
        first = asyncio.create_task(tiny.generate(prompts[0], params[0]))
        start = tiny.num_steps
        while tiny.num_steps < start + 5:
            await asyncio.sleep(0.001)
        rest = [asyncio.create_task(tiny.generate(p, sp)) for p, sp in zip(prompts[1:], params[1:])]
        return [await first] + [await t for t in rest]

    outs = run(staggered())
    singles = [run(tiny.generate(p, sp)) for p, sp in zip(prompts, params)]
    for a, b in zip(outs, singles):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_seed_reproducible_and_bad_input(tiny):
    p = _prompts(tiny.tokenizer, 1)[0]
    sp = SamplingParams(max_tokens=16, seed=5)
    assert run(tiny.generate(p, sp)).token_ids == run(tiny.generate(p, sp)).token_ids
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        run(tiny.generate([], sp))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run(tiny.generate([1, 512], sp))
    with pytest.raises(ValueError, match="context"):
        run(tiny.generate([1] * 512, sp))
    with pytest.raises(KeyError, match="no_such"):
        tiny.load_weights({"no_such.weight": torch.zeros(1)}, 1)
    with pytest.raises(ValueError, match="shape"):
        tiny.load_weights({"model.norm.weight": torch.zeros(3)}, 1)


def test_cancelled_request_leaves_engine_working(tiny):
    p = _prompts(tiny.tokenizer, 1)[0]

    async def go():
        t = asyncio.create_task(tiny.generate(p, SamplingParams(max_tokens=200, seed=1)))
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return await tiny.generate(p, SamplingParams(max_tokens=5, seed=1))

    assert len(run(go()).token_ids) <= 5
    assert tiny.load == 0


def test_version_changes_mid_generation():
    model = load_model("builtin:tiny-qwen3", seed=0)
    new_sd = {k: v.clone() for k, v in load_model("builtin:tiny-qwen3", seed=1).state_dict().items()}
    eng = TransformersEngine(model, load_tokenizer("builtin:tiny-qwen3"), eos_token_ids=[])
    reached = threading.Event()
    calls = [0]

    def hook(mod, args, kwargs):
        calls[0] += 1
        if calls[0] == 6:  # during the 6th forward: the swap lands after its token is sampled
            eng.pause()
            reached.set()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)

    def swapper():
        assert reached.wait(30)
        eng.load_weights(new_sd, 1)  # from another thread, while the generation is in flight
        eng.resume()

    async def go():
        task = asyncio.create_task(eng.generate([1, 326, 207], SamplingParams(max_tokens=30, seed=3)))
        await asyncio.to_thread(swapper)
        return await task

    try:
        out = run(go())
    finally:
        handle.remove()
        eng.close()
    assert out.versions == [0] * 6 + [1] * 24
    assert eng.version == 1
    assert torch.equal(model.model.norm.weight, new_sd["model.norm.weight"])
    # each token's logprob is its own version's forward over the whole prefix (partial rollout:
    # the KV cache is recomputed under the new weights, never new weights over an old cache)
    seq = torch.tensor([[1, 326, 207] + out.token_ids])
    for version, seed in ((0, 0), (1, 1)):
        ref = load_model("builtin:tiny-qwen3", seed=seed)
        with torch.no_grad():
            lp = processed_logprobs(ref(input_ids=seq).logits[0, 2:-1].float(), 1.0, -1, 1.0)
        want = lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        idx = [i for i, v in enumerate(out.versions) if v == version]
        diff = max(abs(out.logprobs[i] - float(want[i])) for i in idx)
        assert diff <= 1e-5, (version, diff)


def test_factory_via_plugin_kwargs():
    from molt_plugins.engines import _transformers_engine

    eng = _transformers_engine(model="builtin:tiny-qwen3", max_batch_size=4, version=3)
    try:
        out = run(eng.generate([1, 326, 207], SamplingParams(max_tokens=3, seed=0)))
    finally:
        eng.close()
    assert out.versions == [3] * len(out.token_ids) and 1 <= len(out.token_ids) <= 3


# ---------------------------------------------------------------- prefix cache (agent turns)


def _turns(eng, tok, k, turns=3, temperature=1.0):
    """One agent conversation of ``turns`` turns on ``eng``: each prompt extends the last by the
    sampled ids and the template's tail (token-exact, as the ledger does)."""

    async def go():
        ids, outs = [], []
        for t in range(turns):
            tail = ("<|im_end|>\n" if ids and ids[-1] != 2 else "\n" if ids else "")
            ids = ids + tok.encode(tail + f"<|im_start|>user\nq{k} {t} {'x' * k}<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
            out = await eng.generate(ids, SamplingParams(max_tokens=5 + k, seed=10 * k + t, temperature=temperature))
            outs.append((list(ids), out))
            ids = ids + out.token_ids
        return outs

    return go()


def test_prefix_cache_reuses_agent_turns_exactly():
    """Concurrent multi-turn sessions: turn t + 1 prefills only its tail (the prefix cache holds
    turn t's keys/values), with the same ids (greedy and sampled) and logprobs within 1e-5 of an
    engine without the cache, and of a plain unpadded forward over the whole sequence."""
    tok = load_tokenizer("builtin:tiny-qwen3")
    cached = TransformersEngine(load_model("builtin:tiny-qwen3"), tok, eos_token_ids=[])
    plain = TransformersEngine(load_model("builtin:tiny-qwen3"), tok, eos_token_ids=[], prefix_cache_mb=0)
    try:
        for temperature in (0.0, 1.0):
            async def sessions(eng):
                return await asyncio.gather(*[_turns(eng, tok, k, temperature=temperature) for k in range(5)])

            hits0, reused0 = cached.prefix_cache.hits, cached.prefix_cache.reused_tokens
            got, want = run(sessions(cached)), run(sessions(plain))
            # every later turn reused the whole previous sequence but its last sampled token
            later = [(p, o) for conv in got for p, o in conv[1:]]
            assert cached.prefix_cache.hits - hits0 >= len(later) == 10
            prev = [len(conv[t][0]) + len(conv[t][1].token_ids) - 1 for conv in got for t in range(2)]
            assert cached.prefix_cache.reused_tokens - reused0 >= sum(prev)
            for ca, cb in zip(got, want):
                for (pa, a), (pb, b) in zip(ca, cb):
                    assert pa == pb and a.token_ids == b.token_ids
                    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
            with torch.no_grad():
                for conv in got:
                    for p, o in conv:
                        logits = cached.model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1: -1]
                        lp = processed_logprobs(logits, temperature, -1, 1.0)
                        ref = lp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
                        assert (ref - torch.tensor(o.logprobs)).abs().max().item() <= 1e-5
        assert plain.prefix_cache.hits == 0 and len(plain.prefix_cache) == 0
    finally:
        cached.close()
        plain.close()


def test_prefix_cache_prefills_only_the_tail():
    """The second turn's prefill forward runs only the new tail's positions."""
    tok = load_tokenizer("builtin:tiny-qwen3")
    eng = TransformersEngine(load_model("builtin:tiny-qwen3"), tok, eos_token_ids=[])
    shapes = []
    orig = eng._forward

    def spy(ids, mask, pos, cache, *vision):
        shapes.append((tuple(ids.shape), 0 if cache is None else cache.get_seq_length()))
        return orig(ids, mask, pos, cache, *vision)

    eng._forward = spy
    try:
        p1 = [1, 326, 207, 40, 41]
        out1 = run(eng.generate(p1, SamplingParams(max_tokens=4, seed=1)))
        tail = [42, 43, 44]
        shapes.clear()
        run(eng.generate(p1 + out1.token_ids + tail, SamplingParams(max_tokens=2, seed=2)))
    finally:
        eng.close()
    # the cache held p1 + the first 3 sampled ids (the 4th was never fed): 8 reused, 4 new
    assert shapes[0] == ((1, 4), 8)
    assert len(shapes) == 2 and shapes[1][0] == (1, 1)


def test_prefix_cache_cleared_by_a_weight_load():
    """Keys/values of old weights are never reused: after load_weights the next turn equals an
    engine that only ever had the new weights. Injecting the fault (a cache that survives the
    load) makes the logprobs differ, so the test sees it."""
    tok = load_tokenizer("builtin:tiny-qwen3")
    new_sd = {k: v.clone() for k, v in load_model("builtin:tiny-qwen3", seed=1).state_dict().items()}
    ref = TransformersEngine(load_model("builtin:tiny-qwen3", seed=1), tok, eos_token_ids=[], prefix_cache_mb=0)
    p1 = [1, 326, 207, 40, 41]
    p2_tail = [42, 43, 44]

    def second_turn(keep_cache: bool):
        eng = TransformersEngine(load_model("builtin:tiny-qwen3", seed=0), tok, eos_token_ids=[])
        try:
            out1 = run(eng.generate(p1, SamplingParams(max_tokens=4, seed=1)))
            if keep_cache:  # the fault: clear() does nothing
                eng.prefix_cache.clear = lambda: None
            eng.load_weights(new_sd, 1)
            assert len(eng.prefix_cache) == (1 if keep_cache else 0)
            p2 = p1 + out1.token_ids + p2_tail
            return p2, run(eng.generate(p2, SamplingParams(max_tokens=6, seed=2, temperature=0.0)))
        finally:
            eng.close()

    try:
        p2, good = second_turn(False)
        want = run(ref.generate(p2, SamplingParams(max_tokens=6, seed=2, temperature=0.0)))
        assert good.versions == [1] * 6 and good.token_ids == want.token_ids
        assert max(abs(x - y) for x, y in zip(good.logprobs, want.logprobs)) <= 1e-5
        _, bad = second_turn(True)
        assert max(abs(x - y) for x, y in zip(bad.logprobs, want.logprobs)) > 1e-3
    finally:
        ref.close()


def test_prefix_cache_lru_budget_and_errors():
    from molt_core.engines.prefix_cache import PrefixCache

    kv = lambda n: [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]  # 2 * (2 * n * 4) * 4 bytes = 64 n
    pc = PrefixCache(64 * 10)
    pc.put([1, 2, 3, 4], kv(4))  # 256 bytes
    pc.put([5, 6, 7, 8], kv(4))  # 512
    assert pc.match([1, 2, 3, 4, 9]) == (4, pc.match([1, 2, 3, 4, 9])[1]) and pc.hits == 2
    pc.put([9, 9, 9], kv(3))  # 704 > 640: evicts the least recently used, [5, 6, 7, 8]
    assert len(pc) == 2 and pc.nbytes == 64 * 7
    assert pc.match([5, 6, 7, 8, 1])[0] == 0
    n, got = pc.match([1, 2, 3, 4])  # the whole prompt cached: the last position is still run
    assert n == 3 and got[0][0].shape == (2, 3, 4)
    assert pc.match([1, 2, 7, 7])[0] == 0  # not a prefix
    pc.put(list(range(11)), kv(11))  # bigger than the whole budget: not kept
    assert len(pc) == 2
    with pytest.raises(ValueError, match="length 3/3 for 4 ids"):
        pc.put([1, 2, 3, 4], kv(3))
    with pytest.raises(ValueError, match=">= 0 bytes"):
        PrefixCache(-1)
    with pytest.raises(ValueError, match="prefix_cache_mb must be >= 0"):
        TransformersEngine(load_model("builtin:tiny-qwen3"), eos_token_ids=[], prefix_cache_mb=-1)
