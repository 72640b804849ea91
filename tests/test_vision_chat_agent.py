"""A ChatAgent that sends images through the stock OpenAI SDK to the builtin tiny VL model on
the transformers engine (the runtime's own episode code) gets a token-exact trajectory: the
sampled ids and logprobs are the ones returned on the wire, the first prompt is the chat
template's render with each image's placeholder expanded to its run (computed by hand), the
ImageRefs sit on those runs, each image is stored once, and the trainer-ingress token check
is clean."""

from __future__ import annotations

import hashlib
import io

import openai
import pytest
from PIL import Image

from molt_core.agents import ChatAgent
from molt_core.identity import TokenCheck, check_tokens
from molt_plugins.vision.images import data_url
from molt_core.testing import run_episode
from molt_core.types import Result

VL = "builtin:tiny-qwen2.5-vl"
PAD = 514


def png(w: int, h: int, color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


RED, BLUE = png(28, 28, (255, 0, 0)), png(42, 28, (0, 0, 255))


class ImageAgent(ChatAgent):
    """Two turns over the stock async OpenAI SDK, an image in each user turn (the second
    image is new, the first repeats in the history)."""

    def __init__(self) -> None:
        self.wire: list[tuple[list[int], list[float]]] = []

    async def run(self, ctx):
        c = openai.AsyncOpenAI(base_url=ctx.openai_base_url, api_key=ctx.api_key, max_retries=0)
        part = lambda b: {"type": "image_url", "image_url": {"url": data_url(b, "image/png")}}  # noqa: E731
        msgs = [{"role": "user", "content": [{"type": "text", "text": "what colour?"}, part(RED)]}]
        for nxt in (BLUE, None):
            r = await c.chat.completions.create(model="policy", messages=msgs, max_tokens=6, temperature=1.0)
            ch = r.choices[0]
            self.wire.append((ch.token_ids, [x.logprob for x in ch.logprobs.content]))
            if nxt is None:
                break
            msgs += [{"role": "assistant", "content": ch.message.content or ""},
                     {"role": "user", "content": [part(nxt), {"type": "text", "text": "and now?"}]}]
        return Result(reward=1.0)


@pytest.mark.slow
def test_chat_agent_images_through_the_openai_sdk_token_exact():
    from molt_core.engines.transformers_engine import TransformersEngine

    engine = TransformersEngine(VL, seed=0)
    tok = engine.tokenizer
    agent = ImageAgent()
    group = run_episode(agent, {"prompt": "colours"}, engine=engine, max_tokens=6)
    (traj,) = group.trajectories
    assert traj.status == "ok", traj.error
    assert check_tokens(traj) == TokenCheck(0, 0)
    # the sampled ids and logprobs are exactly those returned on the wire, in order
    spans = [(seg.token_ids[sp.start:sp.end], seg.logprobs[sp.start:sp.end]) for seg in traj.segments for sp in seg.spans]
    assert [ids for ids, _ in spans] == [ids for ids, _ in agent.wire]
    assert [x for _, lp in spans for x in lp] == pytest.approx([x for _, lp in agent.wire for x in lp], abs=1e-6)
    # the first prompt: the template's render, the red image's placeholder expanded to (28/14)**2 = 4 tokens
    seg0 = traj.segments[0]
    shown = [{"role": "user", "content": [{"type": "text", "text": "what colour?"}, {"type": "image"}]}]
    ids = tok.encode(tok.apply_chat_template(shown, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    i = ids.index(PAD)
    want = ids[:i] + [PAD] * 4 + ids[i + 1:]
    assert seg0.token_ids[:seg0.spans[0].start] == want
    # every image run is recorded where it sits, and each image is stored once
    refs = [r for seg in traj.segments for r in seg.images]
    for seg in traj.segments:
        pads = [j for j, t in enumerate(seg.token_ids) if t == PAD]
        assert sum(r.end - r.start for r in seg.images) == len(pads)
        assert all(seg.token_ids[r.start:r.end] == [PAD] * (r.end - r.start) for r in seg.images)
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert refs[0].sha256 == sha(RED) and refs[-1].sha256 == sha(BLUE) and refs[-1].end - refs[-1].start == 6
    assert set(traj.images) == {sha(RED), sha(BLUE)}


def _image_env():
    """An Env whose first user turn shows an image (built with ``images.image_part``); two turns."""
    from molt_core.agents import Env
    from molt_plugins.vision.images import image_part

    class _Env(Env):
        def first_messages(self, task):
            return [{"role": "user", "content": [{"type": "text", "text": "colour?"}, image_part(RED)]}]

        def step(self, action_text, state):
            if state.turn == 0:  # the second user turn shows a new image
                return Result(reward=0.5, observation=[image_part(BLUE), {"type": "text", "text": "and this?"}])
            return Result(reward=0.5, terminated=True)

    return _Env()


def test_env_loop_passes_images_and_records_them():
    """The framework-owned Env loop (runtime worker): the ledger expands each image, the engine
    gets the prompt's images on every turn (the history re-sent by the loop holds the first by
    digest; the second arrives in a later observation), and the trajectory records both runs
    and stores each image once."""
    from fake_engine import ScriptedEngine
    from molt_core.models import load_tokenizer
    from molt_plugins.vision.processor import load_vision_processor

    tok = load_tokenizer(VL)
    eng = ScriptedEngine(tok, ["red", "still red"])
    eng.vision_processor = load_vision_processor(VL, tok)
    group = run_episode(_image_env(), {"prompt": "x"}, engine=eng, max_tokens=6)
    (traj,) = group.trajectories
    assert traj.status == "ok", traj.error
    assert eng.images == [[RED], [RED, BLUE]] and traj.info["requests"]["extend"] == 1
    (seg,) = traj.segments
    red, blue = seg.images
    assert seg.token_ids[red.start:red.end] == [PAD] * 4 and seg.token_ids[blue.start:blue.end] == [PAD] * 6
    assert seg.token_ids.count(PAD) == 10 and traj.reward == 1.0
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    assert (red.sha256, blue.sha256) == (sha(RED), sha(BLUE)) and set(traj.images) == {sha(RED), sha(BLUE)}
    assert check_tokens(traj) == TokenCheck(0, 0)


@pytest.mark.slow
def test_trainer_recompute_on_a_multi_turn_image_rollout_equals_the_engine():
    """The two-turn ImageAgent rollout: the second prompt reuses the first turn's keys/values
    from the engine's prefix cache and prefills only the tail, whose new image is encoded there
    with positions continuing the first turn's M-RoPE positions. The trainer runs the whole
    segment (both images, 3D positions from the model's own get_rope_index) in one forward: its
    logprobs equal the engine's on every sampled token of both turns (<= 1e-5, float32)."""
    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.models import load_model
    from molt_core.train import Trainer, build_batch
    from trainer_utils import tiny_cfg

    engine = TransformersEngine(VL, seed=0)
    try:
        group = run_episode(ImageAgent(), {"prompt": "colours"}, engine=engine, max_tokens=6)
        assert engine.prefix_cache.hits == 1  # the second turn reused the first turn's prefix
    finally:
        engine.close()
    (traj,) = group.trajectories
    assert traj.info["requests"]["extend"] == 1 and [len(s.images) for s in traj.segments] == [2]
    tr = Trainer(tiny_cfg(model={"path": VL}), model=load_model(VL, seed=0), tokenizer=engine.tokenizer)
    batch = build_batch([traj], tr.pad_id, tr.vocab_size, vision=tr.vision_processor)
    lp, _ = tr.recompute_logprobs(batch)
    diff = (lp - batch.behaviour_logprobs).abs()[batch.mask]
    assert diff.numel() == sum(sp.end - sp.start for sp in traj.segments[0].spans) == 12
    assert float(diff.max()) <= 1e-5
