"""docs/plugins/directory.md is generated from `molt plugins --json` and cannot drift (issue 15, item 4)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "docs" / "gen_plugin_directory.py"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_plugin_directory", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_page_equals_the_generated_one():
    r = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_page_lists_first_party_and_contrib_with_options():
    text = (ROOT / "docs" / "plugins" / "directory.md").read_text()
    assert "| [`molt_reward_example`](#molt_reward_example) | molt-reward-example | reward: `brevity` |" in text
    assert "| [`molt_env_example`](#molt_env_example) | molt-env-example | env: `reverse_word` |" in text
    assert "| `max_chars` | int | `64` | >= 1 |  |" in text            # contrib brevity's option
    assert "### reward `exact_match` -- [exact_match.md](exact_match.md)" in text


def test_options_table_rendering():
    g = _gen()
    schema = {"properties": {
        "n": {"type": "integer", "default": 3, "minimum": 1, "description": "how\nmany | items"},
        "mode": {"enum": ["a", "b"], "default": "a"},
        "path": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["path"]}
    assert g.options_table(schema) == [
        "| option | type | default | bounds | description |", "|---|---|---|---|---|",
        "| `n` | int | `3` | >= 1 | how many \\| items |",
        '| `mode` | "a" \\| "b" | `"a"` |  |  |',
        "| `path` | str \\| None | **required** |  |  |",
        "| `tags` | list[str] | (computed) |  |  |"]
    assert g.options_table(None) == ["No options."]
