"""``dataset`` env: train on your own rows -- a JSONL or Parquet file, a local Hugging Face
dataset directory, a Hub dataset name, or a dataset shipped with molt (``builtin:NAME``).

Each row becomes one single-turn task. The prompt is the row's ``prompt_field``, or the
``template`` rendered with the row's fields (``str.format``: ``"Q: {question}"``), or the
chat messages in ``messages_field``; the gold answer is ``answer_field``. The task dict holds
the row's own fields plus ``question`` (the rendered prompt), ``answer`` (``str``), ``row``
(the row's index in its split) and, with ``messages_field``, ``messages``. A reply is scored
by exact match against the answer (``scorer = "exact"``), or -- with ``scorer = "none"`` -- by
the recipe's ``[rewards.NAME]`` plugins alone, which read ``task["answer"]`` (and any other
row field) the usual way; eval pass@1 then counts a rollout whose total reward is >= 1.

Splits. The train rows are ``split`` of ``path``. The held-out rows are ``eval_split`` of
``eval_path`` (default ``path``) when either is set; otherwise a fixed ``eval_fraction`` of the
train rows, chosen with ``random.Random(split_seed)`` (independent of the run seed, so a
checkpoint evaluated later sees the same eval rows). Eval tasks keep their source order.
Train rows whose prompt is also an eval prompt are dropped, so the splits are disjoint.

Epochs. ``tasks("train", seed)`` yields passes over the train rows, each in a fresh order
(``random.Random(seed + epoch)``; ``shuffle = false`` keeps file order): endlessly by default,
or exactly ``epochs`` passes -- then the run refuses, before any compute, to need more
(:func:`molt_core.rollout.tasks.check_train_split`).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt_core.agents import EpisodeState, Env
from molt_core.rollout.datafiles import Format, load_rows
from molt_core.types import Result

__all__ = ["DatasetEnv", "DatasetOptions", "strip_end_markers"]

_ROLES = ("system", "user", "assistant", "tool")


def strip_end_markers(text: str, suffixes: list[str]) -> str:
    """``text`` whitespace-stripped, with any of ``suffixes`` (end-of-turn markers such as
    ``<|im_end|>``) removed from its end, repeatedly, each removal followed by a right strip."""
    s = text.strip()
    changed = True
    while changed:
        changed = False
        for suf in suffixes:
            if suf and s.endswith(suf):
                s, changed = s[: -len(suf)].rstrip(), True
    return s


class DatasetOptions(BaseModel):
    """Options of the ``dataset`` env (the recipe's ``[agent.options]``).

    * ``path`` -- the train source: ``builtin:NAME``, a ``.jsonl`` / ``.parquet`` file, a
      directory (``save_to_disk`` output, or ``SPLIT.jsonl`` files), or a Hub dataset name;
      ``format`` forces ``jsonl`` / ``parquet`` / ``hf``; ``config`` is a Hub configuration name.
    * ``split`` -- the train split of a directory or Hub dataset (default ``train``).
    * ``eval_path`` / ``eval_split`` -- where the held-out rows are (``eval_path`` defaults to
      ``path``; ``eval_split`` to ``split`` when only ``eval_path`` is given).
    * ``eval_fraction`` -- with neither set: this fraction of the train rows (at least one row)
      is held out, chosen with ``split_seed``. ``eval_size`` caps the eval rows (first N).
    * ``prompt_field`` (default ``prompt``), ``template`` (``{field}`` placeholders over the
      row) or ``messages_field`` (a list of ``{"role", "content"}`` messages; a trailing
      assistant message is dropped from the prompt and is the answer when the row has no
      ``answer_field``) -- where the prompt comes from; ``template`` wins over ``prompt_field``.
    * ``answer_field`` -- the gold answer (``""``: rows need none; ``scorer`` must be ``none``).
    * ``system_prompt`` -- optional system message before the prompt.
    * ``epochs`` -- passes over the train rows (None: endless); ``shuffle`` -- reorder each pass.
    * ``scorer`` -- ``exact``: reward = score = 1.0 when the reply, stripped of whitespace
      and of ``strip_suffixes``, equals the stripped answer, else 0.0; ``none``: reward 0 and no
      score, leaving it to ``[rewards.*]`` plugins.
    """

    model_config = ConfigDict(extra="forbid")

    path: str
    format: Format = "auto"
    config: str | None = None
    split: str = "train"
    eval_path: str | None = None
    eval_split: str | None = None
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    eval_size: int | None = Field(None, ge=1)
    split_seed: int = 0
    prompt_field: str = "prompt"
    template: str | None = None
    messages_field: str | None = None
    answer_field: str = "answer"
    system_prompt: str | None = None
    epochs: int | None = Field(None, ge=1)
    shuffle: bool = True
    scorer: Literal["exact", "none"] = "exact"
    strip_suffixes: list[str] = Field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])

    @model_validator(mode="after")
    def _one_prompt_source(self) -> "DatasetOptions":
        if self.messages_field and self.template:
            raise ValueError("set either messages_field (chat rows) or template (text rows), not both")
        if not self.answer_field and self.scorer == "exact":
            raise ValueError("scorer = 'exact' compares the reply with answer_field; set answer_field, "
                             "or scorer = 'none' with a [rewards.NAME] table")
        return self


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` as plain JSON types (Parquet/Arrow values such as dates become strings)."""
    return json.loads(json.dumps(row, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


class DatasetEnv(Env):
    """Single-turn env over the rows of a dataset (see the module docstring).

    All rows are read and checked at construction, so a bad row fails the run before any
    compute with its split, 1-based row number and the field at fault.

    Raises (at construction):
        ValueError: unreadable source (:func:`molt_core.rollout.datafiles.load_rows`), an empty split,
            a row without the prompt / answer field, a template naming a missing field,
            malformed chat messages, or no train row left once eval prompts are removed.
    """

    Options = DatasetOptions
    options: DatasetOptions
    molt_example = {"options": {"path": "builtin:chain_sum", "eval_split": "test", "template": "What is {expression}?"}}
    """Options for ``molt plugins --check`` (``path`` has no default)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        o = self.options
        self.repeat_train_split = o.epochs is None  # type: ignore[misc]  # instance override of the class default
        train_rows = load_rows(o.path, o.split, o.format, o.config, what="agent.options.path")
        if o.eval_path is None and o.eval_split is not None and Path(o.path).is_file():
            raise ValueError(f"agent.options.eval_split = {o.eval_split!r}: agent.options.path = {o.path!r} is one file, "
                             f"which has no splits (its eval split would be every train row). Hold rows out with "
                             f"agent.options.eval_fraction instead (recipe examples/dataset does: molt run examples/dataset "
                             f"--set agent.options.path=FILE), or give the held-out rows as agent.options.eval_path")
        if o.eval_path is not None or o.eval_split is not None:
            where = "agent.options.eval_path" if o.eval_path is not None else "agent.options.eval_split"
            eval_rows = load_rows(o.eval_path or o.path, o.eval_split or o.split, o.format, o.config, what=where)
            eval_idx = list(range(len(eval_rows)))
            train_idx = list(range(len(train_rows)))
        else:
            if not train_rows:
                raise ValueError(f"agent.options.path = {o.path!r}: split {o.split!r} has no rows")
            k = max(1, math.ceil(o.eval_fraction * len(train_rows)))
            if k >= len(train_rows):
                raise ValueError(f"agent.options.eval_fraction = {o.eval_fraction:g} of {len(train_rows)} rows leaves no "
                                 f"train row; add rows, lower eval_fraction, or set eval_path / eval_split")
            perm = list(range(len(train_rows)))
            random.Random(o.split_seed).shuffle(perm)
            eval_idx, train_idx = sorted(perm[:k]), sorted(perm[k:])
            eval_rows = train_rows
        if o.eval_size is not None:
            eval_idx = eval_idx[: o.eval_size]
        self._eval = [self._task(eval_rows[i], i, "eval") for i in eval_idx]
        if not self._eval:
            raise ValueError(f"agent.options.eval_split: the eval split of {o.eval_path or o.path!r} has no rows")
        held_out = {self._key(t) for t in self._eval}
        train = [self._task(train_rows[i], i, "train") for i in train_idx]
        self._train = [t for t in train if self._key(t) not in held_out]
        self.dropped_overlap = len(train) - len(self._train)
        if not self._train:
            raise ValueError(f"agent.options.path = {o.path!r}: split {o.split!r} has no train rows"
                             + (f" once the {self.dropped_overlap} whose prompt is also an eval prompt are removed"
                                if self.dropped_overlap else ""))

    # -- rows -> tasks -------------------------------------------------------------------------
    @staticmethod
    def _key(task: dict[str, Any]) -> str:
        """What makes two prompts the same: the rendered question, or the chat messages."""
        return json.dumps(task["messages"], sort_keys=True) if "messages" in task else str(task["question"])

    def _task(self, row: dict[str, Any], i: int, split: str) -> dict[str, Any]:
        """The task dict of row ``i`` of ``split`` (see the module docstring).

        Raises:
            ValueError: the row lacks a field the options name (row number 1-based).
        """
        o = self.options
        where = f"{split} row {i + 1}"
        task = _jsonable(row)
        answer = row.get(o.answer_field) if o.answer_field else None
        if o.messages_field:
            msgs = row.get(o.messages_field)
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in msgs):
                raise ValueError(f"agent.options.messages_field = {o.messages_field!r}: {where} has "
                                 f"{'no such field' if msgs is None else 'no list of {role, content} messages'}; "
                                 f"fields: {sorted(row)}")
            for j, m in enumerate(msgs, 1):  # a null or non-text content would be sent as the text "None" / a repr
                if m["role"] not in _ROLES or not isinstance(m["content"], str):
                    what = (f"role {m['role']!r} (one of {', '.join(_ROLES)})" if m["role"] not in _ROLES
                            else f"content of type {type(m['content']).__name__} (a string)")
                    raise ValueError(f"agent.options.messages_field = {o.messages_field!r}: {where}, message {j} has "
                                     f"{what}")
            if not any(m["role"] == "user" for m in msgs):
                raise ValueError(f"agent.options.messages_field: {where} has no user message; a prompt needs one")
            msgs = [{"role": m["role"], "content": m["content"]} for m in _jsonable({"m": msgs})["m"]]
            if msgs[-1]["role"] == "assistant":
                last = msgs.pop()
                if answer is None:
                    answer = last["content"]
            if not msgs:
                raise ValueError(f"agent.options.messages_field: {where} holds only an assistant message; "
                                 f"a prompt needs a user message")
            task["messages"] = msgs
            question = str(next((m["content"] for m in reversed(msgs) if m["role"] == "user"), msgs[-1]["content"]))
        elif o.template is not None:
            try:
                question = o.template.format(**row)
            except (KeyError, IndexError, AttributeError) as e:
                raise ValueError(f"agent.options.template {o.template!r} refers to {e.args[0]!r}, which {where} "
                                 f"lacks; fields: {sorted(row)}") from None
            except ValueError as e:  # a malformed format string ("{q", a stray "}")
                raise ValueError(f"agent.options.template {o.template!r} is not a valid format string ({e}); "
                                 f"fields are {{name}}, a literal brace is {{{{ or }}}}") from None
        else:
            if o.prompt_field not in row:
                raise ValueError(f"agent.options.prompt_field = {o.prompt_field!r}: {where} has no such field; "
                                 f"fields: {sorted(row)} (set prompt_field, template or messages_field)")
            question = str(row[o.prompt_field])
        if o.answer_field and answer is None:
            what = "a null value" if o.answer_field in row else "no such field"
            raise ValueError(f"agent.options.answer_field = {o.answer_field!r}: {where} has {what}; "
                             f"fields: {sorted(row)} (set answer_field, or answer_field = '' with scorer = 'none')")
        task.update(question=question, answer=None if answer is None else str(answer), row=i)
        return task

    # -- Env API -------------------------------------------------------------------------------
    def tasks(self, split: str, seed: int) -> Iterator[dict[str, Any]]:
        """Yield task dicts of ``split``.

        ``"train"``: passes over the train rows, pass ``e`` in the order of
        ``random.Random(seed + e)`` (file order without ``shuffle``): ``epochs`` passes, or
        endless. ``"eval"``: the held-out tasks in source order, once (independent of ``seed``).

        Raises:
            ValueError: a split other than ``train`` / ``eval``.
        """
        if split == "eval":
            yield from (dict(t) for t in self._eval)
            return
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        epoch = 0
        while self.options.epochs is None or epoch < self.options.epochs:
            order = list(range(len(self._train)))
            if self.options.shuffle:
                random.Random(seed + epoch).shuffle(order)
            for i in order:
                yield dict(self._train[i])
            epoch += 1

    def reset(self, task: dict[str, Any]) -> str:
        """The user message: the task's rendered ``question``."""
        return str(task["question"])

    def first_messages(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The row's chat ``messages`` (after the ``system_prompt``, if any) with
        ``messages_field``; else the system prompt and the question (:meth:`Env.first_messages`)."""
        if "messages" not in task or not self.options.messages_field:
            return super().first_messages(task)
        sp = self.options.system_prompt
        return ([{"role": "system", "content": sp}] if sp else []) + [dict(m) for m in task["messages"]]

    def clean_reply(self, action_text: str) -> str:
        """The reply as compared: whitespace-stripped, trailing ``strip_suffixes`` removed."""
        return strip_end_markers(action_text, self.options.strip_suffixes)

    def step(self, action_text: str, state: EpisodeState) -> Result:
        """Score the single reply (``scorer``); the episode ends (``terminated=True``)."""
        if self.options.scorer == "none":
            return Result(reward=0.0, score=None, terminated=True, info={})
        ok = self.clean_reply(action_text) == str(state.task["answer"]).strip()
        return Result(reward=1.0 if ok else 0.0, score=1.0 if ok else 0.0, terminated=True, info={})

