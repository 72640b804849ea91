"""Generate ``docs/plugins/directory.md`` from ``molt plugins --json``, so the page cannot drift.

It lists molt-sdk's first-party plugins and the example packages under ``contrib/`` with
every registered name and its options (type, default, bounds, description), read from the
JSON schema of each ``Options`` model. The listing runs with ``MOLT_LOAD_PLUGINS=""`` (no
third-party plugin that happens to be installed here) plus each contrib package loaded with
``--plugin``, so the page is the same on every machine.

Usage::

    python docs/gen_plugin_directory.py           # rewrite the page
    python docs/gen_plugin_directory.py --check   # exit 1 if the checked-in page differs

Raises ``SystemExit(1)`` on a stale page (``--check``) or a failing ``molt plugins --json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "plugins" / "directory.md"
KIND_TITLES = {"rewards": "reward", "envs": "env", "judges": "judge", "teachers": "teacher",
               "replay_backends": "replay backend", "routing_tools": "routing tool", "engines": "engine",
               "loggers": "logger", "sandbox_backends": "sandbox backend",
               "weight_sync_transports": "weight-sync transport", "estimators": "estimator", "losses": "loss",
               "adapters": "adapter", "trainer_backends": "trainer backend",
               "modalities": "modality", "tool_parsers": "tool parser", "wires": "wire",
               "render_windows": "window prover", "builtin_models": "builtin model"}


def contrib_packages() -> list[tuple[str, str, str, Path]]:
    """``(distribution, version, module, module file)`` of each ``contrib/*`` package, sorted."""
    out = []
    for pp in sorted((ROOT / "contrib").glob("*/pyproject.toml")):
        proj = tomllib.loads(pp.read_text())["project"]
        for _, module in sorted(proj.get("entry-points", {}).get("molt", {}).items()):
            out.append((proj["name"], proj["version"], module, pp.parent / module / "__init__.py"))
    return out


def plugins_json(contrib: list[tuple[str, str, str, Path]]) -> list[dict[str, Any]]:
    """``molt plugins --json`` with only first-party entry points plus the contrib modules.

    Raises:
        SystemExit: the command fails (its stderr is printed).
    """
    cmd = [sys.executable, "-m", "molt_core.cli", "plugins", "--json"]
    for *_, f in contrib:
        cmd += ["--plugin", str(f)]
    env = {**os.environ, "MOLT_LOAD_PLUGINS": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise SystemExit(1)
    return json.loads(r.stdout)


def _cell(s: str) -> str:
    return " ".join(str(s).split()).replace("|", "\\|")


def _type(f: dict[str, Any], defs: dict[str, Any]) -> str:
    if "$ref" in f:
        return f["$ref"].rsplit("/", 1)[-1]
    if "enum" in f:
        return " | ".join(json.dumps(v) for v in f["enum"])
    if "anyOf" in f:
        return " | ".join(_type(x, defs) for x in f["anyOf"])
    t = f.get("type", "any")
    if t == "array" and "items" in f:
        return f"list[{_type(f['items'], defs)}]"
    if t == "object" and isinstance(f.get("additionalProperties"), dict):
        return f"dict[str, {_type(f['additionalProperties'], defs)}]"
    return {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "object": "dict",
            "array": "list", "null": "None"}.get(t, t)


def _bounds(f: dict[str, Any]) -> str:
    marks = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<",
             "minLength": "len >=", "maxLength": "len <="}
    return ", ".join(f"{op} {f[k]}" for k, op in marks.items() if k in f)


def options_table(schema: dict[str, Any] | None) -> list[str]:
    """Markdown lines describing one ``Options`` JSON schema (empty when there is none)."""
    if not schema:
        return ["No options."]
    props = schema.get("properties", {})
    if not props:
        return ["No options."]
    req = set(schema.get("required", []))
    lines = ["| option | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, f in props.items():
        if name in req:
            default = "**required**"
        elif "default" not in f:
            default = "(computed)"  # a default_factory: not in the JSON schema
        else:
            d = json.dumps(f["default"])
            default = f"`{_cell(d if len(d) <= 48 else d[:45] + '...')}`"
        lines.append(f"| `{name}` | {_cell(_type(f, schema.get('$defs', {})))} | {default} | {_cell(_bounds(f))} | "
                     f"{_cell(f.get('description', ''))} |")
    return lines


def render(rows: list[dict[str, Any]], contrib: list[tuple[str, str, str, Path]]) -> str:
    """The whole page from ``molt plugins --json`` rows."""
    local = {str(f): (dist, version, module, f) for dist, version, module, f in contrib}
    first = sorted((r for r in rows if r["distribution"] == "molt-sdk"), key=lambda r: r["name"])
    third = sorted((r for r in rows if r["name"] in local), key=lambda r: local[r["name"]][2])
    out = ["<!-- generated by docs/gen_plugin_directory.py from `molt plugins --json`; do not edit -->",
           "# Plugin directory", "",
           "Every plugin molt-sdk ships (first-party, distribution `molt-sdk`) and the example packages in",
           "`contrib/`, with each registered name and its options. Regenerate with",
           "`python docs/gen_plugin_directory.py` (a test fails when this page is stale). Installed",
           "plugins on your machine: `molt plugins`; their conformance: `molt plugins --check`.", ""]
    summary = ["| plugin | distribution | registers |", "|---|---|---|"]
    for r in first + third:
        dist = local[r["name"]][0] if r["name"] in local else "molt-sdk"
        name = local[r["name"]][2] if r["name"] in local else r["name"]
        regs = "; ".join(f"{KIND_TITLES.get(k, k)}: " + ", ".join(f"`{n}`" for n in sorted(v))
                         for k, v in sorted(r["registered"].items()))
        summary.append(f"| [`{name}`](#{name}) | {dist} | {regs} |")
    out += summary + [""]
    for r in first + third:
        if r["name"] in local:
            dist, version, name, f = local[r["name"]]
            where = f"`contrib/{f.parent.parent.name}` ({dist} {version}; `pip install -e contrib/{f.parent.parent.name}`)"
        else:
            name, where = r["name"], "molt-sdk (first-party)"
        out += [f"## {name}", "", f"From {where}. Hooks: " + ", ".join(f"`{h}`" for h in r["hooks"]) + ".", ""]
        for kind, names in sorted(r["registered"].items()):
            for n in sorted(names):
                page = ROOT / "docs" / "plugins" / f"{n}.md"
                link = f" -- [{n}.md]({n}.md)" if page.is_file() and r["name"] not in local else ""
                out += [f"### {KIND_TITLES.get(kind, kind)} `{n}`{link}", ""]
                schema = (r.get("options", {}).get(kind) or {}).get(n)
                if schema and schema.get("description"):
                    out += [_cell(schema["description"]), ""]
                out += options_table(schema) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    """Write the page, or with ``--check`` compare it; returns the exit code."""
    contrib = contrib_packages()
    text = render(plugins_json(contrib), contrib)
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            sys.stderr.write(f"{PAGE.relative_to(ROOT)} is stale; run: python docs/gen_plugin_directory.py\n")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
