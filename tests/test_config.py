"""RunConfig loading, strict validation and --set overrides (issue 2, item 4)."""

import pytest

from molt_core.config import ConfigError, RunConfig
from molt_core.cli.recipe import apply_overrides, load_config, parse_override


def write(tmp_path, text):
    p = tmp_path / "r.toml"
    p.write_text(text)
    return p


def test_quickstart_recipe_loads():
    cfg = load_config("quickstart")
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.async_.max_staleness == 0


def test_misspelled_key_and_wrong_type_reported_together(tmp_path):
    p = write(tmp_path, '[rollout]\nn_sampels_per_prompt = 4\nmax_tokens = "eight"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "2 invalid field(s)" in msg
    assert "rollout.n_sampels_per_prompt: unknown key (did you mean 'n_samples_per_prompt'?)" in msg
    assert "rollout.max_tokens:" in msg and "expected int, got str 'eight'" in msg
    assert sorted(p for p, _ in e.value.errors) == ["rollout.max_tokens", "rollout.n_sampels_per_prompt"]


def test_numeric_string_is_still_a_type_error(tmp_path):
    p = write(tmp_path, '[trainer]\nmicro_batch_size = "4"\n')
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size: .*expected int, got str '4'"):
        load_config(p)


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="trainr: unknown key \\(did you mean 'trainer'\\?\\)"):
        load_config(write(tmp_path, "[trainr]\nlr = 1.0\n"))


@pytest.mark.parametrize(
    "item,path,value",
    [
        ("rollout.n_samples_per_prompt=4", ["rollout", "n_samples_per_prompt"], 4),
        ("trainer.lr=3e-4", ["trainer", "lr"], 3e-4),
        ("rollout.dynamic_filter=true", ["rollout", "dynamic_filter"], True),
        ("trainer.betas=[0.9, 0.95]", ["trainer", "betas"], [0.9, 0.95]),
        ("model.path=runs/x/ckpt", ["model", "path"], "runs/x/ckpt"),
        ('run.name="a b"', ["run", "name"], "a b"),
    ],
)
def test_parse_override_types(item, path, value):
    assert parse_override(item) == (path, value)


def test_overrides_apply_and_validate(tmp_path):
    cfg = load_config("quickstart", ["rollout.n_samples_per_prompt=4", "trainer.lr=1e-3", "async.max_staleness=1"])
    assert cfg.rollout.n_samples_per_prompt == 4 and cfg.trainer.lr == 1e-3 and cfg.async_.max_staleness == 1
    with pytest.raises(ConfigError, match="rollout.max_tokens"):
        load_config("quickstart", ["rollout.max_tokens=many"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        apply_overrides({}, ["novalue"])


def test_tilde_override_removes_an_option_so_its_default_applies():
    """``--set '~section.key'`` (Hydra's deletion syntax, as verl's CLI) removes a key the recipe
    sets: LoRA off for the LoRA example, the quickstart's lr back to the
    default. Removing a key that is not set, or giving it a value, is an error naming
    the override; an empty value is refused with both spellings of what was meant."""
    assert load_config("examples/lora").trainer.lora is not None
    assert load_config("examples/lora", ["~trainer.lora"]).trainer.lora is None
    assert load_config("quickstart").trainer.lr == 1.5e-4
    assert load_config("quickstart", ["~trainer.lr"]).trainer.lr == RunConfig().trainer.lr
    assert load_config("quickstart", ["~trainer.lr", "trainer.lr=2e-4"]).trainer.lr == 2e-4  # in order
    with pytest.raises(ConfigError, match=r"--set '~trainer.lora': 'trainer.lora' is not set in the recipe"):
        load_config("quickstart", ["~trainer.lora"])
    with pytest.raises(ConfigError, match=r"--set '~nosection.x': 'nosection.x' is not an option$"):
        load_config("quickstart", ["~nosection.x"])
    with pytest.raises(ConfigError, match=r"--set '~trainer.lorra': 'trainer.lorra' is not an option "
                                          r"\(did you mean 'trainer.lora'\?\)"):
        load_config("examples/lora", ["~trainer.lorra"])  # a typo, not an option at its default
    with pytest.raises(ConfigError, match=r"'agent.options.nope' is not set in the recipe"):
        load_config("quickstart", ["~agent.options.nope"])  # a plugin's options: no schema here
    with pytest.raises(ConfigError, match=r"expected '~section.key' \(no value\)"):
        load_config("quickstart", ["~trainer.lr=1"])
    with pytest.raises(ConfigError, match=r"--set 'run.name=': empty value; for an empty string write "
                                          r"run.name='\"\"', to put the option back to its default write '~run.name'"):
        load_config("quickstart", ["run.name="])
    assert load_config("quickstart", ['run.name=""']).run.name == ""


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config("quickstart", ["trainer.lr=1e-3"])
    path = cfg.write(tmp_path / "run" / "config.toml")
    assert load_config(path) == cfg


def test_missing_recipe_lists_shipped():
    with pytest.raises(ConfigError, match="quickstart"):
        load_config("no-such-recipe")


def test_defaults_are_valid():
    assert RunConfig().algo.advantage == "grpo"


def test_cross_field_rules_fail_before_compute():
    with pytest.raises(ConfigError, match=r"correction: the band \[low, high\] = \[0, 0.5\] must contain 1"):
        load_config("quickstart", ["correction.high=0.5"])
    with pytest.raises(ConfigError, match=r"n_samples_per_prompt = 1: algo.advantage = 'grpo' uses a group baseline"):
        load_config("quickstart", ["rollout.n_samples_per_prompt=1"])
    assert load_config("quickstart", ["rollout.n_samples_per_prompt=1", "algo.advantage=reinforce"]).rollout.n_samples_per_prompt == 1


@pytest.mark.parametrize("raw", ["2024-01-01", "1e-3", "true", "nan", "42", "[1, 2]", "12:30:00"])
def test_string_field_override_takes_the_raw_text(raw):
    """Issue 12 item 14: an override is coerced to its field's declared type; string fields
    (``run.name``, ``str | None`` ones, Literal choices) take the raw text."""
    cfg = load_config("quickstart", [f"run.name={raw}"])
    assert cfg.run.name == raw
    # non-string fields keep the TOML value, and a wrong one is still refused
    assert load_config("quickstart", ["trainer.lr=1e-3"]).trainer.lr == 1e-3
    with pytest.raises(ConfigError, match="rollout.max_tokens"):
        load_config("quickstart", ["rollout.max_tokens=2024-01-01"])
