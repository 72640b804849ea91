"""The molt-sdk keys and commands the docs show are real: the mapping tables of
docs/coming_from_trl.md and docs/coming_from_verl.md, and every ``molt run ... --set k=v``
command of those pages, docs/tutorial.md and README.md.

Tables: the column headed "molt-sdk `--set` key" holds backticked keys (``trainer.lr``,
``algo.advantage=dr_grpo``, ``rewards.<name>.weight``) or "—" where there is no equivalent. A key
resolves when every dotted part names a field of the section it is in (section aliases such as
``async`` included); under ``rewards`` the part after the reward's name must be one of
:data:`molt_core.rewards.RESERVED_KEYS` or an option of that reward's ``Options`` (a concrete,
registered name); under an ``options`` table (``agent.options.path``) an option of some registered
plugin of that kind. A ``key=value`` cell is applied as ``--set key=value`` to the defaults and
validated by the recipe loader, and registered names are looked up (``algo.advantage``, ``algo.loss``).

Commands: each is parsed by the ``molt run`` click command itself, then loaded through
:func:`molt_core.cli.recipe.load_config` with its ``--set`` / ``--steps`` / ``--sft-steps`` as
``molt run`` does, then checked as ``molt run`` checks before compute: the estimator and loss
(:func:`molt_core.train.algorithms.resolve_algorithms`) and every ``[rewards.NAME]`` table
(:func:`molt_core.runtime.check_rewards`; a name that a ``--plugin`` file of the page registers
may only hold reserved keys, checked by :func:`molt_core.rewards.reward_spec`).
"""

from __future__ import annotations

import re
import shlex
import types
import typing
from pathlib import Path
from typing import Any

import click
import pytest
from pydantic import BaseModel

from molt_core.cli import run as run_command
from molt_core.cli.recipe import ConfigError, apply_overrides, load_config, validate_config
from molt_core.config import RunConfig
from molt_core.plugins import load_plugins
from molt_core.rewards import RESERVED_KEYS, reward_spec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ["coming_from_trl.md", "coming_from_verl.md"]
COMMAND_PAGES = {"docs/coming_from_trl.md": 1, "docs/coming_from_verl.md": 2, "docs/tutorial.md": 3, "README.md": 7}
KEY_COLUMN = "molt-sdk `--set` key"
OPTION_KINDS = {"agent": "envs", "engine": "engines", "teacher": "teachers"}  # SECTION.options.KEY


@pytest.fixture(scope="module")
def host():
    return load_plugins()


def _models_in(ann: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (``LoraSection | None`` -> [LoraSection])."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(ann) for m in _models_in(a)]
    return []


def _is_dict(ann: Any) -> bool:
    """True for ``dict[...]`` (or an optional one)."""
    if typing.get_origin(ann) is dict or ann is dict:
        return True
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return any(_is_dict(a) for a in typing.get_args(ann))
    return False


def _option_names(obj: Any) -> set[str]:
    """Field names and aliases of a registered object's ``Options`` model (empty without one)."""
    model = getattr(obj, "Options", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return set()
    return {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}


def _placeholder(name: str) -> bool:
    return name.startswith("<") or name.isupper()


def reward_subkey(name: str, sub: str, host: Any) -> str | None:
    """None when ``sub`` may stand in ``[rewards.<name>]``: a reserved key, or (``name`` concrete and
    registered) an option of that reward; else the reason."""
    if not _placeholder(name) and name not in host.names("rewards"):
        return f"rewards.{name}: not a registered reward (registered: {', '.join(host.names('rewards'))})"
    if sub in RESERVED_KEYS:
        return None
    if _placeholder(name):
        return f"rewards.{name}.{sub}: not a reserved reward key ({', '.join(RESERVED_KEYS)})"
    if sub in _option_names(host.get("rewards", name)):
        return None
    return (f"rewards.{name}.{sub}: neither a reserved reward key ({', '.join(RESERVED_KEYS)}) nor an option "
            f"of reward {name!r} ({', '.join(sorted(_option_names(host.get('rewards', name)))) or 'none'})")


def resolve(key: str, host: Any) -> str | None:
    """None when ``key`` (``section.field[.sub...]``, or a top-level field) names a RunConfig
    field (and, inside a plugin table, a reserved key or plugin option); else the reason it does not."""
    model: type[BaseModel] = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = next((f for n, f in model.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            where = ".".join(parts[:i]) or "RunConfig"
            return f"{key}: {where} has no field {part!r}"
        rest = parts[i + 1:]
        if not rest:
            return None
        if _is_dict(field.annotation):
            here = ".".join(parts[:i + 1])
            if here == "rewards":
                if len(rest) > 2:
                    return f"{key}: a reward table's key has no sub-key {rest[2]!r}"
                return reward_subkey(rest[0], rest[1], host) if len(rest) == 2 else None
            kind = OPTION_KINDS.get(parts[0]) if here.endswith(".options") and i == 1 else None
            if kind is not None:
                known = set().union(*(_option_names(host.get(kind, n)) for n in host.names(kind)))
                if rest[0] not in known:
                    return f"{key}: {rest[0]!r} is an option of no registered {kind[:-1]}"
            return None  # a free-form table (chat_template_kwargs, resources, a logger's options)
        models = _models_in(field.annotation)
        if not models:
            return f"{key}: {'.'.join(parts[:i + 1])} is a {field.annotation} option, it has no sub-key {rest[0]!r}"
        model = models[0]
    return None


def check_names(cfg: RunConfig, host: Any, plugin_files: tuple[str, ...] = ()) -> list[str]:
    """What ``molt run`` refuses before compute about registered names: the estimator and loss, and
    every ``[rewards.NAME]`` table. A reward name that is not registered is accepted only when a
    ``--plugin`` file (written by the page, not loaded here) may register it, and then holds only
    reserved keys with valid values."""
    from molt_core.runtime import check_rewards
    from molt_core.train.algorithms import resolve_algorithms

    out = []
    try:
        resolve_algorithms(cfg, host)
    except ConfigError as e:
        out.append(str(e))
    known = {n: t for n, t in cfg.rewards.items() if n in host.names("rewards")}
    try:  # the runtime's own check: reserved values, and the options against the reward's Options
        check_rewards(cfg.model_copy(update={"rewards": known}), host)
        refused = ""
    except ValueError as e:
        refused = str(e)
        out.append(refused)
    for name, table in cfg.rewards.items():
        if name in known:  # a key the runtime let through (an Options that ignores extras) is still a typo
            out += [why for sub in table
                    if (why := reward_subkey(name, sub, host)) and f"rewards.{name}.{sub}" not in refused]
            continue
        if not plugin_files:
            out.append(f"rewards.{name}: not a registered reward and no --plugin file to register it")
            continue
        out += [f"rewards.{name}.{sub}: not a reserved reward key ({', '.join(RESERVED_KEYS)}) (reward from a "
                f"--plugin file)" for sub in table if sub not in RESERVED_KEYS]
        try:
            reward_spec(name, _stub_reward, table)
        except ValueError as e:
            out.append(str(e))
    return out


def _stub_reward(response: str, task: dict) -> float:
    """Stands in for a reward a page's own plugin file defines (module level: picklable)."""
    return 0.0


# ---------------------------------------------------------------- tables


def keys_in_tables(text: str) -> list[str]:
    """The backticked keys (``key`` or ``key=value``) in the KEY_COLUMN column of every table of a
    Markdown page; "—" cells hold none.

    Raises:
        ValueError: a cell of that column holding neither a key nor "—".
    """
    keys: list[str] = []
    col: int | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            col = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if KEY_COLUMN in cells:
            col = cells.index(KEY_COLUMN)
            continue
        if col is None or set(line.replace("|", "").strip()) <= {"-", " "}:
            continue
        cell = cells[col]
        found = re.findall(r"`([^`]+)`", cell)
        if not found:
            if cell != "—":
                raise ValueError(f"a key cell holds no backticked key and is not '—': {line!r}")
            continue
        keys += [k.strip() for k in found]
    return keys


def check_table_key(item: str, host: Any) -> str | None:
    """None when a table's ``key`` or ``key=value`` is real: the key resolves (:func:`resolve`) and
    a value is accepted by the recipe loader on the defaults, with registered names; else why not."""
    key = item.split("=", 1)[0].strip()
    why = resolve(key.removeprefix("~"), host)
    if why or "=" not in item or any(_placeholder(p) for p in key.split(".")):
        return why  # a key with a placeholder (rewards.<name>=...) has no value to try
    try:
        cfg = validate_config(apply_overrides({}, [item]), source=f"--set {item}")
    except ConfigError as e:
        return str(e)
    bad = check_names(cfg, host)
    return "; ".join(bad) or None


@pytest.mark.parametrize("page", PAGES)
def test_every_mapped_key_exists_in_runconfig(page, host):
    keys = keys_in_tables((DOCS / page).read_text())
    assert len(keys) >= 40, f"{page}: only {len(keys)} keys parsed; the table header must be '{KEY_COLUMN}'"
    bad = [r for k in keys if (r := check_table_key(k, host)) is not None]
    assert bad == [], f"{page} maps to keys RunConfig does not define:\n" + "\n".join(bad)


def test_a_misspelt_or_too_deep_key_is_flagged(host):
    page = (f"| theirs | {KEY_COLUMN} | notes |\n|---|---|---|\n"
            "| `lr` | `trainer.lrr` | misspelt field |\n"
            "| `n` | `rollout.n_samples_per_prompt=8` | fine |\n"
            "| `x` | `trainer.lr.value` | a float has no sub-key |\n"
            "| `y` | `sampling.temperature` | no such section |\n"
            "| `w` | `rewards.<name>.weight`, `async.max_staleness`, `trainer.lora.r` | fine |\n"
            "| `z` | — | no equivalent |\n")
    keys = keys_in_tables(page)
    assert keys == ["trainer.lrr", "rollout.n_samples_per_prompt=8", "trainer.lr.value", "sampling.temperature",
                    "rewards.<name>.weight", "async.max_staleness", "trainer.lora.r"]
    assert [check_table_key(k, host) for k in keys] == [
        "trainer.lrr: trainer has no field 'lrr'",
        None,
        "trainer.lr.value: trainer.lr is a <class 'float'> option, it has no sub-key 'value'",
        "sampling.temperature: RunConfig has no field 'sampling'",
        None, None, None,
    ]


def test_a_bad_value_name_or_reward_key_in_a_table_is_flagged(host):
    assert check_table_key("trainer.lr_schedule=constant", host) is None
    assert "trainer.lr_schedule: Input should be 'constant', 'linear' or 'cosine'" in check_table_key(
        "trainer.lr_schedule=constnt", host)
    assert check_table_key("algo.advantage=dr_grpo", host) is None
    assert check_table_key("algo.advantage=dr_grpoo", host).startswith("algo.advantage = 'dr_grpoo': ")
    assert check_table_key("algo.loss=cispoo", host).startswith("algo.loss = 'cispoo': ")
    assert check_table_key("rewards.<name>.weight", host) is None
    assert check_table_key("rewards.<name>.isolation", host) is None
    assert check_table_key("rewards.<name>.wieght", host) == (
        "rewards.<name>.wieght: not a reserved reward key (weight, timeout_s, isolation)")
    assert check_table_key("rewards.exact_match.strip", host) is None  # the reward's own option
    assert check_table_key("rewards.exact_match.strp", host).startswith(
        "rewards.exact_match.strp: neither a reserved reward key (weight, timeout_s, isolation) nor an option of "
        "reward 'exact_match' (")
    assert check_table_key("rewards.exact_mach.weight", host).startswith("rewards.exact_mach: not a registered reward")
    assert check_table_key("agent.options.path", host) is None  # the dataset env's
    assert check_table_key("agent.options.pth", host) == "agent.options.pth: 'pth' is an option of no registered env"


def test_a_key_cell_without_a_key_is_refused():
    with pytest.raises(ValueError, match="holds no backticked key"):
        keys_in_tables(f"| theirs | {KEY_COLUMN} |\n|---|---|\n| `beta` | kl_coef |\n")


@pytest.mark.parametrize("page", PAGES)
def test_a_wrong_key_written_into_the_real_page_is_flagged(page, host):
    text = (DOCS / page).read_text()
    for good, bad, why in [
        ("`trainer.lr`", "`trainer.learning_rate`", "trainer.learning_rate: trainer has no field 'learning_rate'"),
        ("`algo.advantage=dr_grpo`", "`algo.advantage=dr_grpoo`", "algo.advantage = 'dr_grpoo': "),
    ]:
        assert good in text
        keys = keys_in_tables(text.replace(good, bad, 1))
        found = [r for k in keys if (r := check_table_key(k, host)) is not None]
        assert len(found) == 1 and found[0].startswith(why), found


# ---------------------------------------------------------------- commands


def molt_run_commands(text: str) -> list[str]:
    """Every ``molt run ...`` command of a Markdown page: lines of fenced code blocks (``\\``
    continuations joined; one ``&&`` chain part each) and inline code spans, without the
    ``molt run`` prefix. Commands on a run directory (``--resume``), on a placeholder recipe
    (``RECIPE``) and progress output are left out."""
    found: list[str] = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            found += [p.strip() for p in line.split("&&") if p.strip().startswith("molt run ")]
    prose = re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.S | re.M)
    found += [c.strip() for c in re.findall(r"`(molt run [^`]+)`", prose)]
    cmds = [c[len("molt run "):] for c in found if "--resume" not in c]
    return [c for c in cmds if re.match(r"[a-z./-]", c)]  # not output (`molt run ━━ 3/3`), not `RECIPE ...`


def check_command(cmd: str, host: Any) -> list[str]:
    """Problems ``molt run CMD`` would report before any compute (empty when none)."""
    try:
        ctx = run_command.make_context("run", shlex.split(cmd))
    except click.ClickException as e:
        return [f"molt run {cmd}: {e.format_message()}"]
    p = ctx.params
    extra = list(p["overrides"])
    if p["steps"] is not None:
        extra.append(f"run.steps={p['steps']}")
    if p["sft_steps"] is not None:
        extra.append(f"sft.steps={p['sft_steps']}")
    try:
        cfg = load_config(p["recipe"], extra)
    except ConfigError as e:
        return [f"molt run {cmd}: {e}"]
    return [f"molt run {cmd}: {x}" for x in check_names(cfg, host, p["plugin"])]


@pytest.mark.parametrize("page", list(COMMAND_PAGES))
def test_every_molt_run_command_loads(page, host):
    cmds = molt_run_commands((ROOT / page).read_text())
    assert len(cmds) == COMMAND_PAGES[page], cmds
    assert [x for c in cmds for x in check_command(c, host)] == []


def test_the_same_grpo_run_blocks_are_parsed():
    trl = molt_run_commands((DOCS / "coming_from_trl.md").read_text())
    assert trl[0].startswith("quickstart --set model.path=runs/warm/model --set sft.steps=0 ")
    assert "--set trainer.lr_schedule=constant" in trl[0] and trl[0].endswith("--steps 300")
    verl = molt_run_commands((DOCS / "coming_from_verl.md").read_text())
    assert verl[1] == "examples/dataset --set agent.options.path=rows.jsonl"  # a table cell's
    assert "--set trainer.micro_batch_size=64" in verl[0] and verl[0].endswith("--steps 300")


@pytest.mark.parametrize("good, bad, why", [
    ("--set trainer.lr_schedule=constant", "--set trainer.lr_scheduel=constant",
     "trainer.lr_scheduel: unknown key (did you mean 'lr_schedule'?)"),
    ("--set trainer.lr_schedule=constant", "--set trainer.lr_schedule=constnt",
     "trainer.lr_schedule: Input should be 'constant', 'linear' or 'cosine'"),
    ("--set algo.advantage=grpo", "--set algo.advantage=dr_grpoo", "algo.advantage = 'dr_grpoo': "),
    ("--set algo.kl_coef=0", "--set algo.loss=ppoo", "algo.loss = 'ppoo': "),
    ("--set rollout.temperature=1.0", "--set rollout.temperature=hot", "rollout.temperature: Input should be"),
    ("--steps 300", "--stepz 300", "No such option '--stepz'"),
    ("--set algo.kl_coef=0", "--set rewards.exact_match.wieght=2",
     "invalid reward options: rewards.exact_match.wieght: Extra inputs are not permitted"),
    ("--set algo.kl_coef=0", "--set rewards.exact_match.weight=heavy",
     "rewards.exact_match.weight = 'heavy': must be a finite number"),
    ("--set algo.kl_coef=0", "--set rewards.exact_mach.weight=1", "rewards.exact_mach: not a registered reward"),
])
def test_a_fault_in_the_trl_command_is_flagged(host, good, bad, why):
    cmd = molt_run_commands((DOCS / "coming_from_trl.md").read_text())[0]
    assert good in cmd and check_command(cmd, host) == []
    found = check_command(cmd.replace(good, bad, 1), host)
    assert len(found) == 1 and why in found[0], found


def test_a_fault_in_a_tutorial_reward_table_is_flagged(host):
    cmd = molt_run_commands((DOCS / "tutorial.md").read_text())[0]
    assert "--plugin my_reward.py --set rewards.close.weight=0.5" in cmd and check_command(cmd, host) == []
    found = check_command(cmd.replace("rewards.close.weight", "rewards.close.wieght"), host)
    assert found == [f"molt run {cmd.replace('close.weight', 'close.wieght')}: rewards.close.wieght: not a "
                     f"reserved reward key (weight, timeout_s, isolation) (reward from a --plugin file)"]
    found = check_command(cmd.replace("weight=0.5", "isolation=fork"), host)
    assert len(found) == 1 and "rewards.close.isolation = 'fork': must be 'thread' or 'process'" in found[0]
    found = check_command(cmd.replace("--plugin my_reward.py ", ""), host)
    assert len(found) == 1 and "rewards.close: not a registered reward and no --plugin file" in found[0]
