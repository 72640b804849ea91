"""Recipes for the CLI: find a shipped or local TOML recipe, apply ``--set`` overrides, and
validate it into a :class:`~molt_core.config.RunConfig` with every bad field named.

Recipes are TOML files with one table per section of :class:`~molt_core.config.RunConfig`.
Validation is strict: an unknown key, or a value of the wrong type (a string where an int
belongs, say), is an error, and *every* bad field is reported at once with its dotted path and
the expected type (:class:`~molt_core.config.ConfigError`). ``--set section.key=value`` values are
parsed as TOML values (ints, floats, bools, lists, quoted strings); anything that is not a TOML
value is taken as a bare string (``--set model.path=runs/x``), and a field declared a string
takes the raw text whatever it looks like (``--set run.name=2024-01-01``, ``1e-3``, ``true``,
``nan``). ``--set '~section.key'`` removes an option the recipe sets, so it takes its default.
"""

from __future__ import annotations

import datetime
import difflib
import importlib.resources
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from molt_core.config import ConfigError, RunConfig

__all__ = ["load_config", "validate_config", "apply_overrides", "parse_override", "RECIPES_DIR", "find_recipe",
           "recipes_dir", "list_recipes"]


def recipes_dir(package_dir: Path | None = None) -> Path:
    """The directory of the shipped recipes (``*.toml``, ``examples/*.toml``, ``agents/*.py``).

    The repo keeps them at its top, ``recipes/``; the wheel carries that folder inside the
    package as ``molt_core/recipes`` (``[tool.hatch.build.targets.wheel.force-include]`` in
    pyproject.toml). So: the packaged copy when present (a wheel install), else the checkout's
    ``<repo>/recipes`` (an editable install or ``PYTHONPATH``; a repo is recognised by its
    ``pyproject.toml``), else the packaged path, which does not exist (errors then name it).
    The working directory plays no part.

    Args:
        package_dir: the ``molt_core`` package directory; None is the imported package's
            (``importlib.resources.files("molt_core")``). Tests pass a fake one.
    """
    pkg = Path(str(importlib.resources.files("molt_core"))) if package_dir is None else Path(package_dir)
    packaged = pkg / "recipes"
    if packaged.is_dir():
        return packaged
    checkout = pkg.parent / "recipes"
    if checkout.is_dir() and (pkg.parent / "pyproject.toml").is_file():
        return checkout
    return packaged


RECIPES_DIR = recipes_dir()


def list_recipes(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(name, path)`` of every shipped recipe: ``root/*.toml`` named by stem, then
    ``root/examples/*.toml`` named ``examples/<stem>`` (each name is what ``molt run`` takes).

    Args:
        root: the recipes directory; None is :data:`RECIPES_DIR`.
    """
    root = RECIPES_DIR if root is None else root
    top = [(p.stem, p) for p in sorted(root.glob("*.toml"))]
    return top + [(f"examples/{p.stem}", p) for p in sorted((root / "examples").glob("*.toml"))]


def _type_name(model: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The annotation of the field at ``loc`` (a pydantic error location), as text."""
    cur: Any = model
    ann: Any = None
    for part in loc:
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            fields = cur.model_fields
            key = part
            if key not in fields:
                key = next((k for k, f in fields.items() if f.alias == part), None)
                if key is None:
                    return None
            ann = fields[key].annotation
            cur = ann
        else:
            return None
    if ann is None:
        return None
    return getattr(ann, "__name__", None) if isinstance(ann, type) else str(ann).replace("typing.", "")


def _suggest(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(cur, type) and issubclass(cur, BaseModel):
            f = cur.model_fields.get(part) or next((f for f in cur.model_fields.values() if f.alias == part), None)
            cur = f.annotation if f else None
        else:
            return ""
    if not (isinstance(cur, type) and issubclass(cur, BaseModel)):
        return ""
    names = [f.alias or k for k, f in cur.model_fields.items()]
    key = str(loc[-1])
    close = difflib.get_close_matches(key, names, n=1)
    exact = _field_paths(key, fuzzy=False)  # a field of that very name in another section wins
    if close and not exact:
        return f" (did you mean {close[0]!r}?)"
    elsewhere = exact or _field_paths(key)
    if elsewhere:
        return f" (did you mean {' or '.join(repr(p) for p in elsewhere)}?)"
    return f" (known keys: {', '.join(names)})"


def _field_paths(key: str, fuzzy: bool = True) -> list[str]:
    """Dotted paths ``section.field`` of every :class:`RunConfig` section field named ``key``
    (``steps`` -> ``run.steps``, ``sft.steps``), else (when ``fuzzy``) of the fields whose name
    is closest to it (``stesp`` -> the same); ``[]`` when none is."""
    paths: dict[str, list[str]] = {}
    for sec, f in RunConfig.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            for k, sf in f.annotation.model_fields.items():
                paths.setdefault(sf.alias or k, []).append(f"{f.alias or sec}.{sf.alias or k}")
    close = [key] if key in paths else difflib.get_close_matches(key, list(paths), n=1) if fuzzy else []
    return paths[close[0]] if close else []


def validate_config(data: dict[str, Any], source: str = "recipe") -> RunConfig:
    """Validate a recipe dict into a :class:`RunConfig`.

    Raises:
        ConfigError: listing every bad field as ``path: problem (expected TYPE)``.
    """
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        errors: list[tuple[str, str]] = []
        for err in e.errors():
            loc = tuple(err["loc"])
            path = ".".join(str(p) for p in loc)
            if err["type"] == "extra_forbidden":
                msg = f"unknown key{_suggest(RunConfig, loc)}"
            elif err["type"] == "value_error":  # a cross-field rule: its message says it all
                msg = str(err["msg"]).removeprefix("Value error, ")
                path = path or "(whole recipe)"
            else:
                expected = _type_name(RunConfig, loc)
                got = err.get("input")
                msg = f"{err['msg']}"
                if expected:
                    msg += f" (expected {expected}, got {type(got).__name__} {got!r})"
            errors.append((path, msg))
        lines = "\n".join(f"  {p}: {m}" for p, m in errors)
        raise ConfigError(f"{source} has {len(errors)} invalid field(s):\n{lines}", errors) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """Parse ``section.key=value`` into (``["section", "key"]``, typed value).

    The value is parsed as a TOML value (``8`` -> int, ``3e-4`` -> float, ``true`` -> bool,
    ``[1, 2]`` -> list, ``"x"`` -> str); otherwise it is the bare string. (``~section.key``,
    which removes an option, is handled by :func:`apply_overrides`.)

    Raises:
        ConfigError: no ``=``, an empty key, or an empty value (``key=""`` is the empty string).
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item!r}: empty key")
    raw = raw.strip()
    if not raw:
        raise ConfigError(f"--set {item!r}: empty value; for an empty string write {key}='\"\"', to put the "
                          f"option back to its default write '~{key}'")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if isinstance(value, (datetime.date, datetime.time)):  # no option is a TOML date: 2024-01-01 is a name
        value = raw
    return key.split("."), value


def _declared(path: list[str]) -> Any:
    """The annotation of the :class:`RunConfig` field at ``path`` (section aliases such as
    ``async`` included), or None when the path is not a declared field."""
    cls: Any = RunConfig
    ann: Any = None
    for p in path:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        f = next((f for n, f in cls.model_fields.items() if p in (n, f.alias)), None)
        if f is None:
            return None
        ann = cls = f.annotation
    return ann


def _wants_str(ann: Any) -> bool:
    """True when a field of annotation ``ann`` holds a string: ``str``, ``str | None``, or a
    ``Literal`` of strings."""
    import types
    import typing

    if ann is str:
        return True
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return all(isinstance(a, str) for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return len(rest) == 1 and _wants_str(rest[0])
    return False


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``section.key=value`` override applied.

    A value is coerced to the declared type of its field: a string field takes the raw text
    (so ``run.name=2024-01-01``, ``1e-3``, ``true`` or ``nan`` stay the strings typed); other
    fields take the TOML value (:func:`parse_override`). ``~section.key`` (Hydra's syntax, as in
    verl) removes the key, so the option takes its default.

    Raises:
        ConfigError: an override is malformed, descends into a non-table value, or removes a
            key that is not set.
    """
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if item.strip().startswith("~"):  # Hydra's deletion syntax (verl's CLI): back to the default
            _unset(out, item)
            continue
        path, value = parse_override(item)
        names = out.get("loggers")
        if path[0] == "loggers" and len(path) > 1 and isinstance(names, list) and all(isinstance(n, str) for n in names):
            out["loggers"] = {n: {} for n in names}  # --set loggers.wandb.mode=... on the list form
        if not isinstance(value, str) and _wants_str(_declared(path)):
            value = item.split("=", 1)[1].strip()
        cur = out
        for p in path[:-1]:
            nxt = cur.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is not a table")
            cur = nxt
        cur[path[-1]] = value
    return out


def _unset(data: dict[str, Any], item: str) -> None:
    """Apply ``--set '~section.key'``: remove that key from ``data`` (in place), so the option
    takes its default (e.g. ``~trainer.lora`` turns a recipe's LoRA off, ``~model.gguf_file``
    clears a path).

    Raises:
        ConfigError: a value after the key, or the key is not in the recipe.
    """
    key = item.strip()[1:].strip()
    if "=" in key or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected '~section.key' (no value) to remove an option")
    path = key.split(".")
    cur: Any = data
    for p in path[:-1]:
        cur = cur.get(p) if isinstance(cur, dict) else None
    if not isinstance(cur, dict) or path[-1] not in cur:
        if _declared(path) is None and not _plugin_options(path):  # a typo, not an option left at its default
            raise ConfigError(f"--set {item!r}: {key!r} is not an option{_closest_option(path)}")
        raise ConfigError(f"--set {item!r}: {key!r} is not set in the recipe (or an earlier --set), so there is "
                          f"nothing to remove; it already has its default")
    del cur[path[-1]]


def _plugin_options(path: list[str]) -> bool:
    """Whether ``path`` lies inside a free-form table (a plugin's ``options``, ``loggers``),
    whose keys no schema here declares."""
    return any(p in ("options", "loggers") for p in path[:-1]) or path[0] == "loggers"


def _closest_option(path: list[str]) -> str:
    """`` (did you mean 'a.b'?)`` for the declared option closest to ``path``'s last part among
    its parent's fields; ``""`` when none is close or the parent is not a declared table."""
    cls: Any = RunConfig if len(path) == 1 else _declared(path[:-1])
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        return ""
    names = [f.alias or n for n, f in cls.model_fields.items()]
    close = difflib.get_close_matches(path[-1], names, n=1)
    return f" (did you mean {'.'.join(path[:-1] + close[:1])!r}?)" if close else ""


def find_recipe(recipe: str | Path) -> Path:
    """Resolve ``recipe``: a path to a TOML file, or the name of a shipped recipe
    (``quickstart``, ``examples/regex``; see :func:`list_recipes`), found in :data:`RECIPES_DIR`.

    Raises:
        ConfigError: neither exists; lists the shipped recipes and where they were looked for.
    """
    p = Path(recipe)
    if p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{recipe}.toml", RECIPES_DIR / str(recipe)):
        if cand.is_file():
            return cand
    shipped = ", ".join(name for name, _ in list_recipes()) or f"none found in {RECIPES_DIR}"
    raise ConfigError(f"recipe {str(recipe)!r} not found: not a file, and not a shipped recipe"
                      f"{_closest_recipe(str(recipe))} ({shipped})")


def _closest_recipe(name: str) -> str:
    """`` (did you mean 'X'?)`` naming the shipped recipe closest to ``name``: a top-level one
    (``quickstrt`` -> ``quickstart``) or an example (``wandb`` -> ``examples/wandb``); ``""`` when
    none is close."""
    names: dict[str, str] = {}
    for p in sorted(RECIPES_DIR.glob("examples/*.toml")):
        names[p.stem] = names[f"examples/{p.stem}"] = f"examples/{p.stem}"
    names.update({p.stem: p.stem for p in RECIPES_DIR.glob("*.toml")})  # a top-level recipe wins a tie
    close = difflib.get_close_matches(name.removesuffix(".toml"), list(names), n=1)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


def load_config(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a TOML recipe (path or shipped name), apply overrides, validate.

    Raises:
        ConfigError: file missing, TOML syntax error, or invalid fields (all listed).
    """
    path = find_recipe(recipe)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    data = apply_overrides(data, overrides)
    cfg = validate_config(data, source=f"{path} with --set overrides" if overrides else str(path))
    if cfg.agent.path and not Path(cfg.agent.path).is_absolute() and not Path(cfg.agent.path).exists():
        beside = path.parent / cfg.agent.path  # a recipe names its agent file relative to itself
        if beside.exists():
            cfg = cfg.model_copy(update={"agent": cfg.agent.model_copy(update={"path": str(beside)})})
    return cfg
