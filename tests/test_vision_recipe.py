"""recipes/vision.toml: it validates and builds (default suite); (slow) `molt run vision` and
`molt run vision_chat` run a few steps with image segments token-exact and every invariant
metric clean."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from molt_core.agents import make_agent
from molt_core.cli.recipe import load_config
from molt_core.plugins import load_plugins
from molt_plugins.envs.visual import VisualEnv, png_bytes

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "vision.toml"
#: 56x56 image, 7-px patches, 2x2 merge (builtin:tiny-qwen2.5-vl): an 8x8 patch grid -> 16 tokens
RUN, GRID = 16, [1, 8, 8]


def expected_prompt_ids(vl_tok, env: VisualEnv, task: dict) -> list[int]:
    """The prompt as transformers' Qwen2.5-VL processor builds it: the chat template's text with
    the one ``<|image_pad|>`` replaced by the image's run (``Qwen2_5_VLProcessor.__call__``),
    then tokenized -- independent of molt's ledger and vision module."""
    text = vl_tok.apply_chat_template(env.first_messages(task), tokenize=False, add_generation_prompt=True)
    assert text.count("<|image_pad|>") == 1
    return vl_tok.encode(text.replace("<|image_pad|>", "<|image_pad|>" * RUN), add_special_tokens=False)


def test_vision_recipe_validates_and_builds(vl_tok):
    cfg = load_config(RECIPE)
    host = load_plugins()
    assert cfg.model.path == "builtin:tiny-qwen2.5-vl" and cfg.agent.name == "visual"
    assert cfg.sft.steps > 0 and cfg.run.steps > 0 and cfg.eval.n_problems > 0  # warm start, then GRPO
    assert cfg.algo.advantage == "grpo"
    env = make_agent(host.get("envs", "visual"), cfg.agent.options)
    assert isinstance(env, VisualEnv)
    ev = list(env.tasks("eval", cfg.run.seed))
    assert len(ev) == cfg.eval.n_problems == 256
    assert {t["answer"] for t in ev} == {"1", "2", "3", "4"}
    # each image is 16 image tokens for the builtin model; the prompt is short enough for its context
    ids = expected_prompt_ids(vl_tok, env, ev[0])
    assert ids.count(vl_tok.convert_tokens_to_ids("<|image_pad|>")) == RUN
    assert len(ids) + cfg.rollout.max_tokens <= cfg.rollout.max_total_tokens
    assert RECIPE.read_text().splitlines()[0].startswith("# ")


def test_vision_recipe_prompt_matches_the_vision_module(vl_tok):
    """molt's own expansion (molt_plugins.vision.processor, what the ledger and SFT use) equals the
    processor-style reference above for the recipe's images."""
    from molt_core.train.sft import render_with_images
    from molt_plugins.vision.processor import load_vision_processor

    cfg = load_config(RECIPE)
    env = VisualEnv(**cfg.agent.options)
    vp = load_vision_processor(cfg.model.path, vl_tok)
    for task in list(env.tasks("eval", 0))[:4]:
        prompt, comp, images = render_with_images(vl_tok, vp, env.first_messages(task), task["answer"])
        assert prompt == expected_prompt_ids(vl_tok, env, task)
        assert images == [png_bytes(task)]
        assert comp == vl_tok.encode(task["answer"] + "<|im_end|>", add_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["vision", "vision_chat"])  # the env, and the ChatAgent over the OpenAI SDK
def test_molt_run_vision_is_token_exact_and_clean(tmp_path, vl_tok, recipe):
    out = tmp_path / "run"
    env_vars = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "molt_core.cli", "run", recipe, "--out", str(out), "--set", "run.steps=3",
           "--set", "sft.steps=20", "--set", "eval.n_problems=16", "--set", "eval.every=0",
           "--set", "rollout.prompts_per_step=4", "--set", "rollout.n_samples_per_prompt=4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_vars, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [x for x in rows if x["step"] > 0]
    assert [x["step"] for x in steps] == [1, 2, 3]
    for x in steps:
        assert x["rollout/failed"] == 0 and x["ingress/refused_rollouts"] == 0
        assert x["invariants/tokens_retokenized"] == 0 and x["invariants/tokens_unverified"] == 0
        assert x["invariants/staleness_max"] == 0
        assert x["invariants/onpolicy_tokens"] > 0
        assert x["invariants/logprob_absdiff_max_onpolicy"] <= 1e-5  # float32, image segments included
    env = VisualEnv(**load_config(RECIPE).agent.options)
    pad = vl_tok.convert_tokens_to_ids("<|image_pad|>")
    trajs = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines() if x.strip()]
    assert trajs
    for t in trajs:
        png = png_bytes(t["task"])
        sha = hashlib.sha256(png).hexdigest()
        assert list(t["images"]) == [sha] and base64.b64decode(t["images"][sha]) == png  # stored once
        (seg,) = t["segments"]
        prompt = expected_prompt_ids(vl_tok, env, t["task"])
        assert seg["token_ids"][: len(prompt)] == prompt  # id for id, the 16 image tokens included
        assert not any(seg["loss_mask"][: len(prompt)]) and any(seg["loss_mask"][len(prompt):])
        (ref,) = seg["images"]
        start = prompt.index(pad)
        assert ref == {"sha256": sha, "start": start, "end": start + RUN, "grid_thw": GRID}


def test_docs_images_table_states_the_defaults():
    """docs/vision.md's `[images]` snippet is valid and equals ImagePolicy's defaults."""
    import re
    import tomllib

    from molt_plugins.vision.images import ImagePolicy

    text = (ROOT / "docs" / "vision.md").read_text()
    block = next(b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if b.startswith("[images]"))
    assert ImagePolicy(**tomllib.loads(block)["images"]) == ImagePolicy()
