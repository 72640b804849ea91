"""The ``molt`` command line (click): run | sft | eval | plugins | plugin new | recipes | serve.

Every command validates the recipe and loads plugins before any compute starts, so a bad
key, a wrong type or a broken plugin fails in a second with a message naming it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from molt_core import __version__
from molt_core.config import AgentSection, ConfigError, RunConfig
from molt_core.cli.recipe import RECIPES_DIR, list_recipes, load_config
from molt_core.plugins.extras import missing_requirements, with_install_hint
from molt_core.plugins import PluginError, PluginHost, load_plugins, shared_host

console = Console(stderr=True)


def _is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _plain(text: str) -> str:
    """``text`` without ANSI escape sequences (Ray colours the worker name in a
    ``RayTaskError``'s text whatever the terminal; a message is plain text, styled by rich)."""
    return _ANSI.sub("", text)


def _fail(msg: str, code: int = 2) -> None:
    # the message is plain text: escaped, so "pip install 'molt-sdk[envs]'" is not read as markup,
    # and stripped of ANSI codes, so a redirected log holds none
    console.print(f"[bold red]error:[/] {escape(_plain(msg))}", highlight=False, markup=True, soft_wrap=True)
    sys.exit(code)


def _is_ray_error(e: BaseException) -> bool:
    """True for an exception raised by Ray for a failed task or actor (``ray.exceptions.RayError``)."""
    try:
        from ray.exceptions import RayError
    except ImportError:  # pragma: no cover - ray is a core dependency
        return False
    return isinstance(e, RayError)


def _agent_error(msg: str, agent: str | None) -> str:
    """``msg`` naming ``--agent`` instead of ``agent.path`` when the user gave ``--agent``
    (which replaced the recipe's agent), so the error names the option that was typed."""
    return f"--agent {agent}:" + msg[len("agent.path"):].lstrip(":") if agent and msg.startswith("agent.path") else msg


def prepare(recipe: str, plugin: tuple[str, ...], overrides: tuple[str, ...]) -> tuple[RunConfig, PluginHost]:
    """Load and validate ``recipe`` with ``overrides``, then load plugins (recipe ``plugins``
    plus ``--plugin``) and broadcast ``molt_configure``. Exits with code 2 on any error."""
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as e:
        _fail(str(e))
    specs = list(dict.fromkeys([*cfg.plugins, *plugin]))
    cfg = cfg.model_copy(update={"plugins": specs})
    try:
        host = load_plugins(specs)
    except PluginError as e:
        _fail(str(e))
    host.configure(cfg)
    return cfg, host


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="molt-sdk")
def main() -> None:
    """molt-sdk: token-exact agentic RL for language models."""
    if not sys.stderr.isatty():  # no tqdm bars (model loading, shard writing, datasets) in redirected logs
        import os

        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads it too
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


@main.command()
@click.argument("recipe", required=False)
@click.option("--plugin", "plugin", multiple=True, help="Load a plugin: dotted module path or path/to/file.py (repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a recipe field (repeatable); '~SECTION.KEY' removes one (its default applies).")
@click.option("--out", "out", default=None, help="Run directory (default runs/<recipe>-<time>).")
@click.option("--agent", "agent", default=None, help="Path to a .py file defining the Env or ChatAgent to train.")
@click.option("--ray-address", default=None,
              help="Join an existing Ray cluster instead of starting a local one (with Ray token authentication: "
                   "set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token, or RAY_AUTH_MODE=disabled).")
@click.option("--resume", "resume", default=None, type=click.Path(), help="Continue a killed run from its directory.")
@click.option("--local", is_flag=True,
              help="Run workers in this process without Ray (for debugging; launched rollouts run "
                   "concurrently while the driver waits, as on Ray).")
@click.option("--steps", type=click.IntRange(1), default=None,
              help="RL steps (run.steps); the SFT warm start still runs its sft.steps first.")
@click.option("--sft-steps", type=click.IntRange(0), default=None,
              help="SFT warm-start steps before RL (sft.steps; 0 skips the warm start).")
@click.option("--dry-run", is_flag=True,
              help="Validate the recipe and overrides, print the resolved recipe (TOML) and exit; starts nothing.")
def run(recipe: str | None, plugin: tuple[str, ...], overrides: tuple[str, ...], out: str | None,
        agent: str | None, ray_address: str | None, resume: str | None, local: bool, steps: int | None,
        sft_steps: int | None, dry_run: bool) -> None:
    """Train the agent of RECIPE (a TOML path or a shipped recipe name) with RL.

    A few steps to try a recipe: ``molt run quickstart --steps 3 --sft-steps 0``."""
    if resume:
        resume_dir = Path(resume)
        if not (resume_dir / "config.toml").is_file():
            _fail(f"--resume {resume}: no config.toml there; is it a run directory?")
        recipe = str(resume_dir / "config.toml")
        out = str(resume_dir)
    if recipe is None:
        _fail("give a RECIPE (see `molt recipes`) or --resume DIR")
    extra = list(overrides)  # the dedicated flags win over a --set of the same field
    if steps is not None:
        extra.append(f"run.steps={steps}")
    if sft_steps is not None:
        extra.append(f"sft.steps={sft_steps}")
    cfg, host = prepare(recipe, plugin, tuple(extra))
    if agent:  # --agent replaces the recipe's agent (and its options, which belong to that agent)
        cfg = cfg.model_copy(update={"agent": AgentSection(path=str(Path(agent).resolve()))})
    from molt_core import runtime

    try:
        if dry_run:  # the plugin checks of a run, no model file read, nothing started
            runtime.preflight(cfg, host, local, model=False)
            click.echo(cfg.to_toml(), nl=False)
            return
        runtime.main_job(cfg, host, out_dir=out, ray_address=ray_address, resume=resume is not None,
                         recipe_name=Path(recipe).stem, local=local)
    except KeyboardInterrupt as e:  # a Ctrl-C: say how to go on (click alone prints "Aborted!")
        from molt_core.train.checkpoint import latest_checkpoint

        where = getattr(e, "run_dir", None)
        if where is not None and latest_checkpoint(where) is not None:
            _fail(f"interrupted; continue from its last checkpoint with: molt run --resume {where}", code=130)
        _fail("interrupted before the run's first checkpoint (written after the SFT warm start): nothing to "
              "resume; run the command again", code=130)
    except Exception as e:
        if _is_ray_error(e):  # a Ray task or actor raised (a RayTaskError may also be a ValueError): exit 1,
            # its remote traceback without Ray's colour codes
            _fail(with_install_hint(f"a Ray worker failed: {e}", e), code=1)
        if isinstance(e, (ValueError, FileNotFoundError, ImportError, PluginError)):  # found before compute
            _fail(with_install_hint(_agent_error(str(e), agent), e))
        if isinstance(e, runtime.RunFailed):
            _fail(with_install_hint(str(e), e), code=1)
        raise


@main.command()
@click.argument("recipe")
@click.option("--plugin", "plugin", multiple=True, help="Load a plugin: dotted module path or path/to/file.py (repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a recipe field (repeatable); '~SECTION.KEY' removes one (its default applies).")
@click.option("--out", "out", default=None, help="Output directory (default runs/<recipe>-sft-<time>).")
@click.option("--agent", "agent", default=None, help="Path to a .py file defining the Env or ChatAgent whose tasks to learn.")
@click.option("--data", "data", default=None,
              help="Train on this JSONL of {prompt, completion} or {messages} rows instead of the agent's tasks (sft.data).")
@click.option("--steps", "steps", type=click.IntRange(1), default=None, help="SFT steps (shorthand for --set sft.steps=N).")
def sft(recipe: str, plugin: tuple[str, ...], overrides: tuple[str, ...], out: str | None, agent: str | None,
        data: str | None, steps: int | None) -> None:
    """Supervised warm start: fine-tune RECIPE's model on its agent's train tasks, or on the
    rows of --data / sft.data ([sft] table), and write OUT/model, a Hugging Face directory to
    use as model.path."""
    extra = list(overrides)
    if data is not None:
        extra.append(f"sft.data={data}")
    if steps is not None:
        extra.append(f"sft.steps={steps}")
    cfg, host = prepare(recipe, plugin, tuple(extra))
    if agent:  # --agent replaces the recipe's agent (and its options, which belong to that agent)
        cfg = cfg.model_copy(update={"agent": AgentSection(path=str(Path(agent).resolve()))})
    from molt_core.train.sft import run_sft

    try:
        path = run_sft(cfg, host, out_dir=out, recipe_name=Path(recipe).stem)
    except (ValueError, ImportError) as e:
        _fail(with_install_hint(_agent_error(str(e), agent), e))
    console.print(f"wrote {path} (use --set model.path={path})", highlight=False, soft_wrap=True)  # one line: copy-pastable


@main.command(name="eval")
@click.argument("recipe", required=False)
@click.option("--model", "model", required=True,
              help="A run's checkpoint (runs/X/checkpoints/step_N) or run directory, a Hugging Face model directory or "
                   "Hub id, builtin:<name>, or an OpenAI-compatible base URL (http://host:port/v1).")
@click.option("--n", "n", type=click.IntRange(1), default=None, help="Samples per task (default: the recipe's eval.k).")
@click.option("--k", "k", type=click.IntRange(1), default=None, help="Report pass@K too (default: --n).")
@click.option("--out", "out", default=None, type=click.Path(), help="JSON report file (default: RUN/eval/step_N.json for a "
              "run's checkpoint, else runs/eval-<time>.json).")
@click.option("--plugin", "plugin", multiple=True, help="Load a plugin: dotted module path or path/to/file.py (repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a recipe field (repeatable); '~SECTION.KEY' removes one (its default applies).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="API key for a URL --model (env OPENAI_API_KEY).")
@click.option("--served-model", default=None, help="Model name for a URL --model (default: the server's first model).")
def eval_(recipe: str | None, model: str, n: int | None, k: int | None, out: str | None, plugin: tuple[str, ...],
          overrides: tuple[str, ...], api_key: str | None, served_model: str | None) -> None:
    """Evaluate MODEL on RECIPE's held-out eval split: pass@1, pass@k and a JSON report.

    RECIPE defaults to the run's own config.toml when --model is a run's checkpoint; then, with
    the default --n, pass@1 equals the eval/pass@1 the run logged at that step."""
    from molt_core.cli.evaluate import default_report_path, evaluate, resolve_model, run_config_of, summary

    try:
        ref = resolve_model(model)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    recipe = recipe or (str(run_config_of(ref)) if run_config_of(ref) else None)
    if recipe is None:
        _fail("give a RECIPE (its eval split is evaluated); it defaults to the run's config.toml only for a run's checkpoint")
    cfg, host = prepare(recipe, plugin, overrides)
    out = out or str(default_report_path(ref))
    try:
        rep = evaluate(cfg, host, model, n=n, k=k, out=out, recipe=recipe, api_key=api_key, served_model=served_model)
    except (ValueError, FileNotFoundError, OSError) as e:
        _fail(str(e))
    console.print(summary(rep), highlight=False)
    click.echo(json.dumps({"report": out, **rep["metrics"]}))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--plugin", "plugin", multiple=True, help="Also load this plugin (module path or .py file).")
@click.option("--check", "check", is_flag=True, help="Run the conformance checks (molt_core.testing.conformance); exit 1 if one fails.")
@click.option("--verbose", "-v", "verbose", is_flag=True, help="The full table: hooks and every option of every name.")
def plugins(as_json: bool, plugin: tuple[str, ...], check: bool, verbose: bool) -> None:
    """List installed plugins: each registered name with a one-line summary, by kind, and the
    plugins providing them (sandbox backends with which one is active here; a name whose
    optional module is missing names the extra to install). --verbose adds hooks and options;
    --json gives everything. With --check, check every plugin instead."""
    try:
        host = load_plugins(plugin)
    except PluginError as e:
        _fail(str(e))
    if check:
        _check_plugins(host, as_json)
        return
    infos = host.plugin_infos()
    if as_json:
        rows = []
        for i in infos:
            d = i.as_dict()
            d["options"] = {k: {n: _options_schema(host.get(k, n)) for n in names} for k, names in i.registered.items()}
            desc = {k: {n: _describe(host.get(k, n)) for n in names if _describe(host.get(k, n)) is not None}
                    for k, names in i.registered.items()}
            d["descriptions"] = {k: v for k, v in desc.items() if v}
            miss = {k: {n: missing_requirements(host.get(k, n)) for n in names} for k, names in i.registered.items()}
            d["missing"] = {k: {n: m for n, m in v.items() if m} for k, v in miss.items() if any(v.values())}
            rows.append(d)
        click.echo(json.dumps(rows, indent=2))
        return
    if not verbose:
        import shutil

        from molt_core.cli.plugin_listing import compact_lines

        width = shutil.get_terminal_size((80, 24)).columns
        click.echo("\n".join(compact_lines(host, width)))
        _echo_active_sandbox(host, width)
        return
    table = Table(title="molt plugins")
    for col in ("plugin", "distribution", "version", "hooks", "registered (options)"):
        table.add_column(col, overflow="fold")  # --verbose shows every character: fold, never cut
    for i in infos:
        reg = "\n".join(
            f"{k}: " + "; ".join(_brief(n, host.get(k, n)) for n in v) for k, v in sorted(i.registered.items())
        )
        table.add_row(i.name, i.distribution, i.version, "\n".join(i.hooks), reg)
    Console().print(table)
    _echo_active_sandbox(host)


def _echo_active_sandbox(host: PluginHost, width: int | None = None) -> None:
    """Print ``sandbox backend: NAME DESCRIPTION`` for the backend active here, if any
    (wrapped to ``width`` columns when given)."""
    import textwrap

    for n in host.names("sandbox_backends"):
        desc = _describe(host.get("sandbox_backends", n)) or ""
        if desc.startswith("[active]"):
            line = f"sandbox backend: {n} {desc[len('[active] '):]}"
            click.echo("\n".join(textwrap.wrap(line, width, subsequent_indent="  ")) if width else line)


@main.group(name="plugin")
def plugin_group() -> None:
    """Plugin authoring: scaffold a new plugin package."""


@plugin_group.command(name="new")
@click.argument("kind", type=click.Choice(["reward", "env", "judge", "teacher", "replay"]))
@click.argument("name")
@click.option("--dir", "out_dir", default=None, type=click.Path(), help="Package directory (default ./molt-KIND-NAME).")
def plugin_new(kind: str, name: str, out_dir: str | None) -> None:
    """Write a ready plugin package registering NAME as a KIND: pyproject with the `molt`
    entry point, the plugin with typed Options, README, tests that pass as generated, a CI file."""
    from molt_core.testing.scaffold import render_plugin

    try:
        out = render_plugin(kind, name, out_dir=out_dir)
    except ValueError as e:
        _fail(str(e))
    click.echo(str(out))
    console.print(f"next: pip install -e '{out}[test]' && pytest {out} && molt plugins --check", highlight=False)


def _check_plugins(host: PluginHost, as_json: bool) -> None:
    """Print the conformance checks of every loaded plugin (one line each, or JSON) and exit
    with code 1 when one failed."""
    from molt_core.testing.conformance import check_host

    checks = check_host(host)
    failed = [c for c in checks if not c.ok]
    if as_json:
        click.echo(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        for c in checks:
            click.echo(str(c))
        n_skip = sum(c.status == "skip" for c in checks)
        click.echo(f"{len(checks) - len(failed) - n_skip} ok, {n_skip} skipped, {len(failed)} failed "
                   f"({len(host.infos)} plugins)")
    if failed:
        sys.exit(1)


def _describe(obj: object) -> str | None:
    """``obj.describe()`` for registered objects that describe themselves (sandbox backends:
    which one is active and what it isolates), else None; a failing ``describe`` is shown as such."""
    fn = getattr(obj, "describe", None)
    if not callable(fn) or isinstance(obj, type):
        return None
    try:
        return str(fn())
    except Exception as e:  # a plugin's describe() must not break the listing
        return f"describe() failed: {type(e).__name__}: {e}"


def _brief(name: str, obj: object) -> str:
    """One registered name in the table: ``name(options)``, or ``name: description``, then
    ``[unusable here: ... pip install 'molt-sdk[EXTRA]']`` per missing optional module."""
    desc = _describe(obj)
    row = f"{name}: {desc}" if desc is not None else f"{name}({_options_brief(obj)})"
    return row + "".join(escape(f" [unusable here: {m}]") for m in missing_requirements(obj))


def _options_schema(obj: object) -> dict | None:
    """JSON schema of a registered object's ``Options`` Pydantic model, or None if it has none."""
    from pydantic import BaseModel

    model = getattr(obj, "Options", None)
    if isinstance(model, type) and issubclass(model, BaseModel):
        return model.model_json_schema()
    return None


def _options_brief(obj: object) -> str:
    """``field: type = default, ...`` of a registered object's options (``*`` marks required)."""
    schema = _options_schema(obj)
    if not schema:
        return ""
    req = set(schema.get("required", []))
    parts = []
    for name, f in schema.get("properties", {}).items():
        t = f.get("type") or "|".join(x.get("type", "?") for x in f.get("anyOf", [])) or "?"
        d = json.dumps(f["default"]) if "default" in f else "..."
        parts.append(f"{name}*: {t}" if name in req else f"{name}: {t} = {d if len(d) <= 24 else d[:20] + '...'}")
    return ", ".join(parts)


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--step", type=int, default=None, help="Step to show (default: the latest step with samples).")
@click.option("-n", "n", type=click.IntRange(1), default=4, show_default=True, help="Rollouts to show.")
def show(run_dir: str, step: int | None, n: int) -> None:
    """Print sampled rollouts of RUN_DIR: turns (context and response text), reward, status
    and policy versions."""
    from molt_core.cli.show import show_run

    try:
        show_run(run_dir, step=step, n=n)
    except ValueError as e:
        _fail(str(e))


@main.command()
def recipes() -> None:
    """List the shipped recipes and the examples (recipes/examples/), each by the name
    `molt run` takes."""
    import tomllib

    table = Table(title=f"recipes ({RECIPES_DIR})")
    table.add_column("name")
    table.add_column("description")
    for name, p in list_recipes():
        head = []  # the recipe's first comment paragraph
        for ln in p.read_text().splitlines():
            if not ln.startswith("#") or (head and not ln[1:].strip()):
                break
            head.append(ln[1:].strip())
        first = escape(" ".join(h for h in head if h))
        try:
            tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            first = f"(invalid TOML: {e})"
        table.add_row(name, first)
    Console().print(table)


@main.command()
@click.option("--model", "model", required=True, help="A Hugging Face model directory or Hub id (org/name), or builtin:<name> (e.g. builtin:tiny-qwen3).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Loopback by default; any other address (e.g. 0.0.0.0) serves the network "
                   "and refuses to start without an explicit --admin-key (or MOLT_ADMIN_KEY).")
@click.option("--port", default=0, type=click.IntRange(0, 65535), help="Port (0: a free random port).")
@click.option("--admin-key", envvar="MOLT_ADMIN_KEY", default=None, help="Key for the /sessions admin routes (env MOLT_ADMIN_KEY; random when unset).")
@click.option("--max-batch-size", default=16, type=click.IntRange(1), help="Sequences the engine decodes together.")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "bfloat16", "float16"]), help="Parameter dtype.")
@click.option("--enable-thinking/--disable-thinking", default=None, help="Set the chat template's enable_thinking for every session.")
@click.option("--num-engines", default=1, type=click.IntRange(1), help="Engines in-process, each with its own server, behind one request router (session affinity, least-loaded placement).")
@click.option("--prefix-cache-mb", default=256.0, type=click.FloatRange(0), show_default=True,
              help="MiB of finished generations' keys/values each engine keeps for a later prompt with the same prefix (0: off); bounds the server's memory.")
@click.option("--tool-parser", default=None, help="Tool-call parser of the model family: hermes (default; Qwen), qwen3_coder, llama3_json, mistral, or auto (the tokenizer's response schema, else the family its chat template writes).")
def serve(model: str, host: str, port: int, admin_key: str | None, max_batch_size: int, dtype: str,
          enable_thinking: bool | None, num_engines: int, prefix_cache_mb: float, tool_parser: str | None) -> None:
    """Serve MODEL (on 127.0.0.1 unless --host says otherwise) for any OpenAI or Anthropic SDK,
    recording every session token-exactly.

    Prints one JSON line on stdout -- base_url, admin_key and a ready-made session
    (openai_base_url, anthropic_base_url, api_key) -- then serves until interrupted. Exits with
    code 2 when --host is not a loopback address and no admin key was given, for an unknown
    --tool-parser, a model that cannot load, or a port that cannot be bound.
    """
    import time

    from molt_core.engines.transformers_engine import TransformersEngine
    from molt_core.server import start_server

    if not _is_loopback(host) and not admin_key:
        _fail(f"--host {host} listens beyond loopback: every session keeps its own key, but the admin routes need "
              "a key you chose. Pass --admin-key (or set MOLT_ADMIN_KEY), or keep the default --host 127.0.0.1")
    if tool_parser is not None:
        try:
            parsers = shared_host().names("tool_parsers")
        except PluginError as e:
            _fail(str(e))
        if not parsers:
            _fail(f"--tool-parser {tool_parser}: no tool-parser plugin is loaded (molt_register_tool_parsers; first "
                  "party: molt_plugins.parsers, entry point molt_parsers: unset "
                  "MOLT_DISABLE_PLUGINS=molt_parsers, or reinstall molt-sdk from its checkout)")
        if tool_parser not in parsers:
            _fail(f"--tool-parser {tool_parser}: unknown; known: {', '.join(parsers)}")

    try:
        engines = [TransformersEngine(model, max_batch_size=max_batch_size, dtype=dtype, prefix_cache_mb=prefix_cache_mb)
                   for _ in range(num_engines)]
    except (ValueError, FileNotFoundError, OSError) as e:
        _fail(f"--model {model}: {e}")
    engine = engines[0]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    backends = []  # with --num-engines N > 1: N servers on random ports behind the router
    try:
        if num_engines == 1:
            handle = start_server(engine, engine.tokenizer, admin_key=admin_key, port=port, host=host, model_name=model,
                                  chat_template_kwargs=kwargs, tool_parser=tool_parser)
        else:
            from molt_core.cli.router import start_router

            backends = [start_server(e, e.tokenizer, model_name=model, chat_template_kwargs=kwargs, tool_parser=tool_parser)
                        for e in engines]  # the engines' own servers stay on loopback; only the router faces --host
            handle = start_router(backends, admin_key=admin_key, port=port, host=host)
    except OSError as e:
        _fail(f"--port {port}: cannot listen on {host}:{port} ({e})")
    info = handle.create_session()
    click.echo(json.dumps({"base_url": handle.base_url, "admin_key": handle.admin_key, "model": model,
                           "session": info.model_dump(),
                           **({"engines": [b.base_url for b in backends]} if backends else {})}), nl=True)
    sys.stdout.flush()
    console.print(f"[bold]molt serve[/] {model} at {handle.base_url}"
                  + (f" (request router over {num_engines} engines: {', '.join(b.base_url for b in backends)})" if backends else "")
                  + "\n"
                  f"  admin key: {handle.admin_key}   (POST /sessions, GET /sessions/<id>/trajectory)\n"
                  f"  session {info.session_id}: OpenAI base_url={info.openai_base_url}  "
                  f"Anthropic base_url={info.anthropic_base_url}  api_key={info.api_key}\n"
                  f"  Ctrl-C to stop.", highlight=False)
    import signal

    def _stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # stop on SIGINT and SIGTERM even when started with them ignored (a background job of a
    # non-interactive shell, or a parent that ignores SIGINT, passes SIG_IGN on)
    import threading

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _stop)
    try:
        while handle.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
        handle.stop()
        for b in backends:
            b.stop()
        for e in engines:
            close = getattr(e, "close", None)
            if close:
                close()

