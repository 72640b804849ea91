"""The vision modality as a plugin: the kernel reaches images only through
``molt_register_modalities``; with no modality plugin loaded, image parts and the ``[images]``
section are refused by name."""

from __future__ import annotations

import base64
import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image

import molt_core.plugins as plugins
from fake_engine import ScriptedEngine
from molt_core.config import load_config
from molt_core.ledger import Ledger
from molt_core.plugins import PluginError, check_modality_options, load_plugins, modality
from molt_core.server import create_app
from molt_plugins.vision.modality import VisionModality


def _png_url() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 30, 30)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture()
def bare(monkeypatch):
    """A process whose plugin host has no modality (as with the vision plugin disabled)."""
    monkeypatch.setenv("MOLT_DISABLE_PLUGINS", "molt_vision")
    return plugins.shared_host()


def test_the_vision_plugin_registers_the_modality():
    assert isinstance(modality(load_plugins()), VisionModality)
    assert modality(load_plugins(entry_points=False)) is None


def test_server_without_a_modality_refuses_an_image_part_naming_it(vl, bare):
    tok, _ = vl
    app = create_app(ScriptedEngine(tok), tok)
    tc = TestClient(app)
    sid = app.state.sessions.create().session_id
    auth = {"Authorization": f"Bearer {app.state.sessions._get(sid).api_key}"}
    msg = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": _png_url()}}]}
    r = tc.post(f"/s/{sid}/v1/chat/completions", json={"messages": [msg]}, headers=auth)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].image_url.url" and err["code"] == "invalid_image"
    assert "no modality plugin is loaded" in err["message"] and "molt_plugins.vision" in err["message"]
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png_url().split(",")[1]}}
    r = tc.post(f"/s/{sid}/v1/messages", json={"max_tokens": 4, "messages": [{"role": "user", "content": [block]}]},
                headers=auth)
    assert r.status_code == 400 and "messages[0].content[0].source" in r.json()["error"]["message"]
    r = tc.post(f"/s/{sid}/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": _png_url()}]}]}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].image_url"


def test_text_only_ledger_without_a_modality_refuses_an_image_part(vl, bare):
    tok, _ = vl
    msg = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url()}}]}
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: .*no modality plugin is loaded"):
        Ledger(tok).prepare([msg])


def test_engine_without_a_modality_refuses_images(bare):
    import asyncio

    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.types import SamplingParams

    eng = TransformersEngine("builtin:tiny-qwen2.5-vl")
    try:
        assert eng.vision_processor is None and not eng.is_vision
        with pytest.raises(ValueError, match="no modality plugin is loaded"):
            asyncio.run(eng.generate([1, 2, 3], SamplingParams(max_tokens=1), images=[b"x"]))
    finally:
        eng.close()


def test_a_recipe_setting_images_without_a_modality_plugin_is_refused():
    cfg = load_config("quickstart", ["images.max_bytes=1000"])
    with pytest.raises(PluginError, match=r"^images: the recipe sets \[images\] but no modality plugin is loaded"):
        check_modality_options(cfg, load_plugins(entry_points=False))
    check_modality_options(cfg, load_plugins())  # the vision plugin loaded: accepted
    check_modality_options(load_config("quickstart"), load_plugins(entry_points=False))  # no [images]: accepted


def test_a_vision_recipe_without_the_modality_plugin_is_refused_before_the_run_dir(tmp_path):
    """Review of issue 26: `molt run vision` with molt_vision disabled loaded the model and failed
    every rollout; now it is refused by name before any compute (exit 2, no run directory)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = {**os.environ, "MOLT_DISABLE_PLUGINS": "molt_vision"}
    r = subprocess.run([sys.executable, "-m", "molt_core.cli", "run", "vision", "--steps", "1", "--sft-steps", "0",
                        "--local", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert ("model.path = 'builtin:tiny-qwen2.5-vl' is a vision-language model, but no loaded plugin registers a "
            "modality") in r.stderr
    assert not out.exists()


def test_declares_vision_reads_the_name_or_the_config_only(tmp_path):
    from molt_core.models import declares_vision

    assert declares_vision("builtin:tiny-qwen2.5-vl") and not declares_vision("builtin:tiny-qwen3")
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_config": {}}')
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text('{"model_type": "qwen3"}')
    assert declares_vision(str(tmp_path / "vl")) and not declares_vision(str(tmp_path / "text"))
    assert not declares_vision("Qwen/Qwen2.5-VL-3B-Instruct")  # a Hub id: refused per request instead
