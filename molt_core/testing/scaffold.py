"""``molt plugin new KIND NAME``: write a ready-to-publish plugin package from templates.

The templates are Jinja2 files shipped as package data under ``molt_core/testing/templates/plugin``:
``common/`` (pyproject with the ``molt`` entry point, README, CI workflow, .gitignore) and one
folder per kind (the plugin module with typed ``Options``, and its tests). A path component
``dot-x`` is written as ``.x`` (setuptools does not ship dot-files as package data).

Generated layout for ``molt plugin new reward brevity``::

    molt-reward-brevity/
      pyproject.toml  README.md  .gitignore  .github/workflows/test.yml
      molt_reward_brevity/__init__.py  molt_reward_brevity/py.typed
      tests/test_brevity.py

The generated tests pass as generated (``pip install -e . && pytest``), using the fixtures of
:mod:`molt_core.testing`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "NAME_RE", "render_plugin", "TEMPLATES"]

TEMPLATES = Path(__file__).resolve().parent / "templates" / "plugin"
"""Root of the plugin templates (package data)."""

NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
"""A plugin name: a lowercase Python identifier (it names the function / class and the recipe key)."""

KINDS: dict[str, dict[str, Any]] = {
    "reward": {"kind_key": "rewards", "extra_deps": [],
               "usage": "```toml\n[rewards.{name}]\nmax_chars = 32\nweight = 0.5\n```\n\n"
                        "`molt run quickstart --set 'rewards.{name}={{}}'` adds it to the quickstart's task reward.",
               "options_doc": "- `max_chars` (int, default 64, >= 1): replies up to this many characters score 1.0.\n"
                              "- reserved, read by the runtime: `weight` (default 1.0), `timeout_s` (default 60)."},
    "env": {"kind_key": "envs", "extra_deps": [],
            "usage": "```toml\n[agent]\nname = \"{name}\"\n[agent.options]\nmax_number = 9\n```\n\n"
                     "`molt run quickstart --set agent.name={name} --set 'agent.options={{}}'` trains on it.",
            "options_doc": "- `max_number` (int, default 9, >= 1): operands are drawn from 0..max_number.\n"
                           "- `eval_size` (int, default 16, >= 1): held-out eval tasks (disjoint from train)."},
    "judge": {"kind_key": "judges", "extra_deps": ["openai>=1.40"],
              "usage": "```python\nfrom {package} import {camel}Judge\n"
                       "judge = {camel}Judge(base_url=\"http://127.0.0.1:8000/v1\")\n"
                       "judge.score(\"Paris\", {{\"question\": \"Capital of France?\"}})  # in [0, 1]\n```",
              "options_doc": "- `base_url` (str | None): an OpenAI-compatible endpoint; None: the run's own engine "
                             "(the loopback judge session of `molt_core.rewards.judge_endpoint()`).\n"
                             "- `api_key_env` (default `OPENAI_API_KEY`), `model` (default `policy`), "
                             "`max_score` (default 10), `rubric` (a format string with `{{question}}`, `{{response}}`)."},
    "teacher": {"kind_key": "teachers", "extra_deps": [],
                "usage": "```toml\n[teacher]\nname = \"{name}\"\n[teacher.options]\ntemperature = 1.0\n```",
                "options_doc": "- `temperature` (float, default 1.0, > 0): this starter teacher's logprob of every "
                               "sampled token is `log(1 / vocab) / temperature`; replace it with a real model "
                               "(see molt-sdk's `hf_teacher`)."},
    "replay": {"kind_key": "replay_backends", "extra_deps": [],
               "usage": "Registered for `model.config.model_type == \"{name}\"`: the trainer replays the "
                        "engine's recorded expert choice through it (routing replay, R3).",
               "options_doc": "A replay backend has no options; `router_class` names the router modules it replays."},
}
"""The kinds ``molt plugin new`` knows, with the README snippets of each."""


def next_breaking(version: str) -> str:
    """The first release that may break the hook API after ``version`` (docs/plugins/compatibility.md):
    the next minor while 0.x (``0.1.3`` -> ``0.2``), else the next major (``1.4.0`` -> ``2``)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return f"0.{minor + 1}" if major == 0 else f"{major + 1}"


def _camel(name: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in name.split("_") if p)


def render_plugin(kind: str, name: str, out_dir: str | Path | None = None, parent: str | Path = ".") -> Path:
    """Render the ``kind`` plugin package named ``name``.

    Args:
        kind: one of :data:`KINDS` (``reward``, ``env``, ``judge``, ``teacher``, ``replay``).
        name: the registered name (:data:`NAME_RE`), e.g. ``brevity``.
        out_dir: the package directory; default ``<parent>/molt-<kind>-<name with - for _>``.

    Returns:
        The package directory (created).

    Raises:
        ValueError: unknown kind, invalid name, or ``out_dir`` exists and is not empty.
    """
    import jinja2

    from molt_core import __version__

    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; one of: {', '.join(KINDS)}")
    if not NAME_RE.match(name):
        raise ValueError(f"plugin name {name!r} must be a lowercase Python identifier ({NAME_RE.pattern}), e.g. brevity")
    dist = f"molt-{kind}-{name.replace('_', '-')}"
    package = f"molt_{kind}_{name}"
    out = Path(out_dir) if out_dir is not None else Path(parent) / dist
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose another directory")
    meta = KINDS[kind]
    ctx: dict[str, Any] = {"kind": kind, "name": name, "camel": _camel(name), "dist": dist, "package": package,
                           "molt_version": __version__, "molt_next_breaking": next_breaking(__version__),
                           "kind_key": meta["kind_key"], "extra_deps": meta["extra_deps"]}
    ctx["usage"] = meta["usage"].format(**ctx)
    ctx["options_doc"] = meta["options_doc"]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    files: dict[str, str] = {}
    for src in sorted((TEMPLATES / "common").rglob("*.j2")):
        rel = src.relative_to(TEMPLATES / "common").with_suffix("")
        dest = "/".join("." + p[4:] if p.startswith("dot-") else p for p in rel.parts)
        files[dest] = src.relative_to(TEMPLATES).as_posix()
    files[f"{package}/__init__.py"] = f"{kind}/__init__.py.j2"
    files[f"tests/test_{name}.py"] = f"{kind}/test_plugin.py.j2"
    out.mkdir(parents=True, exist_ok=True)
    for dest, tpl in files.items():
        path = out / dest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(env.get_template(tpl).render(**ctx))
    (out / package / "py.typed").write_text("")
    return out
