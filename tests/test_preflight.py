"""What a run refuses before its run directory exists (``molt_core.runtime.preflight``), and what
it says when a run cannot draw its plot."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("disabled, overrides, needle", [
    ("molt_tiny_models", ["model.path=builtin:tiny-qwen3-bigvocab"], "molt_tiny_models registers more"),
    ("molt_moe", ["model.path=builtin:tiny-qwen3-moe"], "no loaded plugin registers an MoE routing tool"),
    ("", ["algo.advantage=bogus"], "algo.advantage = 'bogus'"),
    ("molt_vision", ["images.max_pixels=1000"], "images: the recipe sets [images] but no modality plugin is loaded"),
])
def test_a_missing_feature_is_refused_before_the_run_directory(tmp_path, disabled, overrides, needle):
    """Review of issue 26: each refusal came after ``run directory:`` (MoE, algorithms: inside the
    trainer actor; [images]: a raw traceback). Now exit 2, one ``error:`` line, no directory, and
    ``--dry-run`` refuses the plugin ones too."""
    from click.testing import CliRunner

    from molt_core.cli import main

    env = {"MOLT_DISABLE_PLUGINS": disabled}
    sets = [a for o in overrides for a in ("--set", o)]
    r = CliRunner().invoke(main, ["run", "quickstart", "--local", "--steps", "1", "--sft-steps", "0", *sets,
                                  "--out", str(tmp_path / "run")], env=env)
    assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output
    assert "run directory" not in r.output and not (tmp_path / "run").exists()
    if disabled != "molt_tiny_models" and disabled != "molt_moe":  # the model checks are not --dry-run's
        d = CliRunner().invoke(main, ["run", "quickstart", "--dry-run", *sets], env=env)
        assert d.exit_code == 2 and needle in " ".join(d.output.split()), d.output


def test_a_run_without_matplotlib_says_reward_png_was_not_drawn(tmp_path, monkeypatch):
    """Review of issue 29: the core install has no matplotlib, and reward.png was left out silently."""
    from click.testing import CliRunner

    from molt_core.cli import main

    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)
    r = CliRunner().invoke(main, ["run", "quickstart", "--local", "--steps", "1", "--sft-steps", "0",
                                  "--set", "eval.n_problems=4", "--out", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "note: reward.png not drawn: pip install -e '.[plot]' (matplotlib)" in " ".join(r.output.split())
    assert not (tmp_path / "run" / "reward.png").exists() and (tmp_path / "run" / "metrics.jsonl").exists()
