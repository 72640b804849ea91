"""The shipped image ChatAgent (recipes/agents/visual_chat.py, recipe ``vision_chat``): it sends
the visual env's image through the stock ``openai`` SDK to the loopback server and gets a
token-exact trajectory -- the prompt is the chat template's render with the image's
placeholder expanded to its 16-token run (56x56 image, 7-px patches, 2x2 merge: computed by
hand), the sampled ids and logprobs are the ones returned on the wire, the image is stored
once -- and its SFT warm start sees the same image and question as the ``visual`` env's."""

from __future__ import annotations

import hashlib
from pathlib import Path

import openai
import pytest

from molt_core.agents import load_agent
from molt_core.cli.recipe import load_config
from molt_core.identity import TokenCheck, check_tokens
from molt_core.plugins import load_plugins
from molt_core.train.sft import examples_from_agent
from molt_core.testing import run_episode
from molt_plugins.envs.visual import VisualEnv, png_bytes

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "vision_chat.toml"
PAD, RUN = 514, 16  # <|image_pad|>; (56 / 14) ** 2 image tokens


def agent_and_env():
    cfg = load_config(RECIPE)
    return cfg, load_agent(cfg, load_plugins()), VisualEnv(**cfg.agent.options)


def test_the_recipe_is_the_vision_recipe_with_the_chat_agent():
    """Same model, task options and settings as recipes/vision.toml; only the agent differs."""
    chat, vision = load_config(RECIPE).model_dump(), load_config(ROOT / "recipes" / "vision.toml").model_dump()
    assert chat["agent"]["path"].endswith("recipes/agents/visual_chat.py") and vision["agent"]["name"] == "visual"
    for d in (chat, vision):
        d["agent"].pop("path"), d["agent"].pop("name"), d["run"].pop("name")
    assert chat == vision


def test_the_agent_sends_what_the_env_shows_and_sft_sees_it():
    cfg, agent, env = agent_and_env()
    assert type(agent).__name__ == "VisualChat"
    tasks = list(agent.tasks("eval", 0))[:8]
    assert tasks == list(env.tasks("eval", 0))[:8]
    for t in tasks:
        assert agent.first_messages(t) == env.first_messages(t)  # image part (PNG data URL), then the question
    # the SFT warm start gets the image (before: a ChatAgent's examples were the question text only)
    assert examples_from_agent(agent, 8, 0) == examples_from_agent(env, 8, 0)


class _Recorded(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` that keeps every chat completion it returns (the wire's view)."""

    seen: list = []

    def __init__(self, **kw):
        super().__init__(**kw)
        create = self.chat.completions.create

        async def recording(**body):
            r = await create(**body)
            _Recorded.seen.append(r)
            return r

        self.chat.completions.create = recording


def _episode(monkeypatch, engine, task):
    """One rollout of the shipped agent on ``task``: (its trajectory, the wire's choice)."""
    _, agent, _ = agent_and_env()
    _Recorded.seen = []
    monkeypatch.setattr(openai, "AsyncOpenAI", _Recorded)  # the agent module calls openai.AsyncOpenAI(...)
    (traj,) = run_episode(agent, task, engine=engine, max_tokens=4, temperature=1.0).trajectories
    (r,) = _Recorded.seen
    return traj, r.choices[0]


def _expected_prompt(tok, env, task):
    """The template's text with the one <|image_pad|> repeated RUN times (by hand)."""
    text = tok.apply_chat_template(env.first_messages(task), tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    i = ids.index(PAD)
    assert ids.count(PAD) == 1
    return ids[:i] + [PAD] * RUN + ids[i + 1:], i


def _check(traj, tok, env, task, wire_ids):
    png = png_bytes(task)
    sha = hashlib.sha256(png).hexdigest()
    assert traj.status == "ok", traj.error
    assert check_tokens(traj) == TokenCheck(0, 0)
    (seg,) = traj.segments
    prompt, i = _expected_prompt(tok, env, task)
    assert seg.token_ids == prompt + wire_ids  # id for id: the 16 image tokens, then what the wire returned
    assert seg.loss_mask == [False] * len(prompt) + [True] * len(wire_ids)
    (ref,) = seg.images
    assert (ref.sha256, ref.start, ref.end, ref.grid_thw) == (sha, i, i + RUN, [1, 8, 8])
    assert list(traj.images) == [sha]  # stored once


def test_scripted_replies_are_recorded_and_scored_exactly(monkeypatch):
    from fake_engine import ScriptedEngine
    from molt_plugins.vision.processor import load_vision_processor

    from molt_core.models import load_tokenizer

    cfg, _, env = agent_and_env()
    task = next(iter(env.tasks("eval", 0)))
    wrong = str(int(task["answer"]) % 4 + 1)
    tok = load_tokenizer(cfg.model.path)
    eng = ScriptedEngine(tok, [task["answer"], wrong])
    eng.vision_processor = load_vision_processor(cfg.model.path, tok)
    for reply, reward in ((task["answer"], 1.0), (wrong, 0.0)):
        traj, c = _episode(monkeypatch, eng, task)
        assert c.token_ids == tok.encode(reply + "<|im_end|>", add_special_tokens=False)
        assert (traj.reward, traj.score) == (reward, reward)
        _check(traj, tok, env, task, c.token_ids)
    assert eng.images == [[png_bytes(task)]] * 2


def test_the_tiny_vl_model_through_the_openai_sdk_is_token_exact(monkeypatch):
    """The real engine (builtin tiny VL, transformers): sampled ids and logprobs on the wire are
    the trajectory's, and the trainer-ingress token check is clean."""
    from molt_core.engines.transformers_engine import TransformersEngine

    cfg, _, env = agent_and_env()
    engine = TransformersEngine(cfg.model.path, seed=0)
    try:
        for task in list(env.tasks("eval", 0))[:2]:
            traj, c = _episode(monkeypatch, engine, task)
            _check(traj, engine.tokenizer, env, task, c.token_ids)
            (seg,) = traj.segments
            (sp,) = seg.spans
            assert seg.logprobs[sp.start:sp.end] == pytest.approx([x.logprob for x in c.logprobs.content], abs=1e-6)
            reply = engine.tokenizer.decode(c.token_ids, skip_special_tokens=True).strip()
            assert traj.score == float(reply == task["answer"])
    finally:
        engine.close()
