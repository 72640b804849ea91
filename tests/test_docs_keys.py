"""The molt-sdk keys that docs/coming_from_trl.md and docs/coming_from_verl.md map other
frameworks' options to all exist in :class:`molt_core.config.RunConfig`.

Each page has tables whose second column, headed "molt-sdk `--set` key", holds backticked keys
(``trainer.lr``, ``algo.advantage=dr_grpo``, ``rewards.<name>.weight``) or "—" where there is
no equivalent. A key resolves when every dotted part names a field of the section it is in
(section aliases such as ``async`` included); a dict-valued field (``rewards``, ``agent.options``)
takes any further parts; a scalar or list field must be the last part.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from molt_core.config import RunConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["coming_from_trl.md", "coming_from_verl.md"]
KEY_COLUMN = "molt-sdk `--set` key"


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


def resolve(key: str) -> str | None:
    """None when ``key`` (``section.field[.sub...]``, or a top-level field) names a RunConfig
    field; else the reason it does not."""
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
            return None
        models = _models_in(field.annotation)
        if not models:
            return f"{key}: {'.'.join(parts[:i + 1])} is a {field.annotation} option, it has no sub-key {rest[0]!r}"
        model = models[0]
    return None


def keys_in_tables(text: str) -> list[str]:
    """The backticked keys in the KEY_COLUMN column of every table of a Markdown page (the part
    before ``=`` of ``key=value``); "—" cells hold none.

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
        keys += [k.split("=", 1)[0].strip() for k in found]
    return keys


@pytest.mark.parametrize("page", PAGES)
def test_every_mapped_key_exists_in_runconfig(page):
    keys = keys_in_tables((DOCS / page).read_text())
    assert len(keys) >= 40, f"{page}: only {len(keys)} keys parsed; the table header must be '{KEY_COLUMN}'"
    bad = [r for k in keys if (r := resolve(k)) is not None]
    assert bad == [], f"{page} maps to keys RunConfig does not define:\n" + "\n".join(bad)


def test_a_misspelt_or_too_deep_key_is_flagged():
    page = (f"| theirs | {KEY_COLUMN} | notes |\n|---|---|---|\n"
            "| `lr` | `trainer.lrr` | misspelt field |\n"
            "| `n` | `rollout.n_samples_per_prompt=8` | fine |\n"
            "| `x` | `trainer.lr.value` | a float has no sub-key |\n"
            "| `y` | `sampling.temperature` | no such section |\n"
            "| `w` | `rewards.<name>.weight`, `async.max_staleness`, `trainer.lora.r` | fine |\n"
            "| `z` | — | no equivalent |\n")
    keys = keys_in_tables(page)
    assert keys == ["trainer.lrr", "rollout.n_samples_per_prompt", "trainer.lr.value", "sampling.temperature",
                    "rewards.<name>.weight", "async.max_staleness", "trainer.lora.r"]
    assert [resolve(k) for k in keys] == [
        "trainer.lrr: trainer has no field 'lrr'",
        None,
        "trainer.lr.value: trainer.lr is a <class 'float'> option, it has no sub-key 'value'",
        "sampling.temperature: RunConfig has no field 'sampling'",
        None, None, None,
    ]


def test_a_key_cell_without_a_key_is_refused():
    with pytest.raises(ValueError, match="holds no backticked key"):
        keys_in_tables(f"| theirs | {KEY_COLUMN} |\n|---|---|\n| `beta` | kl_coef |\n")


@pytest.mark.parametrize("page", PAGES)
def test_a_wrong_key_written_into_the_real_page_is_flagged(page):
    text = (DOCS / page).read_text()
    assert "`trainer.lr`" in text
    keys = keys_in_tables(text.replace("`trainer.lr`", "`trainer.learning_rate`", 1))
    assert [r for k in keys if (r := resolve(k)) is not None] == [
        "trainer.learning_rate: trainer has no field 'learning_rate'"]
